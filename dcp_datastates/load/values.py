"""Values (what a state dict holds that is not a tensor) turned back into objects and handed to
DCP's planner.

A value is stored inline in the manifest with its checksum and its encoding.  msgpack values
decode to plain types; pickled ones (``allow_pickle=True`` at save) are refused unless the
reader was built with ``allow_pickle=True``, since loading them would run code from the
checkpoint.  A value whose bytes do not match their checksum comes from the next tier's copy of
the manifest, or fails naming the checkpoint and the key.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Iterable

import torch
import xxhash
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import ChecksumMismatch, ManifestError, NotACheckpointError, PickleNotAllowedError
from ..format import MANIFEST_NAME, Manifest
from ..format.model import ValueEntry
from ..format.values import decode_value
from ..planner import deliver_object
from ..tiers import StorageTier
from ..tiers.manifests import load_manifest

log = logging.getLogger(__name__)


def load_value(ri: ReadItem, planner, m: Manifest, *, checkpoint: str | None, allow_pickle: bool,
               fallback: Iterable[StorageTier] = ()) -> None:
    """Decode the value ``ri`` reads from manifest ``m`` and hand it to ``planner``."""
    fqn = ri.storage_index.fqn
    v = m.values.get(fqn)
    if v is None:
        raise ManifestError("value listed in metadata is missing from the manifest", checkpoint=checkpoint, key=fqn)
    if xxhash.xxh3_64_intdigest(v.data) != v.checksum:
        v = _from_fallback(fqn, checkpoint, fallback)
        if v is None:
            raise ChecksumMismatch("value bytes do not match their checksum", checkpoint=checkpoint,
                                   file=MANIFEST_NAME, key=fqn)
    deliver(ri, planner, _decoded(v, fqn, checkpoint, allow_pickle))


def _decoded(v: ValueEntry, fqn: str, checkpoint: str | None, allow_pickle: bool):
    if v.encoding == "msgpack":
        try:
            return decode_value(v.data)
        except ValueError as e:
            raise ManifestError(f"value does not decode: {e}", checkpoint=checkpoint, key=fqn) from None
    if not allow_pickle:
        raise PickleNotAllowedError(
            f"value was saved with pickle ({v.encoding}); loading it would run code from the "
            "checkpoint. Pass allow_pickle=True to DataStatesReader only if you trust it",
            checkpoint=checkpoint, key=fqn)
    if v.encoding == "pickle":
        return pickle.loads(v.data)  # explicit opt-in only (allow_pickle=True), checked above
    return torch.load(io.BytesIO(v.data), weights_only=False)  # same opt-in


def _from_fallback(fqn: str, checkpoint: str | None, tiers: Iterable[StorageTier]) -> ValueEntry | None:
    for tier in tiers:
        try:
            other = load_manifest(tier).values.get(fqn)
        except (NotACheckpointError, ManifestError, OSError) as e:
            log.warning("value %s: no usable manifest on %s to take it from (%s)", fqn, tier.url, e)
            continue
        if other is not None and xxhash.xxh3_64_intdigest(other.data) == other.checksum:
            log.warning("value %s is damaged in %s; using the copy in %s", fqn, checkpoint, tier.url)
            return other
    return None


def deliver(ri: ReadItem, planner, value, *, tensor: bool = False) -> None:
    """Hand ``value`` to ``planner``: as the object itself where the planner takes objects
    (``planner.deliver_object``), else as the bytes of ``torch.save`` made here from the value
    already decoded, so that the planner's ``torch.load`` never meets bytes read from storage."""
    if deliver_object(planner, ri, value) or tensor:
        return
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    planner.load_bytes(ri, buf)


__all__ = ["deliver", "load_value"]
