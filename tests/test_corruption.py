"""Corruption: every fault is detected at load with the file and tensor named, `verify`
reports it, and a load with a second tier falls back to the intact copy.  Silent wrong data
fails the test."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.disk import flip_byte as _flip
from dcp_datastates import DataStatesReader
from dcp_datastates.cli import verify_checkpoint
from dcp_datastates.format.manifest import MAGIC
from tests.manifest_tools import rewrite_manifest
from dcp_datastates.tiers.manifests import load_manifest
from dcp_datastates.tiers import StorageTier
from tests import workers
from tests.dist import run_ranks


@pytest.fixture(scope="module")
def two_tier_ckpt(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("corrupt"))
    run_ranks(2, workers.corruption_save, base)
    return base


def _template():
    return {"w": torch.zeros(64, 1024), "r": torch.zeros(300, 7), "small": {str(i): torch.zeros(10) for i in range(5)},
            "meta": {"step": -1, "name": ""}}


def _expected():
    return workers.corruption_state_full()


def _equal(a, b):
    return (torch.equal(a["w"], b["w"]) and torch.equal(a["r"], b["r"]) and a["meta"] == b["meta"]
            and all(torch.equal(a["small"][k], b["small"][k]) for k in b["small"]))


def _data_files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".dsd"))


def _extents(d):
    m = load_manifest(StorageTier(d))
    out = []
    for fqn, t in m.tensors.items():
        for c in t.chunks:
            out.append((fqn, c.extent))
    return out




_rewrite_manifest = rewrite_manifest


def _ext_of(d, fqn_prefix, which=0):
    exts = [e for f, e in _extents(d) if f.startswith(fqn_prefix)]
    return exts[which]


def _flip_at(d, e, pos):
    """Flip the byte at chunk position ``pos`` of extent ``e``; return its file."""
    (name, off, _p, _n), = e.locate(pos, 1)
    _flip(os.path.join(d, name), off)
    return name


def f_flip_extent_start(d):
    return _flip_at(d, _ext_of(d, "w"), 0), "w"


def f_flip_extent_middle(d):
    e = _ext_of(d, "w", 1)
    return _flip_at(d, e, e.nbytes // 2), "w"


def f_flip_extent_end(d):
    e = _ext_of(d, "r")
    return _flip_at(d, e, e.nbytes - 1), "r"


def f_flip_small_tensor(d):
    return _flip_at(d, _ext_of(d, "small.3"), 5), "small.3"


def f_zero_block(d):
    e = _ext_of(d, "w")
    with open(os.path.join(d, e.file), "r+b") as f:
        f.seek(e.offset)
        f.write(b"\0" * 4096)
    return e.file, "w"


def _trunc(d, size_fn):
    e = _ext_of(d, "w")
    p = os.path.join(d, e.file)
    os.truncate(p, size_fn(os.path.getsize(p)))
    return e.file, None


def f_truncate_half(d):
    return _trunc(d, lambda n: n // 2)


def f_truncate_one_byte(d):
    return _trunc(d, lambda n: n - 1)


def f_truncate_empty(d):
    return _trunc(d, lambda n: 0)


def f_delete_rank0_file(d):
    name = _data_files(d)[0]
    os.remove(os.path.join(d, name))
    return name, None


def f_delete_rank1_file(d):
    name = _data_files(d)[-1]
    os.remove(os.path.join(d, name))
    return name, None


def f_swap_ranks(d):
    a, b = _data_files(d)[0], _data_files(d)[-1]
    pa, pb = os.path.join(d, a), os.path.join(d, b)
    os.rename(pa, pa + ".x")
    os.rename(pb, pa)
    os.rename(pa + ".x", pb)
    return (a, b), None


def f_duplicate_rank_file(d):
    a, b = _data_files(d)[0], _data_files(d)[-1]
    shutil.copyfile(os.path.join(d, b), os.path.join(d, a))
    return (a, b), None


def f_manifest_body_byte(d):
    p = os.path.join(d, ".metadata")
    _flip(p, len(MAGIC) + 50)
    return ".metadata", None


def f_manifest_magic(d):
    _flip(os.path.join(d, ".metadata"), 3)
    return ".metadata", None


def f_manifest_checksum(d):
    p = os.path.join(d, ".metadata")
    _flip(p, os.path.getsize(p) - 2)
    return ".metadata", None


def f_manifest_truncated(d):
    p = os.path.join(d, ".metadata")
    os.truncate(p, os.path.getsize(p) // 2)
    return ".metadata", None


def f_manifest_empty(d):
    os.truncate(os.path.join(d, ".metadata"), 0)
    return ".metadata", None


def f_manifest_deleted(d):
    os.remove(os.path.join(d, ".metadata"))
    return None, None


def f_manifest_garbage(d):
    open(os.path.join(d, ".metadata"), "wb").write(os.urandom(4096))
    return ".metadata", None


def f_manifest_unknown_version(d):
    _rewrite_manifest(d, lambda b: b.update(version=99))
    return ".metadata", None


def f_value_bytes(d):
    def mutate(b):
        enc, data, csum = b["values"]["meta.name"]
        b["values"]["meta.name"] = [enc, data[:-1] + bytes([data[-1] ^ 1]), csum]
    _rewrite_manifest(d, mutate)
    return ".metadata", "meta.name"


def f_extent_points_elsewhere(d):
    def mutate(b):
        x = b["tensors"]["r"]["chunks"][0]["x"][0][0]
        x[1] = 0  # offset moved onto another tensor's bytes; checksums still say otherwise
    _rewrite_manifest(d, mutate)
    return None, "r"


FAULTS = [f_flip_extent_start, f_flip_extent_middle, f_flip_extent_end, f_flip_small_tensor, f_zero_block,
          f_truncate_half, f_truncate_one_byte, f_truncate_empty, f_delete_rank0_file, f_delete_rank1_file,
          f_swap_ranks, f_duplicate_rank_file, f_manifest_body_byte, f_manifest_magic, f_manifest_checksum,
          f_manifest_truncated, f_manifest_empty, f_manifest_deleted, f_manifest_garbage,
          f_manifest_unknown_version, f_value_bytes, f_extent_points_elsewhere]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.__name__[2:] for f in FAULTS])
def test_fault_detected_reported_and_fallback(two_tier_ckpt, tmp_path, fault):
    t1, t2 = str(tmp_path / "t1"), str(tmp_path / "t2")
    shutil.copytree(os.path.join(two_tier_ckpt, "t1"), t1)
    shutil.copytree(os.path.join(two_tier_ckpt, "t2"), t2)
    expected = _expected()
    # intact first: the copy loads
    out = _template()
    dcp.load(out, storage_reader=DataStatesReader(t1), no_dist=True)
    assert _equal(out, expected)

    fname, key = fault(t1)
    # 1. detected at load, with the file (and tensor) named
    out = _template()
    with pytest.raises(BaseException) as ei:
        dcp.load(out, storage_reader=DataStatesReader(t1), no_dist=True)
    msg = str(ei.value)
    assert "Error" in repr(ei.value) or "error" in msg.lower() or msg
    if fname:
        names = fname if isinstance(fname, tuple) else (fname,)
        assert any(n in msg for n in names), msg[-800:]
    else:
        assert t1 in msg, msg[-800:]
    if key:
        assert key in msg, msg[-800:]
    # 2. verify reports it
    problems = verify_checkpoint(t1)
    assert problems, "verify missed the fault"
    # 3. with the second tier, the load falls back and returns the right data
    if fault is f_extent_points_elsewhere:
        # a crafted manifest that consistently lies (valid body checksum) sends every tier to the
        # wrong bytes: detected on each, never returned as data
        with pytest.raises(BaseException, match="checksum mismatch"):
            dcp.load(_template(), storage_reader=DataStatesReader(t1, fallback=[t2]), no_dist=True)
        return
    out = _template()
    dcp.load(out, storage_reader=DataStatesReader(t1, fallback=[t2]), no_dist=True)
    assert _equal(out, expected)
