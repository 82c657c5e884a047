"""The CUDA layer of dcp-datastates, on cuda-python.  Nothing CUDA-specific lives elsewhere.

What it provides to the engine:

* :func:`available` — whether a GPU, a driver and cuda-python are all usable.  Probed
  lazily (never at import), cached, and silent: on a CPU-only machine it returns False
  with one DEBUG log line giving the reason (:func:`unavailable_reason`).
* :func:`pinned_buffer` — the host cache's memory: one ``cudaHostAlloc`` (portable) of the
  whole cache, allocated once, from a thread bound to the GPU's NUMA node so the pages land
  there, wrapped zero-copy as a ``torch.uint8`` tensor.
* :func:`record_ready` — an event recorded on the caller's current torch stream: the point
  after which the snapshot's copies may start (RAW ordering).
* :class:`D2HCopier` — one non-blocking copy stream per device; waits on the ready event,
  issues ``cudaMemcpyAsync`` device-to-host per piece, records an event per batch for the
  flush threads, and keeps source tensors alive until the stream has passed them.

Both cuda-python layouts are handled: ``cuda.bindings.runtime`` (12.6.1+ and 13.x) and the
older ``cuda.cudart`` (12.6.0 and before).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import warnings
from typing import Any

import torch

log = logging.getLogger(__name__)

# cuda-python's runtime module: compiled, without type stubs, so it is typed ``Any`` here.
_rt: Any = None
_rt_loaded = False
_available: bool | None = None
_reason = ""
_lock = threading.Lock()


def _runtime() -> Any:
    """The cuda-python runtime module, or None (never raises, never warns)."""
    global _rt, _rt_loaded
    if _rt_loaded:
        return _rt
    _rt_loaded = True
    try:
        from cuda.bindings import runtime as rt  # pyright: ignore[reportAttributeAccessIssue] (compiled)
        _rt = rt
    except ImportError:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from cuda import cudart as rt  # pyright: ignore[reportAttributeAccessIssue] (<= 12.6.0)
            _rt = rt
        except ImportError:
            _rt = None
    return _rt


class CudaError(RuntimeError):
    pass


def check(result, what: str = "") -> Any:
    """Unpack a cuda-python ``(err, *values)`` tuple; raise :class:`CudaError` on failure."""
    err, *vals = result
    if int(err) != 0:
        rt = _runtime()
        try:
            name = rt.cudaGetErrorName(err)[1].decode()
        except (AttributeError, TypeError, ValueError, IndexError):  # no name: the number will do
            name = str(err)
        raise CudaError(f"{what} failed: {name}")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else tuple(vals)


def available() -> bool:
    """True when torch sees a GPU and cuda-python can drive it.  Cached after the first call."""
    global _available, _reason
    if _available is not None:
        return _available
    with _lock:
        if _available is not None:
            return _available
        ok, why = False, ""
        if os.environ.get("DCP_DATASTATES_DISABLE_CUDA"):
            why = "disabled by DCP_DATASTATES_DISABLE_CUDA"
        elif not torch.cuda.is_available():
            why = "torch sees no CUDA device"
        elif _runtime() is None:
            why = "cuda-python is not installed (pip install 'dcp-datastates[cuda]')"
        else:
            try:
                n = check(_runtime().cudaGetDeviceCount(), "cudaGetDeviceCount")
                ok, why = n > 0, "" if n > 0 else "no CUDA device"
            except Exception as e:  # noqa: BLE001 - older bindings raise their own types without a driver
                why = f"CUDA runtime unusable: {e}"
        _available, _reason = ok, why
        if not ok:
            log.debug("cuda_ext unavailable: %s; the engine uses CPU copies", why)
        return ok


def unavailable_reason() -> str:
    available()
    return _reason


_tls = threading.local()


def _set_device(device: int) -> None:
    if getattr(_tls, "device", None) != device:
        check(_runtime().cudaSetDevice(device), "cudaSetDevice")
        _tls.device = device


def _sysfs_pci_name(raw: object) -> str:
    """The sysfs name (``dddd:bb:dd.f``, lower case) of the PCI address the CUDA runtime gives
    (bytes or str, NUL-padded, with a 4- or 8-digit domain)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    if not isinstance(text, str):
        raise ValueError(f"not a PCI address: {raw!r}")
    name = text.strip("\0").strip().lower()
    domain, _, rest = name.partition(":")
    if len(domain) == 8:
        domain = domain[4:]
    if len(domain) != 4 or rest.count(":") != 1 or "." not in rest:
        raise ValueError(f"not a PCI address: {raw!r}")
    return f"{domain}:{rest}"


