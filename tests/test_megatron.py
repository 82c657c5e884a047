"""Megatron-Core's ``dist_checkpointing`` through dcp-datastates
(``dcp_datastates.integrations.megatron``), in the frameworks' own environment (``.venv-frameworks``).

Two gloo ranks train a tensor-parallel MLP as Megatron shards one (the first layer split by
rows, the second by columns, its output summed across ranks, the last bias replicated), with
Adam; its sharded state dict is built with Megatron's own ``ShardedTensor``\\ s and optimizer
helpers.  A job trains three steps, saves with ``dist_checkpointing.save`` and ends; a new job
resumes with ``dist_checkpointing.load`` and matches an uninterrupted run bit for bit.

Megatron's checkpoint code calls CUDA in a few places even where the state is on the CPU
(``torch.cuda.current_device()`` as the device of a flag it all-reduces, a
``torch.cuda.synchronize()`` before forking its worker; its persistent worker sets a CUDA
device).  On this CPU-only machine the ranks give it the CPU there (``_cpu_for_cuda``); the
persistent worker runs on a GPU only, so a spawned process stands in for it below.
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing
import os

import pytest

pytest.importorskip("megatron.core", reason="Megatron-Core runs in .venv-frameworks (make test runs it there)")

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from torch.distributed.checkpoint import CheckpointException

from dcp_datastates.integrations import megatron as ours
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import manifest_is_ours
from tests.dist import run_ranks
from tests.frameworks import adam_moments, train_step, whole

SAVED_AT, STEPS = 3, 6


def _cpu_for_cuda() -> None:
    """Where Megatron's checkpoint code asks CUDA for a device or a sync, the CPU answers."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


class _SumAcrossRanks(torch.autograd.Function):
    """Megatron's reduction out of a tensor-parallel region: sum forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class TensorParallelMLP(torch.nn.Module):
    def __init__(self, rank: int, world: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the whole layer, the same on every rank; each keeps its part
        w1, b1, w2, b2 = torch.randn(64, 32) * 0.1, torch.randn(64) * 0.1, torch.randn(8, 64) * 0.1, torch.zeros(8)
        rows = slice(rank * 64 // world, (rank + 1) * 64 // world)
        self.w1 = torch.nn.Parameter(w1[rows].clone())
        self.b1 = torch.nn.Parameter(b1[rows].clone())
        self.w2 = torch.nn.Parameter(w2[:, rows].clone())
        self.b2 = torch.nn.Parameter(b2)
        self.rank, self.world = rank, world

    def forward(self, x):
        h = torch.relu(x @ self.w1.T + self.b1)
        return _SumAcrossRanks.apply(h @ self.w2.T) + self.b2

    def sharded_state_dict(self) -> dict:
        r, w = self.rank, self.world
        return {"w1": ShardedTensor.from_rank_offsets("mlp.w1", self.w1, (0, r, w)),
                "b1": ShardedTensor.from_rank_offsets("mlp.b1", self.b1, (0, r, w)),
                "w2": ShardedTensor.from_rank_offsets("mlp.w2", self.w2, (1, r, w)),
                "b2": ShardedTensor.from_rank_offsets("mlp.b2", self.b2, replica_id=r)}


def _new(rank, world, seed):
    model = TensorParallelMLP(rank, world, seed)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _checkpoint(model, opt, step: int) -> dict:
    """The job's sharded state dict, as a Megatron model and optimizer build theirs."""
    for p in model.parameters():  # the optimizer's state exists before a load fills it (init_state_fn)
        if not opt.state[p]:
            opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    model_sd = model.sharded_state_dict()
    optim_sd = opt.state_dict()
    adam_step = float(next(iter(optim_sd["state"].values()))["step"])
    optim_state_to_sharding_state(optim_sd, get_param_id_to_sharded_param_map(model_sd, model.parameters()),
                                  exclude_keys=("step",))
    return {"model": model_sd, "optimizer": optim_sd, "iteration": step, "adam_step": adam_step}


