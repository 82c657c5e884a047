"""DCP's plan cache (``enable_plan_caching=True``, what large jobs turn on to skip the global
planning step) replays a rank's first final plan, with the writer's data of that save in it."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import load_manifest
from tests import workers
from tests.dist import run_ranks


def test_cached_plans_with_our_planner_save_distinct_loadable_checkpoints(tmp_path):
    base = str(tmp_path)
    run_ranks(2, workers.plan_cache_saves, base, "ours")
    ids = {load_manifest(StorageTier(str(tmp_path / f"step-{s}"))).save_id for s in range(3)}
    assert len(ids) == 3  # each save its own id, though DCP replayed the plans
    run_ranks(3, workers.plan_cache_load, base, [0, 1, 2])


def test_replayed_plan_from_dcp_planner_fails_before_writing(tmp_path):
    base = str(tmp_path)
    run_ranks(2, workers.plan_cache_saves, base, "dcp")
    run_ranks(2, workers.plan_cache_load, base, [0])  # the first checkpoint is intact


def test_single_process_with_dcp_planner_cache_keeps_its_own_ids(tmp_path):
    frozen = torch.randn(600_000)
    for step in range(3):
        sd = {"a": torch.full((300_000,), float(step)), "frozen": frozen}
        base = str(tmp_path / f"step-{step - 1}") if step else None
        dcp.save(sd, storage_writer=DataStatesWriter(str(tmp_path / f"step-{step}"), incremental_base=base),
                 planner=DefaultSavePlanner(enable_plan_caching=True), no_dist=True)
    for step in range(3):
        out = {"a": torch.zeros(300_000), "frozen": torch.zeros(600_000)}
        dcp.load(out, storage_reader=DataStatesReader(str(tmp_path / f"step-{step}")), no_dist=True)
        assert torch.equal(out["a"], torch.full((300_000,), float(step))) and torch.equal(out["frozen"], frozen)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_cached_plans_through_async_save(tmp_path, mode):
    base = str(tmp_path)
    run_ranks(2, workers.plan_cache_async, base, mode)
    ids = {load_manifest(StorageTier(str(tmp_path / f"step-{s}"))).save_id for s in range(3)}
    assert len(ids) == 3
    run_ranks(2, workers.plan_cache_load, base, [0, 1, 2])
