"""Crash consistency: SIGKILL a saving process in every phase; nothing committed is lost.

Each trial starts from a run whose step 1 is committed on both tiers, launches a process
saving step 2 (sync or async, 1 or 2 ranks), kills it at a fault point (plan, copy, write,
manifest, persist) or at a random time, then checks that

* step 1 still loads bit-exactly;
* step 2 is reported committed (by the Checkpointer and by torchtitan-style discovery of
  ``step-N/.metadata``) only where its manifest really committed, and then loads bit-exactly;
* saving step 2 again succeeds and leaves no leftovers of the interrupted attempt.

The default run covers every phase once per mode on 1 rank plus 2-rank trials (14 trials);
``-m slow`` adds the rest of the matrix and random kills (34 more).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.crash_child import state_for, tiers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ["plan", "copy", "write", "manifest", "persist"]


def _child(base, mode, world, step, env_extra=None):
    env = dict(os.environ, PYTHONPATH=ROOT, **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", "tests.crash_child", base, mode, str(world), str(step)],
                            env=env, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _run_ok(base, mode, world, step):
    p = _child(base, mode, world, step)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()[-3000:]


@pytest.fixture(scope="module")
def committed_step1(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("crash-template"))
    _run_ok(base, "sync", 1, 1)
    return base


def _load(c, step):
    from dcp_datastates import DataStatesReader
    import torch.distributed.checkpoint as dcp
    ref = state_for(step)
    out = {"w": torch.zeros_like(ref["w"]), "b": torch.zeros_like(ref["b"]),
           "small": {k: torch.zeros_like(v) for k, v in ref["small"].items()}, "meta": {"step": -1}}
    assert c.load(out, step=step) == step
    assert torch.equal(out["w"], ref["w"]) and torch.equal(out["b"], ref["b"])
    assert all(torch.equal(out["small"][k], ref["small"][k]) for k in ref["small"])
    assert out["meta"] == {"step": step}
    # each tier's copy alone
    for i in range(2):
        if c.is_committed(i, step):
            alone = {"w": torch.zeros_like(ref["w"])}
            dcp.load(alone, storage_reader=DataStatesReader(c.step_path(i, step)), no_dist=True)
            assert torch.equal(alone["w"], ref["w"])


def _no_leftovers(c, step):
    from dcp_datastates.tiers.manifests import load_manifest
    from dcp_datastates.tiers import StorageTier
    for i in range(2):
        t = StorageTier(c.step_path(i, step))
        keep = set(load_manifest(t).files) | {".metadata", ".persisted", ".base-lock"}  # the lock: no leftover
        extra = [n for n in t.listdir() if n not in keep]
        assert not extra, (c.step_path(i, step), extra)


def trial(template, tmp_path, mode, world, phase, delay=None):
    from dcp_datastates import Checkpointer
    base = str(tmp_path / "run")
    shutil.copytree(template, base)
    ready, started = str(tmp_path / "ready"), str(tmp_path / "started")
    env = {"CRASH_STARTED": started}
    if phase:
        env.update(DCP_DATASTATES_FAULT=phase, DCP_DATASTATES_FAULT_READY=ready)
    p = _child(base, mode, world, 2, env)
    deadline = time.monotonic() + 180
    signal_file = ready if phase else started
    while not os.path.exists(signal_file):
        if p.poll() is not None:
            raise AssertionError(f"child ended before the fault ({p.returncode}): {p.stderr.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert os.path.exists(signal_file), "fault point never reached"
    if delay:
        time.sleep(delay)
    finished = p.poll() is not None
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # the save ended before the kill: its whole group is gone
        pass
    p.wait()

    c = Checkpointer(tiers(base), async_mode=None)
    t1, t2 = c.is_committed(0, 2), c.is_committed(1, 2)
    if phase in ("plan", "copy", "write", "manifest"):
        assert not t1 and not t2, (phase, t1, t2)
    if phase == "persist":
        assert not t2
    # torchtitan-style discovery agrees with the checkpointer
    for i, committed in ((0, t1), (1, t2)):
        assert os.path.isfile(os.path.join(c.step_path(i, 2), ".metadata")) == committed
    assert c.latest_step() == (2 if (t1 or t2) else 1)
    _load(c, 1)
    if t1 or t2:
        _load(c, 2)
    # saving the same step again succeeds, and cleans up after the interrupted attempt
    _run_ok(base, mode, world, 2)
    c = Checkpointer(tiers(base), async_mode=None)
    assert c.is_committed(0, 2) and c.is_committed(1, 2)
    _load(c, 2)
    _load(c, 1)
    _no_leftovers(c, 2)
    return {"phase": phase or f"random {delay:.3f}s", "finished_before_kill": finished,
            "t1_committed": t1, "t2_committed": t2}


FAST = [(m, 1, ph) for m in ("sync", "async") for ph in PHASES] + \
       [("sync", 2, "write"), ("async", 2, "copy"), ("sync", 2, "manifest"), ("async", 2, "persist")]
SLOW = [(m, 2, ph) for m in ("sync", "async") for ph in PHASES if (m, 2, ph) not in FAST]
RANDOM = [(m, w, seed) for m in ("sync", "async") for w in (1, 2) for seed in range(7)]


@pytest.mark.parametrize("mode,world,phase", FAST)
def test_kill_at_phase(committed_step1, tmp_path, mode, world, phase):
    trial(committed_step1, tmp_path, mode, world, phase)


@pytest.mark.slow
@pytest.mark.parametrize("mode,world,phase", SLOW)
def test_kill_at_phase_long(committed_step1, tmp_path, mode, world, phase):
    trial(committed_step1, tmp_path, mode, world, phase)


@pytest.mark.slow
@pytest.mark.parametrize("mode,world,seed", RANDOM)
def test_kill_at_random_time(committed_step1, tmp_path, mode, world, seed):
    delay = random.Random(seed * 31 + world).uniform(0.0, 0.6)
    trial(committed_step1, tmp_path, mode, world, None, delay)
