"""torchtitan 0.3.0 with dcp-datastates as its checkpoint backend, on CPU/gloo, 2 ranks.

For each async mode: train the llama3 debug model 6 steps with a checkpoint every 2 steps,
delete the newest step, resume, and require the resumed steps' losses to equal the
uninterrupted run's.  Runs in the environment `make test` builds for it (.venv-titan);
elsewhere it is skipped.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan", reason="torchtitan runs in .venv-titan (make test runs it there)")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEP_RE = re.compile(r"step:\s+(\d+)\s+\S*loss:\s+([0-9.]+)")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("titan")
    shutil.copytree(os.path.join(HERE, "torchtitan", "assets", "tokenizer"), d / "tests/assets/tokenizer")
    os.makedirs(d / "tests/assets/c4_test")
    r = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while shards and tensors flush".split()
    with open(d / "tests/assets/c4_test/data.json", "w") as f:  # synthetic stand-in for c4_test
        for i in range(2000):
            f.write(json.dumps({"text": " ".join(r.choice(words) for _ in range(200)),
                                "timestamp": "2020-01-01", "url": f"u{i}"}) + "\n")
    return str(d)


OVERRIDE = "dcp_datastates.integrations.torchtitan.use_datastates"
# the writer's options through torchtitan's override kwargs, as docs/torchtitan.md shows
WITH_OPTIONS = OVERRIDE + '={"host_cache_bytes": 33554432, "thread_count": 2, "device_cache_bytes": 16777216}'


def _train(workdir, mode, dump, port, ours=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           os.path.join(HERE, "torchtitan", "cpu_train.py"),
           "--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "256",
           "--training.local_batch_size", "2", "--parallelism.spmd_backend", "partial_dtensor",
           "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "6",
           "--checkpoint.async_mode", mode, "--dump_folder", dump]
    if ours:
        cmd += ["--override.imports", WITH_OPTIONS if mode == "async" else OVERRIDE]
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    out = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)
    assert r.returncode == 0, out[-4000:]
    losses = {}
    for m in STEP_RE.finditer(out):
        losses[int(m.group(1))] = m.group(2)
    return losses, out


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_resume_matches_uninterrupted(workdir, mode):
    from tests.dist import free_port
    dump = os.path.join(workdir, "runs", mode)
    first, log1 = _train(workdir, mode, dump, free_port())
    assert "DataStatesCheckpointManager.Config" in log1
    if mode == "async":
        assert "host cache 32 MiB, device cache 16 MiB, 2 flush threads per rank" in log1, log1[-3000:]
    ckpt = os.path.join(dump, "checkpoint")
    assert sorted(os.listdir(ckpt)) == ["step-2", "step-4", "step-6"]
    for step in ("step-2", "step-4", "step-6"):
        with open(os.path.join(ckpt, step, ".metadata"), "rb") as f:
            assert f.read(16) == b"\xffDCP-DATASTATES\n"  # written by dcp-datastates, committed
    shutil.rmtree(os.path.join(ckpt, "step-6"))
    resumed, log2 = _train(workdir, mode, dump, free_port())
    assert "Loading the checkpoint" in log2 and "step-4" in log2
    assert resumed.get(5) and resumed.get(6)
    assert (resumed[5], resumed[6]) == (first[5], first[6]), (first, resumed)


def test_a_run_switched_to_datastates_resumes_from_dcp_steps(workdir):
    """A run checkpointed by torchtitan's own DCP backend (steps 2, 4, 6; step 6 then lost)
    switches to dcp-datastates and resumes from step 4 (DCP's format, read with DCP's reader),
    saving step 6 with ours; its losses equal the uninterrupted run's."""
    from tests.dist import free_port
    dump = os.path.join(workdir, "runs", "switched")
    first, _ = _train(workdir, "disabled", dump, free_port(), ours=False)
    ckpt = os.path.join(dump, "checkpoint")
    with open(os.path.join(ckpt, "step-4", ".metadata"), "rb") as f:
        assert f.read(16) != b"\xffDCP-DATASTATES\n"  # DCP's own format
    shutil.rmtree(os.path.join(ckpt, "step-6"))
    resumed, log1 = _train(workdir, "disabled", dump, free_port())
    assert "in DCP's own format" in log1 and "step-4" in log1, log1[-3000:]
    with open(os.path.join(ckpt, "step-6", ".metadata"), "rb") as f:
        assert f.read(16) == b"\xffDCP-DATASTATES\n"
    assert (resumed[5], resumed[6]) == (first[5], first[6]), (first, resumed)
