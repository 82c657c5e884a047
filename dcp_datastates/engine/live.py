"""The live state a lazy snapshot copies from: its tensors, their version counters (so that a
tensor changed in place before its bytes are copied fails the save instead of tearing it), and
the point on the GPU stream the copies must follow.

Small tensors are copied when the save is called instead (``copy_small``): a tensor of a few
KiB costs more to plan, track and copy later than to copy now, and a state of nothing else
(20,000 tensors of 64 bytes) is then snapshotted before ``async_save`` returns."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

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
    return any(i.live().device.type == "cuda" for i in items)


def want_pinned(items: list[CopyItem]) -> bool:
    """A pinned host cache pays off only for device tensors, and needs cuda-python."""
    return any_gpu(items) and cuda_ext.available()


def ready_point(tensors: list[torch.Tensor]):
    """Record, on the caller's current stream, the point the copies must follow (GPU only)."""
    dev = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if dev is None or not cuda_ext.available():
        return None
    return cuda_ext.record_ready(dev.index or 0)


EAGER_TENSOR_BYTES = 64 << 10  # at most this: copied at the call (the planner's small items too)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# leaves that hold no tensor memory: a state of these and copied tensors has no live bytes left
_INERT = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


@dataclass
class SmallCopies:
    """What ``copy_small`` made: the state dict to save, the bytes copied, the tensors copied
    and those left live, and whether any tensor memory is left live (a tensor left, or an
    object not walked, which may hold some)."""
    state_dict: object
    nbytes: int = 0
    copies: list = field(default_factory=list)
    left: list = field(default_factory=list)
    live: bool = False


def copy_small(state_dict, budget: int, whole: dict[str, int] | None = None) -> SmallCopies:
    """The state dict, its dicts, lists and tuples rebuilt with each tensor (a DTensor: its
    local shard) of at most ``EAGER_TENSOR_BYTES`` replaced by a copy made now, on the
    caller's stream, while ``budget`` bytes last.  With ``whole`` (``{device type: bytes}``,
    a snapshot at the call), tensors of any size are copied too, while that device type's
    bytes last.  Everything else stays as it is: copied lazily, under the version check.  A
    tensor that appears twice is copied once."""
    if budget <= 0 and not whole:
        return SmallCopies(state_dict, left=list(iter_tensors(state_dict)), live=True)
    walk = _SmallCopier(state_dict, budget, dict(whole or {}))
    walk.out.state_dict = walk(state_dict)
    return walk.out


class _SmallCopier:
    """``copy_small``'s walk.  (A class, not a closure that calls itself: such a closure is a
    reference cycle, which would keep the state's tensors alive until a full collection.)"""

    def __init__(self, state_dict, budget: int, whole: dict[str, int]) -> None:
        self.out, self.budget, self.whole = SmallCopies(state_dict), budget, whole
        self.memo: dict[int, object] = {}

    def copied(self, t: torch.Tensor) -> torch.Tensor | None:
        out, n, kind = self.out, t.nbytes, t.device.type
        small = n <= EAGER_TENSOR_BYTES and out.nbytes + n <= self.budget
        if t.layout != torch.strided or not (small or n <= self.whole.get(kind, 0)):
            out.left.append(t)
            return None
        if not small:
            self.whole[kind] -= n
        out.nbytes += n
        c = t.detach().clone()
        out.copies.append(c)
        return c

    def __call__(self, obj):
        if isinstance(obj, torch.Tensor):
            got = self.memo.get(id(obj))
            if got is None:
                got = obj
                if type(obj) is DTensor:
                    local = self.copied(obj.to_local())
                    if local is not None:
                        got = DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                                 shape=obj.shape, stride=obj.stride())
                elif type(obj) in _PLAIN:
                    got = self.copied(obj)
                    got = obj if got is None else got
                else:
                    self.out.left.append(obj)
                self.memo[id(obj)] = got
            self.out.live = self.out.live or got is obj
            return got
        if type(obj) in (dict, OrderedDict):
            return type(obj)((k, self(v)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(self(v) for v in obj)
        if not isinstance(obj, _INERT):  # an object not walked (a BytesIO, a provider's type)
            self.out.live = True
            self.out.left.extend(iter_tensors(obj))  # a dict or list subclass: its tensors stay tracked
        return obj
