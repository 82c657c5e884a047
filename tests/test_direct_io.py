"""Cold reads through O_DIRECT and a huge-page staging buffer (tiers/direct_io.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.disk import drop_cache as _drop_cache
from tests.disk import o_direct_works as _o_direct_works
from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.tiers.manifests import load_manifest
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.direct_io import StagingBuffer, cached_bytes, dio_alignment, read_range

MiB = 1 << 20




@pytest.fixture
def direct_dir(tmp_path):
    if not _o_direct_works(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    return tmp_path




def _at_phase(t: torch.Tensor, phase: int) -> torch.Tensor:
    """An uninitialised tensor like ``t`` whose data starts ``phase`` bytes into a page."""
    raw = torch.empty(t.nbytes + 4096, dtype=torch.uint8)
    shift = (phase - raw.data_ptr()) % 4096
    return raw[shift:shift + t.nbytes].view(t.dtype).view(t.shape)


def _state():
    g = torch.Generator().manual_seed(5)
    return {"emb": torch.randn(4096, 1024, generator=g),  # 16 MiB: one full read piece
            "w": torch.randn(1536, 1024, generator=g).bfloat16(),  # 3 MiB
            "odd": torch.randn(777_777, generator=g),  # not a whole number of blocks
            "small": [torch.randn(50, generator=g) for _ in range(20)],
            "step": 7}


def _fresh(sd, phase=None):
    out = {}
    for k, v in sd.items():
        if isinstance(v, list):
            out[k] = [torch.empty_like(x) for x in v]
        elif isinstance(v, torch.Tensor):
            out[k] = torch.empty_like(v) if phase is None else _at_phase(v, phase)
        else:
            out[k] = 0
    return out


def _equal(a, b):
    for k in b:
        if isinstance(b[k], list):
            assert all(torch.equal(x, y) for x, y in zip(a[k], b[k])), k
        elif isinstance(b[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture
def saved(direct_dir):
    sd = _state()
    path = str(direct_dir / "ckpt")
    dcp.save(sd, storage_writer=DataStatesWriter(path), no_dist=True)
    _drop_cache(path)
    return sd, path


@pytest.mark.parametrize("phase", [None, 0, 64, 100 * 4 + 4, 4032])
def test_cold_load_reads_with_o_direct_whatever_the_destination(saved, phase):
    sd, path = saved
    out = _fresh(sd, phase)
    r = DataStatesReader(path, o_direct=True)
    dcp.load(out, storage_reader=r, no_dist=True)
    _equal(out, sd)
    big = sd["emb"].nbytes + sd["w"].nbytes + sd["odd"].nbytes
    # the three large tensors go direct (block-widened ranges: slightly more than their bytes);
    # the 20 small ones are read buffered
    assert big <= r.bytes_direct <= big + 3 * MiB, (r.bytes_direct, big)
    assert r.bytes_direct < r.bytes_read


def test_buffered_when_disabled_or_cached(saved):
    sd, path = saved
    out = _fresh(sd)
    r = DataStatesReader(path, o_direct=False)
    dcp.load(out, storage_reader=r, no_dist=True)
    _equal(out, sd)
    assert r.bytes_direct == 0 and r.bytes_read > 0

    m = load_manifest(StorageTier(path))
    fd = os.open(os.path.join(path, m.tensors["emb"].chunks[0].extent.file), os.O_RDONLY)
    try:
        while os.read(fd, 8 * MiB):  # the file is now in the page cache
            pass
        if cached_bytes(fd, 0, os.fstat(fd).st_size) is None:
            pytest.skip("this kernel has no cachestat (Linux < 6.5)")
    finally:
        os.close(fd)
    out = _fresh(sd)
    r = DataStatesReader(path, o_direct=True)
    dcp.load(out, storage_reader=r, no_dist=True)
    _equal(out, sd)
    assert r.bytes_direct == 0  # served from memory, not the device


def test_resharded_box_reads_direct(direct_dir):
    big = torch.randn(2048, 2048)  # 16 MiB
    path = str(direct_dir / "c")
    dcp.save({"t": big}, storage_writer=DataStatesWriter(path), no_dist=True)
    _drop_cache(path)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
    dest = torch.empty(1024, 1024)  # rows 512..1535, columns 1024..2047

    class P(DefaultLoadPlanner):
        def resolve_tensor(self, ri):
            return dest
    p = P()
    p.state_dict = {}
    r = DataStatesReader(path, o_direct=True)
    r.set_up_storage_reader(r.read_metadata(), True)
    ri = ReadItem(LoadItemType.TENSOR, MetadataIndex("t", (0, 0)), torch.Size((0, 0)),
                  MetadataIndex("t", (0, 0)), torch.Size((512, 1024)), torch.Size((1024, 1024)))
    r.read_data(LoadPlan([ri]), p).wait()
    assert torch.equal(dest, big[512:1536, 1024:])
    assert r.bytes_direct == r.bytes_read == 8 * MiB  # only the rows it needs, all direct


def test_damage_is_caught_on_the_direct_path(direct_dir):
    sd = {"emb": torch.randn(2048, 1024)}  # 8 MiB
    path = str(direct_dir / "c")
    dcp.save(sd, storage_writer=DataStatesWriter(path), no_dist=True)
    seg = load_manifest(StorageTier(path)).tensors["emb"].chunks[0].extent.segs[0]
    f = os.path.join(path, seg.file)
    with open(f, "r+b") as fh:
        fh.seek(seg.offset + 5 * MiB + 123)
        b = fh.read(1)
        fh.seek(seg.offset + 5 * MiB + 123)
        fh.write(bytes([b[0] ^ 0x40]))
    _drop_cache(path)
    r = DataStatesReader(path, o_direct=True)
    with pytest.raises(CheckpointException) as e:  # DCP wraps our ChecksumMismatch
        dcp.load({"emb": torch.empty_like(sd["emb"])}, storage_reader=r, no_dist=True)
    msg = str(e.value)
    assert "checksum mismatch in block 5" in msg and seg.file in msg and "emb" in msg and path in msg
    assert r.bytes_direct > 0

    os.truncate(f, seg.offset + 6 * MiB + 100)  # cut in the middle of a staged read
    _drop_cache(path)
    with pytest.raises(CheckpointException) as e:
        dcp.load({"emb": torch.empty_like(sd["emb"])}, storage_reader=DataStatesReader(path, o_direct=True), no_dist=True)
    msg = str(e.value)
    assert "truncated" in msg and seg.file in msg and "emb" in msg


def test_read_range_any_offset_length_and_destination(direct_dir):
    data = os.urandom(5 * MiB + 1000)
    p = str(direct_dir / "f")
    open(p, "wb").write(data)
    fd = os.open(p, os.O_RDONLY)
    dfd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    align = dio_alignment(dfd)
    stage = StagingBuffer(MiB + 8192)  # smaller than some ranges: several rounds
    assert stage.address % (2 * MiB) == 0 and stage.nbytes >= MiB + 8192
    try:
        for off, n in [(0, MiB), (100, 2 * MiB), (4096, 3 * MiB + 7), (5 * MiB - 300_000, 300_000),
                       (1, 4 * MiB), (5000, 1000)]:
            dest = torch.empty(n + 64, dtype=torch.uint8)[3:3 + n]  # odd address
            got, direct = read_range(fd, off, memoryview(dest.numpy()), dest.data_ptr(), direct_fd=dfd,
                                     stage=stage, align=align, check_cache=False)
            assert got == n and bytes(dest.numpy()) == data[off:off + n], (off, n)
            assert direct == (n if n >= 256 << 10 else 0), (off, n)
        dest = torch.empty(MiB, dtype=torch.uint8)  # past the end: a short count, not an error
        got, direct = read_range(fd, len(data) - 400_000, memoryview(dest.numpy()), dest.data_ptr(),
                                 direct_fd=dfd, stage=stage, align=align, check_cache=False)
        assert got == direct == 400_000 and bytes(dest[:got].numpy()) == data[-400_000:]
    finally:
        stage.close()
        os.close(fd)
        os.close(dfd)


def test_dio_alignment_of_this_file_system(direct_dir):
    p = str(direct_dir / "f")
    open(p, "wb").write(b"x" * 8192)
    fd = os.open(p, os.O_RDONLY)
    try:
        align = dio_alignment(fd)
    finally:
        os.close(fd)
    assert align is not None  # O_DIRECT opens here (the fixture checked)
    mem, off = align
    assert mem & (mem - 1) == 0 and off & (off - 1) == 0 and 1 <= mem <= 4096 and 1 <= off <= 4096
