"""Background flush of a committed fast-tier copy to slower tiers, with a per-tier commit.

Ranks share nothing but the process group and the persistent tier, and the flush runs
after ``dcp.save`` has returned, when collectives would collide with training.  So the
commit protocol uses the persistent tier itself (two phases, no collectives):

1. every rank uploads its own data files from its fast tier (node-local NVMe) and then
   writes a small marker ``.uploaded.rank-NNNNN.<save_id>`` listing them;
2. the coordinator waits until the markers of every rank of the save are present, then
   writes the manifest last: on object stores that PUT is the commit, on file systems it
   is a rename.  Until then the slow tier's copy is invisible to readers.

Uploads run at idle CPU priority and yield to the fast tier: before each piece they wait (a
bounded time) until no save of this process is writing its first tier.  Uploads are retried
with exponential backoff; a tier that still fails is reported through
the save's ``wait_persisted()`` and the logs, and its copy never commits.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import msgpack

from .. import process_state
from ..errors import CheckpointError, ClaimLostError, ManifestError
from ..format.manifest import decode_manifest
from ..format.model import Manifest
from ..format.names import PERSISTED_RECORD, failed_marker, uploaded_marker
from ..format.values import pack_plain
from .activity import wait_for_quiet
from .base_lock import BaseHold
from .commit import ByClaim, commit_manifest
from .storage import StorageTier
from .tidy import flushing, pin

log = logging.getLogger(__name__)

UPLOAD_PIECE = 64 << 20
HOLD_WAIT_S = 120.0  # for a removal in a directory holding referenced files to end
YIELD_S = 2.0  # before each piece, wait up to this long for this process's saves to finish writing


marker_name = uploaded_marker
failed_name = failed_marker


def with_retries(fn, what: str, *, attempts: int = 4, base_delay: float = 0.2):
    delay = base_delay
    for i in range(attempts):
        try:
            return fn()
        except ClaimLostError:  # the save no longer owns the directory: no retry brings it back
            raise
        except Exception as e:  # storage errors come in many types
            if i == attempts - 1:
                raise
            log.warning("%s failed (%s); retry %d/%d in %.1fs", what, e, i + 1, attempts - 1, delay)
            time.sleep(delay)
            delay *= 4


def copy_file(src: StorageTier, dst: StorageTier, name: str) -> int:
    """Stream one file from ``src`` to ``dst`` in large pieces (multipart on object stores)."""
    size = src.size(name)
    if src.local and dst.local and hasattr(os, "copy_file_range"):
        try:
            dst.backend.copy_local(src.path(name), dst.path(name), f"{name}.part", size,
                                   pace=lambda: wait_for_quiet(YIELD_S), piece=UPLOAD_PIECE)
            return size
        except OSError as e:  # e.g. EXDEV on old kernels: fall back to the buffered copy
            log.debug("copy_file_range failed (%s); buffered copy", e)
    sink = dst.open_sink(name)
    try:
        buf = bytearray(min(UPLOAD_PIECE, max(size, 1)))
        mv = memoryview(buf)
        off = 0
        while off < size:
            wait_for_quiet(YIELD_S)
            n = min(len(buf), size - off)
            got = src.read_into(name, off, mv[:n])
            if got != n:
                raise OSError(f"short read of {name} from {src.url}: {got} of {n} bytes")
            sink.pwrite(mv[:n], off)
            off += n
        sink.close(sync=True)
    except BaseException:
        sink.abort()
        raise
    return size


# Process-wide on purpose: uploads to slower tiers share one bounded pool, whatever the writers.
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool_in_child() -> None:
    """A forked child has none of the pool's threads: it starts its own on its first upload."""
    global _pool, _pool_lock
    process_state.keep(_pool)
    _pool, _pool_lock = None, threading.Lock()


process_state.in_child(_forget_pool_in_child)


