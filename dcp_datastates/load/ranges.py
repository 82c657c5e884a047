"""Byte ranges of a load: what one read fetches, and how small ones are grouped.

A read item becomes byte ranges of stored chunks, widened to whole checksum blocks so that
every byte read is verified.  Small ranges that lie close together in one file are read as
one request (a *run*) and verified and copied out piece by piece: one request per run of the
file instead of one per tensor, which for an object store is one GET per tensor.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from ..format.model import Extent

READ_PIECE = 16 << 20  # the largest single read of a range (one thread's piece)

# A piece of at most COALESCE_PIECE bytes joins the run of its file when the gap from the
# run's end is at most COALESCE_GAP; a run stops growing at COALESCE_RUN bytes.
COALESCE_PIECE = 64 << 10
COALESCE_GAP = 16 << 10
COALESCE_RUN = 4 << 20

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ByteRange:
    """``nbytes`` at ``file_offset`` of data file ``file``, read into its task's buffer at
    ``buf_offset``; they start at block ``first_block`` of ``extent`` (whose digests check them).
    ``stored`` >= 0: the range is one compressed block, ``stored`` bytes at ``file_offset``
    that decode to its ``nbytes``."""
    file: str
    file_offset: int
    nbytes: int
    buf_offset: int
    first_block: int
    extent: Extent
    stored: int = -1


class Ranged(Protocol):
    """A task that reads ranges into a buffer (``tasks.ReadTask`` and ``tasks.SmallTask``)."""

    ri: Any  # DCP's ReadItem
    ranges: list[ByteRange]
    streamed: bool
    block_size: int
    whole_tensor: bool  # its chunk is its whole tensor (replicated, or saved by one rank)

    def buffer(self) -> tuple[np.ndarray, int]:
        """The bytes to read into (a numpy view) and the address of the first."""
        ...


Piece = tuple[Ranged, int]  # a task and the position of one of its ranges


def block_ranges(ext: Extent, start: int, n: int, buf_off: int, block_size: int) -> list[ByteRange]:
    """Chunk bytes ``[start, start + n)`` of ``ext`` (``start`` on a block boundary), read into
    a buffer at ``buf_off``: per segment, in pieces of at most ``READ_PIECE``."""
    if ext.packed:  # one range per compressed block
        b0, b1 = start // block_size, -(-(start + n) // block_size)
        return [ByteRange(g.file, g.offset, min(block_size, ext.nbytes - b * block_size),
                          buf_off + b * block_size - start, b, ext, g.nbytes)
                for b, g in enumerate(ext.segs[b0:b1], b0)]
    step = max(block_size, READ_PIECE // block_size * block_size)
    out = []
    for name, file_off, pos, length in ext.locate(start, n):
        for s in range(0, length, step):
            out.append(ByteRange(name, file_off + s, min(step, length - s), buf_off + pos + s,
                                 (start + pos + s) // block_size, ext))
    return out


def coalesce(pieces: list[Piece], gap: int = COALESCE_GAP) -> tuple[list[list[Piece]], list[Piece]]:
    """Split ``pieces`` into runs of small ones that lie close together in one file (at most
    ``gap`` bytes apart; each run sorted by file offset, at least two pieces), and the pieces
    left to read one by one."""
    small: dict[str, list[Piece]] = defaultdict(list)
    rest: list[Piece] = []
    for t, i in pieces:
        r = t.ranges[i]
        if r.nbytes <= COALESCE_PIECE and not t.streamed and r.stored < 0:
            small[r.file].append((t, i))
        else:
            rest.append((t, i))
    runs: list[list[Piece]] = []

    def close(run: list[Piece]) -> None:
        if len(run) > 1:
            runs.append(run)
        else:
            rest.extend(run)

    for group in small.values():
        group.sort(key=lambda p: p[0].ranges[p[1]].file_offset)
        run: list[Piece] = []
        start = end = 0
        for p in group:
            r = p[0].ranges[p[1]]
            off, n = r.file_offset, r.nbytes
            if run and (off - end > gap or off + n - start > COALESCE_RUN or off < end):
                close(run)
                run = []
            if not run:
                start = off
            run.append(p)
            end = off + n
        close(run)
    return runs, rest


def batches(items: Sequence[_T], nbytes: Callable[[_T], int], target: int = 8 << 20,
            per_item: int = 64 << 10) -> list[list[_T]]:
    """``items`` in order, in batches of about ``target`` bytes, counting each item at least
    ``per_item`` (so a batch holds at most ``target / per_item`` small ones): one pool task per
    batch, since a future and a lock per 64-byte tensor cost more than its read."""
    out: list[list[_T]] = []
    batch: list[_T] = []
    size = 0
    for x in items:
        batch.append(x)
        size += max(nbytes(x), per_item)
        if size >= target:
            out.append(batch)
            batch, size = [], 0
    if batch:
        out.append(batch)
    return out


def strides_of(sizes: Sequence[int]) -> list[int]:
    """Row-major element strides of a chunk of ``sizes``."""
    return [math.prod(sizes[i + 1:]) for i in range(len(sizes))]


def box_runs(offs: Sequence[int], lens: Sequence[int], sizes: Sequence[int], item: int) -> list[tuple[int, int]]:
    """Byte ranges (in the chunk) of the contiguous runs that make up the box."""
    nd = len(sizes)
    if nd == 0:
        return [(0, item)]
    # innermost dims where the box spans the whole dim fold into the run
    d = nd - 1
    while d > 0 and lens[d] == sizes[d]:
        d -= 1
    inner = math.prod(sizes[d + 1:])
    run_elems = lens[d] * inner
    strides = strides_of(sizes)
    outer = [range(o, o + ln) for o, ln in zip(offs[:d], lens[:d])]
    count = math.prod(lens[:d]) if d else 1
    if count > 1 << 16:  # too many tiny runs: the covering read is cheaper
        first = sum(o * s for o, s in zip(offs, strides))
        last = sum((o + ln - 1) * s for o, ln, s in zip(offs, lens, strides)) + 1
        return [(first * item, last * item)]
    out = []
    for idx in itertools.product(*outer):
        start = (sum(i * s for i, s in zip(idx, strides[:d])) + offs[d] * strides[d]) * item
        out.append((start, start + run_elems * item))
    return out
