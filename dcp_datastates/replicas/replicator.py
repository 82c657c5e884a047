"""A rank's replicator: its saves queued in order, each replicated once it can be.

``Replicator`` is what writers, ``Checkpointer`` and repairs hold.  It is made by a collective
of the replica group's ranks (their nodes gathered, a gloo group of their own made for repairs
and for replication on a thread), and replicates one save at a time on a thread that waits for
the save's files and manifest.  The exchange itself (``ReplicaWork``) runs on that thread, or
in a helper process of this rank where asked (``replica_helper``).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import torch.distributed as dist
from torch.futures import Future as TorchFuture

from .. import process_state
from ..format.names import REPLICA_LOCK
from ..tiers.base_lock import BaseHold
from ..tiers.storage import StorageTier
from .group import ReplicaGroup, ReplicaVote, decide_epoch, job_store
from .helper import HelperProcess, helper_possible
from .order import GroupOrder
from .records import ReplicaRecord
from .work import NodeMap, ReplicaPeers, ReplicaWork, node_name

log = logging.getLogger(__name__)

TIMEOUT_ENV = "DCP_DATASTATES_REPLICA_TIMEOUT"  # seconds an operation of the replica group may wait

_T = TypeVar("_T")


@dataclass(frozen=True)
class SaveToReplicate:
    """One save of a plain ``DataStatesWriter(replicas=K)`` on this rank."""

    tier: StorageTier  # this node's directory of the checkpoint
    save_id: str
    written: TorchFuture  # DCP's future of this rank's writes: resolved once its files are durable
    manifest: Future | None  # the coordinator's: its ``CommittedSave``, or None (not committed)
    # the rank's shared base locks (``base_lock.py``), let go once this node's directory has the
    # manifest that names what the rank references there, or the save did not commit
    hold: BaseHold = field(default_factory=BaseHold)
    epoch: int | None = None  # the replica group's epoch the save was given (``PlannedSave``)


def default_timeout_s() -> float:
    """How long an operation of the replica group may wait for a peer:
    ``DCP_DATASTATES_REPLICA_TIMEOUT`` seconds, default 300."""
    return float(os.environ.get(TIMEOUT_ENV) or 300.0)


class Replicator:
    """Replicates each committed step of this rank, one step at a time, over a gloo group of
    its own (made here: a collective over ``pg``'s ranks), from a thread of this process, or a
    helper process where asked (``DCP_DATASTATES_REPLICA_SENDER=process``).  The group is made
    again, under a new epoch, where a save is given one (``replica_group.py``)."""

    def __init__(self, replicas: int, pg=None, node: str | None = None, timeout_s: float | None = None) -> None:
        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        nodes = NodeMap.gather(pg, node)
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
        first = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.group = ReplicaGroup(first, None, timeout_s)
        self.peers = ReplicaPeers(nodes, tuple(ranks), dist.get_rank(pg), replicas, nodes.usable(replicas),
                                  timeout_s)
        self._work: ReplicaWork | HelperProcess = ReplicaWork(self.peers, self.group)
        views = self.group.all_gather_object((helper_possible(), uuid.uuid4().hex))
        prefix = f"dcpds-replicas/{views[0][1]}/"
        # where this process's group is made again; a helper's under the prefix itself
        self.group.store = dist.PrefixStore(prefix + "here/", job_store())
        if self.peers.replicas and all(v[0] for v in views):  # a helper on every rank, or on none
            self._work = HelperProcess(self.peers, prefix)
        self.order = GroupOrder(self.group, self._work.use_epoch)  # the repair's too

    @property
    def in_helper(self) -> bool:
        """Whether the bytes are sent from a helper process (else from this process's thread)."""
        return isinstance(self._work, HelperProcess)

    def ready(self, timeout: float | None = None) -> bool:
        """Wait until the replicator can send (its helper started and in its group: a few
        seconds of one core after the replicator is made, overlapping whatever the job does
        meanwhile); False when it did not within ``timeout``."""
        try:
            return self.order.queue(self._ready).exception(timeout) is None
        except concurrent.futures.TimeoutError:
            return False

    def _ready(self) -> None:
        if isinstance(self._work, HelperProcess):
            self._work.wait_ready()

    def node_ranks(self) -> list[int]:
        """The global ranks on this rank's node (this one included)."""
        return self.peers.node_ranks()

    def vote(self) -> ReplicaVote:
        """This rank's vote, when a save is planned (``replica_group.decide_epoch``)."""
        epoch, idle = self.order.state()
        return ReplicaVote(epoch, self._work.broken, idle)

    def submit(self, tier: StorageTier, step: int, save_id: str, epoch: int | None = None) -> Future:
        """Replicate this rank's files of ``save_id`` in ``tier`` (the step's node-local
        directory, committed on every node); the future resolves to its ``ReplicaRecord``.
        From now until its replication ends the rank holds ``tier``'s replica lock shared, so
        no purge of the node's directory, whichever rank runs it, removes the files it sends
        and the copies it receives (``base_lock.py``: a purge skips a directory so held)."""
        hold = BaseHold(REPLICA_LOCK)
        if not hold.take(tier):
            log.info("%s is being removed; its replicas may be cut short", tier.url)

        def work() -> ReplicaRecord:
            try:
                return self._work.replicate(tier, f"step {step}", save_id)
            finally:
                hold.release()
        return self.order.queue(work, epoch)

    def submit_save(self, save: SaveToReplicate) -> Future:
        """A plain writer's save (``SaveToReplicate``), queued when DCP asks this rank for its
        data, so every rank queues its saves in DCP's order.  Once every rank's files are
        durable and the coordinator committed the manifest, the manifest is committed on this
        node too and this rank's files are replicated; the future resolves to its
        ``ReplicaRecord``, or None when the save did not commit (nothing is replicated)."""
        return self.order.queue(lambda: self._replicate_save(save), save.epoch)

    def agree_epoch(self, pg, label: str) -> int | None:
        """Before a restore's repair, on every rank of ``pg`` (the load's group: a collective
        over it, not over the replica group, which may be broken): the epoch the repair runs
        under, from every rank's ``restore_vote`` (``settle``)."""
        votes: list = [None] * dist.get_world_size(pg)
        dist.all_gather_object(votes, self.restore_vote(label), group=pg)
        return self.settle(votes)

    def restore_vote(self, label: str) -> ReplicaVote:
        """Before a restore's repair: this rank's replications ended, then what it says of the
        group repairs use.  Every rank's votes, gathered over the load's group (``agree_epoch``,
        or with what a restore gathers first: ``RunSteps.start_restore``), go to ``settle``."""
        self.order.in_turn(lambda: None, label)
        epoch, idle = self.order.state()
        return ReplicaVote(epoch, self.group.broken, idle)

    def settle(self, votes: list) -> int | None:
        """The epoch a restore's repair runs under, from every rank's ``restore_vote`` (the same
        list on every rank), decided as a save's is (``decide_epoch``): a new one where some
        rank's group broke (a peer hung), so that the repair makes the group again first rather
        than fail on it.  The next save is given no older one."""
        epoch = decide_epoch(votes)
        self.order.note_epoch(epoch)
        return epoch

    def close(self) -> None:
        """End after the work queued so far: the order's thread, and the helper with it."""
        self.order.close()
        if isinstance(self._work, HelperProcess):
            self._work.close()

    def _replicate_save(self, save: SaveToReplicate) -> ReplicaRecord | None:
        try:
            return self._agree_and_replicate(save)
        finally:  # committed on this node by now (``ReplicaWork.replicate_save``), or never
            save.hold.release()

    def _agree_and_replicate(self, save: SaveToReplicate) -> ReplicaRecord | None:
        try:
            save.written.wait()
            ok = True
        except Exception as e:  # noqa: BLE001 - the save failed on this rank; DCP raises it to the caller
            log.debug("%s: save %s failed on this rank (%s); it will not be replicated", save.tier.url,
                      save.save_id, e)
            ok = False
        coordinator = self._work.agree(save.tier, save.save_id, ok, save.manifest is not None)
        if coordinator is None:
            return None
        committed = None
        if save.manifest is not None:
            try:
                committed = save.manifest.result(self.peers.timeout_s)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                log.warning("%s: save %s was not committed within %.0f s; nothing replicated",
                            save.tier.url, save.save_id, self.peers.timeout_s)
        return self._work.replicate_save(save.tier, save.save_id, coordinator, committed)


_SHARED: dict[tuple, Replicator] = {}
_SHARED_LOCK = threading.Lock()


def _forget_replicators_in_child() -> None:
    """A forked child is no member of its parent's replica groups and has none of its threads."""
    global _SHARED_LOCK
    _SHARED_LOCK = threading.Lock()
    process_state.keep(dict(_SHARED))
    _SHARED.clear()


process_state.in_child(_forget_replicators_in_child)


def shared_replicator(replicas: int | None, pg=None, node: str | None = None) -> Replicator:
    """This process's replicator of ``replicas`` copies among ``pg``'s ranks (None: any number,
    for a repair), made on first use (a collective over them: every rank asks at the same point
    of its program, as writers made before each ``dcp.save`` do) and reused by every later
    writer or reader that asks alike."""
    ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else tuple(range(dist.get_world_size()))
    key = (replicas or 0, node or node_name(), ranks, dist.group.WORLD)  # a new job's group: a new one
    with _SHARED_LOCK:
        rep = _SHARED.get(key)
        if rep is None and replicas is None:
            rep = next((r for k, r in _SHARED.items() if k[1:] == key[1:]), None)
        if rep is None:
            rep = _SHARED[key] = Replicator(replicas or 0, pg, node)
        return rep
