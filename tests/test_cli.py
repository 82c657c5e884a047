"""Every CLI command, on local paths and an s3 URL, against intact and damaged checkpoints."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.convert import from_dcp, to_dcp, to_safetensors
from dcp_datastates.tiers.manifests import load_manifest
from dcp_datastates.tiers import StorageTier
from tests import clirun



def cli(*args, check=True):
    """The command, run in this process (``tests/clirun.py``); ``check``: it must succeed."""
    return clirun.cli(*args, check=check)


def _state():
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(256, 300, generator=g), "bf": torch.randn(40, 8, generator=g).bfloat16(),
            "i": torch.arange(7), "flag": torch.tensor([True, False]), "nested": {"b": torch.randn(5, generator=g)},
            "meta": {"step": 4, "name": "cli"}}


def _zeros(sd):
    return {"w": torch.zeros(256, 300), "bf": torch.zeros(40, 8).bfloat16(), "i": torch.zeros(7, dtype=torch.int64),
            "flag": torch.zeros(2, dtype=torch.bool), "nested": {"b": torch.zeros(5)}, "meta": {"step": 0, "name": ""}}


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in ("w", "bf", "i", "flag")) and \
        torch.equal(a["nested"]["b"], b["nested"]["b"]) and a["meta"] == b["meta"]


@pytest.fixture
def ckpt(tmp_path):
    p = str(tmp_path / "ckpt")
    dcp.save(_state(), storage_writer=DataStatesWriter(p), no_dist=True)
    return p


def test_inspect(ckpt):
    r = cli("inspect", ckpt)
    assert "w" in r.stdout and "bfloat16" in r.stdout and "format v3" in r.stdout and "committed on" in r.stdout
    info = json.loads(cli("inspect", ckpt, "--json").stdout)
    rows = {e["key"]: e for e in info["entries"]}
    assert rows["w"]["shape"] == [256, 300] and rows["w"]["bytes"] == 256 * 300 * 4
    assert rows["meta.name"]["dtype"] == "value/msgpack"


def test_verify_intact_and_damaged(ckpt):
    assert "OK" in cli("verify", ckpt).stdout
    seg = load_manifest(StorageTier(ckpt)).tensors["w"].chunks[0].extent.segs[0]
    data = seg.file
    with open(os.path.join(ckpt, data), "r+b") as f:
        f.seek(seg.offset + 10)
        f.write(b"\x00\x01\x02")
    r = cli("verify", ckpt, check=False)
    assert r.returncode == 1 and "DAMAGED" in r.stdout and data in r.stdout and "tensor w" in r.stdout
    j = json.loads(cli("verify", ckpt, "--json", check=False).stdout)
    assert j["ok"] is False and j["problems"]


def test_inspect_and_verify_on_s3(ckpt, s3):
    bucket = s3.make_bucket("cli")
    url = f"{bucket}/run/step-1"
    w = DataStatesWriter(str(os.path.dirname(ckpt) + "/t1"), persist_to=[url], persist_options=s3.options())
    dcp.save(_state(), storage_writer=w, no_dist=True)
    assert w.wait_persisted(60)
    opts = json.dumps(s3.options())
    assert "w" in cli("inspect", url, "--storage-options", opts).stdout
    assert "OK" in cli("verify", url, "--storage-options", opts).stdout


def test_convert_dcp_round_trip_bit_exact(ckpt, tmp_path):
    dcp_dir, back = str(tmp_path / "dcp"), str(tmp_path / "back")
    cli("convert", ckpt, dcp_dir, "--to", "dcp")
    out = _zeros(_state())
    dcp.load(out, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)  # the other tool reads it
    assert _equal(out, _state())
    cli("convert", dcp_dir, back, "--to", "datastates", "--allow-pickle")  # DCP's .metadata is a pickle
    out = _zeros(_state())
    dcp.load(out, storage_reader=DataStatesReader(back), no_dist=True)
    assert _equal(out, _state())


def test_convert_safetensors_single_and_sharded(ckpt, tmp_path):
    from safetensors.torch import load_file
    single = str(tmp_path / "model.safetensors")
    cli("convert", ckpt, single, "--to", "safetensors")
    loaded = load_file(single)
    src = _state()
    assert torch.equal(loaded["w"], src["w"]) and torch.equal(loaded["bf"], src["bf"])
    assert torch.equal(loaded["nested.b"], src["nested"]["b"]) and torch.equal(loaded["flag"], src["flag"])
    shards = str(tmp_path / "sharded")
    cli("convert", ckpt, shards, "--to", "safetensors", "--max-shard-bytes", "200000")
    index = json.load(open(os.path.join(shards, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    merged = {}
    for f in files:
        merged.update(load_file(os.path.join(shards, f)))
    assert torch.equal(merged["w"], src["w"]) and torch.equal(merged["i"], src["i"])
    with open(single, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
    assert (8 + hlen) % 4096 == 0  # data aligned for O_DIRECT / mmap


def test_bench_writes_valid_pngs(tmp_path):
    out = str(tmp_path / "bench")
    r = cli("bench", "--gb", "0.05", "--out", out)
    assert "dcp-datastates" in r.stdout and "FileSystemWriter" in r.stdout
    for name in ("throughput.png", "timeline.png"):
        p = os.path.join(out, name)
        data = open(p, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        w, h = struct.unpack(">II", data[16:24])
        assert w > 100 and h > 100
        import matplotlib.image
        assert matplotlib.image.imread(p).shape[0] == h  # decodes


def test_python_api_conversions(ckpt, tmp_path):
    to_dcp(ckpt, str(tmp_path / "d"))
    from_dcp(str(tmp_path / "d"), str(tmp_path / "b"), allow_pickle=True)  # DCP's .metadata is a pickle
    out = _zeros(_state())
    dcp.load(out, storage_reader=DataStatesReader(str(tmp_path / "b")), no_dist=True)
    assert _equal(out, _state())
    assert to_safetensors(ckpt, str(tmp_path / "s.safetensors"))


def test_demo_runs_kills_and_resumes(tmp_path):
    r = clirun.cli_process("demo", "--out", str(tmp_path / "demo"), "--width", "256", "--depth", "2", "--steps", "8",
            "--kill-at", "5", check=True)
    assert "demo passed" in r.stdout, r.stdout[-3000:]
    assert "identical to DCP FileSystemReader" in r.stdout and "resumed from step" in r.stdout
    assert os.path.exists(tmp_path / "demo" / "timeline.png")


# ------------------------------------------- interrupted saves: visible, and cleaned on request

def _interrupted_run(tmp_path, monkeypatch) -> str:
    """step-1 committed; step-2's save died before its commit (its data files are left)."""
    from tests.disk import full_at_the_commit
    run = str(tmp_path / "run")
    dcp.save(_state(), storage_writer=DataStatesWriter(os.path.join(run, "step-1")), no_dist=True)
    with monkeypatch.context() as m:
        full_at_the_commit(m)
        with pytest.raises(BaseException):
            dcp.save(_state(), storage_writer=DataStatesWriter(os.path.join(run, "step-2")), no_dist=True)
    assert any(n.startswith("data-") for n in os.listdir(os.path.join(run, "step-2")))
    return run


