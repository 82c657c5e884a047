"""The snapshot engine: live tensors -> host cache -> storage, streamed.

One save is a :class:`SaveJob`: a list of :class:`CopyItem` (a leaf tensor
and the place of its bytes in one data file).  The engine

1. cuts the items into *batches*: a large tensor into ``piece_bytes`` pieces
   (nested chunking), runs of small tensors into one coalesced batch that
   covers a contiguous file range (one write instead of hundreds);
2. on the *stager* thread, reserves cache space for each batch (blocking when
   the cache is full) and copies the bytes out of the live tensors, on a CUDA
   side stream for GPU tensors or with a CPU memcpy otherwise;
3. hands each filled batch at once to a pool of *flush* threads, which wait
   for the batch's copy event, digest its blocks, reserve room at the end of
   the item's stripe file, ``pwrite`` the batch there and free the cache
   space.  Copy and write therefore overlap, and files stay dense in the
   order pieces became ready;
4. marks the job *snapshotted* once every byte has left the live tensors
   (training may mutate them from then on), and *durable* once every batch is
   written and the file is fsynced.

Incremental saves: an item may carry the extent of the same chunk in the
previous checkpoint (``base``).  The flush thread then compares the block
digests of each *dedup unit* (``unit_bytes``, cut at piece boundaries too)
with the base's; a unit whose digests all match is not written: its segment
points at the base's bytes instead.

Jobs run one after the other in submission order (back-to-back saves queue);
their memory is bounded by the one shared host cache.

When ``copy=False`` (a synchronous ``dcp.save``, where nothing runs
concurrently), large contiguous CPU tensors are written straight from their
own memory and only small ones pass through the cache.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch
import xxhash

import cuda_ext

from .. import process_state
from ..errors import TornSnapshotError
from ..format.checksum import BLOCK_SIZE, block_checksums
from ..format.codec import encode_block
from ..format.layout import ALIGNMENT, align_up
from ..format.model import Extent
from ..gcpause import paused_gc
from ..tiers.activity import job_ended as _job_ended
from ..tiers.activity import job_started as _job_started
from .device_cache import DeviceCache
from .host_cache import HostCache

log = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # largest batch: one copy, one write
# a CPU source up to this size is copied by address (one memmove): below it, the tensor view and
# the torch call of a copy cost more than its bytes
SMALL_COPY_BYTES = 256 << 10


@dataclass(slots=True)
class CopyItem:
    key: str
    source: torch.Tensor | None  # None once its bytes are copied (the allocator may reuse them)
    offset: int  # virtual position in its stripe, used to coalesce neighbours into one batch
    nbytes: int
    file: int = 0  # index of the job's sink (stripe file) that receives the item's new bytes
    sums: list = field(default_factory=list)  # one digest per block, filled by the flush threads
    base: Extent | None = None  # Extent of the same chunk in the base checkpoint (incremental saves)
    base_files: frozenset = frozenset()  # base files this rank's tier holds (referencable)
    # filled by the flush threads, in any order: (item_pos, file, file_offset, nbytes) where
    # file is a sink index (new bytes) or a base file name (bytes reused from the base)
    placed: list = field(default_factory=list)
    # the source's version counters when the save started (lazy saves; None: not tracked, as
    # for tensors made under inference_mode).  Checked once its bytes are copied.
    watch: Watch | None = None
    # 0: the bytes are stored as they are; else the header (format/codec.py) its blocks are
    # compressed with, each block on its own into a sink of compressed blocks
    codec: int = 0

    def live(self) -> torch.Tensor:
        """The source tensor, while the snapshot still needs it."""
        if self.source is None:
            raise RuntimeError(f"{self.key}: its source was released once its bytes were copied")
        return self.source

    def segments(self) -> list[tuple[object, int, int]]:
        """``(file, offset, nbytes)`` in item order, neighbours in one file merged."""
        if len(self.placed) == 1:  # most items: one segment
            _pos, f, off, n = self.placed[0]
            return [(f, off, n)]
        out: list[list] = []
        for _pos, f, off, n in sorted(self.placed, key=lambda p: p[0]):
            if self.codec:  # compressed: one segment per stored block
                out.append([f, off, n])
            elif out and out[-1][0] == f and out[-1][1] + out[-1][2] == off and out[-1][2] % BLOCK_SIZE == 0:
                out[-1][2] += n
            else:
                out.append([f, off, n])
        return [tuple(x) for x in out]

    @property
    def reused_bytes(self) -> int:
        return sum(p[3] for p in self.placed if isinstance(p[1], str))


@dataclass(slots=True)
class _Piece:
    item: CopyItem
    src_start: int  # byte offset inside the item
    dst_pos: int  # byte offset inside the batch
    nbytes: int


@dataclass(slots=True)
class _Batch:
    file_offset: int
    nbytes: int
    pieces: list[_Piece]
    direct: bool = False
    file: int = 0


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 tensor (a view when already contiguous and its
    memory holds its values: a conjugate or negative view is resolved into a copy first)."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def _host_address(t: torch.Tensor) -> int | None:
    """The address of a small tensor's bytes where they are plain host memory in order (a
    contiguous CPU tensor, no conjugate or negative bit, no subclass); None otherwise."""
    if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu"
            or t.layout != torch.strided or not t.is_contiguous() or t.is_conj() or t.is_neg()
            or t.is_quantized or not 0 < t.nbytes <= SMALL_COPY_BYTES):
        return None
    return t.data_ptr()


def _source_bytes(src, start: int, nbytes: int) -> memoryview:
    """Bytes ``[start, start + nbytes)`` of a source as ``_copy_out`` keeps it (an address or
    a flat uint8 tensor), without a copy."""
    if type(src) is int:
        return memoryview((ctypes.c_char * nbytes).from_address(src + start)).cast("B")
    return memoryview(src[start:start + nbytes].numpy())


def _comparable(it: CopyItem) -> bool:
    """The item has a base chunk of the same size, stored the same way (both compressed or
    both not), so their block digests line up."""
    return it.base is not None and it.base.nbytes == it.nbytes and len(it.base.sums) == len(it.sums) \
        and it.base.packed == bool(it.codec)


def _units(p: _Piece, unit: int):
    """Cut piece ``p`` into dedup units; yield ``(start, end, reuse)`` in item bytes, where
    ``reuse`` lists the base segments holding identical bytes, or is None (write them).  The
    digests of a unit's blocks are compared when the unit is yielded."""
    it = p.item
    start, end = p.src_start, p.src_start + p.nbytes
    if p.nbytes == 0:
        return
    if not _comparable(it):
        yield start, end, None
        return
    for a, z in _unit_bounds(start, end, unit):
        yield a, z, _reuse(it, a, z)


