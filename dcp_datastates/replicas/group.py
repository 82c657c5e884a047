"""The replica group: the members that replicate to one another, over a gloo process group of
their own, each addressed by its place in it; made again, under a new epoch, after it broke.

Why it breaks, and why it must be made again: when an operation waits past the group's timeout
(a peer that hangs alive: a stuck disk, a stopped process), gloo closes the pair of connections
it waited on, and every later operation over that pair fails at once.  A group left so would
degrade the replicas of every later step for the rest of the job.  So every failed operation
marks the group ``broken``, and each save says so when it is planned (``ReplicaVote``, in the
rank's local plan): the coordinator gives the save a new epoch when some rank's group is broken
and every rank's replication is idle (``decide_epoch``), and every rank makes the group again
under that epoch before it replicates that save.  Only then: a rank still busy (the one that
hung, catching up) would meet its peers' new group only after they gave up waiting for it.

A group is made from the job's own store, under a prefix of its own and the epoch, as a
``ProcessGroupGloo`` held here (not registered with ``torch.distributed``, so making one is no
collective of the job's and needs no other rank than the members): the first one may also be
a group ``dist.new_group`` made.  Its objects travel pickled, as ``dist.all_gather_object``
sends them, only between the job's own ranks and never read from storage; and what arrives is
unpickled into Python's plain types and this library's records only (``_PeerObjects``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import io
import logging
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaVote:
    """What a rank says of its replica group when a save is planned (its local plan's
    ``storage_data``)."""

    epoch: int  # the newest epoch this rank was given
    broken: bool  # an operation of its group failed since that group was made
    idle: bool  # nothing to replicate is queued or running


def decide_epoch(votes: list) -> int | None:
    """The epoch of a save, from every rank's vote: a new one when some rank's group is broken
    and every rank is idle, else the newest given; None when a rank did not vote (no replicas,
    or a planner that drops local plans' ``storage_data``)."""
    if not votes or not all(isinstance(v, ReplicaVote) for v in votes):
        return None
    epoch = max(v.epoch for v in votes)
    if any(v.broken for v in votes) and all(v.idle for v in votes):
        epoch += 1
    return epoch


def job_store() -> dist.Store:
    """The store of the job's default process group."""
    return dist.distributed_c10d._get_default_store()


class ReplicaGroup:
    """The members of a replica group, member ``i`` the process group's rank ``i``.  Every
    operation that fails marks the group ``broken`` and raises; ``remake`` makes it again."""

    def __init__(self, pg, store: dist.Store | None, timeout_s: float) -> None:
        # a ProcessGroup, or a ProcessGroupGloo held here (whose pybind methods the stubs lack)
        self.pg: Any = pg
        self.store, self.timeout_s = store, timeout_s
        self.size, self.me = pg.size(), pg.rank()
        self.epoch = 0
        self.broken = False

    def remake(self, epoch: int) -> None:
        """Make the group again under ``epoch`` (every member does, at the same save).  Where
        it cannot be made in time the old one stays, still broken, and the epoch is spent: a
        later save asks for a new one."""
        self.epoch = epoch
        if self.store is None:
            log.warning("replica group: no store to make epoch %d from; it stays broken", epoch)
            self.broken = True
            return
        try:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"epoch-{epoch}/", self.store), self.me, self.size,
                                            datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:  # a member not there in time: the old group stays, broken
            log.warning("replica group: epoch %d could not be made (%s); its replicas are degraded", epoch, e)
            self.broken = True
            return
        self.broken = False
        log.info("replica group made again (epoch %d, member %d of %d)", epoch, self.me, self.size)

    @contextlib.contextmanager
    def _failing(self):
        try:
            yield
        except RuntimeError:  # gloo: a timeout, or a pair closed by a peer that timed out or died
            self.broken = True
            raise

    def exchange(self, out: torch.Tensor | None, dst: int, into: torch.Tensor | None, src: int) -> None:
        """Send ``out`` to member ``dst`` and receive ``into`` from member ``src``, at once."""
        with self._failing():
            works = []
            if out is not None:
                works.append(self.pg.send([out], dst, 0))
            if into is not None:
                works.append(self.pg.recv([into], src, 0))
            for w in works:
                w.wait()

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.exchange(t, dst, None, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.exchange(None, src, t, src)

    def all_gather_object(self, obj) -> list:
        """Every member's ``obj``, by member."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        with self._failing():
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
            self.pg.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.int64)]).wait()
            most = max(int(s.item()) for s in sizes)
            padded = torch.zeros(most, dtype=torch.uint8)
            padded[:data.numel()] = data
            got = [torch.empty(most, dtype=torch.uint8) for _ in range(self.size)]
            self.pg.allgather([got], [padded]).wait()
        return [_objects(g[:int(s.item())].numpy().tobytes()) for g, s in zip(got, sizes)]

    def broadcast_object(self, obj, src: int):
        """Member ``src``'s ``obj``, on every member."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        with self._failing():
            n = torch.tensor([data.numel()], dtype=torch.int64)
            self.pg.broadcast([n], _root(src)).wait()
            buf = data if self.me == src else torch.empty(int(n.item()), dtype=torch.uint8)
            self.pg.broadcast([buf], _root(src)).wait()
        return obj if self.me == src else _objects(buf.numpy().tobytes())

    def all_reduce_min(self, t: torch.Tensor) -> None:
        """``t`` becomes the element-wise minimum over the members."""
        self._all_reduce(t, dist.ReduceOp.MIN)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        """``t`` becomes the element-wise maximum over the members."""
        self._all_reduce(t, dist.ReduceOp.MAX)

    def _all_reduce(self, t: torch.Tensor, op) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        with self._failing():
            self.pg.allreduce([t], opts).wait()

    def barrier(self) -> None:
        self.all_reduce_min(torch.zeros(1, dtype=torch.int64))


def _root(src: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return opts


class _PeerObjects(pickle.Unpickler):
    """Unpickles what a member sent: Python's plain types and this library's records (its
    dataclasses and enums, named directly by their module), nothing else: no function, and no
    other class, of the library or of any module, is looked up, so no code runs from it."""

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _PLAIN:
            return super().find_class(module, name)
        if (module == "dcp_datastates" or module.startswith("dcp_datastates.")) and "." not in name:
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise pickle.UnpicklingError(f"a replica group member sent a {module}.{name}, which is not one of "
                                     "the objects members exchange")


_PLAIN = frozenset({"set", "frozenset", "bytearray", "complex", "range", "slice"})


def _objects(data: bytes):
    return _PeerObjects(io.BytesIO(data)).load()
