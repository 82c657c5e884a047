"""Multi-level flush: per-tier commit, tier-aware restore with fallbacks, retention, S3."""

import os
import shutil
import time

import msgpack
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.names import PERSISTED_RECORD, TEMP_INFIX
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import load_manifest
from tests import workers
from tests.dist import run_ranks


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(3 << 20, generator=g),  # 12 MiB: multipart on S3 (5 MiB parts)
            "bf": torch.randn(300, 70, generator=g).bfloat16(), "meta": {"step": seed, "tag": "x"}}


def _zeros(sd):
    return {"big": torch.zeros_like(sd["big"]), "bf": torch.zeros_like(sd["bf"]), "meta": {"step": -1, "tag": ""}}


def _equal(a, b):
    return torch.equal(a["big"], b["big"]) and torch.equal(a["bf"], b["bf"]) and a["meta"] == b["meta"]


def test_three_tiers_commit_on_every_tier_and_each_loads_alone(tmp_path, s3):
    bucket = s3.make_bucket("three-tier")
    t1, t2, t3 = str(tmp_path / "nvme/step-1"), str(tmp_path / "pfs/step-1"), f"{bucket}/run/step-1"
    sd = _state(1)
    w = DataStatesWriter(t1, persist_to=[t2, t3], persist_options=s3.options())
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.wait_persisted(60)
    for path, opts in ((t1, None), (t2, None), (t3, s3.options())):
        out = _zeros(sd)
        dcp.load(out, storage_reader=DataStatesReader(path, storage_options=opts), no_dist=True)
        assert _equal(out, sd), path
    import s3fs
    fs = s3fs.S3FileSystem(**s3.options())
    names = fs.ls(t3, detail=True)
    data = [n for n in names if n["name"].endswith(".dsd")]
    assert data and all("-" in n["ETag"] for n in data if n["size"] > (5 << 20))  # multipart ETags
    assert not [n for n in names if ".uploaded." in n["name"]]  # markers cleaned after commit
    assert open(os.path.join(t1, ".persisted"), "rb").read()  # index of committed tiers


def _ckpt(tmp_path, **kw):
    return Checkpointer([str(tmp_path / "nvme"), str(tmp_path / "pfs")], async_mode=None, **kw)


def _load(c):
    out = _zeros(_state())
    step = c.load(out)
    return step, out, c.last_restore


def test_restore_prefers_fast_tier(tmp_path):
    c = _ckpt(tmp_path)
    c.save(1, _state(1))
    c.wait_persisted(60)
    step, out, info = _load(c)
    assert step == 1 and _equal(out, _state(1))
    assert list(info["served"]) == [c.step_path(0, 1)] and info["manifest_tier"] == c.step_path(0, 1)


def test_fallback_when_fast_copy_deleted(tmp_path):
    c = _ckpt(tmp_path)
    c.save(1, _state(1))
    c.wait_persisted(60)
    shutil.rmtree(c.step_path(0, 1))
    step, out, info = _load(c)
    assert step == 1 and _equal(out, _state(1)) and info["manifest_tier"] == c.step_path(1, 1)


def test_fallback_when_fast_copy_corrupt(tmp_path):
    c = _ckpt(tmp_path)
    c.save(1, _state(1))
    c.wait_persisted(60)
    d = c.step_path(0, 1)
    m = load_manifest(StorageTier(d))
    seg = max((c.extent.segs[0] for e in m.tensors.values() for c in e.chunks), key=lambda s: s.nbytes)
    f = os.path.join(d, seg.file)
    raw = bytearray(open(f, "rb").read())
    raw[seg.offset + 100] ^= 0xFF  # a byte of tensor data
    open(f, "wb").write(raw)
    step, out, info = _load(c)
    assert step == 1 and _equal(out, _state(1))
    assert info["served"].get(c.step_path(1, 1), 0) > 0  # the damaged range came from the slow tier


def test_a_run_whose_every_step_fails_to_load_raises_rather_than_start_afresh(tmp_path):
    """``load`` returning None means "nothing to restore": the trainer starts from scratch and
    its next saves and retention replace the run.  Committed steps that all fail to load (here
    a state of another shape; a damaged step has an older one to fall back to) raise, naming
    the steps tried and why the newest failed."""
    c = Checkpointer([str(tmp_path / "run")], async_mode=None)
    for step in (1, 2):
        c.save(step, {"w": torch.randn(64)})
    with pytest.raises(CheckpointError, match=r"none of the committed steps \[2, 1\] .*could be restored.*step 2") as e:
        c.load({"w": torch.zeros(32)})
    assert "\n" not in str(e.value)
    out = {"w": torch.zeros(64)}
    assert c.load(out, step=1) == 1  # the run is still there
    c.close()