def _background_priority() -> None:
    """Flushes to slow tiers yield the CPU to training: SCHED_IDLE, else nice 19 (this thread)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(4, thread_name_prefix="dcpds-persist",
                                       initializer=_background_priority)
        return _pool


def upload_rank(src: StorageTier, dst: StorageTier, files: dict[str, int], rank: int,
                save_id: str, refs: dict[str, tuple[str, int]] | None = None,
                pins: list[tuple[StorageTier, str, str]] | None = None, hold: BaseHold | None = None) -> Future:
    """Phase 1 on one rank: upload its files, then its marker.

    ``refs`` are files of earlier checkpoints that this incremental save references
    (``{name: (home directory, size)}``).  They normally are on ``dst`` already, next to it; one
    that is not (its step was never persisted) is copied into its home directory there, so that
    the slow tier's copy is complete without re-sending the rest.  Such a copy is pinned live
    there (``tidy.pin``) before it starts, and recorded in ``pins`` for the caller to let go
    once the manifest that references it has committed.  Every directory holding such files
    there is held under its base lock (``base_lock.py``) in ``hold``, before the file is looked
    for, until the caller lets it go: no tidy-up or retention pass, in any process, removes
    from it meanwhile."""
    def run() -> None:
        try:
            upload()
        except BaseException as e:
            try:  # best effort: tell the coordinator not to wait for this rank
                dst.commit_bytes(failed_name(rank, save_id), str(e).encode()[:4096])
            except Exception as marker_error:  # noqa: BLE001 - the tier may be gone altogether
                log.warning("could not leave the failure marker on %s (%s); the coordinator "
                            "waits until its timeout", dst.url, marker_error)
            raise

    def upload() -> None:
        with_retries(dst.makedirs, f"creating {dst.url}")
        for name in sorted(files):
            with_retries(partial(copy_file, src, dst, name), f"upload of {name} to {dst.url}")
        for name, (home, size) in sorted((refs or {}).items()):
            there = dst.sibling(home)
            if hold is not None:
                _hold(hold, there)
            try:
                if there.exists(name) and there.size(name) == size:
                    continue
            except OSError:
                pass
            if pins is not None:  # no purge there sweeps it before the manifest commits
                pin(dst.parent(), home, name)
                pins.append((dst.parent(), home, name))
            with_retries(there.makedirs, f"creating {there.url}")
            with_retries(partial(copy_file, src.sibling(home), there, name),
                         f"upload of referenced {home}/{name} to {there.url}")
        body = pack_plain({"rank": rank, "save_id": save_id, "files": files})
        with_retries(lambda: dst.commit_bytes(marker_name(rank, save_id), body),
                     f"marker upload to {dst.url}")
        log.debug("rank %d uploaded %d files to %s", rank, len(files), dst.url)
    return _executor().submit(run)


def _hold(hold: BaseHold, there: StorageTier) -> None:
    """Hold ``there``'s base lock shared (the directory made first: a step this tier never had),
    waiting up to ``HOLD_WAIT_S`` for a tidy-up or retention pass that holds it to end."""
    deadline = time.monotonic() + HOLD_WAIT_S
    pause = 0.05
    while True:
        with_retries(there.makedirs, f"creating {there.url}")
        if hold.take(there):
            return
        if time.monotonic() > deadline:
            raise OSError(errno.EBUSY, f"{there.url} has been tidied or purged for {HOLD_WAIT_S:.0f} s; "
                                       "the files this save references there cannot be held")
        time.sleep(pause)  # a lock held by another process: the kernel tells no one when it goes
        pause = min(pause * 2, 1.0)


def commit_when_complete(dst: StorageTier, manifest: bytes, ranks: list[int], save_id: str,
                         *, timeout: float = 3600.0, on_commit=None,
                         give_up: threading.Event | None = None, fence) -> Future:
    """Phase 2 on the coordinator: wait for every rank's marker, then write the manifest.

    Stops waiting, and never commits, as soon as a rank reports that its upload failed (its
    ``.failed.rank-`` marker) or ``give_up`` is set (the coordinator's own upload failed).
    ``fence()`` runs just before the commit and raises where this save lost ``dst``'s claim."""
    stop = give_up or threading.Event()
    run_dir, step = dst.parent(), dst.name

    def run() -> None:
        # until it commits, this copy's references are live on dst (retention and tidy)
        try:
            flushing(run_dir, step, decode_manifest(manifest, source=dst.url))
        except ManifestError as e:  # the commit below writes it anyway; nothing to protect
            log.warning("manifest flushing to %s does not decode (%s)", dst.url, e)
        try:
            wait_and_commit()
        finally:
            flushing(run_dir, step, None)

    def wait_and_commit() -> None:
        deadline = time.monotonic() + timeout
        want = {marker_name(r, save_id) for r in ranks}
        failed = {failed_name(r, save_id): r for r in ranks}
        delay = 0.05
        while True:
            if stop.is_set():
                raise OSError(f"persist to {dst.url}: this rank's upload failed; not committing")
            have = set(dst.listdir())
            if want <= have:
                break
            bad = sorted(r for n, r in failed.items() if n in have)
            if bad:
                raise OSError(f"persist to {dst.url}: the upload of rank(s) {bad[:8]} failed; "
                              "not committing (see that rank's log)")
            if time.monotonic() > deadline:
                missing = sorted(want - have)[:4]
                raise TimeoutError(f"persist to {dst.url}: ranks did not finish uploading "
                                   f"within {timeout:.0f}s (missing {missing})")
            stop.wait(delay)
            delay = min(delay * 2, 2.0)
        with_retries(lambda: commit_manifest(dst, manifest, save_id, ByClaim(fence)), f"manifest commit on {dst.url}")
        log.info("persisted %s", dst.url)
        if on_commit is not None:
            on_commit(dst.url)
    return _executor().submit(run)


def record_persisted(tier: StorageTier, url: str) -> None:
    """Note in the fast tier's copy which slower tiers committed theirs (for ``inspect``)."""
    have: list = []
    if tier.exists(PERSISTED_RECORD):
        try:
            have = list(msgpack.unpackb(tier.read_bytes(PERSISTED_RECORD, max_bytes=1 << 20)))
        except (ValueError, TypeError, msgpack.UnpackException, OSError, CheckpointError) as e:
            log.warning("rebuilding the damaged %s of %s (%s)", PERSISTED_RECORD, tier.url, e)
    if url not in have:
        have.append(url)
    tier.commit_bytes(PERSISTED_RECORD, pack_plain(have))


def when_all(futs: list[Future], callback) -> None:
    """Call ``callback(first_error_or_None)`` once every future is done."""
    if not futs:
        callback(None)
        return
    lock = threading.Lock()
    left = [len(futs)]
    errors: list = []

    def done(f: Future) -> None:
        e = f.exception()
        with lock:
            if e is not None:
                errors.append(e)
            left[0] -= 1
            last = left[0] == 0
        if last:
            if errors:
                log.error("flush to a persistent tier failed: %s", errors[0])
            callback(errors[0] if errors else None)
    for f in futs:
        f.add_done_callback(done)


def then(fut: Future, fn) -> Future:
    """A future of ``fn()``, run once ``fut`` succeeds (its error otherwise)."""
    out: Future = Future()

    def done(f: Future) -> None:
        e = f.exception()
        if e is not None:
            out.set_exception(e)
            return
        try:
            out.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - delivered through the future
            out.set_exception(err)
    fut.add_done_callback(done)
    return out


def _failed(e: Exception) -> Future:
    f: Future = Future()
    f.set_exception(e)
    return f


class Persistence:
    """One save's flush to slower tiers, as one rank runs it.

    Phase 1 (every rank): ``start_uploads`` sends the rank's files and then its marker.
    Phase 2: ``start_commits`` commits the manifest on each tier once every rank uploaded (the
    coordinator, collective saves) or once this rank did (per-rank manifests).  ``on_done``
    gets the first error or None when this rank's part is over; ``after_commit(tier, manifest)``
    runs once a tier committed; ``on_tier_failed(url)`` once a tier's flush failed;
    ``fence(url)`` just before a manifest is committed there (it raises where the save lost
    that tier's claim)."""

    def __init__(self, src: StorageTier, tiers: list[StorageTier], save_id: str, rank: int, *,
                 on_done, after_commit, on_tier_failed, fence,
                 unclaimed: dict[str, Exception] | None = None) -> None:
        self.src, self.tiers, self.save_id, self.rank = src, tiers, save_id, rank
        self.on_done, self.after_commit, self.on_tier_failed = on_done, after_commit, on_tier_failed
        self.fence = fence
        self.unclaimed = dict(unclaimed or {})  # tiers this save could not claim: failed at once
        self.uploads: list[Future] = []
        self.futures: list[Future] = []
        self.pins: list[tuple[StorageTier, str, str]] = []  # referenced files copied, held live
        self.hold = BaseHold()  # the directories of the slower tiers holding referenced files

    def pending(self) -> bool:
        return any(not f.done() for f in self.futures)

    def _over(self, error: BaseException | None) -> None:
        """This rank's part is over: the files it pinned are a committed manifest's now (or
        belong to nothing: the next tidy-up may take them)."""
        for run, name, file in self.pins:
            pin(run, name, file, on=False)
        self.pins = []
        self.hold.release()
        self.on_done(error)

    def start_uploads(self, files: dict[str, int], refs: dict[str, tuple[str, int]], *,
                      waits_for_commit: bool) -> None:
        self.uploads = [_failed(self.unclaimed[dst.url]) if dst.url in self.unclaimed else
                        upload_rank(self.src, dst, files, self.rank, self.save_id, refs=refs, pins=self.pins,
                                    hold=self.hold)
                        for dst in self.tiers]
        self.futures = list(self.uploads)
        for f, t in zip(self.uploads, self.tiers):
            f.add_done_callback(lambda f, u=t.url: self.on_tier_failed(u) if f.exception() else None)
        if not waits_for_commit:  # with no slower tier: over at once
            when_all(self.uploads, self._over)

    def start_commits(self, manifest: Manifest, body: bytes, name: str, *, collective: bool,
                      record_on: StorageTier | None) -> None:
        # with no slower tier, the first tier's commit, just made, was all: over at once
        if not collective:  # every rank commits its own rank manifest after its own upload
            def commit(tier: StorageTier) -> None:
                commit_manifest(tier, body, self.save_id, ByClaim(lambda: self.fence(tier.url)), name=name)
                self.after_commit(tier, manifest)
            self.futures = [then(f, lambda t=t: commit(t)) for f, t in zip(self.uploads, self.tiers)]
            when_all(self.futures, self._over)
            return
        lock = threading.Lock()
        by_url = {t.url: t for t in self.tiers}

        def committed(url: str) -> None:
            self.after_commit(by_url[url], manifest)
            if record_on is not None:
                with lock:
                    try:
                        record_persisted(record_on, url)
                    except (OSError, CheckpointError) as e:  # the tier committed: only `inspect`'s note is lost
                        log.warning("%s committed, but %s/%s could not say so (%s)", url, record_on.url,
                                    PERSISTED_RECORD, e)
        give_up = [threading.Event() for _ in self.tiers]  # set when this rank's own upload fails
        for f, ev in zip(self.uploads, give_up):
            f.add_done_callback(lambda f, ev=ev: ev.set() if f.exception() is not None else None)
        commits = [commit_when_complete(t, body, list(range(manifest.world_size)), self.save_id,
                                        on_commit=committed, give_up=ev,
                                        fence=lambda u=t.url: self.fence(u))
                   for t, ev in zip(self.tiers, give_up)]
        for f, t in zip(commits, self.tiers):
            f.add_done_callback(lambda f, u=t.url: self.on_tier_failed(u) if f.exception() else None)
        self.futures = self.uploads + commits
        when_all(self.futures, self._over)
