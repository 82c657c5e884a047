"""The base of an incremental save: a committed checkpoint of the same run whose unchanged
bytes the new one references instead of writing (``docs/design.md``, "Incremental")."""

from __future__ import annotations

import dataclasses
import logging

from ..errors import CheckpointError, first_line
from ..format.model import Chunk, Extent, Manifest
from ..format.names import PURGED_MARK
from .base_lock import BaseHold
from .manifests import load_manifest, manifest_head
from .storage import StorageTier

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Base:
    """An incremental save's base, as one rank sees it."""
    name: str  # its directory, a sibling of the new checkpoint's
    manifest: Manifest
    here: frozenset  # base files present on this rank's tier (the only ones it may reference)
    homes: dict  # base file -> the directory that holds it
    chunks: dict  # (fqn, offsets) -> Chunk; empty for a lazy (format 3 or 4) manifest

    def extents(self, fqn: str, offsets: tuple) -> dict[str, Extent]:
        """Base extents of chunk ``(fqn, offsets)``: ``{part path or "": Extent}``.  A lazy
        manifest is asked for that chunk alone (format 4: only the part holding it is read)."""
        entry = self.manifest.tensors.get(fqn)
        if entry is not None and entry.lazy:
            try:
                c: Chunk | None = entry.find(offsets)
            except CheckpointError as e:  # the base cannot serve this chunk: write it in full
                log.warning("incremental base %s: %s; writing that chunk in full", self.name, e)
                c = None
        else:
            c = self.chunks.get((fqn, offsets))
        if c is None:
            return {}
        if c.extent is not None:
            return {"": c.extent}
        return {k: ext for k, (_dt, _shape, ext) in c.parts.items()}


def load_base(tier: StorageTier, incremental_base: str | None, storage_options: dict | None,
              hold: BaseHold, save_id: str | None = None) -> Base | None:
    """The base named ``incremental_base`` (a sibling directory of ``tier``), as this rank's
    tier holds it; None to write in full (no base, the step itself, an unusable base, or not
    save ``save_id`` where one is given).  ``hold`` takes the base lock, shared, of every
    directory the save may reference, before what is there is read (``base_lock.py``); the
    caller lets it go."""
    if incremental_base is None:
        return None
    raw = incremental_base.rstrip("/")
    name = raw.rpartition("/")[2]
    if "/" in raw and StorageTier(raw, storage_options).parent().root != tier.parent().root:
        raise ValueError(f"incremental_base {incremental_base!r} must be a sibling of the "
                         f"checkpoint directory {tier.url!r} (another step of the same run)")
    if name == tier.name:
        return None  # re-saving a step over itself: nothing to reference
    base_tier = tier.sibling(name)
    if not hold.take(base_tier):
        log.info("incremental base %s is being changed; writing %s in full", base_tier.url, tier.url)
        return None
    try:
        m = load_manifest(base_tier)
    except (CheckpointError, OSError) as e:
        log.warning("incremental base %s is not usable (%s); writing %s in full",
                    base_tier.url, first_line(e, 200), tier.url)
        return None
    if save_id is not None and m.save_id != save_id:
        log.info("incremental base %s holds save %s, not %s; writing %s in full", base_tier.url, m.save_id,
                 save_id, tier.url)
        return None
    homes = {f: m.homes.get(f, name) for f in m.files}
    listed: dict[str, set] = {}
    here = set()
    for f, home in homes.items():
        if home not in listed:  # held, then listed: what is there now stays while the save needs it
            listed[home] = set(tier.sibling(home).listdir()) if hold.take(tier.sibling(home)) else set()
        if f in listed[home]:
            here.add(f)
    chunks = {(fqn, c.offsets): c for fqn, t in m.tensors.items() if not t.lazy for c in t.chunks}
    return Base(name, m, frozenset(here), homes, chunks)


def still_committed(tier: StorageTier, base: Base) -> bool:
    """Whether ``base`` (read by ``load_base`` for the save into ``tier``) is still the save
    committed in its directory, with no retention pass uncommitting it: asked once the save's
    claim, which names the base, is in place.  Where no lock holds the base (an object store),
    a purge or a re-save of it between the read and the claim is seen here, and the save
    writes in full; one after it reads the claim and leaves the base's files alone
    (``retention.py``, ``tidy.py``)."""
    t = tier.sibling(base.name)
    try:
        if t.exists(PURGED_MARK):
            return False
        head = manifest_head(t)
        return (head.save_id if head is not None else load_manifest(t).save_id) == base.manifest.save_id
    except (CheckpointError, OSError) as e:
        log.info("incremental base %s cannot be read again (%s)", t.url, first_line(e, 200))
        return False
