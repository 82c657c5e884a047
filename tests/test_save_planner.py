"""``DataStatesSavePlanner`` against DCP's ``DefaultSavePlanner``: the same flat state, paths,
and local plan, whichever way it gets there."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcp_datastates import DataStatesSavePlanner


class _Opaque:
    """A value DCP saves as bytes."""

    def __eq__(self, other):
        return isinstance(other, _Opaque)


def _t(*shape):
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


STATES = {
    "flat": lambda: {"a": _t(3), "b": torch.nn.Parameter(_t(2, 2)), "c": _t()},
    "nested": lambda: {
        "model": {"layers": {"0": {"w": _t(4), "b": _t(1)}, "1": {"w": _t(4)}}, "norm": torch.nn.Parameter(_t(2))},
        "optimizer": {"state.layers.0.w.exp_avg": _t(4), "param_groups.layers.0.w.lr": 0.1,
                      "param_groups.layers.0.w.amsgrad": False, "param_groups.layers.0.w.foreach": None},
        "step": 3, "name": "run", "blob": b"\x00\x01", "scalars": [1, 2.5, "x", None, True], "empty": {},
        "no_list": [], "train_state": {"tokens": 10**12}},
    "list_of_tensors": lambda: {"a": _t(2), "l": [_t(1), _t(2)]},
    "list_of_dicts": lambda: {"pg": [{"lr": 0.1, "params": [0, 1]}], "w": _t(3)},
    "list_in_list": lambda: {"l": [[1, 2], [3]], "w": _t(3)},
    "int_keys": lambda: {1: _t(2), "x": {2: _t(3)}},
    "tuple_leaf": lambda: {"betas": (0.9, 0.99), "w": _t(2)},
    "opaque_leaf": lambda: {"o": _Opaque(), "w": _t(2)},
    "other_mapping": lambda: {"m": collections.OrderedDict(a=_t(2), b=_t(1))},
    "subclass_leaf": lambda: {"w": _t(2).as_subclass(_Sub)},
}


class _Sub(torch.Tensor):
    """A tensor subclass: DCP's own traversal decides."""


def _set_up(planner, state):
    planner.set_up_planner(state, None, True)
    return planner


@pytest.mark.parametrize("name", sorted(STATES))
def test_set_up_flattens_as_dcp_does(name):
    """Keys, their order, the values themselves and the paths DCP's ``load`` unflattens by:
    the one-pass flattening of plain nested dicts must give exactly what DCP's traversal does,
    and everything else goes through DCP's."""
    state = STATES[name]()
    ours, dcps = _set_up(DataStatesSavePlanner(), state), _set_up(DefaultSavePlanner(), state)
    assert list(ours.state_dict) == list(dcps.state_dict)
    assert all(ours.state_dict[k] is v for k, v in dcps.state_dict.items())
    assert list(ours.mappings.items()) == list(dcps.mappings.items())
    assert all(type(x) is type(y) for k, p in dcps.mappings.items() for x, y in zip(p, ours.mappings[k]))
    assert ours.create_local_plan() == dcps.create_local_plan()


def test_set_up_of_a_duplicated_key_fails_as_dcps():
    """``{"a.b": x, "a": {"b": y}}`` flattens to one key twice: DCP refuses it, so must we."""
    state = {"a.b": _t(1), "a": {"b": _t(2)}}
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        _set_up(DefaultSavePlanner(), state)
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        _set_up(DataStatesSavePlanner(), state)


def test_set_up_without_flattening_keeps_the_state():
    """``flatten_state_dict=False``: the state as given, no paths (DCP's own way)."""
    state = STATES["nested"]()
    ours = _set_up(DataStatesSavePlanner(flatten_state_dict=False), state)
    dcps = _set_up(DefaultSavePlanner(flatten_state_dict=False), state)
    assert ours.state_dict == dcps.state_dict and ours.mappings == dcps.mappings == {}


def _hints(plans):
    return [[(i.index.fqn, i.index.index) for i in p.items] for p in plans]


def _global(planner, plans):
    out, md = planner.create_global_plan(plans)
    return out, md, _hints(out)


@pytest.mark.parametrize("name", sorted(STATES))
@pytest.mark.parametrize("caching", [False, True])
def test_plans_are_dcps(name, caching):
    """The local plan made directly, and the global plan and metadata of whole tensors, are
    what DCP's planner makes: items, index hints, metadata and paths (with DCP's plan cache
    on, DCP's own way)."""
    state = STATES[name]()
    ours = _set_up(DataStatesSavePlanner(enable_plan_caching=caching), state)
    dcps = _set_up(DefaultSavePlanner(enable_plan_caching=caching), state)
    local = ours.create_local_plan()
    assert local == dcps.create_local_plan() and ours.plan == dcps.plan
    assert _global(ours, [local]) == _global(dcps, [dcps.plan])


def _plan_of(state):
    return _set_up(DefaultSavePlanner(), state).create_local_plan()


def test_global_plan_of_several_ranks_is_dcps():
    """Ranks' plans: a plain tensor every rank holds (deduplicated), one only a rank holds,
    a hint DCP has not set; then a tensor in two chunks (DCP's way, which checks them), and two
    overlapping chunks, which DCP refuses and so must we.  (Without sharding rules, whose
    dedup gives small items to the lowest rank instead.)"""
    whole = [_plan_of({"shared": _t(4), "r0": _t(2), "v": 1}), _plan_of({"shared": _t(4), "r1": _t(3)})]
    ours, dcps = DataStatesSavePlanner(sharding_rules=False), DefaultSavePlanner()
    for p in (ours, dcps):
        _set_up(p, {})
    assert _global(ours, whole) == _global(dcps, whole)
    assert _hints(_global(ours, whole)[0]) == [[("shared", 0), ("r0", 0), ("v", None)], [("r1", 0)]]
    row = lambda off, n: WriteItem(index=MetadataIndex("w", torch.Size([off])), type=WriteItemType.SHARD,  # noqa: E731
                                   tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([off]), torch.Size([n])),
                                                               TensorProperties(torch.float32), torch.Size([4])))
    split = [SavePlan([row(0, 2)], planner_data={}), SavePlan([row(2, 2)], planner_data={})]
    got = _global(ours, split)
    assert got == _global(dcps, split) and got[2] == [[("w", 0)], [("w", 1)]]
    for p in (ours, dcps):
        with pytest.raises(ValueError, match="overlapping"):
            p.create_global_plan([SavePlan([row(0, 3)], planner_data={}), SavePlan([row(2, 2)], planner_data={})])
