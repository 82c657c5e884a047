"""DCP's checkpoint process killed by SIGKILL in the middle of a save (issue 35, case 8).

Before: the killed process stayed a zombie, its claim counted as live, and every later save into
that directory failed with ``CheckpointBusyError``, across restarts too; later PROCESS-mode saves
in that trainer failed with a raw ``BrokenPipeError``.  Now the kernel drops the dead process's
claim lock, the previous step loads exactly, the next save into the directory commits, and a
later PROCESS-mode save fails with an error that says what happened."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import CheckpointError, DataStatesReader, DataStatesWriter, async_save
from tests.dist import run_ranks


def _state(seed: int, mib: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib << 18, generator=g), "seed": seed}


def _checkpoint_processes() -> list[int]:
    """DCP's checkpoint process: this process's live multiprocessing children started by spawn
    (it registers them itself; scanning ``/proc/*/task/*/children`` misses a child while the
    thread that started it is exiting)."""
    out = []
    for p in multiprocessing.active_children():
        try:
            cmd = open(f"/proc/{p.pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.append(p.pid)
    return out


def _kill_mid_save(rank, world, path, out):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    process = AsyncCheckpointerType.PROCESS
    async_save(_state(1), storage_writer=DataStatesWriter(path), async_checkpointer_type=process).result(timeout=300)
    daemons = _checkpoint_processes()
    assert daemons, "DCP's checkpoint process was not found"
    fut = async_save(_state(2, 256), storage_writer=DataStatesWriter(path, overwrite=True, host_cache_bytes=1 << 20),
                     async_checkpointer_type=process)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(path, ".claim")):  # the save is under way in the daemon
        assert time.monotonic() < deadline and not fut.done(), "the second save never claimed the directory"
        time.sleep(0.005)
    for pid in daemons:
        os.kill(pid, signal.SIGKILL)
    try:
        fut.result(timeout=120)
        raise AssertionError("the save of a killed checkpoint process succeeded")
    except BaseException as e:  # noqa: BLE001 - DCP's error for its dead process
        assert not isinstance(e, AssertionError), e
    back = {"w": torch.zeros(4 << 18), "seed": -1}
    dcp.load(back, storage_reader=DataStatesReader(path))
    assert back["seed"] == 1 and torch.equal(back["w"], _state(1)["w"])  # the previous step, exactly
    # the directory is free: the dead process held its claim under a lock the kernel dropped
    dcp.save(_state(3), storage_writer=DataStatesWriter(path, overwrite=True))
    back = {"w": torch.zeros(4 << 18), "seed": -1}
    dcp.load(back, storage_reader=DataStatesReader(path))
    assert back["seed"] == 3 and torch.equal(back["w"], _state(3)["w"])
    # a later PROCESS-mode save says what happened, not a raw BrokenPipeError
    later = async_save(_state(4), storage_writer=DataStatesWriter(path + "-later"), async_checkpointer_type=process)
    try:
        later.result(timeout=120)
        raise AssertionError("a PROCESS-mode save without a checkpoint process succeeded")
    except CheckpointError as e:
        assert "checkpoint process has died" in str(e), e
    open(out, "w").write("ok")


def test_a_checkpoint_process_killed_mid_save_frees_its_directory(tmp_path):
    out = str(tmp_path / "ok")
    run_ranks(1, _kill_mid_save, str(tmp_path / "ck"), out, timeout=400)
    assert open(out).read() == "ok"


# ------------------------------------------ PROCESS mode: one save at a time in DCP's process

PAIRS = 4


def _back_to_back(rank, world, base):
    """Two PROCESS-mode saves started back to back, four times: each commits and loads."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    futures = []
    for i in range(PAIRS):
        for j in range(2):
            futures.append(async_save(_state(10 * i + j, mib=1), storage_writer=DataStatesWriter(
                os.path.join(base, f"{i}-{j}")), async_checkpointer_type=AsyncCheckpointerType.PROCESS))
            assert all(f.done() for f in futures[:-1])  # the previous save ended before this one began
    for f in futures:
        f.result(timeout=120)
    for i in range(PAIRS):
        for j in range(2):
            got = {"w": torch.zeros(1 << 18), "seed": -1}
            dcp.load(got, storage_reader=DataStatesReader(os.path.join(base, f"{i}-{j}")))
            want = _state(10 * i + j, mib=1)
            assert got["seed"] == want["seed"] and torch.equal(got["w"], want["w"]), (i, j)


def test_process_mode_saves_started_back_to_back_each_commit(tmp_path):
    """DCP makes an executor per ``async_save`` call, and in PROCESS mode every executor talks to
    its one checkpoint process over one pipe without a lock: two saves in flight garble it
    (UnpicklingError, "background process is dead", saves that hang), with DCP's own
    ``FileSystemWriter`` too.  ``dcp_datastates.async_save`` starts a PROCESS-mode save only
    once the previous one has ended."""
    run_ranks(2, _back_to_back, str(tmp_path), timeout=400)