def _cpus_of_pci_device(name: str, sysfs: str = "/sys") -> set[int] | None:
    """CPUs of the NUMA node PCI device ``name`` hangs off (None when sysfs does not say)."""
    try:
        with open(f"{sysfs}/bus/pci/devices/{name}/numa_node") as f:
            node = int(f.read())
        if node < 0:
            return None
        with open(f"{sysfs}/devices/system/node/node{node}/cpulist") as f:
            parts = f.read().strip().split(",")
    except (OSError, ValueError) as e:
        log.debug("no NUMA node for PCI device %s (%s)", name, e)
        return None
    cpus: set[int] = set()
    for part in parts:
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def _numa_cpus(device: int) -> set[int] | None:
    """CPUs of the NUMA node the GPU hangs off (None when unknown: pinning then has no hint)."""
    try:
        raw = check(_runtime().cudaDeviceGetPCIBusId(32, device), "cudaDeviceGetPCIBusId")
        return _cpus_of_pci_device(_sysfs_pci_name(raw))
    except (RuntimeError, ValueError) as e:
        log.debug("no PCI address for GPU %d (%s): no NUMA hint", device, e)
        return None


class PinnedHandle:
    """Owns one cudaHostAlloc allocation; frees it when collected."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes

    def __del__(self):
        rt = _runtime()
        if rt is not None and self.ptr:
            try:
                rt.cudaFreeHost(self.ptr)
            except Exception as e:  # noqa: BLE001 - a finalizer must not raise; say what leaked
                log.warning("cudaFreeHost of %d bytes failed: %s", self.nbytes, e)
            self.ptr = 0


def pinned_buffer(nbytes: int, device: int | None = None) -> tuple[PinnedHandle, torch.Tensor]:
    """Allocate ``nbytes`` of pinned host memory near ``device``; return (owner, uint8 view)."""
    rt = _runtime()
    device = torch.cuda.current_device() if device is None else device
    result: dict = {}

    def alloc():
        try:
            cpus = _numa_cpus(device)
            if cpus:
                os.sched_setaffinity(0, cpus)  # first touch by the driver lands on this node
            _set_device(device)
            result["ptr"] = check(rt.cudaHostAlloc(nbytes, rt.cudaHostAllocPortable), "cudaHostAlloc")
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            result["err"] = e

    t = threading.Thread(target=alloc, name="dcpds-pin")  # affinity change stays in that thread
    t.start()
    t.join()
    if "err" in result:
        raise result["err"]
    ptr = result["ptr"]
    handle = PinnedHandle(ptr, nbytes)
    arr = (ctypes.c_ubyte * nbytes).from_address(ptr)
    view = torch.frombuffer(arr, dtype=torch.uint8, count=nbytes)
    view._dcpds_owner = handle  # pyright: ignore[reportAttributeAccessIssue] (keeps the allocation alive)
    return handle, view


class Event:
    def __init__(self, ev, device: int) -> None:
        self.ev, self.device = ev, device

    def synchronize(self) -> None:
        _set_device(self.device)
        check(_runtime().cudaEventSynchronize(self.ev), "cudaEventSynchronize")

    def __del__(self):
        rt = _runtime()
        if rt is not None:
            try:
                rt.cudaEventDestroy(self.ev)
            except Exception as e:  # noqa: BLE001 - a finalizer must not raise; say what leaked
                log.warning("cudaEventDestroy failed: %s", e)


def _new_event(device: int) -> Event:
    rt = _runtime()
    _set_device(device)
    flags = rt.cudaEventDisableTiming | rt.cudaEventBlockingSync
    return Event(check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags"), device)


def _torch_stream_handle(device: int):
    h = torch.cuda.current_stream(device).cuda_stream
    return h if h else _runtime().cudaStreamLegacy  # 0 is the legacy default stream


def record_ready(device: int) -> Event:
    """Record on the caller's current torch stream the point the snapshot copies must follow."""
    ev = _new_event(device)
    check(_runtime().cudaEventRecord(ev.ev, _torch_stream_handle(device)), "cudaEventRecord")
    return ev


