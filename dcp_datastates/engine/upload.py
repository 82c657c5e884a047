"""Loads onto a GPU: storage reads land in pinned slabs and go to the device from there.

A pageable source makes a host-to-device copy synchronous and many times slower than a pinned
one (``docs/benchmarks.md``, GPU path).  So each reader thread reads a piece (at most
``SLAB_BYTES``) into a pinned slab, verifies it, and uploads it on a side stream straight into
the destination tensor's bytes; the slab is reused once its copy has landed, and the other
threads keep reading meanwhile, so storage reads and uploads overlap.  A piece of a resharded
(narrowed) chunk, or one loaded into another dtype, is uploaded whole into device scratch and
the box is cut out on the device.

Slabs are pinned once per process and reused; there are never more than reader threads.
Without cuda-python (or a GPU) nothing here is used: the reader copies from host memory.
"""

from __future__ import annotations

import contextlib
import threading

import torch

import cuda_ext

SLAB_BYTES = 16 << 20

# Process-wide on purpose: pinned slabs are slow to allocate, so they are pinned once and reused
# by every load of the process; never more than its reader threads.
_slabs: list[torch.Tensor] = []
_lock = threading.Lock()


@contextlib.contextmanager
def pinned_slab():
    """A pinned buffer of ``SLAB_BYTES`` for one piece (made on first need, then reused)."""
    with _lock:
        slab = _slabs.pop() if _slabs else None
    if slab is None:
        _handle, slab = cuda_ext.pinned_buffer(SLAB_BYTES)
    try:
        yield slab
    finally:
        with _lock:
            _slabs.append(slab)


def usable() -> bool:
    """Whether GPU destinations can stage through pinned slabs (cuda-python and a GPU)."""
    return cuda_ext.available()


class DeviceUpload:
    """The uploads of one load: one side stream per destination device."""

    def __init__(self, devices) -> None:
        self._up = {torch.device(d): cuda_ext.H2DUploader(d) for d in devices}

    def piece(self, dest_bytes: torch.Tensor, slab: torch.Tensor) -> None:
        """Upload ``slab[:n]`` into ``dest_bytes`` (``n`` bytes of a device tensor) and wait
        until the slab may be reused."""
        n = dest_bytes.numel()
        self._up[dest_bytes.device].upload(dest_bytes, slab[:n]).synchronize()

    def box(self, dest: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype, shape, strides,
            offset: int) -> None:
        """Upload host bytes ``raw`` through the slabs into device scratch, then copy the box
        (``as_strided`` of elements of ``dtype``) into device tensor ``dest``."""
        up = self._up[dest.device]
        tmp = up.empty(raw.numel())
        with pinned_slab() as slab:
            for a in range(0, raw.numel(), SLAB_BYTES):
                n = min(SLAB_BYTES, raw.numel() - a)
                slab[:n].copy_(raw[a:a + n])
                up.upload(tmp[a:a + n], slab[:n]).synchronize()
        up.copy_box(dest, tmp, dtype, shape, strides, offset)

    def finish(self) -> None:
        """The caller's streams wait for every upload (the state is usable after this)."""
        for u in self._up.values():
            u.finish()
