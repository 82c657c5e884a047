"""Lightning's Trainer on dcp-datastates (``dcp_datastates.integrations.lightning``), in the
frameworks' own environment (``.venv-frameworks``): two gloo ranks on the CPU, a model sharded
with FSDP2 by ``ModelParallelStrategy``, Adam; a job trains three steps and saves, a new job
resumes from the checkpoint and trains on, and matches an uninterrupted run bit for bit."""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest

pytest.importorskip("lightning", reason="Lightning runs in .venv-frameworks (make test runs it there)")

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from dcp_datastates.integrations import lightning as ours
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import manifest_is_ours
from tests.dist import run_ranks
from tests.frameworks import adam_moments, train_step, whole

SAVED_AT, STEPS = 3, 5


class Net(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=self.device_mesh)
        fully_shard(self.net, mesh=self.device_mesh)

    def training_step(self, batch, _i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _data():
    g = torch.Generator().manual_seed(0)  # one batch a rank an epoch: a resume starts an epoch
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 32, generator=g),
                                                                      torch.randn(16, 8, generator=g)), batch_size=8)


def _fit(strategy, seed: int, steps: int, ckpt_path=None, net: type[Net] | None = None) -> Net:
    model = (net or Net)(seed)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    model.trainer_ = trainer
    return model


def _params(model: Net) -> dict[str, list]:
    """The parameters and Adam's moments, whole (compared bit for bit)."""
    return {**{k: whole(v) for k, v in model.net.state_dict().items()}, **adam_moments(model.trainer_.optimizers[0])}


def _first_job(rank, world, base, save_with_ours: bool):
    """The uninterrupted run, then a run of SAVED_AT steps that saves (and ends)."""
    ref = _fit(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 1, STEPS)
    strategy = (ours.DataStatesModelParallelStrategy if save_with_ours else ModelParallelStrategy)(
        data_parallel_size=2, tensor_parallel_size=1)
    saved = _fit(strategy, 1, SAVED_AT)
    saved.trainer_.save_checkpoint(os.path.join(base, "ck"))
    with open(os.path.join(base, f"ref-{rank}.json"), "w") as f:  # each rank's own losses
        json.dump({"losses": ref.losses, "params": _params(ref)}, f)


def _resumed_job(rank, world, base):
    resumed = _fit(ours.DataStatesModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 2, STEPS,
                   ckpt_path=os.path.join(base, "ck"))
    params = _params(resumed)
    ref = json.load(open(os.path.join(base, f"ref-{rank}.json")))
    assert resumed.losses == ref["losses"][SAVED_AT:], (resumed.losses, ref["losses"])
    bad = [k for k in ref["params"] if params[k] != ref["params"][k]]
    assert not bad, bad


@pytest.mark.parametrize("saved_by", ["ours", "lightning"])
def test_a_trainer_resumes_bit_exactly_through_our_strategy(tmp_path, saved_by):
    """Saved through our strategy, or with Lightning's own before the switch; resumed through ours."""
    run_ranks(2, _first_job, str(tmp_path), saved_by == "ours")
    assert manifest_is_ours(StorageTier(str(tmp_path / "ck"))) is (saved_by == "ours")
    assert (tmp_path / "ck" / "meta.pt").exists()  # Lightning's own part of the checkpoint
    run_ranks(2, _resumed_job, str(tmp_path))


def test_an_untested_lightning_version_is_refused_in_one_line(monkeypatch):
    with pytest.raises(RuntimeError, match=r"lightning 0\.1\.0 is not a version") as e:
        ours.check_version("0.1.0")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    with pytest.raises(RuntimeError, match="lightning 9.0.0"):
        ours.DataStatesModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)


# ------------------------------------------------------------------ FSDPStrategy (FSDP1)

class Fsdp1Net(Net):
    def configure_model(self) -> None:
        """Wrapped here, where Lightning lets a model wrap itself: its own wrapping names no
        device on the CPU, which FSDP1 refuses; ``device_id`` CPU, it runs on gloo."""
        self.net = FSDP(self.net, device_id=torch.device("cpu"))


def _full1(model) -> dict[str, list]:
    wrapped, opt = model.trainer_.strategy.model, model.trainer_.optimizers[0]
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False)):
        out = {k: v.flatten().tolist() for k, v in wrapped.state_dict().items()}
        for name, st in FSDP.optim_state_dict(wrapped, opt)["state"].items():
            out.update({f"adam.{name}.{k}": st[k].flatten().tolist() for k in ("exp_avg", "exp_avg_sq")})
    return out


