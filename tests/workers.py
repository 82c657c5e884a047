"""Rank functions for the multi-process tests (spawned by ``tests.dist.run_ranks``).

DCP's own FileSystemWriter/Reader serve as the oracle: the same state is
saved with both backends and loaded with both, and the results must match.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_datastates import (DataStatesLoadPlanner, DataStatesReader, DataStatesSavePlanner,
                            DataStatesWriter)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 7)
        self.l2 = nn.Linear(7, 5)
        self.register_buffer("scale", torch.arange(3, dtype=torch.float32))

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))) * self.scale.sum()


def make_fsdp(world: int, seed: int = 0, train: bool = True):
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model.l2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if train:
        for _ in range(2):
            model(torch.randn(4, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
    return model, opt


def app_state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step": 7, "note": "hello", "none": None,
                                                   "lst": [1, 2.5, "x"]}}


def save_fsdp(rank, world, ours_dir, ref_dir, use_collectives=True, planner=False):
    model, opt = make_fsdp(world)
    sd = app_state(model, opt)
    kw = {"planner": DataStatesSavePlanner()} if planner else {}
    dcp.save(sd, storage_writer=DataStatesWriter(ours_dir), use_collectives=use_collectives, **kw)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(ref_dir))


def save_fsdp_async_device_cache(rank, world, ours_dir, ref_dir, mode):
    """An async save through the device cache level, the optimizer stepping right after it;
    the reference is a synchronous DCP save of the same pre-step state."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_datastates import async_save
    model, opt = make_fsdp(world)
    dcp.save(app_state(model, opt), storage_writer=dcp.FileSystemWriter(ref_dir))
    model(torch.randn(4, 6)).sum().backward()
    # every tensor of this model is small: unless the mode is "thread-eager", they stay live
    # (eager_copy_bytes=0), so that the step really races the lazy snapshot through the device cache
    eager = mode == "thread-eager"
    writer = DataStatesWriter(ours_dir, host_cache_bytes=1 << 20, device_cache_bytes=2 << 20,
                              eager_copy_bytes=64 << 20 if eager else 0)
    ctype = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    fut = async_save(app_state(model, opt), storage_writer=writer, async_checkpointer_type=ctype)
    if eager:
        assert writer.wait_snapshot(timeout=0)  # every local shard was copied by the call
    opt.step()  # waits for the snapshot (the step barrier), then changes every parameter
    fut.result()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _compare(a, b, path=""):
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _compare(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(_local(a), _local(b)), f"tensor mismatch at {path}"
    else:
        assert a == b, (path, a, b)


def load_fsdp_and_compare(rank, world, ours_dir, ref_dir, planner=False):
    m1, o1 = make_fsdp(world, seed=1, train=True)
    m2, o2 = make_fsdp(world, seed=2, train=True)
    s1, s2 = app_state(m1, o1), app_state(m2, o2)
    s1["extra"] = {"step": 0, "note": "", "none": 1, "lst": []}
    s2["extra"] = {"step": 0, "note": "", "none": 1, "lst": []}
    kw = {"planner": DataStatesLoadPlanner()} if planner else {}
    dcp.load(s1, storage_reader=DataStatesReader(ours_dir), **kw)
    dcp.load(s2, storage_reader=dcp.FileSystemReader(ref_dir))
    _compare(s1, s2)
    assert s1["extra"] == {"step": 7, "note": "hello", "none": None, "lst": [1, 2.5, "x"]}
    set_state_dict(m1, o1, model_state_dict=s1["model"], optim_state_dict=s1["optim"])
    # the restored model trains
    m1(torch.randn(4, 6)).sum().backward()
    o1.step()


# ----------------------------------------------------------------- DTensor

def _dt_source(world):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    full = {"row": torch.randn(10, 6), "col": torch.randn(5, 12), "rep": torch.randn(4, 6),
            "tiny": torch.randn(3, 2), "bf": torch.randn(9, 4).bfloat16()}
    placements = {"row": [Shard(0)], "col": [Shard(1)], "rep": [Replicate()], "tiny": [Shard(0)],
                  "bf": [Shard(0)]}
    return mesh, full, {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items()}


def dtensor_save(rank, world, ours_dir):
    _, full, sd = _dt_source(world)
    dcp.save(sd, storage_writer=DataStatesWriter(ours_dir))


def dtensor_load(rank, world, ours_dir, src_world, mesh_shape, planner=False):
    torch.manual_seed(3)
    full = {"row": torch.randn(10, 6), "col": torch.randn(5, 12), "rep": torch.randn(4, 6),
            "tiny": torch.randn(3, 2), "bf": torch.randn(9, 4).bfloat16()}
    mesh = init_device_mesh("cpu", mesh_shape)
    if len(mesh_shape) == 1:
        targets = {"row": [Shard(1)], "col": [Shard(0)], "rep": [Shard(1)], "tiny": [Replicate()],
                   "bf": [Shard(1)]}
    else:
        targets = {"row": [Shard(0), Shard(1)], "col": [Replicate(), Shard(1)],
                   "rep": [Shard(1), Shard(0)], "tiny": [Shard(0), Replicate()],
                   "bf": [Shard(1), Replicate()]}
    sd = {k: distribute_tensor(torch.zeros_like(v), mesh, targets[k]) for k, v in full.items()}
    reader = DataStatesReader(ours_dir)
    dcp.load(sd, storage_reader=reader, **({"planner": DataStatesLoadPlanner()} if planner else {}))
    for k, v in sd.items():
        assert torch.equal(v.full_tensor(), full[k]), k


# ----------------------------------------------------------------- async

def async_mutation(rank, world, base, mode):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    pg = dist.new_group(backend="gloo")
    torch.manual_seed(0)  # plain tensors count as replicated: same values on every rank
    sd = {"w": torch.randn(1024, 1024), "b": torch.randn(1000), "n": {"step": 3}}
    expect = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    ctype = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    for i in range(2):  # two saves through the same writer class, second reuses the daemon
        path = os.path.join(base, f"step-{i}")
        writer = DataStatesWriter(path, host_cache_bytes=1 << 20)  # cache << state: streamed
        from dcp_datastates import async_save
        fut = async_save(sd, storage_writer=writer, process_group=pg, async_checkpointer_type=ctype)
        assert writer.wait_snapshot(timeout=120)
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                v.add_(1000.0)  # mutate right after the snapshot
        fut.result()
        out = {"w": torch.zeros(1024, 1024), "b": torch.zeros(1000), "n": {"step": 0}}
        dcp.load(out, storage_reader=DataStatesReader(path), process_group=pg)
        for k, v in expect.items():
            assert torch.equal(out[k], v), (mode, i, k)
        assert out["n"] == {"step": 3}
        expect = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def load_expect_coverage_error(rank, world, ours_dir):
    from dcp_datastates import CoverageError
    m, o = make_fsdp(world, seed=1, train=True)
    s = app_state(m, o)
    try:
        dcp.load(s, storage_reader=DataStatesReader(ours_dir))
    except BaseException as e:  # DCP wraps it in CheckpointException
        assert "CoverageError" in repr(e) or isinstance(e, CoverageError), repr(e)
        assert "covers only" in str(e)
        return
    raise AssertionError("a load that cannot fill the destination must raise")


# ----------------------------------------------------------------- tiers

def _tier_full():
    torch.manual_seed(5)
    return torch.randn(64, 1024), torch.randn(128, 256)


def _tier_state(rank):
    """A sharded tensor, and a replicated one of 128 KiB: with 2 ranks its replica rule has rank
    1 write it (crc32("r") is odd), so the index holds its record and rank 1's part its digests."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full, rep = _tier_full()
    return full, {"w": distribute_tensor(full, mesh, [Shard(0)]), "r": distribute_tensor(rep, mesh, [Replicate()]),
                  "meta": {"step": 5}}


def tiered_save_node_local(rank, world, base):
    from dcp_datastates import Checkpointer
    full, sd = _tier_state(rank)
    c = Checkpointer([os.path.join(base, f"node{rank}"), os.path.join(base, "pfs")],
                     node_local=True, async_mode="thread")
    c.save(5, sd)
    c.wait_persisted(120)
    assert c.committed_steps(0) == [5]  # the manifest was committed on this node too
    dist.barrier()


def tiered_restore_node_local(rank, world, base):
    from dcp_datastates import Checkpointer
    mesh = init_device_mesh("cpu", (world,))
    full, rep = _tier_full()
    sd = {"w": distribute_tensor(torch.zeros(64, 1024), mesh, [Shard(0)]),
          "r": distribute_tensor(torch.zeros(128, 256), mesh, [Replicate()]), "meta": {"step": -1}}
    c = Checkpointer([os.path.join(base, f"node{rank}"), os.path.join(base, "pfs")], node_local=True)
    assert c.load(sd) == 5
    assert torch.equal(sd["w"].full_tensor(), full) and sd["meta"] == {"step": 5}
    assert torch.equal(sd["r"].full_tensor(), rep)  # held record; digests from rank 1's part on the PFS
    served = c.last_restore["served"]
    assert served.get(c.step_path(0, 5), 0) > 0 and served.get(c.step_path(1, 5), 0) > 0, served


# ----------------------------------------------------------------- corruption

def corruption_state_full():
    g = torch.Generator().manual_seed(77)
    return {"w": torch.randn(64, 1024, generator=g), "r": torch.randn(300, 7, generator=g),
            "small": {str(i): torch.randn(10, generator=g) for i in range(5)},
            "meta": {"step": 9, "name": "corruption"}}


def corruption_save(rank, world, base):
    full = corruption_state_full()
    mesh = init_device_mesh("cpu", (world,))
    sd = dict(full)
    sd["w"] = distribute_tensor(full["w"], mesh, [Shard(0)])
    w = DataStatesWriter(os.path.join(base, "t1"), persist_to=[os.path.join(base, "t2")])
    dcp.save(sd, storage_writer=w)
    assert w.wait_persisted(120)
    dist.barrier()
    if rank == 0:  # the coordinator's commit of t2 may trail the other rank's upload
        assert os.path.exists(os.path.join(base, "t2", ".metadata"))


def guard_roundtrip(rank, world, base, mode):
    """SnapshotGuard: optimizer.step() waits for the lazy snapshot, THREAD or PROCESS."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_datastates import SnapshotGuard, async_save
    pg = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 1024)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = os.path.join(base, f"guard-{mode}")
    writer = DataStatesWriter(path, host_cache_bytes=1 << 20)  # 1 MiB cache, 4 MiB of weights
    guard = SnapshotGuard(opt, writer)
    ctype = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    fut = async_save({"m": model.state_dict()}, storage_writer=writer, process_group=pg,
                     async_checkpointer_type=ctype)
    opt.step()  # mutates every parameter in place, after the guard's wait
    guard.remove()
    fut.result()
    assert guard.waits == 1
    assert not torch.equal(model.weight, before["weight"])
    out = {"m": {k: torch.zeros_like(v) for k, v in before.items()}}
    dcp.load(out, storage_reader=DataStatesReader(path), process_group=pg)
    for k in before:
        assert torch.equal(out["m"][k], before[k]), (mode, k)
    t = writer.timings()
    assert "snapshot_done_s" in t, t
    if rank == 0:  # the coordinator commits; from DCP's checkpoint process the stages come over a pipe
        deadline = time.monotonic() + 30
        while "persisted_s" not in (t := writer.timings()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0 <= t["snapshot_done_s"] <= t["data_written_s"] <= t["committed_s"] <= t["persisted_s"], t


# ----------------------------------------------------------------- incremental

class LoraNet(nn.Module):
    """A frozen base (the bulk of the bytes) with a small trainable adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(64, 256)
        self.adapter = nn.Linear(64, 256, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.adapter(x)


def _lora(world, seed=0):
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = LoraNet()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    g = torch.Generator().manual_seed(11)
    table = distribute_tensor(torch.randn(2048, 1024, generator=g), mesh, [Shard(0)])  # 8 MiB, frozen
    return model, opt, table


def _lora_state(model, opt, table, step):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "table": table, "meta": {"step": step}}


def incremental_save(rank, world, base):
    from dcp_datastates import Checkpointer
    model, opt, table = _lora(world)
    c = Checkpointer([os.path.join(base, f"node{rank}"), os.path.join(base, "pfs")], keep=[2, 3],
                     node_local=True, async_mode="thread", incremental=True)
    for step in range(1, 6):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 4:  # a sparse update of the frozen table: one row on rank 0's shard
            table.to_local()[3] += 1 if rank == 0 else 0
        sd = _lora_state(model, opt, table, step)
        c.save(step, sd)
        c.wait_persisted(120)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(base, "ref", f"step-{step}")))
    c.close()
    assert c.committed_steps(0) == [4, 5] and c.committed_steps(1) == [3, 4, 5]
    w = c._inflight
    assert w is None
    dist.barrier()


def incremental_load(rank, world, base):
    from dcp_datastates import Checkpointer
    c = Checkpointer([os.path.join(base, f"node{rank}"), os.path.join(base, "pfs")], node_local=True)
    for step in (3, 4, 5):
        m1, o1, t1 = _lora(world, seed=1)
        m2, o2, t2 = _lora(world, seed=2)
        ours = _lora_state(m1, o1, distribute_tensor(torch.zeros(2048, 1024), t1.device_mesh, [Shard(0)]), -1)
        ref = _lora_state(m2, o2, distribute_tensor(torch.ones(2048, 1024), t2.device_mesh, [Shard(0)]), -2)
        assert c.load(ours, step=step) == step
        dcp.load(ref, storage_reader=dcp.FileSystemReader(os.path.join(base, "ref", f"step-{step}")))
        _compare(ours, ref)
        assert ours["meta"] == {"step": step}


def incremental_process_mode(rank, world, base):
    """Incremental saves from DCP's background process (the writer is pickled there)."""
    from dcp_datastates import Checkpointer
    model, opt, table = _lora(world)
    c = Checkpointer([os.path.join(base, "run")], async_mode="process", incremental=True, keep=2,
                     process_group=dist.new_group(backend="gloo"))
    saved = {}
    for step in range(1, 4):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        sd = _lora_state(model, opt, table, step)
        c.save(step, sd)
        c.wait_snapshot()
        c.wait()
        saved[step] = {k: v.full_tensor().clone() for k, v in sd["model"].items()}
        if step > 1:  # the frozen table and base weights were referenced, not rewritten
            assert c.last_stats["bytes_reused"] >= 8 << 20, c.last_stats
    c.close()
    m2, o2, t2 = _lora(world, seed=3)
    out = _lora_state(m2, o2, distribute_tensor(torch.zeros(2048, 1024), t2.device_mesh, [Shard(0)]), -1)
    assert c.load(out) == 3
    for k, v in saved[3].items():
        assert torch.equal(out["model"][k].full_tensor(), v), k
    assert torch.equal(out["table"].full_tensor(), table.full_tensor())


# ----------------------------------------------------------------- DCP's plan cache

def plan_cache_saves(rank, world, base, kind):
    """Three saves of one layout with DCP's plan cache on, each incremental on the one before
    (a frozen tensor is referenced, not rewritten); DCP's own save of each is the reference.
    ``kind`` "ours": ``DataStatesSavePlanner``, whose plans carry each save's own id;
    "dcp": ``DefaultSavePlanner``, whose cache replays the first save's plan and its id, so
    the second save must fail before it writes, leaving the first intact."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.api import CheckpointException
    for step, sd, w in _plan_cache_steps(world, base):
        path = w.path
        planner = (DataStatesSavePlanner if kind == "ours" else DefaultSavePlanner)(enable_plan_caching=True)
        if kind == "dcp" and step == 1:
            try:
                dcp.save(sd, storage_writer=w, planner=planner)
            except CheckpointException as e:
                assert "plan cache" in str(e) and "DataStatesSavePlanner" in str(e), str(e)
            else:
                raise AssertionError("a replayed plan was written")
            assert not os.path.exists(os.path.join(path, ".metadata"))
            return
        dcp.save(sd, storage_writer=w, planner=planner)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(base, "ref", f"step-{step}")))


def _plan_cache_steps(world, base):
    """Three training steps of one layout; for each, its state and a writer incremental on the
    step before (a frozen tensor is referenced, not rewritten)."""
    model, opt = make_fsdp(world)
    frozen = torch.arange(600_000, dtype=torch.float32)
    for step in range(3):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        yield step, {**app_state(model, opt), "frozen": frozen}, DataStatesWriter(
            os.path.join(base, f"step-{step}"),
            incremental_base=os.path.join(base, f"step-{step - 1}") if step else None)


def plan_cache_load(rank, world, base, steps):
    for step in steps:
        m1, o1 = make_fsdp(world, seed=1, train=True)
        m2, o2 = make_fsdp(world, seed=2, train=True)
        s1 = {**app_state(m1, o1), "frozen": torch.zeros(600_000)}
        s2 = {**app_state(m2, o2), "frozen": torch.ones(600_000)}
        dcp.load(s1, storage_reader=DataStatesReader(os.path.join(base, f"step-{step}")))
        dcp.load(s2, storage_reader=dcp.FileSystemReader(os.path.join(base, "ref", f"step-{step}")))
        _compare(s1, s2)


# ----------------------------------------------------------------- a stale node-local copy

def _attempt_state(world, seed):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    full = torch.randn(64, 1024)
    return full, {"w": distribute_tensor(full, mesh, [Shard(0)]), "meta": {"seed": seed}}


def save_attempt(rank, world, base, seed):
    """One attempt of a job saving step 5 (node-local tier per rank, a shared persistent one)."""
    from dcp_datastates import Checkpointer
    _full, sd = _attempt_state(world, seed)
    c = Checkpointer([os.path.join(base, f"node{rank}"), os.path.join(base, "pfs")],
                     node_local=True, async_mode=None)
    c.save(5, sd)
    c.close()
    dist.barrier()


def load_never_mixed(rank, world, base, want_seed):
    """Every rank restores step 5 of the save the persistent tier holds, whatever a node-local
    directory still holds from another attempt."""
    from dcp_datastates import Checkpointer
    full, _ = _attempt_state(world, want_seed)
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.zeros(64, 1024), mesh, [Shard(0)]), "meta": {"seed": -1}}
    c = Checkpointer([os.path.join(base, f"node{rank}"), os.path.join(base, "pfs")], node_local=True)
    assert c.load(sd) == 5
    assert sd["meta"] == {"seed": want_seed}, sd["meta"]
    assert torch.equal(sd["w"].full_tensor(), full), "a mix of two saves"


def load_plain_reader_refuses_mix(rank, world, base):
    """Through DataStatesReader alone (node-local path first, the persistent one as fallback),
    a rank whose node-local copy is another save makes the load fail before any byte is read."""
    from torch.distributed.checkpoint.api import CheckpointException
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.zeros(64, 1024), mesh, [Shard(0)]), "meta": {"seed": -1}}
    r = DataStatesReader(os.path.join(base, f"node{rank}", "step-5"), fallback=os.path.join(base, "pfs", "step-5"))
    try:
        dcp.load(sd, storage_reader=r)
    except CheckpointException as e:
        assert "different saves" in str(e), str(e)
    else:
        raise AssertionError("a mix of two saves was loaded")
    assert r.bytes_read == 0 and sd["meta"] == {"seed": -1}


def plan_cache_async(rank, world, base, mode):
    """``plan_cache_saves`` through ``async_save`` (DCP's THREAD or PROCESS checkpointer: the
    plan cache lives in the process that plans, the background one for PROCESS)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_datastates import async_save
    ctype = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    pg = dist.new_group(backend="gloo")
    for step, sd, w in _plan_cache_steps(world, base):
        async_save(sd, storage_writer=w, planner=DataStatesSavePlanner(enable_plan_caching=True),
                   async_checkpointer_type=ctype, process_group=pg).result()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(base, "ref", f"step-{step}")))


