"""Format version 4: a small index, and one metadata part per rank.

A version 3 manifest lists every chunk: with FSDP over N ranks that is tensors x N entries,
and every rank reads all of them.  Version 4 splits it:

* the **index** (``.metadata``, written by the coordinator) holds what grows in tensors +
  ranks: each tensor's dtype and size and either its sharding rule (``rules.py``) or, for
  tensors without one, its chunks' boxes and the rank that wrote each; the meshes; the values;
  every file with its size; and each rank's **part** with its size and xxh3-128 digest;
* a **part** (``part-rNNNNN-<save>.dsm``, written by its rank with its data files) is a
  version 3 manifest of that rank's chunks: where their bytes are, and their block digests.

A rank reads the index and the parts of the ranks whose chunks it loads: its own for a
same-size restart, a few when resharded.  A part is accepted only with the size and digest the
index gives it, the same save id, and files that the index lists with the same sizes; a chunk
is taken from it only where its box is the one the rule or the index says.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import xxhash

from ..errors import ManifestError
from .columnar import _disjoint, decode_table, encode_table
from .dtypes import dtype_from_name
from .model import Chunk, Manifest, TensorEntry, _Bad, check_tiling
from .rules import Geometry, Mesh, ShardRule, salt

INDEX_VERSION = 4
MAX_NDIM = 64
MAX_DIM = 1 << 48
MAX_PART_BYTES = 1 << 31
_I8 = np.dtype("<i8")


@dataclass(frozen=True, slots=True)
class PartRef:
    """A rank's metadata part, as the index names it."""
    rank: int
    name: str
    size: int
    digest: bytes  # xxh3-128 of the whole file, 16 bytes

    def to_wire(self) -> list:
        return [self.rank, self.name, self.size, self.digest]


@dataclass(frozen=True, slots=True)
class IndexTensor:
    """One tensor of the index: its rule, or (``rule`` None) its chunks in ``explicit``."""
    fqn: str
    dtype: str
    size: tuple[int, ...]
    rule: ShardRule | None


@dataclass(frozen=True, slots=True)
class ExplicitChunk:
    """A chunk of a tensor without a rule: its box and the rank whose part holds it, or (small
    plain chunks, ``record`` given) its record in the index itself."""
    tensor: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    owner: int
    record: Chunk | None = None


INLINE = -1  # the owner of a chunk whose record is in the index's "inline" table


def part_digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def index_wire(meshes: list[Mesh], tensors: list[IndexTensor], explicit: list[ExplicitChunk],
               parts: list[PartRef], files: list[str], usage: tuple[int, dict[str, int]]) -> dict:
    """The version 4 fields of the manifest body (``files``: the body's file list, in order)."""
    col = lambda v: np.asarray(v, dtype=_I8).tobytes()  # noqa: E731
    inline: dict[str, TensorEntry] = {}
    for c in explicit:
        if c.record is not None:
            t = tensors[c.tensor]
            inline.setdefault(t.fqn, TensorEntry(t.dtype, t.size, [])).chunks.append(c.record)
    explicit = [c if c.record is None else ExplicitChunk(c.tensor, c.offsets, c.sizes, INLINE) for c in explicit]
    return {
        "usage": [usage[0], usage[1]],
        "inline": encode_table(inline, {f: i for i, f in enumerate(files)}, _no_provider),
        "meshes": [m.to_wire() for m in meshes],
        "tensor_list": [[t.fqn, t.dtype, list(t.size), None if t.rule is None else t.rule.to_wire()] for t in tensors],
        "explicit": {"tensor": col([c.tensor for c in explicit]), "owner": col([c.owner for c in explicit]),
                     "offsets": col([x for c in explicit for x in c.offsets]),
                     "sizes": col([x for c in explicit for x in c.sizes])},
        "parts": [p.to_wire() for p in parts],
    }


def _no_provider(chunk):
    raise ValueError("provider chunks are never inline")


def _arr(d: dict, key: str, n: int | None, lo: int, hi: int) -> np.ndarray:
    raw = d.get(key) if isinstance(d, dict) else None
    if not isinstance(raw, bytes) or len(raw) % 8:
        raise _Bad(f"explicit.{key} must be int64 bytes")
    a = np.frombuffer(raw, dtype=_I8)
    if n is not None and len(a) != n:
        raise _Bad(f"explicit.{key} has {len(a)} entries, expected {n}")
    if len(a) and (int(a.min()) < lo or int(a.max()) > hi):
        raise _Bad(f"explicit.{key} holds values outside [{lo}, {hi}]")
    return a


