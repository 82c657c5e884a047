"""The states a power cut may leave at every point of the save scenarios, each restarted from:
see ``tests/powercut.py``; and of saves written by several processes (two ranks, DCP's
checkpoint process), each loaded: ``tests/powercut_ranks.py``.  A first test checks the model
on calls made by hand."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.format.names import is_manifest_name
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import load_manifest
from dcp_datastates.replicas.records import records_in
from dcp_datastates.verify import verify_checkpoint
from tests.crashsim import LONG_SCENARIOS
from tests.dist import run_ranks
from tests.powercut import SCENARIOS, Disk, Model, materialize
from tests.powercut_ranks import Journal, journal_spawned, replay

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


# ----------------------------------------------------------------------- several processes
def _ranked(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(1 << 14, generator=g)
    return {"w0": w, "w1": w + 1, "step": step}


def _own(rank: int, step: int) -> dict:
    full = _ranked(step)
    return {f"w{rank}": full[f"w{rank}"], "step": step}


def _loaded(path: str) -> dict | str:
    got = {"w0": torch.zeros(1 << 14), "w1": torch.zeros(1 << 14), "step": 0}
    try:
        dcp.load(got, storage_reader=DataStatesReader(path), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - reported as a violation
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return got


def _is(got: dict, step: int) -> bool:
    want = _ranked(step)
    return got["step"] == step and all(torch.equal(got[k], want[k]) for k in ("w0", "w1"))


def _committed(path: str) -> bool:
    return os.path.isdir(path) and any(is_manifest_name(n) for n in os.listdir(path))


def _check_dir(path: str, steps: set[int], floor: int) -> list[str]:
    """A checkpoint directory saved over in place with ``steps``: it loads as one of them, and
    as one at least ``floor`` once that was reported."""
    if not _committed(path):
        return [f"{path}: no committed checkpoint, with step {floor} reported"] if floor else []
    got = _loaded(path)
    if isinstance(got, str):
        return [f"{path}: committed but does not load: {got}"]
    match = [s for s in steps if _is(got, s)]
    if not match:
        return [f"{path}: loads a state never saved there (step field {got['step']})"]
    return [f"{path}: loads step {match[0]}, with step {floor} reported"] if match[0] < floor else []


def _check_run(run: str, floor: int) -> list[str]:
    """A run directory of ``step-N`` checkpoints: each committed one loads as step N; the
    newest is at least ``floor``."""
    bad, newest = [], 0
    for d in sorted(os.listdir(run)) if os.path.isdir(run) else []:
        path = os.path.join(run, d)
        if not _committed(path):
            continue
        step = int(d.split("-")[1])
        got = _loaded(path)
        if isinstance(got, str):
            bad.append(f"{path}: committed but does not load: {got}")
        elif not _is(got, step):
            bad.append(f"{path}: loads a state never saved there (step field {got['step']})")
        else:
            newest = max(newest, step)
    if newest < floor:
        bad.append(f"{run}: the newest loadable step is {newest}, with step {floor} reported")
    return bad


def _every_state(model, out: str, where: str, check) -> tuple[int, list[str]]:
    """Each state a cut may leave, written under ``where`` and checked with the floor of its
    point (the newest step reported before it)."""
    model, marks = replay(model, out)
    assert not model.lost, model.lost
    states, blobs = model.states()
    bad = []
    for k, (label, tree) in enumerate(states):
        n = int(label.split(":", 1)[0])
        work = os.path.join(where, f"state-{k}")
        materialize(tree, blobs, work)
        bad += [f"state {k} ({label}): {v}" for v in check(work, [m for m in marks if m.at <= n])]
        shutil.rmtree(work)
    return len(states), bad


def _floor(marks, what: str = "saved", ranks: int = 1) -> int:
    """The newest step ``ranks`` ranks reported ``what`` by then."""
    said: dict[int, set[int]] = {}
    for m in marks:
        if m.what == what:
            said.setdefault(m.step, set()).add(m.rank)
    return max([s for s, r in said.items() if len(r) >= ranks], default=0)


@contextlib.contextmanager
def _journaled(root: str):
    """This rank's calls under ``root/data`` journaled into ``root/journal`` while the block runs."""
    mp = pytest.MonkeyPatch()
    journal = Journal(f"{root}/data", f"{root}/journal")
    journal.install(mp)
    try:
        yield journal
    finally:
        mp.undo()


