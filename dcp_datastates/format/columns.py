"""Integer columns: how formats 3 and 4 store many records as a few arrays.

Each column is little-endian int64 bytes (or uint8 bytes), validated in bulk with numpy when
decoded (length, and every value in its range) before any record is made of it.  The helpers
here are shared by the version 3 table (``table.py``) and the version 4 index (``v4/``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .codec import MAX_STORED
from .limits import INT64, MAX_FILE_BYTES, FormatViolation
from .names import is_packed_file


def int_bytes(values) -> bytes:
    """A column of ints as little-endian int64 bytes (what ``int_column`` reads back)."""
    return np.asarray(values, dtype=INT64).tobytes()


def int_column(d: dict, key: str, n: int | None = None, lo: int = 0, hi: int = MAX_FILE_BYTES,
               what: str = "field") -> np.ndarray:
    """Column ``key`` of map ``d``: little-endian int64 bytes, ``n`` entries (None: any), every
    value in [lo, hi]; ``what`` names the map in errors."""
    raw = d.get(key) if isinstance(d, dict) else None
    if not isinstance(raw, bytes) or len(raw) % 8:
        raise FormatViolation(f"{what} {key!r} must be bytes of little-endian int64")
    a = np.frombuffer(raw, dtype=INT64)
    if n is not None and len(a) != n:
        raise FormatViolation(f"{what} {key!r} holds {len(a)} entries, expected {n}")
    if len(a) and (int(a.min()) < lo or int(a.max()) > hi):
        bad = int(a.min()) if int(a.min()) < lo else int(a.max())
        raise FormatViolation(f"{what} {key!r} holds {bad}, " + ("a negative value" if bad < 0 else f"outside [{lo}, {hi}]"))
    return a


def byte_column(d: dict, key: str, n: int, what: str = "field") -> np.ndarray:
    """Column ``key`` of map ``d``: ``n`` bytes, one uint8 per entry."""
    raw = d.get(key) if isinstance(d, dict) else None
    if not isinstance(raw, bytes) or len(raw) != n:
        raise FormatViolation(f"{what} {key!r} must be {n} bytes")
    return np.frombuffer(raw, dtype=np.uint8)


def starts(counts: np.ndarray) -> np.ndarray:
    """Where each run of ``counts`` starts in the concatenation."""
    out = np.zeros(len(counts), dtype=INT64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=out[1:])
    return out


def runs(first: np.ndarray, counts: np.ndarray, step: int = 1) -> np.ndarray:
    """Runs of indices laid end to end: for each i, ``counts[i]`` of them from ``first[i]``,
    ``step`` apart."""
    return np.repeat(first - step * starts(counts), counts) + step * np.arange(int(counts.sum()), dtype=INT64)


def _no_more_names(j: int) -> str:
    raise IndexError(j)


class FileList(Sequence):
    """A manifest's files by position, as segments number them: ``(name, size)`` pairs, the
    ``listed`` ones first, then ``more_sizes`` whose names ``name_of(j)`` makes when asked
    (format 4's rank files: 32,768 at 16,384 ranks, of which a rank uses a few)."""

    __slots__ = ("_listed", "_more", "_name_of", "_more_packed")

    def __init__(self, listed: list[tuple[str, int]], more_sizes: np.ndarray | None = None,
                 name_of: Callable[[int], str] = _no_more_names, more_packed: np.ndarray | None = None) -> None:
        self._listed = listed
        self._more = np.zeros(0, dtype=INT64) if more_sizes is None else more_sizes
        self._name_of = name_of
        self._more_packed = np.zeros(len(self._more), dtype=bool) if more_packed is None else more_packed

    def __len__(self) -> int:
        return len(self._listed) + len(self._more)

    def __getitem__(self, i: int) -> tuple[str, int]:
        n = len(self._listed)
        if i < n:
            return self._listed[i]
        j = i - n
        if j >= len(self._more):
            raise IndexError(i)
        return self._name_of(j), int(self._more[j])

    def name(self, i: int) -> str:
        """The name of the file at position ``i``."""
        n = len(self._listed)
        return self._listed[i][0] if i < n else self._name_of(i - n)

    def sizes(self) -> np.ndarray:
        """Every file's size, by position."""
        return np.concatenate([np.asarray([s for _, s in self._listed], dtype=INT64), self._more])

    def packed(self) -> np.ndarray:
        """Whether each file, by position, holds compressed blocks."""
        listed = np.asarray([is_packed_file(n) for n, _ in self._listed], dtype=bool).reshape(-1)
        return np.concatenate([listed, self._more_packed])


def segment_columns(d: dict, counts: np.ndarray, files: Sequence[tuple[str, int]], block_size: int,
                    what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The segments of extents, ``counts[i]`` for extent ``i``, from columns ``seg_file`` (a
    position in ``files``), ``seg_offset`` and ``seg_nbytes`` of ``d``: each inside its file,
    every plain segment but an extent's last a whole number of checksum blocks (a segment in a
    file of compressed blocks is one stored block).  Returns the three columns and where each
    extent's segments start."""
    ns = int(counts.sum())
    fsizes = files.sizes() if isinstance(files, FileList) else np.asarray([s for _, s in files], dtype=INT64)
    fsizes = fsizes if len(fsizes) else np.zeros(1, dtype=INT64)
    sfile = int_column(d, "seg_file", ns, 0, max(0, len(files) - 1), what)
    soff = int_column(d, "seg_offset", ns, 0, MAX_FILE_BYTES, what)
    sn = int_column(d, "seg_nbytes", ns, 0, MAX_FILE_BYTES, what)
    if ns and not files:
        raise FormatViolation("extent refers to a file not listed in the manifest")
    past = np.nonzero(soff + sn > fsizes[sfile])[0]
    if len(past):
        i = int(past[0])
        raise FormatViolation(f"extent [{int(soff[i])}, {int(soff[i] + sn[i])}) runs past the end of "
                   f"{files[int(sfile[i])][0]} ({files[int(sfile[i])][1]} bytes)")
    start = starts(counts)
    if ns:
        last = np.zeros(ns, dtype=bool)
        last[(start + counts - 1)[counts > 0]] = True
        cut = ~last & (sn % block_size != 0)  # plain checkpoints have none: no file names are read
        if cut.any() and np.any(cut & ~packed_files(files)[sfile]):
            raise FormatViolation("a segment other than an extent's last ends inside a checksum block")
    return sfile, soff, sn, start


def packed_files(files: Sequence[tuple[str, int]]) -> np.ndarray:
    """Whether each file, by position, holds compressed blocks (``names.is_packed_file``)."""
    if isinstance(files, FileList):
        return files.packed()
    return np.asarray([is_packed_file(name) for name, _ in files], dtype=bool).reshape(-1)


def extent_problems(counts: np.ndarray, start: np.ndarray, sn: np.ndarray, packed: np.ndarray,
                    nbytes: np.ndarray, block_size: int) -> np.ndarray:
    """The extents (``counts[i]`` segments from ``start[i]``, of ``nbytes[i]`` bytes) whose
    segments do not hold them, in bulk: what ``model.segs_problem`` checks one extent at a time.
    ``packed``: per segment, whether its file holds compressed blocks."""
    held = np.concatenate([[0], np.cumsum(sn)])
    total = held[start + counts] - held[start]
    cpk = np.concatenate([[0], np.cumsum(packed.astype(INT64))])
    npk = cpk[start + counts] - cpk[start]
    plain = npk == 0
    wrong = plain & ((total != nbytes) | ((nbytes > 0) & (counts == 0)))
    wrong |= ~plain & ((npk != counts) | (counts != -(-nbytes // block_size)))
    big = np.nonzero(packed & ((sn < 1) | (sn > MAX_STORED)))[0]
    if len(big):  # the extents those segments belong to
        wrong[np.searchsorted(start, big, side="right") - 1] = True
    return np.nonzero(wrong)[0]


FEW_CHUNKS = 32  # tensors with at most this many chunks are checked and searched in plain Python


def disjoint(offs: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether boxes ((n, ndim) offsets and sizes, none empty) are disjoint, shown over the
    columns: dimension by dimension (most distinct offsets first), boxes of one group sorted by
    start must either not overlap their neighbour or span the same interval, which then forms a
    narrower group for the next dimension (the bands of a sharding grid).  False when that does
    not settle it (the caller runs the exact sweep) or when two boxes coincide."""
    n, nd = offs.shape
    group = np.zeros(n, dtype=INT64)
    for d in sorted(range(nd), key=lambda k: -len(np.unique(offs[:, k]))):
        start, end = offs[:, d], offs[:, d] + sizes[:, d]
        order = np.lexsort((start, group))
        g, a, b = group[order], start[order], end[order]
        same = g[:-1] == g[1:]
        overlap = same & (b[:-1] > a[1:])
        if not overlap.any():
            return True
        if np.any(overlap & ((a[:-1] != a[1:]) | (b[:-1] != b[1:]))):
            return False
        group = np.unique(np.stack([group, start, end], axis=1), axis=0, return_inverse=True)[1].reshape(-1)
    return False
