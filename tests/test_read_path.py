"""The read-path choice (issue 14): before the first large load from a file system the reader
measures O_DIRECT against buffered reads there and keeps the faster for the process.  Which one
is faster is set here by wrapping the storage interface (``direct_io.read_direct`` /
``direct_io.read_buffered``) with a delay, as a slow device would; probe and load are the
library's own."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.tiers import direct_io, read_path
from tests.disk import drop_cache as _drop_cache
from tests.disk import o_direct_works as _o_direct_works

MiB = 1 << 20


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    if not _o_direct_works(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.setattr(read_path, "PROBE_BYTES", 1 * MiB)  # a small probe for a small state
    monkeypatch.setattr(read_path, "PROBE_MIN_LOAD", 16 * MiB)
    read_path.forget()
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(2 * MiB // 4, generator=g) for i in range(12)}  # 12 ranges of 2 MiB
    path = str(tmp_path / "c")
    dcp.save(state, storage_writer=DataStatesWriter(path, thread_count=1), no_dist=True)
    yield path, state
    read_path.forget()


def _slow(monkeypatch, name: str, seconds: float) -> list:
    calls = []
    orig = getattr(direct_io, name)

    @functools.wraps(orig)
    def wrapped(*a, **kw):
        calls.append(1)
        time.sleep(seconds)
        return orig(*a, **kw)
    monkeypatch.setattr(direct_io, name, wrapped)
    return calls


def _load(path, state, **kw) -> DataStatesReader:
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    r = DataStatesReader(path, thread_count=2, **kw)
    dcp.load(out, storage_reader=r, no_dist=True)
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    return r


def test_slow_o_direct_device_is_read_buffered(ckpt, monkeypatch):
    path, state = ckpt
    _slow(monkeypatch, "read_direct", 0.1)
    _drop_cache(path)
    assert _load(path, state).bytes_direct == 0  # probed first: every cold range buffered
    (choice,) = read_path.choices().values()
    assert not choice.direct and choice.buffered_gbps > choice.direct_gbps


def test_slow_buffered_device_keeps_o_direct(ckpt, monkeypatch):
    path, state = ckpt
    _slow(monkeypatch, "read_buffered", 0.1)
    _drop_cache(path)
    first = _load(path, state)
    (choice,) = read_path.choices().values()
    assert choice.direct
    assert 0 < first.bytes_direct < 24 * MiB  # the ranges the buffered probe cached are not reread
    _drop_cache(path)
    assert _load(path, state).bytes_direct == 24 * MiB


def test_cached_files_are_not_probed(ckpt):
    """A probe of cached regions would measure memory, not the device."""
    path, state = ckpt
    _load(path, state, o_direct=False)  # buffered: every page is cached now
    _load(path, state)
    _load(path, state)
    if direct_io.cached_bytes is not None and _cachestat(path):
        assert read_path.choices() == {}


def _cachestat(path) -> bool:
    import os
    name = next(n for n in os.listdir(path) if not n.startswith("."))
    fd = os.open(os.path.join(path, name), os.O_RDONLY)
    try:
        return direct_io.cached_bytes(fd, 0, 4096) is not None
    finally:
        os.close(fd)


def test_a_small_load_keeps_o_direct_unprobed(ckpt, monkeypatch):
    path, state = ckpt
    monkeypatch.setattr(read_path, "PROBE_MIN_LOAD", 1 << 40)
    _drop_cache(path)
    r = _load(path, state)
    assert read_path.choices() == {} and r.bytes_direct == 24 * MiB


def test_the_choice_is_made_once_per_file_system(ckpt, monkeypatch):
    path, state = ckpt
    calls = _slow(monkeypatch, "read_direct", 0.1)
    _drop_cache(path)
    _load(path, state)
    first, probes = read_path.choices(), len(calls)
    _drop_cache(path)
    _load(path, state)
    assert read_path.choices() == first and len(calls) == probes  # no second probe


def test_explicit_settings_do_not_probe(ckpt):
    path, state = ckpt
    _drop_cache(path)
    assert _load(path, state, o_direct=False).bytes_direct == 0
    _drop_cache(path)
    assert _load(path, state, o_direct=True).bytes_direct == 24 * MiB
    assert read_path.choices() == {}
    with pytest.raises(ValueError, match="o_direct"):
        DataStatesReader(path, o_direct="yes")
