"""``WriterReplicas``: what a ``DataStatesWriter`` does for peer replicas of its saves.

With ``replicas=K`` the writer queues each save on this process's replicator
(``replicas/replicator.py``) when DCP asks the rank for its data, and the coordinator hands the
committed save to it once it committed.  Whether or not the writer replicates itself, it carries
a replica group's vote in the rank's local plan and the epoch the coordinator decides from every
rank's vote in the global plan (``replicas/group.py``): a ``Checkpointer`` replicates its
steps itself, and gives the vote of its own replicator to the writer of each save
(``vote``), learning the epoch from the committed save's ``Metadata``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.futures import Future

from .. import process_state
from ..errors import CheckpointError
from ..format.records import committed_save
from ..tiers.base_lock import BaseHold
from ..tiers.storage import StorageTier
from .group import ReplicaVote, decide_epoch
from .replicator import Replicator, SaveToReplicate, shared_replicator

log = logging.getLogger(__name__)


class WriterReplicas:
    """One writer's side of the replicas of its saves (``replicas`` other nodes; none: it only
    carries ``vote``, when given one).  ``node``: this rank's node (the writer's option);
    ``in_checkpoint_process``: the saves run in DCP's checkpoint process, which makes the
    replicator at its first save."""

    def __init__(self, replicas: int, node: str | None = None, in_checkpoint_process: bool = False,
                 pg=None) -> None:
        self.replicas, self.node, self.pg = replicas, node, pg
        self.replicator: Replicator | None = None  # this process's (made in the process that saves)
        # a vote of a replica group this writer does not hold (a Checkpointer's), taken when the
        # save was asked for
        self.vote: ReplicaVote | None = None
        self._manifest: concurrent.futures.Future | None = None  # coordinator: its CommittedSave, or None
        self._replicated: concurrent.futures.Future | None = None  # the last save's ReplicaRecord (or None)
        if replicas:
            if not process_state.group_up():
                raise ValueError("replicas travel over torch.distributed: call dist.init_process_group "
                                 "before making DataStatesWriter(replicas=...)")
            if not in_checkpoint_process:  # else it is made in DCP's checkpoint process, at its first save
                self.replicator = shared_replicator(replicas, pg, node)

    def set_up(self, path: str, is_coordinator: bool, use_collectives: bool) -> None:
        """A save begins (``set_up_storage_writer``)."""
        if not self.replicas:
            return
        if not use_collectives:
            raise CheckpointError("replicas need DCP's collectives (dcp.save without no_dist)", checkpoint=path)
        if self.replicator is None:  # DCP's checkpoint process: its first save through a writer
            self.replicator = shared_replicator(self.replicas, self.pg, self.node)
        self._manifest = concurrent.futures.Future() if is_coordinator else None

    def local_plan(self, plan: SavePlan) -> SavePlan:
        """The rank's local plan, carrying its replica group's vote (where it has one)."""
        vote = self.replicator.vote() if self.replicator is not None else self.vote
        return plan if vote is None else dataclasses.replace(plan, storage_data=vote)

    @staticmethod
    def epoch(plans: list[SavePlan]) -> int | None:
        """The coordinator's: the save's epoch of the replica group, from every rank's vote."""
        return decide_epoch([p.storage_data for p in plans])

    def queue(self, tier: StorageTier, save_id: str, written: Future, hold: BaseHold,
              epoch: int | None) -> None:
        """Save ``save_id`` into ``tier`` reached its writes on this rank, failed or not
        (``written``): queued on the replicator, with the base locks it holds (``hold``) and its
        epoch of the replica group.  Every rank queues every save so, in DCP's order: the
        replicators agree on each save's fate before any bytes move."""
        if self.replicator is not None:
            self._replicated = self.replicator.submit_save(SaveToReplicate(
                tier, save_id, written, self._manifest, hold, epoch))

    def committed(self, metadata: Metadata | None) -> None:
        """The coordinator's save committed (``metadata``) or failed (None): the replicators may
        go on."""
        if self._manifest is not None and not self._manifest.done():
            self._manifest.set_result(None if metadata is None else committed_save(metadata))

    def wait(self, timeout: float | None, path: str | None, save_id: str) -> bool:
        """See ``DataStatesWriter.wait_replicated``."""
        fut = self._replicated
        if fut is None:
            return True
        try:
            rec = fut.result(timeout)
        except (RuntimeError, OSError, CheckpointError) as e:  # a peer or this rank's helper gone
            log.warning("%s: save %s: replication failed: %s", path, save_id, e)
            return False
        return rec is not None and rec.complete

    def __getstate__(self):
        d = dict(self.__dict__)
        d["replicator"] = d["_manifest"] = d["_replicated"] = None  # DCP's checkpoint process makes its own
        d["pg"] = None  # the daemon's group is its default one
        return d
