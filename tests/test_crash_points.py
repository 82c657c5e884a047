"""Every crash point and every fault point of the save scenarios (issue 35): see
``tests/crashsim.py``.  The scenarios run on a small state here, in about a minute on two
cores; ``make test-long`` runs them on a larger one, and the scenario whose slower tier is an
object store (a real S3 server, moto)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.crashsim import LONG_SCENARIOS, REMOTE_SCENARIOS, SCENARIOS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("size", [pytest.param("small"), pytest.param("large", marks=pytest.mark.slow),
                                  pytest.param("s3", marks=pytest.mark.slow)])
def test_no_crash_or_fault_point_loses_a_committed_byte(tmp_path, size):
    if size == "s3":
        pytest.importorskip("s3fs")
        pytest.importorskip("moto")
    out = str(tmp_path / "report.json")
    which = ["--size", "small", *REMOTE_SCENARIOS] if size == "s3" else ["--size", size]
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.crashsim", *which, "--jobs", "2",
                        "--dir", str(tmp_path / "work"), "--json", out],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                       timeout=1800)
    report = json.load(open(out)) if os.path.exists(out) else []
    want = (list(REMOTE_SCENARIOS) if size == "s3"
            else list(SCENARIOS) + (list(LONG_SCENARIOS) if size == "large" else []))
    assert [s["scenario"] for s in report] == want, r.stdout[-3000:] + r.stderr[-3000:]
    for s in report:  # every storage operation of every scenario was a crash point and a fault point
        assert s["crash_points"] >= s["operations"] and s["fault_points"] >= s["operations"], s
    bad = [f"{s['scenario']}: {v}" for s in report for v in s["violations"]]
    assert not bad, "\n".join(bad[:40])
    assert r.returncode == 0, r.stdout[-3000:]
