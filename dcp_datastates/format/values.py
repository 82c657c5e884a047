"""Non-tensor values as msgpack, without pickle.

msgpack covers None, bool, int, float, str, bytes, list and dict.  A few more
types that real state dicts hold (Adam's ``betas`` tuple, ``torch.dtype``,
``io.BytesIO`` payloads) travel as msgpack extension types with the codes
below.  Decoding builds only these types, so decoding cannot run code.
Anything else is refused at save time, naming the key; the user may opt into
pickle for it, and must then opt in again to load it.
"""

from __future__ import annotations

import enum
import io
import threading

import msgpack
import torch

from .dtypes import dtype_from_name, dtype_name
from .limits import MAX_CONTAINER_LEN, MAX_EXT_DEPTH, MAX_VALUE_BYTES

# Decoder limits: far beyond any real state-dict value, far below a bomb.
# Extension types nest by calling the decoder again from its own hook, on the C stack: a
# crafted value nested a few hundred deep would overflow it and kill the process.  Real
# values (a tuple of tuples in an optimizer's param groups) nest a handful of levels.
_depth = threading.local()


class ExtCode(enum.IntEnum):
    TUPLE = 1
    DTYPE = 2
    SIZE = 3
    DEVICE = 4
    SET = 5
    FROZENSET = 6
    COMPLEX = 7
    BIGINT = 8
    BYTESIO = 9


class NotEncodable(TypeError):
    """Raised for a value msgpack plus our extension types cannot express."""


def pack_plain(obj) -> bytes:
    """msgpack of plain data (records, manifests' bodies): no extension types."""
    data = msgpack.packb(obj, use_bin_type=True)
    assert data is not None, "packb returns bytes without a stream"
    return data


def _pack(obj) -> bytes:
    data = msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)
    assert data is not None, "packb returns bytes without a stream"
    return data


def _default(obj):
    t = type(obj)
    if t is tuple:
        return msgpack.ExtType(ExtCode.TUPLE, _pack(list(obj)))
    if t is torch.Size:
        return msgpack.ExtType(ExtCode.SIZE, _pack(list(obj)))
    if t is torch.dtype:
        return msgpack.ExtType(ExtCode.DTYPE, dtype_name(obj).encode())
    if t is torch.device:
        return msgpack.ExtType(ExtCode.DEVICE, str(obj).encode())
    if t is set:
        return msgpack.ExtType(ExtCode.SET, _pack(list(obj)))
    if t is frozenset:
        return msgpack.ExtType(ExtCode.FROZENSET, _pack(list(obj)))
    if t is complex:
        return msgpack.ExtType(ExtCode.COMPLEX, _pack([obj.real, obj.imag]))
    if t is int:  # only reached for ints outside 64 bits
        return msgpack.ExtType(ExtCode.BIGINT, str(obj).encode())
    if t is io.BytesIO:
        return msgpack.ExtType(ExtCode.BYTESIO, obj.getvalue())
    if t is bytearray:
        return bytes(obj)
    raise NotEncodable(f"values of type {t.__module__}.{t.__qualname__} cannot be stored as msgpack")


def encode_value(obj) -> bytes:
    """Encode ``obj`` or raise :class:`NotEncodable`."""
    try:
        return _pack(obj)
    except NotEncodable:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise NotEncodable(str(e)) from e


def _ext_hook(code: int, data: bytes):
    d = getattr(_depth, "n", 0)
    if d >= MAX_EXT_DEPTH:
        raise ValueError(f"extension types nested deeper than {MAX_EXT_DEPTH} levels")
    _depth.n = d + 1
    try:
        return _ext_value(code, data)
    finally:
        _depth.n = d


def _ext_value(code: int, data: bytes):
    if code == ExtCode.TUPLE:
        return tuple(_unpack(data))
    if code == ExtCode.SIZE:
        return torch.Size(_unpack(data))
    if code == ExtCode.DTYPE:
        return dtype_from_name(data.decode())
    if code == ExtCode.DEVICE:
        return torch.device(data.decode())
    if code == ExtCode.SET:
        return set(_unpack(data))
    if code == ExtCode.FROZENSET:
        return frozenset(_unpack(data))
    if code == ExtCode.COMPLEX:
        re, im = _unpack(data)
        return complex(re, im)
    if code == ExtCode.BIGINT:
        return int(data.decode())
    if code == ExtCode.BYTESIO:
        return io.BytesIO(data)
    raise ValueError(f"unsupported msgpack extension code {code}")


def _unpack(data: bytes):
    return msgpack.unpackb(
        data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True,
        max_bin_len=MAX_VALUE_BYTES,
        max_str_len=MAX_VALUE_BYTES, max_array_len=MAX_CONTAINER_LEN,
        max_map_len=MAX_CONTAINER_LEN, max_ext_len=MAX_VALUE_BYTES,
    )


def decode_value(data: bytes):
    """Decode bytes from :func:`encode_value`; raises ``ValueError`` on anything malformed."""
    try:
        return _unpack(data)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"malformed value: {e}") from e
