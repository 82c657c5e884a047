"""The device cache level (issue 14), on CPU: the same engine code as on a GPU, with the first
level in host memory.  A gated storage (a real file whose writes wait for the test) shows what
the snapshot waits for: with room in the first level, only the copy into it; without, the disk.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.engine import device_cache as dcm
from dcp_datastates.engine.device_cache import DeviceCache, device_cache_for
from dcp_datastates.engine.host_cache import HostCache
from dcp_datastates.engine.snapshot import CopyItem, SnapshotEngine, Watch
from dcp_datastates.tiers import local as storage
from dcp_datastates.tiers.local import LocalSink

MiB = 1 << 20


class GatedSink:
    """A real data file whose writes block until ``gate`` is set (a slow disk, under test control)."""

    def __init__(self, path, gate: threading.Event) -> None:
        self._sink = LocalSink(str(path), path.name)
        self.gate = gate
        self.name = path.name
        self.o_direct = False
        self.writes = 0

    def reserve(self, n):
        return self._sink.reserve(n)

    def pwrite(self, buf, offset, logical=None):
        assert self.gate.wait(60), "gate never opened"
        self.writes += 1
        self._sink.pwrite(buf, offset)

    def close(self, sync=True):
        return self._sink.close(sync)

    def abort(self):
        self._sink.abort()


def _items(tensors: dict[str, torch.Tensor]) -> list[CopyItem]:
    items, off = [], 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        items.append(CopyItem(k, t, off, n, watch=Watch(t._version)))
        off += -(-n // 4096) * 4096
    return items


def _read_back(path, items: list[CopyItem]) -> dict[str, torch.Tensor]:
    data = path.read_bytes()
    out = {}
    for it in items:
        parts = [data[o:o + n] for _p, _f, o, n in sorted(it.placed, key=lambda p: p[0])]
        out[it.key] = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    return out


def _state(n_tensors: int, mib_each: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n_tensors * 31 + mib_each)
    return {f"t{i}": torch.randn(mib_each * MiB // 4, generator=g) for i in range(n_tensors)}


@pytest.fixture
def engine():
    eng = SnapshotEngine(HostCache(2 * MiB), io_threads=2, piece_bytes=MiB)
    yield eng
    eng.stop()


def test_snapshot_ends_after_the_first_level_copy_while_the_disk_waits(tmp_path, engine):
    """Device cache >= state, host cache small: the snapshot is done before a byte is written;
    the save then drains through the host cache and the file holds the pre-mutation bytes."""
    state = _state(4, 2)
    expect = {k: v.clone() for k, v in state.items()}
    dc = DeviceCache(16 * MiB, torch.device("cpu"))
    gate = threading.Event()
    sink = GatedSink(tmp_path / "data", gate)
    items = _items(state)
    job = engine.submit(items, [sink], copy=True, label="t", device_cache=dc)
    job.snapshotted.result(timeout=30)
    assert sink.writes == 0 and dc.used > 0
    for t in state.values():  # training updates the state; the checkpoint must not see it
        t.add_(1.0)
    gate.set()
    job.durable.result(timeout=60)
    got = _read_back(tmp_path / "data", items)
    for k, v in expect.items():
        assert torch.equal(got[k], v.view(torch.uint8)), k
    assert dc.used == 0 and engine.cache.used == 0  # both levels handed back
    assert engine.cache.peak_used <= engine.cache.capacity


def test_without_the_first_level_the_snapshot_waits_for_the_disk(tmp_path, engine):
    """The counterpart: host cache a quarter of the state and no device cache, so three quarters
    of the state must reach the (gated) disk before the snapshot can finish."""
    state = _state(4, 2)
    gate = threading.Event()
    sink = GatedSink(tmp_path / "data", gate)
    job = engine.submit(_items(state), [sink], copy=True, label="t")
    assert not job.snapshot_done.wait(0.5)
    gate.set()
    job.durable.result(timeout=60)
    assert job.snapshot_done.is_set()


def test_overflow_goes_to_the_host_cache_with_back_pressure(tmp_path, engine):
    """Device cache half the state: the rest takes the host cache and waits on the disk as
    before; neither level ever holds more than its capacity, and the bytes are exact."""
    state = _state(4, 2)
    expect = {k: v.clone() for k, v in state.items()}
    dc = DeviceCache(4 * MiB, torch.device("cpu"))
    gate = threading.Event()
    sink = GatedSink(tmp_path / "data", gate)
    items = _items(state)
    job = engine.submit(items, [sink], copy=True, label="t", device_cache=dc)
    assert not job.snapshot_done.wait(0.5)  # the overflow waits for room in the host cache
    assert dc.used == 4 * MiB  # the first level filled without blocking
    gate.set()
    job.durable.result(timeout=60)
    got = _read_back(tmp_path / "data", items)
    for k, v in expect.items():
        assert torch.equal(got[k], v.view(torch.uint8)), k
    assert dc.peak_used <= dc.capacity and engine.cache.peak_used <= engine.cache.capacity
    assert engine.cache.waits > 0 and dc.used == 0 and engine.cache.used == 0


def test_coalesced_small_tensors_and_odd_dtypes_round_trip_through_both_levels(tmp_path, engine):
    """Runs of small tensors share one batch (padding zeroed in the first level); bf16, fp16,
    int8 and a non-contiguous tensor come back bit-exact."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(300, 301, generator=g)
    state = {"bf16": torch.randn(1000, generator=g).bfloat16(), "fp16": torch.randn(777, generator=g).half(),
             "i8": torch.randint(-128, 127, (5001,), dtype=torch.int8, generator=g),
             "nc": base.t(), "big": torch.randn(3 * MiB // 4, generator=g)}
    expect = {k: v.contiguous().clone() for k, v in state.items()}
    dc = DeviceCache(8 * MiB, torch.device("cpu"))
    dc.buffer().fill_(0xA5)  # stale bytes from an earlier save
    sink = GatedSink(tmp_path / "data", threading.Event())
    sink.gate.set()
    items = _items(state)
    engine.submit(items, [sink], copy=True, label="t", device_cache=dc).durable.result(timeout=60)
    got = _read_back(tmp_path / "data", items)
    for k, v in expect.items():
        assert torch.equal(got[k], v.reshape(-1).view(torch.uint8)), k
    # the padding between coalesced extents is zeros, not stale bytes of the cache
    data = bytearray((tmp_path / "data").read_bytes())
    for it in items:
        for _p, _f, o, n in it.placed:
            data[o:o + n] = bytes(n)
    assert not any(data)


def test_a_failed_save_hands_back_the_first_level(tmp_path, engine):
    """A write error after the snapshot: the job fails and no device-cache space stays taken."""
    state = _state(3, 2)
    dc = DeviceCache(16 * MiB, torch.device("cpu"))

    class Broken(GatedSink):
        def pwrite(self, buf, offset, logical=None):
            raise OSError(28, "No space left on device")

    sink = Broken(tmp_path / "data", threading.Event())
    job = engine.submit(_items(state), [sink], copy=True, label="t", device_cache=dc)
    with pytest.raises(OSError):
        job.durable.result(timeout=60)
    for _ in range(100):  # the drain's last regions are released by the flush threads
        if dc.used == 0 and engine.cache.used == 0:
            break
        threading.Event().wait(0.05)
    assert dc.used == 0 and engine.cache.used == 0


def test_device_cache_for_picks_the_level():
    cpu = [torch.zeros(4)]
    assert device_cache_for(cpu, 0) is None
    if torch.cuda.is_available():
        assert device_cache_for(cpu, 8 * MiB) is None  # host tensors on a GPU machine
    else:
        c = device_cache_for(cpu, 8 * MiB)
        assert c.device.type == "cpu" and c is dcm.shared_device_cache(8 * MiB, torch.device("cpu"))


def test_writer_rejects_a_tiny_device_cache(tmp_path):
    with pytest.raises(ValueError, match="device_cache_bytes"):
        DataStatesWriter(str(tmp_path / "c"), device_cache_bytes=100)


def test_async_save_through_the_writer_snapshots_into_the_first_level(tmp_path, monkeypatch):
    """``DataStatesWriter(device_cache_bytes=...)`` under ``dcp.async_save``: with the disk
    gated, the snapshot completes (the first level holds the state), the optimizer-free update
    that follows does not reach the checkpoint, and the load is bit-exact."""
    gate = threading.Event()
    real = storage.LocalSink.pwrite

    def gated(self, buf, offset, logical=None):  # the storage interface, wrapped
        assert gate.wait(60)
        return real(self, buf, offset, logical)

    monkeypatch.setattr(storage.LocalSink, "pwrite", gated)
    cap = 12 * MiB + 4096 * 5  # sizes no other test uses
    w = DataStatesWriter(str(tmp_path / "c"), host_cache_bytes=2 * MiB + 4096 * 5,
                         device_cache_bytes=cap, o_direct=False)
    state = _state(4, 2)
    expect = {k: v.clone() for k, v in state.items()}
    fut = dcp.async_save(state, storage_writer=w)
    assert w.wait_snapshot(timeout=30)
    for t in state.values():
        t.mul_(3.0)
    gate.set()
    fut.result(timeout=60)
    out = {k: torch.zeros_like(v) for k, v in expect.items()}
    dcp.load(out, storage_reader=DataStatesReader(str(tmp_path / "c")), no_dist=True)
    for k, v in expect.items():
        assert torch.equal(out[k], v), k
    dc = dcm.shared_device_cache(cap, dcm.default_device())
    assert dc.peak_used > 0 and dc.used == 0
