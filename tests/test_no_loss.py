"""No committed checkpoint lost (issue 17): concurrent writers, per-rank manifests,
incremental bases, symlinks, crafted and special files.  Each case was a failure before."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.values import decode_value
from tests.dist import run_ranks
from tests.manifest_tools import rewrite_manifest
from tests.rank_child import state_for as rank_state
from tests.save_child import state_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)


def _save(path, sd, **kw):
    dcp.save(sd, storage_writer=DataStatesWriter(path, **kw), no_dist=True)


def _load(path, tmpl, **kw):
    dcp.load(tmpl, storage_reader=DataStatesReader(path, **kw), no_dist=True)
    return tmpl


def _load_seed(path, mib):
    out = _load(path, {"w": torch.zeros(mib * 256, 1024), "seed": -1})
    for seed in (1, 2):
        if out["seed"] == seed:
            assert torch.equal(out["w"], state_for(seed, mib)["w"]), "tensor of another save"
            return seed
    raise AssertionError(f"loaded seed {out['seed']}")


# ---------------------------------------------------------------- 1. two writers at once
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("mib", [8, 96])
def test_two_processes_same_directory(tmp_path, overwrite, mib):
    path = str(tmp_path / "step-1")
    go = str(tmp_path / "go")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.save_child", path, str(s), str(mib),
                               "1" if overwrite else "0", go], env=ENV, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for s in (1, 2)]
    time.sleep(1.5)  # both imported torch and built their state
    open(go, "w").close()
    outs = [p.communicate(timeout=240)[0].decode().strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ok = [s for s, o in zip((1, 2), outs) if o == "OK"]
    assert ok, outs
    for o in outs:
        assert o == "OK" or ("CheckpointBusyError" in o or "CheckpointExistsError" in o), o
    # the checkpoint loads, exactly one writer's state, and one that reported success
    assert _load_seed(path, mib) in ok
    if not overwrite:
        assert len(ok) == 1, outs  # a second save never replaces a committed one


# ------------------------------------------------------- 2. per-rank manifests, overwrite
def _per_rank_saves(rank, world, path):
    import torch.distributed as dist
    for seed in (1, 2, 3):
        dcp.save(rank_state(seed, rank), storage_writer=DataStatesWriter(path, overwrite=True),
                 use_collectives=False)
        dist.barrier()
        if rank == 0:
            _check_rank_ckpt(path, seed)
        dist.barrier()


def _check_rank_ckpt(path, seed):
    tmpl = {}
    for r in (0, 1):
        ref = rank_state(seed, r)
        tmpl[f"r{r}"] = torch.zeros_like(ref[f"r{r}"])
        tmpl[f"small{r}"] = torch.zeros_like(ref[f"small{r}"])
    tmpl["shared_seed"] = torch.tensor([-1])
    dcp.load(tmpl, storage_reader=DataStatesReader(path), no_dist=True)
    assert int(tmpl["shared_seed"]) == seed
    for r in (0, 1):
        ref = rank_state(seed, r)
        assert torch.equal(tmpl[f"r{r}"], ref[f"r{r}"]) and torch.equal(tmpl[f"small{r}"], ref[f"small{r}"])


def test_per_rank_manifests_overwrite(tmp_path):
    run_ranks(2, _per_rank_saves, str(tmp_path / "ckpt"))


def test_per_rank_stale_rank_is_never_merged(tmp_path):
    """Rank 1's manifest of the newer save is missing (it died before committing): the reader
    loads the older complete save, never rank 0's new manifest with rank 1's old one."""
    import shutil
    path = str(tmp_path / "step-1")
    run_ranks(2, _one_per_rank_save, path, 1)
    snap = str(tmp_path / "snap")
    shutil.copytree(path, snap)
    run_ranks(2, _one_per_rank_save, path, 2)
    # the state rank 1 would have left had it died before committing save 2: its save-1
    # manifest and files untouched, no save-2 manifest of its own
    for n in os.listdir(snap):
        if not os.path.exists(os.path.join(path, n)):
            shutil.copy(os.path.join(snap, n), os.path.join(path, n))
    old = {n for n in os.listdir(snap) if n.startswith(".manifest.rank-00001.")}
    for n in os.listdir(path):
        if n.startswith(".manifest.rank-00001.") and n not in old:
            os.remove(os.path.join(path, n))
    _check_rank_ckpt(path, 1)


def _one_per_rank_save(rank, world, path, seed):
    dcp.save(rank_state(seed, rank), storage_writer=DataStatesWriter(path, overwrite=True),
             use_collectives=False)


# ------------------------------------------------------ 3. SIGKILL during per-rank overwrite
def _kill_trials(tmp_path, n, name):
    path = str(tmp_path / name)
    subprocess.run([sys.executable, "-m", "tests.rank_child", path, "1"], env=ENV, cwd=ROOT,
                   check=True, timeout=240, capture_output=True)
    _check_rank_ckpt(path, 1)
    rng = random.Random(17)
    outcomes = {"old": 0, "new": 0}
    committed = 1
    for trial in range(n):
        seed = committed + 1
        p = subprocess.Popen([sys.executable, "-m", "tests.rank_child", path, str(seed)], env=ENV,
                             cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(2.0, 6.0))
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(60)
        try:
            _check_rank_ckpt(path, seed)
            outcomes["new"] += 1
            committed = seed
        except AssertionError:
            _check_rank_ckpt(path, committed)  # the old one, exactly
            outcomes["old"] += 1
    return outcomes


@pytest.mark.parametrize("name", ["step-1", "ckpt"])
def test_per_rank_sigkill_during_overwrite(tmp_path, name):
    out = _kill_trials(tmp_path, 2, name)  # 20 in test_per_rank_sigkill_20_trials (make test-long)
    assert sum(out.values()) == 2


@pytest.mark.slow
def test_per_rank_sigkill_20_trials(tmp_path):
    out = _kill_trials(tmp_path, 20, "step-1")
    print("per-rank SIGKILL outcomes:", out)
    assert sum(out.values()) == 20


# ------------------------------------------------------------------ 4. incremental bases
def test_resave_of_incremental_base_keeps_child(tmp_path):
    run = tmp_path / "run"
    a = {"w": torch.randn(1024, 1024), "b": torch.randn(64)}
    _save(str(run / "epoch-1"), a)
    a2 = {"w": a["w"].clone(), "b": torch.randn(64)}
    _save(str(run / "epoch-2"), a2, incremental_base="epoch-1")
    _save(str(run / "epoch-1"), {"w": torch.randn(1024, 1024), "b": torch.randn(64)}, overwrite=True)
    out = _load(str(run / "epoch-2"), {"w": torch.zeros(1024, 1024), "b": torch.zeros(64)})
    assert torch.equal(out["w"], a2["w"]) and torch.equal(out["b"], a2["b"])


def test_resave_of_base_on_slow_tier_keeps_child(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    a = {"w": torch.randn(1024, 1024), "b": torch.randn(64)}
    a2 = {"w": a["w"].clone(), "b": torch.randn(64)}

    def save(step, sd, **kw):
        w = DataStatesWriter(str(fast / f"step-{step}"), persist_to=[str(slow / f"step-{step}")], **kw)
        dcp.save(sd, storage_writer=w, no_dist=True)
        assert w.wait_persisted(60)
    save(1, a)
    save(2, a2, incremental_base="step-1")
    save(1, {"w": torch.randn(1024, 1024), "b": torch.randn(64)}, overwrite=True)
    out = _load(str(slow / "step-2"), {"w": torch.zeros(1024, 1024), "b": torch.zeros(64)})
    assert torch.equal(out["w"], a2["w"]) and torch.equal(out["b"], a2["b"])


def test_dcp_checkpoint_beside_ours_is_no_warning_and_keeps_tidy_working(tmp_path, caplog):
    """A checkpoint in DCP's own format next to ours (a run being migrated) references none of
    our files: overwriting ours still removes the superseded data files, without a warning."""
    import logging
    run = tmp_path / "run"
    dcp.save({"w": torch.randn(64)}, storage_writer=dcp.FileSystemWriter(str(run / "dcp-step-1")), no_dist=True)
    _save(str(run / "step-1"), {"w": torch.randn(64)})
    first = {n for n in os.listdir(run / "step-1") if n.endswith(".dsd")}
    caplog.set_level(logging.INFO)
    _save(str(run / "step-1"), {"w": torch.randn(64)}, overwrite=True)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert first.isdisjoint(os.listdir(run / "step-1"))  # the superseded save's files are gone
    assert os.listdir(run / "dcp-step-1")  # DCP's checkpoint untouched


def test_retention_never_purges_a_dcp_checkpoint_in_a_step_directory(tmp_path, caplog):
    """A checkpoint DCP's FileSystemWriter saved as ``step-1`` of our run is not one of our
    steps: not committed, not latest, and retention never removes its ``.metadata``."""
    import logging
    run = tmp_path / "run"
    theirs = {"w": torch.randn(64)}
    dcp.save(theirs, storage_writer=dcp.FileSystemWriter(str(run / "step-1")), no_dist=True)
    before = sorted(os.listdir(run / "step-1"))
    c = Checkpointer([str(run)], keep=1, async_mode=None)
    assert c.committed_steps(0) == [] and c.latest_step() is None
    caplog.set_level(logging.INFO)
    for step in (2, 3, 4):
        c.save(step, {"w": torch.randn(64)})
    c.close()
    assert c.committed_steps(0) == [4] and c.latest_step() == 4
    assert sorted(os.listdir(run / "step-1")) == before
    out = {"w": torch.zeros(64)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(run / "step-1")), no_dist=True)
    assert torch.equal(out["w"], theirs["w"])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    # a run whose newest step is DCP's: the load says why it does not restore it
    c2 = Checkpointer([str(tmp_path / "run2")], async_mode=None)
    dcp.save(theirs, storage_writer=dcp.FileSystemWriter(str(tmp_path / "run2" / "step-9")), no_dist=True)
    assert c2.load({"w": torch.zeros(64)}) is None
    assert "step(s) [9] in DCP's own format" in caplog.text
    # asked directly, the purge leaves it alone too
    from dcp_datastates.tiers import StorageTier
    from dcp_datastates.tiers.retention import purge_steps
    assert purge_steps(StorageTier(str(run)), ["step-1"]) == []
    assert sorted(os.listdir(run / "step-1")) == before


# ------------------------------------------------------------------ 5. overlapping chunks
def test_overlapping_chunks_refused(tmp_path):
    path = str(tmp_path / "c")
    w = torch.arange(3 * 4096, dtype=torch.float32).reshape(3, 4096)
    _save(path, {"w": w})
    raw = w.numpy().tobytes()

    def mutate(body):
        c = body["tensors"]["w"]["chunks"][0]
        f, off, _n = c["x"][0][0]
        row = 4096 * 4
        c0 = {"o": [0, 0], "s": [2, 4096], "x": [[[f, off, 2 * row]], 2 * row, xxhash.xxh3_128_digest(raw[:2 * row])]}
        c1 = {"o": [1, 0], "s": [1, 4096], "x": [[[f, off + row, row]], row, xxhash.xxh3_128_digest(raw[row:2 * row])]}
        body["tensors"]["w"]["chunks"] = [c0, c1]
    rewrite_manifest(path, mutate)
    with pytest.raises(BaseException, match="overlap"):
        _load(path, {"w": torch.full((3, 4096), -1.0)})


# ------------------------------------------------------------------ 6. symlinks in a run
def test_retention_never_follows_a_step_symlink(tmp_path):
    other = tmp_path / "other-run" / "step-5"
    _save(str(other), {"w": torch.randn(16)})
    (other / "notes.txt").write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(other, run / "step-0")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / ".purged").write_text("")
    (target / "data-r00000-0123456789ab-00.dsd").write_text("not yours")
    os.symlink(target, run / "step-999")
    before = sorted(os.listdir(other)), sorted(os.listdir(target))
    c = Checkpointer([str(run)], keep=1)
    for step in (1, 2, 3):
        c.save(step, {"w": torch.randn(16)})
    c.close()
    assert (sorted(os.listdir(other)), sorted(os.listdir(target))) == before
    assert sorted(os.listdir(run)) == ["step-0", "step-3", "step-999"]


def test_retention_skips_subdirectories_and_foreign_files(tmp_path):
    run = tmp_path / "run"
    c = Checkpointer([str(run)], keep=1)
    c.save(1, {"w": torch.randn(16)})
    c.wait()
    (run / "step-1" / "sub").mkdir()
    (run / "step-1" / "sub" / "x").write_text("x")
    (run / "step-1" / "README").write_text("user notes")
    for step in (2, 3, 4):
        c.save(step, {"w": torch.randn(16)})
        c.wait()
    (run / "step-4" / "deeper").mkdir()
    c.save(5, {"w": torch.randn(16)})
    c.close()
    assert not (run / "step-2").exists() and not (run / "step-3").exists()  # later passes ran
    assert (run / "step-4" / "deeper").exists()
    assert (run / "step-1" / "README").read_text() == "user notes" and (run / "step-1" / "sub" / "x").exists()
    assert not [n for n in os.listdir(run / "step-1") if n.endswith(".dsd") or n == ".metadata"]


# ------------------------------------------------------------------ 7. reads stay inside
def test_data_file_symlink_refused(tmp_path):
    path = tmp_path / "c"
    w = torch.randn(256, 1024)
    _save(str(path), {"w": w})
    data = next(n for n in os.listdir(path) if n.endswith(".dsd"))
    outside = tmp_path / "outside.bin"
    os.rename(path / data, outside)
    os.symlink(outside, path / data)
    with pytest.raises(BaseException, match="symbolic link"):
        _load(str(path), {"w": torch.zeros(256, 1024)})
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "verify", str(path)], env=ENV,
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "symbolic link" in (r.stdout + r.stderr)


# ------------------------------------------------------------- 8. convert runs no pickle
def test_convert_from_dcp_refuses_pickle(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    import pickle
    (src / ".metadata").write_bytes(pickle.dumps(Evil()))
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "convert", str(src), str(tmp_path / "dst"),
                        "--to", "datastates"], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--allow-pickle" in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1
    assert not marker.exists()


# ------------------------------------------------------------ 9. deep values never crash
def test_deeply_nested_value_is_an_error_not_a_crash(tmp_path):
    code = ("import msgpack\nfrom dcp_datastates.format.values import decode_value\n"
            "x = msgpack.packb([])\n"
            "for _ in range(200): x = msgpack.packb(msgpack.ExtType(1, x))\n"
            "try:\n    decode_value(x)\nexcept ValueError as e:\n    print('refused', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "refused" in r.stdout, (r.returncode, r.stderr[-1000:])
    assert decode_value(b"\xc7\x01\x01\x90") == ()  # one level is fine


# ------------------------------------------------------- 10. special and huge manifests
@pytest.mark.parametrize("kind", ["dev-zero", "sparse", "fifo-manifest", "fifo-data"])
def test_special_files_refused_fast(tmp_path, kind):
    path = tmp_path / "c"
    _save(str(path), {"w": torch.randn(16)})
    if kind == "dev-zero":
        os.remove(path / ".metadata")
        os.symlink("/dev/zero", path / ".metadata")
    elif kind == "sparse":
        with open(path / ".metadata", "r+b") as f:
            f.truncate(5 << 30)
    elif kind == "fifo-manifest":
        os.remove(path / ".metadata")
        os.mkfifo(path / ".metadata")
    else:
        data = next(n for n in os.listdir(path) if n.endswith(".dsd"))
        os.remove(path / data)
        os.mkfifo(path / data)
    code = ("import resource, time, torch, torch.distributed.checkpoint as dcp\n"
            "from dcp_datastates import DataStatesReader\n"
            "r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "t = time.time()\n"
            "try:\n"
            f"    dcp.load({{'w': torch.zeros(16)}}, storage_reader=DataStatesReader({str(path)!r}), no_dist=True)\n"
            "    print('LOADED')\n"
            "except BaseException as e:\n"
            "    print('ERR', str(e).replace('\\n', ' ')[-300:])\n"
            "print('RSS', (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) // 1024, 'T', time.time() - t)\n")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert "ERR" in r.stdout, r.stdout + r.stderr[-2000:]
    growth = int(r.stdout.split("RSS ")[1].split()[0])
    assert growth < 256, r.stdout  # MiB of RSS growth during the load: nothing was read whole
    assert any(w in r.stdout for w in ("symbolic link", "not a regular file", "over the")), r.stdout


# ---------------------------------------------------------- resource use of the checks
def test_claim_released_and_no_leftovers(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, {"w": torch.randn(1024, 1024)})
    _save(path, {"w": torch.randn(1024, 1024)}, overwrite=True)
    names = sorted(os.listdir(path))
    assert ".claim" not in names
    assert len([n for n in names if n.endswith(".dsd")]) == 1 and ".metadata" in names


def test_error_types_are_checkpoint_errors():
    assert issubclass(__import__("dcp_datastates.errors", fromlist=["x"]).CheckpointBusyError, CheckpointError)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


# --------------------------------------------------- 11. a million empty chunks, bounded
_MAKE_EMPTY_CHUNKS = """
import os, struct, sys, msgpack, xxhash, torch, torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesWriter
from dcp_datastates.format.manifest import MAGIC, decode_manifest, encode_manifest
d = sys.argv[1]
dcp.save({"w": torch.arange(16.0)}, storage_writer=DataStatesWriter(d), no_dist=True)
p = os.path.join(d, ".metadata")
data = encode_manifest(decode_manifest(open(p, "rb").read()), version=2)  # the version 2 layout
body = msgpack.unpackb(data[len(MAGIC):-8], raw=False, strict_map_key=False)
body["tensors"]["e"] = {"dtype": "float32", "size": [0, 1 << 20],
                        "chunks": [{"o": [0, i], "s": [0, 0], "x": [[], 0, bytes(16)]} for i in range(1_000_000)]}
