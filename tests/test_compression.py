"""Per-block compression (issue 38): ``compression="zstd"``, or DCP's ``_extensions=[ZStandard()]``.

Each 1 MiB checksum block of a tensor of 64 KiB or more is stored compressed on its own, in the
packed data file beside its stripe; the block digest covers the stored bytes.  Everything the
reader does with plain blocks must still hold: ranged and resharded reads, verification before
decoding, the fallback to another tier, incremental dedup, plain DCP calls in every mode."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_datastates import DataStatesReader, DataStatesSavePlanner, DataStatesWriter
from dcp_datastates.errors import ChecksumMismatch, DataFileError
from dcp_datastates.format.codec import decode_block, encode_block
from dcp_datastates.format.limits import FormatViolation
from dcp_datastates.format.names import is_packed_file
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import load_manifest
from dcp_datastates.verify import verify_checkpoint
from tests.dist import run_ranks

pytest.importorskip("zstandard")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(700, 1000, generator=g),  # 2.8 MB: three blocks, the last short
        "bf16": torch.randn(1200, 1000, generator=g).bfloat16(),
        "f16": torch.randn(1000, 333, generator=g).half(),
        "f64": torch.randn(300, 300, generator=g).double(),
        "i8": torch.randint(-100, 100, (2_500_000,), dtype=torch.int8, generator=g),
        "zeros": torch.zeros(1 << 19),  # compresses to almost nothing
        "empty": torch.empty(0, 5),
        "small": torch.randn(10, generator=g),  # under 64 KiB: stored as it is
        "nc": torch.randn(800, 900, generator=g).t(),  # not contiguous
        "rep": torch.randn(300, 1000, generator=g),
        "step": 5,
    }


def _zeros_like(sd: dict) -> dict:
    return {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def _assert_equal(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _packed_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if is_packed_file(n))


def _extent(path: str, fqn: str):
    return load_manifest(StorageTier(path)).tensors[fqn].chunks[0].extent


def test_every_dtype_round_trips_bit_exact_and_takes_fewer_bytes(tmp_path):
    sd = _state()
    path = str(tmp_path / "c")
    dcp.save(sd, storage_writer=DataStatesWriter(path, compression="zstd"), no_dist=True)
    got = _zeros_like(sd)
    dcp.load(got, storage_reader=DataStatesReader(path), no_dist=True)
    _assert_equal(got, sd)
    assert _packed_files(path), "compressed blocks go to a packed file"
    for k in ("f32", "bf16", "f16", "f64", "i8", "zeros", "nc"):
        e = _extent(path, k)
        assert e.packed and len(e.segs) == -(-e.nbytes // (1 << 20)), k
    assert not _extent(path, "small").packed  # small tensors stay as they are
    assert _extent(path, "zeros").stored < 4096
    assert _extent(path, "bf16").stored < 0.8 * _extent(path, "bf16").nbytes  # byte-shuffled bf16
    total = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".dsd"))
    logical = sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))
    assert total < 0.85 * logical
    assert verify_checkpoint(path) == []


def test_the_zstandard_extension_means_compression(tmp_path):
    from torch.distributed.checkpoint._extension import ZStandard
    sd = {"w": torch.randn(600, 500), "step": 1}
    path = str(tmp_path / "z")
    dcp.save(sd, storage_writer=DataStatesWriter(path, _extensions=[ZStandard()]), no_dist=True)
    assert _extent(path, "w").packed
    got = {"w": torch.zeros(600, 500), "step": 0}
    dcp.load(got, storage_reader=DataStatesReader(path), no_dist=True)
    _assert_equal(got, sd)


def _resharded_save(rank, world, path, mode):
    mesh = init_device_mesh("cpu", (world,))
    sd = _state(seed=1)
    dt = {k: distribute_tensor(v, mesh, [Replicate() if k == "rep" and mode == "rules" else Shard(0)])
          for k, v in sd.items() if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] >= world}
    plain = {k: v for k, v in sd.items() if k not in dt}
    state = {**dt, **plain}
    w = DataStatesWriter(path, compression="zstd")
    if mode == "sync":
        dcp.save(state, storage_writer=w)
        return
    if mode == "rules":  # format 4: sharding rules, parts, the replicated box's held record
        dcp.save(state, storage_writer=w, planner=DataStatesSavePlanner())
        return
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    pg = dist.new_group(backend="gloo")
    fut = dcp.async_save(state, storage_writer=w, process_group=pg, async_checkpointer_type=kind)
    if kind == AsyncCheckpointerType.THREAD:  # training's in-place update, once the snapshot is done
        w.wait_snapshot()
        for v in dt.values():
            v.to_local().add_(1)
    fut.result()
    dist.barrier()


def _resharded_load(rank, world, path):
    """Saved as row shards on 2 ranks, loaded as column shards on ``world`` ranks."""
    mesh = init_device_mesh("cpu", (world,))
    sd = _state(seed=1)
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.ndim == 2 and v.shape[1] >= world:
            out[k] = distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), mesh, [Shard(1)])
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        else:
            out[k] = 0
    dcp.load(out, storage_reader=DataStatesReader(path))
    for k, v in sd.items():
        got = out[k].full_tensor() if hasattr(out[k], "full_tensor") else out[k]
        if isinstance(v, torch.Tensor):
            assert torch.equal(got, v), (rank, k)
        else:
            assert got == v, (rank, k)


def _row_load(rank, world, path):
    """Rows of a compressed tensor saved as 2 row shards, loaded as 3: rank 0's rows lie in the
    first block of the first chunk, and only that block is read, checked and decoded."""
    mesh = init_device_mesh("cpu", (world,))
    want = _state(seed=1)["f32"]
    out = {"f32": distribute_tensor(torch.zeros(want.shape), mesh, [Shard(0)])}
    reader = DataStatesReader(path)
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["f32"].full_tensor(), want)
    if rank == 0:
        chunk = load_manifest(StorageTier(path)).tensors["f32"].find((0, 0))
        assert chunk.extent.packed and len(chunk.extent.segs) == 2
        assert reader.stats.bytes_read == chunk.extent.segs[0].nbytes


@pytest.mark.parametrize("mode", ["sync", "rules", "thread", "process"])
def test_compressed_dtensors_reshard_in_every_save_mode(tmp_path, mode):
    path = str(tmp_path / mode)
    run_ranks(2, _resharded_save, path, mode)
    assert _packed_files(path)
    if mode == "rules":
        m = load_manifest(StorageTier(path))
        assert m.version == 4 and m.tensors["rep"].chunks[0].extent.packed  # a held record
    run_ranks(3, _resharded_load, path)  # 2 row shards -> 3 column shards: partial blocks
    if mode == "sync":
        run_ranks(3, _row_load, path)
    got = _zeros_like(_state(seed=1))
    dcp.load(got, storage_reader=DataStatesReader(path), no_dist=True)  # -> 1 rank, plain tensors
    _assert_equal(got, _state(seed=1))


def test_incremental_saves_reuse_compressed_blocks(tmp_path):
    sd = {"a": torch.randn(1 << 21), "b": torch.randn(1 << 20)}  # 8 MiB and 4 MiB
    p0, p1, p2 = (str(tmp_path / f"step-{i}") for i in range(3))
    dcp.save(sd, storage_writer=DataStatesWriter(p0, compression="zstd", dedup_unit_bytes=1 << 20), no_dist=True)
    sd1 = {"a": sd["a"].clone(), "b": sd["b"].clone()}
    sd1["a"][:1000] += 1  # the first block of "a" changes; the rest does not
    w = DataStatesWriter(p1, compression="zstd", dedup_unit_bytes=1 << 20, incremental_base=p0)
    dcp.save(sd1, storage_writer=w, no_dist=True)
    stats = w.last_stats
    assert stats["bytes_reused"] > 0.8 * (_extent(p0, "a").stored + _extent(p0, "b").stored) * 10 / 12
    assert stats["bytes_written"] < 0.25 * (_extent(p0, "a").stored + _extent(p0, "b").stored)
    # a plain save on a compressed base: nothing is comparable, everything is written
    w2 = DataStatesWriter(p2, dedup_unit_bytes=1 << 20, incremental_base=p1)
    dcp.save(sd1, storage_writer=w2, no_dist=True)
    assert w2.last_stats["bytes_reused"] == 0
    for p, want in ((p0, sd), (p1, sd1), (p2, sd1)):
        got = {"a": torch.zeros(1 << 21), "b": torch.zeros(1 << 20)}
        dcp.load(got, storage_reader=DataStatesReader(p), no_dist=True)
        assert torch.equal(got["a"], want["a"]) and torch.equal(got["b"], want["b"]), p
        assert verify_checkpoint(p) == []


def _cause(exc: BaseException) -> BaseException:
    """Our error inside DCP's ``CheckpointException`` (its failures by rank)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    got = next(iter(failures.values()))
    return got[0] if isinstance(got, tuple) else got


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_corrupt_compressed_block_is_caught_named_and_read_from_the_next_tier(tmp_path, caplog):
    sd = _state(seed=2)
    t1, t2 = str(tmp_path / "t1"), str(tmp_path / "t2")
    w = DataStatesWriter(t1, compression="zstd", persist_to=[t2])
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.wait_persisted(60)
    e = _extent(t1, "f32")
    g = e.segs[1]  # the second block, in the middle of its stored bytes
    _flip(os.path.join(t1, g.file), g.offset + g.nbytes // 2)
    with pytest.raises(BaseException) as err:  # DCP wraps it in its CheckpointException
        dcp.load(_zeros_like(sd), storage_reader=DataStatesReader(t1), no_dist=True)
    cause = _cause(err.value)
    assert isinstance(cause, ChecksumMismatch)
    msg = str(cause)
    assert "compressed block 1" in msg and g.file in msg and "f32" in msg and "\n" not in msg
    problems = verify_checkpoint(t1)
    assert len(problems) == 1 and "f32" in problems[0] and "compressed block 1" in problems[0]
    with caplog.at_level("WARNING", logger="dcp_datastates"):
        got = _zeros_like(sd)
        dcp.load(got, storage_reader=DataStatesReader(t1, fallback=[t2]), no_dist=True)
    _assert_equal(got, sd)
    assert any(t2 in r.getMessage() for r in caplog.records)


def test_without_verification_a_corrupt_block_still_never_loads_silently_wrong(tmp_path):
    """``verify=False`` skips the digests, never the decoder's own checks: a damaged header or
    frame fails the load naming the file and tensor (a flip in a zstd literal could decode to
    other bytes: what the digests are for)."""
    sd = {"w": torch.randn(600, 1000)}
    path = str(tmp_path / "v")
    dcp.save(sd, storage_writer=DataStatesWriter(path, compression="zstd"), no_dist=True)
    e = _extent(path, "w")
    _flip(os.path.join(path, e.segs[0].file), e.segs[0].offset)  # the header byte
    with pytest.raises(BaseException) as err:
        dcp.load({"w": torch.zeros(600, 1000)}, storage_reader=DataStatesReader(path, verify=False), no_dist=True)
    cause = _cause(err.value)
    assert isinstance(cause, DataFileError)
    assert "compressed block 0" in str(cause) and e.segs[0].file in str(cause) and "\n" not in str(cause)


def test_the_decoder_is_bounded_by_the_block_length():
    data = memoryview(torch.zeros(1 << 18).numpy().tobytes())  # 1 MiB of zeros
    stored = encode_block(data, 4)
    assert len(stored) < 1000 and stored[0] == 4
    out = bytearray(len(data))
    decode_block(stored, memoryview(out))
    assert bytes(out) == bytes(data)
    with pytest.raises(FormatViolation):  # a frame that says it holds more than the block
        decode_block(stored, memoryview(bytearray(1000)))
    with pytest.raises(FormatViolation):
        decode_block(bytes([9]) + stored[1:], memoryview(out))  # an unknown header
    with pytest.raises(FormatViolation):
        decode_block(bytes([0]) + b"abc", memoryview(out))  # stored as it is, but too short
    noise = memoryview(os.urandom(5000))
    assert encode_block(noise, 1)[0] == 0  # incompressible: stored as it is


def _crafted(tmp_path, name, edit, version):
    """A compressed checkpoint whose manifest ``edit`` changes (with a valid body checksum);
    the plain save's data file is copied beside it, so a segment may name it."""
    from tests.manifest_tools import rewrite_manifest
    sd = {"w": torch.randn(600, 1000)}  # three blocks
    path, plain = str(tmp_path / name), str(tmp_path / f"{name}-plain")
    dcp.save(sd, storage_writer=DataStatesWriter(path, compression="zstd"), no_dist=True)
    dcp.save(sd, storage_writer=DataStatesWriter(plain), no_dist=True)
    pf = _extent(plain, "w").file
    shutil.copy(os.path.join(plain, pf), os.path.join(path, pf))
    rewrite_manifest(path, lambda body: edit(body, pf, os.path.getsize(os.path.join(path, pf))), version=version)
    with pytest.raises(BaseException) as err:
        dcp.load({"w": torch.zeros(600, 1000)}, storage_reader=DataStatesReader(path), no_dist=True)
    return str(_cause(err.value))  # ours, or DCP's no-dist fallback quoting ours


def _v2_mix(body, pf, size):
    body["files"][pf] = size
    body["tensors"]["w"]["chunks"][0]["x"][0][0] = [pf, 0, 1 << 20]


def _v2_drop(body, pf, size):
    del body["tensors"]["w"]["chunks"][0]["x"][0][-1]


def _v2_big(body, pf, size):
    segs = body["tensors"]["w"]["chunks"][0]["x"][0]
    segs[0][2] = (1 << 20) + 2  # more than a block stored as it is: no real writer makes it


def _v3_drop(body, pf, size):
    t = body["table"]
    t["nsegs"] = struct.pack("<q", 2)
    for k in ("seg_file", "seg_offset", "seg_nbytes"):
        t[k] = t[k][:16]


def _v3_mix(body, pf, size):
    body["files"].append([pf, size])
    t = body["table"]
    t["seg_file"] = struct.pack("<q", len(body["files"]) - 1) + t["seg_file"][8:]
    t["seg_offset"] = struct.pack("<q", 0) + t["seg_offset"][8:]
    t["seg_nbytes"] = struct.pack("<q", 1 << 20) + t["seg_nbytes"][8:]


@pytest.mark.parametrize("edit,version,needle", [
    (_v2_mix, 2, "mixes compressed blocks and plain bytes"),
    (_v2_drop, 2, "2 compressed blocks hold an extent of 3 blocks"),
    (_v2_big, 2, "compressed block is stored in 0 or more than"),
    (_v3_drop, 3, "2 compressed blocks hold an extent of 3 blocks"),
    (_v3_mix, 3, "mixes compressed blocks and plain bytes"),
])
def test_a_manifest_whose_compressed_blocks_do_not_hold_the_chunk_is_refused(tmp_path, edit, version, needle):
    msg = _crafted(tmp_path, edit.__name__, edit, version)
    assert needle in msg and "invalid manifest" in msg, msg


def test_compression_needs_zstandard_and_says_so_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if it were not installed
    with pytest.raises(ValueError) as err:
        DataStatesWriter("/nonexistent/x", compression="zstd")
    assert "pip install" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="compression must be None or one of"):
        DataStatesWriter("/nonexistent/x", compression="lz4")


