"""Sharding rules (format version 4): a DTensor's chunks as a rule instead of a list.

A DTensor placed with plain ``Shard(d)`` and ``Replicate()`` placements on a device mesh has
one chunk per coordinate of the mesh's sharded dimensions, and the boxes follow from the
global size exactly as DTensor computes them (``torch.chunk`` sizes: ``ceil(size / n)`` per
shard, the last ones shorter or empty).  A manifest that stores the mesh once and, per tensor,
which tensor dimension each mesh dimension shards, grows in tensors + ranks instead of
tensors x ranks.

Which replica writes a replicated box is a rule too (:meth:`Geometry.writer`), decided by each
rank alone when it plans: the first replica for a box of at most 64 KiB, else replica
``(crc32(fqn) + chunk) mod replicas``, spreading the large writes over the replicas.

Chunk ``i`` of a rule is the coordinate of its sharded mesh dimensions, row-major in mesh
order.  Everything here is arithmetic on small integers; nothing walks all chunks unless asked
for all of them.
"""

from __future__ import annotations

import functools
import itertools
import math
import zlib
from dataclasses import dataclass

import xxhash

from ..limits import MAX_MESH_DIMS, FormatViolation

SMALL_BOX_BYTES = 64 << 10  # a replicated box this small is written by the first replica
_ALL_LARGE, _ALL_SMALL, _MIXED = 1, 0, 2  # a rule's boxes against SMALL_BOX_BYTES


@dataclass(frozen=True, slots=True)
class Mesh:
    """A device mesh: its shape and the global rank at each coordinate, row-major.  ``ranks``
    is a ``range`` when the ranks step evenly (every mesh torchtitan builds), else a tuple."""
    shape: tuple[int, ...]
    ranks: range | tuple[int, ...]

    @classmethod
    def of(cls, shape, ranks) -> "Mesh":
        ranks = [int(r) for r in ranks]
        if len(ranks) >= 2 and all(b - a == ranks[1] - ranks[0] for a, b in zip(ranks, ranks[1:])) \
                and ranks[1] != ranks[0]:
            compact: range | tuple = range(ranks[0], ranks[-1] + (1 if ranks[1] > ranks[0] else -1),
                                           ranks[1] - ranks[0])
        else:
            compact = tuple(ranks)
        return cls(tuple(int(s) for s in shape), compact)

    def to_wire(self) -> list:
        r = self.ranks
        return [list(self.shape), [r.start, r.stop, r.step] if isinstance(r, range) else ["list", *r]]

    @classmethod
    def from_wire(cls, w, max_rank: int) -> "Mesh":
        if not isinstance(w, list) or len(w) != 2 or not isinstance(w[0], list) or not isinstance(w[1], list):
            raise FormatViolation("a mesh must be [shape, ranks]")
        shape = w[0]
        if not 1 <= len(shape) <= MAX_MESH_DIMS or not all(_plain_int(s) and 1 <= s <= max_rank for s in shape):
            raise FormatViolation(f"mesh shape {shape!r} is invalid")
        n = 1
        for s in shape:
            n *= s
        if n > max_rank:
            raise FormatViolation(f"mesh of shape {shape} has more ranks than the limit {max_rank}")
        raw = w[1]
        if raw[:1] == ["list"]:
            ranks: range | tuple = tuple(raw[1:])
            if not all(_plain_int(r) for r in ranks):
                raise FormatViolation("mesh ranks must be integers")
        elif len(raw) == 3 and all(_plain_int(x) for x in raw) and raw[2] != 0:
            ranks = range(*raw)
        else:
            raise FormatViolation("mesh ranks must be a range or a list")
        if len(ranks) != n:
            raise FormatViolation(f"mesh of shape {shape} lists {len(ranks)} ranks")
        lo, hi = ((ranks[0], ranks[-1]) if ranks.step > 0 else (ranks[-1], ranks[0])) \
            if isinstance(ranks, range) and n else (min(ranks, default=0), max(ranks, default=0))
        if n and (lo < 0 or hi >= max_rank):
            raise FormatViolation(f"mesh ranks must lie in [0, {max_rank})")
        if not isinstance(ranks, range) and len(set(ranks)) != n:
            raise FormatViolation("a mesh lists a rank twice")
        return cls(tuple(shape), ranks)


