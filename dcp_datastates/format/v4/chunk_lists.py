"""Format 4's chunk lists as int64 columns: the chunks of tensors without a rule (``Listed``:
boxes and the rank whose part holds each) and the records of replicated boxes the index holds
(``Held``: segments, and where their block digests start in their writer's part tail).  Columns
are validated in bulk when the index is decoded; a tensor's boxes are searched as numpy arrays,
or as Python lists made once for tables of up to ``_BULK`` chunks.  ``tensors`` are the index's
``IndexTensor`` list (fqn, dtype, size, rule), ``parts`` its ``PartRef`` by rank."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Callable, NamedTuple

import numpy as np

from ..checksum import DIGEST_BYTES, Digests, DigestTail
from ..columns import FEW_CHUNKS, FileList, disjoint, int_column, runs, segment_columns, starts
from ..limits import INT64, MAX_DIM, MAX_PART_BYTES, NO_INTS, FormatViolation
from ..model import BareBox, Chunk, Extent, Seg, box_hits, check_tiling, segs_problem
from .rank_files import PartTable

_BULK = 1 << 17  # listed chunks converted to Python lists at once (see Listed._lists)
INLINE = -1  # the owner of a chunk whose record is in the index's "inline" table


class HeldRecord(NamedTuple):
    """The record of one replicated box a rank wrote: the tensor's key, the box's chunk number
    under the tensor's rule (which gives the box and its writer), where its block digests start
    in the writer's part tail, and its segments as three parallel tuples.  ``PartRecord.of``
    packs those whose segments lie in the rank's own files into its rows; the others travel
    as they are (``RareRecord.held``)."""
    key: str
    chunk: int
    tail_at: int
    files: tuple[str, ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]

    @classmethod
    def of(cls, key: str, chunk: int, extent: Extent, tail_at: int) -> "HeldRecord":
        segs = extent.segs
        return cls(key, chunk, tail_at, tuple(g.file for g in segs), tuple(g.offset for g in segs),
                   tuple(g.nbytes for g in segs))


@dataclass(slots=True)
class HeldColumns:
    """Records of replicated boxes, which the index holds (a rank loading one reads no part),
    as int64 columns: per record the tensor, the box's chunk number, where its digests start in
    the writer's part tail and its number of segments; per segment its file's place in the
    index's file list, its offset and its length (segments in the order of their records)."""
    tensor: np.ndarray = field(default_factory=lambda: NO_INTS)
    chunk: np.ndarray = field(default_factory=lambda: NO_INTS)
    tail_at: np.ndarray = field(default_factory=lambda: NO_INTS)
    nsegs: np.ndarray = field(default_factory=lambda: NO_INTS)
    seg_file: np.ndarray = field(default_factory=lambda: NO_INTS)
    seg_offset: np.ndarray = field(default_factory=lambda: NO_INTS)
    seg_nbytes: np.ndarray = field(default_factory=lambda: NO_INTS)

    @classmethod
    def of(cls, records: list[HeldRecord], at: dict[str, int], fidx: dict[str, int]) -> "HeldColumns":
        """Records that name their files (``at``: each key's tensor number, ``fidx``: each
        file's place), transposed at once."""
        if not records:
            return cls()
        key, chunk, tail_at, files, offsets, nbytes = zip(*records)
        nsegs = list(map(len, files))
        segs = chain.from_iterable
        col = partial(np.asarray, dtype=INT64)
        return cls(col(list(map(at.__getitem__, key))), col(chunk), col(tail_at), col(nsegs),
                   col(list(map(fidx.__getitem__, segs(files)))), col(list(segs(offsets))), col(list(segs(nbytes))))

    @classmethod
    def join(cls, *parts: "HeldColumns") -> "HeldColumns":
        """The records of ``parts``, one after the other."""
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls.__slots__))

    def to_wire(self) -> dict:
        """The columns in (tensor, chunk) order, as the reader looks records up; raises
        ``FormatViolation`` where two ranks sent the same box (the save must not commit)."""
        tensor, chunk, nsegs = self.tensor, self.chunk, self.nsegs
        order = np.lexsort((chunk, tensor))
        if len(order) > 1 and not np.all(np.diff(tensor[order] * (1 << 24) + chunk[order]) > 0):
            raise FormatViolation("two ranks sent the record of one replicated box")
        first = starts(nsegs)
        if len(order) and int(nsegs.max()) > 1:  # each record's segments, records in order
            segs = runs(first[order], nsegs[order])
        else:
            segs = first[order]
        return {"tensor": tensor[order].tobytes(), "chunk": chunk[order].tobytes(),
                "tail_at": self.tail_at[order].tobytes(), "nsegs": nsegs[order].tobytes(),
                "seg_file": self.seg_file[segs].tobytes(), "seg_offset": self.seg_offset[segs].tobytes(),
                "seg_nbytes": self.seg_nbytes[segs].tobytes()}


