"""A failed save releases every rank at once (issue 35, case 5).

Whatever fails an async save, on this rank or another, in DCP's planning or in ours, the
optimizer step barrier of every rank lets go as soon as DCP fails the save there, and the next
save through the same writer starts cleanly.  Plain ``dcp.async_save``, real gloo ranks."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from tests.dist import run_ranks
from tests.test_claims import hold_claim


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(1024, 2048)  # 8 MiB of weights: copied lazily, not at the call


def _fails_then_steps(rank, world, busy_path, free_path, out):
    import torch.distributed as dist
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = DataStatesWriter(busy_path, overwrite=True)  # step_barrier_s: the default 600 s
    fut = dcp.async_save({"model": model.state_dict()}, storage_writer=writer)
    try:
        fut.result(timeout=120)
        raise AssertionError("the save into a claimed directory succeeded")
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        assert "another save is writing" in repr(e) or "CheckpointBusyError" in repr(e), repr(e)
    model(torch.randn(4, 1024)).sum().backward()
    t = time.monotonic()
    opt.step()  # waited out the whole barrier before
    took = time.monotonic() - t
    assert took < 30, f"rank {rank}: optimizer.step() waited {took:.1f} s after the save failed"
    # the next save through the same writer starts cleanly
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fut = dcp.async_save({"model": model.state_dict()}, storage_writer=writer, checkpoint_id=free_path)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    fut.result(timeout=120)
    dist.barrier()
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load({"model": back}, storage_reader=DataStatesReader(free_path))
    assert all(torch.equal(back[k], want[k]) for k in want)
    open(os.path.join(out, f"rank{rank}"), "w").write(f"{took:.3f}")


def test_a_save_failed_by_the_coordinator_releases_every_rank(tmp_path):
    """The coordinator's ``prepare_global_plan`` fails (the directory is claimed by a live
    save): DCP fails both ranks' futures at once, but rank 1's session was never marked
    failed, since none of its own writer calls raised; its next ``opt.step()`` waited out
    ``step_barrier_s``."""
    busy, free, out = str(tmp_path / "busy"), str(tmp_path / "free"), str(tmp_path / "out")
    os.makedirs(busy)
    os.makedirs(out)
    holder = hold_claim(busy, "0123456789ab", str(tmp_path / "ready"))
    try:
        run_ranks(2, _fails_then_steps, busy, free, out, timeout=400)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(os.listdir(out)) == ["rank0", "rank1"]
