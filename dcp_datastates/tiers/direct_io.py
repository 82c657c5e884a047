"""Cold reads of local files: O_DIRECT into a huge-page staging buffer, one copy into place.

Buffered reads pay for page-cache management (allocating and inserting small folios, then a
copy out): a cold restore read that way ran at a third to a half of the device's speed on the
machine of ``docs/benchmarks.md``.  O_DIRECT skips the page cache, but the memory it reads into
matters twice over:

* it must be aligned as the device requires (512 bytes on the virtio disk measured here, 4 bytes
  on NVMe), while PyTorch's allocations are 64-byte aligned, so reading straight into the
  destination tensor is often not allowed at all;
* a request can carry only so many memory segments (254 here), so memory scattered in 4 KiB
  pages splits each read into requests of about 1 MiB, whose fixed cost then dominates.

So each reader thread reads into its own staging buffer of 2 MiB transparent huge pages (aligned
for any device, physically contiguous in 2 MiB runs, so requests as large as the device takes)
and copies the range into place, at memory speed, far above the disk's: as fast as O_DIRECT
straight into page-aligned destinations, and faster than both 4 KiB-page staging and buffered
reads (``benchmarks/bench_read_paths.py``, ``docs/benchmarks.md``).

Ranges mostly in the page cache already are read buffered (memory beats any device), as are
short ranges (readahead serves runs of small tensors well) and files on file systems that
refuse O_DIRECT.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os

from ..format.layout import ALIGNMENT, align_down

log = logging.getLogger(__name__)

DIRECT_MIN = 256 << 10  # shorter ranges are read buffered
# Reads through the stage go in rounds of REQUEST_BYTES (the largest request most block devices
# take, so each round is one request); the stage holds one round and the partial block after
# it, rounded up to whole huge pages: 6 MiB per reader thread.  Larger stages measured no faster.
REQUEST_BYTES = 4 << 20
STAGE_BYTES = REQUEST_BYTES + ALIGNMENT
DEFAULT_ALIGN = (ALIGNMENT, ALIGNMENT)  # (memory, file offset): always sufficient
_MAX_IO = 1 << 30
_HUGE = 2 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once per process; None where it cannot be."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
    except (OSError, AttributeError):
        return None
    return lib


# -- what the kernel can tell us ---------------------------------------------------------------
_NR_CACHESTAT = 451  # the same number on every architecture (new syscalls share one table)
_cachestat_ok = True


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


def cached_bytes(fd: int, offset: int, nbytes: int) -> int | None:
    """Bytes of ``[offset, offset + nbytes)`` in the page cache (whole pages), or None where
    the kernel cannot tell (``cachestat`` is Linux 6.5 and later)."""
    global _cachestat_ok
    if not _cachestat_ok:
        return None
    libc = _libc()
    if not libc:
        _cachestat_ok = False
        return None
    st = _Cachestat()
    r = libc.syscall(ctypes.c_long(_NR_CACHESTAT), ctypes.c_int(fd),
                     ctypes.byref(_CachestatRange(offset, nbytes)), ctypes.byref(st), ctypes.c_uint(0))
    if r != 0:
        log.debug("cachestat unavailable (errno %d): cold reads assumed", ctypes.get_errno())
        _cachestat_ok = False
        return None
    return st.nr_cache * _PAGE


def evict_from_page_cache(directory: str) -> None:
    """Write back and drop a directory's files from the page cache (no privileges needed), so
    that the next read of them is cold: for fair load benchmarks."""
    for name in os.listdir(directory):
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
        finally:
            os.close(fd)


def mostly_cached(fd: int, offset: int, nbytes: int) -> bool:
    cached = cached_bytes(fd, offset, nbytes)
    return cached is not None and cached * 2 >= nbytes


class _Statx(ctypes.Structure):  # struct statx, up to stx_dio_offset_align (Linux 6.1), padded
    _fields_ = [("stx_mask", ctypes.c_uint32), ("_head", ctypes.c_uint8 * 148),
                ("stx_dio_mem_align", ctypes.c_uint32), ("stx_dio_offset_align", ctypes.c_uint32),
                ("_tail", ctypes.c_uint8 * 96)]


_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000


def dio_alignment(fd: int) -> tuple[int, int] | None:
    """``(memory, file offset)`` alignment O_DIRECT needs on this open file, from statx
    (``STATX_DIOALIGN``); None where the file system does not do O_DIRECT on it.  Where the
    kernel cannot tell, 4 KiB for both, which is always enough."""
    libc = _libc()
    statx = getattr(libc, "statx", None) if libc else None
    if statx is None:
        return DEFAULT_ALIGN
    st = _Statx()
    if statx(ctypes.c_int(fd), b"", ctypes.c_int(_AT_EMPTY_PATH), ctypes.c_uint(_STATX_DIOALIGN),
             ctypes.byref(st)) != 0 or not st.stx_mask & _STATX_DIOALIGN:
        return DEFAULT_ALIGN
    if st.stx_dio_mem_align == 0 or st.stx_dio_offset_align == 0:
        return None
    return int(st.stx_dio_mem_align), int(st.stx_dio_offset_align)


# -- reading ------------------------------------------------------------------------------------
class StagingBuffer:
    """Private anonymous memory, 2 MiB-aligned and advised for transparent huge pages."""

    def __init__(self, nbytes: int, huge_pages: bool = True) -> None:
        self.nbytes = -(-nbytes // _HUGE) * _HUGE
        self._map = mmap.mmap(-1, self.nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # THP not available: still correct, with smaller requests
                pass
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        shift = (-base) % _HUGE
        self.address = base + shift
        self.view = memoryview(self._map)[shift:shift + self.nbytes]

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # the ctypes probe still holds an export: the GC unmaps it
            pass


def pread_full(fd: int, mv: memoryview, offset: int) -> int:
    """Fill ``mv`` from ``offset`` of ``fd``; returns the bytes read (short at end of file)."""
    got = 0
    n = mv.nbytes
    while got < n:
        r = os.preadv(fd, [mv[got:got + _MAX_IO]], offset + got)
        if r <= 0:
            break
        got += r
    return got


def read_buffered(fd: int, mv: memoryview, offset: int) -> int:
    """A buffered read of ``mv.nbytes`` from ``offset`` (the path O_DIRECT is measured against)."""
    return pread_full(fd, mv, offset)


def read_direct(direct_fd: int, mv: memoryview, offset: int) -> int:
    """An O_DIRECT read into aligned memory (``offset`` and ``mv`` aligned as the file needs)."""
    return pread_full(direct_fd, mv, offset)


def read_staged(direct_fd: int, offset: int, n: int, address: int, stage: StagingBuffer,
                 off_align: int) -> int:
    """Whole aligned blocks around ``[offset, offset + n)`` into ``stage`` with O_DIRECT, then
    the range into ``address``; as many rounds as the stage needs.  Short only at end of file."""
    room = stage.nbytes - off_align  # the partial block after a round must fit too
    round_bytes = align_down(room, REQUEST_BYTES) or align_down(room, off_align)
    done = 0
    while done < n:
        start = offset + done
        a0 = align_down(start, off_align)
        take = min(n - done, round_bytes - (start - a0))
        a1 = -(-(start + take) // off_align) * off_align
        got = read_direct(direct_fd, stage.view[:a1 - a0], a0)
        valid = max(0, min(got - (start - a0), take))
        ctypes.memmove(address + done, stage.address + (start - a0), valid)  # releases the GIL
        done += valid
        if valid < take:
            break
    return done


def read_range(fd: int, offset: int, mv: memoryview, address: int, *, direct_fd: int | None = None,
               stage: StagingBuffer | None = None, align: tuple[int, int] | None = None,
               check_cache: bool = True) -> tuple[int, int]:
    """Fill ``mv`` (whose first byte is at memory ``address``) from file ``offset``.

    With ``direct_fd`` (the file opened with O_DIRECT, ``align`` its :func:`dio_alignment`)
    and a ``stage``, a cold range of at least ``DIRECT_MIN`` bytes is read through the stage;
    anything else through ``fd``.  Returns ``(bytes read, of which with O_DIRECT)``; short
    only at end of file."""
    n = mv.nbytes
    if direct_fd is None or stage is None or n < DIRECT_MIN or \
            (check_cache and mostly_cached(fd, offset, n)):
        return read_buffered(fd, mv, offset), 0
    _mem, off_align = align or DEFAULT_ALIGN
    try:
        got = read_staged(direct_fd, offset, n, address, stage, off_align)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        log.debug("O_DIRECT read refused (%s); reading buffered", e)
        return read_buffered(fd, mv, offset), 0
    return got, got
