"""Multi-rank FSDP2 / DTensor save and load with resharding, on gloo ranks."""

import os

import pytest

from tests import workers
from tests.dist import run_ranks


@pytest.fixture(scope="module")
def fsdp2_ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp2")
    ours, ref = str(base / "ours"), str(base / "ref")
    run_ranks(2, workers.save_fsdp, ours, ref)
    return ours, ref


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_adam_reshard_from_2(fsdp2_ckpt, world):
    ours, ref = fsdp2_ckpt
    run_ranks(world, workers.load_fsdp_and_compare, ours, ref)


def test_fsdp2_1_to_2_with_our_planners(tmp_path):
    ours, ref = str(tmp_path / "ours"), str(tmp_path / "ref")
    run_ranks(1, workers.save_fsdp, ours, ref, True, True)
    run_ranks(2, workers.load_fsdp_and_compare, ours, ref, True)


def test_use_collectives_false_rank_manifests_merge(tmp_path):
    ours, ref = str(tmp_path / "ours"), str(tmp_path / "ref")
    run_ranks(2, workers.save_fsdp, ours, ref, False)
    names = sorted(os.listdir(ours))
    assert ".metadata" not in names
    rank_manifests = [n for n in names if n.startswith(".manifest.rank-")]
    # one per rank, both named with the save id the ranks agreed on (issue 17)
    assert [n[:20] for n in rank_manifests] == [".manifest.rank-00000", ".manifest.rank-00001"]
    assert len({n[21:] for n in rank_manifests}) == 1
    run_ranks(1, workers.load_fsdp_and_compare, ours, ref)  # resharded: needs both ranks' chunks

    # Publish only rank 0's manifest as the global one: the load must refuse, not leave zeros.
    import shutil
    partial = str(tmp_path / "partial")
    shutil.copytree(ours, partial)
    os.replace(os.path.join(partial, rank_manifests[0]), os.path.join(partial, ".metadata"))
    os.remove(os.path.join(partial, rank_manifests[1]))
    run_ranks(1, workers.load_expect_coverage_error, partial)


def test_dtensor_placements_and_meshes(tmp_path):
    ours = str(tmp_path / "dt")
    run_ranks(4, workers.dtensor_save, ours)  # "tiny" has 3 rows over 4 ranks: a zero-size shard
    run_ranks(4, workers.dtensor_load, ours, 4, (2, 2))  # 1-D mesh -> 2-D mesh
    run_ranks(2, workers.dtensor_load, ours, 4, (2,))  # Shard(0)/Replicate -> Shard(1) column blocks
    # DataStatesLoadPlanner narrows each tensor to the chunks overlapping the rank's boxes first
    run_ranks(4, workers.dtensor_load, ours, 4, (2, 2), True)
    run_ranks(3, workers.dtensor_load, ours, 4, (3,), True)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_save_snapshot_is_consistent(tmp_path, mode):
    run_ranks(2, workers.async_mutation, str(tmp_path), mode)


def test_one_writer_per_rank_for_several_saves(tmp_path):
    run_ranks(2, workers.saves_through_one_writer, str(tmp_path))


@pytest.mark.parametrize("world,mode", [(1, "thread"), (1, "process"), (2, "process")])
def test_snapshot_guard(tmp_path, world, mode):
    run_ranks(world, workers.guard_roundtrip, str(tmp_path), mode)


@pytest.mark.parametrize("mode", ["thread", "process", "thread-eager"])
def test_fsdp2_async_save_through_the_device_cache_reshards(tmp_path, mode):
    """thread-eager: each DTensor's small local shard is copied when async_save is called."""
    ours, ref = str(tmp_path / "ours"), str(tmp_path / "ref")
    run_ranks(2, workers.save_fsdp_async_device_cache, ours, ref, mode)
    run_ranks(3, workers.load_fsdp_and_compare, ours, ref)