@dataclass(frozen=True, slots=True)
class ShardRule:
    """How one tensor lies on a mesh: ``dims[m]`` is the tensor dimension mesh dimension ``m``
    shards, or -1 where the tensor is replicated along it."""
    mesh: int
    dims: tuple[int, ...]

    def to_wire(self) -> list:
        return [self.mesh, list(self.dims)]

    @classmethod
    def from_wire(cls, w, meshes: list[Mesh], ndim: int) -> "ShardRule":
        if not isinstance(w, list) or len(w) != 2 or not _plain_int(w[0]) or not isinstance(w[1], list):
            raise FormatViolation("a sharding rule must be [mesh, dims]")
        if not 0 <= w[0] < len(meshes):
            raise FormatViolation(f"sharding rule names mesh {w[0]}, but there are {len(meshes)}")
        dims = tuple(w[1])
        if len(dims) != len(meshes[w[0]].shape) or not all(_plain_int(d) and -1 <= d < ndim for d in dims):
            raise FormatViolation(f"sharding rule dims {list(dims)} do not fit a {ndim}-d tensor on its mesh")
        sharded = [d for d in dims if d >= 0]
        if len(set(sharded)) != len(sharded):
            raise FormatViolation("a tensor dimension is sharded by two mesh dimensions")
        return cls(w[0], dims)


