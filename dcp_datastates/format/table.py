"""The tensor table of format version 3: every tensor's chunks as columns of integers.

Version 2 stored each chunk as a msgpack map (about 146 bytes a chunk, a dozen Python objects
and as many checks to decode).  Version 3 stores the same records as a handful of arrays, so a
manifest is validated in bulk, with numpy over whole columns, before any record is built:

======================  ============================  =========================================
field                   type                          per
======================  ============================  =========================================
``names``               list of str                   tensor (distinct)
``dtypes``              list of str                   distinct dtype, referenced by ``dtype``
``dtype``, ``ndim``     bytes, uint8                  tensor
``size``                bytes, int64 LE               tensor dimension (sum of ``ndim``)
``nchunks``             bytes, int64 LE               tensor
``offsets``, ``sizes``  bytes, int64 LE               chunk dimension, chunks in tensor order
``nsegs``               bytes, int64 LE               chunk; -1: the chunk is in ``special``
``seg_file``            bytes, int64 LE               segment: index into the manifest's files
``seg_offset``,         bytes, int64 LE               segment
``seg_nbytes``
``sums``                bytes                         block of a plain chunk: its 16-byte digest
``special``             map str(chunk index) -> map   chunk stored by a registered provider
======================  ============================  =========================================

A plain chunk holds ``max(1, ceil(nbytes / block_size))`` digests; its segments hold exactly
its bytes and every segment but its last ends on a block boundary.  ``docs/format.md`` has the
full specification.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import ManifestError
from .checksum import DIGEST_BYTES, Digests, DigestTail, join_digests
from .columns import (
    FEW_CHUNKS,
    byte_column,
    disjoint,
    extent_problems,
    int_bytes,
    int_column,
    packed_files,
    runs,
    segment_columns,
    starts,
)
from .dtypes import dtype_from_name
from .limits import INT64, MAX_DIM, MAX_ENTRIES, MAX_FILE_BYTES, MAX_NDIM, FormatViolation
from .model import BareBox, Chunk, Extent, Seg, TensorEntry, box_hits, check_tiling, segs_problem


def encode_table(tensors: dict[str, TensorEntry], file_index: dict[str, int], special_wire) -> dict:
    """The columns of ``tensors``; ``file_index``: each file's place in the manifest's file
    list; ``special_wire(chunk)``: the msgpack form of a provider chunk."""
    dtypes: dict[str, int] = {}
    dcode, ndim, size, nchunks = [], [], [], []
    offsets, sizes, nsegs, seg_file, seg_offset, seg_nbytes = [], [], [], [], [], []
    sums: list[bytes] = []
    special: dict[str, dict] = {}
    # bound once: this loop runs once per chunk (hundreds of thousands at scale)
    off_x, size_x, nsegs_a, file_a, soff_a, sn_a = (offsets.extend, sizes.extend, nsegs.append,
                                                     seg_file.append, seg_offset.append, seg_nbytes.append)
    sums_x, sums_a = sums.extend, sums.append
    ci = 0
    for t in tensors.values():
        dcode.append(dtypes.setdefault(t.dtype, len(dtypes)))
        ndim.append(len(t.size))
        size.extend(t.size)
        nchunks.append(len(t.chunks))
        for c in t.chunks:
            off_x(c.offsets)
            size_x(c.sizes)
            ext = c.extent
            if ext is None:
                nsegs_a(-1)
                special[str(ci)] = special_wire(c)
            else:
                nsegs_a(len(ext.segs))
                for s in ext.segs:
                    file_a(file_index[s.file])
                    soff_a(s.offset)
                    sn_a(s.nbytes)
                if type(ext.sums) is list:
                    sums_x(ext.sums)
                else:
                    sums_a(join_digests(ext.sums))
            ci += 1
    return {"names": list(tensors), "dtypes": list(dtypes), "dtype": bytes(dcode), "ndim": bytes(ndim),
            "size": int_bytes(size), "nchunks": int_bytes(nchunks), "offsets": int_bytes(offsets),
            "sizes": int_bytes(sizes), "nsegs": int_bytes(nsegs), "seg_file": int_bytes(seg_file),
            "seg_offset": int_bytes(seg_offset), "seg_nbytes": int_bytes(seg_nbytes), "sums": b"".join(sums),
            "special": special}


def tail_offsets(tensors: dict[str, TensorEntry]) -> dict[tuple[str, tuple], int]:
    """Where each plain chunk's block digests start in the ``sums`` column ``encode_table``
    builds of ``tensors`` (the tail of a format 4 part), by (key, offsets)."""
    out, at = {}, 0
    for fqn, t in tensors.items():
        for c in t.chunks:
            if c.extent is not None:
                out[(fqn, tuple(c.offsets))] = at
                at += len(c.extent.sums) * DIGEST_BYTES
    return out


def _ints(table: dict, key: str, n: int | None = None, lo: int = 0, hi: int = MAX_FILE_BYTES) -> np.ndarray:
    return int_column(table, key, n, lo, hi, "table field")


def _bytes(table: dict, key: str, n: int) -> np.ndarray:
    return byte_column(table, key, n, "table field")


def decode_table(table, files: Sequence[tuple[str, int]], block_size: int, special_chunk,
                 source: str = "<memory>", tail: DigestTail | None = None) -> dict[str, TensorEntry]:
    """Validate the columns in bulk; the tensors' records are built when first asked for.
    ``files``: the manifest's (name, size) list that ``seg_file`` indexes;
    ``special_chunk(fqn, offsets, sizes, wire)``: the record of a provider chunk (validated by
    the caller); ``source``: the file, named by errors found later (overlapping chunks);
    ``tail``: the block digests, when the manifest keeps them out of its table (a format 4 part)."""
    if not isinstance(table, dict):
        raise FormatViolation("the tensor table must be a map")
    names = table.get("names")
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise FormatViolation("table field 'names' must be a list of strings")
    nt = len(names)
    if len(set(names)) != nt:
        raise FormatViolation("tensor names must be distinct")
    dnames = table.get("dtypes")
    if not isinstance(dnames, list) or not all(isinstance(x, str) for x in dnames):
        raise FormatViolation("table field 'dtypes' must be a list of strings")
    itemsizes = np.asarray([dtype_from_name(d).itemsize for d in dnames] or [1], dtype=INT64)
    dcode = _bytes(table, "dtype", nt).astype(INT64)
    if nt and int(dcode.max()) >= len(dnames):
        raise FormatViolation("a tensor's dtype code is not in 'dtypes'")
    ndim = _bytes(table, "ndim", nt).astype(INT64)
    if nt and int(ndim.max()) > MAX_NDIM:
        raise FormatViolation(f"a tensor has more than {MAX_NDIM} dimensions (at most {MAX_NDIM})")
    gsize = _ints(table, "size", int(ndim.sum()), 0, MAX_DIM)
    nchunks = _ints(table, "nchunks", nt, 0, MAX_ENTRIES)
    nc = int(nchunks.sum())
    if nc > MAX_ENTRIES:
        raise FormatViolation(f"more than {MAX_ENTRIES} chunks")
    chunk_t = np.repeat(np.arange(nt, dtype=INT64), nchunks)
    cnd = ndim[chunk_t]
    nd_total = int(cnd.sum())
    offs = _ints(table, "offsets", nd_total, 0, MAX_DIM)
    sizes = _ints(table, "sizes", nd_total, 0, MAX_DIM)
    cstart = starts(cnd)
    # each chunk dimension against its tensor's: offset + size <= size of the tensor
    gidx = runs(starts(ndim)[chunk_t], cnd)
    over = np.nonzero(offs + sizes > gsize[gidx])[0]
    if len(over):
        c = int(np.searchsorted(cstart, over[0], side="right") - 1)
        raise FormatViolation(f"{names[int(chunk_t[c])]}: a chunk leaves the tensor (dimension {int(over[0] - cstart[c])})")
    # elements and bytes of each chunk (0-d chunks hold one element)
    numel = np.ones(nc, dtype=INT64)
    has = np.nonzero(cnd)[0]
    if len(has):
        approx = np.multiply.reduceat(sizes.astype(np.float64), cstart[has])
        if float(approx.max()) > MAX_FILE_BYTES:
            raise FormatViolation("a chunk is absurdly large")
        numel[has] = np.multiply.reduceat(sizes, cstart[has])
    nbytes = numel * itemsizes[dcode[chunk_t]] if nc else numel
    nsegs = _ints(table, "nsegs", nc, -1, MAX_ENTRIES)
    plain = nsegs >= 0
    segc = np.where(plain, nsegs, 0)
    ns = int(segc.sum())
    if ns > MAX_ENTRIES:
        raise FormatViolation("too many segments")
    sfile, soff, sn, sstart = segment_columns(table, segc, files, block_size, "table field")
    wrong = extent_problems(segc, sstart, sn, packed_files(files)[sfile] if ns else np.zeros(0, bool),
                            nbytes, block_size)
    wrong = wrong[plain[wrong]]
    if len(wrong):
        c = int(wrong[0])
        segs = [Seg(files[int(f)][0], 0, int(k)) for f, k in zip(sfile[sstart[c]:sstart[c] + segc[c]].tolist(),
                                                                 sn[sstart[c]:sstart[c] + segc[c]].tolist())]
        raise FormatViolation(f"{names[int(chunk_t[c])]}: {segs_problem(segs, int(nbytes[c]), block_size)}")
    nsums = np.where(plain, np.maximum(1, -(-nbytes // block_size)), 0)
    sums = table.get("sums") if tail is None else tail
    if tail is not None and "sums" in table:
        raise FormatViolation("block digests are both in the table and in the file's tail")
    got = tail.nbytes if tail is not None else (len(sums) if isinstance(sums, bytes) else -1)
    if got != int(nsums.sum()) * DIGEST_BYTES:
        raise FormatViolation(f"table field 'sums': expected {int(nsums.sum())} block digests of {DIGEST_BYTES} bytes")
    special = table.get("special") or {}
    if not isinstance(special, dict) or sorted(special) != sorted(str(i) for i in np.nonzero(~plain)[0].tolist()):
        raise FormatViolation("table field 'special' must hold exactly the chunks whose 'nsegs' is -1")
    table = Table(names, ndim, gsize, nchunks, cstart, offs, sizes, numel, nbytes, nsegs, sstart,
                  sfile, soff, sn, nsums, sums, files, source)
    for key, wire in special.items():  # provider chunks: few, validated now
        c = int(key)
        t = int(chunk_t[c])
        table.special[c] = special_chunk(names[t], *table.box(c, t), wire)
    dims, first = gsize.tolist(), table.first_dim.tolist()  # every tensor's size from two lists, not per tensor arrays
    return {fqn: TensorEntry(dnames[d], tuple(dims[a:a + k]), table=table, row=t)
            for t, (fqn, d, a, k) in enumerate(zip(names, dcode.tolist(), first, ndim.tolist()))}


class Table:
    """The validated columns of a version 3 manifest.  A tensor's chunk records are built when
    first asked for (``TensorEntry.chunks``); ``find`` and ``overlapping`` work on the columns.
    A ``model.ChunkTable``."""

    lazy = True

    def __init__(self, names, ndim, gsize, nchunks, chunk_dim, offs, sizes, numel, nbytes, nsegs,
                 first_seg, sfile, soff, sn, nsums, sums, files, source: str) -> None:
        self.names, self.ndim, self.gsize, self.nchunks = names, ndim, gsize, nchunks
        self.offs, self.sizes, self.numel, self.nbytes, self.nsegs = offs, sizes, numel, nbytes, nsegs
        self.sfile, self.soff, self.sn, self.sums, self.nsums = sfile, soff, sn, sums, nsums
        self.special: dict[int, Chunk] = {}
        self.files = files  # (name, size) by the position segments give
        self.source = source
        self._rows_cache: dict[int, np.ndarray] = {}
        self._small_boxes: dict[int, list] = {}
        self.first_chunk = starts(nchunks)
        self.first_dim = starts(ndim)
        self.chunk_dim, self.first_seg = chunk_dim, first_seg  # where each chunk's dims, segments start
        self.first_sum = starts(nsums) * DIGEST_BYTES
        self._checked: set[int] = set()
        self._stacked: frozenset[int] | None = None

    def _stacked_tensors(self) -> frozenset[int]:
        """Tensors whose non-empty boxes are shown disjoint in one pass over every chunk of the
        table: sorted by their start along the first dimension, each ends before the next
        starts (FSDP's shards, and any split of dimension 0).  The others are checked alone."""
        if self._stacked is None:
            t_of = np.repeat(np.arange(len(self.nchunks), dtype=INT64), self.nchunks)
            live = np.nonzero((self.ndim[t_of] > 0) & (self.numel > 0))[0]
            tid = t_of[live]
            start = self.offs[self.chunk_dim[live]]
            end = start + self.sizes[self.chunk_dim[live]]
            order = np.lexsort((start, tid))
            tid, start, end = tid[order], start[order], end[order]
            bad = np.unique(tid[:-1][(tid[:-1] == tid[1:]) & (end[:-1] > start[1:])])
            many = np.nonzero((self.nchunks > 1) & (self.ndim > 0))[0]  # 0-d: the exact check
            self._stacked = frozenset(np.setdiff1d(many, bad).tolist())
        return self._stacked

    def size(self, t: int) -> tuple[int, ...]:
        a = int(self.first_dim[t])
        return tuple(self.gsize[a:a + int(self.ndim[t])].tolist())

    def _rows(self, t: int) -> tuple[int, int, int]:
        c0 = int(self.first_chunk[t])
        return c0, c0 + int(self.nchunks[t]), int(self.ndim[t])

    def _boxes(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        c0, c1, nd = self._rows(t)
        a = int(self.chunk_dim[c0]) if c1 > c0 else 0
        return (self.offs[a:a + (c1 - c0) * nd].reshape(c1 - c0, nd),
                self.sizes[a:a + (c1 - c0) * nd].reshape(c1 - c0, nd))

    def chunk(self, c: int, t: int, box: tuple | None = None) -> Chunk:
        """The record of chunk ``c`` (a row of the table) of tensor ``t`` (``box``: its box, when known)."""
        o, z = self.box(c, t) if box is None else box
        n = self.nsegs.item(c)  # .item: a Python int without a numpy scalar on the way
        if n < 0:
            return self.special[c]
        s0 = self.first_seg.item(c)
        if n == 1:  # most chunks: no slices
            segs = [Seg(self.files[self.sfile.item(s0)][0], self.soff.item(s0), self.sn.item(s0))]
        else:
            segs = [Seg(self.files[int(f)][0], int(off), int(k)) for f, off, k in
                    zip(self.sfile[s0:s0 + n].tolist(), self.soff[s0:s0 + n].tolist(), self.sn[s0:s0 + n].tolist())]
        d, k = self.first_sum.item(c), self.nsums.item(c) * DIGEST_BYTES
        sums = Digests.tail(self.sums, d, k) if isinstance(self.sums, DigestTail) else Digests(self.sums[d:d + k])
        return Chunk(o, z, Extent(segs, self.nbytes.item(c), sums))

    def rows(self, t: int) -> np.ndarray:
        """Table rows of tensor ``t``'s chunks in record order (empty chunks folded into the
        first), cached."""
        got = self._rows_cache.get(t)
        if got is None:
            c0, c1, _ = self._rows(t)
            if c1 - c0 == 1:  # one chunk (most small tensors): no array arithmetic
                got = self._rows_cache[t] = np.array([c0])
                return got
            live = np.nonzero(self.numel[c0:c1])[0]
            empty = np.nonzero(self.numel[c0:c1] == 0)[0][:1]
            got = self._rows_cache[t] = c0 + np.sort(np.concatenate([live, empty]))
        return got

    def count(self, t: int) -> int:
        return len(self.rows(t))

    @staticmethod
    def layout_key(t: int) -> None:
        """Listed boxes are the tensor's own: none is shared by construction."""
        return None

    def box_at(self, t: int, i: int) -> tuple[tuple, tuple]:
        """(offsets, sizes) of tensor ``t``'s record ``i``."""
        return self.box(int(self.rows(t)[i]), t)

    def chunk_at(self, t: int, i: int) -> Chunk:
        """Tensor ``t``'s record ``i`` alone (its boxes checked first)."""
        self.check(t)
        return self.chunk(int(self.rows(t)[i]), t)

    def box_list(self, t: int) -> list[tuple[tuple, tuple]]:
        """(offsets, sizes) of tensor ``t``'s records, in order (kept for small tensors)."""
        got = self._small_boxes.get(t)
        if got is not None:
            return got
        rows = self.rows(t) - int(self.first_chunk[t])
        offs, sizes = self._boxes(t)
        got = [(tuple(o), tuple(z)) for o, z in zip(offs[rows].tolist(), sizes[rows].tolist())]
        if len(got) <= FEW_CHUNKS:
            self._small_boxes[t] = got
        return got

    def box(self, c: int, t: int) -> tuple[tuple, tuple]:
        """(offsets, sizes) of chunk ``c`` (a row of the table) of tensor ``t``."""
        nd, a = self.ndim.item(t), self.chunk_dim.item(c)
        return tuple(self.offs[a:a + nd].tolist()), tuple(self.sizes[a:a + nd].tolist())

    def _invalid(self, e: Exception) -> ManifestError:
        return ManifestError(f"invalid manifest: {e}", checkpoint=self.source)

    def records(self, t: int) -> list[Chunk]:
        """Every chunk record of tensor ``t``: empty chunks folded into one, boxes disjoint."""
        try:
            return self._records(t)
        except FormatViolation as e:
            raise self._invalid(e) from None

    def _records(self, t: int) -> list[Chunk]:
        out = [self.chunk(c, t) for c in self.rows(t).tolist()]
        if len(out) > 1:
            check_tiling(self.names[t], out)
        self._checked.add(t)
        return out

    def check(self, t: int) -> None:
        """Boxes of tensor ``t`` disjoint, checked over the columns (a sort along the dimension
        with the most distinct offsets); records are built only when that is not conclusive."""
        try:
            self._check(t)
        except FormatViolation as e:
            raise self._invalid(e) from None

    def _check(self, t: int) -> None:
        if t in self._checked:
            return
        if int(self.nchunks[t]) == 1:  # one box, inside the tensor (checked in bulk): nothing to overlap
            self._checked.add(t)
            return
        if t in self._stacked_tensors():
            self._checked.add(t)
            return
        if int(self.nchunks[t]) <= FEW_CHUNKS:  # a few boxes: the sweep on plain tuples is cheaper
            check_tiling(self.names[t], [BareBox(o, z) for o, z in self.box_list(t)])
            self._checked.add(t)
            return
        offs, sizes = self._boxes(t)
        keep = np.all(sizes > 0, axis=1) if offs.shape[1] else np.zeros(len(offs), dtype=bool)
        offs, sizes = offs[keep], sizes[keep]
        if len(offs) > 1 and not disjoint(offs, sizes):
            self.records(t)  # not shown disjoint over the columns: the full sweep decides (raises)
        self._checked.add(t)

    def exact(self, t: int, box: tuple[tuple, tuple]) -> int | None:
        """Position (in record order) of tensor ``t``'s chunk whose box is exactly ``box``, else None."""
        if int(self.nchunks[t]) == 1:
            return 0 if self.box(int(self.first_chunk[t]), t) == box else None
        keep = self.overlapping(t, [box])  # boxes are disjoint: the exact one overlaps it alone
        return keep[0] if len(keep) == 1 and self.box_at(t, keep[0]) == box else None

    def find(self, t: int, offsets: tuple) -> Chunk | None:
        if self.nchunks.item(t) == 1:  # most tensors of a rank's part: compare the one box
            c = self.first_chunk.item(t)
            box = self.box(c, t)
            return self.chunk(c, t, box) if box[0] == tuple(offsets) else None
        self.check(t)
        offs, _ = self._boxes(t)
        if offs.shape[1] == 0:
            hit = np.arange(len(offs)) if offsets == () else np.array([], dtype=np.int64)
        else:
            hit = np.nonzero(np.all(offs == np.asarray(offsets, dtype=INT64), axis=1))[0]
        return self.chunk(int(self.first_chunk[t]) + int(hit[0]), t) if len(hit) else None

    def record_at(self, t: int, at, key: tuple) -> Chunk | None:
        """The record a read item names: tensor ``t``'s record ``at`` (DCP's planners number
        the chunks they were given) when it is stored at offsets ``key``, else the one stored
        there; a one-chunk tensor (most of a state's) is compared with its one box at once."""
        if self.nchunks.item(t) != 1 and isinstance(at, int) and 0 <= at < self.count(t):
            chunk = self.chunk_at(t, at)
            if chunk.offsets == key:
                return chunk
        return self.find(t, key)

    def writer_at(self, t: int, at, key: tuple) -> None:
        """Records and digests are in the manifest itself."""
        return None

    def find_box(self, t: int, offsets: tuple, sizes: tuple) -> Chunk | None:
        """The record of tensor ``t``'s chunk whose box is exactly (``offsets``, ``sizes``), else
        None (the index's rule says where a chunk is; its part must hold that very box)."""
        if self.nchunks.item(t) == 1:  # most tensors of a rank's part: compare the one box
            c = self.first_chunk.item(t)
            nd, a = self.ndim.item(t), self.chunk_dim.item(c)
            if self.offs[a:a + nd].tolist() != list(offsets) or self.sizes[a:a + nd].tolist() != list(sizes):
                return None
            return self.chunk(c, t, (tuple(offsets), tuple(sizes)))
        chunk = self.find(t, offsets)
        return chunk if chunk is not None and chunk.sizes == tuple(sizes) else None

    def overlapping(self, t: int, boxes: list[tuple[tuple, tuple]]) -> list[int]:
        """Positions (in tensor ``t``'s record order) of the chunks that overlap any of
        ``boxes`` ((offsets, sizes) pairs), empty chunks left out."""
        self.check(t)
        if int(self.nchunks[t]) <= FEW_CHUNKS:
            return [i for i, (o, z) in enumerate(self.box_list(t)) if box_hits(o, z, boxes)]
        rows = self.rows(t)
        offs, sizes = self._boxes(t)
        offs, sizes = offs[rows - int(self.first_chunk[t])], sizes[rows - int(self.first_chunk[t])]
        if offs.shape[1] == 0:
            return list(range(min(1, len(offs))))
        hit = np.zeros(len(offs), dtype=bool)
        live = np.all(sizes > 0, axis=1)
        for lo, n in boxes:
            lo_a, hi_a = np.asarray(lo, dtype=INT64), np.asarray(lo, dtype=INT64) + np.asarray(n, dtype=INT64)
            hit |= live & np.all(offs < hi_a, axis=1) & np.all(offs + sizes > lo_a, axis=1)
        return np.nonzero(hit)[0].tolist()
