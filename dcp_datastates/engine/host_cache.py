"""The bounded host cache.

One buffer of ``capacity`` bytes, allocated once per process (pinned through
``cuda_ext`` when a GPU is usable, plain memory otherwise) and reused by every
later save.  ``prepare_host_cache`` allocates it in the background as soon as a
writer is made, so that the first snapshot does not wait for it: pinning
gigabytes takes seconds, which would otherwise be the first checkpoint's whole
stall.  Host memory used for staging therefore never
grows with the size of the state.  Space is handed out in 4 KiB-aligned
pieces; when the cache is full, ``alloc`` blocks until a flush frees space:
this is the back-pressure that keeps memory bounded.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from concurrent.futures import Future

import torch

import cuda_ext
from cuda_ext import pinned_buffer

from .. import process_state
from ..format.layout import ALIGNMENT, align_up

log = logging.getLogger(__name__)

DEFAULT_HOST_CACHE_BYTES = 2 << 30


def default_host_cache_bytes() -> int:
    """2 GiB, or ``DCP_DATASTATES_HOST_CACHE_BYTES`` when set."""
    env = os.environ.get("DCP_DATASTATES_HOST_CACHE_BYTES")
    return int(env) if env else DEFAULT_HOST_CACHE_BYTES


class HostCache:
    """The bounded staging buffer of one process: ``alloc`` hands out 4 KiB-aligned space and
    blocks while the buffer is full (back-pressure), ``try_alloc`` only takes what is free now,
    ``free`` gives it back."""

    level = "host"

    def __init__(self, capacity: int, *, pinned: bool = False) -> None:
        if capacity < ALIGNMENT:
            raise ValueError(f"{self.level}_cache_bytes must be at least {ALIGNMENT}, got {capacity}")
        self.capacity = align_up(capacity)
        self.pinned = pinned
        self._buf: torch.Tensor | None = None
        self._pinned_handle = None
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (start, size)
        self._cv = threading.Condition()
        self.used = 0
        self.peak_used = 0
        self.waits = 0
        self.allocations = 0
        self._preparing: Future | None = None

    # -- memory -------------------------------------------------------------
    def prepare(self) -> Future:
        """Allocate (and pin) the buffer on a background thread; :meth:`buffer` waits for that
        instead of allocating again.  Resolves when the buffer is ready."""
        with self._cv:
            if self._preparing is not None:
                return self._preparing
            fut = self._preparing = Future()
            if self._buf is not None:
                fut.set_result(None)
                return fut
        threading.Thread(target=self._prepare, args=(fut,), name="dcpds-cache-prepare").start()
        return fut

    def _prepare(self, fut: Future) -> None:
        try:
            buf = self._allocate()
        except Exception as e:  # noqa: BLE001 - logged; the first use allocates again and raises there
            log.warning("host cache of %d MiB could not be prepared in the background: %s: %s",
                        self.capacity >> 20, type(e).__name__, e)
            fut.set_result(None)  # never left pending: buffer() waits on it
            return
        with self._cv:
            if self._buf is None:
                self._buf = buf
        fut.set_result(None)

    def buffer(self) -> torch.Tensor:
        """The whole buffer (allocated now, unless a preparation is under way: then waited for)."""
        if self._buf is None:
            fut = self._preparing
            if fut is not None:
                fut.result()  # being prepared: wait for it rather than allocate twice
            with self._cv:
                if self._buf is None:
                    self._buf = self._allocate()
        return self._buf

    def _allocate(self) -> torch.Tensor:
        self.allocations += 1
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
        """``nbytes`` of the buffer from ``offset``, as a uint8 tensor."""
        return self.buffer()[offset:offset + nbytes]

    # -- allocation ---------------------------------------------------------
    def alloc(self, nbytes: int, abort: threading.Event | None = None) -> int:
        """Reserve ``nbytes``; blocks while the cache is full (back-pressure)."""
        need = align_up(max(nbytes, 1))
        if need > self.capacity:
            raise ValueError(f"request of {nbytes} bytes exceeds the {self.level} cache ({self.capacity})")
        with self._cv:
            waited = False
            while True:
                start = self._take(need)
                if start is not None:
                    return start
                if abort is not None and abort.is_set():
                    raise RuntimeError("save aborted while waiting for host cache space")
                if not waited:
                    self.waits += 1
                    waited = True
                self._cv.wait()  # woken by free() or, for an aborted save, by wake()

    def try_alloc(self, nbytes: int) -> int | None:
        """Reserve ``nbytes`` if there is room now; None otherwise (never blocks)."""
        with self._cv:
            return self._take(align_up(max(nbytes, 1)))

    def _take(self, need: int) -> int | None:
        for i, (start, size) in enumerate(self._free):  # first fit; caller holds the lock
            if size >= need:
                if size == need:
                    self._free.pop(i)
                else:
                    self._free[i] = (start + need, size - need)
                self.used += need
                self.peak_used = max(self.peak_used, self.used)
                return start
        return None

    def wake(self) -> None:
        """Wake every waiting ``alloc`` (a save was aborted: its waiter must see it)."""
        with self._cv:
            self._cv.notify_all()

    def free(self, offset: int, nbytes: int) -> None:
        """Give back space ``alloc`` returned (coalesced with its free neighbours) and wake
        whoever waits for room."""
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


# Process-wide on purpose: the host cache bounds the staging memory of the whole process (pinned
# memory is slow to allocate and scarce), so every writer shares one per (size, pinned).
_shared: dict[tuple[int, bool], HostCache] = {}
_shared_lock = threading.Lock()


def _forget_caches_in_child() -> None:
    """A forked child's caches are its parent's, mid-use by threads it does not have: it makes
    its own on first use (``snapshot._forget_engines_in_child``)."""
    global _shared_lock
    _shared_lock = threading.Lock()
    process_state.keep(dict(_shared))
    _shared.clear()


process_state.in_child(_forget_caches_in_child)


def shared_host_cache(capacity: int, pinned: bool) -> HostCache:
    """The process-wide cache of this size: writers made per step reuse one buffer.  A save of
    host tensors uses a pinned cache of that size when one exists (pinned memory serves it as
    well), rather than allocate a second buffer."""
    key = (align_up(capacity), pinned)
    with _shared_lock:
        c = _shared.get(key) or (_shared.get((key[0], True)) if not pinned else None)
        if c is None:
            c = _shared[key] = HostCache(capacity, pinned=pinned)
        return c


def prepare_host_cache(capacity: int) -> HostCache:
    """Start allocating the process's cache of ``capacity`` bytes in the background (pinned
    when a GPU is usable): called when a writer, ``Checkpointer`` or torchtitan manager is
    made, so the memory is committed then and the first snapshot finds it ready."""
    c = shared_host_cache(capacity, cuda_ext.available())
    c.prepare()
    return c