def _plain_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def split(size: int, n: int, i: int) -> tuple[int, int]:
    """(offset, length) of shard ``i`` of ``n`` along a dimension of ``size``, as DTensor cuts
    it (``torch.chunk``: empty shards sit at offset ``size``)."""
    if size % n == 0:
        full = size // n
        return full * i, full
    full = -(-size // n)
    start = full * i
    return min(size, start), max(0, min(size, start + full) - start)


def salt(fqn: str) -> int:
    """The per-tensor offset of the replica that writes a replicated box."""
    return zlib.crc32(fqn.encode())


_SEEN_BOXES = 8  # boxes a geometry keeps (``Geometry.box``)


class Geometry:
    """The chunks of one tensor under a rule: boxes, overlap, owner ranks, by arithmetic."""

    __slots__ = ("size", "mesh", "dims", "salt", "itemsize", "_sharded", "_replicated", "_count", "_replicas",
                 "_strides", "_big", "_seen")

    def __init__(self, size: tuple[int, ...], mesh: Mesh, rule: ShardRule, salt_: int, itemsize: int,
                 seen: dict | None = None) -> None:
        self.size, self.mesh, self.dims, self.salt, self.itemsize = tuple(size), mesh, rule.dims, salt_, itemsize
        self._sharded, self._replicated, self._count, self._replicas, self._strides = _layout(mesh.shape, rule.dims)
        self._big: int | None = None  # _ALL_LARGE, _ALL_SMALL or _MIXED (``_alike``), found on first use
        # planning and reading ask for a rank's few chunks' boxes several times each: the last
        # few are kept (never all: a rule stands for up to millions of chunks).  ``seen``: the
        # boxes kept for geometries of one size and rule (a model's layers), shared
        self._seen: dict[int, tuple[tuple, tuple]] = {} if seen is None else seen

    def count(self) -> int:
        return self._count

    def replicas(self) -> int:
        """How many ranks hold each box."""
        return self._replicas

    def _coord(self, i: int) -> list[int]:
        """The sharded mesh dimensions' coordinate of chunk ``i`` (row-major)."""
        out = [0] * len(self._sharded)
        for k in range(len(self._sharded) - 1, -1, -1):
            n = self.mesh.shape[self._sharded[k]]
            out[k] = i % n
            i //= n
        return out

    def box(self, i: int) -> tuple[tuple, tuple]:
        box = self._seen.get(i)
        if box is not None:
            return box
        if len(self._sharded) == 1:  # one sharded mesh dimension (FSDP, HSDP): one split
            m = self._sharded[0]
            d = self.dims[m]
            o, z = split(self.size[d], self.mesh.shape[m], i % self.mesh.shape[m])
            box = ((0,) * d + (o,) + (0,) * (len(self.size) - d - 1),
                   self.size[:d] + (z,) + self.size[d + 1:])
        else:
            offs, sizes = [0] * len(self.size), list(self.size)
            for m, c in zip(self._sharded, self._coord(i)):
                d = self.dims[m]
                offs[d], sizes[d] = split(self.size[d], self.mesh.shape[m], c)
            box = tuple(offs), tuple(sizes)
        if len(self._seen) >= _SEEN_BOXES:
            self._seen.clear()
        self._seen[i] = box
        return box

    def boxes(self) -> list[tuple[tuple, tuple]]:
        return [self.box(i) for i in range(self._count)]

    def chunk_of(self, coord: tuple[int, ...]) -> int:
        """The chunk a rank at mesh coordinate ``coord`` holds."""
        i = 0
        for m in self._sharded:
            i = i * self.mesh.shape[m] + coord[m]
        return i

    def writer(self, i: int) -> tuple[int, ...]:
        """The mesh coordinate of the replica that writes chunk ``i``: the first replica for a
        small box (a rank then finds a tensor group's small boxes in one part), else replica
        ``(salt + i) mod replicas`` (the large ones spread over the replicas' bandwidth)."""
        coord = [0] * len(self.dims)
        for m, c in zip(self._sharded, self._coord(i)):
            coord[m] = c
        k = 0
        if self._replicas > 1 and math.prod(self.box(i)[1]) * self.itemsize > SMALL_BOX_BYTES:
            k = (self.salt + i) % self._replicas
        for m in reversed(self._replicated):
            coord[m] = k % self.mesh.shape[m]
            k //= self.mesh.shape[m]
        return tuple(coord)

    def owner(self, i: int) -> int:
        """The global rank whose part holds chunk ``i``: the mesh rank at ``writer(i)``, by
        strides where all boxes are alike (an even split), else through ``writer``."""
        shape = self.mesh.shape
        if self._replicas == 1 and len(shape) == 1:  # FSDP: chunk i is rank i's
            return self.mesh.ranks[i]
        if self._big is None:
            self._big = self._alike()
        if self._big == _MIXED and self._replicas > 1:  # boxes of different sizes: the general way
            flat = 0
            for n, c in zip(shape, self.writer(i)):
                flat = flat * n + c
            return self.mesh.ranks[flat]
        flat, j, strides = 0, i, self._strides
        for m in reversed(self._sharded):
            n = shape[m]
            flat += (j % n) * strides[m]
            j //= n
        if self._replicas > 1 and self._big == _ALL_LARGE:  # replica (salt + i) mod replicas wrote it
            k = (self.salt + i) % self._replicas
            for m in reversed(self._replicated):
                flat += (k % shape[m]) * strides[m]
                k //= shape[m]
        return self.mesh.ranks[flat]

    def _alike(self) -> int:
        return _alike(self.size, self.mesh.shape, self.dims, self.itemsize)

    def exact(self, offsets: tuple, sizes: tuple) -> int | None:
        """The chunk whose box is exactly (``offsets``, ``sizes``), else None."""
        if len(offsets) != len(self.size):
            return None
        i = 0
        for m in self._sharded:  # the shard each offset falls in, by arithmetic; the box decides
            d, n = self.dims[m], self.mesh.shape[m]
            full = -(-self.size[d] // n)
            c = offsets[d] // full if full else n
            if c >= n:
                return None
            i = i * n + c
        return i if self.box(i) == (offsets, sizes) else None

    def index_of(self, offsets: tuple) -> int | None:
        """The chunk stored at ``offsets`` (an empty one: the first such), or None."""
        if len(offsets) != len(self.size):
            return None
        i = 0
        for m in self._sharded:
            d, n = self.dims[m], self.mesh.shape[m]
            c = next((c for c in _candidates(self.size[d], n, offsets[d]) if split(self.size[d], n, c)[0] == offsets[d]),
                     None)
            if c is None:
                return None
            i = i * n + c
        unsharded = set(range(len(self.size))) - {self.dims[m] for m in self._sharded}
        return i if all(offsets[d] == 0 for d in unsharded) else None

    def overlapping(self, boxes: list[tuple[tuple, tuple]]) -> list[int]:
        """Chunks that overlap any of ``boxes`` ((offsets, sizes)), sorted; a 0-d tensor's one
        chunk always does, empty chunks never."""
        if not self.size:
            return [0]
        if not all(self.size):  # a dimension of size 0: every box is empty
            return []
        if len(self._sharded) == 1 and len(boxes) == 1:  # one sharded mesh dimension, one box (FSDP)
            offs, sizes = boxes[0]
            if len(offs) != len(self.size) or not all(sizes):
                return []
            m = self._sharded[0]
            d = self.dims[m]
            return list(_span(self.size[d], self.mesh.shape[m], offs[d], offs[d] + sizes[d]))
        hits: set[int] = set()
        for offs, sizes in boxes:
            if len(offs) != len(self.size) or not all(sizes):
                continue
            ranges = []
            for m in self._sharded:
                d, n = self.dims[m], self.mesh.shape[m]
                lo, hi = offs[d], offs[d] + sizes[d]
                ranges.append(_span(self.size[d], n, lo, hi))  # non-empty shards only
            for coord in itertools.product(*ranges):
                i = 0
                for m, c in zip(self._sharded, coord):
                    i = i * self.mesh.shape[m] + c
                hits.add(i)
        return sorted(hits)


@functools.lru_cache(maxsize=1024)
def _layout(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple:
    """What a rule's geometry needs of its mesh's shape, made once per (shape, dims): the sharded
    and the replicated mesh dimensions, the chunk count, the replica count and the row-major
    stride of each mesh dimension."""
    sharded = [m for m, d in enumerate(dims) if d >= 0]
    replicated = [m for m, d in enumerate(dims) if d < 0]
    strides = [math.prod(shape[m + 1:]) for m in range(len(shape))]
    return sharded, replicated, math.prod(shape[m] for m in sharded), math.prod(shape[m] for m in replicated), strides


@functools.lru_cache(maxsize=4096)
def _alike(size: tuple[int, ...], shape: tuple[int, ...], dims: tuple[int, ...], itemsize: int) -> int:
    """Whether every box of a rule is larger than ``SMALL_BOX_BYTES``, none is, or it differs
    by box (an uneven split: the last shards are shorter); made once per shape and layout."""
    sharded, _, count, _, _ = _layout(shape, dims)
    if any(size[dims[m]] % shape[m] for m in sharded) or not count:
        return _MIXED
    box = list(size)
    for m in sharded:
        box[dims[m]] //= shape[m]
    return _ALL_LARGE if math.prod(box) * itemsize > SMALL_BOX_BYTES else _ALL_SMALL


def _candidates(size: int, n: int, off: int):
    full = size // n if size % n == 0 else -(-size // n)
    if full and off < size:
        yield min(n - 1, off // full)
    else:  # an empty shard (offset == size): the first one
        yield from (c for c in range(n) if split(size, n, c)[1] == 0)


def _span(size: int, n: int, lo: int, hi: int) -> range:
    """Shard indices along one dimension whose [start, end) meets [lo, hi)."""
    full = size // n if size % n == 0 else -(-size // n)
    if full == 0 or hi <= lo or lo >= size:
        return range(0)
    return range(max(0, lo // full), min(n - 1, (min(hi, size) - 1) // full) + 1)


@dataclass(frozen=True, slots=True)
class RuleTable:
    """Sharding rules by tensor: one rank's (its DTensors, for the coordinator) or the save's
    (merged).  ``digest`` identifies the content: ranks holding the same tensors the same way
    send equal tables, and the coordinator reads each distinct table once."""
    meshes: tuple[Mesh, ...]
    rules: dict[str, ShardRule]
    digest: bytes

    def replicas(self, fqn: str) -> int:
        """How many ranks hold each box of tensor ``fqn`` (1: it has no rule, or is not replicated)."""
        rule = self.rules.get(fqn)
        return 1 if rule is None else _layout(self.meshes[rule.mesh].shape, rule.dims)[3]

    def chunk_of(self, fqn: str, size: tuple[int, ...], offsets: tuple[int, ...]) -> int:
        """The number of the chunk at ``offsets`` of tensor ``fqn`` (of ``size``) under its rule."""
        rule = self.rules[fqn]
        i = Geometry(size, self.meshes[rule.mesh], rule, 0, 1).index_of(tuple(offsets))
        if i is None:
            raise FormatViolation(f"tensor {fqn!r} has no chunk at {list(offsets)} under its sharding rule")
        return i

    @classmethod
    def of(cls, meshes: list[Mesh], rules: dict[str, ShardRule]) -> "RuleTable":
        h = xxhash.xxh3_128()
        for m in meshes:
            h.update(repr(m.to_wire()).encode())
        for fqn in sorted(rules):
            h.update(f"{fqn}\0{rules[fqn].mesh}\0{rules[fqn].dims}\0".encode())
        return cls(tuple(meshes), dict(rules), h.digest())


def merge_tables(tables: list["RuleTable | None"]) -> RuleTable:
    """One table for the save from every rank's; raises ``FormatViolation`` where two ranks give one
    tensor different rules.  Each distinct table is read once."""
    meshes: list[Mesh] = []
    where: dict[Mesh, int] = {}
    rules: dict[str, ShardRule] = {}
    seen: set[bytes] = set()
    for t in tables:
        if t is None or t.digest in seen:
            continue
        seen.add(t.digest)
        remap = []
        for m in t.meshes:
            if m not in where:
                where[m] = len(meshes)
                meshes.append(m)
            remap.append(where[m])
        for fqn, r in t.rules.items():
            r2 = ShardRule(remap[r.mesh], r.dims)
            if rules.setdefault(fqn, r2) != r2:
                raise FormatViolation(f"ranks shard tensor {fqn!r} differently ({rules[fqn]} and {r2})")
    return RuleTable.of(meshes, rules)
