"""An incremental save and a change to its base from another process, at every point of the
save: no committed checkpoint loses a byte it references (issue 35's rule, for bases).

The save of step-2 on step-1 runs in this process; another process (``tests/interferer.py``)
saves step-1 again, tidying what the replaced save owned, or purges step-1 by retention.  Both
count their calls into the storage interface, which is wrapped (as DCP's tests wrap a writer),
and every pair of points is tried: at the save's call i the change starts, runs up to its own
call j and waits there until the save has ended.  Whatever the pair, step-2 either commits a
checkpoint that loads bit-exact, now and after step-1 changes once more, or fails with a clear
error and commits nothing; and step-1 holds the re-saved state.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.interferer import Interferer as _Interferer
from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.errors import CheckpointError
from dcp_datastates.tiers.local import LocalBackend
from tests.interferer import NO_LOCKS_ENV, SEAM, keep_no_locks, state_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)




class _Seam:
    """Counts the save's calls into the storage interface; at call ``at`` runs ``act`` first."""

    def __init__(self, monkeypatch) -> None:
        self.calls, self.at, self.act, self.on = 0, -1, None, False
        self._lock = threading.Lock()
        for name in SEAM:
            monkeypatch.setattr(LocalBackend, name, self._wrap(getattr(LocalBackend, name)))

    def _wrap(self, orig):
        @functools.wraps(orig)
        def call(backend, *a, **kw):
            if self.on:
                with self._lock:
                    n, self.calls = self.calls, self.calls + 1
                if n == self.at and self.act is not None:
                    self.act()
            return orig(backend, *a, **kw)
        return call


def _load(path: str, like: dict) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    return out


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def _act(run, how: str) -> str:
    return f"resave {run / 'step-1'} 2" if how == "resave" else f"purge {run} step-1"


def _trial(run, seam: _Seam, interfere: _Interferer, how: str, at: int, then: int = -1) -> str:
    """One save of step-2 on step-1 with step-1 changed at the save's call ``at``: wholly, or
    (``then`` >= 0) up to the change's own call ``then``, going on once the save has ended."""
    step1, step2 = str(run / "step-1"), str(run / "step-2")
    base = state_for(1)
    dcp.save(base, storage_writer=DataStatesWriter(step1), no_dist=True)
    want = dict(base, t5=base["t5"] + 1)  # one tensor changed: the others are referenced in step-1
    fired: list[str] = []
    seam.calls, seam.at, seam.act, seam.on = 0, at, lambda: fired.append(interfere.send(f"{_act(run, how)} {then}")), True
    try:
        dcp.save(want, storage_writer=DataStatesWriter(step2, incremental_base="step-1"), no_dist=True)
        outcome = "committed"
    except Exception as e:  # noqa: BLE001 - the outcome under test
        failures = getattr(e, "failures", None)
        inner = next(iter(failures.values())) if failures else e
        assert isinstance(getattr(inner, "exc", inner), CheckpointError), f"call {at}: {e!r}"
        outcome = "failed"
    finally:
        seam.on = False
        if fired == ["paused"]:
            fired.append(interfere.send("go"))
    if fired and how == "resave":
        assert _same(_load(step1, base), state_for(2)), f"call {at}: step-1 is not the re-save"
    if outcome == "failed":
        assert not os.path.exists(os.path.join(step2, ".metadata")), f"call {at}: a failed save committed"
        return outcome
    assert _same(_load(step2, want), want), f"call {at}/{then}: step-2 does not load as saved"
    interfere(f"resave {step1} 3")  # the base changes once more: step-2's manifest keeps what it uses
    assert _same(_load(step2, want), want), f"call {at}/{then}: step-2 lost bytes to a later re-save of step-1"
    return outcome


@pytest.mark.parametrize("locks", [True, False], ids=["locks", "no-locks"])
@pytest.mark.parametrize("how", [pytest.param("resave", marks=pytest.mark.slow), "purge"])
def test_every_pair_of_storage_calls_of_an_incremental_save_and_a_change_to_its_base(tmp_path, monkeypatch, how,
                                                                                       locks):
    """For every call i of the save and every call j of the change to step-1 (and j past its
    last: the whole change), the change starts at the save's call i and stops at its own
    call j until the save ends.  i = 0 runs the whole save inside the change.  ``no-locks``:
    on a filesystem that keeps no locks, as an object store (claims are leases; no base lock
    holds the base, only the claim's record of it)."""
    if not locks:
        keep_no_locks(monkeypatch.setattr)
    seam = _Seam(monkeypatch)
    interfere = _Interferer(locks)
    try:
        _trial(tmp_path / "count", seam, interfere, how, -1)
        saves = seam.calls
        assert saves > 10, f"the save made only {saves} storage calls"
        dcp.save(state_for(1), storage_writer=DataStatesWriter(str(tmp_path / "n" / "step-1")), no_dist=True)
        changes = interfere(_act(tmp_path / "n", how))
        assert changes > 5, f"the {how} made only {changes} storage calls"
        outcomes = {(i, j): _trial(tmp_path / f"at-{i}-{j}", seam, interfere, how, i, j)
                    for i in range(saves) for j in range(changes + 1)}
    finally:
        interfere.close()
    assert list(outcomes.values()).count("committed") >= len(outcomes) // 2, outcomes


def test_a_purge_that_read_the_claims_before_a_save_claimed_its_base_leaves_the_base(tmp_path, monkeypatch):
    """Where no lock holds a base (an object store): a retention pass read the run's claims
    (none yet) and is about to uncommit step-1 when an incremental save of step-2 on step-1
    claims its directory, naming step-1, and finds step-1 still committed; the pass goes on
    while step-2 writes.  It reads the claims again once its mark is in place, finds step-1
    named, and leaves it: step-2 commits and loads exactly.  (Reading them only before the
    mark, it swept step-1's files from under step-2.)"""
    from dcp_datastates.format.names import PURGED_MARK
    from dcp_datastates.tiers import StorageTier
    from dcp_datastates.tiers.retention import purge_steps
    keep_no_locks(monkeypatch.setattr)
    run = tmp_path / "run"
    base = state_for(1)
    dcp.save(base, storage_writer=DataStatesWriter(str(run / "step-1")), no_dist=True)
    want = dict(base, t5=base["t5"] + 1)
    marking, go, purged = threading.Event(), threading.Event(), []
    commit, open_sink = LocalBackend.commit, LocalBackend.open_sink

    def commit_later(self, root, path, tmp_name, data, *, sync):  # the pass's mark waits for step-2's writes
        if path.endswith(PURGED_MARK) and not go.is_set():
            marking.set()
            assert go.wait(60)
        return commit(self, root, path, tmp_name, data, sync=sync)

    def open_sink_after_purge(self, path, name, **kw):  # step-2's first data file: the pass runs to its end
        if "step-2" in path and os.path.basename(path).startswith("data-") and not go.is_set():
            go.set()
            purge.join(60)
        return open_sink(self, path, name, **kw)
    monkeypatch.setattr(LocalBackend, "commit", commit_later)
    monkeypatch.setattr(LocalBackend, "open_sink", open_sink_after_purge)
    purge = threading.Thread(target=lambda: purged.append(purge_steps(StorageTier(str(run)), ["step-1"])))
    purge.start()
    assert marking.wait(60)
    dcp.save(want, storage_writer=DataStatesWriter(str(run / "step-2"), incremental_base="step-1"), no_dist=True)
    assert go.is_set() and not purge.is_alive() and purged == [[]], purged
    assert _same(_load(str(run / "step-2"), want), want)
    assert _same(_load(str(run / "step-1"), base), base)  # the pass left step-1 committed