def test_fallback_when_fast_copy_partial(tmp_path):
    c = _ckpt(tmp_path)
    c.save(1, _state(1))
    c.wait_persisted(60)
    os.remove(os.path.join(c.step_path(0, 1), ".metadata"))  # as if the commit never happened
    step, out, info = _load(c)
    assert step == 1 and _equal(out, _state(1)) and info["manifest_tier"] == c.step_path(1, 1)


def test_mixed_node_local_copies_restart_with_fewer_ranks(tmp_path):
    base = str(tmp_path)
    run_ranks(2, workers.tiered_save_node_local, base)
    assert sorted(os.listdir(os.path.join(base, "node1", "step-5")))  # node 1 has its own copy
    m = load_manifest(StorageTier(os.path.join(base, "node0", "step-5")))
    r = next(i for i, t in enumerate(m.index.tensors) if t.fqn == "r")
    g = m.index.geom(r)  # written by rank 1 (the rule's writer), its record held in the index
    assert m.index.held.has(r) and m.index.held.chunk.tolist() == [0] and g.owner(0) == 1
    shutil.rmtree(os.path.join(base, "node1"))  # node 1 is gone
    run_ranks(1, workers.tiered_restore_node_local, base)


def test_retention_keeps_last_durable_and_ignores_inflight(tmp_path):
    c = Checkpointer([str(tmp_path / "nvme"), str(tmp_path / "pfs")], keep=[1, 2],
                     persist_every=2, async_mode=None)
    for step in range(1, 7):  # persisted: 1, 3, 5
        c.save(step, _state(step))
        c.wait_persisted(60)
    assert c.committed_steps(1) == [3, 5]
    # tier 1 keeps its newest (6) and the newest durable step (5), never only an unpersisted one
    assert c.committed_steps(0) == [5, 6]
    # a crashed save (data, no manifest) is never latest
    os.makedirs(c.step_path(0, 9))
    open(os.path.join(c.step_path(0, 9), "data-r00000-000000000000-00.dsd"), "wb").write(b"x")
    assert c.latest_step() == 6
    # an in-flight async save is not latest either, and is not counted by retention
    ca = Checkpointer([str(tmp_path / "nvme"), str(tmp_path / "pfs")], keep=[1, 2], async_mode="thread")
    ca.save(7, _state(7))
    assert ca.latest_step() == 6 or ca._inflight is None
    ca.wait_persisted(60)
    assert ca.latest_step() == 9 - 2  # step 7 now committed; the crashed step-9 still ignored
    step, out, _ = _load(ca)
    assert step == 7 and _equal(out, _state(7))


def test_stale_node_local_copy_of_another_save_is_never_mixed_in(tmp_path):
    """A requeued job rolled back and saved step 5 again; a node it ran on before still holds
    its old step 5 (another save). Ranks on that node must not restore it beside the others."""
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    run_ranks(2, workers.save_attempt, old, 1)
    run_ranks(2, workers.save_attempt, new, 2)
    shutil.rmtree(os.path.join(new, "node1", "step-5"))
    shutil.copytree(os.path.join(old, "node1", "step-5"), os.path.join(new, "node1", "step-5"))
    run_ranks(2, workers.load_never_mixed, new, 2)
    run_ranks(2, workers.load_plain_reader_refuses_mix, new)


def test_persisted_record_survives_the_fast_tiers_own_tidy(tmp_path, monkeypatch):
    """The fast tier's ``.persisted`` record is written after the slower tier commits; the
    fast tier's tidy (after its own commit) removes the save's own leftover temporary files.
    The two must not overlap: here the fast tier's listings are slow and the record's temporary
    file lingers before its rename, so a tidy still running when the slower tier commits would
    take the record's temporary file away (the save then reported its persist as failed,
    though the slower tier had committed)."""
    t1, t2 = str(tmp_path / "nvme/step-1"), str(tmp_path / "pfs/step-1")
    listdir, commit_bytes = StorageTier.listdir, StorageTier.commit_bytes

    def slow_listdir(self):
        if self.url.rstrip("/") == t1:
            time.sleep(0.3)
        return listdir(self)

    def lingering_commit(self, name, data, *, sync=True):
        if name == PERSISTED_RECORD:  # the temporary file, durable, then the rename a while later
            tmp = self.path(f"{name}{TEMP_INFIX}linger")
            with open(tmp, "wb") as f:
                f.write(data)
            time.sleep(1.0)
            os.replace(tmp, self.path(name))
            return None
        return commit_bytes(self, name, data, sync=sync)
    monkeypatch.setattr(StorageTier, "listdir", slow_listdir)
    monkeypatch.setattr(StorageTier, "commit_bytes", lingering_commit)
    sd = _state(1)
    w = DataStatesWriter(t1, persist_to=[t2])
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.wait_persisted(60)
    assert msgpack.unpackb(open(os.path.join(t1, PERSISTED_RECORD), "rb").read()) == [t2]
    assert not [n for n in os.listdir(t1) if TEMP_INFIX in n]