class Listed:
    """The chunks of tensors without a rule, as int64 columns validated in bulk (owners, boxes
    inside their tensors); a tensor's boxes are shown disjoint when it is first used."""

    def __init__(self, raw, tensors: list, parts: PartTable, world: int) -> None:
        what = "explicit"
        t = int_column(raw, "tensor", None, 0, max(0, len(tensors) - 1), what)
        owner = int_column(raw, "owner", len(t), INLINE, world - 1, what)
        if parts.missing(owner[owner != INLINE]):
            raise FormatViolation("a listed chunk's owner has no metadata part")
        if len(t) and any(tensors[i].rule is not None for i in np.unique(t).tolist()):
            raise FormatViolation("a tensor with a sharding rule also has listed chunks")
        tnd = np.array([len(x.size) for x in tensors], dtype=INT64)
        nd = tnd[t] if len(t) else np.zeros(0, INT64)
        total = int(nd.sum())
        self.offs = int_column(raw, "offsets", total, 0, MAX_DIM, what)
        self.sizes = int_column(raw, "sizes", total, 0, MAX_DIM, what)
        self.cstart = starts(nd)
        if total:
            tsz = np.array([x for ts in tensors for x in ts.size], dtype=INT64)
            tstart = starts(tnd)
            chunk = np.repeat(np.arange(len(t)), nd)
            dim = np.arange(total) - self.cstart[chunk]
            if np.any(self.offs + self.sizes > tsz[tstart[t[chunk]] + dim]):
                raise FormatViolation("a listed chunk extends beyond its tensor")
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
                        self.cstart.tolist(), self.nd.tolist(), self.offs.tolist(), self.sizes.tolist(),
                        self.owner.tolist())
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
                bounds, order, cst, nd, offs, sizes, _ = py
                lo, hi = bounds.get(ti, (0, 0))
                got = [(tuple(offs[cst[c]:cst[c] + nd[c]]), tuple(sizes[cst[c]:cst[c] + nd[c]])) for c in order[lo:hi]]
            if len(got) <= FEW_CHUNKS:
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

    def box_of(self, ti: int, i: int) -> tuple[tuple, tuple]:
        """The box of tensor ``ti``'s chunk ``i``."""
        py = self._lists()
        if py is not None:  # one box from the lists, not the tensor's every box
            bounds, order, cst, nd, offs, sizes, _ = py
            c = order[bounds[ti][0] + i]
            a, k = cst[c], nd[c]
            return tuple(offs[a:a + k]), tuple(sizes[a:a + k])
        return self._box_list(ti)[i] if self.count(ti) <= FEW_CHUNKS else self.box(self.row(ti, i))

    def owner_of(self, ti: int, i: int) -> int:
        """The rank whose part holds tensor ``ti``'s chunk ``i`` (``INLINE``: the index)."""
        py = self._lists()
        return int(self.owner[self.row(ti, i)]) if py is None else py[6][self.row(ti, i)]

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
        if self.count(ti) > 1 and ti not in self._stacked_tensors():
            rows = self.rows(ti)
            offs, sizes = self._boxes(ti)
            live = np.all(sizes > 0, axis=1)
            if not disjoint(offs[live], sizes[live]):
                check_tiling(fqn, [BareBox(*self.box(int(c))) for c in rows.tolist()])
        self._checked.add(ti)

    def overlapping(self, ti: int, boxes: list[tuple[tuple, tuple]]) -> list[int]:
        if self.count(ti) <= FEW_CHUNKS:
            return [i for i, (o, z) in enumerate(self._box_list(ti)) if box_hits(o, z, boxes)]
        offs, sizes = self._boxes(ti)
        if offs.shape[1] == 0:
            return list(range(min(1, len(offs))))
        hit = np.zeros(len(offs), dtype=bool)
        live = np.all(sizes > 0, axis=1)
        for lo, n in boxes:
            lo_a = np.asarray(lo, dtype=INT64)
            hit |= live & np.all(offs < lo_a + np.asarray(n, dtype=INT64), axis=1) & np.all(offs + sizes > lo_a, axis=1)
        return np.nonzero(hit)[0].tolist()

    def position(self, ti: int, offsets: tuple) -> int | None:
        py = self._lists()
        if py is not None:  # compare list slices: no box built
            bounds, order, cst, nd, offs, _, _ = py
            lo, hi = bounds.get(ti, (0, 0))
            want = list(offsets)
            return next((i for i, c in enumerate(order[lo:hi]) if offs[cst[c]:cst[c] + nd[c]] == want), None)
        if self.count(ti) <= FEW_CHUNKS:
            return next((i for i, (o, _) in enumerate(self._box_list(ti)) if o == offsets), None)
        offs, _ = self._boxes(ti)
        if offs.shape[1] == 0:
            return 0 if len(offs) and offsets == () else None
        hit = np.nonzero(np.all(offs == np.asarray(offsets, dtype=INT64), axis=1))[0]
        return int(hit[0]) if len(hit) else None


