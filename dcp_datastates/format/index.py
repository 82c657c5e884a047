"""Format version 4: a small index, and one metadata part per rank.

A version 3 manifest lists every chunk: with FSDP over N ranks that is tensors x N entries,
and every rank reads all of them.  Version 4 splits it:

* the **index** (``.metadata``, written by the coordinator) holds what grows in tensors +
  ranks: each tensor's dtype and size and either its sharding rule (``rules.py``) or, for
  tensors without one, its chunks' boxes and the rank that wrote each; the meshes; the values;
  every file with its size; and each rank's **part** with its size and xxh3-128 digest;
* a **part** (``part-rNNNNN-<save>.dsm``, written by its rank with its data files) is a
  version 3 manifest of that rank's chunks, where their bytes are (the head), followed by
  their block digests (the tail).

A rank reads the index and the heads of the parts of the ranks whose chunks it loads: its own
for a same-size restart, a few when resharded.  A head is accepted only with the digest the
index gives it, the same save id, and files that the index lists with the same sizes; a chunk
is taken from it only where its box is the one the rule or the index says.  A part's tail is
read when the first of its chunks' data is, and used only with the digest its head gives.
Both the index and the heads are packed (zlib) after their header fields.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import xxhash

from ..errors import ManifestError
from .checksum import DIGEST_BYTES, DigestTail, Digests
from .columnar import _SMALL, _disjoint, decode_table, encode_table
from .dtypes import dtype_from_name
from .model import Chunk, Extent, Manifest, Seg, TensorEntry, _Bad, box_hits, check_tiling
from .rules import Geometry, Mesh, ShardRule, salt

INDEX_VERSION = 4
MAX_NDIM = 64
MAX_DIM = 1 << 48
MAX_PART_BYTES = 1 << 31
MAX_RULES = 1 << 20
_BULK = 1 << 17  # listed chunks converted to Python lists at once (see _Listed._lists)
_I8 = np.dtype("<i8")


@dataclass(frozen=True, slots=True)
class PartRef:
    """A rank's metadata part, as the index names it: a file of ``size`` bytes whose first
    ``head`` bytes are the manifest of its chunks (xxh3-128 ``digest``); the rest is the block
    digests of those chunks, read with the data they check (the head gives their digest)."""
    rank: int
    name: str
    size: int
    digest: bytes  # xxh3-128 of the head, 16 bytes
    head: int
    tail_digest: bytes  # xxh3-128 of the rest (the block digests), 16 bytes

    def to_wire(self) -> list:
        return [self.rank, self.name, self.size, self.digest, self.head, self.tail_digest]


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


@dataclass(slots=True)
class HeldColumns:
    """Records of replicated boxes, which the index holds (a rank loading one reads no part),
    gathered column by column as the coordinator adds each rank's: the box, the writer's rank,
    the extent's segments, and where its block digests start in that rank's part's tail."""
    tensor: list[int] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    tail_at: list[int] = field(default_factory=list)
    nsegs: list[int] = field(default_factory=list)
    seg_file: list[str] = field(default_factory=list)
    seg_offset: list[int] = field(default_factory=list)
    seg_nbytes: list[int] = field(default_factory=list)

    def add(self, tensor: int, offsets: tuple, sizes: tuple, owner: int, extent: Extent, tail_at: int) -> None:
        self.tensor.append(tensor)
        self.owner.append(owner)
        self.offsets += offsets
        self.sizes += sizes
        self.tail_at.append(tail_at)
        segs = extent.segs
        self.nsegs.append(len(segs))
        if len(segs) == 1:
            g = segs[0]
            self.seg_file.append(g.file)
            self.seg_offset.append(g.offset)
            self.seg_nbytes.append(g.nbytes)
            return
        self.seg_file += [g.file for g in segs]
        self.seg_offset += [g.offset for g in segs]
        self.seg_nbytes += [g.nbytes for g in segs]

    def to_wire(self, fidx: dict[str, int]) -> dict:
        col = lambda v: np.asarray(v, dtype=_I8).tobytes()  # noqa: E731
        return {"tensor": col(self.tensor), "owner": col(self.owner), "offsets": col(self.offsets),
                "sizes": col(self.sizes), "tail_at": col(self.tail_at), "nsegs": col(self.nsegs),
                "seg_file": col([fidx[f] for f in self.seg_file]), "seg_offset": col(self.seg_offset),
                "seg_nbytes": col(self.seg_nbytes)}