def _restore(model, opt, loaded: dict) -> int:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(loaded["model"][name])
    state = {pid: {**s, "step": torch.tensor(loaded["adam_step"])} for pid, s in loaded["optimizer"]["state"].items()}
    opt.load_state_dict({"state": state, "param_groups": loaded["optimizer"]["param_groups"]})
    return loaded["iteration"]


def _everything(model, opt) -> dict:
    """Parameters and Adam's moments of this rank, as lists (compared bit for bit)."""
    return {**{f"p.{k}": whole(v) for k, v in model.named_parameters()}, **adam_moments(opt)}


def _first_job(rank, world, base, saved_by: str):
    """The uninterrupted run, then a run of SAVED_AT steps that saves and ends."""
    _cpu_for_cuda()
    model, opt = _new(rank, world, 1)
    losses = [train_step(model, opt, s) for s in range(STEPS)]
    with open(os.path.join(base, f"ref-{rank}.json"), "w") as f:
        json.dump({"losses": losses, "state": _everything(model, opt)}, f)

    model, opt = _new(rank, world, 1)
    for s in range(SAVED_AT):
        train_step(model, opt, s)
    with open(os.path.join(base, f"saved-{rank}.json"), "w") as f:
        json.dump(_everything(model, opt), f)
    ck = os.path.join(base, "ck")
    os.makedirs(ck, exist_ok=True)  # Megatron-LM makes the iteration's directory before it saves
    if saved_by == "torch_dist":  # Megatron's own default storage
        dist_checkpointing.save(_checkpoint(model, opt, SAVED_AT), ck)
    elif saved_by == "ours":
        dist_checkpointing.save(_checkpoint(model, opt, SAVED_AT), ck, sharded_strategy=ours.DataStatesSaveStrategy())
    elif saved_by == "ours-fully-parallel":  # Megatron's wrapper spreads the replicated tensors' writes
        strategy = FullyParallelSaveStrategyWrapper(ours.DataStatesSaveStrategy(), dist.group.WORLD)
        dist_checkpointing.save(_checkpoint(model, opt, SAVED_AT), ck, sharded_strategy=strategy)
    else:  # async, scheduled as Megatron-LM does, training on while it saves
        strategy = ours.DataStatesSaveStrategy(optimizer=opt)
        request = dist_checkpointing.save(_checkpoint(model, opt, SAVED_AT), ck, sharded_strategy=strategy,
                                          async_sharded_save=True)
        calls = AsyncCallsQueue()
        calls.schedule_async_request(request)
        train_step(model, opt, SAVED_AT)  # changes the state being saved: waits for its snapshot only
        assert calls.maybe_finalize_async_calls(blocking=True) == [0]
        strategy.close()


def _resumed_job(rank, world, base, load_strategy):
    _cpu_for_cuda()
    model, opt = _new(rank, world, 2)  # other weights: everything must come from the checkpoint
    ck = os.path.join(base, "ck")
    strategy = ours.DataStatesLoadStrategy() if load_strategy == "ours" else None  # None: the registry's
    start = _restore(model, opt, dist_checkpointing.load(_checkpoint(model, opt, 0), ck, sharded_strategy=strategy))
    assert start == SAVED_AT
    losses = [train_step(model, opt, s) for s in range(start, STEPS)]
    ref = json.load(open(os.path.join(base, f"ref-{rank}.json")))
    assert losses == ref["losses"][SAVED_AT:], (losses, ref["losses"])
    state = _everything(model, opt)
    bad = [k for k in ref["state"] if state[k] != ref["state"][k]]
    assert not bad, bad


@pytest.mark.parametrize("saved_by,load_strategy", [("ours", "registry"), ("ours-async", "registry"),
                                                    ("ours-fully-parallel", "registry"), ("torch_dist", "ours")])