def _unit_bounds(start: int, end: int, unit: int):
    """``[start, end)`` cut at multiples of ``unit``."""
    a = start
    while a < end:
        z = min(end, (a // unit + 1) * unit)
        yield a, z
        a = z


def _reuse(it: CopyItem, a: int, z: int) -> list | None:
    """The base segments that hold item bytes ``[a, z)`` (``(item_pos, file, offset, nbytes)``)
    when their block digests equal the item's and this tier holds their files, else None."""
    base = it.base
    if base is None or not _comparable(it):
        return None
    b0, b1 = a // BLOCK_SIZE, -(-z // BLOCK_SIZE)
    if it.sums[b0:b1] != base.sums[b0:b1]:
        return None
    if it.codec:  # a stored block per segment
        segs = [(g.file, g.offset, b * BLOCK_SIZE - a, g.nbytes) for b, g in enumerate(base.segs[b0:b1], b0)]
    else:
        segs = base.locate(a, z - a)
    if segs and all(f in it.base_files for f, _o, _p, _n in segs):
        return [(a + pos, f, off, n) for f, off, pos, n in segs]
    return None


def plan_batches(items: list[CopyItem], piece_bytes: int, *, direct_ok) -> list[_Batch]:
    """Cut items into batches of at most ``piece_bytes``.

    Within a file, batches follow file order; across files they are interleaved, so that the
    flush threads write different files at once (the kernel serializes writers of one inode).
    """
    per_file: dict[int, list[_Batch]] = {}
    for f in sorted({it.file for it in items}):
        batches: list[_Batch] = []
        cur: _Batch | None = None
        for it in sorted((i for i in items if i.file == f), key=lambda i: i.offset):
            if it.nbytes >= piece_bytes // 2:
                cur = None
                direct = direct_ok(it)
                for s in range(0, it.nbytes, piece_bytes):
                    n = min(piece_bytes, it.nbytes - s)
                    batches.append(_Batch(it.offset + s, n, [_Piece(it, s, 0, n)], direct, f))
                continue
            end = it.offset + it.nbytes
            if cur is not None and end - cur.file_offset <= piece_bytes:
                cur.pieces.append(_Piece(it, 0, it.offset - cur.file_offset, it.nbytes))
                cur.nbytes = end - cur.file_offset
            else:
                cur = _Batch(it.offset, it.nbytes, [_Piece(it, 0, 0, it.nbytes)], False, f)
                batches.append(cur)
        per_file[f] = batches
    out: list[_Batch] = []
    queues = [deque(q) for q in per_file.values() if q]
    while queues:
        for q in queues:
            out.append(q.popleft())
        queues = [q for q in queues if q]
    return out


def _settle(fut: Future, *, result=None, error: BaseException | None = None) -> None:
    """Resolve ``fut`` unless it already is (a failure and the snapshot can race)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


@dataclass(frozen=True)
class Written:
    """What a job's ``durable`` future resolves to: the bytes in each sink, and when each
    stage was reached.  (Not the job itself: a future holding its own job is a cycle, and the
    job's items and records would then wait for the collector's full pass.)"""

    file_sizes: list[int]
    timings: dict[str, float]


class SaveJob:
    """One save on one rank: completion handles and per-stage timings."""

    def __init__(self, items: list[CopyItem], sinks: list, *, label: str, unit_bytes: int = PIECE_BYTES,
                 device_cache: DeviceCache | None = None) -> None:
        self.items = items
        self.sinks = sinks
        self.label = label
        self.unit_bytes = unit_bytes  # dedup granularity of items with a base (incremental saves)
        self.device_cache = device_cache  # the first cache level for items on its device, if any
        self.snapshot_done = threading.Event()
        self.snapshotted: Future = Future()  # None when snapshot_done is set (error: failed)
        self.durable: Future = Future()  # Written, once every sink is closed and synced
        self.error: BaseException | None = None
        self.abort = threading.Event()
        self.on_abort: list = []  # called when the job fails (wakes its cache waiters)
        self.file_sizes: list[int] = [0] * len(sinks)
        self.timings: dict[str, float] = {"submitted": time.monotonic()}
        self._pending = 0
        self._lock = threading.Lock()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = exc
        self.abort.set()
        for wake in self.on_abort:
            wake()
        self.snapshot_done.set()
        _settle(self.snapshotted, error=exc)
        for sink in self.sinks:
            try:
                sink.abort()
            except OSError as e:  # the save fails anyway; its partial file is never committed
                log.warning("aborting %s failed: %s", getattr(sink, "name", sink), e)
        if not self.durable.done():
            self.durable.set_exception(exc)

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        ok = self.snapshot_done.wait(timeout)
        if self.error is not None:
            raise self.error
        return ok


class SnapshotEngine:
    def __init__(self, cache: HostCache, *, io_threads: int = 4,
                 piece_bytes: int = PIECE_BYTES) -> None:
        self.cache = cache
        self.io_threads = io_threads
        self.piece_bytes = max(BLOCK_SIZE, min(piece_bytes, cache.capacity // 4) // BLOCK_SIZE * BLOCK_SIZE)
        self._jobs: queue.Queue = queue.Queue()
        self._flush = _Workers(io_threads, "dcpds-flush")
        # not a daemon: at interpreter exit the saves still queued finish (see _exit_watch)
        self._stager = threading.Thread(target=self._stage_loop, name="dcpds-stager")
        self._stager.start()

    # -- public -------------------------------------------------------------
    def submit(self, items: list[CopyItem], sinks: list, *, copy: bool, label: str = "",
               ready_event=None, unit_bytes: int = PIECE_BYTES,
               device_cache: DeviceCache | None = None) -> SaveJob:
        """Queue a save of ``items`` into ``sinks`` (item.file indexes them).

        ``ready_event`` (GPU) orders the copies after the producer kernels.  ``unit_bytes``
        (a multiple of the block size) is the dedup granularity of items that have a base.
        ``device_cache``: the first cache level for items on its device (``device_cache.py``)."""
        if unit_bytes <= 0 or unit_bytes % BLOCK_SIZE:
            raise ValueError(f"unit_bytes must be a positive multiple of {BLOCK_SIZE}, got {unit_bytes}")
        for it in items:
            nblocks = max(1, -(-it.nbytes // BLOCK_SIZE))
            it.sums = [b""] * nblocks
            it.placed = []
        job = SaveJob(items, sinks, label=label, unit_bytes=unit_bytes, device_cache=device_cache)
        job.on_abort.append(self.cache.wake)
        _job_started()
        job.durable.add_done_callback(_job_ended)
        self._jobs.put((job, copy, ready_event))
        return job

    # -- stager -------------------------------------------------------------
    def stop(self) -> None:
        """Let queued saves finish, then end the stager and flush threads (called at exit).
        The flush threads stop only after the stager has queued its last batch."""
        self._jobs.put(None)
        self._stager.join()
        self._flush.shutdown()

    def _stage_loop(self) -> None:
        while True:
            entry = self._jobs.get()
            if entry is None:  # stop(): no daemon thread may be left inside native code at exit
                return
            job, copy, ready = entry
            try:
                self._stage(job, copy, ready)
            except BaseException as e:  # surfaced through the job
                log.debug("staging of %s failed", job.label, exc_info=True)
                job.fail(e)
            del entry, job, copy, ready  # an idle stager holds nothing of the last save

    def _stage(self, job: SaveJob, copy: bool, ready) -> None:
        job.timings["staging_started"] = time.monotonic()

        def direct_ok(it: CopyItem) -> bool:
            s = it.live()
            return (not copy) and s.device.type == "cpu" and s.is_contiguous()

        with paused_gc():  # a piece per item and a batch per run of them, none cyclic
            batches = plan_batches(job.items, self.piece_bytes, direct_ok=direct_ok)
            batches.sort(key=_residency)  # device regions first, then pinned, then pageable host
        flat: dict[int, torch.Tensor] = {}
        copier = _copier_for(job.items, ready)
        dc = job.device_cache
        parked: list[tuple[_Batch, int]] = []  # batches copied into the device cache
        with job._lock:
            job._pending = len(batches)
        if not batches:
            self._snapshot_done(job, copier)
            self._finish(job)
            return
        try:
            if not self._copy_out(job, batches, copier, flat, dc, parked):
                _release(dc, parked)
                return
            self._snapshot_done(job, copier)
        except BaseException:
            _release(dc, parked)
            raise
        flat.clear()
        self._drain(job, copier, dc, parked)

    def _copy_out(self, job: SaveJob, batches: list[_Batch], copier, flat: dict,
                  dc: DeviceCache | None, parked: list) -> bool:
        """Copy every batch out of the live tensors: into the device cache where it has room,
        into the host cache (blocking while full) otherwise.  False when the job was aborted."""
        by_address = isinstance(copier, _CpuCopier)
        for b in batches:
            if job.abort.is_set():
                return False
            for p in b.pieces:
                if id(p.item) not in flat:
                    src = copier.prepare(p.item.source)
                    addr = _host_address(src) if by_address and not b.direct else None
                    flat[id(p.item)] = _flat_bytes(src) if addr is None else addr
            if not b.direct and self._unchanged(job, b, flat):
                # nothing to copy or write: every byte is in the base.  Counted off on a flush
                # thread: the last batch finishes the job, which waits for this very stager
                self._flush.submit(self._batch_done, job)
                continue
            if b.direct:
                p = b.pieces[0]
                view = flat[id(p.item)][p.src_start:p.src_start + p.nbytes]
                self._flush.submit(self._flush_batch, job, b, view, None, None)
                continue
            doff = dc.try_alloc(b.nbytes) if dc is not None and _on_device(dc, b) else None
            if dc is not None and doff is not None:  # first level: a copy that stays on the device
                try:
                    _fill(copier, dc.view(doff, b.nbytes), b, flat)
                except BaseException:
                    dc.free(doff, b.nbytes)
                    raise
                parked.append((b, doff))
                continue
            off = self.cache.alloc(b.nbytes, job.abort)
            view = self.cache.view(off, b.nbytes)
            try:
                _fill(copier, view, b, flat)
                event = copier.record()
            except BaseException:
                self.cache.free(off, b.nbytes)
                raise
            self._flush.submit(self._flush_batch, job, b, view, off, event)
            # a source is no longer needed once its last piece is issued (kept until the
            # copy completes through `flat` of this frame for GPU; CPU copies are synchronous)
        return True

    def _drain(self, job: SaveJob, copier, dc: DeviceCache | None, parked: list) -> None:
        """Second level: move the batches parked in the device cache through the host cache to
        storage (the snapshot is done: training runs meanwhile).  Blocks on the host cache like
        any batch; a device region is freed once its copy to the host has landed."""
        for i, (b, doff) in enumerate(parked):
            if job.abort.is_set():
                _release(dc, parked[i:])
                return
            try:
                off = self.cache.alloc(b.nbytes, job.abort)
            except BaseException:
                _release(dc, parked[i:])
                if job.error is None:
                    raise
                return
            view = self.cache.view(off, b.nbytes)
            assert dc is not None, "batches are parked only where a device cache is"
            try:
                copier.copy(view, dc.view(doff, b.nbytes))
                event = copier.record()
            except BaseException:
                self.cache.free(off, b.nbytes)
                _release(dc, parked[i:])
                raise
            self._flush.submit(self._flush_batch, job, b, view, off, event, (dc, doff))

    def _snapshot_done(self, job: SaveJob, copier) -> None:
        copier.synchronize()  # every byte has left the live tensors
        torn = [it.key for it in job.items if it.watch is not None and it.source is not None
                and it.watch.changed(it.source)]
        if torn:
            raise TornSnapshotError(
                f"{len(torn)} tensor(s) changed in place while the lazy snapshot was copying them "
                f"(first: {torn[0]!r}); the save is not committed. Call writer.wait_snapshot() "
                "(or use SnapshotGuard, Checkpointer.register_step_pre_hook, or the torchtitan "
                "integration) before the optimizer step", checkpoint=job.label)
        for it in job.items:
            it.source = it.watch = None  # release references: the allocator may reuse the memory now
        job.timings["snapshot_done"] = time.monotonic()
        # the future first: its callbacks (the session's "snapshotted" stamp) run before the
        # event lets the flush threads close the files and report the data written
        _settle(job.snapshotted)
        job.snapshot_done.set()
        log.debug("%s: snapshot done in %.3fs", job.label,
                  job.timings["snapshot_done"] - job.timings["submitted"])

    # -- flush --------------------------------------------------------------
    def _flush_batch(self, job: SaveJob, b: _Batch, view: torch.Tensor, cache_off, event,
                     parked: tuple | None = None) -> None:
        try:
            if event is not None:  # first: no memory of this batch is reused before it lands
                event.synchronize()
            if parked is not None:  # the device region's bytes are in the host cache now
                parked[0].free(parked[1], b.nbytes)
                parked = None
            if job.abort.is_set():
                return
            mv = view.numpy().data if view.numel() else memoryview(b"")
            sink = job.sinks[b.file]
            direct = getattr(sink, "o_direct", False) and cache_off is not None
            if b.pieces[0].item.codec:  # a sink of compressed blocks holds nothing else
                for p in b.pieces:
                    _write_packed(job, p, mv[p.dst_pos:p.dst_pos + p.nbytes], sink, b.file)
                return
            with paused_gc():  # a few records per piece, none cyclic; the writes come after
                spans = self._spans(job, b, mv, sink, direct)
            for x, y, off in spans:
                if direct:  # O_DIRECT: whole blocks from the aligned cache
                    n = y - x
                    padded = align_up(n)
                    assert cache_off is not None, "direct writes come from the host cache"
                    full = self.cache.view(cache_off + x, padded)
                    if x + padded > b.nbytes:
                        full[b.nbytes - x:].zero_()
                    sink.pwrite(full.numpy().data, off, logical=n)
                else:
                    sink.pwrite(mv[x:y], off)
        except BaseException as e:  # noqa: BLE001 - a flush thread reports through its job, never dies silently
            job.fail(e)
        finally:
            if parked is not None:
                parked[0].free(parked[1], b.nbytes)
            if cache_off is not None:
                self.cache.free(cache_off, b.nbytes)
            self._batch_done(job)

    @staticmethod
    def _spans(job: SaveJob, b: _Batch, mv: memoryview, sink, direct: bool) -> list[tuple[int, int, int]]:
        """Batch ``b``'s block digests, its reuse of the base, and the ranges of it to write,
        ``(start, end, file offset)``, each reserved in the file and recorded in its items."""
        spans: list[list] = []  # [start, end, units], each unit (item, item_start, start, nbytes)
        for p in b.pieces:
            sums = block_checksums(mv[p.dst_pos:p.dst_pos + p.nbytes])
            first = p.src_start // BLOCK_SIZE
            p.item.sums[first:first + len(sums)] = sums
            for a, z, reuse in _units(p, job.unit_bytes):
                if reuse is not None:
                    p.item.placed.extend(reuse)
                    continue
                x, y = p.dst_pos + a - p.src_start, p.dst_pos + z - p.src_start
                if spans and x - spans[-1][1] < ALIGNMENT:  # only alignment padding between
                    spans[-1][1] = y
                else:
                    spans.append([x, y, []])
                spans[-1][2].append((p.item, a, x, z - a))
        out = []
        for x, y, units in spans:
            if direct:  # O_DIRECT writes start on a page of the cache: widen packed spans down
                x = x // ALIGNMENT * ALIGNMENT
            off = sink.reserve(y - x)
            for item, a, ux, un in units:
                item.placed.append((a, b.file, off + ux - x, un))
            out.append((x, y, off))
        return out

    def _batch_done(self, job: SaveJob) -> None:
        with job._lock:
            job._pending -= 1
            last = job._pending == 0
        if last and job.error is None:
            self._finish(job)

    @staticmethod
    def _unchanged(job: SaveJob, b: _Batch, flat: dict) -> bool:
        """Incremental saves: digest a CPU batch straight from the live tensors (stable until
        the snapshot is done) and, when every unit matches the base, record the reuse and skip
        the copy and the write.  Stops at the first block that differs, so a changed batch
        costs one extra block digest before it takes the normal path."""
        if not all(_comparable(p.item) and not p.item.codec and p.item.live().device.type == "cpu"
                   for p in b.pieces):
            return False
        reuse = []
        for p in b.pieces:
            it = p.item
            if p.nbytes == 0:
                continue
            mv = _source_bytes(flat[id(it)], p.src_start, p.nbytes)
            first = p.src_start // BLOCK_SIZE
            for j, i in enumerate(range(0, p.nbytes, BLOCK_SIZE)):
                d = block_checksums(mv[i:i + BLOCK_SIZE])[0]
                if it.base is None or d != it.base.sums[first + j]:
                    return False
                it.sums[first + j] = d
            for _a, _z, r in _units(p, job.unit_bytes):
                if r is None:  # equal bytes, but the base's file is not on this tier
                    return False
                reuse.append((it, r))
        for it, r in reuse:
            it.placed.extend(r)
        return True

    def _finish(self, job: SaveJob) -> None:
        try:
            job.snapshot_done.wait()
            # one fsync per stripe, in parallel (the other stripes on helper threads: this one
            # runs on a flush thread, which must not wait for the pool it belongs to)
            helpers = [_call_in_thread(sk.close, True) for sk in job.sinks[1:]]
            first = job.sinks[0].close(sync=True)
            job.file_sizes = [first] + [f.result() for f in helpers]
            job.timings["data_written"] = time.monotonic()
            if not job.durable.done():
                job.durable.set_result(Written(job.file_sizes, dict(job.timings)))
        except BaseException as e:  # noqa: BLE001 - the close fails the job, which its future reports
            job.fail(e)


def _write_packed(job: SaveJob, p: _Piece, mv: memoryview, sink, file: int) -> None:
    """Piece ``p`` (its bytes ``mv``), compressed block by block and written a dedup unit at a
    time (so a flush thread holds one unit's stored bytes, not a piece's): each block's digest
    covers its stored bytes; a unit whose stored blocks equal the base's reuses them, the
    others are appended to the sink, each block its own segment."""
    it = p.item
    for a, z in _unit_bounds(p.src_start, p.src_start + p.nbytes, job.unit_bytes):
        if job.abort.is_set():
            return
        lo = a - p.src_start
        stored = [encode_block(mv[i:min(i + BLOCK_SIZE, z - p.src_start)], it.codec)
                  for i in range(lo, z - p.src_start, BLOCK_SIZE)]
        first = a // BLOCK_SIZE
        it.sums[first:first + len(stored)] = [xxhash.xxh3_128_digest(x) for x in stored]
        reuse = _reuse(it, a, z)
        if reuse is not None:
            it.placed.extend(reuse)
            continue
        data = b"".join(stored)  # one write at the reserved offset (object stores append in that order)
        off = pos = sink.reserve(len(data))
        for k, x in enumerate(stored):
            it.placed.append((a + k * BLOCK_SIZE, file, pos, len(x)))
            pos += len(x)
        del stored
        sink.pwrite(data, off)


def _fill(copier, view: torch.Tensor, b: _Batch, flat: dict) -> None:
    """Copy batch ``b``'s pieces into ``view`` (host or device cache), zeroing the padding
    between the extents of a coalesced batch.  A source kept by address (``_host_address``,
    CPU jobs only) is copied with one memmove into the host cache."""
    host = view.data_ptr() if isinstance(copier, _CpuCopier) and view.device.type == "cpu" else None
    pos = 0
    for p in b.pieces:
        if p.dst_pos > pos:
            if host is not None:
                ctypes.memset(host + pos, 0, p.dst_pos - pos)
            else:
                copier.zero(view[pos:p.dst_pos])
        pos = p.dst_pos + p.nbytes
        src = flat[id(p.item)]
        if type(src) is int:
            if host is None:
                raise AssertionError("a source kept by address is copied into host memory only")
            ctypes.memmove(host + p.dst_pos, src + p.src_start, p.nbytes)
        else:
            copier.copy(view[p.dst_pos:p.dst_pos + p.nbytes], src[p.src_start:p.src_start + p.nbytes])


def _on_device(dc: DeviceCache, b: _Batch) -> bool:
    return all(dc.holds(p.item.live()) for p in b.pieces)


def _release(dc: DeviceCache | None, parked: list) -> None:
    if dc is None:
        return
    for b, doff in parked:
        dc.free(doff, b.nbytes)


def _residency(b: _Batch) -> int:
    """Where a batch's bytes live: 0 device, 1 pinned host, 2 pageable host.  The stager takes
    device regions first (DataStates-LLM's order): they hold the scarcest memory and copy
    fastest, so the GPU is free of the snapshot soonest."""
    s = b.pieces[0].item.source
    if s is None:
        return 2
    if s.device.type != "cpu":
        return 0
    return 1 if s.is_pinned() else 2


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (shared with every view of its storage); None where torch does
    not track it (tensors created under ``inference_mode``)."""
    try:
        return t._version
    except RuntimeError:
        return None


@dataclass(frozen=True, slots=True)
class Watch:
    """The version counters a lazy save reads for one storage it copies later: the storage's
    own, and those of the DTensors whose local shard it is (``through``).  An in-place op
    through a DTensor (FSDP2's parameters, an optimizer's state) bumps the DTensor's counter,
    not its shard's: the op reaches the shard below autograd, where no counter is bumped."""

    at_start: int  # the counters' sum when the save started
    through: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def read(t: torch.Tensor, through: tuple[torch.Tensor, ...] = ()) -> int | None:
        """The counters' sum now (None where torch does not track ``t``'s)."""
        v = tensor_version(t)
        if v is None:
            return None
        return v + sum(w for d in through if (w := tensor_version(d)) is not None)

    def changed(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (the storage's tensor) or a DTensor it was reached through changed in
        place since the save started."""
        now = self.read(t, self.through)
        return now is not None and now != self.at_start


class _CpuCopier:
    """memcpy on the stager thread (torch's copy releases the GIL)."""

    def prepare(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def zero(self, dst: torch.Tensor) -> None:
        dst.zero_()

    def record(self):
        return None

    def synchronize(self) -> None:
        pass


def _copier_for(items: list[CopyItem], ready):
    cuda_items = [i for i in items if i.source is not None and i.source.device.type == "cuda"]
    if not cuda_items:
        return _CpuCopier()
    if not cuda_ext.available():
        return _CpuCopier()
    return cuda_ext.D2HCopier(cuda_items[0].live().device.index or 0, ready)


# Process-wide on purpose: one engine (stager and flush threads) per host cache and thread count,
# shared by every writer of the process, so saves queue behind each other instead of competing.
_engines: dict[tuple[int, int], SnapshotEngine] = {}
_engine_lock = threading.Lock()


def _stop_engines() -> None:
    with _engine_lock:
        engines = list(_engines.values())
        _engines.clear()
    for eng in engines:
        try:
            eng.stop()
        except (RuntimeError, OSError) as e:  # exiting anyway: say what was left
            log.warning("engine stop at exit failed: %s", e)


def _exit_watch() -> None:
    """Wait for the main thread to finish, then let the engines finish their queued saves and
    stop.  Engine threads are not daemons, so the interpreter waits for them; this tells them
    when to end, through public threading API only."""
    threading.main_thread().join()
    _stop_engines()


_watcher: list[threading.Thread] = []  # the one thread that stops the engines at exit (_exit_watch)


def _forget_engines_in_child() -> None:
    """A forked child (a DataLoader worker) has none of its parent's threads: engines whose
    workers it lacks would take its saves and never run them.  It makes its own on first use."""
    global _engine_lock
    _engine_lock = threading.Lock()
    process_state.keep(dict(_engines), list(_watcher))
    _engines.clear()
    _watcher.clear()


process_state.in_child(_forget_engines_in_child)


class _Workers:
    """A fixed pool of non-daemon threads fed by a FIFO queue.  Not concurrent.futures: its
    exit hook refuses new work while a queued save may still need to submit some."""

    def __init__(self, n: int, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}") for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> None:
        self._q.put((fn, args))

    def _run(self) -> None:
        while True:
            task = self._q.get()
            if task is None:
                return
            fn, args = task
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - tasks report through their job
                log.error("flush task %s failed outside its job: %s", getattr(fn, "__name__", fn), e)
            del task, fn, args  # an idle thread holds nothing of the last save

    def shutdown(self) -> None:
        """Run what is queued, then end the threads."""
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()


def _call_in_thread(fn, *args) -> Future:
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            fut.set_exception(e)
    threading.Thread(target=run, name="dcpds-fsync").start()
    return fut


def get_engine(cache: HostCache, io_threads: int) -> SnapshotEngine:
    """Process-wide engine for ``cache`` (created on first use, then reused)."""
    with _engine_lock:
        key = (id(cache), io_threads)
        eng = _engines.get(key)
        if eng is None:
            eng = _engines[key] = SnapshotEngine(cache, io_threads=io_threads)
            if not _watcher:
                _watcher.append(threading.Thread(target=_exit_watch, name="dcpds-exit-watch"))
                _watcher[0].start()
        return eng