INLINE = -1  # the owner of a chunk whose record is in the index's "inline" table


def part_digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def index_wire(meshes: list[Mesh], tensors: list[IndexTensor], explicit: list[ExplicitChunk],
               parts: list[PartRef], files: list[str], usage: tuple[int, dict[str, int]],
               held: HeldColumns | None = None) -> dict:
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
        "tensor_list": _tensors_wire(tensors),
        "explicit": {"tensor": col([c.tensor for c in explicit]), "owner": col([c.owner for c in explicit]),
                     "offsets": col([x for c in explicit for x in c.offsets]),
                     "sizes": col([x for c in explicit for x in c.sizes])},
        "parts": [p.to_wire() for p in parts],
        "held": (held or HeldColumns()).to_wire({f: i for i, f in enumerate(files)}),
    }


def _tensors_wire(tensors: list[IndexTensor]) -> dict:
    """The tensor list as columns: names, distinct dtypes and rules, and per tensor a dtype
    code, its dimensions, its sizes and a rule code (-1: no rule, its chunks are listed)."""
    dtypes: dict[str, int] = {}
    rules: dict[ShardRule, int] = {}
    dcode, ndim, size, rcode = [], [], [], []
    for t in tensors:
        dcode.append(dtypes.setdefault(t.dtype, len(dtypes)))
        ndim.append(len(t.size))
        size.extend(t.size)
        rcode.append(-1 if t.rule is None else rules.setdefault(t.rule, len(rules)))
    return {"names": [t.fqn for t in tensors], "dtypes": list(dtypes), "dtype": bytes(dcode), "ndim": bytes(ndim),
            "size": np.asarray(size, dtype=_I8).tobytes(), "rules": [r.to_wire() for r in rules],
            "rule": np.asarray(rcode, dtype=_I8).tobytes()}


def _tensors_from_wire(raw, meshes: list[Mesh]) -> list[IndexTensor]:
    """The tensor list, its columns validated in bulk and each distinct rule once per rank."""
    if not isinstance(raw, dict):
        raise _Bad("tensor_list must be a map of columns")
    names, dnames, rwires = raw.get("names"), raw.get("dtypes"), raw.get("rules")
    if not isinstance(names, list) or not all(type(x) is str for x in names):
        raise _Bad("tensor_list.names must be a list of strings")
    if len(set(names)) != len(names):
        raise _Bad("a tensor is listed twice")
    if not isinstance(dnames, list) or not isinstance(rwires, list) or len(dnames) > 256 or len(rwires) > MAX_RULES:
        raise _Bad("tensor_list.dtypes and tensor_list.rules must be lists")
    for d in dnames:
        dtype_from_name(d)  # raises on a dtype outside the fixed table
    n = len(names)
    dcode, nd = (_raw_u8(raw, k, n) for k in ("dtype", "ndim"))
    if n and (int(dcode.max()) >= len(dnames) or int(nd.max()) > MAX_NDIM):
        raise _Bad("a tensor's dtype code or dimension count is out of range")
    size = _arr(raw, "size", int(nd.sum()), 0, MAX_DIM)
    rcode = _arr(raw, "rule", n, -1, len(rwires) - 1)
    rules: dict[tuple[int, int], ShardRule] = {}  # (rule, ndim): few, each validated once
    for r, k in set(zip(rcode.tolist(), nd.tolist())):
        if r >= 0:
            rules[(r, k)] = ShardRule.from_wire(rwires[r], meshes, k)
    sizes, dt, out, at = size.tolist(), [dnames[c] for c in dcode.tolist()], [], 0
    for i, (k, r) in enumerate(zip(nd.tolist(), rcode.tolist())):
        out.append(IndexTensor(names[i], dt[i], tuple(sizes[at:at + k]), rules[(r, k)] if r >= 0 else None))
        at += k
    return out


def _pattern(fqn: str, path) -> tuple | None:
    """How DCP's flattening path of ``fqn`` cuts it: ``(cuts, ints)``, ``cuts`` the ordinals of
    the dots that separate components (None: every dot), ``ints`` the components that are list
    indices.  None when the path is not ``fqn`` cut at dots (kept as it is)."""
    if not isinstance(path, (list, tuple)) or not path:
        return None
    try:
        comps, ints = path, ()
        joined = ".".join(path)  # all strings: the usual case, in C
    except TypeError:
        if any(type(p) not in (str, int) for p in path):
            return None
        comps = [str(p) for p in path]
        ints = tuple(k for k, p in enumerate(path) if type(p) is int)
        joined = ".".join(comps)
    if joined != fqn:
        return None
    if len(comps) == fqn.count(".") + 1:
        return None, ints
    cuts, dots = [], -1
    for c in comps[:-1]:
        dots += c.count(".") + 1
        cuts.append(dots)
    return tuple(cuts), ints