_streams: dict[int, Any] = {}  # a cudaStream_t per device, created once: streams are per process


def after_fork_in_child() -> None:
    """In a forked child: a fresh lock (a parent's thread may have held this one) and none of
    the parent's streams (CUDA its parent initialised is not the child's to use)."""
    global _lock
    _lock = threading.Lock()
    _streams.clear()


def copy_stream(device: int) -> Any:
    """The device's non-blocking copy stream (one per device, created once)."""
    with _lock:
        s = _streams.get(device)
        if s is None:
            rt = _runtime()
            _set_device(device)
            s = _streams[device] = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking),
                                         "cudaStreamCreateWithFlags")
        return s


class D2HCopier:
    """The copies of one snapshot on the device's side stream: device to host, and device to
    device into the device cache (the engine's first level)."""

    def __init__(self, device: int, ready: Event | None) -> None:
        self.device = device
        self.rt = _runtime()
        _set_device(device)
        self.stream = copy_stream(device)
        self.torch_stream = torch.cuda.ExternalStream(int(self.stream), device=device)
        if ready is not None:
            check(self.rt.cudaStreamWaitEvent(self.stream, ready.ev, 0), "cudaStreamWaitEvent")
        self._keep: list[torch.Tensor] = []  # sources stay alive until the stream passes them
        self.bytes = 0

    def prepare(self, t: torch.Tensor) -> torch.Tensor:
        """Make a GPU source contiguous, its conjugate or negative bit resolved, on the copy
        stream (after the ready point)."""
        if t.device.type == "cuda" and (not t.is_contiguous() or t.is_conj() or t.is_neg()):
            with torch.cuda.stream(self.torch_stream):
                t = t.resolve_conj().resolve_neg().contiguous()
        return t

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.device.type != "cuda":
            dst.copy_(src)
            return
        n = src.numel() * src.element_size()
        if n == 0:
            return
        if not dst.is_contiguous() or not src.is_contiguous():
            raise ValueError("D2HCopier needs contiguous source and destination")
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice if dst.device.type == "cuda" \
            else self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        check(self.rt.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), n, kind, self.stream),
              "cudaMemcpyAsync")
        self._keep.append(src)
        self.bytes += n

    def zero(self, dst: torch.Tensor) -> None:
        """Zero ``dst`` in stream order with the copies (a device region), or now (host)."""
        if dst.device.type == "cuda":
            with torch.cuda.stream(self.torch_stream):
                dst.zero_()
        else:
            dst.zero_()

    def record(self) -> Event:
        ev = _new_event(self.device)
        check(self.rt.cudaEventRecord(ev.ev, self.stream), "cudaEventRecord")
        return ev

    def synchronize(self) -> None:
        _set_device(self.device)
        check(self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        self._keep.clear()


class H2DUploader:
    """Host-to-device copies of one load on a side stream of ``device``: each ``upload`` is
    ordered after the destination's allocation and returns an event that marks when the pinned
    source may be reused; ``finish`` makes the caller's stream wait for every upload."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # destinations exist

    def upload(self, dst: torch.Tensor, src: torch.Tensor):
        """Copy pinned ``src`` into device ``dst`` (same bytes, both contiguous), asynchronously."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def empty(self, nbytes: int) -> torch.Tensor:
        """Device scratch of ``nbytes`` in this stream's order."""
        with torch.cuda.stream(self.stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_box(self, dst: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype, shape, strides,
                 offset: int) -> None:
        """Copy the box ``as_strided(shape, strides, offset)`` of device bytes ``raw`` (elements
        of ``dtype``) into ``dst``, on the device, in this stream's order (casting if needed)."""
        with torch.cuda.stream(self.stream):
            usable = raw.numel() // dtype.itemsize * dtype.itemsize
            typed = raw[:usable].view(dtype)
            dst.copy_(typed.as_strided(shape, strides, offset) if shape else typed[offset:offset + 1].reshape(()))

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.stream.synchronize()


__all__ = ["CudaError", "after_fork_in_child", "D2HCopier", "H2DUploader", "Event", "available", "check", "copy_stream",
           "pinned_buffer", "record_ready", "unavailable_reason"]