class IndexTable:
    """The decoded index: the source of its tensors' chunks (``TensorEntry``), loading the
    parts that hold their records on demand through ``loader`` (set by the tier that read it)."""

    def __init__(self, body: dict, *, files: dict[str, int], homes: dict[str, str], world: int, save_id: str,
                 source: str, block_size: int, decode: Callable[[bytes, str], Manifest]) -> None:
        self.source, self.save_id, self.files, self.homes, self._decode = source, save_id, files, homes, decode
        # readers of a part by (name, size), fastest tier first; set by the tier that read the index
        self.loaders: list[Callable[[str, int], bytes]] = []
        self._lock = threading.Lock()
        self._loaded: dict[int, Manifest] = {}
        raw_meshes = body.get("meshes")
        if not isinstance(raw_meshes, list) or len(raw_meshes) > 1 << 16:
            raise _Bad("meshes must be a list")
        self.meshes = [Mesh.from_wire(w, world) for w in raw_meshes]
        self.parts = self._parts(body.get("parts"), world)
        for m in self.meshes:  # every rank a rule can name has a part
            missing = [r for r in m.ranks if r not in self.parts]
            if missing:
                raise _Bad(f"mesh ranks {missing[:8]} have no metadata part")
        raw = body.get("tensor_list")
        if not isinstance(raw, list):
            raise _Bad("tensor_list must be a list")
        self.tensors: list[IndexTensor] = []
        self._geoms: dict[int, Geometry | None] = {}
        names: set[str] = set()
        rules: dict[tuple, ShardRule] = {}  # few distinct rules: each validated once
        for w in raw:
            if not isinstance(w, list) or len(w) != 4 or not isinstance(w[0], str) or not isinstance(w[1], str) \
                    or not isinstance(w[2], list) or len(w[2]) > MAX_NDIM:
                raise _Bad("a tensor must be [name, dtype, size, rule]")
            if w[0] in names:
                raise _Bad(f"tensor {w[0]!r} is listed twice")
            names.add(w[0])
            size = tuple(w[2])
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_DIM for x in size):
                raise _Bad(f"tensor {w[0]!r} has an invalid size")
            rule = None
            if w[3] is not None:
                key = (repr(w[3]), len(size))
                rule = rules.get(key)
                if rule is None:
                    rule = rules[key] = ShardRule.from_wire(w[3], self.meshes, len(size))
            self.tensors.append(IndexTensor(w[0], w[1], size, rule))
        self.listed = _Listed(body.get("explicit"), self.tensors, self.parts, world)
        raw_usage = body.get("usage")
        if not (isinstance(raw_usage, list) and len(raw_usage) == 2 and isinstance(raw_usage[0], int)
                and isinstance(raw_usage[1], dict) and raw_usage[0] >= 0
                and all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in raw_usage[1].items())):
            raise _Bad("usage must be [owned bytes, {home: shared bytes}]")
        self.usage: tuple[int, dict[str, int]] = (raw_usage[0], dict(raw_usage[1]))
        self.inline = decode_table(body.get("inline"), list(files.items()), block_size, _no_special, source)
        if int((self.listed.owner == INLINE).sum()) != sum(e.count() for e in self.inline.values()):
            raise _Bad("the inline table does not hold exactly the chunks listed as inline")

    def _parts(self, raw, world: int) -> dict[int, PartRef]:
        if not isinstance(raw, list) or len(raw) > world:
            raise _Bad("parts must be a list of at most one per rank")
        out: dict[int, PartRef] = {}
        for w in raw:
            if not isinstance(w, list) or len(w) != 4 or not isinstance(w[0], int) or isinstance(w[0], bool) \
                    or not isinstance(w[2], int) or not isinstance(w[3], bytes) or len(w[3]) != 16:
                raise _Bad("a part must be [rank, name, size, digest]")
            if not 0 <= w[0] < world or w[0] in out:
                raise _Bad(f"part of rank {w[0]} is out of range or listed twice")
            if self.files.get(w[1]) != w[2] or not 0 < w[2] <= MAX_PART_BYTES:
                raise _Bad(f"part {w[1]!r} is not among the files with its size")
            out[w[0]] = PartRef(w[0], w[1], w[2], w[3])
        return out

    # ------------------------------------------------------ TensorEntry's source
    def geom(self, t: int) -> Geometry | None:
        """Tensor ``t``'s rule as geometry (None: its chunks are listed), made on first use."""
        g = self._geoms.get(t, False)
        if g is False:
            x = self.tensors[t]
            g = self._geoms[t] = None if x.rule is None else Geometry(
                x.size, self.meshes[x.rule.mesh], x.rule, salt(x.fqn), dtype_from_name(x.dtype).itemsize)
        return g

    def count(self, t: int) -> int:
        g = self.geom(t)
        return g.count() if g is not None else len(self.listed.rows(t))

    def box_at(self, t: int, i: int) -> tuple[tuple, tuple]:
        g = self.geom(t)
        return g.box(i) if g is not None else self.listed.box(int(self.listed.rows(t)[i]))

    def box_list(self, t: int) -> list[tuple[tuple, tuple]]:
        g = self.geom(t)
        return g.boxes() if g is not None else [self.listed.box(c) for c in self.listed.rows(t).tolist()]

    def overlapping(self, t: int, boxes: list[tuple[tuple, tuple]]) -> list[int]:
        g = self.geom(t)
        if g is not None:
            return g.overlapping(boxes)
        self.check(t)
        return self.listed.overlapping(t, boxes)

    def check(self, t: int) -> None:
        """Rules are valid by construction; a tensor's listed boxes are checked disjoint on first use."""
        if self.tensors[t].rule is None:
            try:
                self.listed.check(t, self.tensors[t].fqn)
            except _Bad as e:
                raise ManifestError(f"invalid manifest: {e}", checkpoint=self.source) from None

    def chunk_at(self, t: int, i: int) -> Chunk:
        g = self.geom(t)
        if g is not None:
            o, z = g.box(i)
            return self._record(t, o, z, g.owner(i))
        self.check(t)
        c = int(self.listed.rows(t)[i])
        return self._record(t, *self.listed.box(c), int(self.listed.owner[c]))

    def find(self, t: int, offsets: tuple) -> Chunk | None:
        g = self.geom(t)
        if g is not None:
            i = g.index_of(tuple(offsets))
            return None if i is None else self.chunk_at(t, i)
        self.check(t)
        i = self.listed.position(t, tuple(offsets))
        return None if i is None else self.chunk_at(t, i)

    def records(self, t: int) -> list[Chunk]:
        return [self.chunk_at(t, i) for i in range(self.count(t))]

    # ------------------------------------------------------------------ parts
    def _record(self, t: int, offsets: tuple, sizes: tuple, owner: int) -> Chunk:
        fqn = self.tensors[t].fqn
        entry = self.inline.get(fqn) if owner == INLINE else self.part(owner).tensors.get(fqn)
        chunk = None if entry is None else entry.find(offsets)
        if chunk is None or tuple(chunk.sizes) != tuple(sizes):
            if owner == INLINE:
                raise ManifestError(f"the index has no inline chunk of size {list(sizes)} at {list(offsets)}",
                                    checkpoint=self.source, key=fqn)
            raise ManifestError(f"the metadata part of rank {owner} has no chunk of size {list(sizes)} at "
                                f"{list(offsets)}", checkpoint=self.source, key=fqn,
                                file=self.parts[owner].name)
        return chunk

    def part(self, rank: int) -> Manifest:
        """Rank ``rank``'s part, read and checked once."""
        with self._lock:
            got = self._loaded.get(rank)
            if got is not None:
                return got
            ref = self.parts.get(rank)
            if ref is None:
                raise ManifestError(f"rank {rank} has no metadata part", checkpoint=self.source)
            data, why = None, "this index was decoded without a way to read its parts"
            for load in self.loaders:  # the digest pins the content: any tier's copy will do
                try:
                    got = load(ref.name, ref.size)
                except (OSError, ManifestError) as e:
                    why = f"unreadable: {e}"
                    continue
                if len(got) == ref.size and part_digest(got) == ref.digest:
                    data = got
                    break
                why = "does not match the index (damaged, or from another save)"
            if data is None:
                raise ManifestError(f"metadata part {why}; restore it from another tier or re-save",
                                    checkpoint=self.source, file=ref.name)
            m = self._decode(data, f"{self.source}/{ref.name}")
            if m.save_id != self.save_id or m.version != 3 or m.ranks != [rank]:
                raise ManifestError(f"metadata part holds save {m.save_id} ranks {m.ranks[:4]}, not rank "
                                    f"{rank} of save {self.save_id}", checkpoint=self.source, file=ref.name)
            for name, size in m.files.items():
                if self.files.get(name) != size:
                    raise ManifestError(f"metadata part names file {name} ({size} bytes), which the "
                                        "index does not list so", checkpoint=self.source, file=ref.name)
            if any(self.homes.get(name) != home for name, home in m.homes.items()):
                raise ManifestError("metadata part places a file in another checkpoint than the index does",
                                    checkpoint=self.source, file=ref.name)
            self._loaded[rank] = m
            return m


