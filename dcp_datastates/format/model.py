"""The in-memory model of a manifest: what a checkpoint holds and where.

``manifest.py`` encodes and decodes it (``docs/format.md``); every other layer works on these
records.  ``check_tiling`` is the model's one invariant that spans chunks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from ..errors import ManifestError
from .checksum import BLOCK_SIZE, join_digests, split_digests
from .codec import MAX_STORED
from .limits import SMALL_ITEM_BYTES, FormatViolation
from .names import is_packed_file

FORMAT_VERSION = 3  # written now; manifest.py reads the versions it lists

@dataclass(slots=True)
class Seg:
    """``nbytes`` contiguous bytes at ``offset`` in data file ``file``."""
    file: str
    offset: int
    nbytes: int


@dataclass(slots=True)
class Extent:
    """Bytes of one stored chunk: consecutive segments, one digest per block.

    Usually one segment.  Several when the chunk was written in pieces that landed apart
    in the file, or when an incremental save kept some pieces from an earlier checkpoint.
    Every segment but the last holds whole blocks, so block ``b`` of the chunk never
    straddles two files.

    A *packed* extent (its segments in data files of compressed blocks, ``names.is_packed_file``)
    has one segment per block instead: segment ``b`` is block ``b`` as stored (``codec.py``),
    ``nbytes`` its logical size, and its digests cover the stored bytes."""
    segs: list[Seg]
    nbytes: int
    sums: Sequence  # per block: 16-byte xxh3-128 digest (v2; v3: a checksum.Digests) or xxh3-64 int (v1)

    @classmethod
    def contiguous(cls, file: str, offset: int, nbytes: int, sums: Sequence) -> "Extent":
        return cls([Seg(file, offset, nbytes)], nbytes, sums)

    @property
    def file(self) -> str:
        """The file of the first segment (the only one for most extents)."""
        return self.segs[0].file if self.segs else ""

    @property
    def offset(self) -> int:
        return self.segs[0].offset if self.segs else 0

    def files(self) -> set[str]:
        return {s.file for s in self.segs}

    @property
    def packed(self) -> bool:
        """Whether the extent is stored as compressed blocks, one segment each."""
        return bool(self.segs) and is_packed_file(self.segs[0].file)

    @property
    def stored(self) -> int:
        """The bytes the extent takes in its files."""
        return sum(s.nbytes for s in self.segs)

    def locate(self, start: int, n: int) -> list[tuple[str, int, int, int]]:
        """Where chunk bytes ``[start, start + n)`` are: ``(file, file_offset, pos, length)``
        per segment touched, ``pos`` counted from ``start``.  Not for a packed extent, whose
        bytes are found block by block (``segs[b]``)."""
        assert not self.packed, "a packed extent's bytes are its blocks' segments"
        out = []
        base = 0
        end = start + n
        for s in self.segs:
            a, b = max(start, base), min(end, base + s.nbytes)
            if a < b:
                out.append((s.file, s.offset + a - base, a - start, b - a))
            base += s.nbytes
            if base >= end:
                break
        return out

    def to_wire(self) -> list:
        return [[[s.file, s.offset, s.nbytes] for s in self.segs], self.nbytes,
                join_digests(self.sums)]

    @classmethod
    def from_wire(cls, x) -> "Extent":
        """Inverse of :meth:`to_wire` for trusted in-process data (the writer's results);
        manifests read from storage go through the validating decoder instead."""
        segs, nbytes, sums = x
        return cls([Seg(f, o, n) for f, o, n in segs], nbytes, split_digests(sums))


def segs_problem(segs: list[Seg], n: int, block_size: int) -> str | None:
    """What is wrong with ``segs`` as the segments of an extent of ``n`` bytes, else None: plain
    segments hold the ``n`` bytes, each but the last whole blocks; packed ones (all or none of
    them) are one stored block each, of 1 to ``MAX_STORED`` bytes."""
    packed = [is_packed_file(s.file) for s in segs]
    if any(packed):
        if not all(packed):
            return "an extent mixes compressed blocks and plain bytes"
        blocks = -(-n // block_size)
        if len(segs) != blocks:
            return f"{len(segs)} compressed blocks hold an extent of {blocks} blocks"
        if any(not 0 < s.nbytes <= MAX_STORED for s in segs):
            return f"a compressed block is stored in 0 or more than {MAX_STORED} bytes"
        return None
    held = sum(s.nbytes for s in segs)
    if held != n or (n and not segs):
        return f"segments hold {held} bytes, the extent {n}"
    if any(s.nbytes % block_size for s in segs[:-1]):
        return "a segment other than the last ends inside a checksum block"
    return None


@dataclass(slots=True)
class Chunk:
    """One saved piece of a tensor: its box in the global tensor and its bytes."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    extent: Extent | None  # None when a provider stores the chunk as parts
    provider: str | None = None
    meta: object = None
    # leaf tensors of the provider, by path ("data", or "inner/data" for a nested provider)
    parts: dict[str, tuple[str, tuple[int, ...], Extent]] = field(default_factory=dict)
    # how the parts nest: {part: None (a tensor leaf) | {"p": provider, "m": meta, "t": tree}};
    # None when every part is a tensor leaf of the top provider (the format before nesting)
    tree: dict | None = None


def box_hits(offsets: tuple, sizes: tuple, boxes) -> bool:
    """Whether the chunk at ``offsets`` of size ``sizes`` overlaps one of ``boxes`` ((offsets,
    sizes) pairs); a 0-d chunk always does, an empty one never."""
    if not sizes:
        return True
    if not all(sizes):
        return False
    return any(all(a < lo + n and lo < a + b for a, b, lo, n in zip(offsets, sizes, blo, bn))
               for blo, bn in boxes)


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a chunk in its tensor


class ChunkTable(Protocol):
    """Where the chunk records of a manifest's tensors come from, tensor by tensor (row ``t``).

    Three implementations: :class:`ChunkList` (records in memory: versions 1 and 2, and every
    manifest a save builds), the version 3 table (``table.Table``) and the version 4 index
    (``index.IndexTable``), which answer from columns or sharding rules and build a record only
    when it is asked for, so a rank that loads one chunk of a tensor sharded over thousands of
    ranks never builds the others.  Positions ``i`` count records in the table's record order;
    every box is an (offsets, sizes) pair.  A table raises ``ManifestError`` for a record that
    breaks the format; none reads storage except the version 4 index, through the part reader
    it was given when it was decoded."""

    lazy: bool  # records built only when asked for

    def count(self, t: int) -> int:
        """How many records tensor ``t`` has, without building them."""
        ...

    def layout_key(self, t: int) -> tuple | None:
        """A key tensors whose boxes are the same by construction share (one sharding rule over
        one size), else None: a planner may reuse one tensor's box arithmetic for another."""
        ...

    def box_at(self, t: int, i: int) -> Box:
        """The box of record ``i``, without building it."""
        ...

    def box_list(self, t: int) -> list[Box]:
        """The box of every record, in order, without building the records."""
        ...

    def exact(self, t: int, box: Box) -> int | None:
        """The position of the record whose box is exactly ``box``, else None."""
        ...

    def overlapping(self, t: int, boxes: list[Box]) -> list[int]:
        """The positions of the records that overlap any of ``boxes`` (empty ones left out)."""
        ...

    def chunk_at(self, t: int, i: int) -> Chunk:
        """Record ``i`` alone (its tensor's boxes are checked first)."""
        ...

    def record_at(self, t: int, at: object, key: tuple) -> Chunk | None:
        """The record a read item names: record ``at`` (DCP's planners number the chunks they
        were given) when it is stored at offsets ``key``, else the one stored at ``key``."""
        ...

    def writer_at(self, t: int, at: object, key: tuple) -> int | None:
        """The rank whose metadata part holds the record ``record_at`` names, or whose part
        holds the digests of a record the table holds (a version 4 index), found without
        reading the part; None where the table holds record and digests itself."""
        ...

    def find(self, t: int, offsets: tuple) -> Chunk | None:
        """The record stored at ``offsets``, else None."""
        ...

    def find_box(self, t: int, offsets: tuple, sizes: tuple) -> Chunk | None:
        """The record whose box is exactly (``offsets``, ``sizes``), else None."""
        ...

    def records(self, t: int) -> list[Chunk]:
        """Every record of tensor ``t``, boxes checked disjoint."""
        ...


class PartIndex(Protocol):
    """What a format 4 index (``index.IndexTable``) offers beyond its tensors' chunks."""

    usage: tuple[int, dict[str, int]]  # bytes owned, and shared per earlier checkpoint

    def part_ranks(self) -> list[int]:
        """The ranks that wrote a metadata part, in order."""
        ...

    def check_part(self, rank: int) -> None:
        """Read and check rank ``rank``'s part, head and digest tail (``ManifestError``)."""
        ...


class ChunkList:
    """One tensor's records in memory: a :class:`ChunkTable` of one row (``t`` is ignored).
    The list is the tensor's own: builders append to it (``TensorEntry.chunks``)."""

    __slots__ = ("items", "_at", "_indexed")
    lazy = False

    def __init__(self, items: list[Chunk]) -> None:
        self.items = items
        self._at: dict[tuple, Chunk] = {}  # offsets -> record, made on the first lookup
        self._indexed = 0  # how many of ``items`` ``_at`` holds (builders append after lookups)

    def count(self, t: int) -> int:
        return len(self.items)

    def layout_key(self, t: int) -> None:
        return None

    def box_at(self, t: int, i: int) -> Box:
        c = self.items[i]
        return c.offsets, c.sizes

    def box_list(self, t: int) -> list[Box]:
        return [(c.offsets, c.sizes) for c in self.items]

    def exact(self, t: int, box: Box) -> int | None:
        return next((i for i, c in enumerate(self.items) if (c.offsets, c.sizes) == box), None)

    def overlapping(self, t: int, boxes: list[Box]) -> list[int]:
        return [i for i, c in enumerate(self.items) if box_hits(c.offsets, c.sizes, boxes)]

    def chunk_at(self, t: int, i: int) -> Chunk:
        return self.items[i]

    def record_at(self, t: int, at: object, key: tuple) -> Chunk | None:
        items = self.items
        if isinstance(at, int) and 0 <= at < len(items) and items[at].offsets == key:
            return items[at]
        return self.find(t, key)

    def writer_at(self, t: int, at: object, key: tuple) -> None:
        return None

    def find(self, t: int, offsets: tuple) -> Chunk | None:
        if self._indexed != len(self.items):
            for c in self.items[self._indexed:]:
                self._at.setdefault(tuple(c.offsets), c)
            self._indexed = len(self.items)
        return self._at.get(tuple(offsets))

    def find_box(self, t: int, offsets: tuple, sizes: tuple) -> Chunk | None:
        chunk = self.find(t, offsets)
        return chunk if chunk is not None and tuple(chunk.sizes) == tuple(sizes) else None

    def records(self, t: int) -> list[Chunk]:
        return self.items


class TensorEntry:
    """A tensor of the checkpoint: dtype, global size, and its chunk records in row ``row`` of a
    :class:`ChunkTable` (its own :class:`ChunkList` unless a decoded table backs it).  Asking
    for ``chunks`` builds every record once and keeps them in memory from then on."""

    __slots__ = ("dtype", "size", "_table", "_row")

    def __init__(self, dtype: str, size: tuple[int, ...], chunks: list[Chunk] | None = None, *,
                 table: ChunkTable | None = None, row: int = 0) -> None:
        self.dtype, self.size = dtype, size
        self._table: ChunkTable = table if table is not None else ChunkList([] if chunks is None else chunks)
        self._row = row

    @property
    def chunks(self) -> list[Chunk]:
        """Every record, built once; builders append to this list."""
        table = self._table
        if table.lazy:
            table = self._table = ChunkList(table.records(self._row))
            self._row = 0
        return table.records(self._row)

    @property
    def lazy(self) -> bool:
        """Whether the records are still unbuilt (a decoded table backs them)."""
        return self._table.lazy

    def find(self, offsets: tuple) -> Chunk | None:
        """The chunk stored at ``offsets`` (None: there is none)."""
        return self._table.find(self._row, offsets)

    def record_at(self, at: object, key: tuple) -> Chunk | None:
        """See :meth:`ChunkTable.record_at`."""
        return self._table.record_at(self._row, at, key)

    def writer_at(self, at: object, key: tuple) -> int | None:
        """See :meth:`ChunkTable.writer_at`."""
        return self._table.writer_at(self._row, at, key)

    def find_box(self, offsets: tuple, sizes: tuple) -> Chunk | None:
        """The chunk whose box is exactly (``offsets``, ``sizes``), else None."""
        return self._table.find_box(self._row, offsets, sizes)

    def count(self) -> int:
        """How many chunk records the tensor has, without building them."""
        return self._table.count(self._row)

    def layout_key(self) -> tuple | None:
        """See :meth:`ChunkTable.layout_key`."""
        return self._table.layout_key(self._row)

    def box(self, i: int) -> Box:
        """(offsets, sizes) of record ``i``, without building it."""
        return self._table.box_at(self._row, i)

    def chunk_at(self, i: int) -> Chunk:
        """Record ``i`` alone (a lazy tensor builds only that one; its boxes are checked)."""
        return self._table.chunk_at(self._row, i)

    def boxes(self) -> list[Box]:
        """(offsets, sizes) of every record, in order, without building the records."""
        return self._table.box_list(self._row)

    def exact(self, box: Box) -> int | None:
        """Position of the record whose box is exactly ``box``, else None."""
        return self._table.exact(self._row, box)

    def overlapping(self, boxes: list[Box]) -> list[int]:
        """Positions of the records that overlap any of ``boxes``."""
        return self._table.overlapping(self._row, boxes)

    def __repr__(self) -> str:
        n = "lazy" if self._table.lazy else self._table.count(self._row)
        return f"TensorEntry({self.dtype}, {list(self.size)}, chunks={n})"


@dataclass(slots=True)
class ValueEntry:
    encoding: str  # "msgpack"; "provider" (node below); "pickle"/"torch" only by opt-in
    data: bytes
    checksum: int
    node: "Chunk | None" = None  # encoding "provider": a registered type's parts and metadata


@dataclass(slots=True)
class Manifest:
    save_id: str
    world_size: int
    ranks: list[int]
    files: Mapping[str, int]  # a dict, or a format 4 index's FileMap, which names rank files when walked
    tensors: dict[str, TensorEntry]
    values: dict[str, ValueEntry]
    planner_data: dict[str, list]
    homes: dict[str, str] = field(default_factory=dict)  # file -> sibling checkpoint holding it
    version: int = FORMAT_VERSION  # as read (1 to 4); a version 3 manifest is written as FORMAT_VERSION
    block_size: int = BLOCK_SIZE
    created_unix: float = 0.0
    torch_version: str = ""
    writer: str = ""
    extra: dict = field(default_factory=dict)
    index: PartIndex | None = None  # version 4: the index that finds chunk records in the ranks' parts

    def usage(self) -> tuple[int, dict[str, int]]:
        """Tensor bytes this checkpoint owns (in its own files) and, per earlier checkpoint of
        the run, the bytes it shares from there (incremental saves).  A version 4 index holds the
        sums its ranks counted in their parts."""
        if self.index is not None:
            return self.index.usage
        owned, shared = 0, {}
        for t in self.tensors.values():
            for c in t.chunks:
                exts = [c.extent] if c.extent is not None else [p[2] for p in c.parts.values()]
                for e in exts:
                    for seg in e.segs:
                        home = self.homes.get(seg.file)
                        if home is None:
                            owned += seg.nbytes
                        else:
                            shared[home] = shared.get(home, 0) + seg.nbytes
        return owned, shared

    def merge(self, other: "Manifest", *, source: str = "<memory>") -> None:
        """Fold a rank-local manifest (``use_collectives=False``) of the same save into this
        one.  Ranks that disagree on a tensor, or whose chunks overlap, raise ``ManifestError``."""
        files = self.files
        if not isinstance(files, dict):
            raise ManifestError("a format 4 index merges no rank manifests", checkpoint=source)
        for name, size in other.files.items():
            if files.get(name, size) != size:
                raise ManifestError(f"rank manifests disagree on the size of {name}", checkpoint=source)
            files[name] = size
        self.homes.update(other.homes)
        touched = []
        for fqn, t in other.tensors.items():
            mine = self.tensors.get(fqn)
            if mine is None:
                self.tensors[fqn] = TensorEntry(t.dtype, t.size, list(t.chunks))
                continue
            if (mine.dtype, mine.size) != (t.dtype, t.size):
                raise ManifestError(f"rank manifests disagree on {fqn}: {mine.dtype}{list(mine.size)} "
                                    f"vs {t.dtype}{list(t.size)}", checkpoint=source, key=fqn)
            seen = {(c.offsets, c.sizes) for c in mine.chunks}
            mine.chunks.extend(c for c in t.chunks if (c.offsets, c.sizes) not in seen)
            touched.append(fqn)
        for fqn in touched:
            try:
                check_tiling(fqn, self.tensors[fqn].chunks)
            except FormatViolation as e:
                raise ManifestError(f"invalid manifest: {e}", checkpoint=source, key=fqn) from None
        for fqn, v in other.values.items():
            self.values.setdefault(fqn, v)
        for k, v in other.planner_data.items():
            self.planner_data.setdefault(k, v)
        self.ranks = sorted(set(self.ranks) | set(other.ranks))


class Boxed(Protocol):
    """Anything with a box: a chunk record, or a :class:`BareBox`."""

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def sizes(self) -> tuple[int, ...]: ...


@dataclass(slots=True, frozen=True)
class BareBox:
    """A box alone, to check boxes with ``check_tiling`` without building their records."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def check_tiling(fqn: str, chunks: Sequence[Boxed]) -> None:
    """Chunks of one tensor may not overlap: then the volumes the reader sums are the
    union it covers.  A sweep along the dimension with the most distinct offsets compares
    only chunks whose extents along it intersect (one neighbour each for FSDP shards)."""
    boxes = [c for c in chunks if c.sizes and all(c.sizes)]
    if len(boxes) < 2:
        seen = set()
        for c in chunks:  # scalars and 0-d: one chunk per offset
            if not c.sizes and c.offsets in seen:
                raise FormatViolation(f"{fqn}: two chunks at offsets {list(c.offsets)}")
            seen.add(c.offsets)
        return
    nd = len(boxes[0].offsets)
    d = max(range(nd), key=lambda k: len({c.offsets[k] for c in boxes}))
    boxes.sort(key=lambda c: c.offsets[d])
    for i, a in enumerate(boxes):
        end = a.offsets[d] + a.sizes[d]
        for b in boxes[i + 1:]:
            if b.offsets[d] >= end:
                break
            if all(bo < ao + asz and ao < bo + bsz
                   for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                raise FormatViolation(f"{fqn}: chunks at {list(a.offsets)} (size {list(a.sizes)}) and "
                           f"{list(b.offsets)} (size {list(b.sizes)}) overlap")


class ChunkMetadataView(Sequence):
    """DCP's ``TensorStorageMetadata.chunks`` for one tensor of a manifest: made from its boxes
    when DCP's planner walks it, one element at a time when ours asks for a few (``entry``)."""

    __slots__ = ("entry", "_list")

    def __init__(self, entry: TensorEntry) -> None:
        self.entry = entry
        self._list: list[ChunkStorageMetadata] | None = None

    def _all(self) -> list[ChunkStorageMetadata]:
        if self._list is None:
            size = torch.Size
            self._list = [ChunkStorageMetadata(size(o), size(z)) for o, z in self.entry.boxes()]
        return self._list

    def __len__(self) -> int:
        return len(self._list) if self._list is not None else self.entry.count()

    def __getitem__(self, i):
        if self._list is not None or isinstance(i, slice):
            return self._all()[i]
        o, z = self.entry.box(i if i >= 0 else i + len(self))
        return ChunkStorageMetadata(torch.Size(o), torch.Size(z))

    def __iter__(self):
        return iter(self._all())

    def __reduce__(self):
        return (list, (self._all(),))


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """``nbytes`` bytes at ``offset`` of data file ``file``: a range a node-local load may be
    sent alone (``small_ranges``); hashable and ordered, unlike a :class:`Seg` of an extent."""
    file: str
    offset: int
    nbytes: int


def small_segs(m: Manifest, entry: TensorEntry, chunk: Chunk) -> list[Seg] | None:
    """The segments of ``chunk``, a record of ``entry`` that the manifest holds itself, where it
    is a small plain record of the whole tensor (at most ``SMALL_ITEM_BYTES``: a replicated
    tensor DCP's dedup had one rank write, which every rank reads, such as an optimizer's step)
    stored as it is in memory in ``m``'s own files: a node-local load whose node lacks such a
    file is sent these bytes alone, not the file (``replicas/repair.py``).  None otherwise
    (a small shard of a sharded tensor is read with its writer's files)."""
    e = chunk.extent
    if (e is None or e.nbytes > SMALL_ITEM_BYTES or tuple(chunk.sizes) != tuple(entry.size) or any(chunk.offsets)
            or any(s.file in m.homes or is_packed_file(s.file) for s in e.segs)):
        return None
    return e.segs


def small_ranges(m: Manifest) -> tuple[Span, ...]:
    """Every segment of ``small_segs`` in ``m`` as a :class:`Span`, sorted: the same on every rank
    that reads the same manifest.  Only a tensor of one record (an empty one aside) can have a
    record of the whole tensor; no metadata part is read (a record a part holds is skipped by
    its writer, ``ChunkTable.writer_at``), and no other record is built."""
    out: set[Span] = set()
    for entry in m.tensors.values():
        n = entry.count()
        if n > 2:
            continue
        whole = (tuple(0 for _ in entry.size), tuple(entry.size))
        for i in range(n):
            if tuple(map(tuple, entry.box(i))) != whole or entry.writer_at(i, whole[0]) is not None:
                continue
            segs = small_segs(m, entry, entry.chunk_at(i))
            out.update(Span(s.file, s.offset, s.nbytes) for s in segs or ())
    return tuple(sorted(out))
