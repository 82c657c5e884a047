"""Where bytes go inside a rank's data file.

Every extent starts on an ``ALIGNMENT`` (4 KiB) boundary so that O_DIRECT and
block-aligned ranged reads work; the gap up to the boundary is zero padding.
"""

from __future__ import annotations

ALIGNMENT = 4096


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
        offset = align_up(self.end)
        self.end = offset + nbytes
        return offset