def paths_wire(names: list[str], planner_data: dict) -> tuple[dict, dict]:
    """DCP's flattening paths of the index's tensors as a few distinct patterns and one code
    per tensor (-1: none); returns that and the entries it does not cover."""
    at = {n: i for i, n in enumerate(names)}
    patterns: dict[tuple, int] = {}
    code = np.full(len(names), -1, dtype=_I8)
    rest = {}
    for k, path in planner_data.items():
        pat = _pattern(k, path) if k in at else None
        if pat is None:
            rest[k] = path
        else:
            code[at[k]] = patterns.setdefault(pat, len(patterns))
    wire = [[None if c is None else list(c), list(i)] for c, i in patterns]
    return {"patterns": wire, "of": code.tobytes()}, rest


def paths_from_wire(raw, names: list[str]) -> dict[str, list]:
    """The flattening paths ``paths_wire`` encoded, each cut from its tensor's name."""
    if not isinstance(raw, dict) or not isinstance(raw.get("patterns"), list):
        raise _Bad("paths must be a map with a list of patterns")
    pats = []
    for w in raw["patterns"]:
        if not (isinstance(w, list) and len(w) == 2 and (w[0] is None or isinstance(w[0], list))
                and isinstance(w[1], list) and all(type(x) is int for x in (w[0] or []) + w[1])):
            raise _Bad("a path pattern must be [cuts or null, ints]")
        pats.append(w)
    code = _arr(raw, "of", len(names), -1, len(pats) - 1)
    out: dict[str, list] = {}
    for i, c in enumerate(code.tolist()):
        if c < 0:
            continue
        cuts, ints = pats[c]
        parts = names[i].split(".")
        if cuts is None:
            comps = parts
        else:
            if any(not 0 <= b < len(parts) - 1 for b in cuts) or any(a >= b for a, b in zip(cuts, cuts[1:])):
                raise _Bad(f"path pattern {c} does not fit {names[i]!r}")
            bounds = [0, *(b + 1 for b in cuts), len(parts)]
            comps = [".".join(parts[a:b]) for a, b in zip(bounds, bounds[1:])]
        for k in ints:
            if not 0 <= k < len(comps) or not _INT.fullmatch(comps[k]):
                raise _Bad(f"path pattern {c} makes a non-integer of {names[i]!r} an index")
            comps[k] = int(comps[k])
        out[names[i]] = comps
    return out


_INT = re.compile(r"-?(0|[1-9][0-9]*)")


