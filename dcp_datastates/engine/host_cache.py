"""The bounded host cache.

One buffer of ``capacity`` bytes, allocated once per process on first use
(pinned through ``cuda_ext`` when a GPU is usable, plain memory otherwise)
and reused by every later save.  Host memory used for staging therefore never
grows with the size of the state.  Space is handed out in 4 KiB-aligned
pieces; when the cache is full, ``alloc`` blocks until a flush frees space:
this is the back-pressure that keeps memory bounded.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading

import torch

from ..format.layout import ALIGNMENT, align_up
from cuda_ext import pinned_buffer

log = logging.getLogger(__name__)

DEFAULT_HOST_CACHE_BYTES = 2 << 30


def default_host_cache_bytes() -> int:
    """2 GiB, or ``DCP_DATASTATES_HOST_CACHE_BYTES`` when set."""
    env = os.environ.get("DCP_DATASTATES_HOST_CACHE_BYTES")
    return int(env) if env else DEFAULT_HOST_CACHE_BYTES


class HostCache:
    def __init__(self, capacity: int, *, pinned: bool = False) -> None:
        if capacity < ALIGNMENT:
            raise ValueError(f"host_cache_bytes must be at least {ALIGNMENT}, got {capacity}")
        self.capacity = align_up(capacity)
        self.pinned = pinned
        self._buf: torch.Tensor | None = None
        self._pinned_handle = None
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (start, size)
        self._cv = threading.Condition()
        self.used = 0
        self.peak_used = 0
        self.waits = 0

    # -- memory -------------------------------------------------------------
    def buffer(self) -> torch.Tensor:
        if self._buf is None:
            with self._cv:
                if self._buf is None:
                    self._buf = self._allocate()
        return self._buf

    def _allocate(self) -> torch.Tensor:
        if self.pinned:
            self._pinned_handle, buf = pinned_buffer(self.capacity)
            log.info("host cache: %d MiB pinned", self.capacity >> 20)
            return buf
        log.info("host cache: %d MiB (pageable)", self.capacity >> 20)
        # page-aligned start, so that every 4 KiB-aligned slice can feed an O_DIRECT write
        raw = torch.empty(self.capacity + ALIGNMENT, dtype=torch.uint8)
        shift = (-raw.data_ptr()) % ALIGNMENT
        return raw[shift:shift + self.capacity]

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer()[offset:offset + nbytes]

    # -- allocation ---------------------------------------------------------
    def alloc(self, nbytes: int, abort: threading.Event | None = None) -> int:
        """Reserve ``nbytes``; blocks while the cache is full (back-pressure)."""
        need = align_up(max(nbytes, 1))
        if need > self.capacity:
            raise ValueError(f"request of {nbytes} bytes exceeds the host cache ({self.capacity})")
        with self._cv:
            waited = False
            while True:
                for i, (start, size) in enumerate(self._free):
                    if size >= need:
                        if size == need:
                            self._free.pop(i)
                        else:
                            self._free[i] = (start + need, size - need)
                        self.used += need
                        self.peak_used = max(self.peak_used, self.used)
                        return start
                if abort is not None and abort.is_set():
                    raise RuntimeError("save aborted while waiting for host cache space")
                if not waited:
                    self.waits += 1
                    waited = True
                self._cv.wait()  # woken by free() or, for an aborted save, by wake()

    def wake(self) -> None:
        """Wake every waiting ``alloc`` (a save was aborted: its waiter must see it)."""
        with self._cv:
            self._cv.notify_all()

    def free(self, offset: int, nbytes: int) -> None:
        size = align_up(max(nbytes, 1))
        with self._cv:
            i = bisect.bisect_left(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            # coalesce with neighbours
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free[i + 1][1])
                self._free.pop(i + 1)
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                self._free.pop(i)
            self.used -= size
            self._cv.notify_all()


_shared: dict[tuple[int, bool], HostCache] = {}
_shared_lock = threading.Lock()


def shared_host_cache(capacity: int, pinned: bool) -> HostCache:
    """The process-wide cache of this size: writers made per step reuse one buffer."""
    key = (align_up(capacity), pinned)
    with _shared_lock:
        c = _shared.get(key)
        if c is None:
            c = _shared[key] = HostCache(capacity, pinned=pinned)
        return c
