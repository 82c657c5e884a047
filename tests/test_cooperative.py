"""Cooperative loads (issue 37): each stored block a job needs is read from storage once and
sent to the other ranks that need it, over the process group.

Every test loads through plain ``dcp.load`` with DCP's default planner.  The bytes read from
storage are counted by wrapping the storage interface in the rank processes: our reader's
ranged reads (``loading.files.read_range`` and ``StorageTier.read_into``) and, for DCP's
``FileSystemReader``, the streams its ``FileSystem`` opens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_datastates import DataStatesReader, DataStatesWriter
from tests.dist import run_ranks
from tests.disk import flip_byte as _flip

# ---------------------------------------------------------------- counting storage reads


class _Counted:
    n = 0


def _count_ours() -> None:
    """Count every byte our reader reads from storage (local ranged reads and tier reads)."""
    from dcp_datastates.load import files
    from dcp_datastates.tiers import StorageTier
    real_range, real_into = files.read_range, StorageTier.read_into

    def read_range(*a, **k):
        got, direct = real_range(*a, **k)
        _Counted.n += got
        return got, direct

    def read_into(self, name, *a, **k):
        got = real_into(self, name, *a, **k)
        if name.startswith("data-"):  # not the manifest or parts: data files only, as for DCP below
            _Counted.n += got
        return got
    files.read_range = read_range
    StorageTier.read_into = read_into


class _CountingStream:
    def __init__(self, f) -> None:
        self._f = f

    def read(self, n=-1):
        b = self._f.read(n)
        _Counted.n += len(b)
        return b

    def readinto(self, b):
        got = self._f.readinto(b)
        _Counted.n += got or 0
        return got

    def __getattr__(self, name):
        return getattr(self._f, name)


class _CountingFS(FileSystem):
    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as f:
            yield _CountingStream(f)


def _dcp_reader(path: str) -> FileSystemReader:
    r = FileSystemReader(path)
    r.fs = _CountingFS()
    return r


def _stored_tensor_bytes(path: str) -> int:
    """What the checkpoint stores of its tensors: every block a whole-state load needs."""
    from dcp_datastates.tiers import StorageTier
    from dcp_datastates.tiers.manifests import load_manifest
    m = load_manifest(StorageTier(path))
    return sum(c.extent.nbytes for e in m.tensors.values() for c in e.chunks if c.extent is not None)


def _stored_tensor_bytes_of(path: str, fqn: str) -> int:
    from dcp_datastates.tiers import StorageTier
    from dcp_datastates.tiers.manifests import load_manifest
    m = load_manifest(StorageTier(path))
    return sum(c.extent.nbytes for k, e in m.tensors.items() if k.endswith(fqn) for c in e.chunks
               if c.extent is not None)


def _total(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _same(a, b) -> None:
    for k, v in a.items():
        if isinstance(v, dict):
            _same(v, b[k])
        elif isinstance(v, torch.Tensor):
            x = v.to_local() if isinstance(v, DTensor) else v
            y = b[k].to_local() if isinstance(b[k], DTensor) else b[k]
            assert torch.equal(x, y), k
        else:
            assert v == b[k], k


# ------------------------------------------------------------------------ HSDP, R = 2


def _model(mesh):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 512), nn.Linear(512, 64))
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _hsdp(rank, world, base):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model(mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    want = {"model": {k: v.detach().clone() for k, v in msd.items()},
            "optim": {k: {n: (x.detach().clone() if isinstance(x, torch.Tensor) else x) for n, x in s.items()}
                      for k, s in osd["state"].items()}}
    ours, theirs = os.path.join(base, "ours"), os.path.join(base, "dcp")
    dcp.save({"model": msd, "optim": osd}, storage_writer=DataStatesWriter(ours))
    dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(theirs))
    _count_ours()
    counts = {}
    for name, reader in (("coop", lambda: DataStatesReader(ours)),
                         ("solo", lambda: DataStatesReader(ours, cooperative=False)),
                         ("dcp", lambda: _dcp_reader(theirs))):
        fresh = _model(mesh)
        fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        fresh(torch.randn(8, 64)).sum().backward()
        fopt.step()  # state to load into
        m2, o2 = get_state_dict(fresh, fopt)
        for v in m2.values():
            v.to_local().zero_()
        sd = {"model": m2, "optim": o2}
        _Counted.n = 0
        r = reader()
        dcp.load(sd, storage_reader=r)
        counts[name] = _total(_Counted.n)
        _same(want["model"], sd["model"])
        _same(want["optim"], {k: v for k, v in sd["optim"]["state"].items()})
        if name == "coop":
            sent, got = _total(r.stats.bytes_sent), _total(r.stats.bytes_received)
            assert sent == got > 0, (sent, got)
    need = _stored_tensor_bytes(ours)
    # every stored block read once by the job, against twice (R = 2 replica groups) by DCP's reader
    assert counts["coop"] == need, (counts, need)
    assert counts["solo"] >= 2 * need, (counts, need)
    assert counts["dcp"] >= 2 * need, (counts, need)


def test_hsdp_2x2_reads_every_stored_block_once(tmp_path):
    run_ranks(4, _hsdp, str(tmp_path))


# ----------------------------------------- replicated tensors, resharded loads 4 -> 2, 2 -> 3


def _state(mesh, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = {"w": torch.randn(1000, 300, generator=g), "v": torch.randn(777, 5, generator=g),
            "norm": torch.randn(300, generator=g), "bias": torch.randn(4, 513, generator=g),
            "emb": torch.randn(3 << 18, generator=g), "step": torch.tensor(7)}
    placed = {"w": [Shard(0)], "v": [Shard(0)], "norm": [Replicate()], "bias": [Replicate()],
              "emb": [Replicate()], "step": None}
    return full, {k: v if placed[k] is None else distribute_tensor(v, mesh, placed[k]) for k, v in full.items()}


def _exact(out: dict, full: dict) -> None:
    assert out["epoch"] == 3
    for k, v in out["s"].items():
        got = v.full_tensor() if isinstance(v, DTensor) else v
        assert torch.equal(got, full[k]), k


def _save(rank, world, path):
    mesh = init_device_mesh("cpu", (world,))
    _full, sd = _state(mesh)
    dcp.save({"s": sd, "epoch": 3}, storage_writer=DataStatesWriter(path))


def _save_both(rank, world, path):
    mesh = init_device_mesh("cpu", (world,))
    _full, sd = _state(mesh)
    dcp.save({"s": sd, "epoch": 3}, storage_writer=DataStatesWriter(path))
    dcp.save({"s": sd, "epoch": 3}, storage_writer=FileSystemWriter(path + "-dcp"))


def _load_resharded(rank, world, path):
    mesh = init_device_mesh("cpu", (world,))
    full, _ = _state(mesh)
    _count_ours()
    counts = {}
    for name, reader in (("coop", lambda: DataStatesReader(path)),
                         ("solo", lambda: DataStatesReader(path, cooperative=False)),
                         ("dcp", lambda: _dcp_reader(path + "-dcp"))):
        _z, sd = _state(mesh, seed=1)
        out = {"s": sd, "epoch": 0}
        _Counted.n = 0
        dcp.load(out, storage_reader=reader())
        counts[name] = _total(_Counted.n)
        _exact(out, full)
    need = _stored_tensor_bytes(path)
    assert counts["coop"] == need, (counts, need)
    # the replicated tensors once per rank (and, ours alone, boundary blocks again per rank)
    replicated = sum(_stored_tensor_bytes_of(path, k) for k in ("norm", "bias", "emb", "step"))
    assert counts["solo"] >= need + (world - 1) * replicated, (counts, need, replicated)
    assert counts["dcp"] >= need + (world - 1) * replicated, (counts, need, replicated)


@pytest.mark.parametrize("saved,loaded", [(4, 2), (2, 3)])
def test_resharded_loads_read_every_needed_block_once(tmp_path, saved, loaded):
    path = str(tmp_path / "ck")
    run_ranks(saved, _save_both, path)
    run_ranks(loaded, _load_resharded, path)


# ------------------------------------------------------------------------- faults


def _node_copies(base: str, world: int) -> None:
    src = os.path.join(base, "ck")
    for n in range(world):
        shutil.copytree(src, os.path.join(base, f"node{n}"))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _corrupt_owner(rank, world, base):
    """Rank 1's copy of every data file is damaged and it reads without checking
    (``verify=False``): what it sends fails rank 0's check, which reads those blocks from its
    own copy and loads exactly."""
    mesh = init_device_mesh("cpu", (world,))
    _full, shards = _state(mesh)
    lines = _Lines()
    logging.getLogger("dcp_datastates").addHandler(lines)
    mine = os.path.join(base, f"node{rank}")
    _z, sd = _state(mesh, seed=1)
    out = {"s": sd, "epoch": 0}
    dcp.load(out, storage_reader=DataStatesReader(mine, verify=rank != 1))
    if rank == 0:
        _same_local(out["s"], shards)  # its own shards (rank 1's came from its damaged copy)
        assert any("does not match its digest; reading it from storage" in x for x in lines.lines), lines.lines


def _same_local(got: dict, want: dict) -> None:
    """This rank's shards of ``got`` equal those of ``want``."""
    for k, v in got.items():
        w = want[k]
        assert torch.equal(v.to_local() if isinstance(v, DTensor) else v,
                           w.to_local() if isinstance(w, DTensor) else w), k


