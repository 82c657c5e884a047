"""Run a function on N gloo ranks on 127.0.0.1 (real process groups, no mocks)."""

from __future__ import annotations

import faulthandler
import multiprocessing.connection as mpc
import os
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STACKS = []  # the file a rank's stacks go to, kept open for faulthandler


def _entry(rank, world, port, fn, args, errq, stacks):
    import datetime

    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    # one intra-op thread a rank, as torchrun sets for several ranks a node: the ranks share
    # this machine's few cores, where idle OpenMP workers spinning would take them from others
    torch.set_num_threads(1)
    # a rank that hangs writes every thread's stack when ``run_ranks`` gives up on it
    _STACKS.append(open(stacks, "w"))
    faulthandler.register(HANG_SIGNAL, file=_STACKS[-1], all_threads=True)
    # The parent owns the rendezvous store (bound to port 0 by the OS): no port race.
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        try:
            dist.barrier()
        except Exception:
            pass
        dist.destroy_process_group()
    # The work and its assertions are done. Skip interpreter teardown: with FSDP2 on gloo it
    # intermittently aborts in native code ("terminate called without an active exception").
    # torch alone does it too (scripts/teardown_abort_repro.py: no dcp-datastates involved).
    # DCPDS_TEST_NORMAL_EXIT=1 keeps the normal teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("DCPDS_TEST_NORMAL_EXIT") != "1":
        os._exit(0)


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "torch.distributed.tensor", "dcp_datastates", "tests.dist", "tests.workers",
            "tests.frozen"]  # last: it freezes what the others made


def _context():
    """Ranks start from a fork server that imported torch and the library once: each rank of
    each test forks from it instead of importing torch again (about 2 s a start on 2 cores).
    The server imports only, then freezes what it imported (``tests/frozen.py``); it never starts
    a process group or touches a device.  A rank
    starts from the server's state, not the test's: what a test changes in its own process
    (environment variables, monkeypatches) reaches its ranks only through ``fn``'s arguments."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_in_process(fn, *args, timeout: float = 120) -> int | None:
    """``fn(*args)`` in one process forked from the fork server (no thread started yet, as a
    trainer's process is at its start); its exit code, or None where it ran past ``timeout``
    (killed then)."""
    p = _context().Process(target=fn, args=args)
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return None
    return p.exitcode


FAILED_GRACE_S = 20.0
HANG_SIGNAL = signal.SIGUSR2


def _in_collective(stacks: str) -> bool:
    """Whether one of the threads in a faulthandler dump waits in a ``torch.distributed``
    collective (its innermost frame is in ``distributed_c10d.py``)."""
    innermost = [lines[1] for block in stacks.split("\n\n")
                 if len(lines := block.strip().splitlines()) > 1 and "(most recent call first)" in lines[0]]
    return any("torch/distributed/distributed_c10d.py" in line for line in innermost)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended meanwhile
        pass


def run_ranks(world: int, fn, *args, timeout: float = 240, after_death: float | None = None) -> None:
    """Spawn ``world`` processes running ``fn(rank, world, *args)``; re-raise the first failure.

    ``after_death``: once a rank has died without reporting a failure (a crash test's rank
    ended at its crash point), the others get that long; those still alive then whose threads
    wait in a ``torch.distributed`` collective (for the dead rank: gloo may never notice a peer
    that died in the middle of one) are killed, as a launcher ends a job whose rank died, and
    count as killed (exit code -SIGKILL).  A rank alive for another reason is a hang."""
    import datetime

    import torch.distributed as dist
    ctx = _context()
    errq = ctx.SimpleQueue()
    master = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                           timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    port = master.port
    with tempfile.TemporaryDirectory(prefix="dcpds-stacks-") as stacks:
        files = [os.path.join(stacks, f"rank-{r}") for r in range(world)]
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, errq, files[r]), daemon=False)
                 for r in range(world)]
        for p in procs:
            p.start()
        # all ranks within ``timeout``; once one reported a failure, the others get ``FAILED_GRACE_S``
        # to end (they may wait in a collective for the failed one: it would take their timeout)
        deadline, errors, died = time.monotonic() + timeout, [], False
        while (alive := [p for p in procs if p.is_alive()]) and time.monotonic() < deadline:
            mpc.wait([p.sentinel for p in alive], timeout=1.0)
            while not errq.empty():
                errors.append(errq.get())
            if errors:
                deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
            elif after_death is not None and not died and any(p.exitcode not in (None, 0) for p in procs):
                died, deadline = True, min(deadline, time.monotonic() + after_death)
        hung = [procs.index(p) for p in alive]
        waiting = {}
        for p in alive:  # where each stands, before it is killed
            _signal(p.pid, HANG_SIGNAL)
            time.sleep(0.5)  # its dump written
            r = procs.index(p)
            waiting[r] = _in_collective(said := open(files[r]).read())
            print(f"[rank {r}] alive past the deadline; its threads:\n{said}", file=sys.stderr, flush=True)
        for p in alive:
            p.kill()
            p.join()
    while not errq.empty():
        errors.append(errq.get())
    if errors:
        rank, tb = sorted(errors)[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if alive and not (died and all(waiting.values())):
        raise AssertionError(f"{len(alive)} ranks hung past {timeout}s (ranks {hung}: their stacks are on stderr)")
    if alive:
        print(f"ranks {hung} waited in a collective after a rank died: killed, as a launcher would",
              file=sys.stderr, flush=True)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")
