"""``NodeCopies``: what ``Checkpointer`` does per node when its first tier is node-local: the
manifest the coordinator committed on its own node committed here too, with ``replicas`` this
rank's files of each step sent on to its peers' nodes (``replicas/work.py``), and before a
restore this node's directory of the step given what its ranks read from the others
(``replicas/repair.py``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from .. import process_state
from ..errors import CheckpointError
from ..format.records import CommittedSave
from ..tiers import StorageTier
from ..tiers.base_lock import BaseHold
from ..tiers.manifests import load_manifest, manifest_head
from .group import ReplicaVote
from .records import ReplicaRecord, read_record
from .repair import NodeRepair
from .replicator import Replicator
from .work import commit_on_node

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnownSave:
    """A step ``Checkpointer`` committed: the save and the other steps it references."""

    step: int
    save_id: str
    homes: frozenset[str]  # step directories holding files it references (``Manifest.homes``)


class NodeCopies:
    """This node's copy of each step of a run whose first tier is node-local: the manifest the
    coordinator committed on its own node, committed here too; with ``replicas``, this rank's
    files of the step sent on to its peers' nodes (``Replicator``); before a restore, this
    node's directory of the step given what its ranks read (``repair``, ``NodeRepair``).
    ``tier_of(step)``: the step's node-local directory."""

    def __init__(self, tier_of: Callable[[int], StorageTier], replicas: int = 0, pg=None,
                 node: str | None = None) -> None:
        self.tier_of, self.pg = tier_of, pg
        self.replicator: Replicator | None = None
        if replicas:
            if not process_state.group_up():
                raise ValueError("replicas travel over torch.distributed: call dist.init_process_group first")
            self.replicator = Replicator(replicas, pg, node)  # a collective: every rank
        self._lock = threading.Lock()
        self._done: set[tuple[int, str]] = set()  # (step, save) this node committed
        self._replicating: dict[int, Future] = {}
        self._holds: dict[int, BaseHold] = {}  # step -> its base's locks, until committed here

    def hold_base(self, step: int, base: int, known: KnownSave | None) -> str | None:
        """Before ``step`` is saved incremental on step ``base``: hold, shared, the base lock
        of this node's directory of ``base`` and of those it references, until this node
        commits ``step`` or its save fails (the caller's ``let_go``).  The rank's own hold
        ends with its part of the save, before its node commits (``base_lock.py``).  The save
        id held (the writer references no other: ``incremental_base_save_id``); None where
        the base is being changed here or cannot be read: write ``step`` in full.  ``known``:
        the base as this process committed it (its references then need no read)."""
        self.let_go(step)
        hold, t = BaseHold(), self.tier_of(base)
        try:
            if hold.take(t) and (head := manifest_head(t)) is not None:
                homes = (known.homes if known is not None and known.step == base and known.save_id == head.save_id
                         else frozenset(load_manifest(t).homes.values()))
                if all(hold.take(t.sibling(h)) for h in sorted(homes)):
                    with self._lock:
                        self._holds[step] = hold
                    return head.save_id
            log.info("step %d: its base, step %d, is being changed on this node; writing it in full", step, base)
        except (CheckpointError, OSError) as e:
            log.warning("step %d: its base, step %d, cannot be read on this node (%s); writing it in full",
                        step, base, e)
        hold.release()
        return None

    def let_go(self, step: int) -> None:
        """The base locks held for ``step`` (``hold_base``) go: it committed here, or failed."""
        with self._lock:
            hold = self._holds.pop(step, None)
        if hold is not None:
            hold.release()

    def committed(self, step: int, committed: CommittedSave) -> None:
        """Step ``step`` committed as ``committed``: commit it on this node, where it replaces
        an older save of the step and removes what that save and the dead attempts it took over
        wrote here (``commit_on_node``), and start its replication.  Called when an async
        save's future completes and again from the next wait; the second call finds it done."""
        with self._lock:
            if (step, committed.save_id) in self._done:
                return
            self._done.add((step, committed.save_id))
            t = self.tier_of(step)
            t.makedirs()
            commit_on_node(t, committed)
            if self.replicator is not None:
                self._replicating[step] = self.replicator.submit(t, step, committed.save_id,
                                                                      committed.replica_epoch)

    def close(self) -> None:
        """After ``wait``: the replicator's thread and helper end."""
        for step in list(self._holds):
            self.let_go(step)
        if self.replicator is not None:
            self.replicator.close()

    def record(self, step: int, timeout: float | None = None) -> ReplicaRecord:
        """This rank's replica record of ``step``, once its replication ended."""
        return self._replicating[step].result(timeout)

    def busy(self) -> set[int]:
        """Steps whose replication has not ended: retention keeps them."""
        return {step for step, fut in self._replicating.items() if not fut.done()}

    def newest_replicated(self, steps: list[int]) -> int | None:
        """The newest of ``steps`` (committed on this node) that every rank of this node has
        fully replicated, by their records in the node's directory: retention keeps it, so that
        a node lost while newer steps replicate leaves a step its peers hold.  Every rank of
        the node reads the same records, so every purge of the directory keeps the same step
        (or a newer one, once its records are complete)."""
        if self.replicator is None:
            return None
        local = self.replicator.node_ranks()
        for step in sorted(steps, reverse=True):
            t = self.tier_of(step)
            head = manifest_head(t)
            if head is None:
                continue
            recs = [read_record(t, r, head.save_id) for r in local]
            if all(rec is not None and rec.complete for rec in recs):
                return step
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every step so far is replicated; False when one ended degraded."""
        ok = True
        for step, fut in sorted(self._replicating.items()):
            try:
                ok = fut.result(timeout).complete and ok
            except (RuntimeError, OSError, CheckpointError) as e:
                log.warning("step %d: replication failed: %s", step, e)
                ok = False
        return ok

    def restore_vote(self) -> ReplicaVote | None:
        """What this rank says of its replica group as a restore starts (``Replicator.restore_vote``,
        after its replications under way); None without replicas."""
        return None if self.replicator is None else self.replicator.restore_vote("the restore")

    def repair(self, step: int, save_id: str | None, votes: list | None = None) -> NodeRepair | None:
        """Before restoring ``step``: the repair of this node's directory of it, which the
        load's reader finishes once its ranks know what they read (``NodeRepair``); None
        without replicas.  ``votes``: every rank's ``restore_vote``, gathered since the last
        replication (the repair then gathers none)."""
        if self.replicator is None:
            return None
        return NodeRepair(self.replicator, self.tier_of(step), f"step {step}", save_id, pg=self.pg, votes=votes)
