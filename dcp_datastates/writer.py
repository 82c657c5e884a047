"""``DataStatesWriter``: a DCP ``StorageWriter`` and ``AsyncStager``.

Call order under ``dcp.save`` / ``dcp.async_save`` (DCP drives it):

0. (caller thread, async only) ``stage(state_dict)`` returns the live state
   dict at once: nothing is copied yet (the *lazy* snapshot).
1. (all ranks) ``reset(checkpoint_id)`` when an id is given, then
   ``set_up_storage_writer`` and ``prepare_local_plan``.
2. (coordinator) ``prepare_global_plan`` names one data file per rank and a
   save id shared by all ranks.
3. (all ranks) ``write_data`` lays the rank's items out in its data file and
   hands them to the engine, which copies them out of the live tensors into
   the bounded host cache and streams them to storage.  Its future resolves
   once the data file is fsynced.
4. (coordinator) ``finish`` merges every rank's results into the msgpack
   manifest and commits it (temp file, fsync, rename).  That rename is the
   commit: a directory without it is not a checkpoint.

With ``use_collectives=False`` every rank commits its own rank manifest in
step 4, and the reader merges them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import sys
import time
import uuid

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ._version import __version__
from . import _faults
from .engine import CopyItem, get_engine
from .engine.snapshot import tensor_version
from .engine.host_cache import default_host_cache_bytes, shared_host_cache
from .errors import CheckpointError, CheckpointExistsError, ProviderError, UnsupportedValueError
from .format import BLOCK_SIZE, MANIFEST_NAME, Manifest, dtype_name, encode_manifest
from .format.layout import FileLayout
from .format.manifest import Chunk, Extent, Seg, TensorEntry, ValueEntry
from .format.names import (CLAIM_NAME, PERSISTED_RECORD, data_file_name, parse_rank_manifest,
                           rank_claim_name, rank_manifest_name)
from .providers import ObjectProvider, provider_for, type_provider_for
from .session import SaveSession
from .tiers import StorageTier
from .tiers.claim import Claim, acquire
from .tiers.manifests import load_manifest
from .tiers.tidy import Tidy, rank_superseded, superseded_here
from torch.distributed.tensor import DTensor
import torch.distributed as dist
import msgpack
from concurrent.futures import Future as CFuture
from torch.distributed.checkpoint.utils import find_state_dict_object
import cuda_ext
from .tiers.persist import upload_rank
from .tiers.persist import commit_when_complete
import xxhash

log = logging.getLogger(__name__)

STRIPE_MIN_BYTES = 64 << 20  # below this per file, more files only add fsyncs
DEFAULT_DEDUP_UNIT = 4 << 20


@dataclasses.dataclass
class _Base:
    """An incremental save's base, as one rank sees it."""
    name: str  # its directory, a sibling of the new checkpoint's
    manifest: Manifest
    here: frozenset  # base files present on this rank's tier (the only ones it may reference)
    homes: dict  # base file -> the directory that holds it
    chunks: dict  # (fqn, offsets) -> Chunk


