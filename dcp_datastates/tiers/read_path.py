"""Which cold-read path a file system serves best: O_DIRECT through the staging buffer, or
buffered reads.

Neither wins everywhere: on one machine of ``docs/benchmarks.md`` O_DIRECT through huge-page
staging reads a cold checkpoint faster than buffered reads, on another buffered reads won.  So
before the
first load of ``PROBE_MIN_LOAD`` or more from a file system, the reader measures: on as many
threads as the load uses, each thread reads ``PROBE_BYTES`` of one data file with O_DIRECT, then
each reads another region buffered, and the wall-clock rate of each round decides (O_DIRECT
unless buffered was ``MARGIN`` faster).  The choice holds for the process and is logged
(:func:`choices`).

Why a probe and not the load's own reads, timed one by one: a buffered read's time leaves out
the readahead it starts, which later reads then find cached, so per-read timing made buffered
reads look twice as fast as O_DIRECT on a disk where whole loads ran slower buffered.  Wall
clock over a round of concurrent reads counts the device's work either way.

Cost: ``threads x PROBE_BYTES`` read each way (32 MiB with the default 8 threads).  The
buffered regions stay in the page cache and serve the load; only the O_DIRECT ones are read
twice.  Regions already in the page cache are not probed (they would measure memory).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import process_state
from . import direct_io
from .direct_io import StagingBuffer, mostly_cached

log = logging.getLogger(__name__)

PROBE_BYTES = 4 << 20  # per thread and path
PROBE_MIN_LOAD = 512 << 20  # smaller loads keep O_DIRECT without probing
MARGIN = 1.10  # buffered must be this much faster to replace O_DIRECT (noise guard)


@dataclass(frozen=True, slots=True)
class ReadPathChoice:
    """The measured read path of one file system."""

    direct: bool
    direct_gbps: float
    buffered_gbps: float
    probe_bytes: int  # per path

    def describe(self) -> str:
        way = "O_DIRECT" if self.direct else "buffered"
        return (f"{way} (probe: O_DIRECT {self.direct_gbps:.2f} GB/s, buffered "
                f"{self.buffered_gbps:.2f} GB/s, {self.probe_bytes >> 20} MiB each)")


# Process-wide on purpose: the read path is measured once per file system (st_dev) and process.
_choices: dict[int, ReadPathChoice] = {}
_lock = threading.Lock()


def _new_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()


process_state.in_child(_new_lock_in_child)


def choices() -> dict[int, ReadPathChoice]:
    """The choices made in this process, by ``st_dev``."""
    with _lock:
        return dict(_choices)


def forget() -> None:
    """Drop the choices (the next large load probes again)."""
    with _lock:
        _choices.clear()


def known(fd: int) -> ReadPathChoice | None:
    """The choice for ``fd``'s file system, if one was made."""
    with _lock:
        return _choices.get(os.fstat(fd).st_dev)


def choose(fd: int, direct_fd: int, align: tuple[int, int], threads: int) -> ReadPathChoice | None:
    """The read path for ``fd``'s file system: known, or probed now on this file (its buffered
    and O_DIRECT descriptors).  None when the file is too small for the probe or its regions are
    in the page cache already."""
    st = os.fstat(fd)
    with _lock:
        if st.st_dev in _choices:
            return _choices[st.st_dev]
        threads = min(threads, 8, st.st_size // (2 * PROBE_BYTES))  # as many as the file holds
        if threads < 1:
            return None
        span = st.st_size // (2 * threads) // align[1] * align[1]
        starts = [i * span for i in range(2 * threads)]
        if any(mostly_cached(fd, s, PROBE_BYTES) for s in starts):
            return None
        bufs = [StagingBuffer(PROBE_BYTES) for _ in range(threads)]
        try:
            for b in bufs:  # fault the pages in first: the probe times the device only
                b.view[::4096] = bytes(len(range(0, b.nbytes, 4096)))
            direct_s = _round(lambda s, b: direct_io.read_direct(direct_fd, b.view[:PROBE_BYTES], s),
                              starts[0::2], bufs)
            buffered_s = _round(lambda s, b: direct_io.read_buffered(fd, b.view[:PROBE_BYTES], s),
                                starts[1::2], bufs)
        finally:
            for b in bufs:
                b.close()
        total = threads * PROBE_BYTES
        choice = ReadPathChoice(direct=buffered_s * MARGIN >= direct_s, direct_gbps=total / direct_s / 1e9,
                                buffered_gbps=total / buffered_s / 1e9, probe_bytes=total)
        _choices[st.st_dev] = choice
    log.info("cold reads on device %d:%d: %s", os.major(st.st_dev), os.minor(st.st_dev), choice.describe())
    return choice


def _round(read, starts: list[int], bufs: list[StagingBuffer]) -> float:
    """Wall-clock seconds for ``read(start, buffer)`` of every start, one thread each."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(starts), thread_name_prefix="dcpds-probe") as pool:
        for _ in pool.map(read, starts, bufs):
            pass
    return max(time.perf_counter() - t0, 1e-6)
