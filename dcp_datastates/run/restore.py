"""``Restore``: what ``Checkpointer.load`` does to restore a run, as one object: the steps it
tries newest first and, for each, the saves of that step newest first (an older attempt may be
whole on the nodes where the newest is not); one try each, every rank alike: the node-local
repair (``NodeCopies.repair``), then ``dcp.load`` through a ``DataStatesReader`` that falls back
to the slower tiers."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch.distributed.checkpoint as dcp

from ..errors import CheckpointError, first_line
from ..load.reader import DataStatesReader
from ..planner import DataStatesLoadPlanner
from ..replicas.for_run import NodeCopies
from .steps import RunSteps

log = logging.getLogger(__name__)


class Restore:
    """One restore of a run over its tiers (``steps``); ``last`` says what it loaded."""

    def __init__(self, steps: RunSteps, storage_options: Sequence[dict | None],
                 node_copies: NodeCopies | None, pg=None) -> None:
        self.steps, self.storage_options, self.node_copies, self.pg = steps, list(storage_options), node_copies, pg
        self.last: dict = {}

    def run(self, state: dict, step: int | None, *, besides: int | None) -> int | None:
        """Load ``step`` (default: the newest committed, never ``besides``, a save in flight)
        into ``state``; the step loaded, None where no step is committed."""
        failed: list[tuple[int, BaseException]] = []  # newest first
        # one all-gather: each rank's steps, the saves of its newest, its replica group's vote
        start = self.steps.start_restore(step, besides=besides, vote=None if self.node_copies is None
                                         else self.node_copies.restore_vote())
        tried = 0
        for s in start.order:
            for save in self.steps.saves_to_try(s, start) or [None]:
                # the votes were taken before any repair: only the first attempt may use them
                votes = start.votes() if tried == 0 else None
                tried += 1
                got = self._try(state, s, save, votes)
                if isinstance(got, BaseException):
                    failed.append((s, got))
                    continue
                self.last = {"step": s, "manifest_tier": got.manifest_tier, "served": dict(got.served)}
                return s
        if not failed and step is not None:  # a resume the caller asked for: never a silent fresh start
            raise CheckpointError(f"step {step} is not committed on any tier of this run (committed: "
                                  f"{start.committed[-5:] or 'none'}); nothing was loaded",
                                  checkpoint=self.steps.tiers[0])
        if not failed:
            self._say_fresh(step)
            return None
        if step is not None:
            raise failed[0][1]
        newest, why = failed[0]
        raise CheckpointError(
            f"none of the committed steps {list(dict.fromkeys(f for f, _e in failed))} of this run could be "
            f"restored, so nothing was loaded (a fresh start would replace the run); step {newest} failed with: "
            f"{first_line(why, 300)}", checkpoint=self.steps.tiers[0]) from why

    def _try(self, state: dict, s: int, save: str | None, votes) -> DataStatesReader | BaseException:
        """One try at restoring save ``save`` of step ``s`` (every rank alike): the reader that
        loaded it, or why it could not."""
        fix = self.node_copies.repair(s, save, votes) if self.node_copies is not None else None
        if fix is not None and not fix.survey() \
                and not any(self.steps.is_committed(i, s) for i in range(1, len(self.steps.tiers))):
            log.warning("step %d (save %s): some of its files are on no node and no slower tier holds "
                        "it; trying an older save or step", s, save)
            return CheckpointError(f"step {s}: some files of save {save} are on no node and no slower "
                                   "tier holds it", checkpoint=self.steps.step_path(0, s))
        reader = DataStatesReader(
            self.steps.step_path(0, s), storage_options=self.storage_options[0],
            fallback=[self.steps.step_path(i, s) for i in range(1, len(self.steps.tiers))],
            fallback_options=self.storage_options[1] if len(self.steps.tiers) > 1 else None,
            save_id=save, process_group=self.pg, _node_repair=fix)
        try:
            dcp.load(state, storage_reader=reader, process_group=self.pg, planner=DataStatesLoadPlanner())
        except BaseException as e:  # CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            if reader.peer_error is not None:  # the group lost a rank: no older step can be tried
                raise reader.peer_error from e
            log.warning("step %d could not be restored from any tier (%s); trying an older save or step",
                        s, first_line(e, 300))
            return e
        log.info("restored step %d (manifest from %s; %s)", s, reader.manifest_tier,
                 ", ".join(f"{n / 2**20:.1f} MiB from {u}" for u, n in reader.served.items()))
        return reader

    def _say_fresh(self, step: int | None) -> None:
        """Say, in one line, why there is nothing to load: a trainer then starts from step 0."""
        missing = [u for i, u in enumerate(self.steps.tiers) if not _is_dir(self.steps.tier(i))]
        where = f" (no directory at {', '.join(missing)}: a mistyped path?)" if missing else ""
        log.log(logging.WARNING if missing else logging.INFO,
                "no committed step%s in %s%s; nothing loaded, the run starts afresh",
                "" if step is None else f" {step}", ", ".join(self.steps.tiers), where)


def _is_dir(tier) -> bool:
    try:
        return tier.is_real_dir()
    except OSError:
        return False