class _Listed:
    """The chunks of tensors without a rule, as int64 columns validated in bulk (owners, boxes
    inside their tensors); a tensor's boxes are shown disjoint when it is first used."""

    def __init__(self, raw, tensors: list[IndexTensor], parts: dict[int, PartRef], world: int) -> None:
        t = _arr(raw, "tensor", None, 0, max(0, len(tensors) - 1))
        owner = _arr(raw, "owner", len(t), INLINE, world - 1)
        if any(int(o) not in parts for o in np.unique(owner).tolist() if o != INLINE):
            raise _Bad("an explicit chunk's owner has no metadata part")
        if len(t) and any(tensors[i].rule is not None for i in np.unique(t).tolist()):
            raise _Bad("a tensor with a sharding rule also lists explicit chunks")
        tnd = np.array([len(x.size) for x in tensors], dtype=_I8)
        nd = tnd[t] if len(t) else np.zeros(0, _I8)
        total = int(nd.sum())
        self.offs = _arr(raw, "offsets", total, 0, MAX_DIM)
        self.sizes = _arr(raw, "sizes", total, 0, MAX_DIM)
        self.cstart = np.concatenate([np.zeros(1, _I8), np.cumsum(nd)[:-1]]) if len(t) else nd
        if total:
            tsz = np.array([x for ts in tensors for x in ts.size], dtype=_I8)
            tstart = np.concatenate([np.zeros(1, _I8), np.cumsum(tnd)[:-1]])
            chunk = np.repeat(np.arange(len(t)), nd)
            dim = np.arange(total) - self.cstart[chunk]
            if np.any(self.offs + self.sizes > tsz[tstart[t[chunk]] + dim]):
                raise _Bad("an explicit chunk extends beyond its tensor")
        self.t, self.owner, self.nd = t, owner, nd
        self._order = np.argsort(t, kind="stable")
        self._sorted = t[self._order]
        self._checked: set[int] = set()

    def rows(self, ti: int) -> np.ndarray:
        """Column positions of tensor ``ti``'s chunks, in listed order."""
        lo, hi = np.searchsorted(self._sorted, ti, "left"), np.searchsorted(self._sorted, ti, "right")
        return self._order[lo:hi]

    def box(self, c: int) -> tuple[tuple, tuple]:
        a, k = int(self.cstart[c]), int(self.nd[c])
        return tuple(self.offs[a:a + k].tolist()), tuple(self.sizes[a:a + k].tolist())

    def _boxes(self, ti: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self.rows(ti)
        k = int(self.nd[rows[0]]) if len(rows) else 0
        at = self.cstart[rows][:, None] + np.arange(k)[None, :]
        return self.offs[at], self.sizes[at]

    def check(self, ti: int, fqn: str) -> None:
        if ti in self._checked:
            return
        rows = self.rows(ti)
        if len(rows) > 1:
            offs, sizes = self._boxes(ti)
            live = np.all(sizes > 0, axis=1)
            if not _disjoint(offs[live], sizes[live]):
                check_tiling(fqn, [_Box(*self.box(int(c))) for c in rows.tolist()])
        self._checked.add(ti)

    def overlapping(self, ti: int, boxes: list[tuple[tuple, tuple]]) -> list[int]:
        offs, sizes = self._boxes(ti)
        if offs.shape[1] == 0:
            return list(range(min(1, len(offs))))
        hit = np.zeros(len(offs), dtype=bool)
        live = np.all(sizes > 0, axis=1)
        for lo, n in boxes:
            lo_a = np.asarray(lo, dtype=_I8)
            hit |= live & np.all(offs < lo_a + np.asarray(n, dtype=_I8), axis=1) & np.all(offs + sizes > lo_a, axis=1)
        return np.nonzero(hit)[0].tolist()

    def position(self, ti: int, offsets: tuple) -> int | None:
        offs, _ = self._boxes(ti)
        if offs.shape[1] == 0:
            return 0 if len(offs) and offsets == () else None
        hit = np.nonzero(np.all(offs == np.asarray(offsets, dtype=_I8), axis=1))[0]
        return int(hit[0]) if len(hit) else None


def _no_special(fqn, offsets, sizes, wire):
    raise _Bad(f"{fqn}: an inline chunk must be a plain tensor chunk")


class _Box:
    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets: tuple, sizes: tuple) -> None:
        self.offsets, self.sizes = offsets, sizes
