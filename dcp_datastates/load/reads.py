"""One pass of a rank's reads (``DataStatesReader.read_data``): the read tasks of its plan made
into bytes in their destinations.

GPU destinations are given pinned-slab uploads (``engine/upload.py``: a reader never waits for
its own upload); where the coordinator
agreed a cooperative load, the blocks this rank reads for others are sent as each range holding
them is read and those others read for it are received (``cooperative.py``); the ranges are
read on a thread pool (runs of small pieces of one file coalesced, ``ranges.py``), each from the
fastest tier whose copy verifies (``files.Fetcher``); then every task is finalized (a cast, a
narrowed box) and every upload has landed.  Delivering to DCP's planner is the caller's."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from .. import process_state
from ..engine import upload
from ..engine.upload import DeviceUpload, HostUpload
from ..tiers import StorageTier, read_path
from .cooperative import Cooperation, SharePlan
from .files import Fetcher, FileSet, ReadStats
from .ranges import COALESCE_GAP, batches, coalesce
from .tasks import ReadTask, SmallTask

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadOptions:
    """How a rank reads (``DataStatesReader``'s arguments of the same names)."""

    thread_count: int = 8
    verify: bool = True  # every block checked against its digest
    o_direct: bool | str = "auto"  # True, False, or "auto": chosen by a probe of the first reads
    # a stand-in for the GPU's uploads, for host destinations (tests, the CPU proxy of
    # ``bench_read_paths.py``): made per load; None: GPU destinations alone stream
    host_uploads: Callable[[], HostUpload] | None = None


def read_tasks(tasks: Sequence[ReadTask | SmallTask], tiers: list[StorageTier], homes: dict[str, str],
               block_size: int, coop: Cooperation | None, stats: ReadStats, opts: ReadOptions,
               borrowed: dict[str, StorageTier] | None = None) -> SharePlan | None:
    """Read ``tasks`` into their destinations from ``tiers`` (``homes``: the files kept in
    earlier checkpoints an incremental save references; ``borrowed``: files the first tier
    serves from the ranges this rank was sent, ``FileSet``); the first error raises, once the
    cooperative exchange, if any, has ended.  Returns the cooperative share read (None: none)."""
    stats.bytes_needed = sum(t.needed for t in tasks)
    up = _uploads(tasks, opts)
    share = coop.plan(tasks, block_size) if coop is not None else None
    files = FileSet(tiers, homes, borrowed)
    total = sum(t.buf_size for t in tasks)
    # threads pay off for large reads; for small ones they only contend for the GIL
    threads = max(1, min(opts.thread_count, total // (4 << 20)))
    staging = up.staging(threads) if up is not None and any(t.streamed for t in tasks) else None
    fetch = Fetcher(files, stats, verify=opts.verify, o_direct=opts.o_direct, staging=staging)
    try:
        if opts.o_direct == "auto" and total >= read_path.PROBE_MIN_LOAD:
            fetch.probe(tasks, opts.thread_count)
        reads = share.reads if share is not None else [(t, i) for t in tasks for i in range(len(t.ranges))]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads, thread_name_prefix="dcpds-read") as pool:
            if share is not None and coop is not None:
                coop.open(share)  # receives posted; each block is sent once the range holding it is read
                failed = _fetch_all(pool, fetch, reads, done=lambda pieces: coop.ready(share, pieces))
            else:
                failed = _fetch_all(pool, fetch, reads)
            stats.read_s = time.perf_counter() - t0
            if share is not None and coop is not None:  # the exchange ends; what it could not bring is read
                coop.finish(share, fetch, [p for run, _e in failed for p in run], stats, verify=opts.verify)
            if failed:
                raise failed[0][1]
            for _ in pool.map(lambda b: [t.finalize() for t in b], batches(tasks, lambda t: t.buf_size)):
                pass
    finally:  # each runs, whatever the one before raised: files closed, uploads landed, slabs back
        with contextlib.ExitStack() as done:
            done.callback(files.close)
            if up is not None:
                done.callback(up.finish)  # every upload landed before the planner sees the tensors
            if staging is not None:
                done.callback(staging.close)  # first: an upload that failed raises here
    return share


def _uploads(tasks: Sequence[ReadTask | SmallTask], opts: ReadOptions) -> DeviceUpload | HostUpload | None:
    """The load's uploads, attached to the tasks whose destinations they serve: the GPU's, or
    the host stand-in ``opts.host_uploads`` makes."""
    if opts.host_uploads is not None:
        up: DeviceUpload | HostUpload | None = opts.host_uploads()
    else:
        gpu = {t.dest.device for t in tasks if t.dest is not None and t.dest.device.type == "cuda"}
        up = DeviceUpload(gpu) if gpu and upload.usable() else None
    if up is not None:
        for t in tasks:
            if t.dest is not None and t.dest.device.type == up.device_type:
                t.attach_upload(up)
    return up


def _fetch_all(pool: ThreadPoolExecutor, fetch: Fetcher, reads: list,
               done: Callable[[list], None] | None = None) -> list:
    """Read ``reads`` (pieces of tasks) on ``pool``: runs of small ones coalesced, the rest one
    by one; the first error raises.  With ``done`` (a cooperative load), called on this thread
    with the pieces of each run or batch as it ends, failed or not: no gap is read between
    pieces (its bytes are another rank's to read), and a run or batch that failed, whatever
    the error, is returned as ``(pieces, error)`` while the rest are read on: the peers waiting
    for its blocks learn they were not read, then the caller raises."""
    runs, pieces = coalesce(reads, gap=COALESCE_GAP if done is None else 0)

    def each(run: list) -> None:
        for p in run:
            fetch.piece(*p)

    jobs = [(fetch.run, run) for run in runs]
    jobs += [(each, b) for b in batches(pieces, lambda p: p[0].ranges[p[1]].nbytes)]
    failed = []
    futures = {pool.submit(fn, batch): batch for fn, batch in jobs}
    progress = _Progress(sum(t.ranges[i].nbytes for t, i in reads))
    for f in as_completed(futures):
        e = f.exception()
        if e is not None:
            if done is None or not isinstance(e, Exception):  # the first error; or an interrupt
                for other in futures:
                    other.cancel()
                raise e
            failed.append((futures[f], e))  # raised once the peers know what was not read
        progress.add(sum(t.ranges[i].nbytes for t, i in futures[f]))
        if done is not None:
            done(futures[f])
    return failed


PROGRESS_S = 10.0  # a long load says how far it is at most this often


class _Progress:
    """How far this rank's reads are, said at INFO every ``PROGRESS_S`` of a long load."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.t0 = time.monotonic()
        self._next = self.t0 + PROGRESS_S

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now >= self._next and self.done < self.total:
            self._next = now + PROGRESS_S
            log.info("rank %d: %.2f of %.2f GiB read (%.0f%%, %.0f MiB/s)", process_state.rank(), self.done / 2**30,
                     self.total / 2**30, 100 * self.done / max(self.total, 1), self.done / 2**20 / (now - self.t0))
