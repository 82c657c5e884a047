"""Resource faults: a full disk, permission denied, a persistent tier that goes away mid-flush,
and checkpointing every step under cache pressure.  For each: the error reaches the caller
(future or exception) and the logs, training goes on, earlier checkpoints are untouched, and
partial data is removed or stays invisible."""

from __future__ import annotations

import collections
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import (Checkpointer, DataStatesLoadPlanner, DataStatesReader, DataStatesSavePlanner,
                            DataStatesWriter, async_save)
from dcp_datastates.gcpause import PROMOTE_AFTER, paused_gc
from dcp_datastates.tiers.local import LocalSink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sd(seed, n=1 << 20):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "meta": {"seed": seed}}


def _loads(path, sd):
    out = {"w": torch.zeros_like(sd["w"]), "meta": {"seed": -1}}
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    return torch.equal(out["w"], sd["w"]) and out["meta"] == sd["meta"]


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {r.stderr.decode().strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full(small_fs, mode, caplog):
    earlier = _sd(1, 1 << 18)  # 1 MiB, fits
    dcp.save(earlier, storage_writer=DataStatesWriter(os.path.join(small_fs, "step-1")), no_dist=True)
    big = _sd(2, 4 << 20)  # 16 MiB: does not fit in what is left
    path = os.path.join(small_fs, "step-2")
    caplog.set_level(logging.DEBUG, logger="dcp_datastates")
    with pytest.raises(BaseException) as ei:
        if mode == "sync":
            dcp.save(big, storage_writer=DataStatesWriter(path), no_dist=True)
        else:
            w = DataStatesWriter(path)
            fut = async_save(big, storage_writer=w, no_dist=True)
            fut.result(timeout=120)  # the error surfaces in the save's future
    assert "No space left on device" in str(ei.value) or "ENOSPC" in str(ei.value) or "28" in str(ei.value)
    # the error names the tier and the file it failed on (issue 69: a bare OSError named neither)
    text = str(ei.value)
    assert f"checkpoint={path}" in text and "file=data-" in text, text
    assert not os.path.exists(os.path.join(path, ".metadata"))  # never committed
    assert not [n for n in os.listdir(path) if n.endswith(".dsd")]  # partial data removed
    assert _loads(os.path.join(small_fs, "step-1"), earlier)  # earlier checkpoint untouched
    # training goes on: the next save to a place with room succeeds
    ok = os.path.join(os.path.dirname(small_fs), "elsewhere")
    dcp.save(big, storage_writer=DataStatesWriter(ok), no_dist=True)
    assert _loads(ok, big)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_at_the_commit_names_the_tier_and_the_file(tmp_path, monkeypatch, mode):
    """The manifest's commit meets ENOSPC: the error names the checkpoint and ``.metadata`` (a
    bare ``OSError: [Errno 28]`` named neither), and stays an OSError with its errno."""
    from dcp_datastates import StorageFailedError
    from tests.disk import full_at_the_commit
    full_at_the_commit(monkeypatch)
    path = str(tmp_path / "step-1")
    with pytest.raises(BaseException) as ei:
        if mode == "sync":
            dcp.save(_sd(1), storage_writer=DataStatesWriter(path), no_dist=True)
        else:
            async_save(_sd(1), storage_writer=DataStatesWriter(path), no_dist=True).result(timeout=120)
    failures = getattr(ei.value, "failures", {}) or {0: ei.value}
    err = failures[0][0] if isinstance(failures[0], tuple) else failures[0]
    assert isinstance(err, StorageFailedError) and isinstance(err, OSError) and err.errno == 28, repr(err)
    assert f"checkpoint={path}" in str(err) and "file=.metadata" in str(err) and "No space" in str(err)


def test_full_persistent_tier_fails_the_flush_promptly(small_fs, tmp_path):
    """The slow tier fills up: the flush is reported failed at once (no wait for a marker that
    will never come), nothing is committed there, and the fast copy is intact."""
    import time
    sd = _sd(3, 4 << 20)  # 16 MiB: more than the 12 MiB tier holds
    fast = str(tmp_path / "nvme" / "step-1")
    w = DataStatesWriter(fast, persist_to=[os.path.join(small_fs, "run", "step-1")])
    dcp.save(sd, storage_writer=w, no_dist=True)
    t = time.monotonic()
    with pytest.raises(BaseException) as ei:
        w.wait_persisted(timeout=120)
    assert time.monotonic() - t < 60, "the commit kept waiting after the upload had failed"
    assert "No space left" in str(ei.value) or "upload" in str(ei.value), repr(ei.value)
    assert not os.path.exists(os.path.join(small_fs, "run", "step-1", ".metadata"))
    assert _loads(fast, sd)


def test_a_failed_rank_stops_the_coordinators_commit(tmp_path):
    """Another rank's upload fails: its failure marker ends the coordinator's wait."""
    import time
    from dcp_datastates.tiers import StorageTier
    from dcp_datastates.tiers.persist import commit_when_complete, marker_name, upload_rank
    src, dst = StorageTier(str(tmp_path / "fast")), StorageTier(str(tmp_path / "slow"))
    src.makedirs()
    dst.makedirs()
    dst.commit_bytes(marker_name(0, "abc"), b"")  # rank 0 uploaded
    bad = upload_rank(src, dst, {"data-r00001-abc000000000-00.dsd": 10}, 1, "abc")  # source missing
    with pytest.raises(FileNotFoundError):
        bad.result(timeout=60)
    t = time.monotonic()
    fut = commit_when_complete(dst, b"manifest", [0, 1], "abc", fence=lambda: None)
    with pytest.raises(OSError, match=r"rank\(s\) \[1\] failed"):
        fut.result(timeout=60)
    assert time.monotonic() - t < 10 and not dst.exists(".metadata")


def test_permission_denied():
    import pathlib
    import tempfile
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="dcpds-perm-", dir="/tmp"))
    base = tmp_path / "ro"
    base.mkdir()
    earlier = _sd(3, 1 << 16)
    dcp.save(earlier, storage_writer=DataStatesWriter(str(base / "step-1")), no_dist=True)
    os.chmod(tmp_path, 0o755)
    os.chmod(base, 0o755)
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o777)
    os.chmod(scratch, 0o777)
    script = textwrap.dedent(f"""
        import os, sys, torch, torch.distributed.checkpoint as dcp, logging
        logging.basicConfig(level=logging.WARNING)
        sys.path.insert(0, {ROOT!r})
        from dcp_datastates import DataStatesWriter
        sd = {{"w": torch.randn(1 << 16), "meta": {{"seed": 4}}}}
        dcp.save(sd, storage_writer=DataStatesWriter({str(scratch / "warm")!r}), no_dist=True)  # warm imports
        os.setgid(65534); os.setuid(65534)  # from here on, an ordinary user
        for target in ({str(base / "step-1")!r}, {str(base / "step-2")!r}):
            try:
                dcp.save(sd, storage_writer=DataStatesWriter(target, overwrite=True), no_dist=True)
                print("SAVED", target)
            except BaseException as e:
                print("ERROR", target, type(e).__name__, str(e).splitlines()[-1][:300])
        dcp.save(sd, storage_writer=DataStatesWriter({str(scratch / "after")!r}), no_dist=True)
        print("TRAINING GOES ON")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    assert len(errors) == 2 and all("Permission denied" in ln for ln in errors), r.stdout
    assert "TRAINING GOES ON" in lines
    assert _loads(str(base / "step-1"), earlier)  # the committed checkpoint is untouched
    assert not (base / "step-2").exists() or not (base / "step-2" / ".metadata").exists()


def test_persistent_tier_goes_away_mid_flush(tmp_path, caplog):
    from tests.s3server import S3Server
    server = S3Server().start()
    try:
        bucket = server.make_bucket("vanishing")
        opts = server.options()
        opts["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 2}
        fast = str(tmp_path / "nvme" / "step-1")
        slow = f"{bucket}/run/step-1"
        sd = _sd(5, 6 << 20)  # 24 MiB: several multipart parts
        caplog.set_level(logging.WARNING, logger="dcp_datastates")
        w = DataStatesWriter(fast, persist_to=[slow], persist_options=opts)
        server.stop()  # the server goes away before (or while) the flush runs
        dcp.save(sd, storage_writer=w, no_dist=True)  # tier 1 commits regardless
        with pytest.raises(BaseException) as ei:
            w.wait_persisted(timeout=120)
        assert "persistent tier failed" in str(ei.value), repr(ei.value)
        # gone before the save claimed it: not flushed there, and said at once (a tier lost after
        # its claim is retried with backoff instead)
        assert any("retry" in r.getMessage() or "could not claim" in r.getMessage() for r in caplog.records)
        assert any("failed" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
        assert _loads(fast, sd)  # the fast copy is committed and intact
        assert not os.path.exists(os.path.join(fast, ".persisted"))  # no tier claimed as committed
        # training goes on: the next save to tier 1 works
        dcp.save(_sd(6), storage_writer=DataStatesWriter(str(tmp_path / "nvme" / "step-2")), no_dist=True)
    finally:
        server.stop()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _digest(sd):
    import xxhash
    return {k: xxhash.xxh3_64_intdigest(memoryview(v.detach().contiguous().numpy())) for k, v in sd.items()}


def _pressure(run_dir: str, steps: int, cache: int) -> dict:
    """Train and checkpoint every step; return the RSS series and each step's digests."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    c = Checkpointer([run_dir], async_mode="thread", host_cache_bytes=cache)
    c.register_step_pre_hook(opt)
    expected, rss = {}, []
    for step in range(1, steps + 1):
        model(torch.randn(8, 512)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        c.save(step, {"model": model.state_dict()})
        expected[step] = _digest(model.state_dict())  # digests, not clones: RSS measures the saves
        rss.append(_rss())
    c.close()
    return {"rss": rss, "expected": expected,
            "shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
            "state_bytes": sum(p.numel() * 4 for p in model.parameters()) * 3}


@pytest.mark.parametrize("steps", [50, pytest.param(400, marks=pytest.mark.slow)])
def test_checkpoint_every_step_under_cache_pressure(tmp_path, steps):
    import json
    cache = 4 << 20  # a third of the ~12 MiB state
    run = str(tmp_path / "run")
    if steps <= 50:
        res = _pressure(run, steps, cache)
    else:  # a fresh process, so the RSS series is the loop's alone (not pytest's bookkeeping)
        code = ("import json, sys; from tests.test_resource_faults import _pressure; "
                "print('RESULT ' + json.dumps(_pressure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))")
        # one malloc arena: glibc's per-thread arenas otherwise creep by ~60 KB a step from
        # fragmentation alone (measured: +23 MiB over the last 100 steps with them, +1 MiB without)
        r = subprocess.run([sys.executable, "-c", code, run, str(steps), str(cache)], capture_output=True,
                           text=True, timeout=900, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT, MALLOC_ARENA_MAX="1"))
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][0][7:])
        res["expected"] = {int(k): v for k, v in res["expected"].items()}
    rss = res["rss"]
    c = Checkpointer([run], async_mode=None)
    assert c.committed_steps(0) == list(range(1, steps + 1))  # no deadlock, all committed
    # bounded: allocator warm-up settles within tens of MiB, then no growth with the step count
    growth = max(rss[9:50]) - rss[9]
    assert growth < cache + (64 << 20), f"RSS grew by {growth >> 20} MiB over steps 10..50"
    if steps >= 400:
        late = max(rss[3 * steps // 4:]) - max(rss[: 3 * steps // 4])
        assert late < cache + (16 << 20), f"RSS still growing: +{late >> 20} MiB in the last quarter"
    for step in range(1, steps + 1):
        out = {"model": {k: torch.zeros(s) for k, s in res["shapes"].items()}}
        assert c.load(out, step=step) == step
        assert _digest(out["model"]) == res["expected"][step], step
    assert res["state_bytes"] > 2 * cache


_PER_ITEM = ("CopyItem", "Placed", "WriteItem", "WriteResult", "ItemRecord", "_Piece")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_finished_save_lets_go_of_the_state_and_its_records(tmp_path, mode):
    """Once a save is over, nothing of ours holds the saved tensors or the save's per-item
    records, even while the writer is kept: they are freed by reference counting, with the
    cycle collector off (records left in cycles wait for a full collection, which walks the
    whole heap; a writer that keeps the last save's tensors keeps a model's old parameters)."""
    def per_item():
        return {id(o): type(o).__name__ for o in gc.get_objects() if type(o).__name__ in _PER_ITEM}

    gc.collect()
    before = per_item()  # what earlier tests keep (DCP's plan caches)
    gc.disable()
    try:
        writer = DataStatesWriter(str(tmp_path / "c"), overwrite=True)
        for step in range(2):
            sd = {f"t{i}": torch.randn(16) for i in range(64)}
            sd["big"] = torch.randn(1 << 18)  # copied lazily by an async save
            held = [weakref.ref(t) for t in sd.values()]
            if mode == "sync":
                dcp.save(sd, storage_writer=writer, no_dist=True)
            else:
                fut = async_save(sd, storage_writer=writer, no_dist=True)
                getattr(fut, "upload_completion", fut).result()
                del fut
            del sd
            deadline = time.monotonic() + 10  # the flush threads return from their last task
            while any(r() is not None for r in held) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [r() is None for r in held].count(False) == 0, f"save {step} still holds its tensors"
            left = collections.Counter(n for i, n in per_item().items() if i not in before)
            assert not left, f"save {step} left {dict(left)} for the cycle collector"
    finally:
        gc.enable()


def test_pauses_of_the_collector_from_several_threads_act_as_one():
    """The planner, the stager and each flush thread pause the cycle collector around their
    bulk record building.  One thread leaving its pause must not end another's, which is still
    inside; the last to leave turns the collector back on."""
    gc.enable()
    try:
        first, second = paused_gc(), paused_gc()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)  # the first leaves while the second is still inside
        assert not gc.isenabled(), "one thread's pause ended another's"
        second.__exit__(None, None, None)
        assert gc.isenabled(), "the collector was left off"
    finally:
        gc.enable()


@pytest.mark.parametrize("collector", ["on", "off"])
def test_saves_and_loads_leave_the_collector_as_they_found_it(tmp_path, collector):
    """Left off, the collector never frees the cycles training makes; turned on, it undoes a
    job's own choice (torchtitan turns it off and collects on its own schedule).  Sync and
    async saves through our planner (the most pauses, on the most threads) and a load."""
    on = collector == "on"
    gc.enable() if on else gc.disable()
    try:
        sd = {f"t{i}": torch.randn(16) for i in range(300)}
        sd["big"] = torch.randn(1 << 20)
        writer = DataStatesWriter(str(tmp_path / "c"), overwrite=True)
        dcp.save(sd, storage_writer=writer, planner=DataStatesSavePlanner(), no_dist=True)
        assert gc.isenabled() is on, "after a sync save"
        fut = async_save(sd, storage_writer=writer, planner=DataStatesSavePlanner(), no_dist=True)
        getattr(fut, "upload_completion", fut).result()
        assert gc.isenabled() is on, "after an async save"
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=DataStatesReader(str(tmp_path / "c")), planner=DataStatesLoadPlanner(),
                 no_dist=True)
        assert gc.isenabled() is on, "after a load"
        assert all(torch.equal(out[k], v) for k, v in sd.items())
    finally:
        gc.enable()


