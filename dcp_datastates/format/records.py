"""Typed records from a rank's ``write_data`` to the coordinator's ``finish``.

Each ``WriteResult.storage_data`` is an :class:`ItemRecord` (DCP gathers them to the
coordinator with pickle; they hold only plain data and format records).  The first record of
each rank also carries its :class:`RankRecord`.  ``build.py`` turns them into the manifest
directly, with no encoding on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .listed import HeldRecord
from .ranked import OwnFile, PartRef
from .manifest import Extent, ValueEntry


@dataclass(slots=True)
class RankRecord:
    """One rank's part of the save: the data files it wrote (and those it references in
    earlier checkpoints of the run, with their home directories), and its stage timings."""
    rank: int
    files: dict[str, int]
    homes: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class ItemRecord:
    """What one DCP ``WriteItem`` became.

    ``kind``: ``"tensor"`` (one extent), ``"provider"`` (a registered type stored as a tensor
    chunk: ``parts`` by path, ``tree`` of nested providers), ``"value"`` (``value`` inline) or
    ``"provider-value"`` (a registered type stored as a value: ``parts`` and ``tree``)."""
    kind: str
    dtype: str = ""
    sizes: tuple[int, ...] = ()
    extent: Extent | None = None
    provider: str | None = None
    meta: object = None
    parts: dict[str, tuple[str, tuple[int, ...], Extent]] = field(default_factory=dict)
    tree: dict | None = None
    value: ValueEntry | None = None
    rank: RankRecord | None = None


@dataclass(slots=True)
class PartRecord:
    """A rank's whole result in a version 4 save (one ``WriteResult``): the metadata part it
    wrote, its own data files and the others it refers to, the chunks of its tensors without a
    sharding rule (key, offsets, sizes, and the extent of a small plain chunk, which the index
    holds itself; the others it lists with this rank as owner), its values, and the records of
    the replicated boxes it wrote."""
    rank: int  # the global rank, as the meshes number them
    part: PartRef
    files: dict[str, int]
    homes: dict[str, str]
    explicit: list[tuple[str, tuple[int, ...], tuple[int, ...], Extent | None]]  # extent: small, inline
    values: dict[str, ValueEntry]
    usage: tuple[int, dict[str, int]] = (0, {})  # bytes in own files, bytes shared by home (``Manifest.usage``)
    timings: dict[str, float] = field(default_factory=dict)
    # replicated boxes this rank wrote for all replicas; the index holds these records itself
    held: tuple[HeldRecord, ...] = ()
    # this rank's own data files of this save; ``files`` holds the others (another save's, which
    # an incremental save refers to), by name
    own: tuple[OwnFile, ...] = ()