class LightningsFSDP(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, unchanged: Lightning refuses the class itself on the CPU by
    its exact type (``type(strategy) is FSDPStrategy``), not a subclass; FSDP1 runs on gloo."""


def _first_job1(rank, world, base, save_with_ours: bool):
    ref = _fit(LightningsFSDP(state_dict_type="sharded"), 1, STEPS, net=Fsdp1Net)
    strategy = ours.DataStatesFSDPStrategy() if save_with_ours else LightningsFSDP(state_dict_type="sharded")
    saved = _fit(strategy, 1, SAVED_AT, net=Fsdp1Net)
    saved.trainer_.save_checkpoint(os.path.join(base, "ck"))
    with open(os.path.join(base, f"ref-{rank}.json"), "w") as f:
        json.dump({"losses": ref.losses, "params": _full1(ref)}, f)


def _resumed_job1(rank, world, base):
    resumed = _fit(ours.DataStatesFSDPStrategy(), 2, STEPS, ckpt_path=os.path.join(base, "ck"), net=Fsdp1Net)
    ref = json.load(open(os.path.join(base, f"ref-{rank}.json")))
    assert resumed.losses == ref["losses"][SAVED_AT:], (resumed.losses, ref["losses"])
    params = _full1(resumed)
    bad = [k for k in ref["params"] if params[k] != ref["params"][k]]
    assert not bad, bad


@pytest.mark.parametrize("saved_by", ["ours", "lightning"])
def test_an_fsdp1_trainer_resumes_bit_exactly_through_our_strategy(tmp_path, saved_by):
    """``FSDPStrategy`` (FSDP1, sharded state dicts, its optimizer state loaded through DCP's
    ``load_sharded_optimizer_state_dict``) on the CPU: saved through ours or Lightning's own
    storage, resumed through ours."""
    run_ranks(2, _first_job1, str(tmp_path), saved_by == "ours")
    assert manifest_is_ours(StorageTier(str(tmp_path / "ck"))) is (saved_by == "ours")
    run_ranks(2, _resumed_job1, str(tmp_path))


# ------------------------------------------------------------------------------- Fabric

def _parallelize(model, mesh):
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _fabric_run(strategy, steps: int, load_from=None, save_to=None, saved_at: int = 0):
    import lightning as L
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(7 if load_from else 1)
    model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": opt, "step": 0}
    if load_from:
        fabric.load(load_from, state)
    losses = []
    for s in range(state["step"], steps):
        losses.append(train_step(model, opt, s, backward=fabric.backward))
        state["step"] = s + 1
        if save_to and s + 1 == saved_at:
            fabric.save(save_to, state)
    return losses, {**{k: whole(v) for k, v in model.state_dict().items()}, **adam_moments(opt)}


def _fabric_jobs(rank, world, base, saved_by: str):
    """A run that saves at SAVED_AT and goes on (through ours, or Fabric's own strategy), then a
    new Fabric that resumes from the save through ours."""
    from lightning.fabric.strategies import ModelParallelStrategy as FabricMP
    ck = os.path.join(base, "ck")
    kinds = {"ours": ours.DataStatesFabricModelParallelStrategy, "lightning": FabricMP}
    ref_losses, ref_params = _fabric_run(kinds[saved_by](_parallelize, data_parallel_size=2, tensor_parallel_size=1),
                                         STEPS, save_to=ck, saved_at=SAVED_AT)
    dist.barrier()
    assert manifest_is_ours(StorageTier(ck)) is (saved_by == "ours")
    losses, params = _fabric_run(ours.DataStatesFabricModelParallelStrategy(
        _parallelize, data_parallel_size=2, tensor_parallel_size=1), STEPS, load_from=ck)
    assert losses == ref_losses[SAVED_AT:], (losses, ref_losses)
    assert params == ref_params


@pytest.mark.parametrize("saved_by", ["ours", "lightning"])
def test_fabric_resumes_bit_exactly_through_our_strategy(tmp_path, saved_by):
    """Fabric's ``ModelParallelStrategy``: ``fabric.save`` mid-run (through ours, or Fabric's own
    storage), ``fabric.load`` in a new Fabric, the same losses and parameters as the run that went on."""
    run_ranks(2, _fabric_jobs, str(tmp_path), saved_by)
