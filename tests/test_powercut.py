"""The states a power cut may leave at every point of the save scenarios, each restarted from:
see ``tests/powercut.py``.  A first test checks the model on calls made by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.crashsim import LONG_SCENARIOS
from tests.powercut import SCENARIOS, Disk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_the_model_keeps_only_what_was_made_durable(tmp_path, monkeypatch):
    """A file written and fsynced but whose directory was not, a rename not yet durable, and a
    removal not yet durable: each may or may not survive, and unsynced bytes never do."""
    root = str(tmp_path)
    os.mkdir(f"{root}/d")
    with open(f"{root}/d/old", "wb") as f:
        f.write(b"old")
    disk = Disk(root)
    with monkeypatch.context() as mp:
        disk.install(mp)
        fd = os.open(f"{root}/d/new.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"new")
        os.fsync(fd)
        os.close(fd)
        os.replace(f"{root}/d/new.tmp", f"{root}/d/new")
        os.unlink(f"{root}/d/old")
        fd = os.open(f"{root}/d/unsynced", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"lost")
        os.close(fd)
        states, blobs = disk.states()
    assert not disk.lost
    trees = {tuple((p, blobs[h] if h else None) for p, h in t) for _, t in states}
    assert (("d", None), ("d/old", b"old")) in trees  # nothing of the act durable
    assert (("d", None), ("d/new", b"new"), ("d/unsynced", b"")) in trees  # every name, no unsynced byte
    assert (("d", None), ("d/new", b"new"), ("d/old", b"old")) in trees  # the rename alone kept
    assert (("d", None),) in trees  # the removal alone kept
    assert all(b"lost" not in (v or b"") for t in trees for _, v in t)
    _fsync(f"{root}/d")  # unwrapped now: the model saw none of this
    assert [p.label.split()[0] for p in disk.points] == ["fsync", "replace", "unlink", "end"]


@pytest.mark.parametrize("size", [pytest.param("small"), pytest.param("large", marks=pytest.mark.slow)])
def test_no_power_cut_loses_a_committed_byte(tmp_path, size):
    out = str(tmp_path / "report.json")
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.powercut", "--jobs", "2", "--size", size,
                        "--dir", str(tmp_path / "work"), "--json", out],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                       timeout=1800)
    report = json.load(open(out)) if os.path.exists(out) else []
    want = SCENARIOS + (list(LONG_SCENARIOS) if size == "large" else [])
    assert [s["scenario"] for s in report] == want, r.stdout[-3000:] + r.stderr[-3000:]
    for s in report:  # the act ran under the model, and left more than one state to restart from
        assert s["points"] > 3 and s["states"] > s["points"], s
    bad = [f"{s['scenario']}: {v.splitlines()[0][:400]}" for s in report for v in s["violations"]]
    assert not bad, "\n".join(bad[:40])
    assert r.returncode == 0, r.stdout[-3000:]
