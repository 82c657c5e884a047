"""A drop-in for FileSystemWriter users (issue 38): plain DCP code, unchanged, on real gloo ranks.

PROCESS mode with a plain ``DataStatesWriter(path)``: DCP pickles the writer into its checkpoint
process, and that is how the writer learns the save crosses processes; the state committed is
the state at the call, and a save that fails in the checkpoint process releases the trainer's
optimizer step at once."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_datastates import DataStatesReader, DataStatesWriter
from tests.dist import run_ranks

PROCESS = AsyncCheckpointerType.PROCESS


def _fsdp_model(world: int):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))  # 512 KiB a weight
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt)
    return model, opt


def _train(model, opt) -> None:
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _snapshot(obj):
    """A deep copy of a state dict's values (DTensors: their local shards)."""
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, DTensor):
        return obj.to_local().clone()
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    return obj


def _equal(a, b, path="") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(b, torch.Tensor):
        got = b.to_local() if isinstance(b, DTensor) else b
        assert torch.equal(a, got), f"{path} differs from the state at the call"
    else:
        assert a == b, path


def _blank(model, opt) -> dict:
    """The state dict to load into: every tensor zeroed (a DTensor's local shard too)."""
    sd = _state(model, opt)
    for t in _leaves(sd):
        (t.to_local() if isinstance(t, DTensor) else t).zero_()
    return sd


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, torch.Tensor):
        yield obj


def _process_twice(rank, world, base):
    model, opt = _fsdp_model(world)
    pg = dist.new_group(backend="gloo")
    paths = [os.path.join(base, f"step-{i}") for i in range(2)]
    writer = DataStatesWriter(paths[0])  # plain: nothing tells it the save runs in another process
    wants = []
    for i, path in enumerate(paths):
        sd = _state(model, opt)
        wants.append(_snapshot(sd))
        kw = {} if i == 0 else {"checkpoint_id": path}
        fut = dcp.async_save(sd, storage_writer=writer, process_group=pg, async_checkpointer_type=PROCESS, **kw)
        _train(model, opt)  # forward, backward and the optimizer's in-place update, right after the call
        fut.result(timeout=300)
    assert not torch.equal(_snapshot(_state(model, opt))["model"]["0.weight"], wants[1]["model"]["0.weight"])
    # copied for the checkpoint process, not moved into shared memory under training's feet
    assert not any(p._local_tensor.is_shared() for p in model.parameters())
    for path, want in zip(paths, wants):
        got = _blank(model, opt)
        dcp.load(got, storage_reader=DataStatesReader(path), process_group=pg)
        _equal(want, got)


def test_plain_writer_in_process_mode_commits_the_state_at_the_call(tmp_path):
    run_ranks(2, _process_twice, str(tmp_path), timeout=400)


def _process_fails_then_steps(rank, world, base, out):
    model, opt = _fsdp_model(world)
    pg = dist.new_group(backend="gloo")
    fut = dcp.async_save(_state(model, opt), storage_writer=DataStatesWriter(os.path.join(base, "ok")),
                         process_group=pg, async_checkpointer_type=PROCESS)
    _train(model, opt)
    fut.result(timeout=300)  # the checkpoint process is up
    blocker = os.path.join(base, "a-file")
    if rank == 0:
        open(blocker, "w").close()
    dist.barrier(pg)
    bad = os.path.join(blocker, "step-1")  # under a regular file: fails in the checkpoint process
    fut = dcp.async_save(_state(model, opt), storage_writer=DataStatesWriter(bad), process_group=pg,
                         async_checkpointer_type=PROCESS)
    model(torch.randn(8, 256)).sum().backward()
    t = time.monotonic()
    opt.step()  # the step barrier: released as soon as the save fails over there
    took = time.monotonic() - t
    try:
        fut.result(timeout=300)
        raise AssertionError("a save under a regular file succeeded")
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        assert "AssertionError" not in type(e).__name__, e
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{took:.3f}")