def test_inspect_shows_an_interrupted_save_and_clean_removes_only_it(tmp_path, monkeypatch):
    run = _interrupted_run(tmp_path, monkeypatch)
    left = sum(os.path.getsize(os.path.join(run, "step-2", n)) for n in os.listdir(os.path.join(run, "step-2")))
    out = cli("inspect", run).stdout
    assert "step-2" in out and "uncommitted" in out, out
    info = json.loads(cli("inspect", run, "--json").stdout)
    assert [(u["dir"], u["claimed"]) for u in info["uncommitted"]] == [("step-2", False)], info
    assert 0 < info["uncommitted"][0]["reclaimable_bytes"] <= left
    dry = cli("clean", run)  # a dry run by default: names what would go, removes nothing
    assert "step-2" in dry.stdout and "--yes" in dry.stdout, dry.stdout
    assert os.path.isdir(os.path.join(run, "step-2"))
    cli("clean", run, "--yes")
    assert not os.path.exists(os.path.join(run, "step-2"))
    out = _zeros(_state())
    dcp.load(out, storage_reader=DataStatesReader(os.path.join(run, "step-1")), no_dist=True)
    assert _equal(out, _state())
    assert "uncommitted" not in cli("inspect", run).stdout


def test_clean_leaves_a_step_a_save_is_writing(tmp_path, monkeypatch):
    from dcp_datastates.tiers.claim import acquire
    run = _interrupted_run(tmp_path, monkeypatch)
    held = acquire(StorageTier(os.path.join(run, "step-2")), ".claim", "live0000save")  # a save in flight
    try:
        info = json.loads(cli("inspect", run, "--json").stdout)
        assert [u["claimed"] for u in info["uncommitted"]] == [True]
        cli("clean", run, "--yes")
        assert any(n.startswith("data-") for n in os.listdir(os.path.join(run, "step-2")))
    finally:
        held.release()
