"""The in-memory model of a manifest: what a checkpoint holds and where.

``manifest.py`` encodes and decodes it (``docs/format.md``); every other layer works on these
records.  ``check_tiling`` is the model's one invariant that spans chunks.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

from ..errors import ManifestError
from .checksum import BLOCK_SIZE, join_digests, split_digests

FORMAT_VERSION = 3  # written now; manifest.py reads the versions it lists


@contextlib.contextmanager
def paused_gc():
    """Build many acyclic records without the cyclic collector running over them.

    Decoding a manifest or building DCP's metadata creates a few objects per chunk; each
    generation-0 collection then walks the ever larger heap of young records, and on 20,000
    chunks the collector took three quarters of the time (0.39 s of decode with it, 0.10 s
    without).  The records hold no cycles, so nothing is lost by collecting once, afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Bad(Exception):
    """A manifest field breaks the format (turned into ``ManifestError`` naming the file)."""


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
    straddles two files."""
    segs: list[Seg]
    nbytes: int
    sums: list  # per block: 16-byte xxh3-128 digest (v2, v3: a checksum.Digests) or xxh3-64 int (v1)

    @classmethod
    def contiguous(cls, file: str, offset: int, nbytes: int, sums: list) -> "Extent":
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

    def locate(self, start: int, n: int) -> list[tuple[str, int, int, int]]:
        """Where chunk bytes ``[start, start + n)`` are: ``(file, file_offset, pos, length)``
        per segment touched, ``pos`` counted from ``start``."""
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


@dataclass(slots=True)
class TensorEntry:
    dtype: str
    size: tuple[int, ...]
    chunks: list[Chunk]


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
    files: dict[str, int]
    tensors: dict[str, TensorEntry]
    values: dict[str, ValueEntry]
    planner_data: dict[str, list]
    homes: dict[str, str] = field(default_factory=dict)  # file -> sibling checkpoint holding it
    version: int = FORMAT_VERSION  # as read (1 or 2); always written as FORMAT_VERSION
    block_size: int = BLOCK_SIZE
    created_unix: float = 0.0
    torch_version: str = ""
    writer: str = ""
    extra: dict = field(default_factory=dict)

    def usage(self) -> tuple[int, dict[str, int]]:
        """Tensor bytes this checkpoint owns (in its own files) and, per earlier checkpoint of
        the run, the bytes it shares from there (incremental saves)."""
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
        for name, size in other.files.items():
            if self.files.get(name, size) != size:
                raise ManifestError(f"rank manifests disagree on the size of {name}", checkpoint=source)
            self.files[name] = size
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
            except _Bad as e:
                raise ManifestError(f"invalid manifest: {e}", checkpoint=source, key=fqn) from None
        for fqn, v in other.values.items():
            self.values.setdefault(fqn, v)
        for k, v in other.planner_data.items():
            self.planner_data.setdefault(k, v)
        self.ranks = sorted(set(self.ranks) | set(other.ranks))


def check_tiling(fqn: str, chunks: list[Chunk]) -> None:
    """Chunks of one tensor may not overlap: then the volumes the reader sums are the
    union it covers.  A sweep along the dimension with the most distinct offsets compares
    only chunks whose extents along it intersect (one neighbour each for FSDP shards)."""
    boxes = [c for c in chunks if c.sizes and all(c.sizes)]
    if len(boxes) < 2:
        seen = set()
        for c in chunks:  # scalars and 0-d: one chunk per offset
            if not c.sizes and c.offsets in seen:
                raise _Bad(f"{fqn}: two chunks at offsets {list(c.offsets)}")
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
                raise _Bad(f"{fqn}: chunks at {list(a.offsets)} (size {list(a.sizes)}) and "
                           f"{list(b.offsets)} (size {list(b.sizes)}) overlap")