def test_the_end_of_a_save_does_not_forget_the_next_one(tmp_path, monkeypatch):
    """DCP gets a save's results before the writer's own bookkeeping of that save has ended;
    the next save on the writer may start in between.  The writer must still know that the
    next save runs: its back-to-back policy waits for it, and its directory claim stays live."""
    second, first_done, held, seen = threading.Event(), threading.Event(), threading.Event(), []
    close = LocalSink.close

    def held_close(self, sync=True):
        # the first save's data is durable only once the test's callbacks are on its future:
        # otherwise a fast flush sets the future first, and the holding callback then runs in
        # DCP's own thread, before the writer's commit (the save then waits 30 s, tests nothing)
        held.wait(30)
        return close(self, sync)

    monkeypatch.setattr(LocalSink, "close", held_close)

    class Writer(DataStatesWriter):
        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            job = self._job
            if not seen:
                seen.append(None)
                # after the writer's own callback on this job, which runs first
                job.durable.add_done_callback(lambda f: first_done.set())
                fut.add_done_callback(lambda f: second.wait(30))  # DCP has the results; the writer's end waits
                held.set()
            else:
                second.set()
                assert first_done.wait(30)
                seen.append((self._job is job, job.durable.done()))
            return fut

    writer = Writer(str(tmp_path / "c"), overwrite=True)
    f1 = async_save({"w": torch.randn(1 << 16)}, storage_writer=writer, no_dist=True)
    f2 = async_save({"w": torch.randn(8 << 20)}, storage_writer=writer, no_dist=True)  # 32 MiB: still flushing
    for f in (f1, f2):
        getattr(f, "upload_completion", f).result(timeout=60)
    assert second.is_set() and held.is_set()
    known, done = seen[1]
    assert known or done, "the first save's end cleared the writer's record of the second save"