def _damaged_node1(base: str, damage) -> None:
    """A checkpoint saved by 2 ranks, copied to node0/ and node1/; ``damage`` applied to each
    data file of node1's copy."""
    run_ranks(2, _save, os.path.join(base, "ck"))
    _node_copies(base, 2)
    node1 = os.path.join(base, "node1")
    for name in os.listdir(node1):
        if name.startswith("data-"):
            damage(os.path.join(node1, name))


def test_a_corrupted_block_from_an_owner_is_read_from_storage(tmp_path):
    def rot(path: str) -> None:
        for off in range(0, os.path.getsize(path), 1 << 16):
            _flip(path, off)
    _damaged_node1(str(tmp_path), rot)
    run_ranks(2, _corrupt_owner, str(tmp_path))


def _failing_owner(rank, world, base):
    """Rank 1's copy lacks its data files.  With a slower tier it reads them there (logged) and
    the load completes; without one it cannot read its blocks: it tells rank 0, waiting for the
    shared blocks it owns (with six shared blocks, two arbiters and owners balanced by bytes,
    it owns at least one), which reads them itself, and the load fails on rank 1 only, naming
    the file, with no rank left waiting."""
    mesh = init_device_mesh("cpu", (world,))
    full, shards = _state(mesh)
    lines = _Lines()
    logging.getLogger("dcp_datastates").addHandler(lines)
    mine = os.path.join(base, f"node{rank}")
    _z, sd = _state(mesh, seed=1)
    out = {"s": sd, "epoch": 0}
    dcp.load(out, storage_reader=DataStatesReader(mine, fallback=[os.path.join(base, "ck")]))
    _exact(out, full)
    if rank == 1:
        assert any("reading this file from" in x for x in lines.lines), lines.lines
    _z, sd = _state(mesh, seed=1)
    out = {"s": sd, "epoch": 0}
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
        dcp.load(out, storage_reader=DataStatesReader(mine))
    assert "data file is missing" in str(e.value), str(e.value)
    if rank == 0:  # every block rank 1 owed it was read here instead
        _same_local(out["s"], shards)
        assert any("could not read; reading them here" in x for x in lines.lines), lines.lines


