"""One pass of a rank's reads (``DataStatesReader.read_data``): the read tasks of its plan made
into bytes in their destinations.

GPU destinations are given pinned-slab uploads (``engine/upload.py``); where the coordinator
agreed a cooperative load, the blocks this rank reads for others are sent as each range holding
them is read and those others read for it are received (``cooperative.py``); the ranges are
read on a thread pool (runs of small pieces of one file coalesced, ``ranges.py``), each from the
fastest tier whose copy verifies (``files.Fetcher``); then every task is finalized (a cast, a
narrowed box) and every upload has landed.  Delivering to DCP's planner is the caller's."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from ..engine import upload
from ..engine.upload import DeviceUpload
from ..tiers import StorageTier, read_path
from .cooperative import Cooperation, SharePlan
from .files import Fetcher, FileSet, ReadStats
from .ranges import COALESCE_GAP, batches, coalesce
from .tasks import ReadTask, SmallTask


@dataclass(frozen=True)
class ReadOptions:
    """How a rank reads (``DataStatesReader``'s arguments of the same names)."""

    thread_count: int = 8
    verify: bool = True  # every block checked against its digest
    o_direct: bool | str = "auto"  # True, False, or "auto": chosen by a probe of the first reads


def read_tasks(tasks: Sequence[ReadTask | SmallTask], tiers: list[StorageTier], homes: dict[str, str],
               block_size: int, coop: Cooperation | None, stats: ReadStats, opts: ReadOptions,
               borrowed: dict[str, StorageTier] | None = None) -> SharePlan | None:
    """Read ``tasks`` into their destinations from ``tiers`` (``homes``: the files kept in
    earlier checkpoints an incremental save references; ``borrowed``: files the first tier
    serves from the ranges this rank was sent, ``FileSet``); the first error raises, once the
    cooperative exchange, if any, has ended.  Returns the cooperative share read (None: none)."""
    stats.bytes_needed = sum(t.needed for t in tasks)
    gpu = [t for t in tasks if t.dest is not None and t.dest.device.type == "cuda"]
    up = DeviceUpload({t.dest.device for t in gpu if t.dest is not None}) if gpu and upload.usable() else None
    for t in gpu:
        t.attach_upload(up)
    share = coop.plan(tasks, block_size) if coop is not None else None
    files = FileSet(tiers, homes, borrowed)
    fetch = Fetcher(files, stats, verify=opts.verify, o_direct=opts.o_direct)
    try:
        total = sum(t.buf_size for t in tasks)
        if opts.o_direct == "auto" and total >= read_path.PROBE_MIN_LOAD:
            fetch.probe(tasks, opts.thread_count)
        reads = share.reads if share is not None else [(t, i) for t in tasks for i in range(len(t.ranges))]
        # threads pay off for large reads; for small ones they only contend for the GIL
        threads = max(1, min(opts.thread_count, total // (4 << 20)))
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
        if up is not None:
            up.finish()  # every upload landed before the planner sees the tensors
    finally:
        files.close()
    return share


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
    if done is None:
        for _ in pool.map(lambda j: j[0](j[1]), jobs):
            pass
        return []
    failed = []
    futures = {pool.submit(fn, batch): batch for fn, batch in jobs}
    for f in as_completed(futures):
        e = f.exception()
        if e is not None:
            if not isinstance(e, Exception):  # an interrupt: nothing to wait for
                raise e
            failed.append((futures[f], e))  # raised once the peers know what was not read
        done(futures[f])
    return failed
