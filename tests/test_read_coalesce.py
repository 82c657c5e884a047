"""Small tensors are read in runs: one request per run of a file, not one per tensor
(issue 15), with every piece still verified and a damaged one still named or served by
another tier."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from torch.distributed.checkpoint.api import CheckpointException
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import load_manifest

N = 300


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    sd = {f"layers.{i // 6}.p{i % 6}": torch.randn(5 + i % 11, generator=g) for i in range(N)}
    sd["big"] = torch.randn(300_000, generator=g)  # between small ones in the files: not coalesced
    return sd


def _zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


class _CountingReads:
    """Wraps the storage interface (``StorageTier.read_into``) and counts requests per file."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, int]] = []
        real = StorageTier.read_into

        def counted(tier, name, offset, buf, **kw):
            self.calls.append((name, memoryview(buf).nbytes))
            return real(tier, name, offset, buf, **kw)

        monkeypatch.setattr(StorageTier, "read_into", counted)


def _small_seg(path: str, fqn: str):
    m = load_manifest(StorageTier(path))
    return m.tensors[fqn].chunks[0].extent.segs[0]


def test_small_tensors_from_an_object_store_take_one_request_per_run(tmp_path, s3, monkeypatch):
    bucket = s3.make_bucket("coalesce")
    url = f"{bucket}/run/step-1"
    sd = _state()
    dcp.save(sd, storage_writer=DataStatesWriter(url, storage_options=s3.options()), no_dist=True)
    reads = _CountingReads(monkeypatch)
    out = _zeros(sd)
    dcp.load(out, storage_reader=DataStatesReader(url, storage_options=s3.options()), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    files = {name for name, _n in reads.calls}
    small = [n for _name, n in reads.calls if n < (1 << 20)]
    # one request per run of small tensors in each file (a run stops at the big tensor), not 300
    assert 0 < len(small) <= 2 * len(files), reads.calls


def test_damaged_small_tensor_is_named(tmp_path):
    path = str(tmp_path / "ckpt")
    sd = _state()
    dcp.save(sd, storage_writer=DataStatesWriter(path), no_dist=True)
    seg = _small_seg(path, "layers.7.p3")
    f = os.path.join(path, seg.file)
    raw = bytearray(open(f, "rb").read())
    raw[seg.offset + 2] ^= 0xFF
    open(f, "wb").write(raw)
    with pytest.raises(CheckpointException) as e:  # DCP wraps our ChecksumMismatch
        dcp.load(_zeros(sd), storage_reader=DataStatesReader(path), no_dist=True)
    line = next(x for x in str(e.value).splitlines() if x.startswith("dcp_datastates.errors.ChecksumMismatch"))
    assert "checksum mismatch" in line and "tensor=layers.7.p3" in line and seg.file in line and path in line


def test_damaged_small_tensor_comes_from_the_next_tier(tmp_path):
    fast, slow = str(tmp_path / "nvme" / "step-1"), str(tmp_path / "pfs" / "step-1")
    sd = _state()
    w = DataStatesWriter(fast, persist_to=[slow])
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.wait_persisted(60)
    seg = _small_seg(fast, "layers.20.p1")
    f = os.path.join(fast, seg.file)
    raw = bytearray(open(f, "rb").read())
    raw[seg.offset] ^= 0xFF
    open(f, "wb").write(raw)
    out = _zeros(sd)
    r = DataStatesReader(fast, fallback=slow)
    dcp.load(out, storage_reader=r, no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert 0 < r.served.get(slow, 0) < 4096  # only the damaged piece came from the slow tier
    assert r.served.get(fast, 0) > 1 << 20  # the rest from the fast one