def test_an_owner_that_cannot_read_falls_back_or_fails_alone(tmp_path):
    _damaged_node1(str(tmp_path), os.remove)
    run_ranks(2, _failing_owner, str(tmp_path))


def _peer_killed(rank, world, base):
    """Rank 1 dies as its first read ends, before sending anything: rank 0's load fails within
    the group's timeout with an error naming the exchange, and no tensor of rank 0's state is
    left half-written: each holds the checkpoint's values (read from storage once the peer was
    gone) or its own, untouched."""
    import datetime

    from dcp_datastates.load import cooperative
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    if rank == 1:
        def die(self, *a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        cooperative.Cooperation.ready = die  # as its first read ends, before it sends
    mesh = init_device_mesh("cpu", (world,))
    _full, want = _state(mesh)
    _z, sd = _state(mesh, seed=1)
    before = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in sd.items()}
    lines = _Lines()
    logging.getLogger("dcp_datastates").addHandler(lines)
    t = time.monotonic()
    with pytest.raises(BaseException) as e:  # ours, or DCP's gather meeting the dead rank first
        dcp.load({"s": sd, "epoch": 0}, storage_reader=DataStatesReader(os.path.join(base, "ck"),
                                                                         process_group=group))
    assert time.monotonic() - t < 60, repr(e.value)
    assert any("cooperative load: exchanging" in x and "failed" in x for x in lines.lines), lines.lines
    for k, v in sd.items():
        got = v.to_local() if isinstance(v, DTensor) else v
        w = want[k].to_local() if isinstance(want[k], DTensor) else want[k]
        assert torch.equal(got, w) or torch.equal(got, before[k]), k
    os._exit(0)  # the group lost rank 1: skip the teardown collectives


