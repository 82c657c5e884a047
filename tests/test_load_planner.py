"""DataStatesLoadPlanner's shortcut for tensors stored whole (issue 15, per-item cost): its plan
is the one DCP's own planner makes, item for item, and DCP's checks still apply."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesWriter


def _state():
    g = torch.Generator().manual_seed(11)
    return {"scalar": torch.tensor(3.5), "vec": torch.randn(17, generator=g),
            "mat": torch.randn(5, 7, generator=g), "ints": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "param": torch.nn.Parameter(torch.randn(4, 4, generator=g)), "empty": torch.empty(0, 3),
            "nested": {"a": torch.randn(3, generator=g), "step": 9}, "note": "x"}


def _plan(planner, sd, md):
    planner.set_up_planner(sd, md, is_coordinator=True)
    return planner.create_local_plan()


def _key(ri):
    return (ri.dest_index.fqn, tuple(ri.dest_index.offset or ()), ri.type.value)


@pytest.fixture
def saved(tmp_path):
    sd = _state()
    path = str(tmp_path / "c")
    dcp.save(sd, storage_writer=DataStatesWriter(path), no_dist=True)
    return path, sd


def _fresh(sd):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _fresh(v)
        elif isinstance(v, torch.nn.Parameter):
            out[k] = torch.nn.Parameter(torch.zeros_like(v))
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = v
    return out


def test_plan_matches_dcps_item_for_item(saved):
    path, sd = saved
    md = DataStatesReader(path).read_metadata()
    ours = sorted(_plan(DataStatesLoadPlanner(), _fresh(sd), md).items, key=_key)
    dcps = sorted(_plan(DefaultLoadPlanner(), _fresh(sd), md).items, key=_key)
    assert ours == dcps


def test_whole_tensors_load_exactly_with_the_shortcut(saved):
    path, sd = saved
    out = _fresh(sd)
    dcp.load(out, storage_reader=DataStatesReader(path), planner=DataStatesLoadPlanner(), no_dist=True)
    for k in ("scalar", "vec", "mat", "ints", "param", "empty"):
        assert torch.equal(out[k], sd[k]), k
    assert torch.equal(out["nested"]["a"], sd["nested"]["a"]) and out["nested"]["step"] == 9


def test_a_shape_mismatch_still_fails_as_in_dcp(saved):
    path, sd = saved
    out = _fresh(sd)
    out["mat"] = torch.zeros(7, 5)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(out, storage_reader=DataStatesReader(path), planner=DataStatesLoadPlanner(), no_dist=True)
    assert "Size mismatch" in str(ei.value.failures[0]) and "mat" in str(ei.value.failures[0])


def test_partial_loads_and_missing_keys_behave_as_in_dcp(saved):
    path, sd = saved
    part = {"vec": torch.zeros(17), "mat": torch.zeros(5, 7)}
    dcp.load(part, storage_reader=DataStatesReader(path), planner=DataStatesLoadPlanner(), no_dist=True)
    assert torch.equal(part["vec"], sd["vec"]) and torch.equal(part["mat"], sd["mat"])
    extra = {"vec": torch.zeros(17), "absent": torch.zeros(2)}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(extra, storage_reader=DataStatesReader(path), planner=DataStatesLoadPlanner(), no_dist=True)
    assert "Missing key" in str(ei.value.failures[0]) and "absent" in str(ei.value.failures[0])
    dcp.load(extra, storage_reader=DataStatesReader(path),
             planner=DataStatesLoadPlanner(allow_partial_load=True), no_dist=True)
    assert torch.equal(extra["vec"], sd["vec"]) and not extra["absent"].any()


def test_the_tensor_a_read_fills_is_the_one_dcps_lookup_gives(saved):
    path, sd = saved
    md = DataStatesReader(path).read_metadata()
    planner = DataStatesLoadPlanner()
    items = [ri for ri in _plan(planner, _fresh(sd), md).items if ri.type.name == "TENSOR"]
    assert len(items) >= 6
    for ri in items:
        ours, dcps = planner.resolve_tensor(ri), DefaultLoadPlanner.resolve_tensor(planner, ri)
        assert (ours.data_ptr(), ours.shape, ours.stride(), type(ours)) == \
            (dcps.data_ptr(), dcps.shape, dcps.stride(), type(dcps)), ri.dest_index.fqn


def test_a_subclass_that_narrows_its_own_way_is_asked_for_every_tensor(saved):
    path, sd = saved

    class Narrowing(DataStatesLoadPlanner):
        asked: list = []

        def transform_tensor(self, read_item, tensor):
            self.asked.append(read_item.dest_index.fqn)
            return super().transform_tensor(read_item, tensor)

    out = _fresh(sd)
    dcp.load(out, storage_reader=DataStatesReader(path), planner=Narrowing(), no_dist=True)
    assert sorted(set(Narrowing.asked)) == sorted(["scalar", "vec", "mat", "ints", "param", "nested.a"])
    assert torch.equal(out["mat"], sd["mat"])


def test_a_planner_object_that_narrows_its_own_way_is_asked_for_every_tensor(saved):
    """The same with ``transform_tensor`` replaced on the planner object, not its class."""
    path, sd = saved
    planner, asked = DataStatesLoadPlanner(), []
    plain = planner.transform_tensor

    def narrowing(read_item, tensor):
        asked.append(read_item.dest_index.fqn)
        return plain(read_item, tensor)
    planner.transform_tensor = narrowing
    out = _fresh(sd)
    dcp.load(out, storage_reader=DataStatesReader(path), planner=planner, no_dist=True)
    assert sorted(set(asked)) == sorted(["scalar", "vec", "mat", "ints", "param", "nested.a"])
    assert torch.equal(out["mat"], sd["mat"])