class _Young:
    """A tracked object made inside a pause of the collector."""


def _generation_of(obj) -> int | None:
    return next((g for g in range(3) if any(o is obj for o in gc.get_objects(generation=g))), None)


def test_a_long_pause_hands_what_it_made_to_the_oldest_generation():
    """After a pause in which the process made many objects (a plan's items, a save's records),
    the next young collection would walk them all (60 ms after the local plan of 20,000
    tensors); they go to the oldest generation instead, which full collections still walk."""
    gc.enable()
    gc.collect()
    try:
        with paused_gc():
            made = [_Young() for _ in range(PROMOTE_AFTER + 1000)]
        assert gc.isenabled()
        assert _generation_of(made[-1]) == 2, "the pause's objects were left to a young collection"
        assert gc.get_count()[0] < 100
        assert gc.get_freeze_count() == 0
        with paused_gc():  # a short pause: its objects stay young
            few = [_Young() for _ in range(100)]
        assert _generation_of(few[-1]) == 0
    finally:
        gc.enable()


def test_a_long_pause_that_ends_beside_training_leaves_young_objects_young():
    """A pause that ends on another thread than the main one (a flush thread of an async save,
    while training runs) promotes nothing: the training's young objects, a reference cycle
    that holds a GPU tensor among them, must not wait for a full collection."""
    gc.enable()
    gc.collect()
    made = []

    def flush_thread():
        with paused_gc():
            made.extend(_Young() for _ in range(PROMOTE_AFTER + 1000))

    try:
        t = threading.Thread(target=flush_thread)
        t.start()
        t.join()
        assert _generation_of(made[-1]) in (0, 1), "a pause that ended beside training promoted its objects"
    finally:
        gc.enable()


