"""Conversion refuses what does not exist (issue 35, case 9): a DCP checkpoint whose metadata
declares more than its chunks cover, or a size no file could hold, is refused with one line
naming the checkpoint and the tensor, before anything is allocated or committed."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcp_datastates import DataStatesWriter
from tests.manifest_tools import rewrite_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def _dcp_checkpoint(path, declared: tuple[int, ...]) -> None:
    """A real DCP checkpoint of a 16-element tensor whose metadata then declares ``declared``
    (its one chunk still covers 16 elements): a lost chunk, or an absurd size."""
    dcp.save({"w": torch.arange(16, dtype=torch.float32)}, storage_writer=dcp.FileSystemWriter(str(path)),
             no_dist=True)
    md_path = os.path.join(path, ".metadata")
    with open(md_path, "rb") as f:
        md = pickle.load(f)
    t = md.state_dict_metadata["w"]
    assert isinstance(t, TensorStorageMetadata)
    md.state_dict_metadata["w"] = TensorStorageMetadata(t.properties, torch.Size(declared), t.chunks)
    with open(md_path, "wb") as f:
        pickle.dump(md, f)


def _convert(src, dst, to: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dcp_datastates", "convert", str(src), str(dst), "--to", to,
                           "--allow-pickle"], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("declared", [(32,), (1 << 34,), (1 << 62,)], ids=["lost-chunk", "2^34", "2^62"])
def test_convert_from_dcp_refuses_what_its_chunks_do_not_cover(tmp_path, declared):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _dcp_checkpoint(src, declared)
    r = _convert(src, dst, "datastates")
    err = r.stderr.strip()
    assert r.returncode != 0 and len(err.splitlines()) == 1, err[-2000:]
    assert "w" in err and str(src) in err and "Traceback" not in err, err
    assert not (dst / ".metadata").exists()
    assert not os.path.exists(f"{dst}.convert-scratch")


def test_to_safetensors_refuses_a_checkpoint_that_does_not_cover_its_tensors(tmp_path):
    """Our own checkpoint whose manifest declares a tensor larger than its chunks (a lost rank
    manifest of a per-rank save): refused before a tensor of the declared size is allocated, and
    no header-only file is left behind."""
    ck = tmp_path / "ck"
    dcp.save({"w": torch.arange(16, dtype=torch.float32)}, storage_writer=DataStatesWriter(str(ck)), no_dist=True)
    def grow(body):
        body["tensors"]["w"]["size"] = [1 << 34]
    rewrite_manifest(str(ck), grow, version=2)
    out = tmp_path / "out.safetensors"
    r = _convert(ck, out, "safetensors")
    err = r.stderr.strip()
    assert r.returncode != 0 and len(err.splitlines()) == 1, err[-2000:]
    assert "w" in err and "Traceback" not in err, err
    assert not out.exists()


def _one_rank_converts(rank, world, base):
    """Rank 0 converts while the job's process group is up; the other rank is busy elsewhere."""
    import torch.distributed as dist

    from dcp_datastates import convert
    if rank == 0:
        src = os.path.join(base, "ours")
        dcp.save({"w": torch.arange(16.0), "step": 7}, storage_writer=DataStatesWriter(src), no_dist=True)
        convert.to_dcp(src, os.path.join(base, "dcp"))
        convert.to_safetensors(src, os.path.join(base, "st"))
        convert.from_dcp(os.path.join(base, "dcp"), os.path.join(base, "again"), allow_pickle=True)
        got = {"w": torch.zeros(16), "step": 0}
        dcp.load(got, storage_reader=dcp.FileSystemReader(os.path.join(base, "dcp")), no_dist=True)
        assert torch.equal(got["w"], torch.arange(16.0)) and got["step"] == 7
    dist.barrier()


def test_a_conversion_on_one_rank_of_a_running_job_needs_no_other_rank(tmp_path):
    """A conversion reads and writes in its own process: it never waits in a collective of the
    job's group for ranks that are not converting (it did, for the checkpoint's values)."""
    from tests.dist import run_ranks
    run_ranks(2, _one_rank_converts, str(tmp_path), timeout=60)