def _raw_u8(d: dict, key: str, n: int) -> np.ndarray:
    raw = d.get(key)
    if not isinstance(raw, bytes) or len(raw) != n:
        raise _Bad(f"tensor_list.{key} must be {n} bytes")
    return np.frombuffer(raw, dtype=np.uint8)


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
                 source: str, block_size: int, decode: Callable[[bytes, str, Callable], Manifest]) -> None:
        self.source, self.save_id, self.files, self.homes, self._decode = source, save_id, files, homes, decode
        # readers of a part's bytes [start, end) by name, fastest tier first; set by the tier that read the index
        self.loaders: list[Callable[[str, int, int], bytes]] = []
        self._lock = threading.Lock()
        self._tails_lock = threading.Lock()
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
        self.tensors: list[IndexTensor] = _tensors_from_wire(body.get("tensor_list"), self.meshes)
        self._geoms: dict[int, Geometry | None] = {}
        self.listed = _Listed(body.get("explicit"), self.tensors, self.parts, world)
        self.held = _Held(body.get("held"), self.tensors, self.parts, world, list(files.items()), block_size)
        self._tails: dict[int, DigestTail] = {}
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
            if not isinstance(w, list) or len(w) != 6 or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in (w[0], w[2], w[4])) \
                    or not all(isinstance(x, bytes) and len(x) == 16 for x in (w[3], w[5])):
                raise _Bad("a part must be [rank, name, size, digest, head, tail digest]")
            if not 0 <= w[0] < world or w[0] in out:
                raise _Bad(f"part of rank {w[0]} is out of range or listed twice")
            if self.files.get(w[1]) != w[2] or not 0 < w[2] <= MAX_PART_BYTES:
                raise _Bad(f"part {w[1]!r} is not among the files with its size")
            if not 0 < w[4] <= w[2]:
                raise _Bad(f"part {w[1]!r}: its head of {w[4]} bytes is not within its {w[2]} bytes")
            out[w[0]] = PartRef(*w)
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
        if not self.tensors[t].size:  # a 0-d tensor (an Adam step): its one chunk
            return list(range(min(1, len(self.listed.rows(t)))))
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

    def record_for(self, t: int, at, key: tuple) -> Chunk | None:
        """The record a read item names: chunk ``at`` when its box starts at ``key`` (DCP's
        planners number the chunks they were given; a narrowed plan numbers its own list),
        else the chunk stored at ``key``; one lookup of the rule for both."""
        g = self.geom(t)
        if g is None:
            return self.find(t, key)
        i = at if isinstance(at, int) and 0 <= at < g.count() and g.box(at)[0] == key else g.index_of(key)
        if i is None:
            return None
        o, z = g.box(i)
        return self._record(t, o, z, g.owner(i))

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
        if self.tensors[t].rule is not None and self.held.has(t):
            x = self.tensors[t]
            try:
                return self.held.chunk(t, offsets, sizes, owner, self.tail,
                                       math.prod(sizes) * dtype_from_name(x.dtype).itemsize)
            except _Bad as e:
                raise ManifestError(f"invalid manifest: {e}", checkpoint=self.source, key=fqn) from None
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
            data = self._read(ref, 0, ref.head, ref.digest, "metadata part")
            m = self._decode(data, f"{self.source}/{ref.name}", lambda n, digest: self._own_tail(ref, n, digest))
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


    def _read(self, ref: PartRef, start: int, end: int, digest: bytes, what: str) -> bytes:
        why = "this index was decoded without a way to read its parts"
        for load in self.loaders:  # the digest pins the content: any tier's copy will do
            try:
                got = load(ref.name, start, end)
            except (OSError, ManifestError) as e:
                why = f"unreadable: {e}"
                continue
            if len(got) == end - start and part_digest(got) == digest:
                return got
            why = "does not match the index (damaged, or from another save)"
        raise ManifestError(f"{what} {why}; restore it from another tier or re-save",
                            checkpoint=self.source, file=ref.name)

    def tail(self, rank: int) -> DigestTail:
        """The block digests of rank ``rank``'s part (the file after its head), read once, when
        the first data they check is read."""
        with self._tails_lock:
            got = self._tails.get(rank)
            if got is None:
                ref = self.parts[rank]
                got = self._tails[rank] = DigestTail(ref.size - ref.head, ref.tail_digest, lambda: self._read(
                    ref, ref.head, ref.size, ref.tail_digest, "block digests of metadata part"))
            return got

    def _own_tail(self, ref: PartRef, n: int, digest: bytes) -> DigestTail:
        """The tail a part's head announces: the one the index gives it."""
        if ref.head + n != ref.size or digest != ref.tail_digest:
            raise _Bad(f"its block digests ({n} bytes after a {ref.head}-byte head) are not the "
                       f"{ref.size - ref.head} bytes the index gives")
        return self.tail(ref.rank)


