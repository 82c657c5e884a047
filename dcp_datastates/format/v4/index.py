"""Format version 4: a small index, and one metadata part per rank.

A version 3 manifest lists every chunk: with FSDP over N ranks that is tensors x N entries,
and every rank reads all of them.  Version 4 splits it:

* the **index** (``.metadata``, written by the coordinator) holds what grows in tensors +
  ranks: each tensor's dtype and size and either its sharding rule (``rules.py``) or, for
  tensors without one, its chunks' boxes and the rank that wrote each; the meshes; the values;
  the records of replicated boxes (``v4/chunk_lists.py``); every file with its size, and each rank's
  **part** with the length of its head (as columns, ``v4/rank_files.py``);
* a **part** (``part-rNNNNN-<save>.dsm``, written by its rank with its data files) is a
  version 3 manifest of that rank's chunks, where their bytes are (the head), followed by
  their block digests and a footer naming its save and rank (the tail).

A rank reads the index and the heads of the parts of the ranks whose chunks it loads: its own
for a same-size restart, a few when resharded.  A head is accepted only when it decodes (its
trailer included), names this save and this rank, and lists files that the index lists with
the same sizes; a chunk is taken from it only where its box is the one the rule or the index
says.  A part's tail is read when the first of its chunks' data is, and used only when its
footer names this save and rank and matches its digests.  Both the index and the heads are
packed (zlib) after their header fields.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ...errors import ManifestError
from ..checksum import DigestTail
from ..columns import byte_column, int_bytes, int_column
from ..dtypes import dtype_from_name
from ..limits import MAX_DIM, MAX_NDIM, MAX_RULES, FormatViolation
from ..model import Chunk, Manifest, TensorEntry
from ..table import decode_table, encode_table
from .chunk_lists import INLINE, Held, HeldColumns, Listed
from .rank_files import FileMap, GatheredFiles, PartRef, PartTable, RankFileColumns, RankFiles, open_tail
from .rules import Geometry, Mesh, ShardRule, salt

INDEX_VERSION = 4


@dataclass(frozen=True, slots=True)
class IndexTensor:
    """One tensor of the index: its rule, or (``rule`` None) its chunks in ``listed``."""
    fqn: str
    dtype: str
    size: tuple[int, ...]
    rule: ShardRule | None


@dataclass(frozen=True, slots=True)
class ListedChunk:
    """A chunk of a tensor without a rule: its box and the rank whose part holds it, or (small
    plain chunks, ``record`` given) its record in the index itself."""
    tensor: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    owner: int
    record: Chunk | None = None


def index_wire(meshes: list[Mesh], tensors: list[IndexTensor], listed: list[ListedChunk],
               files: GatheredFiles, ranked: RankFileColumns, usage: tuple[int, dict[str, int]],
               held: HeldColumns | None = None, fidx: dict[str, int] | None = None) -> dict:
    """The version 4 fields of the manifest body: ``files.named`` those not named by rank
    (listed first), ``ranked`` each rank's own data files and part (``v4/rank_files.py``); ``fidx``:
    the places of the files the inline records name (None: ``files.positions()``)."""
    fidx = files.positions() if fidx is None else fidx
    inline: dict[str, TensorEntry] = {}
    for c in listed:
        if c.record is not None:
            t = tensors[c.tensor]
            inline.setdefault(t.fqn, TensorEntry(t.dtype, t.size, [])).chunks.append(c.record)
    listed = [c if c.record is None else ListedChunk(c.tensor, c.offsets, c.sizes, INLINE) for c in listed]
    return {
        "files": [[name, size] for name, size in files.named.items()],
        **ranked.to_wire(),
        "usage": [usage[0], usage[1]],
        "inline": encode_table(inline, fidx, _no_provider),
        "meshes": [m.to_wire() for m in meshes],
        "tensor_list": _tensors_wire(tensors),
        "explicit": {"tensor": int_bytes([c.tensor for c in listed]),  # "explicit": the wire name of the listed chunks
                     "owner": int_bytes([c.owner for c in listed]),
                     "offsets": int_bytes([x for c in listed for x in c.offsets]),
                     "sizes": int_bytes([x for c in listed for x in c.sizes])},
        "held": (held or HeldColumns()).to_wire(),
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
            "size": int_bytes(size), "rules": [r.to_wire() for r in rules],
            "rule": int_bytes(rcode)}


def _tensors_from_wire(raw, meshes: list[Mesh]) -> list[IndexTensor]:
    """The tensor list, its columns validated in bulk and each distinct rule once per rank."""
    if not isinstance(raw, dict):
        raise FormatViolation("tensor_list must be a map of columns")
    names, dnames, rwires = raw.get("names"), raw.get("dtypes"), raw.get("rules")
    if not isinstance(names, list) or not all(type(x) is str for x in names):
        raise FormatViolation("tensor_list.names must be a list of strings")
    if len(set(names)) != len(names):
        raise FormatViolation("a tensor is listed twice")
    if not isinstance(dnames, list) or not isinstance(rwires, list) or len(dnames) > 256 or len(rwires) > MAX_RULES:
        raise FormatViolation("tensor_list.dtypes and tensor_list.rules must be lists")
    for d in dnames:
        dtype_from_name(d)  # raises on a dtype outside the fixed table
    n = len(names)
    dcode, nd = (byte_column(raw, k, n, "tensor_list") for k in ("dtype", "ndim"))
    if n and (int(dcode.max()) >= len(dnames) or int(nd.max()) > MAX_NDIM):
        raise FormatViolation("a tensor's dtype code or dimension count is out of range")
    size = int_column(raw, "size", int(nd.sum()), 0, MAX_DIM, "tensor_list")
    rcode = int_column(raw, "rule", n, -1, len(rwires) - 1, "tensor_list")
    rules: dict[tuple[int, int], ShardRule] = {}  # (rule, ndim): few, each validated once
    for r, k in set(zip(rcode.tolist(), nd.tolist())):
        if r >= 0:
            rules[(r, k)] = ShardRule.from_wire(rwires[r], meshes, k)
    sizes, dt, out, at = size.tolist(), [dnames[c] for c in dcode.tolist()], [], 0
    for i, (k, r) in enumerate(zip(nd.tolist(), rcode.tolist())):
        out.append(IndexTensor(names[i], dt[i], tuple(sizes[at:at + k]), rules[(r, k)] if r >= 0 else None))
        at += k
    return out


_MESH_CHECKS_PER_PART = 16  # a real index has a few meshes, each of at most every rank

# Reads bytes [start, end) of the metadata part named so (short only at the file's end); one per
# copy of the checkpoint, given to the index when it is decoded (``decode_manifest(parts=...)``).
PartReader = Callable[[str, int, int], bytes]
_T = TypeVar("_T")


def _no_provider(chunk):
    raise ValueError("provider chunks are never inline")


class IndexTable:
    """The decoded index: the source of its tensors' chunks (``TensorEntry``), loading the
    parts that hold their records on demand through ``loader`` (set by the tier that read it).
    A ``model.ChunkTable``."""

    lazy = True

    def __init__(self, body: dict, *, files: FileMap, ranked: RankFiles, homes: dict[str, str], world: int,
                 save_id: str, source: str, block_size: int,
                 decode: Callable[[bytes, str, Callable], Manifest], parts: Sequence[PartReader] = ()) -> None:
        self.source, self.save_id, self.files, self.homes, self._decode = source, save_id, files, homes, decode
        self._parts = tuple(parts)  # readers of the parts, fastest copy first
        self._lock = threading.Lock()
        self._tails_lock = threading.Lock()
        self._loaded: dict[int, Manifest | ManifestError] = {}
        raw_meshes = body.get("meshes")
        if not isinstance(raw_meshes, list) or len(raw_meshes) > 1 << 16:
            raise FormatViolation("meshes must be a list")
        self.meshes = [Mesh.from_wire(w, world) for w in raw_meshes]
        self.parts = PartTable(body.get("parts"), ranked, world)
        self._check_meshes()
        self.tensors: list[IndexTensor] = _tensors_from_wire(body.get("tensor_list"), self.meshes)
        self._geoms: dict[int, Geometry | None] = {}
        self._seen: dict[tuple, dict] = {}  # the boxes geometries of one ``layout_key`` share
        self.listed = Listed(body.get("explicit"), self.tensors, self.parts, world)
        positions = files.positions()  # what segments' file numbers name
        self.held = Held(body.get("held"), self.tensors, world, positions, block_size)
        self._tails: dict[int, DigestTail] = {}
        raw_usage = body.get("usage")
        if not (isinstance(raw_usage, list) and len(raw_usage) == 2 and isinstance(raw_usage[0], int)
                and isinstance(raw_usage[1], dict) and raw_usage[0] >= 0
                and all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in raw_usage[1].items())):
            raise FormatViolation("usage must be [owned bytes, {home: shared bytes}]")
        self.usage: tuple[int, dict[str, int]] = (raw_usage[0], dict(raw_usage[1]))
        self.inline = decode_table(body.get("inline"), positions, block_size, _no_special, source)
        if int((self.listed.owner == INLINE).sum()) != sum(e.count() for e in self.inline.values()):
            raise FormatViolation("the inline table does not hold exactly the chunks listed as inline")

    def _check_meshes(self) -> None:
        """Every rank a rule can name has a part.  Each distinct mesh is checked once, a mesh of
        more ranks than there are parts is refused at once, and the checks together walk at
        most a few times the parts the index lists: the work follows the index's own size,
        never the ranks its meshes declare."""
        budget = _MESH_CHECKS_PER_PART * (len(self.parts) + 1)
        for m in dict.fromkeys(self.meshes):
            n = len(m.ranks)
            if n > len(self.parts):
                raise FormatViolation(f"a mesh of {n} ranks, but only {len(self.parts)} ranks have a metadata part")
            budget -= n
            if budget < 0:
                raise FormatViolation("the meshes name more ranks than the index's parts can account for")
            missing = self.parts.missing(m.ranks)
            if missing:
                raise FormatViolation(f"mesh ranks {missing[:8]} have no metadata part")

    # ------------------------------------------------------ TensorEntry's source
    def geom(self, t: int) -> Geometry | None:
        """Tensor ``t``'s rule as geometry (None: its chunks are listed), made on first use."""
        if t in self._geoms:
            return self._geoms[t]
        x = self.tensors[t]
        g = self._geoms[t] = None if x.rule is None else Geometry(
            x.size, self.meshes[x.rule.mesh], x.rule, salt(x.fqn), dtype_from_name(x.dtype).itemsize,
            self._seen.setdefault((x.size, x.rule), {}))
        return g

    def count(self, t: int) -> int:
        g = self.geom(t)
        return g.count() if g is not None else self.listed.count(t)

    def layout_key(self, t: int) -> tuple | None:
        """Tensor ``t``'s size and rule (its mesh and dimensions), all its boxes depend on; None
        where its chunks are listed."""
        x = self.tensors[t]
        return None if x.rule is None else (x.size, x.rule)

    def box_at(self, t: int, i: int) -> tuple[tuple, tuple]:
        g = self.geom(t)
        return g.box(i) if g is not None else self.listed.box_of(t, i)

    def box_list(self, t: int) -> list[tuple[tuple, tuple]]:
        g = self.geom(t)
        return g.boxes() if g is not None else [self.listed.box(c) for c in self.listed.rows(t).tolist()]

    def exact(self, t: int, box: tuple[tuple, tuple]) -> int | None:
        """The chunk whose box is exactly ``box`` (a same-size restart), else None."""
        g = self.geom(t)
        if g is not None:
            return g.exact(*box)
        self.check(t)  # listed boxes are disjoint: a box that is one of them overlaps no other
        i = self.listed.position(t, box[0])
        return i if i is not None and self.listed.box_of(t, i) == box else None

    def overlapping(self, t: int, boxes: list[tuple[tuple, tuple]]) -> list[int]:
        g = self.geom(t)
        if g is not None:
            return g.overlapping(boxes)
        self.check(t)
        if not self.tensors[t].size:  # a 0-d tensor (an Adam step): its one chunk
            return list(range(min(1, self.listed.count(t))))
        return self.listed.overlapping(t, boxes)  # a box that is one listed chunk: ``exact``, asked first

    def check(self, t: int) -> None:
        """Rules are valid by construction; a tensor's listed boxes are checked disjoint on first use."""
        if self.tensors[t].rule is None:
            try:
                self.listed.check(t, self.tensors[t].fqn)
            except FormatViolation as e:
                raise ManifestError(f"invalid manifest: {e}", checkpoint=self.source) from None

    def chunk_at(self, t: int, i: int) -> Chunk:
        g = self.geom(t)
        if g is not None:
            o, z = g.box(i)
            return self._record(t, o, z, g.owner(i), g, i)
        self.check(t)
        return self._record(t, *self.listed.box_of(t, i), self.listed.owner_of(t, i))

    def record_at(self, t: int, at, key: tuple) -> Chunk | None:
        """The record a read item names: chunk ``at`` when its box starts at ``key`` (DCP's
        planners number the chunks they were given; a narrowed plan numbers its own list),
        else the chunk stored at ``key``; one lookup of the rule for both."""
        i = self._position(t, at, key)
        return None if i is None else self.chunk_at(t, i)

    def writer_at(self, t: int, at, key: tuple) -> int | None:
        """The rank whose part holds the record (or, for a replicated box the index holds, its
        digests); None for a record inline in the index.  No part is read."""
        i = self._position(t, at, key)
        if i is None:
            return None
        g = self.geom(t)
        owner = g.owner(i) if g is not None else self.listed.owner_of(t, i)
        return None if owner == INLINE else int(owner)

    def _position(self, t: int, at, key: tuple) -> int | None:
        """The position ``record_at`` and ``writer_at`` name (listed boxes checked first)."""
        g = self.geom(t)
        if g is None:
            self.check(t)
            box = self.listed.box_of(t, at) if isinstance(at, int) and 0 <= at < self.listed.count(t) else None
            return at if box is not None and box[0] == key else self.listed.position(t, tuple(key))
        if isinstance(at, int) and 0 <= at < g.count() and g.box(at)[0] == key:
            return at
        return g.index_of(key)

    def find(self, t: int, offsets: tuple) -> Chunk | None:
        g = self.geom(t)
        if g is not None:
            i = g.index_of(tuple(offsets))
            return None if i is None else self.chunk_at(t, i)
        self.check(t)
        i = self.listed.position(t, tuple(offsets))
        return None if i is None else self.chunk_at(t, i)

    # ---------------------------------------------------------- PartIndex
    def part_ranks(self) -> list[int]:
        return sorted(self.parts)

    def check_part(self, rank: int) -> None:
        self.part(rank)
        self.tail(rank).load()

    def find_box(self, t: int, offsets: tuple, sizes: tuple) -> Chunk | None:
        i = self.exact(t, (tuple(offsets), tuple(sizes)))
        return None if i is None else self.chunk_at(t, i)

    def records(self, t: int) -> list[Chunk]:
        return [self.chunk_at(t, i) for i in range(self.count(t))]

    # ------------------------------------------------------------------ parts
    def _record(self, t: int, offsets: tuple, sizes: tuple, owner: int, g: Geometry | None = None,
                i: int = -1) -> Chunk:
        """The record of tensor ``t``'s box (chunk ``i`` of rule ``g``, or listed), from the
        index (held or inline) or from ``owner``'s part."""
        fqn = self.tensors[t].fqn
        if g is not None and self.held.has(t):  # a replicated box: its record is in the index
            try:
                return self.held.chunk_of(t, i, offsets, sizes, owner, self.tail, math.prod(sizes) * g.itemsize)
            except FormatViolation as e:
                raise ManifestError(f"invalid manifest: {e}", checkpoint=self.source, key=fqn) from None
        entry = self.inline.get(fqn) if owner == INLINE else self.part(owner).tensors.get(fqn)
        chunk = None if entry is None else entry.find_box(offsets, sizes)  # the part must hold that very box
        if chunk is None:
            if owner == INLINE:
                raise ManifestError(f"the index has no inline chunk of size {list(sizes)} at {list(offsets)}",
                                    checkpoint=self.source, key=fqn)
            raise ManifestError(f"the metadata part of rank {owner} has no chunk of size {list(sizes)} at "
                                f"{list(offsets)}", checkpoint=self.source, key=fqn,
                                file=self.parts[owner].name)
        return chunk

    def part(self, rank: int) -> Manifest:
        """Rank ``rank``'s part, read and checked once; a part that failed fails again without
        being read again (``verify`` asks once per chunk the part holds)."""
        got = self._loaded.get(rank)  # once loaded, a part stays: no lock to find it again
        if isinstance(got, Manifest):
            return got
        with self._lock:
            got = self._loaded.get(rank)
            if isinstance(got, ManifestError):
                raise got.with_traceback(None)
            if got is not None:
                return got
            try:
                m = self._loaded[rank] = self._load_part(rank)
            except ManifestError as e:
                self._loaded[rank] = e
                raise
            return m

    def _load_part(self, rank: int) -> Manifest:
        ref = self.parts.get(rank)
        if ref is None:
            raise ManifestError(f"rank {rank} has no metadata part", checkpoint=self.source)
        m = self._read(ref, 0, ref.head, lambda data: self._own_head(ref, data), "metadata part")
        for name, size in m.files.items():
            if self.files.get(name) != size:
                raise ManifestError(f"metadata part names file {name} ({size} bytes), which the "
                                    "index does not list so", checkpoint=self.source, file=ref.name)
        if any(self.homes.get(name) != home for name, home in m.homes.items()):
            raise ManifestError("metadata part places a file in another checkpoint than the index does",
                                checkpoint=self.source, file=ref.name)
        return m

    def _own_head(self, ref: PartRef, data: bytes) -> Manifest:
        """The part's head, decoded: a version 3 manifest of this save and this rank alone."""
        m = self._decode(data, f"{self.source}/{ref.name}", lambda n, digest: self._own_tail(ref, n))
        if m.save_id != self.save_id or m.version != 3 or m.ranks != [ref.rank]:
            raise FormatViolation(f"it holds save {m.save_id} ranks {m.ranks[:4]}, not rank {ref.rank} of save {self.save_id}")
        return m

    def _read(self, ref: PartRef, start: int, end: int, accept: Callable[[bytes], _T], what: str) -> _T:
        """``accept`` of bytes [start, end) of part ``ref``, from the first tier whose copy it
        accepts (a part checks itself and names its save and rank: any tier's copy will do)."""
        why = "this index was decoded without a way to read its parts"
        for load in self._parts:
            try:
                got = load(ref.name, start, end)
                if len(got) != end - start:
                    raise FormatViolation(f"{len(got)} bytes where the index gives {end - start}")
                return accept(got)
            except (OSError, ManifestError, FormatViolation) as e:  # this copy will not do: the next tier's may
                why = f"refused: {getattr(e, 'reason', e)}"
        advice = "" if "re-save" in why else "; restore it from another tier or re-save"
        raise ManifestError(f"{what} {why}{advice}", checkpoint=self.source, file=ref.name)

    def tail(self, rank: int) -> DigestTail:
        """The block digests of rank ``rank``'s part (the file after its head), read once, when
        the first data they check is read."""
        got = self._tails.get(rank)
        if got is not None:
            return got
        with self._tails_lock:
            got = self._tails.get(rank)
            if got is None:
                nbytes = self.parts.digests(rank)
                if nbytes is None:
                    raise KeyError(rank)
                got = self._tails[rank] = DigestTail(nbytes, lambda: self._read_tail(rank))
            return got

    def _read_tail(self, rank: int) -> bytes:
        ref = self.parts[rank]
        return self._read(ref, ref.head, ref.size, lambda data: open_tail(data, self.save_id, rank),
                          "block digests of metadata part")

    def _own_tail(self, ref: PartRef, n: int) -> DigestTail:
        """The tail a part's head announces: ``n`` bytes of digests, the rest of the part."""
        if n != ref.digests:
            raise FormatViolation(f"its block digests ({n} bytes after a {ref.head}-byte head) are not the "
                       f"{ref.digests} bytes the index leaves them")
        return self.tail(ref.rank)


def _no_special(fqn, offsets, sizes, wire):
    raise FormatViolation(f"{fqn}: an inline chunk must be a plain tensor chunk")