def test_a_lost_persisted_record_does_not_fail_a_committed_flush(tmp_path, monkeypatch, caplog):
    """``.persisted`` only tells ``inspect`` which slower tiers committed; when it cannot be
    written (the fast tier's step purged meanwhile, a full disk) the slower tier's commit
    still counts, and the log says what was lost."""
    t1, t2 = str(tmp_path / "nvme/step-1"), str(tmp_path / "pfs/step-1")
    commit_bytes = StorageTier.commit_bytes

    def failing(self, name, data, *, sync=True):
        if name == PERSISTED_RECORD:
            raise OSError(28, "No space left on device")
        return commit_bytes(self, name, data, sync=sync)
    monkeypatch.setattr(StorageTier, "commit_bytes", failing)
    sd = _state(2)
    w = DataStatesWriter(t1, persist_to=[t2])
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.wait_persisted(60)
    assert any("could not say so" in r.getMessage() for r in caplog.records)
    out = _zeros(sd)
    dcp.load(out, storage_reader=DataStatesReader(t2), no_dist=True)
    assert _equal(out, sd)


@pytest.mark.parametrize("race", ["uncommitted", "removed"])
def test_a_step_uncommitted_while_the_run_is_scanned_holds_no_references(tmp_path, monkeypatch, race):
    """Retention uncommits step 1 between a tidy's listing of it (its manifest there) and the
    manifest's read, or removes the directory right after the run's listing: the scan must
    find it gone, not call the run unreadable or unlistable (which keeps every superseded
    file of the save that tidies: a leftover)."""
    from dcp_datastates.format.names import MANIFEST_NAME
    from dcp_datastates.tiers.local import LocalBackend
    from dcp_datastates.tiers.tidy import run_references
    run = tmp_path / "run"
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=DataStatesWriter(str(run / f"step-{step}")), no_dist=True)
    step1 = str(run / "step-1")
    seen = []
    orig = LocalBackend.listdir

    def listdir(self, root):
        if root == step1 and race == "removed":
            shutil.rmtree(root)
        names = orig(self, root)
        if root == step1:
            seen.append(names)
            if len(seen) == 1 and race == "uncommitted":  # retention uncommits it right after
                os.remove(os.path.join(root, MANIFEST_NAME))
        return names
    monkeypatch.setattr(LocalBackend, "listdir", listdir)
    refs = run_references(StorageTier(str(run)))
    assert "*" not in refs.get("step-2", set()), refs
    assert not refs.get("step-1"), refs
    assert refs.get("step-2"), refs  # step 2's own files are still referenced


def _slow_tier_requests(rank, world, base):
    """Rank ``rank``'s requests to the slow tier in one retention pass of a node-local run
    that keeps every step there (``keep=[1, 0]``), after six persisted steps."""
    import json

    import torch.distributed as dist
    c = Checkpointer([os.path.join(base, f"node{rank}"), os.path.join(base, "pfs")], node_local=True,
                     keep=[1, 0], async_mode=None, host_cache_bytes=8 << 20)
    for step in range(1, 7):
        c.save(step, {"w": torch.full((256,), float(10 * step + rank)), "step": step})
        c.wait_persisted(120)
    c.close()
    dist.barrier()
    pfs, asked = os.path.join(base, "pfs"), []
    real = {n: getattr(StorageTier, n) for n in ("listdir", "entries", "read_into", "read_bytes", "exists")}

    def counted(name):
        def call(self, *a, **kw):
            if self.url.startswith(pfs):
                asked.append(f"{name} {os.path.relpath(self.url, pfs)} {a[:1]}")
            return real[name](self, *a, **kw)
        return call
    for n in real:
        setattr(StorageTier, n, counted(n))
    c.retention.run()
    for n, f in real.items():
        setattr(StorageTier, n, f)
    assert c.committed_steps(0) == [6] and c.committed_steps(1) == [1, 2, 3, 4, 5, 6]
    with open(os.path.join(base, f"asked-{rank}.json"), "w") as f:
        json.dump(asked, f)
    dist.barrier()


def test_a_node_local_pass_asks_the_slow_tier_about_its_own_steps_only(tmp_path):
    """A rank purging only its node's directory needs the newest durable step among the steps
    it holds there, not every step the slow tier keeps: at a thousand ranks, each listing the
    shared run and reading each step's manifest at every pass, a PFS's metadata server (or an
    object store's request budget) pays for it.  Its requests must not grow with the run."""
    import json
    run_ranks(2, _slow_tier_requests, str(tmp_path))
    for rank in (0, 1):
        asked = json.load(open(tmp_path / f"asked-{rank}.json"))
        assert len(asked) <= 3, asked  # the newest local step's manifest there, not six steps'
