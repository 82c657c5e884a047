"""Hugging Face accelerate's sharded checkpoints through dcp-datastates
(``dcp_datastates.integrations.accelerate``), in the frameworks' own environment (``.venv-frameworks``).

accelerate turns FSDP on only with an accelerator (its CPU runs are DDP). These tests run on two
gloo ranks with a model sharded with FSDP2 and Adam, and reach its FSDP checkpoints three ways:
its checkpoint functions called as ``save_state`` and the ``Trainer`` call them; an
``Accelerator`` given the state accelerate sets up for FSDP with an accelerator, whose own
``save_state``/``load_state`` then run; and a ``Trainer`` whose accelerator is given that
state, trained, checkpointed by ``save_steps`` and resumed with ``resume_from_checkpoint``."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

pytest.importorskip("accelerate", reason="accelerate runs in .venv-frameworks (make test runs it there)")

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_datastates import convert
from dcp_datastates.integrations import accelerate as ours
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import manifest_is_ours
from tests.dist import run_ranks
from tests.frameworks import train_step, whole

STEPS, SAVED_AT = 5, 3


def _model(world: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _full(model, opt) -> dict:
    out = {f"p.{k}": (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
    for k, v in get_optimizer_state_dict(model, opt)["state"].items():
        for name, t in v.items():
            out[f"o.{k}.{name}"] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def _plugin():
    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")


def _save_then_resume(rank, world, base, switch_at_save: bool, switch_at_load: bool, convert_back: bool = False):
    """Train SAVED_AT steps and save through accelerate's functions; a new model and optimizer
    (another seed: nothing carried over) load through them and train on; an uninterrupted run
    gives the state and losses to match."""
    import accelerate.utils as acc_utils
    acc = Accelerator(cpu=True)
    plugin = _plugin()
    (ours.use_datastates if switch_at_save else ours.stop_using_datastates)()
    model, opt = _model(world, seed=1)
    for s in range(SAVED_AT):
        train_step(model, opt, s)
    acc_utils.save_fsdp_model(plugin, acc, model, base)
    acc_utils.save_fsdp_optimizer(plugin, acc, opt, model, base)
    dist.barrier()
    assert manifest_is_ours(StorageTier(os.path.join(base, "pytorch_model_fsdp_0"))) is switch_at_save
    if convert_back:  # the switch back of docs/integrations/accelerate.md: each directory to DCP's format
        if rank == 0:
            for name in ("pytorch_model_fsdp_0", "optimizer_0"):
                convert.to_dcp(os.path.join(base, name), os.path.join(base, "back", name))
        dist.barrier()
        base = os.path.join(base, "back")
    (ours.use_datastates if switch_at_load else ours.stop_using_datastates)()
    model2, opt2 = _model(world, seed=2)
    train_step(model2, opt2, 99)  # the optimizer has state of its own, which the load replaces
    acc_utils.load_fsdp_model(plugin, acc, model2, base)
    acc_utils.load_fsdp_optimizer(plugin, acc, opt2, model2, base)
    got = [train_step(model2, opt2, s) for s in range(SAVED_AT, STEPS)]
    ref_model, ref_opt = _model(world, seed=1)
    want = [train_step(ref_model, ref_opt, s) for s in range(STEPS)][SAVED_AT:]
    assert got == want, (got, want)
    a, b = _full(model2, opt2), _full(ref_model, ref_opt)
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad
    ours.stop_using_datastates()


def test_a_sharded_model_and_optimizer_resume_bit_exactly_through_our_storage(tmp_path):
    run_ranks(2, _save_then_resume, str(tmp_path), True, True)


def test_a_checkpoint_accelerate_wrote_before_the_switch_resumes(tmp_path):
    """Saved with accelerate's own storage (DCP's format), loaded after ``use_datastates``."""
    run_ranks(2, _save_then_resume, str(tmp_path), False, True)


def test_a_checkpoint_of_ours_converted_back_resumes_with_accelerates_own_storage(tmp_path):
    run_ranks(2, _save_then_resume, str(tmp_path), True, False, True)


def test_an_untested_accelerate_version_is_refused_in_one_line(monkeypatch):
    with pytest.raises(RuntimeError, match=r"accelerate 0\.1\.0 is not a version .* tested with") as e:
        ours.check_version("0.1.0")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    with pytest.raises(RuntimeError, match="accelerate 9.0.0"):
        ours.use_datastates()


def test_a_misspelled_option_fails_at_the_switch():
    with pytest.raises(ValueError, match=r"use_datastates got an unknown option 'host_cache_byte'"):
        ours.use_datastates(host_cache_byte=1 << 20)


def test_the_trainer_calls_the_wrapped_functions_and_the_switch_back_restores_them():
    """transformers' Trainer imports accelerate's functions by name: the switch reaches those
    names too, whether transformers was imported before it or after."""
    import accelerate.utils.fsdp_utils as fsdp_utils
    import transformers.trainer as trainer
    before = {n: getattr(trainer, n) for n in ours.FUNCTIONS}
    ours.use_datastates()
    try:
        for n in ours.FUNCTIONS:
            assert getattr(trainer, n) is getattr(fsdp_utils, n) and getattr(trainer, n).__wrapped__ is before[n]
    finally:
        ours.stop_using_datastates()
    assert {n: getattr(trainer, n) for n in ours.FUNCTIONS} == before


def _accelerator_as_with_an_accelerator(model, opt):
    """An ``Accelerator`` whose state is the one accelerate sets up for FSDP with an accelerator
    (on the CPU it runs DDP and never takes its FSDP branches), holding ``model`` and ``opt`` as
    ``prepare`` would: its own ``save_state``/``load_state`` then run their FSDP paths."""
    from accelerate.utils import DistributedType
    acc = Accelerator(cpu=True)
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = _plugin()
    acc._models.append(model)
    acc._optimizers.append(opt)
    return acc


def _save_state_then_load_state(rank, world, base):
    ours.use_datastates()
    model, opt = _model(world, seed=1)
    acc = _accelerator_as_with_an_accelerator(model, opt)
    for s in range(SAVED_AT):
        train_step(model, opt, s)
    acc.save_state(base)
    dist.barrier()
    assert manifest_is_ours(StorageTier(os.path.join(base, "pytorch_model_fsdp_0")))
    assert manifest_is_ours(StorageTier(os.path.join(base, "optimizer_0")))
    model2, opt2 = _model(world, seed=2)
    train_step(model2, opt2, 99)
    acc2 = _accelerator_as_with_an_accelerator(model2, opt2)
    acc2.load_state(base)
    got = [train_step(model2, opt2, s) for s in range(SAVED_AT, STEPS)]
    ref_model, ref_opt = _model(world, seed=1)
    want = [train_step(ref_model, ref_opt, s) for s in range(STEPS)][SAVED_AT:]
    assert got == want, (got, want)
    a, b = _full(model2, opt2), _full(ref_model, ref_opt)
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    ours.stop_using_datastates()


def test_accelerator_save_state_and_load_state_resume_bit_exactly(tmp_path):
    """``Accelerator.save_state``/``load_state`` themselves (their FSDP paths, RNG states and
    all) through our storage."""
    run_ranks(2, _save_state_then_load_state, str(tmp_path))


# ------------------------------------------------------------------ the transformers Trainer

class _Regressor(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)

    def forward(self, x, labels=None):
        out = self.b(torch.relu(self.a(x))).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(16, generator=g), "labels": torch.randn((), generator=g)}


def _trainer(base: str, seed: int):
    """A ``Trainer`` whose ``Accelerator`` has the state accelerate sets up for FSDP2 with an
    accelerator (on the CPU it runs DDP): its own prepare, training loop, checkpoints and
    resume then take their FSDP paths."""
    from accelerate.utils import DistributedType
    from transformers import Trainer, TrainingArguments

    class FsdpOnTheCpu(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            self.accelerator.state.distributed_type = DistributedType.FSDP
            self.accelerator.state.fsdp_plugin = _plugin()
            self.is_fsdp_enabled = True

    args = TrainingArguments(output_dir=base, max_steps=STEPS + 1, save_steps=SAVED_AT, logging_steps=1,
                             per_device_train_batch_size=4, report_to=[], use_cpu=True, data_seed=0, seed=0)
    return FsdpOnTheCpu(model=_Regressor(seed), args=args, train_dataset=_Rows())


def _losses_and_params(trainer) -> tuple[dict, dict]:
    """Each step's logged loss; the parameters and the optimizer's moments, whole."""
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    sd = trainer.model_wrapped.state_dict()
    assert any(isinstance(v, DTensor) for v in sd.values())  # sharded by accelerate's FSDP2 prepare
    params = {k: whole(v) for k, v in sd.items()}
    for k, st in get_optimizer_state_dict(trainer.model_wrapped, trainer.optimizer.optimizer)["state"].items():
        params.update({f"o.{k}.{n}": whole(t) for n, t in st.items() if n != "step"})
    return losses, params


def _trainer_jobs(rank, world, base, saved_by_ours: bool):
    (ours.use_datastates if saved_by_ours else ours.stop_using_datastates)()
    first = _trainer(base, seed=1)
    first.train()  # checkpoints at step SAVED_AT on the way
    ref_losses, ref_params = _losses_and_params(first)
    ck = os.path.join(base, f"checkpoint-{SAVED_AT}")
    dist.barrier()
    assert manifest_is_ours(StorageTier(os.path.join(ck, "pytorch_model_fsdp_0"))) is saved_by_ours
    assert manifest_is_ours(StorageTier(os.path.join(ck, "optimizer_0"))) is saved_by_ours
    ours.use_datastates()
    resumed = _trainer(base, seed=2)  # other weights: everything must come from the checkpoint
    resumed.train(resume_from_checkpoint=ck)
    losses, params = _losses_and_params(resumed)
    after = {s: v for s, v in ref_losses.items() if s > SAVED_AT}
    assert {s: v for s, v in losses.items() if s > SAVED_AT} == after and after, (losses, ref_losses)
    assert params == ref_params
    ours.stop_using_datastates()


@pytest.mark.parametrize("saved_by", ["ours", "accelerate"])
def test_a_trainer_resumes_bit_exactly_through_our_storage(tmp_path, saved_by):
    """The Trainer's own checkpoints (``save_steps``) and ``resume_from_checkpoint``, FSDP2 on
    two gloo ranks: saved through ours, or with accelerate's own storage before the switch;
    resumed through ours, the same losses and parameters as the run that went on."""
    run_ranks(2, _trainer_jobs, str(tmp_path), saved_by == "ours")
