"""Versions 1 and 2: every chunk of every tensor as its own msgpack map.

A body's chunk lists are kept as bytes and decoded one chunk at a time (``ChunkStream``):
such a manifest never exists as a tree of Python objects, only as the validated records it
decodes into.  Version 3 replaced these maps with a table of integer columns (``table.py``).
"""

from __future__ import annotations

import math

import msgpack

from .dtypes import dtype_from_name
from .fields import dims_field, extent_field, field, provider_fields
from .limits import MAX_ENTRIES, FormatViolation
from .model import Chunk, TensorEntry, check_tiling


def unpacker(data) -> msgpack.Unpacker:
    up = msgpack.Unpacker(raw=False, strict_map_key=False, use_list=True, max_buffer_size=len(data) + 1,
                          max_array_len=MAX_ENTRIES, max_map_len=MAX_ENTRIES, max_ext_len=0)
    up.feed(data)
    return up


class ChunkStream:
    """The chunk list of one tensor, decoded one chunk at a time: a manifest never exists
    as a tree of Python objects, only as the validated records it decodes into."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __iter__(self):
        up = unpacker(self.data)
        try:
            n = up.read_array_header()
        except (ValueError, msgpack.UnpackException) as e:
            raise FormatViolation(f"chunks must be a list ({e})") from None
        for _ in range(n):
            yield up.unpack()


def tensors_v2(body, files: dict[str, int], block_size: int, version: int) -> dict[str, TensorEntry]:
    """Versions 1 and 2: one msgpack map per chunk, decoded chunk by chunk."""
    tensors: dict[str, TensorEntry] = {}
    n_chunks = 0
    for fqn, t in field(body, "tensors", dict).items():
        if not isinstance(fqn, str):
            raise FormatViolation("tensor keys must be strings")
        dtype = field(t, "dtype", str)
        item = dtype_from_name(dtype).itemsize
        size = dims_field(field(t, "size", list), f"{fqn} size")
        chunks = []
        has_empty = False
        for c in field(t, "chunks", (list, ChunkStream)):
            offs = dims_field(field(c, "o", list), f"{fqn} chunk offsets")
            sizes = dims_field(field(c, "s", list), f"{fqn} chunk sizes")
            if len(offs) != len(size) or len(sizes) != len(size):
                raise FormatViolation(f"{fqn}: chunk rank does not match tensor rank {len(size)}")
            for o, s, g in zip(offs, sizes, size):
                if o + s > g:
                    raise FormatViolation(f"{fqn}: chunk at {list(offs)} of size {list(sizes)} leaves the tensor {list(size)}")
            ext = None
            if "x" in c:
                ext = extent_field(c["x"], files, block_size, fqn, version)
                if ext.nbytes != math.prod(sizes) * item:
                    raise FormatViolation(f"{fqn}: extent holds {ext.nbytes} bytes, chunk needs {math.prod(sizes) * item}")
            chunk = Chunk(offs, sizes, ext)
            if "p" in c:
                provider_fields(chunk, c, files, block_size, version, fqn)
            elif ext is None:
                raise FormatViolation(f"{fqn}: chunk has neither an extent nor a provider")
            n_chunks += 1
            if n_chunks > MAX_ENTRIES:
                raise FormatViolation(f"more than {MAX_ENTRIES} chunks")
            if not math.prod(sizes):
                if has_empty:  # holds no byte and covers nothing: one represents them all
                    continue
                has_empty = True
            chunks.append(chunk)
        check_tiling(fqn, chunks)
        tensors[fqn] = TensorEntry(dtype, size, chunks)
    return tensors
