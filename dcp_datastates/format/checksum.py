"""Per-block checksums of extents.

Each extent is cut into blocks of ``BLOCK_SIZE`` bytes (the last one shorter)
and each block gets an xxh3-64 digest.  Blocks, not whole extents, so that a
resharded load can read just the blocks it needs and still verify all of them.
xxh3 runs at ~30 GB/s a core and releases the GIL, so checksums cost little
next to the copy itself.
"""

from __future__ import annotations

import xxhash

BLOCK_SIZE = 1 << 20
ALGORITHM = "xxh3-64"


def block_checksums(buf, block_size: int = BLOCK_SIZE) -> list[int]:
    """Digest of each block of ``buf`` (any buffer-protocol object)."""
    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    if n == 0:
        return [xxhash.xxh3_64_intdigest(b"")]
    return [xxhash.xxh3_64_intdigest(mv[i:i + block_size]) for i in range(0, n, block_size)]


def verify_blocks(buf, sums: list[int], first_block: int, block_size: int = BLOCK_SIZE) -> int | None:
    """Check ``buf``, which starts at block ``first_block`` of an extent.

    Returns the index of the first bad block, or ``None`` when all match.
    """
    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    if n == 0:
        return None if sums and sums[first_block] == xxhash.xxh3_64_intdigest(b"") else first_block
    for j, i in enumerate(range(0, n, block_size)):
        b = first_block + j
        if b >= len(sums) or xxhash.xxh3_64_intdigest(mv[i:i + block_size]) != sums[b]:
            return b
    return None
