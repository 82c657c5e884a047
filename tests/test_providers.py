"""Providers that compose (issue 13): registered plain classes, tensor subclasses with their
tag, nested registered types, in sync, THREAD and PROCESS saves, in 2-rank FSDP2 state loaded
on 1 and 3 ranks; unregistered providers and failing ``flatten`` name what went wrong."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesWriter
from dcp_datastates.providers import registry as _reg  # noqa: F401
from tests import provider_types as pt
from tests.dist import run_ranks


def _unwrap(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    text = str(e)
    if failures:
        for f in failures.values():
            text += " " + str(getattr(f, "exc", f))
    return text


@pytest.mark.parametrize("instances", [True, False])
@pytest.mark.parametrize("planner", [False, True])
def test_sync_round_trip(tmp_path, instances, planner):
    path = str(tmp_path / "c")
    dcp.save(pt.sample_state(), storage_writer=DataStatesWriter(path), no_dist=True)
    out = pt.placeholders(instances)
    kw = {"planner": DataStatesLoadPlanner()} if planner else {}
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True, **kw)
    pt.check_state(out)


def test_thread_async_round_trip(tmp_path):
    path = str(tmp_path / "c")
    writer = DataStatesWriter(path)
    fut = dcp.async_save(pt.sample_state(), storage_writer=writer)
    writer.wait_snapshot()
    fut.result(timeout=120)
    out = pt.placeholders(False)
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    pt.check_state(out)


def _process_mode(rank, world, path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_datastates import async_save
    writer = DataStatesWriter(path)
    fut = async_save(pt.sample_state(), storage_writer=writer,
                     async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    writer.wait_snapshot(timeout=120)
    fut.result()
    out = pt.placeholders(True)
    dcp.load(out, storage_reader=DataStatesReader(path))
    pt.check_state(out)


def test_process_async_round_trip(tmp_path):
    run_ranks(1, _process_mode, str(tmp_path / "c"))


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_unregistered_provider_on_load_names_it(tmp_path, mode):
    path = str(tmp_path / "c")
    if mode == "process":
        run_ranks(1, _process_mode, path)  # saves in PROCESS mode (and checks that round trip)
    elif mode == "thread":
        writer = DataStatesWriter(path)
        dcp.async_save(pt.sample_state(), storage_writer=writer).result(timeout=120)
    else:
        dcp.save(pt.sample_state(), storage_writer=DataStatesWriter(path), no_dist=True)
    from dcp_datastates import register_provider, unregister_provider
    unregister_provider(pt.Scaled)
    try:
        with pytest.raises(BaseException) as ei:
            dcp.load(pt.placeholders(False), storage_reader=DataStatesReader(path), no_dist=True)
        text = _unwrap(ei.value)
        assert "tests.provider_types.Scaled" in text and "not registered" in text, text[-1500:]
    finally:
        register_provider(pt.Scaled, pt.ScaledProvider(), clobber=True)


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_flatten_raising_fails_the_save_uncommitted(tmp_path, mode):
    path = str(tmp_path / "c")
    sd = {"w": torch.randn(8), "bad": pt.Broken(torch.randn(4))}
    writer = DataStatesWriter(path)
    with pytest.raises(BaseException) as ei:
        if mode == "sync":
            dcp.save(sd, storage_writer=writer, no_dist=True)
        else:
            dcp.async_save(sd, storage_writer=writer).result(timeout=120)
    text = _unwrap(ei.value)
    assert "flatten exploded" in text and "tensor=bad" in text, text[-1500:]
    assert not os.path.exists(os.path.join(path, ".metadata"))


def _flatten_raising_process(rank, world, path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_datastates import async_save
    sd = {"w": torch.randn(8), "bad": pt.Broken(torch.randn(4))}
    with pytest.raises(BaseException) as ei:
        async_save(sd, storage_writer=DataStatesWriter(path),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(timeout=120)
    assert "flatten exploded" in _unwrap(ei.value) or "Broken" in _unwrap(ei.value)
    assert not os.path.exists(os.path.join(path, ".metadata"))


def test_flatten_raising_process_mode(tmp_path):
    run_ranks(1, _flatten_raising_process, str(tmp_path / "c"))


# -------------------------------------------------- a registered type in FSDP2 state
def _fsdp_save(rank, world, path, mode="sync"):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_datastates import async_save
    from tests.workers import app_state, make_fsdp
    model, opt = make_fsdp(world)
    sd = app_state(model, opt)
    sd["extra"]["scaled"] = pt.Scaled(torch.arange(6.0), torch.ones(2), 0.5)
    sd["pair"] = pt.Pair(pt.Scaled(torch.arange(3.0), torch.zeros(2), 2.0), torch.arange(4.0), "p")
    if mode == "sync":
        dcp.save(sd, storage_writer=DataStatesWriter(path))
        return
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    writer = DataStatesWriter(path)
    fut = async_save(sd, storage_writer=writer, process_group=dist.new_group(backend="gloo"),
                     async_checkpointer_type=kind)
    writer.wait_snapshot(timeout=120)
    fut.result()


def _fsdp_load(rank, world, path):
    from tests.workers import app_state, make_fsdp
    model, opt = make_fsdp(world, seed=3)
    sd = app_state(model, opt)
    sd["extra"]["scaled"] = None
    sd["pair"] = None
    dcp.load(sd, storage_reader=DataStatesReader(path))
    s = sd["extra"]["scaled"]
    assert type(s) is pt.Scaled and s.scale == 0.5 and torch.equal(s.data, torch.arange(6.0))
    p = sd["pair"]
    assert type(p) is pt.Pair and p.label == "p" and p.inner.scale == 2.0
    assert torch.equal(p.extra, torch.arange(4.0)) and torch.equal(p.inner.data, torch.arange(3.0))


@pytest.mark.parametrize("mode,load_worlds", [("sync", (1, 3)), ("thread", (1, 3)), ("process", (1, 3))])
def test_registered_types_in_fsdp_state_reshard(tmp_path, mode, load_worlds):
    path = str(tmp_path / "c")
    run_ranks(2, _fsdp_save, path, mode)
    for w in load_worlds:
        run_ranks(w, _fsdp_load, path)