def _storage_key(t: torch.Tensor):
    try:
        return (t.device.type, t.device.index, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # storage-less wrappers: not tracked
        return None


def _versions(tensors: list[torch.Tensor]) -> dict:
    """Version counter per storage (views share their base's counter)."""
    out = {}
    for t in tensors:
        k = _storage_key(t)
        v = tensor_version(t)
        if k is not None and v is not None:
            out[k] = v
    return out


def _iter_tensors(obj):
    if isinstance(obj, DTensor):
        yield obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _iter_tensors(v)


class DataStatesWriter(StorageWriter):
    """Save DCP checkpoints in the dcp-datastates format.

    Args:
        path: checkpoint directory (local path or fsspec URL).  May be omitted
            when ``checkpoint_id`` is passed to ``dcp.save``.
        overwrite: replace a committed checkpoint at ``path``.  Off by default:
            saving over a committed checkpoint raises ``CheckpointExistsError``.
            When on, the old checkpoint stays loadable until the new manifest
            commits; its data files are removed afterwards.
        thread_count: flush threads per rank (writes and checksums).
        host_cache_bytes: size of the host staging cache shared by all saves of
            this process (default 2 GiB, or ``DCP_DATASTATES_HOST_CACHE_BYTES``).
        allow_pickle: store values msgpack cannot express with pickle.  Off by
            default; such values then raise ``UnsupportedValueError``.
        sync_files: fsync data files and the manifest (durability).  Keep on.
        storage_options: passed to fsspec for URLs.
        async_mode: ``"process"`` when the save runs in DCP's checkpoint process
            (``async_checkpointer_type=PROCESS``); ``None`` or ``"thread"`` otherwise.
            ``dcp_datastates.async_save`` sets it from its arguments; a PROCESS save through
            plain ``dcp.async_save`` without it fails with an error that says so.
        persist_to: slower tiers (paths or fsspec URLs of this checkpoint's directory on
            each), flushed in the background after ``path`` holds the data.  Each commits on
            its own; see ``tiers/persist.py``.
        persist: flush this save to ``persist_to`` (a run-level checkpointer turns it off
            for the checkpoints it does not persist).
        persist_options: fsspec storage options for the ``persist_to`` URLs.
        incremental_base: a committed checkpoint of the same run, in a sibling directory of
            ``path`` (``"step-90"`` or its full path).  Chunks whose bytes are unchanged since
            that checkpoint are not written again: the new manifest points at the base's bytes
            (per dedup unit).  ``None`` (default) writes a self-contained checkpoint.  A missing
            or unreadable base is logged and the save is written in full.
        dedup_unit_bytes: granularity of incremental reuse, a multiple of 1 MiB (default 4 MiB;
            ``docs/benchmarks.md`` has the measurement behind it).
        o_direct: write local data files with O_DIRECT from the page-aligned host cache,
            bypassing the page cache (on by default; the file system is probed and writes fall
            back to buffered where it refuses).  Off: large CPU tensors of a synchronous save are
            written straight from their own memory through the page cache.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, path: str | None = None, *, overwrite: bool = False,
                 thread_count: int = 4, host_cache_bytes: int | None = None,
                 allow_pickle: bool = False, sync_files: bool = True,
                 storage_options: dict | None = None, async_mode: str | None = None,
                 persist_to: list[str] | str | None = None, persist: bool = True,
                 persist_options: dict | None = None, o_direct: bool = True,
                 incremental_base: str | None = None,
                 dedup_unit_bytes: int = DEFAULT_DEDUP_UNIT) -> None:
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        if host_cache_bytes is not None and host_cache_bytes < BLOCK_SIZE:
            raise ValueError(f"host_cache_bytes must be at least {BLOCK_SIZE} (one checksum block), "
                             f"got {host_cache_bytes}")
        if async_mode not in (None, "thread", "process"):
            raise ValueError(f"async_mode must be None, 'thread' or 'process', got {async_mode!r}")
        self.path = None if path is None else str(path)
        self.overwrite = overwrite
        self.thread_count = thread_count
        self.host_cache_bytes = host_cache_bytes or default_host_cache_bytes()
        self.allow_pickle = allow_pickle
        self.sync_files = sync_files
        self.storage_options = storage_options
        self.async_mode = async_mode
        if isinstance(persist_to, str):
            persist_to = [persist_to]
        self.persist_to = [str(p) for p in (persist_to or [])]
        self.persist = persist
        self.persist_options = persist_options
        self.o_direct = o_direct
        if dedup_unit_bytes <= 0 or dedup_unit_bytes % BLOCK_SIZE:
            raise ValueError(f"dedup_unit_bytes must be a positive multiple of {BLOCK_SIZE}, "
                             f"got {dedup_unit_bytes}")
        self.incremental_base = None if incremental_base is None else str(incremental_base)
        self.dedup_unit_bytes = dedup_unit_bytes
        self._base: _Base | None = None
        self.last_stats: dict[str, int] = {}
        self._persist_futs: list = []
        self.rank = 0
        self.is_coordinator = True
        self.use_collectives = True
        self.save_id = uuid.uuid4().hex[:12]
        self._session: SaveSession | None = None
        self._staged = False
        self._job = None
        self.last_timings: dict[str, float] = {}
        self._claims: dict[str, Claim] = {}  # tier url -> claim held by the save in flight
        self._tidies: dict[str, Tidy] = {}  # tier url -> what its commit may remove
        self._planned_at = 0.0

    # ------------------------------------------------------------ AsyncStager
    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        """Start a lazy snapshot: return the live state dict, copy nothing yet."""
        self._wait_previous()
        process = self.async_mode == "process"
        self._session = SaveSession(lazy=True, cross_process=process)
        self._stage_pid = os.getpid()
        self._staged = True
        if not process:
            tensors = list(_iter_tensors(state_dict))
            # order the side-stream copies after the kernels queued so far on this thread's stream
            self._session.ready = _ready_events_for(tensors)
            # version counters now: a tensor changed in place before its bytes are copied makes
            # the save fail uncommitted (engine/snapshot.py), never a torn checkpoint
            self._session.versions = _versions(tensors)
        if process:
            # The daemon reads CPU tensors through shared memory. Move them there now,
            # in the caller thread, so the pickler never copies live memory in the background.
            for t in _iter_tensors(state_dict):
                if t.device.type == "cpu" and not t.is_shared():
                    t.share_memory_()
                elif t.device.type == "cuda":
                    torch.cuda.current_stream(t.device).synchronize()
        return state_dict

    def synchronize_staging(self) -> None:
        self.wait_snapshot()

    def close(self) -> None:
        pass

    def attach(self, future) -> None:
        """Let :meth:`wait_snapshot` see failures that happen before ``write_data``."""
        if self._session is not None:
            self._session.future = future

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Block until the current async save has copied every byte out of the live state.

        After it returns, training may mutate parameters and optimizer state.
        Returns ``False`` only on timeout; raises if the save failed.
        """
        s = self._session
        if s is None or not s.lazy:
            return True
        return s.wait_snapshot(timeout)

    def timings(self) -> dict[str, float]:
        """Seconds from the last save's call to each stage it reached: ``snapshot_done_s``
        (every byte left the live state), ``data_written_s`` (this rank's files fsynced) and
        ``committed_s`` (manifest committed; coordinator only).  Works in PROCESS mode too."""
        return {} if self._session is None else self._session.timings()

    def _wait_previous(self) -> None:
        """Back-to-back policy: a new save on this writer waits for the previous one's data."""
        job = self._job
        if job is not None and not job.durable.done():
            log.info("previous save on this writer is still flushing; waiting")
            try:
                job.durable.result()
            except BaseException:  # noqa: BLE001 - the previous save reports its own error
                pass

    # ---------------------------------------------------------- StorageWriter
    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex[:12]

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        if self.path is None:
            raise CheckpointError("DataStatesWriter has no path: pass one to the constructor "
                                  "or give dcp.save a checkpoint_id")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        self._release_claims()  # a previous save through this writer that DCP abandoned
        self.save_id = uuid.uuid4().hex[:12]
        if not self.use_collectives:
            self.save_id = _agree_save_id(self.save_id)
        if self._staged:
            self._staged = False  # this save was started by stage(): keep its lazy session
            if os.getpid() != self._stage_pid and not self._session.cross_process:
                raise CheckpointError(
                    "this save runs in DCP's checkpoint process (async_checkpointer_type=PROCESS), "
                    "but the writer was staged for THREAD mode, so wait_snapshot() could not see it "
                    "finish; pass DataStatesWriter(async_mode='process') or save with "
                    "dcp_datastates.async_save(...), which tells the writer", checkpoint=self.path)
        else:
            self._session = SaveSession(lazy=False)
        self.tier = StorageTier(self.path, self.storage_options)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            self.tier = StorageTier(self.path, self.storage_options)
            self.tier.makedirs()
            _faults.point("plan")
            if not self.overwrite and self._committed_here():
                raise CheckpointExistsError(
                    "a committed checkpoint already exists here; pass overwrite=True to "
                    "DataStatesWriter to replace it, or save to a new path", checkpoint=self.path)
            self._base = self._load_base()
        except BaseException as e:
            self._fail(e)
            raise
        return plan

    def _claim_dirs(self) -> None:
        """Claim this save's directory on every tier it writes (``tiers/claim.py``), then, under
        the claims, re-check ``overwrite`` and read what the save will replace."""
        per_rank = not self.use_collectives
        name = rank_claim_name(self.rank) if per_rank else CLAIM_NAME
        self._planned_at = time.monotonic()
        try:
            for i, t in enumerate([self.tier, *self._persist_tiers()]):
                try:
                    c = acquire(t, name, self.save_id, busy=self._busy)
                except CheckpointError:
                    raise  # busy: another save holds it
                except Exception as e:  # noqa: BLE001 - fsspec backends raise their own types
                    if i == 0:
                        raise
                    # an unreachable slow tier must not fail the save: its flush reports it
                    log.warning("could not claim %s (%s); its flush will report the failure", t.url, e)
                    continue
                self._claims[t.url] = c
                rank = self.rank if per_rank else None
                self._tidies[t.url] = Tidy(t, self.save_id, superseded_here(t, rank=rank),
                                           list(c.took_over), rank)
            if not self.overwrite and self._committed_here():
                raise CheckpointExistsError(
                    "a committed checkpoint already exists here (committed while this save was "
                    "planning); pass overwrite=True to replace it", checkpoint=self.path)
        except BaseException:
            self._release_claims()
            raise

    def _busy(self) -> bool:
        """Whether this writer's save still has work in flight (claims of a save DCP abandoned
        after planning are stale once nothing of it runs)."""
        job = self._job
        if job is not None and not job.durable.done():
            return True
        if any(not f.done() for f in self._persist_futs):
            return True
        return job is None and time.monotonic() - self._planned_at < 120.0

    def _release_claims(self, url: str | None = None) -> None:
        for u in list(self._claims) if url is None else [url]:
            c = self._claims.pop(u, None)
            if c is not None:
                c.release()

    def _tidy_after_commit(self, tier: StorageTier, manifest: Manifest) -> None:
        """After ``tier`` committed this save: remove what it superseded, then drop the claim."""
        try:
            tidy = self._tidies.pop(tier.url, None)
            if tidy is None:
                return
            if self.use_collectives:
                tidy.run({f for f in manifest.files if f not in manifest.homes})
            else:
                names, old, protect = rank_superseded(tier, self.rank, self.save_id)
                for n in names:  # uncommit first: a crash from here on leaves only leftovers
                    tier.remove(n)
                tidy.superseded = old
                tidy.run(protect)
        except (OSError, CheckpointError) as e:
            log.warning("%s committed, but tidying superseded files failed (%s); they stay "
                        "until the next save here", tier.url, e)
        finally:
            self._release_claims(tier.url)

    def _load_base(self):
        """The incremental base as seen from this rank's tier (None: write in full)."""
        if self.incremental_base is None:
            return None
        raw = self.incremental_base.rstrip("/")
        name = raw.rpartition("/")[2]
        if "/" in raw and StorageTier(raw, self.storage_options).parent().root != self.tier.parent().root:
            raise ValueError(f"incremental_base {self.incremental_base!r} must be a sibling of the "
                             f"checkpoint directory {self.path!r} (another step of the same run)")
        if name == self.tier.name:
            return None  # re-saving a step over itself: nothing to reference
        base_tier = self.tier.sibling(name)
        try:
            m = load_manifest(base_tier)
        except (CheckpointError, OSError) as e:
            log.warning("incremental base %s is not usable (%s); writing %s in full",
                        base_tier.url, str(e).splitlines()[0][:200], self.path)
            return None
        homes = {f: m.homes.get(f, name) for f in m.files}
        listed: dict[str, set] = {}
        here = set()
        for f, home in homes.items():
            if home not in listed:
                listed[home] = set(self.tier.sibling(home).listdir())
            if f in listed[home]:
                here.add(f)
        chunks = {(fqn, c.offsets): c for fqn, t in m.tensors.items() for c in t.chunks}
        return _Base(name, m, frozenset(here), homes, chunks)

    def _base_extents(self, fqn: str, offsets: tuple) -> dict:
        """Base extents of chunk ``(fqn, offsets)``: ``{part name or "": Extent}``."""
        c = None if self._base is None else self._base.chunks.get((fqn, offsets))
        if c is None:
            return {}
        if c.extent is not None:
            return {"": c.extent}
        return {k: ext for k, (_dt, _shape, ext) in c.parts.items()}

    def _committed_here(self) -> bool:
        names = self.tier.listdir()
        if MANIFEST_NAME in names or (not self.tier.local and self.tier.exists(MANIFEST_NAME)):
            return True
        if not self.use_collectives:
            return any((p := parse_rank_manifest(n)) is not None and p[0] == self.rank for n in names)
        return False

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        try:
            self._claim_dirs()
        except BaseException as e:
            self._fail(e)
            raise
        save_id = self.save_id
        if len(plans) == 1 and not self.use_collectives:
            return [dataclasses.replace(plans[0], storage_data={"rank": self.rank, "save_id": save_id})]
        return [dataclasses.replace(p, storage_data={"rank": i, "save_id": save_id})
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return self._write_data(plan, planner)
        except BaseException as e:
            self._fail(e)
            raise

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        sd = plan.storage_data if isinstance(plan.storage_data, dict) else {}
        rank = int(sd.get("rank", self.rank))
        self.save_id = sd.get("save_id", self.save_id)
        session = self._session or SaveSession(lazy=False)
        copy_items: list[CopyItem] = []
        results: list[tuple] = []  # (write_item, kind, payload)

        resolved = []
        for item in plan.items:
            fqn = item.index.fqn
            try:
                if item.type == WriteItemType.BYTE_IO:
                    obj, found = _lookup_original(planner, item)
                    if not (found and type_provider_for(obj) is not None):
                        results.append((item, "v", self._encode_value(planner, item)))
                        continue
                    prov = provider_for(obj)  # a registered type held as a plain value
                else:
                    prov = provider_for(planner.resolve_data(item))
            except ProviderError as e:
                raise ProviderError(str(e), checkpoint=self.path, key=fqn) from e.__cause__
            resolved.append((item, prov, prov.regions()))
        total = sum(r.nbytes for _, _, regions in resolved for r in regions)
        n_files = max(1, min(self.thread_count, total // STRIPE_MIN_BYTES))
        names = [data_file_name(rank, self.save_id, k) for k in range(n_files)]
        layouts = [FileLayout(n) for n in names]
        # largest regions first onto the least-filled stripe: balanced files, one writer each
        order = sorted(((r.nbytes, i, j) for i, (_, _, regions) in enumerate(resolved)
                        for j, r in enumerate(regions)), reverse=True)
        where: dict[tuple[int, int], tuple[int, int]] = {}
        for nbytes, i, j in order:
            k = min(range(n_files), key=lambda k: layouts[k].end)
            where[(i, j)] = (k, layouts[k].place(nbytes))

        base_files = self._base.here if self._base is not None else frozenset()
        versions = getattr(session, "versions", None) if session.lazy else None
        for i, (item, prov, regions) in enumerate(resolved):
            fqn = item.index.fqn
            placed = []
            bases = self._base_extents(fqn, tuple(item.index.offset) if item.index.offset is not None else ())
            for j, r in enumerate(regions):
                k, off = where[(i, j)]
                ci = CopyItem(f"{fqn}{'/' + r.name if r.name else ''}", r.source, off, r.nbytes, k)
                ci.base = bases.get(r.name or "")
                if versions is not None:
                    v = tensor_version(r.source)
                    ci.version = versions.get(_storage_key(r.source), v)
                ci.base_files = base_files
                copy_items.append(ci)
                placed.append((r.name, dtype_name(r.source.dtype), list(r.source.shape), ci))
            if prov.name == "tensor":
                results.append((item, "t", placed[0][3]))
            else:
                kind = "pv" if item.type == WriteItemType.BYTE_IO else "p"
                results.append((item, kind, (prov.name, prov.meta(), placed, prov.tree())))

        lazy = session.lazy
        label = f"{self.path} rank {rank}"
        fut: Future = Future()
        if not copy_items:
            session.mark_snapshot()
            self._start_uploads({}, rank, session)
            fut.set_result(self._results(results, names, [], session))
            return fut
        self.tier.makedirs()
        persisting = bool(self.persist_to and self.persist)
        sinks = [self.tier.open_sink(n, o_direct=self.o_direct, drop_cache=not persisting) for n in names]
        ready = getattr(session, "ready", None) if lazy else None
        if ready is None:
            ready = _ready_events(copy_items)
        engine = get_engine(shared_host_cache(self.host_cache_bytes, _want_pinned(copy_items)),
                            self.thread_count)
        direct_io = any(getattr(s, "o_direct", False) for s in sinks)
        job = engine.submit(copy_items, sinks, copy=lazy or direct_io or _any_gpu(copy_items), label=label,
                            ready_event=ready, unit_bytes=self.dedup_unit_bytes)
        self._job = job

        def on_snapshot() -> None:
            job.snapshot_done.wait()
            if job.error is None:
                session.mark_snapshot()

        def done(_f) -> None:
            try:
                job_result = _f.result()
                session.stamp("data_written")
                sizes = job_result.file_sizes
                for n, sz in zip(names, sizes):
                    if sz == 0:  # every byte of this stripe was reused from the base
                        self.tier.remove(n)
                res = self._results(results, names, sizes, session, job_result.timings)
                self._start_uploads({n: sz for n, sz in zip(names, sizes) if sz > 0}, rank, session)
                fut.set_result(res)
            except BaseException as e:  # noqa: BLE001
                session.mark_failed(e)
                fut.set_exception(CheckpointError(f"writing rank {rank}'s data failed: {e}",
                                                  checkpoint=self.path, file=names[0]))

        threading.Thread(target=on_snapshot, daemon=True, name="dcpds-snapwatch").start()
        job.durable.add_done_callback(done)
        if not lazy:
            # synchronous dcp.save: DCP waits on the future right away anyway
            job.durable.exception()
        return fut

    # ---------------------------------------------------------- persistence
    def _persist_tiers(self) -> list[StorageTier]:
        return [StorageTier(u, self.persist_options) for u in self.persist_to] if self.persist else []

    def _start_uploads(self, files: dict[str, int], rank: int, session) -> None:
        """Phase 1 of the slow-tier commit: this rank's files, then its marker."""
        refs = getattr(self, "_refs", {})
        self._persist_futs = [upload_rank(self.tier, dst, files, rank, self.save_id, refs=refs)
                              for dst in self._persist_tiers()]
        self._upload_futs = list(self._persist_futs)
        if not self._persist_futs:
            session.mark_persisted()
            return
        if not self.is_coordinator or not self.use_collectives:
            _when_all(self._persist_futs, lambda err: session.mark_persisted(err))

    def _start_commits(self, manifest: Manifest, body: bytes, name: str) -> None:
        """Phase 2 (coordinator): commit the manifest on each slow tier once all ranks uploaded."""
        tiers = self._persist_tiers()
        if not tiers:
            return
        session = self._session
        if not self.use_collectives:
            # every rank commits its own rank manifest after its own upload
            futs = []

            def commit(tier: StorageTier) -> None:
                tier.commit_bytes(name, body)
                self._tidy_after_commit(tier, manifest)
            for f, tier in zip(self._upload_futs, tiers):
                futs.append(_chain(f, lambda tier=tier: commit(tier)))
                f.add_done_callback(lambda f, u=tier.url: self._release_claims(u)
                                    if f.exception() is not None else None)
            self._persist_futs = futs
            _when_all(futs, lambda err: session.mark_persisted(err) if session else None)
            return
        lock = threading.Lock()
        by_url = {t.url: t for t in tiers}

        def record(url: str) -> None:
            self._tidy_after_commit(by_url[url], manifest)
            with lock:
                _record_persisted(self.tier, url)
        ranks = list(range(manifest.world_size))
        give_up = [threading.Event() for _ in tiers]  # set when this rank's own upload fails
        for f, ev in zip(self._upload_futs, give_up):
            f.add_done_callback(lambda f, ev=ev: ev.set() if f.exception() is not None else None)
        self._persist_futs = [commit_when_complete(t, body, ranks, self.save_id, on_commit=record,
                                                   give_up=ev)
                              for t, ev in zip(tiers, give_up)]
        for f, t in zip(self._persist_futs, tiers):
            f.add_done_callback(lambda f, u=t.url: self._release_claims(u))
        _when_all(self._upload_futs + self._persist_futs,
                  lambda err: session.mark_persisted(err) if session else None)

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Block until the last save reached every ``persist_to`` tier.

        On the coordinator this means every slow tier committed its copy; on other ranks,
        that this rank's files and marker are uploaded.  Raises if the flush failed after
        its retries; returns ``False`` on timeout."""
        s = self._session
        if s is None or not self.persist_to or not self.persist:
            return True
        return s.wait_persisted(timeout)

    def _encode_value(self, planner, item) -> tuple:
        fqn = item.index.fqn
        obj, found = _lookup_original(planner, item)
        if found:
            enc, data, csum = ObjectProvider(obj).encode(key=fqn, checkpoint=self.path,
                                                         allow_pickle=self.allow_pickle)
            return (enc, data, csum)
        # A planner that hides the original object: only torch.save bytes are available.
        if not self.allow_pickle:
            raise UnsupportedValueError(
                "this planner only exposes the value as torch.save bytes (a pickle); use "
                "DCP's DefaultSavePlanner or ours, or pass allow_pickle=True",
                checkpoint=self.path, key=fqn)
        data = planner.resolve_data(item).getvalue()
        return ("torch", data, xxhash.xxh3_64_intdigest(data))

    def _results(self, results, names, sizes, session, timings=None) -> list[WriteResult]:
        out = []
        written = {n: sz for n, sz in zip(names, sizes) if sz > 0}
        homes = self._base.homes if self._base is not None else {}
        base_files = self._base.manifest.files if self._base is not None else {}
        refs: dict[str, str] = {}

        def wire(ci: CopyItem) -> list:
            segs = []
            for f, off, n in ci.segments():
                if isinstance(f, str):  # a base file: referenced, not written
                    refs[f] = homes[f]
                else:
                    f = names[f]
                segs.append(Seg(f, off, n))
            return Extent(segs, ci.nbytes, ci.sums).to_wire()

        reused = 0
        for idx, (item, kind, payload) in enumerate(results):
            if kind == "v":
                sd = {"k": "v", "v": list(payload)}
                nbytes = len(payload[1])
            elif kind == "t":
                ci = payload
                td = item.tensor_data
                sd = {"k": "t", "dtype": dtype_name(td.properties.dtype), "sizes": list(td.chunk.sizes),
                      "x": wire(ci)}
                nbytes = ci.nbytes
                reused += ci.reused_bytes
            else:
                pname, meta, placed, tree = payload
                parts = {name: [dt, shape, wire(ci)] for name, dt, shape, ci in placed}
                sd = {"k": kind, "p": pname, "m": meta, "parts": parts, "t": tree}
                if kind == "p":
                    td = item.tensor_data
                    sd.update(dtype=dtype_name(td.properties.dtype), sizes=list(td.chunk.sizes))
                nbytes = sum(p[3].nbytes for p in placed)
                reused += sum(p[3].reused_bytes for p in placed)
            out.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=sd))
        if out:
            sd = out[0].storage_data
            sd["files"] = {**written, **{f: base_files[f] for f in refs}}
            sd["homes"] = refs
            sd["rank"] = self.rank
            if timings:
                sd["timings"] = timings
        self.last_timings = dict(timings or {})
        self._refs = {f: (refs[f], base_files[f]) for f in refs}
        self.last_stats = {"bytes_written": sum(written.values()), "bytes_reused": reused,
                           "files_written": len(written), "files_referenced": len(refs)}
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._finish(metadata, results)
        except BaseException as e:
            self._fail(e)
            raise

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        manifest = build_manifest(metadata, results, save_id=self.save_id)
        if self.use_collectives:
            name = MANIFEST_NAME
        else:
            manifest.world_size = dist.get_world_size() if dist.is_initialized() else 1
            manifest.ranks = [self.rank]
            name = rank_manifest_name(self.rank, self.save_id)
        body = encode_manifest(manifest)
        self.tier.commit_bytes(name, body, sync=self.sync_files)
        if self.use_collectives:
            # DCP broadcasts this Metadata to every rank as the save's result: a run-level
            # checkpointer on another node uses it to commit the manifest on its own disk.
            metadata.storage_data = {"dcp_datastates.manifest": body}
        self._start_commits(manifest, body, name)
        if self._session is not None:
            self._session.mark_committed()
            log.debug("%s stage timings: %s", self.path, self._session.timings())
        log.info("committed %s (%d tensors, %d values, %.1f MiB)", self.path, len(manifest.tensors),
                 len(manifest.values), sum(manifest.files.values()) / 2**20)
        self._tidy_after_commit(self.tier, manifest)

    def _fail(self, e: BaseException) -> None:
        if self._session is not None:
            self._session.mark_failed(e)
        self._tidies.clear()
        self._release_claims()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never auto-selected by DCP; users pass the writer explicitly

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_job"] = None
        d["_persist_futs"] = []
        d["_claims"] = {}
        d["_tidies"] = {}
        d.pop("_upload_futs", None)
        d.pop("tier", None)
        return d


def build_manifest(metadata: Metadata, results: list[list[WriteResult]], *, save_id: str) -> Manifest:
    files: dict[str, int] = {}
    homes: dict[str, str] = {}
    tensors: dict[str, TensorEntry] = {}
    values: dict[str, ValueEntry] = {}
    ranks = []
    for rank_results in results:
        for wr in rank_results:
            sd = wr.storage_data
            if "files" in sd:
                files.update(sd["files"])
                homes.update(sd.get("homes") or {})
                ranks.append(sd.get("rank", 0))
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = TensorEntry(dtype_name(md.properties.dtype), tuple(md.size), [])
    seen: set[tuple] = set()
    for rank_results in results:
        for wr in rank_results:
            sd = wr.storage_data
            fqn = wr.index.fqn
            if sd["k"] == "v":
                enc, data, csum = sd["v"]
                values[fqn] = ValueEntry(enc, data, csum)
                continue
            if sd["k"] == "pv":
                parts = {k: (dt, tuple(shape), Extent.from_wire(x)) for k, (dt, shape, x) in sd["parts"].items()}
                values[fqn] = ValueEntry("provider", b"", 0, Chunk((), (), None, sd["p"], sd["m"], parts,
                                                                   sd["t"]))
                continue
            offsets = tuple(wr.index.offset) if wr.index.offset is not None else ()
            if (fqn, offsets) in seen:
                continue
            seen.add((fqn, offsets))
            entry = tensors[fqn]
            if sd["k"] == "t":
                entry.chunks.append(Chunk(offsets, tuple(sd["sizes"]), Extent.from_wire(sd["x"])))
            else:
                parts = {k: (dt, tuple(shape), Extent.from_wire(x))
                         for k, (dt, shape, x) in sd["parts"].items()}
                entry.chunks.append(Chunk(offsets, tuple(sd["sizes"]), None, sd["p"], sd["m"], parts,
                                          sd.get("t")))
    planner_data = {}
    if isinstance(metadata.planner_data, dict):
        for k, v in metadata.planner_data.items():
            if isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v):
                planner_data[k] = list(v)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return Manifest(save_id=save_id, world_size=max(world, len(results)),
                    ranks=sorted(set(ranks)) or list(range(len(results))), files=files,
                    homes=homes, tensors=tensors, values=values, planner_data=planner_data,
                    block_size=BLOCK_SIZE, created_unix=time.time(), torch_version=torch.__version__,
                    writer=f"dcp-datastates {__version__}")


def _record_persisted(tier: StorageTier, url: str) -> None:
    """Note in the fast tier's copy which slower tiers committed theirs (for `inspect`)."""
    try:
        have = msgpack.unpackb(tier.read_bytes(PERSISTED_RECORD)) if tier.exists(PERSISTED_RECORD) else []
    except Exception:  # noqa: BLE001 - a damaged record is rebuilt
        have = []
    if url not in have:
        have.append(url)
    tier.commit_bytes(PERSISTED_RECORD, msgpack.packb(have))


def _agree_save_id(mine: str) -> str:
    """Per-rank manifests (``use_collectives=False``) still name one save: rank 0's id, sent
    to the others with one broadcast on the default process group (DCP itself ends such a
    save with a barrier on it).  A single process keeps its own."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _when_all(futs, callback) -> None:
    """Call ``callback(first_error_or_None)`` once every future is done."""
    if not futs:
        callback(None)
        return
    lock = threading.Lock()
    left = [len(futs)]
    errors: list = []

    def done(f):
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


def _chain(fut, then):
    """A future that runs ``then()`` after ``fut`` succeeds."""
    out: CFuture = CFuture()

    def done(f):
        e = f.exception()
        if e is not None:
            out.set_exception(e)
            return
        try:
            out.set_result(then())
        except BaseException as err:  # noqa: BLE001
            out.set_exception(err)
    fut.add_done_callback(done)
    return out


def _lookup_original(planner, item):
    """The unserialized object behind a BYTE_IO item, when the planner exposes it."""
    sd = getattr(planner, "state_dict", None)
    if isinstance(sd, dict):
        try:
            return find_state_dict_object(sd, item.index), True
        except (ValueError, KeyError):
            pass
    return None, False


def _any_gpu(items: list[CopyItem]) -> bool:
    return any(i.source.device.type == "cuda" for i in items)


def _want_pinned(items: list[CopyItem]) -> bool:
    if not _any_gpu(items):
        return False
    return cuda_ext.available()


def _ready_events(items: list[CopyItem]):
    """Record, on the caller's current stream, the point the copies must follow (GPU only)."""
    return _ready_events_for([i.source for i in items])


def _ready_events_for(tensors: list[torch.Tensor]):
    dev = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if dev is None:
        return None
    if not cuda_ext.available():
        return None
    return cuda_ext.record_ready(dev.index or 0)
