"""A failed save releases every rank at once (issue 35, case 5).

Whatever fails an async save, on this rank or another, in DCP's planning or in ours, the
optimizer step barrier of every rank lets go as soon as DCP fails the save there, and the next
save through the same writer starts cleanly.  Plain ``dcp.async_save``, real gloo ranks."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from tests.dist import run_ranks
from tests.claim_child import hold_claim


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


# ------------------------------------------------ a Checkpointer goes on after a failed save
def _checkpointer_fails_once(rank, world, base, amode):
    """Step 2's save fails on rank 1 (its data file cannot be created: EIO, in the process
    that writes: this one, or DCP's checkpoint process).  The failure is raised once (by the
    save when it is sync, else by the next call that waits); the saves after it commit, and
    the failed step's directory goes with retention like any other."""
    import json

    import torch.distributed as dist

    from dcp_datastates import Checkpointer
    from tests import crashsim
    from tests.workers import crash_same as _same
    from tests.workers import crash_state as _state
    from tests.workers import crash_template as _template
    run, plan = os.path.join(base, "run"), os.path.join(base, "plan.json")
    if rank == 1:
        if amode == "process":  # DCP starts its checkpoint process at the first save
            crashsim.wrap_spawned(plan)
        else:
            crashsim.install()
    ckpt = Checkpointer([run], keep=1, async_mode=amode)
    ckpt.save(1, _state(rank, 1))
    assert ckpt.wait_persisted(60)
    dist.barrier()
    if rank == 1 and amode == "process":
        crashsim.arm(plan, "fault", 1, os.path.join(base, "ops"), match="create data-")
    elif rank == 1:
        crashsim.PLAN.match, crashsim.PLAN.mode, crashsim.PLAN.k = "create data-", "fault", 1
        crashsim.PLAN.log.clear()
    raised = None
    try:
        ckpt.save(2, _state(rank, 2))  # a sync save raises here
        ckpt.wait()
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raised = repr(e)
    assert raised is not None and "injected" in raised, f"rank {rank}: step 2's failure was not raised: {raised}"
    got = {}
    for step in (3, 4):
        ckpt.save(step, _state(rank, step))
        got[step] = ckpt.wait_persisted(60)
    dist.barrier()
    ckpt.wait_persisted(60)  # a pass once step 4 is durable on every rank
    dirs = sorted(os.listdir(run))
    sd = _template(rank)
    loaded = ckpt.load(sd)
    ckpt.close()
    with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
        json.dump({"persisted": got, "dirs": dirs, "loaded": loaded, "exact": _same(rank, sd, 4)}, f)
    crashsim.end_children()
    os._exit(0)


@pytest.mark.parametrize("amode", [None, "thread", "process"])
def test_a_checkpointer_saves_again_after_a_save_failed(tmp_path, amode):
    import json
    run_ranks(2, _checkpointer_fails_once, str(tmp_path), amode, timeout=240)
    for rank in (0, 1):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        assert got["persisted"] == {"3": True, "4": True}, got
        assert got["loaded"] == 4 and got["exact"], got
        assert got["dirs"] == ["step-4"], got  # the failed step's directory went with step 3


def _plain_process_save_fails_once(rank, world, base):
    """Plain ``dcp.async_save`` in PROCESS mode: step 2 fails on rank 1 (in its checkpoint
    process), step 3 saves, then the trainer saves step 2 again itself."""
    import json

    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from tests import crashsim
    from tests.workers import crash_same as _same
    from tests.workers import crash_state as _state
    from tests.workers import crash_template as _template
    plan = os.path.join(base, "plan.json")
    if rank == 1:
        crashsim.wrap_spawned(plan)
        crashsim.arm(plan, "fault", 1, os.path.join(base, "ops"), match="create data-")

    def path(step):
        return os.path.join(base, f"step-{step}")

    def process_save(step):
        return dcp.async_save(_state(rank, step), storage_writer=DataStatesWriter(path(step)),
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    try:
        process_save(2).result(timeout=120)
        raise AssertionError("step 2 did not fail")
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        assert "injected" in repr(e), repr(e)
    process_save(3).result(timeout=120)
    dcp.save(_state(rank, 2), storage_writer=DataStatesWriter(path(2), overwrite=True))  # from the trainer
    sd = _template(rank)
    dcp.load(sd, storage_reader=DataStatesReader(path(2)))
    with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
        json.dump({"exact": _same(rank, sd, 2), "files": sorted(os.listdir(path(2)))}, f)
    crashsim.end_children()
    os._exit(0)


def test_a_plain_process_mode_save_that_failed_leaves_its_directory_free(tmp_path):
    """The failed save's coordinator (rank 0's checkpoint process) lets its claim go at its
    next save, so the trainer can save into that directory, which then holds only the new
    save's files."""
    import json
    run_ranks(2, _plain_process_save_fails_once, str(tmp_path), timeout=240)
    for rank in (0, 1):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        assert got["exact"], got
        data = [n for n in got["files"] if n.startswith("data-")]
        assert len({n.split("-")[2] for n in data}) == 1, got  # one save's files: the new one
