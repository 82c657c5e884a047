"""The live state a lazy snapshot copies from: its tensors, their version counters (so that a
tensor changed in place before its bytes are copied fails the save instead of tearing it), and
the point on the GPU stream the copies must follow."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import cuda_ext

from .snapshot import CopyItem, tensor_version


def iter_tensors(obj):
    """Every tensor of a state dict (a DTensor's local shard), depth first."""
    if isinstance(obj, DTensor):
        yield obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def storage_key(t: torch.Tensor):
    """Identifies the storage ``t`` views (views share its version counter)."""
    try:
        return (t.device.type, t.device.index, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # storage-less wrappers: not tracked
        return None


def versions(tensors: list[torch.Tensor]) -> dict:
    """Version counter per storage, read when the save starts."""
    out = {}
    for t in tensors:
        k = storage_key(t)
        v = tensor_version(t)
        if k is not None and v is not None:
            out[k] = v
    return out


def version_at_start(started: dict, t: torch.Tensor) -> int | None:
    """``t``'s version when the save started (its current one if it was not seen then)."""
    return started.get(storage_key(t), tensor_version(t))


def any_gpu(items: list[CopyItem]) -> bool:
    return any(i.source.device.type == "cuda" for i in items)


def want_pinned(items: list[CopyItem]) -> bool:
    """A pinned host cache pays off only for device tensors, and needs cuda-python."""
    return any_gpu(items) and cuda_ext.available()


def ready_point(tensors: list[torch.Tensor]):
    """Record, on the caller's current stream, the point the copies must follow (GPU only)."""
    dev = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if dev is None or not cuda_ext.available():
        return None
    return cuda_ext.record_ready(dev.index or 0)