def _on_node(rank: int, root: str) -> Checkpointer:
    """Node ``rank``'s ``Checkpointer``: its own node-local directory, one replica, one step kept."""
    return Checkpointer([f"{root}/data/node{rank}"], node_local=True, replicas=1, node=f"n{rank}", keep=1,
                        async_mode=None, process_group=dist.new_group(backend="gloo"))


def _collective_over(rank, world, root):
    """Two ranks' collective ``dcp.save`` of step 2 over step 1 in one directory, journaled."""
    ckpt = f"{root}/data/run/ckpt"
    dcp.save(_own(rank, 1), storage_writer=DataStatesWriter(ckpt))
    dist.barrier()
    if rank == 0:  # what the journals start from: step 1, committed and durable
        with open(f"{root}/model.pkl", "wb") as f:
            pickle.dump(Model(f"{root}/data"), f)
    dist.barrier()
    with _journaled(root) as journal:
        dcp.save(_own(rank, 2), storage_writer=DataStatesWriter(ckpt, overwrite=True))
        journal.mark(2, "saved", rank)
    os._exit(0)


def test_a_collective_save_over_a_committed_one_survives_any_power_cut(tmp_path):
    run_ranks(2, _collective_over, str(tmp_path))
    model = pickle.load(open(tmp_path / "model.pkl", "rb"))
    n, bad = _every_state(model, str(tmp_path / "journal"), str(tmp_path / "states"),
                          lambda work, marks: _check_dir(f"{work}/run/ckpt", {1, 2}, max(_floor(marks), 1)))
    assert n > 10, n
    assert not bad, "\n".join(bad[:20])


def _in_dcps_process(rank, world, root):
    """``Checkpointer(async_mode="process")`` on two ranks: DCP's checkpoint process writes both
    tiers, journaled from its start; three steps, retention keeping one in each tier."""
    journal_spawned(f"{root}/data", f"{root}/journal")
    with _journaled(root) as journal:
        ck = Checkpointer([f"{root}/data/fast", f"{root}/data/slow"], keep=[1, 1], async_mode="process",
                          process_group=dist.new_group(backend="gloo"))
        for step in (1, 2, 3):
            ck.save(step, _own(rank, step))
            ck.wait()
            assert ck.wait_persisted(120)
            if rank == 0:  # the coordinator's return says every tier committed; another rank's, its own files
                journal.mark(step, "saved", rank)
        ck.close()
    os._exit(0)


def test_a_save_in_dcps_checkpoint_process_survives_any_power_cut(tmp_path):
    os.makedirs(tmp_path / "data")
    model = Model(str(tmp_path / "data"))
    run_ranks(2, _in_dcps_process, str(tmp_path))
    pids = {n.partition("-")[2] for n in os.listdir(tmp_path / "journal") if n.startswith("journal-")}
    assert len(pids) >= 3, pids  # both ranks and at least one checkpoint process
    n, bad = _every_state(model, str(tmp_path / "journal"), str(tmp_path / "states"),
                          lambda work, marks: _check_run(f"{work}/fast", _floor(marks))
                          + _check_run(f"{work}/slow", _floor(marks)))
    assert n > 20, n
    assert not bad, "\n".join(bad[:20])


def _replicating(rank, world, root):
    """Two nodes of one rank, ``Checkpointer(node_local=True, replicas=1, keep=1)``: three steps,
    each reported saved when its save returns and replicated when ``wait_replicated`` does."""
    with _journaled(root) as journal:
        ck = _on_node(rank, root)
        for step in (1, 2, 3):
            ck.save(step, _own(rank, step))
            journal.mark(step, "saved", rank)
            assert ck.wait_replicated(60)
            journal.mark(step, "replicated", rank)
        ck.close()
    os._exit(0)