# ----------------------------------------------------------------- format 4: sharding rules

def _rules_full():
    torch.manual_seed(5)
    return {"row": torch.randn(10, 6), "tiny": torch.randn(3, 2), "col": torch.randn(5, 7),
            "rep": torch.randn(4, 6), "hsdp": torch.randn(9, 4), "grid": torch.randn(5, 6),
            "plain": torch.arange(5.0), "twice": torch.randn(16, 3),
            # the size of "row" under other rules, and under the same one: a load planner that
            # reuses one tensor's box arithmetic for another must tell them apart
            "row_cols": torch.randn(10, 6), "row_hsdp": torch.randn(10, 6), "row_again": torch.randn(10, 6),
            # one rule's dimensions on two 2-D meshes of other shapes
            "row_square": torch.randn(10, 6), "row_tall": torch.randn(10, 6)}


def rules_save(rank, world, ours_dir):
    """1-D and 2-D meshes with Shard, Replicate, uneven and empty shards, an HSDP layout
    (replicated over one mesh dimension, sharded over the other), a tensor whose dimension 0
    both mesh dimensions shard (no rule: its chunks are listed) and a plain tensor."""
    full = _rules_full()
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    mesh3 = init_device_mesh("cpu", (world, 1))
    place = {"row": (mesh1, [Shard(0)]), "tiny": (mesh1, [Shard(0)]), "col": (mesh1, [Shard(1)]),
             "rep": (mesh1, [Replicate()]), "hsdp": (mesh2, [Replicate(), Shard(0)]),
             "grid": (mesh2, [Shard(1), Shard(0)]), "twice": (mesh2, [Shard(0), Shard(0)]),
             "row_cols": (mesh1, [Shard(1)]), "row_hsdp": (mesh2, [Replicate(), Shard(0)]),
             "row_again": (mesh1, [Shard(0)]), "row_square": (mesh2, [Shard(0), Replicate()]),
             "row_tall": (mesh3, [Shard(0), Replicate()])}
    sd = {k: distribute_tensor(full[k], *place[k]) if k in place else full[k] for k in full}
    dcp.save(sd, storage_writer=DataStatesWriter(ours_dir), planner=DataStatesSavePlanner())


