"""The device cache: the first cache level, a buffer on the accelerator itself.

With a device cache, a lazy snapshot copies a device tensor into this buffer (device to device,
on the copy stream, at the device's memory bandwidth) instead of into the host cache, so the
snapshot, and with it the optimizer's wait, ends after that copy.  The engine then drains the
buffer through the host cache to storage in the background.  A batch that finds no room here
(``try_alloc``: the level never blocks) goes to the host cache as without this level, and waits
there as before: that is the back-pressure across both levels.

The buffer is one allocation through torch's caching allocator (so training's memory accounting
sees it), made once per process and size and reused by every save.  It stays reserved for the
life of the process.  With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` it is mapped
into an expandable segment like any other tensor; without it, it is one segment of its own.

On a process without a GPU the level lives in host memory: it then behaves as a second host
cache that never blocks, which is how CI exercises the two-level scheduling.
"""

from __future__ import annotations

import logging
import threading

import torch

from .. import process_state
from .host_cache import HostCache

log = logging.getLogger(__name__)


class DeviceCache(HostCache):
    """A :class:`HostCache` whose buffer lives on ``device`` (host memory for ``cpu``)."""

    level = "device"

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, pinned=False)
        self.device = torch.device(device)

    def holds(self, t: torch.Tensor | None) -> bool:
        """``t`` lives on this cache's device, so a copy into the cache stays on the device."""
        return t is not None and t.device == self.device

    def _allocate(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return super()._allocate()
        self.allocations += 1
        log.info("device cache: %d MiB on %s", self.capacity >> 20, self.device)
        return torch.empty(self.capacity, dtype=torch.uint8, device=self.device)


# Process-wide on purpose: device memory is the process's, and every writer of the process
# shares one cache per (size, device) rather than each taking its own.
_shared: dict[tuple[int, str], DeviceCache] = {}
_lock = threading.Lock()


@process_state.in_child
def _forget_device_caches_in_child() -> None:
    """A forked child cannot use its parent's device memory: it makes its own cache on first use."""
    global _lock
    _lock = threading.Lock()
    process_state.keep(dict(_shared))
    _shared.clear()


def default_device() -> torch.device:
    """The device of this process's accelerator state: the current GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shared_device_cache(capacity: int, device: torch.device) -> DeviceCache:
    """The process-wide device cache of this size on ``device`` (made once, then reused)."""
    device = torch.device(device)  # callers pass an indexed device (a tensor's, default_device())
    key = (capacity, str(device))
    with _lock:
        c = _shared.get(key)
        if c is None:
            c = _shared[key] = DeviceCache(capacity, device)
        return c


def device_cache_for(sources: list[torch.Tensor], capacity: int) -> DeviceCache | None:
    """The device cache a save of ``sources`` uses: on the device of its GPU tensors, or in host
    memory when the process has no GPU; None when ``capacity`` is 0 or the state has no tensor
    on the process's accelerator."""
    if capacity <= 0:
        return None
    dev = next((t.device for t in sources if t.device.type == "cuda"), None)
    if dev is None:
        if torch.cuda.is_available():
            return None  # host tensors on a GPU machine: the host cache is their first level
        dev = torch.device("cpu")
    return shared_device_cache(capacity, dev)


def prepare_device_cache(capacity: int) -> DeviceCache | None:
    """Allocate the device cache in the background (writer, ``Checkpointer``, torchtitan manager
    construction), so the first snapshot finds it ready; None when ``capacity`` is 0."""
    if capacity <= 0:
        return None
    c = shared_device_cache(capacity, default_device())
    c.prepare()
    return c
