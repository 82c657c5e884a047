"""The live state a lazy snapshot copies from: its tensors, their version counters (so that a
tensor changed in place before its bytes are copied fails the save instead of tearing it), and
the point on the GPU stream the copies must follow.

Small tensors are copied when the save is called instead (``copy_small``): a tensor of a few
KiB costs more to plan, track and copy later than to copy now, and a state of nothing else
(20,000 tensors of 64 bytes) is then snapshotted before ``async_save`` returns."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.tensor import DTensor

import cuda_ext

from ..errors import CheckpointError
from .snapshot import CopyItem, Watch, tensor_version


def _leaves(obj):
    """Every tensor of a state dict (a DTensor or ShardedTensor as it is), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)


def iter_tensors(obj):
    """Every tensor of a state dict (a DTensor's local shard, a ShardedTensor's local shards),
    depth first."""
    for t in _leaves(obj):
        if isinstance(t, DTensor):
            yield t.to_local()
        elif isinstance(t, ShardedTensor):
            yield from (shard.tensor for shard in t.local_shards())
        else:
            yield t


def storage_key(t: torch.Tensor):
    """Identifies the storage ``t`` views (views share its version counter)."""
    try:
        return (t.device.type, t.device.index, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # storage-less wrappers: not tracked
        return None


def iter_dtensors(obj):
    """Every DTensor of a state dict, depth first."""
    return (t for t in _leaves(obj) if isinstance(t, DTensor))


def versions(tensors: list[torch.Tensor], through: Sequence[torch.Tensor] = ()) -> dict:
    """A ``Watch`` per storage of ``tensors``, read when the save starts; ``through``: the
    DTensors whose local shards are among them, whose own counters are read too."""
    wrappers: dict = {}
    for d in through:
        wrappers.setdefault(storage_key(_local(d)), []).append(d)
    out = {}
    for t in tensors:
        k = storage_key(t)
        if k is None or k in out:
            continue
        via = tuple(wrappers.get(k, ()))
        v = Watch.read(t, via)
        if v is not None:
            out[k] = Watch(v, via)
    return out


def watch_of(started: dict, t: torch.Tensor) -> Watch | None:
    """``t``'s watch from the save's start (from now, where ``t`` was not seen then)."""
    w = started.get(storage_key(t))
    if w is not None:
        return w
    v = tensor_version(t)
    return None if v is None else Watch(v)


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
    through: list = field(default_factory=list)  # the DTensors whose local shards are left
    live: bool = False


def copy_small(state_dict, budget: int, whole: dict[str, int] | None = None) -> SmallCopies:
    """The state dict, its dicts, lists and tuples rebuilt with each tensor (a DTensor: its
    local shard) of at most ``EAGER_TENSOR_BYTES`` replaced by a copy made now, on the
    caller's stream, while ``budget`` bytes last.  With ``whole`` (``{device type: bytes}``,
    a snapshot at the call), tensors of any size are copied too, while that device type's
    bytes last.  Everything else stays as it is: copied lazily, under the version check.  A
    tensor that appears twice is copied once."""
    if budget <= 0 and not whole:
        return SmallCopies(state_dict, left=list(iter_tensors(state_dict)),
                           through=list(iter_dtensors(state_dict)), live=True)
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
                    if local is None:
                        self.out.through.append(obj)
                    else:
                        got = DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                                 shape=obj.shape, stride=obj.stride())
                elif type(obj) in _PLAIN:
                    got = self.copied(obj)
                    got = obj if got is None else got
                else:  # a ShardedTensor, another subclass: copied lazily, its tensors tracked
                    self.out.left.extend(iter_tensors(obj))
                    self.out.through.extend(iter_dtensors(obj))
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
            self.out.through.extend(iter_dtensors(obj))
        return obj


# ------------------------------------------------------------ DCP's checkpoint process
_ALIGN = 64


@dataclass
class ForProcess:
    """What ``for_process`` made: the state dict to pickle for DCP's checkpoint process, the
    tensors it copied (their version counters say whether they changed before the copy), the
    bytes it copied, and whether tensors are left for that process to read lazily."""
    state_dict: object
    copied: list
    nbytes: int
    live: bool