def test_inspect_shows_logical_and_stored_bytes(tmp_path):
    from tests.clirun import cli
    sd = {"bf16": torch.randn(1000, 1000).bfloat16(), "small": torch.randn(10)}
    path = str(tmp_path / "i")
    dcp.save(sd, storage_writer=DataStatesWriter(path, compression="zstd"), no_dist=True)
    rows = {r["key"]: r for r in json.loads(cli("inspect", path, "--json").stdout)["entries"]}
    assert rows["bf16"]["bytes"] == 2_000_000 and rows["bf16"]["stored_bytes"] < 1_500_000
    assert rows["small"]["stored_bytes"] == rows["small"]["bytes"] == 40
    text = cli("inspect", path).stdout
    assert "logical" in text and "compressed" in text


def test_compressed_blocks_on_an_object_store(tmp_path, s3):
    """Straight to S3 (a sink that appends in reservation order) and as a slower tier; the load
    reads each stored block by range."""
    bucket = s3.make_bucket("compressed")
    sd = _state(seed=4)
    url = f"s3://{bucket}/direct"
    w = DataStatesWriter(url, compression="zstd", storage_options=s3.options(), thread_count=2)
    dcp.save(sd, storage_writer=w, no_dist=True)
    got = _zeros_like(sd)
    dcp.load(got, storage_reader=DataStatesReader(url, storage_options=s3.options()), no_dist=True)
    _assert_equal(got, sd)
    local, slow = str(tmp_path / "t1"), f"s3://{bucket}/slow"
    w = DataStatesWriter(local, compression="zstd", persist_to=[slow], persist_options=s3.options())
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.wait_persisted(60)
    shutil.rmtree(local)
    got = _zeros_like(sd)
    dcp.load(got, storage_reader=DataStatesReader(slow, storage_options=s3.options()), no_dist=True)
    _assert_equal(got, sd)