def test_a_killed_peer_fails_the_load_within_the_timeout(tmp_path):
    base = str(tmp_path)
    run_ranks(2, _save, os.path.join(base, "ck"))
    with pytest.raises(AssertionError, match=r"exited with codes \[-9\]"):
        run_ranks(2, _peer_killed, base, timeout=120)


def _checkpointer_peer_killed(rank, world, base):
    """``Checkpointer.load`` whose peer dies in the exchange raises the library's one-line
    ``PeerLoadError`` (not the process group's error from DCP's collective after the reads),
    without trying an older step over a group that lost a rank."""
    import datetime

    from dcp_datastates import Checkpointer
    from dcp_datastates.errors import PeerLoadError
    from dcp_datastates.load import cooperative
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (world,))
    _full, sd = _state(mesh)
    ckpt = Checkpointer([base], process_group=group, async_mode=None)
    ckpt.save(1, {"s": sd, "epoch": 1})
    ckpt.save(2, {"s": sd, "epoch": 2})
    if rank == 1:
        def die(self, *a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        cooperative.Cooperation.ready = die
    t = time.monotonic()
    with pytest.raises(PeerLoadError) as e:
        ckpt.load({"s": _state(mesh, seed=1)[1], "epoch": 0})
    assert time.monotonic() - t < 60
    assert "\n" not in str(e.value) and "cooperative load" in str(e.value), str(e.value)
    os._exit(0)  # the group lost rank 1: skip the teardown collectives


def test_a_checkpointer_load_whose_peer_dies_raises_the_librarys_error(tmp_path):
    with pytest.raises(AssertionError, match=r"exited with codes \[-9\]"):
        run_ranks(2, _checkpointer_peer_killed, str(tmp_path), timeout=120)


def _checkpointer(rank, world, base):
    """``Checkpointer.load`` loads cooperatively over its process group: every stored block
    read once by the job."""
    from dcp_datastates import Checkpointer
    mesh = init_device_mesh("cpu", (world,))
    full, sd = _state(mesh)
    ckpt = Checkpointer([base], process_group=dist.new_group(backend="gloo"), async_mode=None)
    ckpt.save(1, {"s": sd, "epoch": 3})
    ckpt.wait()
    _count_ours()
    _z, fresh = _state(mesh, seed=1)
    out = {"s": fresh, "epoch": 0}
    _Counted.n = 0
    assert ckpt.load(out) == 1
    _exact(out, full)
    need, got = _stored_tensor_bytes(os.path.join(base, "step-1")), _total(_Counted.n)
    assert got == need, (got, need)
    ckpt.close()


def test_checkpointer_loads_cooperatively(tmp_path):
    run_ranks(2, _checkpointer, str(tmp_path))


def _owner_bug(rank, world, base):
    """An unexpected error in one owner's reads (not a storage error: a bug, say) still lets
    its peer finish: the owner tells it which blocks it could not send, then raises its own
    error; the peer reads those blocks itself and no rank waits out a timeout."""
    import datetime

    from dcp_datastates.load import files
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    if rank == 1:
        def read_range(*a, **k):
            raise ValueError("injected: a bug in the read path")
        files.read_range = read_range
    mesh = init_device_mesh("cpu", (world,))
    _full, shards = _state(mesh)
    _z, sd = _state(mesh, seed=1)
    out = {"s": sd, "epoch": 0}
    t = time.monotonic()
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException names rank 1's error
        dcp.load(out, storage_reader=DataStatesReader(os.path.join(base, "ck"), process_group=group))
    assert time.monotonic() - t < 30, time.monotonic() - t
    assert "injected: a bug in the read path" in str(e.value), str(e.value)
    if rank == 0:
        _same_local(out["s"], shards)


def test_an_owner_that_hits_a_bug_does_not_leave_its_peer_waiting(tmp_path):
    run_ranks(2, _save, str(tmp_path / "ck"))
    run_ranks(2, _owner_bug, str(tmp_path))
