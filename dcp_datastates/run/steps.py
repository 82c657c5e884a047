"""``RunSteps``: the steps of a run over its tiers, as the directories say.

A run is ``<tier>/step-<N>/`` on each tier, fastest first (the layout torchtitan uses, so its
discovery of ``step-N/.metadata`` sees only committed steps).  A step counts on a tier only once
its manifest is committed there and reads back; a directory without one is an interrupted or a
purged save, and one holding another format's ``.metadata`` (DCP's own) is no step of ours.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .. import process_state
from ..errors import CheckpointError
from ..format.names import is_manifest_name, step_of
from ..replicas.group import ReplicaVote
from ..tiers import StorageTier
from ..tiers.manifests import ManifestHead, load_manifest, manifest_head, manifest_is_ours

log = logging.getLogger(__name__)


def join_url(base: str, name: str) -> str:
    """``name`` inside directory ``base`` (a local path or a URL)."""
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


@dataclass(frozen=True)
class RestoreView:
    """What one rank holds as a restore starts (``RunSteps.start_restore``): the steps committed
    on its tiers, the manifest head on each tier of ``step`` (the step asked for, else its
    newest; None: it has none), and its replica group's vote (None without replicas)."""

    committed: tuple[int, ...]
    step: int | None
    heads: tuple[ManifestHead | None, ...]
    vote: ReplicaVote | None = None


@dataclass(frozen=True)
class RestoreStart:
    """Every rank's ``RestoreView`` (the same on every rank) and the steps to try, newest first."""

    order: tuple[int, ...]
    views: tuple[RestoreView, ...]

    @property
    def committed(self) -> list[int]:
        """The steps some rank holds committed on some tier, oldest first."""
        return sorted(set().union(*(v.committed for v in self.views)))

    def votes(self) -> list[ReplicaVote] | None:
        """Every rank's replica vote; None where some rank gave none."""
        votes = [v.vote for v in self.views if v.vote is not None]
        return votes if len(votes) == len(self.views) else None

    def heads_of(self, step: int) -> list[tuple[ManifestHead | None, ...]] | None:
        """The manifest heads of ``step`` by tier of every rank that holds it committed on some
        tier, where ``step`` is the newest any rank gave heads of (each rank gave those of its
        newest, or of the step asked for: a rank whose newest is another holds this one on no
        tier, as a node that lost it); None for an older step: ``agreed_save`` gathers them."""
        if step != max((v.step for v in self.views if v.step is not None), default=None):
            return None
        return [v.heads for v in self.views if v.step == step]


