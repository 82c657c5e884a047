"""No first-save stall (issue 14, the part a CPU machine can check): the host cache is
allocated in the background when a writer, ``Checkpointer`` or torchtitan manager is made, the
first save waits for that allocation instead of making a second one, and a save of host
tensors reuses a pinned cache of the same size."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.engine import host_cache as hc


def test_writer_prepares_its_cache_before_the_first_save(tmp_path):
    cap = (3 << 20) + 4096 * 7  # a size no other test uses: a fresh cache
    w = DataStatesWriter(str(tmp_path / "c"), host_cache_bytes=cap)
    cache = hc.shared_host_cache(cap, False)
    assert cache._preparing is not None
    cache._preparing.result(timeout=60)
    assert cache._buf is not None and cache.allocations == 1
    sd = {"w": torch.randn(256, 256)}
    fut = dcp.async_save(sd, storage_writer=w)
    fut.result(timeout=60)
    assert cache.allocations == 1  # the save used the prepared buffer
    out = {"w": torch.zeros(256, 256)}
    dcp.load(out, storage_reader=DataStatesReader(str(tmp_path / "c")), no_dist=True)
    assert torch.equal(out["w"], sd["w"])


def test_checkpointer_prepares_the_cache(tmp_path):
    cap = (5 << 20) + 4096 * 3
    Checkpointer([str(tmp_path / "run")], host_cache_bytes=cap)
    cache = hc.shared_host_cache(cap, False)
    cache._preparing.result(timeout=60)
    assert cache._buf is not None


class _SlowCache(hc.HostCache):
    """A cache whose allocation takes a while, as pinning gigabytes does."""

    def _allocate(self):
        time.sleep(0.5)
        return super()._allocate()


def test_first_use_waits_for_the_preparation_instead_of_allocating_again():
    cache = _SlowCache(1 << 20)
    cache.prepare()
    got = []
    users = [threading.Thread(target=lambda: got.append(cache.buffer())) for _ in range(3)]
    for u in users:
        u.start()
    for u in users:
        u.join(timeout=30)
    assert cache.allocations == 1 and len(got) == 3 and all(g.data_ptr() == got[0].data_ptr() for g in got)


def test_host_tensors_reuse_a_pinned_cache_of_the_same_size():
    cap = (7 << 20) + 4096
    pinned = hc.HostCache(cap, pinned=True)  # never allocated here: only the lookup is checked
    with hc._shared_lock:
        hc._shared[(hc.align_up(cap), True)] = pinned
    try:
        assert hc.shared_host_cache(cap, False) is pinned
    finally:
        with hc._shared_lock:
            hc._shared.pop((hc.align_up(cap), True), None)


class _BrokenOnceCache(hc.HostCache):
    """A cache whose background allocation fails with an error nobody anticipated (as a
    NUMA lookup once failed on an H200 with an ``AttributeError``), then works."""

    def _allocate(self):
        if self.allocations == 0:
            self.allocations += 1
            raise AttributeError("'int' object has no attribute 'strip'")
        return super()._allocate()


def test_a_preparation_that_fails_unexpectedly_never_hangs_the_first_save():
    cache = _BrokenOnceCache(1 << 20)
    cache.prepare()
    got = []
    user = threading.Thread(target=lambda: got.append(cache.buffer()), daemon=True)
    user.start()
    user.join(timeout=30)
    assert not user.is_alive(), "buffer() waited forever on a preparation that had failed"
    assert len(got) == 1 and got[0].numel() == cache.capacity  # the first use allocated instead
