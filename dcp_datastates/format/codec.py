"""Compressed blocks: how one checksum block is stored in a data file of compressed blocks.

A tensor saved with ``compression="zstd"`` is cut into the same 1 MiB checksum blocks as any
other, and each block is stored on its own, as one segment of a packed data file
(``names.is_packed_file``): a one-byte header, then the payload.  The header says how:

* ``RAW`` (0): the block's bytes as they are (compressing did not make them smaller);
* ``ZSTD`` (1): zstd of the block's bytes;
* 2, 4 or 8: zstd of the block's bytes byte-shuffled by that element width first (byte ``k`` of
  every element together: a float's sign and exponent bytes repeat, its mantissa bytes do not,
  so shuffled they compress better; ``docs/benchmarks.md``).

Blocks stay independent, so a resharded load reads and decompresses only the blocks it needs,
and the block digest covers the stored bytes, so a damaged block is caught before it is
decompressed.  The decoder bounds its output by the block's known length, so no stored block
can make it allocate more.  ``zstandard`` is optional (the ``zstd`` extra): it is imported on
first use, and only a checkpoint that holds compressed blocks needs it.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..errors import CheckpointError
from .checksum import BLOCK_SIZE
from .limits import FormatViolation

RAW, ZSTD = 0, 1
SHUFFLE_WIDTHS = (2, 4, 8)
MAX_STORED = BLOCK_SIZE + 1  # a block stored as it is, with its header
LEVEL = 1  # zstd-3 compressed no better in the measurements, and slower
CODECS = ("zstd",)  # what ``compression=`` accepts
# tensors smaller than this are stored as they are: a few KiB compress to little, and are read
# in one coalesced request with their neighbours
MIN_BYTES = 64 << 10

_local = threading.local()


class CodecMissing(CheckpointError):
    """The ``zstandard`` package is not installed."""


def _zstd():
    try:
        import zstandard  # optional: only compressed checkpoints need it
    except ImportError:
        raise CodecMissing("compressed blocks need the zstandard package: pip install 'dcp-datastates[zstd]'") from None
    return zstandard


def check_available(compression: str | None) -> None:
    """Raise ``ValueError`` in one line when ``compression`` is unknown or cannot run here."""
    if compression is None:
        return
    if compression not in CODECS:
        raise ValueError(f"compression must be None or one of {', '.join(map(repr, CODECS))}, got {compression!r}")
    try:
        _zstd()
    except CodecMissing as e:
        raise ValueError(f"compression={compression!r}: {e}") from None


def codec_for(dtype: torch.dtype) -> int:
    """The header a block of ``dtype`` is compressed with: shuffled by the element width for
    floats of 2, 4 and 8 bytes (where it paid), plain zstd for every other type."""
    width = dtype.itemsize
    return width if dtype.is_floating_point and width in SHUFFLE_WIDTHS else ZSTD


def _shuffle(data: memoryview, width: int) -> bytes:
    n = len(data) // width * width
    a = np.frombuffer(data, dtype=np.uint8, count=n).reshape(-1, width).T
    return a.tobytes() + bytes(data[n:])


def _unshuffle(data: bytes, width: int, out: memoryview) -> None:
    n = len(out) // width * width
    src = np.frombuffer(data, dtype=np.uint8, count=n).reshape(width, -1).T
    dst = np.frombuffer(out, dtype=np.uint8)
    dst[:n].reshape(-1, width)[:] = src
    dst[n:] = np.frombuffer(data, dtype=np.uint8, offset=n)


def encode_block(data: memoryview, codec: int) -> bytes:
    """Block ``data`` (at most ``BLOCK_SIZE`` bytes) as stored: header and payload, the
    block as it is where compressing does not make it smaller.  The result is never exactly as
    long as the block, so a release that predates compressed blocks, which takes a segment for
    its bytes, finds the segments do not add up and refuses the manifest."""
    if not 0 < len(data) <= BLOCK_SIZE:
        raise ValueError(f"a compressed block holds 1 to {BLOCK_SIZE} bytes, got {len(data)}")
    c = getattr(_local, "compressor", None)
    if c is None:  # one per thread: a ZstdCompressor is not thread safe
        c = _local.compressor = _zstd().ZstdCompressor(level=LEVEL)
    src = _shuffle(data, codec) if codec in SHUFFLE_WIDTHS and len(data) >= codec else data
    packed = c.compress(src)
    if 1 + len(packed) >= len(data):  # stored is never exactly the block's length (docs/format.md)
        return bytes((RAW,)) + bytes(data)
    return bytes((codec if src is not data else ZSTD,)) + packed


def decode_block(stored, out: memoryview) -> None:
    """Fill ``out`` (the block's length) from its stored form; ``FormatViolation`` when the
    stored bytes do not decode to exactly that many bytes."""
    stored = memoryview(stored).cast("B")
    n = len(out)
    if len(stored) < 1:
        raise FormatViolation("a stored block is empty")
    head, body = stored[0], stored[1:]
    if head == RAW:
        if len(body) != n:
            raise FormatViolation(f"a block stored as it is holds {len(body)} bytes, not {n}")
        out[:] = body
        return
    if head != ZSTD and head not in SHUFFLE_WIDTHS:
        raise FormatViolation(f"a stored block has an unknown header {head}")
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = _zstd().ZstdDecompressor()
    zstd = _zstd()
    try:
        declared = zstd.frame_content_size(body)  # the frame's own size, checked before any allocation
        if declared != n:
            raise FormatViolation(f"a compressed block says it holds {declared} bytes, not {n}")
        raw = d.decompress(body, max_output_size=n)
    except zstd.ZstdError as e:
        raise FormatViolation(f"a compressed block does not decode: {e}") from None
    if len(raw) != n:
        raise FormatViolation(f"a compressed block decodes to {len(raw)} bytes, not {n}")
    if head == ZSTD:
        out[:] = raw
    else:
        _unshuffle(raw, head, out)
