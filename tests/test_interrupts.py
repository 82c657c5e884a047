"""Ctrl-C during an async save (issue 69): SIGINT to the job's process group, as a terminal
sends it, while ``dcp.async_save`` streams step 2 (THREAD and PROCESS mode).  Whatever the
interrupted save left, nothing committed is damaged: step 1 loads bit-exact; step 2 is either
committed whole (it loads bit-exact) or uncommitted, in which case ``inspect`` lists it and
``clean --yes`` removes it and nothing else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader
from tests import clirun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_JOB = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from dcp_datastates import DataStatesWriter
    run, mode, port = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(48)}  # 192 MiB
    dcp.save(state(1), storage_writer=DataStatesWriter(os.path.join(run, "step-1")))
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    extra = {"async_mode": "process"} if mode == "process" else {}  # shared memory at the call
    w = DataStatesWriter(os.path.join(run, "step-2"), host_cache_bytes=2 << 20, **extra)  # streams slowly
    fut = dcp.async_save(state(2), storage_writer=w, async_checkpointer_type=kind)
    print("saving", flush=True)
    fut.result()
    print("saved", flush=True)
""")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(48)}


def _loads(path: str, seed: int) -> bool:
    want = _state(seed)
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    return all(torch.equal(out[k], want[k]) for k in want)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_ctrl_c_during_an_async_save_leaves_nothing_damaged_and_nothing_hidden(tmp_path, mode):
    from tests.dist import free_port
    run = str(tmp_path / "run")
    job = subprocess.Popen([sys.executable, "-c", _JOB, run, mode, str(free_port())], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "saving"
        step2 = os.path.join(run, "step-2")
        deadline = time.monotonic() + 60  # some of step 2 is on disk: the save is under way
        while not (os.path.isdir(step2) and any(n.startswith("data-") for n in os.listdir(step2))):
            assert time.monotonic() < deadline and job.poll() is None, job.poll()
            time.sleep(0.01)
        os.killpg(job.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        job.wait(120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert _loads(os.path.join(run, "step-1"), 1)
    info = json.loads(clirun.cli("inspect", run, "--json").stdout)
    committed = [r["dir"] for r in info["steps"]]
    if "step-2" in committed:  # finished as the process ended: whole
        assert _loads(step2, 2)
        return
    assert [u["dir"] for u in info["uncommitted"]] == ["step-2"], info
    clirun.cli("clean", run, "--yes")
    assert not os.path.exists(step2)
    assert _loads(os.path.join(run, "step-1"), 1)
