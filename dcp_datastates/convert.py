"""Conversions to and from DCP's FileSystemWriter format and to HuggingFace safetensors.

Each conversion reads the whole state into host memory, then writes it in the other format.

* ``to_dcp``: dcp-datastates -> DCP ``FileSystemWriter`` (readable by any DCP).
* ``from_dcp``: DCP ``FileSystemWriter`` -> dcp-datastates.  DCP's ``.metadata`` is a pickle and
  its non-tensor values are ``torch.save`` blobs: convert only checkpoints you trust.
* ``to_safetensors``: tensors, as one file (``dst`` named ``*.safetensors``) or a directory
  holding ``model.safetensors`` or shards of at most ``max_shard_bytes`` with a
  ``model.safetensors.index.json``.  Keys are DCP's flattened names (``keys`` picks some,
  ``strip_prefix`` shortens them); non-tensor values are written to ``values.json`` beside.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import struct
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from .errors import PickleNotAllowedError
from .format.layout import align_up
from .format.names import MANIFEST_NAME
from .reader import DataStatesReader
from .writer import DataStatesWriter

log = logging.getLogger(__name__)

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
for _n, _c in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _n):
        _ST_DTYPES[getattr(torch, _n)] = _c


def _load_all(reader) -> dict:
    return _load_state_dict_from_keys(storage_reader=reader)


def to_dcp(src: str, dst: str, *, storage_options: dict | None = None) -> None:
    sd = _load_all(DataStatesReader(src, storage_options=storage_options))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(dst), no_dist=True)


def from_dcp(src: str, dst: str, *, allow_pickle: bool = False) -> None:
    """DCP's ``.metadata`` is a pickle and its values are ``torch.save`` blobs: reading them
    runs code from the checkpoint, so this needs ``allow_pickle=True`` (a trusted source)."""
    if not allow_pickle:
        raise PickleNotAllowedError(
            "DCP's .metadata is a pickle and reading it would run code from the file; pass "
            "--allow-pickle (allow_pickle=True) only if you trust this checkpoint",
            checkpoint=src, file=MANIFEST_NAME)
    sd = _load_all(dcp.FileSystemReader(src))
    dcp.save(sd, storage_writer=DataStatesWriter(dst, allow_pickle=allow_pickle), no_dist=True)


def _flatten(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    header: dict = {}
    pos = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    # pad the header with spaces so the data starts 4 KiB-aligned (the format allows it)
    hlen = align_up(8 + len(raw)) - 8
    raw = raw + b" " * (hlen - len(raw))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", hlen))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


@dataclass
class SafetensorsExport:
    """What ``to_safetensors`` wrote: the safetensors files, and the non-tensor values left
    out (safetensors holds tensors only), written as JSON beside them when there are any."""
    files: list[str]
    left_out: list[str] = field(default_factory=list)
    values_file: str | None = None

    def __bool__(self) -> bool:
        return bool(self.files)

    def __len__(self) -> int:
        return len(self.files)


def to_safetensors(src: str, dst: str, *, max_shard_bytes: int | None = None,
                   storage_options: dict | None = None, keys: list[str] | None = None,
                   strip_prefix: str | None = None) -> SafetensorsExport:
    """Export the tensors of checkpoint ``src``.

    ``dst`` named ``*.safetensors`` is one file; anything else is a directory that receives
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` and
    ``model.safetensors.index.json`` (HuggingFace's layout).  ``keys``: glob patterns of the
    flattened names to export (default all); ``strip_prefix``: removed from the names that
    start with it (``"model."`` for a HuggingFace model).  Non-tensor values go to
    ``values.json`` beside the tensors (``<file>.values.json`` for a single file)."""
    flat = _flatten(_load_all(DataStatesReader(src, storage_options=storage_options)))
    if keys:
        flat = {k: v for k, v in flat.items() if any(fnmatch.fnmatchcase(k, p) for p in keys)}
    if strip_prefix:
        flat = {(k[len(strip_prefix):] if k.startswith(strip_prefix) else k): v for k, v in flat.items()}
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in flat.items() if k not in tensors}
    bad = sorted(k for k, t in tensors.items() if t.dtype not in _ST_DTYPES)
    if bad:
        raise ValueError(f"dtypes of {bad[:5]} have no safetensors code")
    single_file = dst.endswith(".safetensors")
    if single_file and max_shard_bytes:
        raise ValueError(f"{dst} names one file; give a directory to shard into")
    if not single_file:
        os.makedirs(dst, exist_ok=True)
    out = SafetensorsExport([])
    if values:
        out.left_out = sorted(values)
        out.values_file = f"{dst}.values.json" if single_file else os.path.join(dst, "values.json")
        with open(out.values_file, "w") as f:
            json.dump(values, f, indent=1, sort_keys=True, default=repr)
        log.warning("safetensors holds tensors only: %d values written to %s instead (%s)",
                    len(values), out.values_file, ", ".join(out.left_out[:10]))
    if not max_shard_bytes:
        path = dst if single_file else os.path.join(dst, "model.safetensors")
        _write_safetensors(path, tensors)
        out.files = [path]
        return out
    shards: list[dict] = [{}]
    size = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        _write_safetensors(os.path.join(dst, name), shard)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    out.files = [os.path.join(dst, n) for n in names]
    return out
