"""Loads onto a GPU: storage reads land in pinned slabs and go to the device from there.

A pageable source makes a host-to-device copy synchronous and many times slower than a pinned
one (``docs/benchmarks.md``, GPU path).  So a whole chunk bound for a GPU tensor is read piece
by piece (at most ``SLAB_BYTES``) into pinned slabs, each verified and uploaded on a side
stream straight into the destination's bytes.  A reader never waits for its own upload:
``StagedPieces`` holds ``DEPTH`` slabs per reader thread, and a reader takes the slab whose
upload was submitted first, waiting only where that one has not landed yet; so the reads stay
in flight while earlier slabs upload, and the drive is kept busy.  A piece of a resharded
(narrowed) chunk, or one loaded into another dtype, is uploaded whole into device scratch and
the box is cut out on the device.

Slabs are pinned once per process and reused by every load (at most ``DEPTH`` per reader
thread of the largest load).  Without cuda-python (or a GPU) the GPU side is not used; the same
pipeline runs with ``HostUpload``, a stand-in for the copy engine that lands pieces in host
destinations after a fixed latency, so tests and the CPU proxy exercise it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

import cuda_ext

from .. import process_state

SLAB_BYTES = 16 << 20
DEPTH = 2  # slabs per reader thread: one being read into while the other uploads

# Process-wide on purpose: pinned slabs are slow to allocate, so they are pinned once and reused
# by every load of the process.
_slabs: list[torch.Tensor] = []
_lock = threading.Lock()


@process_state.in_child
def _forget_slabs_in_child() -> None:
    """A forked child cannot use its parent's pinned slabs (nor its CUDA streams)."""
    global _lock
    _lock = threading.Lock()
    process_state.keep(list(_slabs))
    _slabs.clear()


process_state.in_child(cuda_ext.after_fork_in_child)


def _pinned() -> torch.Tensor:
    with _lock:
        if _slabs:
            return _slabs.pop()
    _handle, slab = cuda_ext.pinned_buffer(SLAB_BYTES)
    return slab


def _give_back(slab: torch.Tensor) -> None:
    with _lock:
        _slabs.append(slab)


def usable() -> bool:
    """Whether GPU destinations can stage through pinned slabs (cuda-python and a GPU)."""
    return cuda_ext.available()


