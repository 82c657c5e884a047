"""The GPU's streamed load path, run on the CPU: whole chunks read piece by piece into staging
slabs and handed to uploads that land later (``engine/upload.py``).  ``HostUpload`` stands in
for the GPU's copy engine with host destinations; plain ``dcp.load`` drives it."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.engine.upload import DEPTH, SLAB_BYTES, HostUpload


class Watched(HostUpload):
    """The stand-in, noting at each submitted piece how many earlier ones had not landed yet,
    and which slabs the pieces came from; ``fail_at``: that piece's copy raises."""

    def __init__(self, latency_s: float = 0.0, fail_at: int | None = None) -> None:
        super().__init__(latency_s)
        self.lock = threading.Lock()
        self.events: list = []
        self.in_flight: list[int] = []
        self.slabs: set[int] = set()
        self.fail_at = fail_at

    def piece(self, dest_bytes, slab):
        with self.lock:
            if len(self.events) == self.fail_at:
                dest_bytes = torch.zeros(1, dtype=torch.uint8).expand(dest_bytes.numel())  # writing it raises
            self.in_flight.append(sum(1 for e in self.events if not e.done()))
            self.slabs.add(slab.data_ptr())
            ev = super().piece(dest_bytes, slab)
            self.events.append(ev)
            return ev


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(3 * SLAB_BYTES // 4 + 123, generator=g),  # three slabs and a bit
            "mid": torch.randn(1000, 700, generator=g), "small": torch.randn(5, generator=g), "step": 7}


def _saved(tmp_path) -> tuple[str, dict]:
    path = str(tmp_path / "ck")
    sd = _state()
    dcp.save(sd, storage_writer=DataStatesWriter(path), no_dist=True)
    return path, sd


def _load(path: str, up: HostUpload, threads: int, into: dict | None = None) -> dict:
    got = into or {"big": torch.zeros_like(_state()["big"]), "mid": torch.zeros(1000, 700),
                   "small": torch.zeros(5), "step": 0}
    dcp.load(got, storage_reader=DataStatesReader(path, thread_count=threads, _host_uploads=lambda: up),
             no_dist=True)
    return got


@pytest.mark.parametrize("threads", [1, 4])
def test_a_streamed_load_lands_every_byte(tmp_path, threads):
    path, sd = _saved(tmp_path)
    up = Watched(latency_s=0.01)
    got = _load(path, up, threads)
    for k in ("big", "mid", "small"):
        assert torch.equal(got[k], sd[k]), k
    assert got["step"] == 7
    assert len(up.in_flight) >= 4  # the big tensor went as pieces through the slabs


def test_a_reader_reads_on_while_its_last_upload_is_in_flight(tmp_path):
    """One reader thread and an upload slower than a read from the page cache: each piece after
    the first is submitted while the one before it has not landed (a reader that waited for
    its own upload, as the path did before, would always find none in flight)."""
    path, sd = _saved(tmp_path)
    up = Watched(latency_s=0.3)
    got = _load(path, up, threads=1)
    assert torch.equal(got["big"], sd["big"])
    assert max(up.in_flight) >= 1, up.in_flight
    assert len(up.slabs) <= DEPTH  # staging memory: DEPTH slabs per reader, whatever the state


def test_the_slabs_are_bounded_by_the_readers(tmp_path):
    path, _sd = _saved(tmp_path)
    up = Watched(latency_s=0.05)
    _load(path, up, threads=4)
    assert len(up.slabs) <= 4 * DEPTH, len(up.slabs)


def test_an_upload_that_fails_fails_the_load(tmp_path):
    path, _sd = _saved(tmp_path)
    with pytest.raises(BaseException, match="unsupported operation|memory location"):
        _load(path, Watched(latency_s=0.0, fail_at=1), threads=1)