def test_a_megatron_job_resumes_bit_exactly_through_our_strategies(tmp_path, saved_by, load_strategy):
    """Saved through our strategy (sync, async in Megatron's own queue with a forked worker, or
    inside Megatron's ``FullyParallelSaveStrategyWrapper``), or by Megatron's ``torch_dist``
    before the switch; resumed through ours: named, or found in
    Megatron's registry by the backend ``metadata.json`` names, as Megatron-LM's own load does."""
    run_ranks(2, _first_job, str(tmp_path), saved_by)
    ck = tmp_path / "ck"
    assert manifest_is_ours(StorageTier(str(ck))) is (saved_by != "torch_dist")
    assert json.loads((ck / "metadata.json").read_text())["sharded_backend"] == (
        "torch_dist" if saved_by == "torch_dist" else ours.BACKEND)
    assert (ck / "common.pt").exists()  # Megatron's own part of the checkpoint
    run_ranks(2, _resumed_job, str(tmp_path), load_strategy)


def _megatron_resumes_it(rank, world, base):
    """Megatron alone (its registry's torch_dist strategy, DCP's FileSystemReader)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    _cpu_for_cuda()
    model, opt = _new(rank, world, 2)
    ck = os.path.join(base, "back")
    loaded = dist_checkpointing.load(_checkpoint(model, opt, 0), ck, sharded_strategy=TorchDistLoadShardedStrategy())
    assert _restore(model, opt, loaded) == SAVED_AT
    losses = [train_step(model, opt, s) for s in range(SAVED_AT, STEPS)]
    assert losses == json.load(open(os.path.join(base, f"ref-{rank}.json")))["losses"][SAVED_AT:]


def test_to_torch_dist_makes_a_checkpoint_megatron_reads_without_us(tmp_path):
    """The switch back: ``to_torch_dist`` gives Megatron's own torch_dist loader a checkpoint it reads."""
    run_ranks(2, _first_job, str(tmp_path), "ours")
    ours.to_torch_dist(str(tmp_path / "ck"), str(tmp_path / "back"))
    assert manifest_is_ours(StorageTier(str(tmp_path / "back"))) is False
    assert json.loads((tmp_path / "back" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    run_ranks(2, _megatron_resumes_it, str(tmp_path))
    with pytest.raises(ValueError, match="not a Megatron checkpoint saved with dcp-datastates"):
        ours.to_torch_dist(str(tmp_path / "back"), str(tmp_path / "again"))


def _waits_in(request, seen):
    args = list(request.async_fn_args)
    request.async_fn(*args, **request.async_fn_kwargs)
    seen.put("done")


def _persistent_worker(rank, world, base):
    """The request crosses to a spawned process, as to Megatron's persistent worker, whose wait
    ends once the save is committed; the finalize then reports it."""
    strategy = ours.DataStatesSaveStrategy()
    model, opt = _new(rank, world, 1)
    os.makedirs(os.path.join(base, "ck"), exist_ok=True)
    request = dist_checkpointing.save(_checkpoint(model, opt, 0), os.path.join(base, "ck"), sharded_strategy=strategy,
                                      async_sharded_save=True)
    ctx = multiprocessing.get_context("spawn")
    queue, seen = ctx.JoinableQueue(), ctx.SimpleQueue()
    worker = ctx.Process(target=_worker_loop, args=(queue, seen))
    worker.start()
    queue.put(request._replace(finalize_fns=[]))
    assert seen.get() == "done"
    worker.join(60)
    dist.barrier()
    for fn in request.finalize_fns:
        fn()


def _worker_loop(queue, seen):
    _waits_in(queue.get(), seen)


def test_an_async_request_waits_in_a_spawned_worker(tmp_path):
    run_ranks(2, _persistent_worker, str(tmp_path))
    assert manifest_is_ours(StorageTier(str(tmp_path / "ck"))) is True
    assert (tmp_path / "ck" / "metadata.json").exists()


def test_an_untested_megatron_version_is_refused_in_one_line(monkeypatch):
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.1\.0 is not a version") as e:
        ours.check_version("0.1.0")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    with pytest.raises(RuntimeError, match="megatron-core 9.0.0"):
        ours.DataStatesSaveStrategy()
    with pytest.raises(RuntimeError, match="megatron-core 9.0.0"):
        ours.DataStatesLoadStrategy()


def test_a_misspelled_option_is_refused_at_construction():
    with pytest.raises(ValueError, match="DataStatesSaveStrategy got an unknown option 'compresion'"):
        ours.DataStatesSaveStrategy(compresion="zstd")


def _one_rank_resumes(rank, world, base):
    """Tensor parallelism 2 -> 1: the one rank's whole tensors are the two ranks' parts."""
    model, opt = _new(rank, world, 2)
    loaded = dist_checkpointing.load(_checkpoint(model, opt, 0), os.path.join(base, "ck"))
    assert _restore(model, opt, loaded) == SAVED_AT
    parts = [json.load(open(os.path.join(base, f"saved-{r}.json"))) for r in range(2)]
    got = _everything(model, opt)
    for i, (name, p) in enumerate(model.named_parameters()):
        axis = {"w1": 0, "b1": 0, "w2": 1}.get(name)
        for key in (f"p.{name}", f"adam.{i}.exp_avg", f"adam.{i}.exp_avg_sq"):
            shards = [torch.tensor(part[key]) for part in parts]
            if axis is None:  # replicated: each rank saved the same
                want = shards[0]
            else:
                want = torch.cat([t.reshape(-1, *p.shape[1:]) if axis == 0 else t.reshape(p.shape[0], -1)
                                  for t in shards], dim=axis).flatten()
            assert torch.equal(torch.tensor(got[key]), want), key


def test_a_checkpoint_of_two_ranks_loads_on_one(tmp_path):
    """Saved with tensor parallelism 2 through ours, loaded by Megatron's registry on one rank."""
    run_ranks(2, _first_job, str(tmp_path), "ours")
    run_ranks(1, _one_rank_resumes, str(tmp_path))


def _async_save_fails(rank, world, base):
    from tests.disk import full_at_the_commit

    _cpu_for_cuda()
    full_at_the_commit(pytest.MonkeyPatch())  # the manifest's commit meets a full disk
    model, opt = _new(rank, world, 1)
    ck = os.path.join(base, "ck")
    os.makedirs(ck, exist_ok=True)
    strategy = ours.DataStatesSaveStrategy(optimizer=opt)
    request = dist_checkpointing.save(_checkpoint(model, opt, 0), ck, sharded_strategy=strategy, async_sharded_save=True)
    calls = AsyncCallsQueue()
    calls.schedule_async_request(request)
    train_step(model, opt, 0)
    with pytest.raises(CheckpointException) as e:
        calls.maybe_finalize_async_calls(blocking=True)  # on every rank: none waits for another
    causes = [str(f[0] if isinstance(f, tuple) else f) for f in e.value.failures.values()]
    assert any("No space left on device" in c and "file=.metadata" in c for c in causes), causes


def test_an_async_save_that_fails_raises_at_the_finalize_on_every_rank(tmp_path):
    """The save's error reaches Megatron's finalize on both ranks (the worker itself never
    raises, which would leave Megatron's queue waiting); no metadata.json, nothing committed."""
    run_ranks(2, _async_save_fails, str(tmp_path))
    assert not (tmp_path / "ck" / "metadata.json").exists()
    assert not manifest_is_ours(StorageTier(str(tmp_path / "ck")))


def _a_strategy_per_save(rank, world, base):
    groups = []
    for i in range(3):  # a strategy made at every save, as a script may: one checkpoint group still
        ck = os.path.join(base, f"ck-{i}")
        os.makedirs(ck, exist_ok=True)
        strategy = ours.DataStatesSaveStrategy()
        model, opt = _new(rank, world, i)
        dist_checkpointing.save(_checkpoint(model, opt, i), ck, sharded_strategy=strategy)
        groups.append(strategy.process_group)
    assert groups[0] is not None and all(g is groups[0] for g in groups)


def test_strategies_made_at_every_save_share_one_checkpoint_group(tmp_path):
    run_ranks(2, _a_strategy_per_save, str(tmp_path))
    assert all(manifest_is_ours(StorageTier(str(tmp_path / f"ck-{i}"))) for i in range(3))
