"""Per-block digests of extents: integrity check and content address in one.

Each extent is cut into blocks of ``BLOCK_SIZE`` bytes (the last one shorter)
and each block gets an xxh3-128 digest (16 bytes).  Blocks, not whole extents,
so that a resharded load can read just the blocks it needs and still verify
all of them.

The same digests are the content addresses of incremental checkpoints: a block
whose digest equals the one recorded for the same place in the previous
checkpoint is not written again (``docs/design.md``, "Incremental checkpoints").
128 bits make an accidental collision negligible (about 2^-64 after 2^32
blocks, i.e. 4 PiB of distinct data); xxh3 is not a cryptographic hash, which
is fine for state that only the job itself writes.  xxh3-128 runs at the speed
of xxh3-64, far above a disk's, and releases the GIL.

Format version 1 stored xxh3-64 integers; :func:`verify_blocks` still checks them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import xxhash

BLOCK_SIZE = 1 << 20
ALGORITHM = "xxh3-128"
DIGEST_BYTES = 16
_EMPTY = xxhash.xxh3_128_digest(b"")


def block_checksums(buf, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Digest of each block of ``buf`` (any buffer-protocol object)."""
    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    if n == 0:
        return [_EMPTY]
    return [xxhash.xxh3_128_digest(mv[i:i + block_size]) for i in range(0, n, block_size)]


class DigestTail:
    """Block digests kept out of a manifest, in the tail of its file (format 4's metadata
    parts): ``nbytes`` of them.  ``fetch()`` reads and checks them (from any copy of the
    file); they are read on the first use of any of them, which is when the data they check
    is read."""

    def __init__(self, nbytes: int, fetch: Callable[[], bytes]) -> None:
        self.nbytes, self._fetch = nbytes, fetch
        self._lock = threading.Lock()
        self._data: bytes | None = None
        self._error: Exception | None = None

    def load(self) -> bytes:
        """All the digests, fetched once (the fetcher checks size and digest); a fetch that
        failed fails again without reading, so a bad tail costs one read, not one per extent."""
        with self._lock:
            if self._data is None:
                if self._error is not None:
                    raise self._error.with_traceback(None)
                try:
                    self._data = self._fetch()
                except Exception as e:  # kept, and raised to this caller and every later one
                    self._error = e
                    raise
            return self._data

    def read(self, at: int, n: int) -> bytes:
        return self.load()[at:at + n]


class Digests(Sequence):
    """The block digests of one extent, kept as the one string they were read as: a manifest
    of a large state lists hundreds of thousands of blocks, and a bytes object per digest
    cost most of its decode time.  Indexing returns a digest, slicing a list of them.
    ``Digests.tail(...)``: the extent's digests are a slice of a :class:`DigestTail`, read
    when one is first used."""

    __slots__ = ("_joined", "_tail", "_at", "_n")

    def __init__(self, joined: bytes) -> None:
        self._joined: bytes | None = joined
        self._tail: DigestTail | None = None
        self._at, self._n = 0, len(joined)

    @classmethod
    def tail(cls, source: DigestTail, at: int, nbytes: int) -> "Digests":
        d = cls.__new__(cls)
        d._joined, d._tail, d._at, d._n = None, source, at, nbytes
        return d

    @property
    def joined(self) -> bytes:
        joined = self._joined
        if joined is None:
            assert self._tail is not None, "digests are either joined or in a tail"
            joined = self._joined = self._tail.read(self._at, self._n)
        return joined

    def __len__(self) -> int:
        return self._n // DIGEST_BYTES

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("digest index out of range")
        return self.joined[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]

    def __eq__(self, other) -> bool:
        if isinstance(other, Digests):
            return self.joined == other.joined
        return list(self) == list(other) if isinstance(other, (list, tuple)) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable peers (lists) compare equal


def join_digests(sums) -> bytes:
    """The concatenated form of a list of digests or a :class:`Digests`."""
    return sums.joined if isinstance(sums, Digests) else b"".join(sums)


def split_digests(joined: bytes) -> list[bytes]:
    """The per-block digests of a manifest's concatenated digest field."""
    return [joined[i:i + DIGEST_BYTES] for i in range(0, len(joined), DIGEST_BYTES)]


def _digest_like(ref, data) -> bytes | int:
    if isinstance(ref, int):  # format v1
        return xxhash.xxh3_64_intdigest(data)
    return xxhash.xxh3_128_digest(data)


def verify_blocks(buf, sums: Sequence, first_block: int, block_size: int = BLOCK_SIZE) -> int | None:
    """Check ``buf``, which starts at block ``first_block`` of an extent.

    Returns the index of the first bad block, or ``None`` when all match.
    """
    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    if 0 < n <= block_size and isinstance(sums, Digests):  # one block (most small pieces)
        want = sums.joined[first_block * DIGEST_BYTES:(first_block + 1) * DIGEST_BYTES]
        return None if len(want) == DIGEST_BYTES and xxhash.xxh3_128_digest(mv) == want else first_block
    if not sums or first_block >= len(sums):
        return first_block
    if n == 0:
        return None if sums[first_block] == _digest_like(sums[first_block], b"") else first_block
    for j, i in enumerate(range(0, n, block_size)):
        b = first_block + j
        if b >= len(sums) or _digest_like(sums[b], mv[i:i + block_size]) != sums[b]:
            return b
    return None