payload = msgpack.packb(body, use_bin_type=True)
open(p, "wb").write(MAGIC + payload + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload)))
"""

_LOAD_RSS = """
import resource, sys, torch, torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesReader
out = {"w": torch.zeros(16)}
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
dcp.load(out, storage_reader=DataStatesReader(sys.argv[1]), no_dist=True)
assert torch.equal(out["w"], torch.arange(16.0))
print("GROWTH_MIB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) // 1024)
"""


def test_million_empty_chunks_decode_in_bounded_memory(tmp_path):
    """A 36 MiB manifest of one million empty chunks cost 1.2 GB of RSS to load (msgpack built
    the whole tree first); decoded one chunk at a time, empty chunks folded, it costs a few
    times the file size."""
    d = str(tmp_path / "c")
    subprocess.run([sys.executable, "-c", _MAKE_EMPTY_CHUNKS, d], env=ENV, cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    size_mib = os.path.getsize(os.path.join(d, ".metadata")) / 2**20
    r = subprocess.run([sys.executable, "-c", _LOAD_RSS, d], env=ENV, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    growth = int(r.stdout.split("GROWTH_MIB")[1].split()[0])
    assert growth < 8 * size_mib, (growth, size_mib)


def _own(p, value, n):
    out = {"w": torch.zeros(n), "s": torch.zeros(8)}
    dcp.load(out, storage_reader=DataStatesReader(str(p)), no_dist=True)
    return bool(torch.all(out["w"] == value)) and bool(torch.all(out["s"] == value))


def test_saves_through_one_writer_that_overlap_stay_apart(tmp_path):
    """DCP runs each async save in a thread of its own, so a second save through the same
    writer can start while the first runs.  Before: both futures succeeded, the first directory
    had no manifest and the second's manifest named the first's data file.  Each save now
    waits for the previous one through the writer, and each checkpoint holds its own state."""
    from dcp_datastates import async_save
    n = 1 << 20
    writer = DataStatesWriter(None)
    futs = [async_save({"w": torch.full((n,), float(i)), "s": torch.full((8,), float(i))}, storage_writer=writer,
                       checkpoint_id=str(tmp_path / f"c{i}"), no_dist=True) for i in (1, 2)]
    dcp.save({"w": torch.full((n,), 3.0), "s": torch.full((8,), 3.0)}, storage_writer=writer,
             checkpoint_id=str(tmp_path / "c3"), no_dist=True)  # synchronous, from the same thread
    for f in futs:
        getattr(f, "upload_completion", f).result(timeout=120)
    assert [_own(tmp_path / f"c{i}", float(i), n) for i in (1, 2, 3)] == [True, True, True]


def test_an_async_save_dcp_gave_up_on_does_not_hold_the_writer(tmp_path):
    """A save that DCP abandons between two of the writer's calls (its planner raised) frees
    the writer when its future ends, so the next save through it does not wait."""
    import threading
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from dcp_datastates import async_save

    class Boom(DefaultSavePlanner):
        def create_local_plan(self):
            raise RuntimeError("planner failed")

    writer = DataStatesWriter(None)
    sd = {"w": torch.full((1024,), 5.0), "s": torch.full((8,), 5.0)}
    fut = async_save(sd, storage_writer=writer, checkpoint_id=str(tmp_path / "a"), planner=Boom(), no_dist=True)
    with pytest.raises(BaseException) as failed:  # DCP's CheckpointException, wrapping the planner's error
        getattr(fut, "upload_completion", fut).result(timeout=60)
    assert "planner failed" in str(failed.value) or "planner failed" in repr(failed.value.args)
    done = threading.Event()
    t = threading.Thread(target=lambda: (dcp.save(sd, storage_writer=writer, checkpoint_id=str(tmp_path / "b"),
                                                   no_dist=True), done.set()), daemon=True)
    t.start()
    assert done.wait(60), "the next save waited for the abandoned one"
    assert _own(tmp_path / "b", 5.0, 1024)


# ------------------------------------------- issue 35, case 6: manifest kinds supersede
def _saves_of_two_kinds(rank, world, path, collective_first):
    import torch.distributed as dist
    for seed, collective in ((1, collective_first), (2, not collective_first)):
        dcp.save(rank_state(seed, rank), storage_writer=DataStatesWriter(path, overwrite=True),
                 use_collectives=collective)
        dist.barrier()


@pytest.mark.parametrize("collective_first", [True, False], ids=["collective-then-per-rank", "per-rank-then-collective"])
def test_a_save_of_either_kind_supersedes_the_other(tmp_path, collective_first):
    """A committed save with per-rank manifests over a collective one (and the reverse) is what
    every later load returns: the newest committed save, whichever kind wrote it.  Before, the
    old ``.metadata`` stayed and was preferred, so loads silently returned the old state."""
    path = str(tmp_path / "ckpt")
    run_ranks(2, _saves_of_two_kinds, path, collective_first)
    _check_rank_ckpt(path, 2)


# --------------------------------------------- issue 35, case 8: a zombie holds no claim
def test_a_claim_of_a_zombie_process_is_stale(tmp_path):
    """A checkpoint process killed by SIGKILL stays a zombie until its parent reaps it (DCP's
    PROCESS mode never does, nor does an init that does not reap).  Its claim must count as
    stale: before, ``kill(pid, 0)`` succeeded on the zombie, so every later save into the
    directory failed with ``CheckpointBusyError``, across restarts too."""
    import socket

    from dcp_datastates.format.names import CLAIM_NAME
    from dcp_datastates.tiers import StorageTier
    from dcp_datastates.tiers.claim import ClaimRecord, acquire
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # exited, not reaped: a zombie
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        if fields[0] == b"Z":
            break
        time.sleep(0.02)
    started = int(fields[19])  # what a claim records: the process's start time
    try:
        tier = StorageTier(str(tmp_path / "ck"))
        tier.makedirs()
        rec = ClaimRecord("0123456789ab", socket.gethostname(), child.pid, started, time.time())
        tier.commit_bytes(CLAIM_NAME, rec.to_bytes())
        claim = acquire(tier, CLAIM_NAME, "ba9876543210")
        assert claim.took_over == ["0123456789ab"]
        claim.release()
    finally:
        child.wait()


def test_a_step_uncommitted_while_a_tidy_up_reads_the_run_is_not_unreadable(tmp_path, monkeypatch, caplog):
    """Retention uncommits step-1 between a tidy-up's listing of it and its read of step-1's
    manifest.  The manifest is gone, not unreadable: the tidy-up of step-2, saved again, still
    removes what the replaced save owned.  (It took the vanished manifest for one it could not
    read, which may reference any file, and removed nothing: a dead attempt's files were left
    behind in the crash harness under load.)"""
    import logging

    from dcp_datastates.tiers.local import LocalBackend
    run = tmp_path / "run"
    _save(str(run / "step-1"), {"w": torch.randn(1024)})
    _save(str(run / "step-2"), {"w": torch.randn(1024)})
    old = {n for n in os.listdir(run / "step-2") if n.startswith("data-")}
    orig = LocalBackend.read_file
    gone = []

    def read_file(self, path, *a, **kw):  # step-1 uncommitted just before its manifest is read
        if path == str(run / "step-1" / ".metadata") and not gone:
            gone.append(path)
            os.remove(path)
        return orig(self, path, *a, **kw)
    monkeypatch.setattr(LocalBackend, "read_file", read_file)
    caplog.set_level(logging.WARNING)
    _save(str(run / "step-2"), {"w": torch.randn(1024)}, overwrite=True)
    assert gone, "the tidy-up never read step-1's manifest"
    assert not old & set(os.listdir(run / "step-2")), "the replaced save's files stayed"
    assert "cannot read the committed manifest" not in caplog.text
