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

import torch.distributed as dist

from .errors import CheckpointError
from .format.names import is_manifest_name, step_of
from .tiers import StorageTier
from .tiers.manifests import ManifestHead, load_manifest, manifest_head, manifest_is_ours

log = logging.getLogger(__name__)


def join_url(base: str, name: str) -> str:
    """``name`` inside directory ``base`` (a local path or a URL)."""
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


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

    def restore_order(self, step: int | None, *, besides: int | None = None) -> list[int]:
        """The steps a restore tries, newest first: ``step`` alone where given, else every step
        committed on some tier of some rank, except ``besides`` (a save in flight; a collective
        over ``pg``).  A step in another format (DCP's own) newer than those, or the one asked
        for, is said in the log: it is not restored."""
        candidates = set()
        for i in range(len(self.tiers)):
            candidates.update(self.committed(i, besides=besides))
        if dist.is_available() and dist.is_initialized():
            everyone: list = [None] * dist.get_world_size(self.pg)
            dist.all_gather_object(everyone, sorted(candidates), group=self.pg)
            candidates = set().union(*map(set, everyone))
        foreign = sorted({s for i in range(len(self.tiers)) for s in self.step_dirs(i)
                          if s not in candidates and self.foreign(i, s)})
        if foreign and (step in foreign or (step is None and foreign[-1] > max(candidates, default=-1))):
            log.warning("%s holds step(s) %s in DCP's own format, which Checkpointer does not restore "
                        "(load one with dcp.load and FileSystemReader, or `dcp-datastates convert` it)",
                        self.tiers[0], foreign)
        return [step] if step is not None else sorted(candidates, reverse=True)

    def agreed_save(self, step: int) -> str | None:
        """The save of ``step`` every rank restores when tiers hold different ones (a node kept
        a copy from an attempt the job rolled back): the newest on a tier all ranks share, else
        the newest on a node-local tier; None when no copy says (the reader decides alone)."""
        heads = [manifest_head(self.tier(i, step)) for i in range(len(self.tiers))]
        views: list[list[ManifestHead | None] | None] = [heads]
        if dist.is_available() and dist.is_initialized():
            views = [None] * dist.get_world_size(self.pg)
            dist.all_gather_object(views, heads, group=self.pg)
        shared = range(1 if self.node_local else 0, len(self.tiers))
        for tiers in (shared, range(0, 1 if self.node_local else 0)):
            found = [h for v in views if v is not None for i in tiers if (h := v[i]) is not None]
            if found:
                return max(found, key=lambda h: (h.created_unix, h.save_id)).save_id
        return None