def test_a_long_pause_leaves_the_applications_frozen_objects_frozen():
    """An application that froze its objects (``gc.freeze()`` before forking workers) keeps
    them frozen: the pause's objects are then left to the young collection."""
    gc.enable()
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with paused_gc():
            made = [_Young() for _ in range(PROMOTE_AFTER + 1000)]
        assert gc.get_freeze_count() == frozen, "the pause unfroze the application's objects"
        assert _generation_of(made[-1]) in (0, 1)  # a young collection may have run since
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_child_forked_during_a_pause_of_the_collector_has_it_on():
    """A process forked while another thread is inside a pause (a flush thread, say) would
    otherwise keep the collector off for good: that thread does not exist in the child."""
    gc.enable()
    pause = paused_gc()
    pause.__enter__()
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        pause.__exit__(None, None, None)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's collector stayed off"
    assert gc.isenabled()


_PAUSE_IN_HANDLER = """
import gc
from dcp_datastates.gcpause import paused_gc
pause = paused_gc()
gc.enable()
with pause._lock:  # as if a signal arrived while this thread was inside the pause's own lock
    with paused_gc():  # what the handler's save does
        assert not gc.isenabled()
assert gc.isenabled()
print("ok")
"""


def test_a_signal_handler_that_saves_cannot_deadlock_on_the_collectors_pause():
    """A job saves from its SIGTERM handler (a preemption checkpoint); the handler runs in the
    main thread, which may be inside the pause's lock at that moment."""
    r = subprocess.run([sys.executable, "-c", _PAUSE_IN_HANDLER], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.stdout.strip() == "ok", r.stderr[-2000:]