class RunSteps:
    """The step directories of one run on its ordered tiers (``node_local``: the first tier is
    private to each node); ``pg`` is the group whose ranks agree on a save to restore."""

    def __init__(self, tiers: Sequence[str], storage_options: Sequence[dict | None], *,
                 node_local: bool, pg=None) -> None:
        self.tiers, self.storage_options = list(tiers), list(storage_options)
        self.node_local, self.pg = node_local, pg

    def step_path(self, tier: int, step: int) -> str:
        """The directory (or URL) of ``step`` on tier ``tier``: ``<tier>/step-<step>``."""
        return join_url(self.tiers[tier], f"step-{step}")

    def tier(self, i: int, step: int | None = None) -> StorageTier:
        """Tier ``i``'s run directory, or its directory of ``step``."""
        url = self.tiers[i] if step is None else self.step_path(i, step)
        return StorageTier(url, self.storage_options[i])

    def step_dirs(self, i: int) -> list[int]:
        """Every step with a directory on tier ``i``, committed or not."""
        return sorted(s for s in map(step_of, self.tier(i).listdir()) if s is not None)

    def is_committed(self, i: int, step: int) -> bool:
        """Whether ``step`` has a committed manifest on tier ``i`` (a readable set of rank
        manifests counts; a directory without one is an interrupted or purged save)."""
        ours = self.ours(i, step)
        if ours is not None:
            return ours  # a .metadata of another format (DCP's own) is no step of ours
        t = self.tier(i, step)
        if not any(is_manifest_name(n) for n in t.listdir()):
            return False
        try:
            load_manifest(t)
            return True
        except CheckpointError:
            return False

    def committed(self, i: int, *, besides: int | None = None) -> list[int]:
        """Steps committed on tier ``i``, except ``besides`` (a save in flight)."""
        return [s for s in self.step_dirs(i) if s != besides and self.is_committed(i, s)]

    def newest_durable(self, tiers: Sequence[int], in_flight: int | None, flushing: set[int]) -> int | None:
        """The newest step committed on the last tier (``in_flight``, the save under way, never
        counts), as far as a retention pass over ``tiers`` needs it.  A pass over the last tier
        asks it about every step.  A pass over faster tiers only (a rank purging its node's
        directory) keeps it only among the steps those tiers hold, so it asks the last tier
        about those, newest first, and stops at the first committed one (the newest durable
        step was saved through them), leaving out the ``flushing`` ones, which the pass keeps
        anyway: a request or two a pass whatever the run keeps there, not a listing and every
        step's manifest read by every rank."""
        last = len(self.tiers) - 1
        if last in tiers:
            return max(self.committed(last, besides=in_flight), default=None)
        held = {s for i in tiers for s in self.step_dirs(i)} - flushing - {in_flight}
        return next((s for s in sorted(held, reverse=True) if self.is_committed(last, s)), None)

    def ours(self, i: int, step: int) -> bool | None:
        """``manifest_is_ours`` of step ``step`` on tier ``i``; a ``.metadata`` that cannot be
        read now counts as ours (loading it says why)."""
        try:
            return manifest_is_ours(self.tier(i, step))
        except (OSError, CheckpointError):
            return True

    def foreign(self, i: int, step: int) -> bool:
        """Whether step directory ``step`` of tier ``i`` holds another format's checkpoint."""
        return self.ours(i, step) is False

    def start_restore(self, step: int | None, *, besides: int | None = None,
                      vote: ReplicaVote | None = None) -> RestoreStart:
        """What every rank holds as a restore starts, in one all-gather over ``pg`` (each a ring
        over the whole job at scale): its committed steps on every tier except ``besides`` (a
        save in flight), the manifest heads of ``step`` (where given, else of its newest) for
        ``agreed_save``, and ``vote`` (its replica group's, for the first step's repair).  The
        steps a restore tries, newest first, are ``step`` alone where given and committed on
        some tier of some rank (else none), else every step so committed.  A step in another format (DCP's own) newer than
        those, or the one asked for, is said in the log: it is not restored."""
        mine: set[int] = set()
        for i in range(len(self.tiers)):
            mine.update(self.committed(i, besides=besides))
        at = step if step is not None else max(mine, default=None)
        views = self._everyone(RestoreView(tuple(sorted(mine)), at, self._heads(at) if at is not None else (), vote))
        candidates: set[int] = set().union(*(v.committed for v in views))
        foreign = sorted({s for i in range(len(self.tiers)) for s in self.step_dirs(i)
                          if s not in candidates and self.foreign(i, s)})
        if foreign and (step in foreign or (step is None and foreign[-1] > max(candidates, default=-1))):
            log.warning("%s holds step(s) %s in DCP's own format, which Checkpointer does not restore "
                        "(load one with dcp.load and FileSystemReader, or `dcp-datastates convert` it)",
                        self.tiers[0], foreign)
        order = ((step,) if step in candidates else ()) if step is not None else tuple(sorted(candidates, reverse=True))
        return RestoreStart(order, tuple(views))

    def _everyone(self, obj) -> list:
        """Every rank's ``obj`` over ``pg`` (an all-gather), or this one's alone without a group."""
        return process_state.gather(obj, self.pg)

    def _heads(self, step: int) -> tuple[ManifestHead | None, ...]:
        return tuple(manifest_head(self.tier(i, step)) for i in range(len(self.tiers)))

    def agreed_save(self, step: int, start: RestoreStart | None = None) -> str | None:
        """The save of ``step`` every rank restores first when tiers hold different ones (a node
        kept a copy from an attempt the job rolled back): the newest on a tier all ranks share,
        else the newest on a node-local tier; None when no copy says (the reader decides
        alone).  ``saves_to_try`` gives the others, in the order a restore tries them."""
        saves = self.saves_to_try(step, start)
        return saves[0] if saves else None

    def saves_to_try(self, step: int, start: RestoreStart | None = None) -> list[str]:
        """The saves of ``step`` a restore tries, the same list on every rank: those on tiers all
        ranks share, newest first, then those only node-local tiers hold, newest first (a node's
        copy may be of an attempt that no set of nodes holds whole: an older attempt may be).
        Decided from the heads ``start`` holds of ``step`` where it holds them (of every copy
        committed), else from an all-gather over ``pg`` of every rank's."""
        views = start.heads_of(step) if start is not None else None
        if views is None:
            views = self._everyone(self._heads(step))
        shared = range(1 if self.node_local else 0, len(self.tiers))
        out: list[str] = []
        for tiers in (shared, range(0, 1 if self.node_local else 0)):
            found = {h.save_id: h for v in views if v is not None for i in tiers if (h := v[i]) is not None}
            out += [h.save_id for h in sorted(found.values(), key=lambda h: (h.created_unix, h.save_id), reverse=True)
                    if h.save_id not in out]
        return out