class _Listed:
    """The chunks of tensors without a rule, as int64 columns validated in bulk (owners, boxes
    inside their tensors); a tensor's boxes are shown disjoint when it is first used."""

    def __init__(self, raw, tensors: list[IndexTensor], parts: dict[int, PartRef], world: int,
                 ruled: bool = False) -> None:
        t = _arr(raw, "tensor", None, 0, max(0, len(tensors) - 1))
        owner = _arr(raw, "owner", len(t), 0 if ruled else INLINE, world - 1)
        if any(int(o) not in parts for o in np.unique(owner).tolist() if o != INLINE):
            raise _Bad("an explicit chunk's owner has no metadata part")
        if len(t) and any((tensors[i].rule is None) == ruled for i in np.unique(t).tolist()):
            raise _Bad("a held chunk's tensor has no sharding rule" if ruled else
                       "a tensor with a sharding rule also lists explicit chunks")
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
        self._rows: dict[int, np.ndarray] = {}
        self._small: dict[int, list] = {}
        self._stacked: frozenset[int] | None = None
        self._py: tuple | None = None

    def _stacked_tensors(self) -> frozenset[int]:
        """Tensors whose live boxes are shown disjoint in one pass over every listed chunk:
        sorted by their start along the first dimension, each ends before the next starts
        (TP's strided row splits, FSDP's shards).  The others are checked alone."""
        if self._stacked is None:
            live = np.nonzero(self.nd > 0)[0]
            if len(live):  # 0-d chunks hold no dims: each segment is exactly its chunk's
                live = live[np.minimum.reduceat(self.sizes, self.cstart[live]) > 0]
            tid, start = self.t[live], self.offs[self.cstart[live]]
            end = start + self.sizes[self.cstart[live]]
            order = np.lexsort((start, tid))
            tid, start, end = tid[order], start[order], end[order]
            bad = np.unique(tid[:-1][(tid[:-1] == tid[1:]) & (end[:-1] > start[1:])])
            self._stacked = frozenset(np.setdiff1d(np.unique(tid), bad).tolist())
        return self._stacked

    def _lists(self) -> tuple | None:
        """The columns as Python lists, with each tensor's run in the sorted order: made once,
        when a table of at most ``_BULK`` chunks is first searched in Python (a restart looks up
        a few chunks of every tensor: one conversion beats one per tensor)."""
        if self._py is None and len(self.t) <= _BULK:
            u, first, count = np.unique(self._sorted, return_index=True, return_counts=True)
            self._py = (dict(zip(u.tolist(), zip(first.tolist(), (first + count).tolist()))), self._order.tolist(),
                        self.cstart.tolist(), self.nd.tolist(), self.offs.tolist(), self.sizes.tolist())
        return self._py

    def _box_list(self, ti: int) -> list[tuple[tuple, tuple]]:
        """Tensor ``ti``'s boxes as tuples, kept for tensors of few chunks (searched in Python)."""
        got = self._small.get(ti)
        if got is None:
            py = self._lists()
            if py is None:
                offs, sizes = self._boxes(ti)
                got = [(tuple(o), tuple(z)) for o, z in zip(offs.tolist(), sizes.tolist())]
            else:
                bounds, order, cst, nd, offs, sizes = py
                lo, hi = bounds.get(ti, (0, 0))
                got = [(tuple(offs[cst[c]:cst[c] + nd[c]]), tuple(sizes[cst[c]:cst[c] + nd[c]])) for c in order[lo:hi]]
            if len(got) <= _SMALL:
                self._small[ti] = got
        return got

    def rows(self, ti: int) -> np.ndarray:
        """Column positions of tensor ``ti``'s chunks, in listed order (cached)."""
        got = self._rows.get(ti)
        if got is None:
            lo, hi = np.searchsorted(self._sorted, ti, "left"), np.searchsorted(self._sorted, ti, "right")
            got = self._rows[ti] = self._order[lo:hi]
        return got

    def count(self, ti: int) -> int:
        py = self._lists()
        if py is None:
            return len(self.rows(ti))
        lo, hi = py[0].get(ti, (0, 0))
        return hi - lo

    def sizes_of(self, c: int) -> tuple:
        py = self._lists()
        if py is None:
            return self.box(c)[1]
        _, _, cst, nd, _, sizes = py
        return tuple(sizes[cst[c]:cst[c] + nd[c]])

    def row(self, ti: int, i: int) -> int:
        """Column position of tensor ``ti``'s chunk ``i``."""
        py = self._lists()
        return int(self.rows(ti)[i]) if py is None else py[1][py[0][ti][0] + i]

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
        if len(rows) > 1 and ti not in self._stacked_tensors():
            offs, sizes = self._boxes(ti)
            live = np.all(sizes > 0, axis=1)
            if not _disjoint(offs[live], sizes[live]):
                check_tiling(fqn, [_Box(*self.box(int(c))) for c in rows.tolist()])
        self._checked.add(ti)

    def overlapping(self, ti: int, boxes: list[tuple[tuple, tuple]]) -> list[int]:
        if self.count(ti) <= _SMALL:
            return [i for i, (o, z) in enumerate(self._box_list(ti)) if box_hits(o, z, boxes)]
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
        py = self._lists()
        if py is not None:  # compare list slices: no box built
            bounds, order, cst, nd, offs, _ = py
            lo, hi = bounds.get(ti, (0, 0))
            want = list(offsets)
            return next((i for i, c in enumerate(order[lo:hi]) if offs[cst[c]:cst[c] + nd[c]] == want), None)
        if self.count(ti) <= _SMALL:
            return next((i for i, (o, _) in enumerate(self._box_list(ti)) if o == offsets), None)
        offs, _ = self._boxes(ti)
        if offs.shape[1] == 0:
            return 0 if len(offs) and offsets == () else None
        hit = np.nonzero(np.all(offs == np.asarray(offsets, dtype=_I8), axis=1))[0]
        return int(hit[0]) if len(hit) else None


