"""The process that sends a rank's replicas, where asked (``DCP_DATASTATES_REPLICA_SENDER=process``):
``ReplicaWork`` out of the training process.

Sending, receiving, hashing and storing replicas is background work, but run on a thread of the
training process it shares that process's interpreter lock with training: each time the thread
wakes from a socket or a disk it takes the lock, and a training thread that takes it back
between every operator may wait.  A helper process per rank keeps that work off training's
lock and, at the lowest CPU priority (``SCHED_IDLE``, else ``nice`` 19, set before any of its
threads start, so gloo's threads inherit it), behind training on the cores.  It costs a process
per rank (about 230 MB of private memory, mostly torch's own); measured against each run's own
quiet steps it adds a third of what the thread adds to the stall, but neither meets the
target on this machine (``docs/benchmarks.md``), so the thread, which costs no process, stays
the default.

The helpers of a replica group form a gloo world of their own, met through the job's own
``TCPStore`` (the default process group's, under a prefix of their own), so it needs nothing a
launcher does not already provide.  The training process hands each helper its work over a
pipe, one call at a time, and gets back what ``ReplicaWork`` returns, or the exception it
raised, with the log records of the call, which it hands to its own loggers (so they reach
the job's log as if the work had run in it).  A helper ends when its training process does: a
second pipe, never written, reads end-of-file then, even while the helper waits in a
collective.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import threading
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from .group import ReplicaGroup, job_store
from .work import ReplicaPeers, ReplicaWork

log = logging.getLogger(__name__)

SENDER_ENV = "DCP_DATASTATES_REPLICA_SENDER"  # "process": a helper process sends; else a thread


def store_address() -> tuple[str, int] | None:
    """Where the default process group's ``TCPStore`` listens, or None (another kind of store)."""
    store = job_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


def helper_possible() -> bool:
    """Whether this process should start a helper: asked to (``DCP_DATASTATES_REPLICA_SENDER=
    process``), not a daemonic process (DCP's checkpoint process, which is not training's),
    with a ``TCPStore`` to meet through."""
    if os.environ.get(SENDER_ENV, "thread") != "process":
        return False
    if multiprocessing.current_process().daemon:
        return False
    return store_address() is not None


class HelperProcess:
    """A rank's helper, started at once; its calls block the calling thread (the replicator's)
    until the helper answers.  The first call also waits for the helper's group to form."""

    def __init__(self, peers: ReplicaPeers, prefix: str) -> None:
        address = store_address()
        if address is None:
            raise RuntimeError("replica helpers meet through the default group's TCPStore")
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._alive, child_alive = ctx.Pipe()
        self._proc = ctx.Process(target=_main, args=(child, child_alive, peers, address, prefix),
                                 name=f"dcpds-replicas-{peers.rank}", daemon=True)
        self._proc.start()
        child.close()
        child_alive.close()
        self._ready = False
        self.broken = False  # the helper's group, as its last answer said

    def wait_ready(self) -> None:
        """Block until the helper is in its group (its peers' helpers too); RuntimeError when
        it did not start."""
        if self._ready:
            return
        try:
            tag, value = self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._gone() from e
        if tag != "ready":
            raise RuntimeError(f"the replica helper did not start: {value}")
        self._ready = True

    def _gone(self) -> RuntimeError:
        return RuntimeError(f"the replica helper (pid {self._proc.pid}) is gone: exit code {self._proc.exitcode}")

    def _call(self, method: str, *args):
        self.wait_ready()
        try:
            self._conn.send((method, args))
            tag, value, records, self.broken = self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._gone() from e
        for record in records:  # shown as the training process's loggers would show their own
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)
        if tag == "err":
            raise value
        return value

    def close(self) -> None:
        """End the helper: it reads end-of-file where it waits for the next call."""
        self._conn.close()
        self._alive.close()
        self._proc.join(30)

    def agree(self, *args):
        return self._call("agree", *args)

    def use_epoch(self, *args):
        return self._call("use_epoch", *args)

    def replicate_save(self, *args):
        return self._call("replicate_save", *args)

    def replicate(self, *args):
        return self._call("replicate", *args)


def _main(conn: Connection, alive: Connection, peers: ReplicaPeers, address: tuple[str, int], prefix: str
          ) -> None:
    _lowest_priority()  # before gloo starts its threads: they inherit it
    torch.set_num_threads(1)

    def watch() -> None:
        try:
            alive.recv()  # never sent: end-of-file when the training process is gone
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="dcpds-replicas-parent", daemon=True).start()
    records = _Records()
    root = logging.getLogger("dcp_datastates")
    root.addHandler(records)
    root.setLevel(logging.DEBUG)  # the training process's loggers decide what is shown
    root.propagate = False
    timeout = datetime.timedelta(seconds=peers.timeout_s)
    try:
        host, port = address
        store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=timeout))
        dist.init_process_group("gloo", store=store, rank=peers.me, world_size=len(peers.ranks), timeout=timeout)
        work = ReplicaWork(peers, ReplicaGroup(dist.group.WORLD, store, peers.timeout_s))
    except Exception as e:  # noqa: BLE001 - said to the training process, which logs it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        os._exit(1)
    conn.send(("ready", None))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        try:
            answer = ("ok", getattr(work, method)(*args))
        except Exception as e:  # noqa: BLE001 - raised again in the training process
            answer = ("err", RuntimeError(f"{type(e).__name__}: {e}"))  # as text: every failure is alike there
        conn.send((*answer, records.take(), work.broken))


def _lowest_priority() -> None:
    """Run only on a core training leaves idle: ``SCHED_IDLE`` where the kernel has it (a
    waking training thread always preempts it), else ``nice`` 19.  Safe here and not on a
    thread of the training process, where a preempted holder of the interpreter's lock would
    keep training waiting."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as e:
        log.debug("SCHED_IDLE refused (%s); nice 19 instead", e)
        os.nice(19)


class _Records(logging.Handler):
    """The log records of the call under way, made ready to cross the pipe."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._got: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = self.format(record), None  # formatted here: arguments may not pickle
        record.exc_info = record.exc_text = None
        self._got.append(record)

    def take(self) -> list[logging.LogRecord]:
        got, self._got = self._got, []
        return got

