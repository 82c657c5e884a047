"""Incremental checkpoints: unchanged bytes are referenced, never written twice."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.errors import CheckpointError
from dcp_datastates.tiers.manifests import load_manifest
from dcp_datastates.tiers import StorageTier
from tests import workers
from tests.dist import run_ranks
from tests.manifest_tools import rewrite_manifest

MiB = 1 << 20


def _state(step: int) -> dict:
    """A LoRA-shaped state: large frozen base weights, small trainable adapters that change."""
    g = torch.Generator().manual_seed(0)
    frozen = {"embed": torch.randn(6 * MiB // 4, generator=g).reshape(-1, 256),  # 6 MiB
              "w0": torch.randn(512, 2048, generator=g),  # 4 MiB
              "w1": torch.randn(512, 2048, generator=g).bfloat16(),  # 2 MiB
              "norms": [torch.ones(512) * i for i in range(20)]}
    t = torch.Generator().manual_seed(1000 + step)
    return {"base": frozen,
            "lora": {"a": torch.randn(512, 8, generator=t), "b": torch.randn(8, 2048, generator=t)},
            "optim": {"exp_avg": torch.randn(8, 2048, generator=t), "step": step}}


def _like(sd):
    if isinstance(sd, dict):
        return {k: _like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_like(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.full_like(sd, 7)
    return -1


def _assert_equal(a, b, path=""):
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor mismatch at {path}"
    else:
        assert a == b, path


def _save(path, sd, **kw):
    w = DataStatesWriter(path, **kw)
    dcp.save(sd, storage_writer=w, no_dist=True)
    return w


def _load(path, like):
    out = _like(like)
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    return out


def _own_bytes(d):
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".dsd"))


def test_dedup_across_steps(tmp_path):
    run = tmp_path / "run"
    full = _save(str(run / "step-1"), _state(1))
    assert full.last_stats["bytes_reused"] == 0
    inc = _save(str(run / "step-2"), _state(2), incremental_base="step-1")
    frozen = sum(t.numel() * t.element_size() for t in
                 [*_state(0)["base"]["norms"], *(v for k, v in _state(0)["base"].items() if k != "norms")])
    # every frozen byte is referenced; only the adapters and optimizer state are written
    assert inc.last_stats["bytes_reused"] == frozen
    assert _own_bytes(run / "step-2") < 0.1 * _own_bytes(run / "step-1")
    _assert_equal(_load(str(run / "step-2"), _state(2)), _state(2))
    _assert_equal(_load(str(run / "step-1"), _state(1)), _state(1))
    m = load_manifest(StorageTier(str(run / "step-2")))
    assert set(m.homes.values()) == {"step-1"} and m.homes
    # a chain: step 3 on step 2 still points at step 1's files directly (no chains to follow)
    _save(str(run / "step-3"), _state(3), incremental_base=str(run / "step-2"))
    m3 = load_manifest(StorageTier(str(run / "step-3")))
    assert set(m3.homes.values()) == {"step-1"}
    _assert_equal(_load(str(run / "step-3"), _state(3)), _state(3))


def test_partial_change_writes_only_changed_units(tmp_path):
    run = tmp_path / "run"
    g = torch.Generator().manual_seed(3)
    sd = {"table": torch.randn(32 * MiB // 4, generator=g).reshape(-1, 1024)}  # 32 MiB
    _save(str(run / "step-1"), sd)
    sd2 = {"table": sd["table"].clone()}
    sd2["table"][5000] += 1  # one row, inside one 4 MiB unit (rows 4096..5119)
    w = _save(str(run / "step-2"), sd2, incremental_base="step-1")
    assert w.last_stats["bytes_written"] == 4 * MiB
    assert w.last_stats["bytes_reused"] == 28 * MiB
    _assert_equal(_load(str(run / "step-2"), sd2), sd2)
    _assert_equal(_load(str(run / "step-1"), sd), sd)
    # the unit is configurable: 1 MiB units write 1 MiB
    w = _save(str(run / "step-3"), sd2 | {"table": sd2["table"] * 1}, incremental_base="step-2",
              dedup_unit_bytes=MiB)
    assert w.last_stats["bytes_written"] == 0 and w.last_stats["bytes_reused"] == 32 * MiB
    sd4 = {"table": sd2["table"].clone()}
    sd4["table"][100] -= 1
    w = _save(str(run / "step-4"), sd4, incremental_base="step-3", dedup_unit_bytes=MiB)
    assert w.last_stats["bytes_written"] == MiB
    _assert_equal(_load(str(run / "step-4"), sd4), sd4)


def test_corrupt_base_file_is_named_on_load(tmp_path):
    run = tmp_path / "run"
    _save(str(run / "step-1"), _state(1))
    _save(str(run / "step-2"), _state(2), incremental_base="step-1")
    m = load_manifest(StorageTier(str(run / "step-2")))
    shared = sorted(m.homes)[0]
    os.remove(run / "step-1" / shared)
    with pytest.raises(BaseException) as ei:
        _load(str(run / "step-2"), _state(2))
    msg = str(ei.value)
    assert shared in msg and "step-1" in msg and "step-2" in msg
    # verify reports it too
    from dcp_datastates.cli import verify_checkpoint
    problems = verify_checkpoint(str(run / "step-2"))
    assert any(shared in p and "missing" in p for p in problems)


def test_base_must_be_a_sibling_and_a_missing_base_means_a_full_save(tmp_path):
    with pytest.raises(BaseException) as ei:
        _save(str(tmp_path / "a" / "step-2"), _state(2), incremental_base=str(tmp_path / "b" / "step-1"))
    assert "sibling" in str(ei.value)
    w = _save(str(tmp_path / "a" / "step-3"), _state(3), incremental_base="step-1")  # never saved
    assert w.last_stats["bytes_reused"] == 0
    _assert_equal(_load(str(tmp_path / "a" / "step-3"), _state(3)), _state(3))


def _run_steps(c, steps):
    for s in steps:
        c.save(s, _state(s))
        c.wait_persisted(120)


def test_purge_with_shared_extents(tmp_path):
    c = Checkpointer([str(tmp_path / "run")], keep=2, async_mode=None, incremental=True)
    _run_steps(c, range(1, 7))
    c.close()
    assert c.last_stats["bytes_reused"] > 12 * MiB and 0 < c.last_stats["bytes_written"] < MiB
    assert c.committed_steps(0) == [5, 6]
    run = tmp_path / "run"
    # step 1 wrote the frozen weights; it stays only as a husk holding those files
    assert sorted(os.listdir(run)) == ["step-1", "step-5", "step-6"]
    husk = os.listdir(run / "step-1")
    assert ".metadata" not in husk and any(n.endswith(".dsd") for n in husk)
    assert _own_bytes(run / "step-1") < 16 * MiB
    for s in (5, 6):
        _assert_equal(_load(str(run / f"step-{s}"), _state(s)), _state(s))
    # inspect shows ownership per step
    from dcp_datastates.cli import main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["inspect", str(run), "--json"])
    rows = {r["step"]: r for r in json.loads(buf.getvalue())["steps"]}
    assert set(rows) == {5, 6}
    assert rows[6]["shared_from"] == {"step-1": rows[6]["shared_bytes"]} and rows[6]["shared_bytes"] > 12 * MiB
    assert rows[6]["owned_bytes"] < MiB
    # a self-contained checkpoint (incremental off) is never a husk
    c2 = Checkpointer([str(tmp_path / "plain")], keep=1, async_mode=None)
    _run_steps(c2, range(1, 4))
    assert sorted(os.listdir(tmp_path / "plain")) == ["step-3"]


def test_overwrite_never_deletes_files_a_later_step_uses(tmp_path):
    run = tmp_path / "run"
    _save(str(run / "step-1"), _state(1))
    _save(str(run / "step-2"), _state(2), incremental_base="step-1")
    _save(str(run / "step-1"), _state(5), overwrite=True)  # step 1 saved again (a rerun)
    _assert_equal(_load(str(run / "step-2"), _state(2)), _state(2))
    _assert_equal(_load(str(run / "step-1"), _state(5)), _state(5))


PURGE_CHILD = r"""
import sys
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.retention import purge_steps
from tests.faults import install
install()
purge_steps(StorageTier(sys.argv[1]), sys.argv[2].split(","))
"""


@pytest.mark.parametrize("nth", [1, 2, 3, 4, 5])
def test_crash_during_purge_leaves_retained_steps_loadable(tmp_path, nth):
    run = tmp_path / "run"
    c = Checkpointer([str(run)], async_mode=None, incremental=True)
    _run_steps(c, range(1, 6))
    ready = tmp_path / "ready"
    env = dict(os.environ, DCP_DATASTATES_FAULT=f"purge:{nth}", DCP_DATASTATES_FAULT_READY=str(ready),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen([sys.executable, "-c", PURGE_CHILD, str(run), "step-1,step-2,step-3"], env=env)
    deadline = time.monotonic() + 60
    while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait()
    # the retained steps load whatever point the purge reached
    for s in (4, 5):
        _assert_equal(_load(str(run / f"step-{s}"), _state(s)), _state(s))
    assert c.latest_step() == 5
    # the purge really was interrupted, and what it uncommitted stays uncommitted (a step it
    # only marked, the claims not read again yet, keeps its manifest and stays committed)
    assert ready.exists()
    marked = [s for s in (1, 2, 3) if (run / f"step-{s}" / ".purged").exists()]
    uncommitted = [s for s in marked if not (run / f"step-{s}" / ".metadata").exists()]
    assert uncommitted and not set(uncommitted) & set(c.committed_steps(0))
    # the next purge finishes the job
    from dcp_datastates.tiers.retention import purge_steps
    purge_steps(StorageTier(str(run)), ["step-1", "step-2", "step-3"])
    assert sorted(os.listdir(run)) == ["step-1", "step-4", "step-5"]
    assert not any(n == ".metadata" for n in os.listdir(run / "step-1"))
    for s in (4, 5):
        _assert_equal(_load(str(run / f"step-{s}"), _state(s)), _state(s))


def test_persistent_tier_receives_only_new_extents(tmp_path, s3):
    bucket = s3.make_bucket("incremental")
    c = Checkpointer([str(tmp_path / "nvme"), f"{bucket}/run"], storage_options=[None, s3.options()],
                     async_mode="thread", incremental=True, persist_every=2)
    _run_steps(c, range(1, 5))  # persisted: 1 and 3; step 3 builds on step 2 (not persisted)
    c.close()
    import s3fs
    fs = s3fs.S3FileSystem(**s3.options())

    def sizes(step):
        try:
            return {os.path.basename(x["name"]): x["size"] for x in fs.ls(f"{bucket}/run/step-{step}", detail=True)
                    if x["name"].endswith(".dsd")}
        except FileNotFoundError:
            return {}
    m1 = load_manifest(StorageTier(c.step_path(0, 1)))
    m3 = load_manifest(StorageTier(c.step_path(0, 3)))
    own3 = {n: s for n, s in m3.files.items() if n not in m3.homes}
    assert sizes(1) == {n: s for n, s in m1.files.items()}  # the full first save
    assert sizes(3) == own3  # step 3 sent only its own new bytes ...
    assert sum(own3.values()) < 0.1 * sum(m1.files.values())
    # ... plus the files of step 2 it references, which step 2 never persisted: they go to
    # step-2's directory there, without a manifest
    from_2 = {n for n, h in m3.homes.items() if h == "step-2"}
    assert set(sizes(2)) == from_2
    assert not fs.exists(f"{bucket}/run/step-2/.metadata")
    # the slow tier alone serves step 3 bit-exactly
    import shutil
    shutil.rmtree(tmp_path / "nvme")
    out = _like(_state(3))
    dcp.load(out, storage_reader=DataStatesReader(f"{bucket}/run/step-3", storage_options=s3.options()),
             no_dist=True)
    _assert_equal(out, _state(3))


def test_incremental_steps_load_on_other_world_sizes(tmp_path):
    base = str(tmp_path)
    run_ranks(2, workers.incremental_save, base)
    for world in (1, 3):
        run_ranks(world, workers.incremental_load, base)


def test_incremental_from_dcp_background_process(tmp_path):
    run_ranks(2, workers.incremental_process_mode, str(tmp_path))


def test_manifest_v1_still_loads(tmp_path):
    """Checkpoints written before incremental support (format v1) stay readable."""
    import msgpack
    import struct
    import xxhash
    from dcp_datastates.format.manifest import MAGIC, decode_manifest, encode_manifest
    d = tmp_path / "v1"
    _save(str(d), {"w": torch.arange(10.0)})
    raw = encode_manifest(decode_manifest(open(d / ".metadata", "rb").read()), version=2)[len(MAGIC):-8]
    body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    body["version"] = 1
    del body["homes"]
    x = body["tensors"]["w"]["chunks"][0]["x"]
    (f, off, n), = x[0]
    data = open(d / f, "rb").read()[off:off + n]
    body["tensors"]["w"]["chunks"][0]["x"] = [f, off, n, [xxhash.xxh3_64_intdigest(data)]]
    payload = msgpack.packb(body, use_bin_type=True)
    open(d / ".metadata", "wb").write(MAGIC + payload + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload)))
    assert torch.equal(_load(str(d), {"w": torch.zeros(10)})["w"], torch.arange(10.0))
    with open(d / f, "r+b") as fh:
        fh.seek(off)
        fh.write(b"\x01")
    with pytest.raises(BaseException, match="checksum"):
        _load(str(d), {"w": torch.zeros(10)})
    assert CheckpointError


def test_packed_tiny_tensors_round_trip_incrementally(tmp_path):
    """Tensors under 4 KiB are packed at 64-byte offsets, not one per 4 KiB slot; an incremental
    save that rewrites every third of them writes spans that start between pages (widened down
    to the page for O_DIRECT), and both checkpoints load exactly."""
    g = torch.Generator().manual_seed(4)
    sd = {f"t{i}": torch.randn(16, generator=g) for i in range(3000)}
    sd["big"] = torch.randn(1 << 18, generator=g)  # 1 MiB: stays page-aligned
    run = tmp_path / "run"
    dcp.save(sd, storage_writer=DataStatesWriter(str(run / "step-0")), no_dist=True)
    data = sum(p.stat().st_size for p in (run / "step-0").iterdir() if p.name.startswith("data-"))
    assert data < (1 << 20) + 3000 * 64 * 2, data  # 12 MB with a 4 KiB slot per tensor
    first = {k: v.clone() for k, v in sd.items()}
    for i in range(0, 3000, 3):
        sd[f"t{i}"].add_(1)
    dcp.save(sd, storage_writer=DataStatesWriter(str(run / "step-1"), incremental_base="step-0"),
             no_dist=True)
    for step, want in (("step-0", first), ("step-1", sd)):
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(out, storage_reader=DataStatesReader(str(run / step)), no_dist=True)
        bad = [k for k in want if not torch.equal(out[k], want[k])]
        assert not bad, (step, bad[:5])


@pytest.mark.parametrize("why", ["unknown-version", "unreadable"])
def test_retention_deletes_nothing_an_unreadable_manifest_could_use(tmp_path, why):
    """Issue 35, case 1: steps 1 to 3 incremental (step 3 references files of steps 1 and 2);
    a purge of steps 1 and 2 while step 3's manifest cannot be read (a format version this
    release does not know, as a newer release in the same run writes; or a read error) deletes
    nothing any manifest could reference, and says so once: step 3 loads exactly afterwards.
    Before, only step 3's own directory was kept and steps 1 and 2 were removed whole."""
    run = tmp_path / "run"
    c = Checkpointer([str(run)], async_mode=None, incremental=True)
    _run_steps(c, range(1, 4))
    c.close()
    meta = run / "step-3" / ".metadata"
    good = meta.read_bytes()
    if why == "unknown-version":
        def newer(body):
            body["version"] = 99
        rewrite_manifest(str(run / "step-3"), newer, version=3)
    else:
        meta.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # fails its checksum: unreadable
    from dcp_datastates.tiers.retention import purge_steps
    purge_steps(StorageTier(str(run)), ["step-1", "step-2"])
    meta.write_bytes(good)  # the manifest reads again (the newer release, or the disk, is back)
    _assert_equal(_load(str(run / "step-3"), _state(3)), _state(3))


def test_retention_never_purges_a_step_a_per_rank_save_is_writing(tmp_path):
    """Issue 35 (read-only finding): retention checked only the collective ``.claim``, not a
    per-rank save's ``.claim.rank-N``, so it could purge a step such a save was writing.  Here
    rank 0 of a per-rank save holds its live claim on step 2 while a purge drops steps 1 and 2:
    step 2 is left alone, committed and whole."""
    from dcp_datastates.format.names import rank_claim_name
    from dcp_datastates.tiers.claim import acquire
    from dcp_datastates.tiers.retention import purge_steps
    run = tmp_path / "run"
    for s in (1, 2, 3):
        _save(str(run / f"step-{s}"), _state(s))
    claim = acquire(StorageTier(str(run / "step-2")), rank_claim_name(0), "0123456789ab", busy=lambda: True)
    try:
        purge_steps(StorageTier(str(run)), ["step-1", "step-2"])
        assert (run / "step-2" / ".metadata").exists()
        _assert_equal(_load(str(run / "step-2"), _state(2)), _state(2))
    finally:
        claim.release()
    assert not (run / "step-1").exists()
