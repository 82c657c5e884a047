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
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_datastates.integrations import lightning as ours
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import manifest_is_ours
from tests.dist import run_ranks

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


def _fit(strategy, seed: int, steps: int, ckpt_path=None) -> Net:
    model = Net(seed)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    model.trainer_ = trainer
    return model


def _params(model: Net) -> dict[str, list]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).flatten().tolist()
            for k, v in model.net.state_dict().items()}


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