class UploadEvent(Protocol):
    """When an upload has landed (a CUDA event, or ``HostUpload``'s)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class Slot:
    """A slab taken for one piece; ``uploading`` records the upload that reads it (an event
    with ``query`` and ``synchronize``), after which the slab may be taken again."""

    slab: torch.Tensor
    pending: UploadEvent | None = None

    def uploading(self, event: UploadEvent) -> None:
        self.pending = event


@dataclass
class StagedPieces:
    """The slabs of one load's streamed pieces: at most ``count``, made by ``make`` (and given
    back by ``give_back`` at ``close``)."""

    count: int
    make: Callable[[], torch.Tensor] = _pinned
    give_back: Callable[[torch.Tensor], None] = _give_back
    _free: collections.deque = field(default_factory=collections.deque)
    _made: int = 0
    _cv: threading.Condition = field(default_factory=threading.Condition)

    @contextlib.contextmanager
    def slot(self):
        """A slab to read one piece into, free of any earlier upload."""
        slab, pending = self._take()
        if pending is not None:  # landed already, or the oldest upload; one that failed raises here
            pending.synchronize()
        slot = Slot(slab)
        try:
            yield slot
        finally:
            with self._cv:
                self._free.append((slab, slot.pending))
                self._cv.notify()

    def _take(self) -> tuple[torch.Tensor, UploadEvent | None]:
        """A free slab whose upload landed; else a new one, up to ``count``; else the slab
        whose upload was submitted first.  Its caller synchronizes with the upload it returns
        (at once where it landed: an upload that failed raises there)."""
        with self._cv:
            while True:
                for i, (slab, pending) in enumerate(self._free):
                    if pending is None or pending.query():
                        del self._free[i]
                        return slab, pending
                if self._made < self.count:
                    self._made += 1
                    break
                if self._free:
                    return self._free.popleft()
                self._cv.wait()
        return self.make(), None

    def close(self) -> None:
        """Wait for every upload, and give the slabs back."""
        with self._cv:
            free, self._free = list(self._free), collections.deque()
        for slab, pending in free:
            if pending is not None:
                pending.synchronize()
            self.give_back(slab)


class DeviceUpload:
    """The uploads of one load: one side stream per destination device."""

    device_type = "cuda"

    def __init__(self, devices) -> None:
        self._up = {torch.device(d): cuda_ext.H2DUploader(d) for d in devices}

    def staging(self, readers: int) -> StagedPieces:
        """The pinned slabs of this load's streamed pieces."""
        return StagedPieces(max(1, readers) * DEPTH)

    def piece(self, dest_bytes: torch.Tensor, slab: torch.Tensor):
        """Upload ``slab[:n]`` into ``dest_bytes`` (``n`` bytes of a device tensor); the event
        marks when the slab may be reused."""
        n = dest_bytes.numel()
        return self._up[dest_bytes.device].upload(dest_bytes, slab[:n])

    def box(self, dest: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype, shape, strides,
            offset: int) -> None:
        """Upload host bytes ``raw`` through a slab into device scratch, then copy the box
        (``as_strided`` of elements of ``dtype``) into device tensor ``dest``."""
        up = self._up[dest.device]
        tmp = up.empty(raw.numel())
        slab = _pinned()
        try:
            for a in range(0, raw.numel(), SLAB_BYTES):
                n = min(SLAB_BYTES, raw.numel() - a)
                slab[:n].copy_(raw[a:a + n])
                up.upload(tmp[a:a + n], slab[:n]).synchronize()
        finally:
            _give_back(slab)
        up.copy_box(dest, tmp, dtype, shape, strides, offset)

    def finish(self) -> None:
        """The caller's streams wait for every upload (the state is usable after this)."""
        for u in self._up.values():
            u.finish()


class _Landed(Future):
    """A ``HostUpload`` piece: an event as CUDA's, over a future."""

    def query(self) -> bool:
        return self.done()

    def synchronize(self) -> None:
        self.result()


class HostUpload:
    """A stand-in for a GPU's copy engine with host destinations: each piece lands (is copied
    into its destination) ``latency_s`` after it was submitted, in submission order, on a thread
    of its own, and the caller does not wait for it.  Boxes are cut on the host."""

    device_type = "cpu"

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dcpds-host-upload", daemon=True)
        self._thread.start()

    def staging(self, readers: int) -> StagedPieces:
        return StagedPieces(max(1, readers) * DEPTH, make=lambda: torch.empty(SLAB_BYTES, dtype=torch.uint8),
                            give_back=lambda slab: None)

    def piece(self, dest_bytes: torch.Tensor, slab: torch.Tensor) -> _Landed:
        ev = _Landed()
        with self._cv:
            self._q.append((time.monotonic() + self.latency_s, dest_bytes, slab[:dest_bytes.numel()], ev))
            self._cv.notify()
        return ev

    def box(self, dest: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype, shape, strides,
            offset: int) -> None:
        usable_bytes = raw.numel() // dtype.itemsize * dtype.itemsize
        typed = raw[:usable_bytes].view(dtype)
        dest.copy_(typed.as_strided(shape, strides, offset) if shape else typed[offset:offset + 1].reshape(()))

    def finish(self) -> None:
        """Every piece submitted has landed; the thread ends."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    return
                due, dest, src, ev = self._q.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                dest.copy_(src)
            except Exception as e:  # noqa: BLE001 - delivered through the piece's event
                ev.set_exception(e)
                continue
            ev.set_result(None)


__all__ = ["DEPTH", "SLAB_BYTES", "DeviceUpload", "HostUpload", "Slot", "StagedPieces", "UploadEvent", "usable"]