class Held:
    """The records of replicated boxes that the index holds, in (tensor, chunk) order: per
    record its chunk number under the tensor's rule, its segments, and where its block digests
    start in the writer's part tail.  The rule gives the box and its writer; segments are
    checked against the files in bulk, a record against its box when used."""

    def __init__(self, raw, tensors: list, world: int, files: FileList, block_size: int) -> None:
        t = int_column(raw, "tensor", None, 0, max(0, len(tensors) - 1), "held")
        n = len(t)
        chunk = int_column(raw, "chunk", n, 0, world - 1, "held")  # a rule has at most a chunk per rank
        if n > 1 and not np.all(np.diff(t * (1 << 24) + chunk) > 0):
            raise FormatViolation("held records are not in (tensor, chunk) order, each once")
        with_ = np.unique(t).tolist()
        if any(tensors[i].rule is None for i in with_):
            raise FormatViolation("a held chunk's tensor has no sharding rule")
        self.tail_at = int_column(raw, "tail_at", n, 0, MAX_PART_BYTES, "held")
        nsegs = int_column(raw, "nsegs", n, 0, 1 << 16, "held")
        self.sfile, self.soff, self.sn, self.first = segment_columns(raw, nsegs, files, block_size, "held")
        self.t, self.chunk, self.nsegs = t, chunk, nsegs
        self.files, self.block_size = files, block_size
        self._with = frozenset(with_)
        self._lists: tuple | None = None  # the columns as Python lists, made on first use

    def has(self, t: int) -> bool:
        return t in self._with

    def _row(self, t: int, i: int) -> int | None:
        if self._lists is None:
            u, lo = np.unique(self.t, return_index=True)
            self._lists = (dict(zip(u.tolist(), lo.tolist())), self.chunk.tolist(), self.t.tolist(),
                           *(a.tolist() for a in (self.tail_at, self.first, self.nsegs, self.sfile, self.soff,
                                                  self.sn)))
        lo, chunk, ts = self._lists[0].get(t), self._lists[1], self._lists[2]
        if lo is None:
            return None
        c = lo + i  # records of every box of a tensor (the usual case): chunk i is the tensor's i-th
        if c < len(chunk) and ts[c] == t and chunk[c] == i:
            return c
        c = bisect_left(chunk, i, lo, bisect_left(ts, t + 1, lo))
        return c if c < len(chunk) and ts[c] == t and chunk[c] == i else None

    def chunk_of(self, t: int, i: int, offsets: tuple, sizes: tuple, owner: int,
                 tail: Callable[[int], DigestTail], nbytes: int) -> Chunk:
        """The held record of tensor ``t``'s chunk ``i`` (box ``offsets``, ``sizes``, written by
        ``owner``): it must hold exactly the box's ``nbytes``, its digests in the writer's tail."""
        c = self._row(t, i)
        if c is None:
            raise FormatViolation(f"no held chunk at {list(offsets)}")
        assert self._lists is not None, "_row made the lists"
        _, _, _, tail_at, first, nsegs, sfile, soff, sn = self._lists
        a, k = first[c], nsegs[c]
        name = self.files.name
        if k == 1:  # most records: one segment
            segs = [Seg(name(sfile[a]), soff[a], sn[a])]
        else:
            segs = [Seg(name(sfile[j]), soff[j], sn[j]) for j in range(a, a + k)]
        # one segment that holds the box's bytes, at most a block, is right plain or packed
        if (k != 1 or sn[a] != nbytes or not 0 < nbytes <= self.block_size) \
                and (problem := segs_problem(segs, nbytes, self.block_size)):
            raise FormatViolation(f"the held chunk at {list(offsets)}: {problem}")
        src = tail(owner)
        at, nd = tail_at[c], max(1, -(-nbytes // self.block_size)) * DIGEST_BYTES
        if at + nd > src.nbytes:
            raise FormatViolation(f"the held chunk at {list(offsets)} has its block digests past its part's")
        return Chunk(tuple(offsets), tuple(sizes), Extent(segs, nbytes, Digests.tail(src, at, nd)))

