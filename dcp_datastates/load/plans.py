"""What a load's plans carry between DCP's ranks (``LoadPlan.storage_data``), as typed records,
and the coordinator's check that every rank restores one save of one checkpoint."""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.planner import LoadPlan

from ..errors import ManifestError
from ..tiers.manifests import one_checkpoint


@dataclasses.dataclass(frozen=True)
class ManifestServed:
    """A rank's local plan: the save its manifest is, the tier it came from and the checkpoint
    the rank named (``tiers.manifests.checkpoint_name``)."""
    save_id: str
    tier: str | None
    checkpoint: str | None = None


@dataclasses.dataclass(frozen=True)
class LoadTerms:
    """What the coordinator tells every rank about a load: whether it is cooperative."""
    cooperative: bool


def one_save(plans: list[LoadPlan], path: str | None) -> None:
    """Raise unless every rank's manifest is the same save: ranks restoring different saves of
    one step (a node-local copy an earlier attempt left) would mix two states; ranks that name
    different checkpoints are told so first."""
    one_checkpoint([(r, p.storage_data.checkpoint, None) for r, p in enumerate(plans)
                    if isinstance(p.storage_data, ManifestServed)], path or "")
    saves: dict[str, list[tuple[int, str | None]]] = {}
    for rank, p in enumerate(plans):
        if isinstance(p.storage_data, ManifestServed):
            saves.setdefault(p.storage_data.save_id, []).append((rank, p.storage_data.tier))
    if len(saves) > 1:
        seen = "; ".join(f"save {sid}: ranks {', '.join(str(r) for r, _ in who[:4])}"
                         f"{'...' if len(who) > 4 else ''} (from {who[0][1]})" for sid, who in saves.items())
        raise ManifestError(f"ranks would restore different saves of this checkpoint ({seen}); a copy "
                            "on some tier is from another attempt: load with Checkpointer, or pass "
                            "DataStatesReader(save_id=...)", checkpoint=path)


__all__ = ["LoadTerms", "ManifestServed", "one_save"]