def _check_nodes(work: str, nodes: list[str], saved: int, replicated: int) -> list[str]:
    """Node-local copies with replicas: a step committed on some node whose every file some node
    holds must verify as a whole (its files gathered from the nodes); the newest such step is at
    least ``saved``, and the newest whose every file every node holds at least ``replicated``."""
    bad, whole, everywhere = [], 0, 0
    for n in nodes:  # what a node's replica records say it holds, it holds
        for d in sorted(os.listdir(f"{work}/{n}")) if os.path.isdir(f"{work}/{n}") else []:
            if not _committed(f"{work}/{n}/{d}"):
                continue
            tier = StorageTier(f"{work}/{n}/{d}")
            here = set(os.listdir(tier.root))
            for rec in records_in(tier, load_manifest(tier).save_id):
                for rank, files in rec.held.items():
                    if set(files) - here:
                        bad.append(f"{n}/{d}: its record says it holds rank {rank}'s files; "
                                   f"{sorted(set(files) - here)[:2]} are not there")
    names = sorted({d for n in nodes for d in (os.listdir(f"{work}/{n}") if os.path.isdir(f"{work}/{n}") else [])
                    if d.startswith("step-")})
    for d in names:
        holders = {n: f"{work}/{n}/{d}" for n in nodes if _committed(f"{work}/{n}/{d}")}
        if not holders:
            continue
        m = load_manifest(StorageTier(next(iter(holders.values()))))
        files = set(m.files)
        have = {n: files & set(os.listdir(f"{work}/{n}/{d}")) if os.path.isdir(f"{work}/{n}/{d}") else set()
                for n in nodes}
        if set().union(*have.values()) != files:
            continue  # not restorable from what survived: an older step must be
        gathered = f"{work}/gathered/{d}"
        os.makedirs(gathered)
        src = next(iter(holders.values()))
        for n in os.listdir(src):
            if is_manifest_name(n):
                shutil.copy(f"{src}/{n}", gathered)
        for f in files:
            shutil.copy(f"{work}/{next(n for n in nodes if f in have[n])}/{d}/{f}", gathered)
        problems = verify_checkpoint(gathered)
        if problems:
            bad.append(f"{d}: every file survived, but it does not verify: {problems[:2]}")
            continue
        step = int(d.split("-")[1])
        whole = max(whole, step)
        if all(have[n] == files for n in nodes):
            everywhere = max(everywhere, step)
    if whole < saved:
        bad.append(f"the newest step whose files survived is {whole}, with step {saved} reported saved")
    if everywhere < replicated:
        bad.append(f"the newest step held by every node is {everywhere}, with step {replicated} reported "
                   "replicated by every rank")
    return bad


def test_replicated_steps_on_node_local_directories_survive_any_power_cut(tmp_path):
    os.makedirs(tmp_path / "data")
    model = Model(str(tmp_path / "data"))
    run_ranks(2, _replicating, str(tmp_path))
    n, bad = _every_state(model, str(tmp_path / "journal"), str(tmp_path / "states"),
                          lambda work, marks: _check_nodes(work, ["node0", "node1"], _floor(marks),
                                                           _floor(marks, "replicated", 2)))
    assert n > 20, n
    assert not bad, "\n".join(bad[:20])


def _repairing(rank, world, root):
    """The two nodes again, node 1's directory lost: ``Checkpointer.load`` restores step 3 and
    gives node 1 back its copies from node 0, journaled."""
    with _journaled(root):
        ck = _on_node(rank, root)
        got = {f"w{rank}": torch.zeros(1 << 14), "step": 0}
        assert ck.load(got) == 3 and torch.equal(got[f"w{rank}"], _own(rank, 3)[f"w{rank}"])
        ck.close()
    os._exit(0)


def test_the_repair_of_a_lost_node_survives_any_power_cut(tmp_path):
    """Step 3, saved and replicated by both ranks, stays restorable in every state the repair
    may leave, and a node's records never name a file it lacks."""
    os.makedirs(tmp_path / "data")
    run_ranks(2, _replicating, str(tmp_path))
    shutil.rmtree(tmp_path / "journal")
    shutil.rmtree(tmp_path / "data" / "node1")
    model = Model(str(tmp_path / "data"))  # what the repair starts from: node 0's copies, durable
    run_ranks(2, _repairing, str(tmp_path))
    n, bad = _every_state(model, str(tmp_path / "journal"), str(tmp_path / "states"),
                          lambda work, marks: _check_nodes(work, ["node0", "node1"], 3, 0))
    assert n > 5, n
    assert not bad, "\n".join(bad[:20])