class _Held:
    """The records of replicated boxes that the index holds: boxes as ``_Listed`` columns,
    and per chunk its segments and where its block digests start in its owner's part tail.
    Segments are checked against the files in bulk; a record against its rule when used."""

    def __init__(self, raw, tensors: list[IndexTensor], parts: dict[int, PartRef], world: int,
                 files: list[tuple[str, int]], block_size: int) -> None:
        self.boxes = _Listed(raw, tensors, parts, world, ruled=True)
        n = len(self.boxes.t)
        self.tail_at = _arr(raw, "tail_at", n, 0, MAX_PART_BYTES)
        nsegs = _arr(raw, "nsegs", n, 0, 1 << 16)
        ns = int(nsegs.sum())
        self.sfile = _arr(raw, "seg_file", ns, 0, max(0, len(files) - 1))
        self.soff = _arr(raw, "seg_offset", ns, 0, 1 << 50)
        self.sn = _arr(raw, "seg_nbytes", ns, 0, 1 << 50)
        if ns and not files:
            raise _Bad("a held chunk names a file the index does not list")
        fsize = np.asarray([z for _, z in files] or [0], dtype=_I8)
        if np.any(self.soff + self.sn > fsize[self.sfile]):
            raise _Bad("a held chunk's segment runs past the end of its file")
        self.first = np.concatenate([np.zeros(1, _I8), np.cumsum(nsegs)[:-1]]) if n else nsegs
        last = np.zeros(ns, dtype=bool)
        last[(self.first + nsegs - 1)[nsegs > 0]] = True
        if np.any(~last & (self.sn % block_size != 0)):
            raise _Bad("a held chunk's segment other than its last ends inside a checksum block")
        self.nsegs, self.fnames, self.block_size = nsegs, [f for f, _ in files], block_size
        self._with = frozenset(np.unique(self.boxes.t).tolist())
        self._lists: tuple | None = None  # the columns as Python lists, made on first use

    def has(self, t: int) -> bool:
        return t in self._with

    def chunk(self, t: int, offsets: tuple, sizes: tuple, owner: int, tail: Callable[[int], DigestTail],
              nbytes: int) -> Chunk:
        """The held record of tensor ``t``'s box at ``offsets``: it must have the rule's sizes,
        be owned by the rule's writer, and hold exactly the box's ``nbytes``."""
        i = self.boxes.position(t, offsets)
        if i is None:
            raise _Bad(f"no held chunk at {list(offsets)}")
        if self._lists is None:
            self._lists = tuple(a.tolist() for a in (self.boxes.owner, self.tail_at, self.first, self.nsegs,
                                                     self.sfile, self.soff, self.sn))
        owners, tail_at, first, nsegs, sfile, soff, sn = self._lists
        c = self.boxes.row(t, i)
        if self.boxes.sizes_of(c) != tuple(sizes) or owners[c] != owner:
            raise _Bad(f"the held chunk at {list(offsets)} is not the box its rule gives (size, writer)")
        a, k = first[c], nsegs[c]
        segs = [Seg(self.fnames[sfile[j]], soff[j], sn[j]) for j in range(a, a + k)]
        if sum(g.nbytes for g in segs) != nbytes:
            raise _Bad(f"the held chunk at {list(offsets)} holds {sum(g.nbytes for g in segs)} bytes, its box {nbytes}")
        src = tail(owner)
        at, nd = tail_at[c], max(1, -(-nbytes // self.block_size)) * DIGEST_BYTES
        if at + nd > src.nbytes:
            raise _Bad(f"the held chunk at {list(offsets)} has its block digests past its part's")
        return Chunk(tuple(offsets), tuple(sizes), Extent(segs, nbytes, Digests.tail(src, at, nd)))


def _no_special(fqn, offsets, sizes, wire):
    raise _Bad(f"{fqn}: an inline chunk must be a plain tensor chunk")


class _Box:
    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets: tuple, sizes: tuple) -> None:
        self.offsets, self.sizes = offsets, sizes