def for_process(state_dict, budget: int, what: str) -> ForProcess:
    """The state dict as DCP's checkpoint process should get it.  That process reads a tensor
    in place only through shared memory: GPU memory (CUDA IPC) and CPU tensors already in shared
    memory stay as they are, to be copied lazily over there.  Every other CPU tensor is copied
    here, into one shared-memory arena: torch's pickler would otherwise move its storage into
    shared memory in place, in this (background) thread, under training's feet.  (The copies
    made at the call are among them: never shared, and never torn, since no version of theirs
    was recorded.)  More than ``budget`` bytes to copy fail the save before any is copied
    (``what`` names the setting to raise)."""
    walk = _ToProcess()
    walk.plan(state_dict)
    total = walk.arena_bytes + walk.alone
    if total > budget:
        raise CheckpointError(
            f"DCP's PROCESS mode would copy {total / 2**20:.1f} MiB of CPU tensors that are not in "
            f"shared memory, more than {what} ({budget / 2**20:.1f} MiB) allows; raise it, or pass "
            "DataStatesWriter(async_mode='process'), which moves them into shared memory at the call")
    if walk.arena_bytes:
        walk.arena = torch.empty(walk.arena_bytes, dtype=torch.uint8).share_memory_()
    return ForProcess(walk.rebuild(state_dict), walk.copies, total, walk.live)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, the same object at every call (``to_local()`` makes a new one)."""
    return t._local_tensor if type(t) is DTensor else t  # pyright: ignore[reportAttributeAccessIssue]


class _ToProcess:
    """``for_process``'s walks: ``plan`` places every CPU tensor to copy in the arena,
    ``rebuild`` copies them there and rebuilds the containers around the copies."""

    def __init__(self) -> None:
        self.live = False
        self.arena_bytes = self.alone = 0  # bytes copied into the arena, and into storages of their own
        self.offsets: dict[int, int] = {}
        self.copies: list[torch.Tensor] = []
        self.arena: torch.Tensor | None = None
        self.memo: dict[int, torch.Tensor] = {}

    @staticmethod
    def _to_copy(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.layout == torch.strided and not t.is_shared()

    def _place(self, t: torch.Tensor, *, alone: bool) -> None:
        """Plan ``t``'s copy: in the arena, or (``alone``) in a shared storage of its own (a
        DTensor's or ShardedTensor's shard, see ``_copy``).  A tensor met twice is copied once."""
        if id(t) in self.offsets:
            return
        if alone:
            self.offsets[id(t)] = -1
            self.alone += t.nbytes
        else:
            self.offsets[id(t)] = self.arena_bytes
            self.arena_bytes += -(-t.nbytes // _ALIGN) * _ALIGN
        self.copies.append(t)

    def plan(self, obj) -> None:
        if isinstance(obj, ShardedTensor):
            shards = [sh.tensor for sh in obj.local_shards()]
            if not all(self._to_copy(t) for t in shards):
                self.live = True  # its GPU or shared shards are read over there
                return
            for t in shards:
                self._place(t, alone=True)
        elif isinstance(obj, torch.Tensor):
            t = _local(obj)
            if type(obj) not in (DTensor, *_PLAIN) or not self._to_copy(t):
                self.live = self.live or t.device.type != "meta"
            else:
                self._place(t, alone=type(obj) is DTensor)
        elif type(obj) in (dict, OrderedDict):
            for v in obj.values():
                self.plan(v)
        elif type(obj) in (list, tuple):
            for v in obj:
                self.plan(v)
        elif not isinstance(obj, _INERT):
            self.live = True  # an object not walked: pickled as it is

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        got = self.memo.get(id(t))
        if got is None and t.nbytes == 0:
            got = self.memo[id(t)] = torch.empty(t.shape, dtype=t.dtype)
        if got is None:
            off = self.offsets[id(t)]
            if off < 0:  # a DTensor or ShardedTensor shard: torch cannot pickle a DTensor whose
                # local tensor starts past its storage's start
                got = torch.empty(t.shape, dtype=t.dtype).share_memory_()
            else:
                assert self.arena is not None, "planned: the arena holds every copy"
                got = self.arena[off:off + t.nbytes].view(t.dtype).view(t.shape)
            got.copy_(t.detach())
            self.memo[id(t)] = got
        return got

    def rebuild(self, obj):
        if isinstance(obj, ShardedTensor):
            shards = obj.local_shards()
            if not all(id(sh.tensor) in self.offsets for sh in shards):
                return obj
            # local: no collective, the global metadata is the original's
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                [Shard(self._copy(sh.tensor), sh.metadata) for sh in shards], obj.metadata(),
                process_group=obj._process_group, sharding_spec=obj.sharding_spec())  # pyright: ignore[reportAttributeAccessIssue]
        if isinstance(obj, torch.Tensor):
            t = _local(obj)
            if id(t) not in self.offsets:
                return obj
            if type(obj) is DTensor:  # the constructor DTensor's own code uses: same spec, new local
                return DTensor(self._copy(t), obj._spec, requires_grad=False)  # pyright: ignore[reportAttributeAccessIssue]
            return self._copy(t)
        if type(obj) in (dict, OrderedDict):
            return type(obj)((k, self.rebuild(v)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(self.rebuild(v) for v in obj)
        return obj
