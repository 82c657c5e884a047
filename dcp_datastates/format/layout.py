"""Where bytes go inside a rank's data file.

An extent of ``ALIGNMENT`` (4 KiB) or more starts on a 4 KiB boundary, so that it can be
written from the page-aligned host cache with O_DIRECT and read back in whole device blocks.
A smaller one is packed on a ``PACK_ALIGNMENT`` (64-byte) boundary: it is written as part of
a coalesced run and read buffered, so a 4 KiB slot would only waste space (20,000 tensors of
64 bytes took 82 MB of file that way, for 1.3 MB of data).  Gaps are zero padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from .names import PACKED_STRIPE

ALIGNMENT = 4096
PACK_ALIGNMENT = 64  # extents under ALIGNMENT bytes (any dtype's alignment, a cache line)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def align_down(n: int, alignment: int = ALIGNMENT) -> int:
    return n // alignment * alignment


class FileLayout:
    """Hands out aligned offsets in one append-only data file."""

    def __init__(self, name: str, start: int = 0) -> None:
        self.name = name
        self.end = start

    def place(self, nbytes: int) -> int:
        offset = align_up(self.end, ALIGNMENT if nbytes >= ALIGNMENT else PACK_ALIGNMENT)
        self.end = offset + nbytes
        return offset


STRIPE_MIN_BYTES = 64 << 20  # below this per file, more files only add fsyncs


def stripe_count(total_bytes: int, thread_count: int) -> int:
    """How many data files (stripes) a rank writes: one per flush thread, but no file under
    ``STRIPE_MIN_BYTES`` (each costs an fsync)."""
    return max(1, min(thread_count, total_bytes // STRIPE_MIN_BYTES, PACKED_STRIPE))


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one region goes: its stripe (data file index) and its offset there (4 KiB-aligned,
    or 64-byte for a region under 4 KiB)."""
    stripe: int
    offset: int


def place_regions(sizes: list[int], n_files: int) -> list[Placement]:
    """A placement for each region of ``sizes``: largest first onto the least-filled stripe, so
    that the files are balanced and each flush thread writes one.  A pure function."""
    order = sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True)
    where: list[Placement] = [Placement(0, 0)] * len(sizes)
    if n_files == 1:  # one stripe (any rank under 128 MiB): each region where the last ended
        end = 0
        for i in order:
            nbytes = sizes[i]
            offset = align_up(end, ALIGNMENT if nbytes >= ALIGNMENT else PACK_ALIGNMENT)
            end = offset + nbytes
            where[i] = Placement(0, offset)
        return where
    layouts = [FileLayout(str(k)) for k in range(n_files)]
    for i in order:
        nbytes = sizes[i]
        k = min(range(n_files), key=lambda k: layouts[k].end)
        where[i] = Placement(k, layouts[k].place(nbytes))
    return where