def held_incremental(rank, world, base):
    """Two saves of a replicated DTensor (its box written by one replica, its record in the
    index) and a sharded one; the second incremental on the first, with the replicated tensor
    unchanged: its record then names the first save's file.  Both load on every rank."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    rep = distribute_tensor(torch.randn(1 << 20, generator=g), mesh, [Replicate()])  # 4 MiB: one dedup unit
    for step in range(2):
        row = distribute_tensor(torch.full((8, 4), float(step)), mesh, [Shard(0)])
        w = DataStatesWriter(os.path.join(base, f"step-{step}"), dedup_unit_bytes=1 << 20,
                             incremental_base=os.path.join(base, "step-0") if step else None)
        dcp.save({"rep": rep, "row": row}, storage_writer=w, planner=DataStatesSavePlanner())
    for step in range(2):
        out = {"rep": distribute_tensor(torch.zeros(1 << 20), mesh, [Replicate()]),
               "row": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}
        dcp.load(out, storage_reader=DataStatesReader(os.path.join(base, f"step-{step}")),
                 planner=DataStatesLoadPlanner())
        assert torch.equal(out["rep"].full_tensor(), rep.full_tensor()), (rank, step)
        assert bool(torch.all(out["row"].full_tensor() == step)), (rank, step)


def rules_load(rank, world, ours_dir, planner):
    full = _rules_full()
    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(v.ndim - 1)]) if k != "plain"
          else torch.zeros_like(v) for k, v in full.items()}
    dcp.load(sd, storage_reader=DataStatesReader(ours_dir), **({"planner": DataStatesLoadPlanner()} if planner else {}))
    for k, v in sd.items():
        assert torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, full[k]), k


def saves_through_one_writer(rank, world, base):
    """One writer on each rank for a synchronous and an async save, twice: a rank that is not
    the coordinator frees its writer when DCP has its results (it never gets ``finish``).  Plain
    ``dcp.async_save``, which gives the writer no future to free it by."""
    pg = dist.new_group(backend="gloo")
    writer = DataStatesWriter(None)
    for i in range(2):
        sd = {"w": torch.full((4096,), float(10 * i)), "n": {"i": i}}  # the same on every rank
        dcp.save(sd, storage_writer=writer, checkpoint_id=os.path.join(base, f"sync-{i}"), process_group=pg)
        dcp.async_save(sd, storage_writer=writer, checkpoint_id=os.path.join(base, f"async-{i}"),
                       process_group=pg).result(timeout=120)
        for kind in ("sync", "async"):
            out = {"w": torch.zeros(4096), "n": {"i": -1}}
            dcp.load(out, storage_reader=DataStatesReader(os.path.join(base, f"{kind}-{i}")), process_group=pg)
            assert out["n"] == {"i": i} and bool(torch.all(out["w"] == 10 * i)), (rank, kind, i)


# ------------------------------------------------------------ the crash-point tests' state
def crash_state(rank: int, seed: int) -> dict:
    """Rank ``rank``'s state of save ``seed``: its own tensor (two write buffers' worth), a
    tensor every rank holds alike (DCP's planner has one rank write it) and a value."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    return {f"w{rank}": torch.randn(3 << 18, generator=g), "shared": torch.arange(4096.0) * seed,
            "seed": seed}


def crash_template(rank: int) -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in crash_state(rank, 0).items()}


def crash_same(rank: int, got: dict, seed: int) -> bool:
    want = crash_state(rank, seed)
    return got["seed"] == seed and all(torch.equal(got[k], v) for k, v in want.items() if k != "seed")
