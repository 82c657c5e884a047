"""Stable names for tensor dtypes.

The manifest stores dtypes by these names, never by pickled ``torch.dtype``
objects, so a checkpoint written under one torch release reads under another.
An unknown name is refused rather than guessed.
"""

from __future__ import annotations

import torch

_NAMES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.complex32: "complex32",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
# newer dtypes where this torch has them (float8_e8m0fnu: MX scales; float4_e2m1fn_x2: two
# fp4 values per byte)
for _attr in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e8m0fnu", "float4_e2m1fn_x2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _attr):
        _NAMES[getattr(torch, _attr)] = _attr

_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in _NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no stable name in the dcp-datastates format") from None


def dtype_from_name(name: object) -> torch.dtype:
    """Map a manifest dtype string back to a dtype; raise ``ValueError`` on anything else."""
    if not isinstance(name, str) or name not in _BY_NAME:
        raise ValueError(f"unknown dtype {name!r} in manifest")
    return _BY_NAME[name]