def test_a_save_failing_in_the_checkpoint_process_releases_the_step(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(2, _process_fails_then_steps, str(tmp_path), str(out), timeout=400)
    took = {p.name: float(p.read_text()) for p in out.iterdir()}
    assert sorted(took) == ["rank0", "rank1"]
    assert max(took.values()) < 1.0, took


def _process_over_budget(rank, world, base):
    model = nn.Linear(1024, 2048)  # 8 MiB of CPU weights outside shared memory
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = DataStatesWriter(os.path.join(base, "big"), host_cache_bytes=1 << 20, eager_copy_bytes=0)
    fut = dcp.async_save({"m": model.state_dict()}, storage_writer=writer, async_checkpointer_type=PROCESS)
    try:
        fut.result(timeout=300)
        raise AssertionError("a PROCESS save over its copy budget succeeded")
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        assert "host_cache_bytes" in str(e) and "async_mode='process'" in str(e), e
    model(torch.randn(2, 1024)).sum().backward()
    t = time.monotonic()
    opt.step()
    assert time.monotonic() - t < 1.0
    # said in advance, the same state moves into shared memory at the call and commits
    want = {k: v.clone() for k, v in model.state_dict().items()}
    writer = DataStatesWriter(os.path.join(base, "said"), host_cache_bytes=1 << 20, eager_copy_bytes=0,
                              async_mode="process")
    fut = dcp.async_save({"m": model.state_dict()}, storage_writer=writer, async_checkpointer_type=PROCESS)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    fut.result(timeout=300)
    got = {"m": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(got, storage_reader=DataStatesReader(os.path.join(base, "said")))
    assert all(torch.equal(got["m"][k], want[k]) for k in want)


def test_a_process_save_beyond_its_copy_budget_fails_in_one_line_and_releases_the_step(tmp_path):
    run_ranks(1, _process_over_budget, str(tmp_path), timeout=300)


def _process_changed_before_handoff(rank, world, base):
    model = nn.Linear(1024, 1024)
    path = os.path.join(base, "torn")
    fut = dcp.async_save({"m": model.state_dict()}, storage_writer=DataStatesWriter(path),
                         async_checkpointer_type=PROCESS)
    # the first PROCESS save starts DCP's checkpoint process before it pickles the save: this
    # in-place change, outside any optimizer, lands before the state is handed over
    with torch.no_grad():
        model.weight.mul_(0.5)
    try:
        fut.result(timeout=300)
        raise AssertionError("a save whose state changed before the handoff committed")
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        assert "changed in place" in str(e), e
    assert not os.path.exists(os.path.join(path, ".metadata"))


def test_a_change_before_the_handoff_fails_the_process_save_uncommitted(tmp_path):
    """In PROCESS mode the CPU tensors are copied when DCP hands the save over; one changed in
    place since the call (the version counter says so) fails the save instead of tearing it."""
    run_ranks(1, _process_changed_before_handoff, str(tmp_path), timeout=300)


def test_copying_the_staged_state_is_not_handing_it_over(tmp_path):
    """Only pickling for DCP's checkpoint process copies the state out and ends the snapshot;
    a copy or deep copy of the state ``stage`` returned is a plain dict and changes nothing."""
    import copy
    writer = DataStatesWriter(str(tmp_path / "c"), eager_copy_bytes=0)
    staged = writer.stage({"w": torch.zeros(1 << 20)})
    for c in (copy.copy(staged), copy.deepcopy(staged)):
        assert type(c) is dict and torch.equal(c["w"], staged["w"])
    assert not writer.wait_snapshot(timeout=0)  # still live: the lazy copy has not run
    writer.sessions.fail(RuntimeError("test over"))


# ----------------------------------------------------------------- ShardedTensor

def _spec(kind: str, world: int):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec
    places = [f"rank:{r}/cpu" for r in range(world)]
    if kind == "rowwise":
        return ChunkShardingSpec(dim=0, placements=places)
    if kind == "colwise":
        return ChunkShardingSpec(dim=1, placements=places)
    # another shard plan: uneven blocks, rank 1 holding the first rows
    return EnumerableShardingSpec([ShardMetadata([0, 0], [3, 10], places[1]),
                                   ShardMetadata([3, 0], [9, 10], places[0])])


_FULL = torch.arange(120, dtype=torch.float32).reshape(12, 10) / 7


def _sharded(kind: str, world: int, fill: bool):
    """A ShardedTensor of ``_FULL``'s shape laid out by ``kind``, holding ``_FULL`` (or zeros)."""
    from torch.distributed._shard import sharded_tensor
    st = sharded_tensor.zeros(_spec(kind, world), 12, 10)
    if fill:
        for shard in st.local_shards():
            o, n = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(_FULL[o[0]:o[0] + n[0], o[1]:o[1] + n[1]])
    return st


def _dest(kind: str, world: int):
    from torch.distributed.tensor import Shard, distribute_tensor
    if kind == "plain":
        return torch.zeros(12, 10)
    if kind == "dtensor":
        return distribute_tensor(torch.zeros(12, 10), init_device_mesh("cpu", (world,)), [Shard(1)])
    return _sharded(kind, world, fill=False)


def _source(kind: str, world: int):
    from torch.distributed.tensor import Shard, distribute_tensor
    if kind == "plain":
        return _FULL.clone()
    if kind == "dtensor":
        return distribute_tensor(_FULL.clone(), init_device_mesh("cpu", (world,)), [Shard(0)])
    return _sharded(kind, world, fill=True)


def _pieces(t) -> list[tuple[tuple, torch.Tensor]]:
    """What this rank holds of a loaded tensor: (offsets, values) per local piece."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    if isinstance(t, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in t.local_shards()]
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        _, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return [(tuple(off), t.to_local())]
    return [((0, 0), t)]


def _sharded_tensor_cases(rank, world, base):
    import warnings
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    cases = [("rowwise", "colwise"), ("rowwise", "enum"), ("rowwise", "plain"), ("rowwise", "dtensor"),
             ("colwise", "rowwise"), ("plain", "colwise"), ("dtensor", "enum")]
    for i, (src, dst) in enumerate(cases):
        ours, ref = os.path.join(base, f"ours-{i}"), os.path.join(base, f"ref-{i}")
        dcp.save({"w": _source(src, world), "step": 3}, storage_writer=DataStatesWriter(ours))
        dcp.save({"w": _source(src, world), "step": 3}, storage_writer=dcp.FileSystemWriter(ref))
        got_ours, got_ref = {"w": _dest(dst, world), "step": 0}, {"w": _dest(dst, world), "step": 0}
        dcp.load(got_ours, storage_reader=DataStatesReader(ours))
        dcp.load(got_ref, storage_reader=dcp.FileSystemReader(ref))
        assert got_ours["step"] == got_ref["step"] == 3
        for (off, a), (off_ref, b) in zip(_pieces(got_ours["w"]), _pieces(got_ref["w"]), strict=True):
            want = _FULL[off[0]:off[0] + a.shape[0], off[1]:off[1] + a.shape[1]]
            assert off == off_ref and torch.equal(a, b) and torch.equal(a, want), (src, dst, off)
    # through an async save and our own planners too
    from dcp_datastates import DataStatesLoadPlanner, DataStatesSavePlanner
    path = os.path.join(base, "async")
    src = _source("rowwise", world)
    dcp.async_save({"w": src}, storage_writer=DataStatesWriter(path), planner=DataStatesSavePlanner()).result()
    got = {"w": _dest("colwise", world)}
    dcp.load(got, storage_reader=DataStatesReader(path), planner=DataStatesLoadPlanner())
    for off, a in _pieces(got["w"]):
        assert torch.equal(a, _FULL[off[0]:off[0] + a.shape[0], off[1]:off[1] + a.shape[1]]), off
    # and through DCP's PROCESS mode: its local shards copied for the checkpoint process
    path = os.path.join(base, "process")
    src = _source("rowwise", world)
    dcp.async_save({"w": src}, storage_writer=DataStatesWriter(path), async_checkpointer_type=PROCESS).result()
    assert not any(sh.tensor.is_shared() for sh in src.local_shards())
    got = {"w": _dest("colwise", world)}
    dcp.load(got, storage_reader=DataStatesReader(path))
    for off, a in _pieces(got["w"]):
        assert torch.equal(a, _FULL[off[0]:off[0] + a.shape[0], off[1]:off[1] + a.shape[1]]), off


def test_sharded_tensors_load_resharded_like_dcp(tmp_path):
    """Legacy ``ShardedTensor`` state (FSDP1's SHARDED_STATE_DICT, TorchRec): saved on 2 ranks,
    loaded rowwise to colwise, into another shard plan, into a plain tensor and a DTensor, and
    the reverse, each bit-exact and equal to what DCP's FileSystemWriter/Reader give."""
    run_ranks(2, _sharded_tensor_cases, str(tmp_path), timeout=400)


# ----------------------------------------------------------------- FileSystemWriter's arguments

def _roundtrip(tmp_path, name, writer_kw=None, reader_kw=None):
    state = {"w": torch.arange(300_000, dtype=torch.float32).reshape(600, 500), "b": torch.ones(7),
             "step": 5}
    path = str(tmp_path / name)
    dcp.save(state, storage_writer=DataStatesWriter(path, **(writer_kw or {})), no_dist=True)
    got = {"w": torch.zeros(600, 500), "b": torch.zeros(7), "step": 0}
    dcp.load(got, storage_reader=DataStatesReader(path, **(reader_kw or {})), no_dist=True)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"]) and got["step"] == 5


def test_every_file_system_writer_and_reader_argument_is_accepted():
    import inspect
    ours_w = inspect.signature(DataStatesWriter.__init__).parameters
    ours_r = inspect.signature(DataStatesReader.__init__).parameters
    assert set(inspect.signature(dcp.FileSystemWriter.__init__).parameters) - {"args", "kwargs"} <= set(ours_w)
    assert set(inspect.signature(dcp.FileSystemReader.__init__).parameters) <= set(ours_r)


def test_file_system_writer_arguments_without_effect_leave_the_state_alone(tmp_path):
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    _roundtrip(tmp_path, "a", {"single_file_per_rank": False, "per_thread_copy_ahead": 0,
                               "cache_staged_state_dict": True, "sync_files": False, "thread_count": 1,
                               "serialization_format": SerializationFormat.TORCH_SAVE},
               {"_extension_registry": ExtensionRegistry()})


def test_file_system_writer_arguments_that_would_change_the_files_are_refused_in_one_line(tmp_path):
    import pytest
    from torch.distributed.checkpoint._extension import StreamTransformExtension
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    class Rot13(StreamTransformExtension):  # a user's transform: dropping it would store plain bytes
        @staticmethod
        def registry_name() -> str:
            return "stream.rot13"

        @staticmethod
        def from_descriptor(version: str):
            return Rot13()

        def get_descriptor(self) -> str:
            return "stream.rot13/1"

        def transform_to(self, output):
            return output

        def transform_from(self, input):
            return input

    for kw, words in (({"serialization_format": SerializationFormat.SAFETENSORS}, "convert --to safetensors"),
                      ({"_extensions": [Rot13()]}, "stream.rot13"),
                      ({"per_thread_copy_ahead": -1}, "per_thread_copy_ahead")):
        with pytest.raises(ValueError) as ei:
            DataStatesWriter(str(tmp_path / "r"), **kw)
        assert words in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
    assert not os.path.exists(tmp_path / "r")


def test_overwrite_true_replaces_like_file_system_writer(tmp_path):
    path = str(tmp_path / "o")
    dcp.save({"x": torch.zeros(4)}, storage_writer=DataStatesWriter(path), no_dist=True)
    dcp.save({"x": torch.ones(4)}, storage_writer=DataStatesWriter(path, overwrite=True), no_dist=True)
    got = {"x": torch.zeros(4)}
    dcp.load(got, storage_reader=DataStatesReader(path), no_dist=True)
    assert torch.equal(got["x"], torch.ones(4))


def test_convert_reads_a_dcp_checkpoint_written_with_zstandard(tmp_path):
    import pytest
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    from dcp_datastates.convert import from_dcp
    state = {"w": torch.randn(300, 200), "i8": torch.arange(100, dtype=torch.int8), "step": 11}
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "ours")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(src, _extensions=[ZStandard()]), no_dist=True)
    from_dcp(src, dst, allow_pickle=True)  # DCP's .metadata is a pickle
    got = {"w": torch.zeros(300, 200), "i8": torch.zeros(100, dtype=torch.int8), "step": 0}
    dcp.load(got, storage_reader=DataStatesReader(dst), no_dist=True)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["i8"], state["i8"]) and got["step"] == 11


def test_a_forked_child_does_not_keep_a_save_link_open():
    """A process forked from the trainer (a DataLoader worker) must not hold a save's pipe open:
    the trainer learns that DCP's checkpoint process let go of a save (it died mid-flush) only
    when every write end is closed."""
    import multiprocessing
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import pytest

    from dcp_datastates.save.progress import SaveSession
    s = SaveSession(lazy=True)
    s.mark_snapshot()
    sent = ForkingPickler.dumps(s)  # as DCP sends it to its checkpoint process
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
    worker.start()  # forked while the save runs, and outliving it
    try:
        over_there = pickle.loads(sent)  # the copy in the checkpoint process
        del over_there  # its end closes: that process died mid-flush
        s.caller_ended()  # DCP's thread for the save ended
        with pytest.raises(Exception, match="let go of the save"):
            assert s.wait_persisted(timeout=5), "the link never saw its pipe end"
    finally:
        worker.kill()
        worker.join()


# ----------------------------------------------- tensors of DCP's checkpointable protocol

class _RowBlock(torch.Tensor):
    """A tensor of global shape whose rank holds rows ``[start, start + len(data))``, known to DCP
    through its checkpointable protocol only (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``), as Megatron-Core's ``torch_dist`` state is."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, start: int, rows: int):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size((rows, *data.shape[1:])), dtype=data.dtype)

    def __init__(self, data: torch.Tensor, start: int, rows: int) -> None:
        self.block, self.start = data, start

    def _chunk(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        offsets = torch.Size((self.start,) + (0,) * (self.block.dim() - 1))
        return ChunkStorageMetadata(offsets=offsets, sizes=self.block.size())

    def __create_write_items__(self, fqn, obj, index=None):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        chunk = self._chunk()
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets, index), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(
                              self.block), size=self.size()))]

    def __create_chunk_list__(self):
        return [self._chunk()]

    def __get_tensor_shard__(self, index):
        return self.block

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} answers DCP's protocol only ({func})")


def _checkpointable_cases(rank, world, base):
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    saved = {"w": _RowBlock(full[rank * 32:(rank + 1) * 32].clone(), rank * 32, 64), "step": 3}
    ours, ref = os.path.join(base, "ours"), os.path.join(base, "ref")
    dcp.save(saved, storage_writer=DataStatesWriter(ours))
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(ref))
    lo, hi = (0, 20) if rank == 0 else (20, 64)  # another split than the save's
    for reader in (DataStatesReader(ours), dcp.FileSystemReader(ref)):
        got = {"w": _RowBlock(torch.zeros(hi - lo, 8), lo, 64), "step": 0}
        dcp.load(got, storage_reader=reader)
        assert got["step"] == 3 and torch.equal(got["w"].block, full[lo:hi]), type(reader).__name__


def test_tensors_of_dcps_checkpointable_protocol_load_like_dcp(tmp_path):
    """State DCP knows only through its checkpointable protocol (Megatron-Core's ``torch_dist``
    tensors): saved on 2 ranks by rows, loaded into another split, as DCP's own storage does."""
    run_ranks(2, _checkpointable_cases, str(tmp_path))
