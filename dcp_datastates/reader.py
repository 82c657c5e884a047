"""``DataStatesReader``: a DCP ``StorageReader`` for the dcp-datastates format.

* ``read_metadata`` reads the msgpack manifest (or merges the per-rank
  manifests of a ``use_collectives=False`` save) and rebuilds DCP's
  ``Metadata`` from it.  Nothing read from storage is ever unpickled unless
  the reader was built with ``allow_pickle=True``.
* ``read_data`` reads only the byte ranges each ``ReadItem`` needs, widened
  to checksum-block boundaries, in parallel, straight into the destination
  tensor when its layout allows it, and verifies every block it read.
* Before any byte is read, it checks that the plan fills every destination
  tensor completely; DCP itself leaves uncovered regions silently unchanged.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import math
import os
import pickle
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.futures import Future

from .engine import upload
from .engine.upload import DeviceUpload, pinned_slab
from .errors import (
    ChecksumMismatch,
    CoverageError,
    DataFileError,
    ManifestError,
    NotACheckpointError,
    PickleNotAllowedError,
    ProviderError,
)
from .format import MANIFEST_NAME, Manifest, dtype_from_name, verify_blocks
from .format.manifest import Chunk, Extent, paused_gc
from .format.model import ChunkMetadataView
from .format.values import decode_value
from .planner import deliver_object
from .providers import rebuild
from .tiers import StorageTier, read_path
from .tiers.direct_io import DIRECT_MIN, STAGE_BYTES, StagingBuffer, dio_alignment, read_range
from .tiers.manifests import (
    load_manifest,  # noqa: F401 (re-exported: tests and tools use it)
)
from .tiers.storage import open_regular

log = logging.getLogger(__name__)

READ_PIECE = 16 << 20


def manifest_to_metadata(m: Manifest, checkpoint_id: str) -> Metadata:
    """DCP's ``Metadata`` of manifest ``m``: each tensor's chunks in the manifest's order (a
    ``ReadItem``'s ``storage_index.index`` is then the chunk's place in ``m``).  No
    ``storage_data``: this reader finds chunks in the manifest, not through DCP."""
    sdm: dict = {}
    csm, size = ChunkStorageMetadata, torch.Size
    props: dict[str, TensorProperties] = {}
    for fqn, t in m.tensors.items():
        p = props.get(t.dtype)
        if p is None:
            p = props[t.dtype] = TensorProperties(dtype=dtype_from_name(t.dtype))
        # a version 3 tensor's chunks are listed for DCP only when its planner walks them
        chunks = ChunkMetadataView(t) if t.lazy else [csm(size(c.offsets), size(c.sizes)) for c in t.chunks]
        sdm[fqn] = TensorStorageMetadata(properties=p, size=size(t.size), chunks=chunks)
    for fqn in m.values:
        sdm[fqn] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=sdm,
                    planner_data={k: tuple(v) for k, v in m.planner_data.items()},
                    storage_data={},
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=m.save_id))


class DataStatesReader(StorageReader):
    """Load checkpoints written by :class:`DataStatesWriter`.

    Args:
        path: checkpoint directory (local path or fsspec URL); may be omitted
            when ``checkpoint_id`` is passed to ``dcp.load``.
        thread_count: parallel ranged reads.
        allow_pickle: allow values that were saved with ``allow_pickle=True``.
            Off by default: loading such a checkpoint raises ``PickleNotAllowedError``.
        verify: check block checksums of every byte read (on by default).
        storage_options: passed to fsspec for URLs.
        fallback: slower copies of the same checkpoint (persistent tiers), in order.  The
            manifest comes from the first tier holding a valid committed one; each byte range
            is read from the first tier whose file is present and passes its checksums, so a
            missing, partial or corrupt fast copy falls back per file, per rank.
        fallback_options: fsspec storage options for the ``fallback`` URLs.
        o_direct: read cold ranges of local files with O_DIRECT into a per-thread staging
            buffer of huge pages, then copy them into place (``tiers/direct_io.py`` says why
            this beats both buffered reads and O_DIRECT into the destination).  Ranges mostly
            in the page cache already, ranges under 256 KiB and file systems that refuse
            O_DIRECT are read buffered.  ``"auto"`` (the default): the first load of 512 MiB or
            more from a file system measures both paths on it and keeps the faster for the
            process (``tiers/read_path.py``); ``True``: always O_DIRECT; ``False``: buffered.
        save_id: load only this save: a tier whose manifest is another save of the path (a
            node-local copy an earlier attempt left) is not read.  Whatever it is, ranks that
            read manifests of different saves fail the load before reading any byte.
    """

    def __init__(self, path: str | None = None, *, thread_count: int = 8, allow_pickle: bool = False,
                 verify: bool = True, storage_options: dict | None = None,
                 fallback: list[str] | str | None = None, fallback_options: dict | None = None,
                 o_direct: bool | str = "auto", save_id: str | None = None) -> None:
        super().__init__()
        self.save_id = save_id
        self._skip: set[str] = set()  # tiers holding another save (``save_id``)
        if o_direct not in (True, False, "auto"):
            raise ValueError(f"o_direct must be True, False or 'auto', got {o_direct!r}")
        self.o_direct = o_direct
        self.path = None if path is None else str(path)
        if isinstance(fallback, str):
            fallback = [fallback]
        self.fallback = [str(f) for f in (fallback or [])]
        self.fallback_options = fallback_options
        self.served: dict[str, int] = {}  # bytes read per tier URL (this rank)
        self.manifest_tier: str | None = None
        self.thread_count = max(1, thread_count)
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.storage_options = storage_options
        self.manifest: Manifest | None = None
        self.bytes_read = 0
        self.bytes_needed = 0
        self.bytes_direct = 0  # of bytes_read, read through O_DIRECT (tiers/direct_io.py)
        self._lock = threading.Lock()
        self._chunk_index = None  # (manifest, {(fqn, offsets): chunk})
        self._cast_warned: set[str] = set()

    # --------------------------------------------------------- StorageReader
    def reset(self, checkpoint_id=None) -> None:
        """DCP: start a load; ``checkpoint_id`` (when given) replaces the path."""
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)
        self.manifest = None

    def _tier(self) -> StorageTier:
        if self.path is None:
            raise NotACheckpointError("DataStatesReader has no path: pass one to the constructor "
                                      "or give dcp.load a checkpoint_id")
        return StorageTier(self.path, self.storage_options)

    def _tiers(self, every: bool = False) -> list[StorageTier]:
        tiers = [self._tier()] + [StorageTier(u, self.fallback_options) for u in self.fallback]
        return tiers if every else [t for t in tiers if t.url not in self._skip]

    def _load_manifest(self) -> Manifest:
        errors = []
        for tier in self._tiers(every=True):
            try:
                m = load_manifest(tier, [x for x in self._tiers() if x.url != tier.url])
                if self.save_id is not None and m.save_id != self.save_id:
                    self._skip.add(tier.url)
                    raise ManifestError(f"holds save {m.save_id} of this step, not save {self.save_id} "
                                        "(a copy left by another attempt?)", checkpoint=tier.url)
            except (NotACheckpointError, ManifestError, OSError) as e:
                errors.append(e)
                if self.fallback:
                    log.warning("no usable manifest on %s (%s); trying the next tier", tier.url, e)
                continue
            self.manifest_tier = tier.url
            if errors:
                log.warning("manifest served by %s", tier.url)
            return m
        raise errors[0]

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """DCP: the committed manifest (fastest tier holding a valid one) as DCP's ``Metadata``."""
        self.manifest = self._load_manifest()
        with paused_gc():
            return manifest_to_metadata(self.manifest, self.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        """DCP: make sure the manifest is loaded (another reader may have read the metadata)."""
        if self.manifest is None:
            self.manifest = self._load_manifest()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """DCP: the plan, telling the coordinator which save this rank's manifest is."""
        if plan.storage_data is not None or self.manifest is None:
            return plan
        return dataclasses.replace(plan, storage_data=ManifestServed(self.manifest.save_id, self.manifest_tier))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """DCP: the plans unchanged, once every rank is shown to load the same save."""
        _one_save(plans, self.path)
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        """DCP: never chosen automatically; pass the reader explicitly."""
        return False

    # ------------------------------------------------------------- read_data
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP: read every item of ``plan`` (coverage checked first, every block verified,
        slower tiers used for what the first cannot serve) and hand it to ``planner``."""
        with paused_gc():  # a few records and buffers per item, none cyclic (format/model.py)
            self._read_plan(plan, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        # runs inside read_data's pause of the collector (a few records and buffers per item)
        tiers = self._tiers()
        m = self.manifest or self._load_manifest()
        self.manifest = m
        tensor_items = [ri for ri in plan.items if ri.type != LoadItemType.BYTE_IO]
        self._check_coverage(tensor_items, planner, m)
        tasks = self._tasks(plan, planner, m, tensor_items)
        gpu = [t for t in tasks if t.dest is not None and t.dest.device.type == "cuda"]
        up = DeviceUpload({t.dest.device for t in gpu}) if gpu and upload.usable() else None
        for t in gpu:
            t.up = up
            t.streamed = up is not None and t._whole_gpu
        files = _FileSet(tiers, m.homes)
        try:
            total = sum(t.buf_size for t in tasks)
            if self.o_direct == "auto" and total >= read_path.PROBE_MIN_LOAD:
                _probe_read_path(files, tasks, self.thread_count)
            pieces = [(t, i) for t in tasks for i in range(len(t.ranges))]
            # Small pieces that lie close together in a file are read as one range, then
            # verified and copied out piece by piece: one request per run of the file rather
            # than one per tensor (which, for an object store, is one GET per tensor).
            runs, pieces = _coalesce(pieces)
            # one pool task per batch of small pieces: a future and a lock per 64-byte tensor
            # cost more than its read
            # threads pay off for large reads; for small ones they only contend for the GIL
            threads = max(1, min(self.thread_count, total // (4 << 20)))
            with ThreadPoolExecutor(threads, thread_name_prefix="dcpds-read") as pool:
                for _ in pool.map(lambda r: _read_run(self, files, r), runs):
                    pass
                for _ in pool.map(lambda b: [self._run_piece(files, *ti) for ti in b],
                                  _batches(pieces, lambda ti: ti[0].ranges[ti[1]][2])):
                    pass
                for _ in pool.map(lambda b: [t.finalize() for t in b],
                                  _batches(tasks, lambda t: t.buf_size)):
                    pass
            if up is not None:
                up.finish()  # every upload landed before the planner sees the tensors
        finally:
            files.close()
        self._deliver_all(tasks, planner)
        if len(tiers) > 1 and self.served:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            log.info("rank %d restored %s", rank, ", ".join(
                f"{n / 2**20:.1f} MiB from {u}" for u, n in self.served.items()))

    def _deliver_all(self, tasks: list["_ReadTask"], planner) -> None:
        """Hand every finished task's tensor (or rebuilt object) to the planner."""
        sd = getattr(planner, "state_dict", None)
        for t in tasks:
            if t.rebuilt is not None and not (isinstance(sd, dict) and _is_dtensor(sd.get(t.ri.dest_index.fqn))):
                # what the provider rebuilt replaces the placeholder (a DTensor entry keeps its
                # place in the mesh and only receives the bytes)
                _deliver(t.ri, planner, t.rebuilt, tensor=t.dest is not None)
            if t.dest is not None:
                planner.commit_tensor(t.ri, t.dest)

    def _tasks(self, plan: LoadPlan, planner, m: Manifest, tensor_items) -> list["_ReadTask"]:
        """One read task per item (values are delivered here, from the manifest)."""
        tasks = []
        for ri in plan.items:
            if ri.type != LoadItemType.BYTE_IO:
                continue
            v = m.values.get(ri.storage_index.fqn)
            if v is not None and v.node is not None:  # a registered type: read its parts
                tasks.append(_ReadTask(self, ri, None, "uint8", v.node, m.block_size))
            else:
                self._load_value(ri, planner, m)
        return tasks + [self._make_task(ri, planner, m) for ri in tensor_items]

    def _check_coverage(self, items, planner, m: Manifest) -> None:
        sd = getattr(planner, "state_dict", None)
        if not isinstance(sd, dict):
            return
        covered: dict[str, int] = defaultdict(int)
        for ri in items:
            covered[ri.dest_index.fqn] += math.prod(ri.lengths)
        for fqn, obj in sd.items():
            if fqn not in m.tensors or not isinstance(obj, torch.Tensor):
                continue
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            if covered[fqn] < local.numel():
                raise CoverageError(
                    f"the checkpoint covers only {covered[fqn]} of the {local.numel()} elements this "
                    "rank must load; the save did not record every chunk (was it saved with "
                    "use_collectives=False and a rank manifest lost?)", checkpoint=self.path, key=fqn)

    def _load_value(self, ri, planner, m: Manifest) -> None:
        fqn = ri.storage_index.fqn
        v = m.values.get(fqn)
        if v is None:
            raise ManifestError("value listed in metadata is missing from the manifest",
                                checkpoint=self.path, key=fqn)
        if xxhash.xxh3_64_intdigest(v.data) != v.checksum:
            v = self._value_from_fallback(fqn)
            if v is None:
                raise ChecksumMismatch("value bytes do not match their checksum", checkpoint=self.path,
                                       file=MANIFEST_NAME, key=fqn)
        if v.encoding == "msgpack":
            try:
                value = decode_value(v.data)
            except ValueError as e:
                raise ManifestError(f"value does not decode: {e}", checkpoint=self.path, key=fqn) from None
        elif not self.allow_pickle:
            raise PickleNotAllowedError(
                f"value was saved with pickle ({v.encoding}); loading it would run code from the "
                "checkpoint. Pass allow_pickle=True to DataStatesReader only if you trust it",
                checkpoint=self.path, key=fqn)
        elif v.encoding == "pickle":
            value = pickle.loads(v.data)  # explicit opt-in only (allow_pickle=True), checked above
        else:
            value = torch.load(io.BytesIO(v.data), weights_only=False)  # same opt-in
        _deliver(ri, planner, value)

    def _value_from_fallback(self, fqn: str):
        for tier in self._tiers()[1:]:
            try:
                other = load_manifest(tier).values.get(fqn)
            except (NotACheckpointError, ManifestError, OSError):
                continue
            if other is not None and xxhash.xxh3_64_intdigest(other.data) == other.checksum:
                log.warning("value %s is damaged in %s; using the copy in %s", fqn, self.path, tier.url)
                return other
        return None

    def _make_task(self, ri, planner, m: Manifest) -> "_ReadTask | _SmallTask":
        fqn = ri.storage_index.fqn
        key = tuple(ri.storage_index.offset) if ri.storage_index.offset is not None else ()
        entry = m.tensors.get(fqn)
        chunk = None if entry is None else entry.record_at(ri.storage_index.index, key)
        if chunk is None and entry is not None and not entry.lazy:  # another planner: look it up
            if self._chunk_index is None or self._chunk_index[0] is not m:  # one index per manifest
                self._chunk_index = (m, {(f, c.offsets): c for f, t in m.tensors.items() for c in t.chunks})
            chunk = self._chunk_index[1].get((fqn, key))
        if chunk is None:
            raise ManifestError(f"no stored chunk at offsets {list(key)}", checkpoint=self.path, key=fqn)
        dest = planner.resolve_tensor(ri).detach()
        if dest.dtype != dtype_from_name(entry.dtype) and fqn not in self._cast_warned:
            self._cast_warned.add(fqn)
            log.warning("%s: tensor %s was saved as %s and is loaded into a %s tensor: its values are "
                        "cast", self.path, fqn, entry.dtype, str(dest.dtype).replace("torch.", ""))
        if _small_whole(ri, dest, entry.dtype, chunk):
            self.bytes_needed += chunk.extent.nbytes
            return _SmallTask(ri, dest, chunk.extent, m.block_size)
        return _ReadTask(self, ri, dest, entry.dtype, chunk, m.block_size)

    def _run_piece(self, files: "_FileSet", task: "_ReadTask", i: int) -> None:
        name, file_off, n, buf_off, first_block, ext = task.ranges[i]
        if task.streamed:  # to the GPU: read into a pinned slab, upload it into place
            with pinned_slab() as slab:
                self._read_any_tier(files, task, name, file_off, n, memoryview(slab[:n].numpy()),
                                    slab.data_ptr(), first_block, ext)
                task.up.piece(task.dest_bytes()[buf_off:buf_off + n], slab)
            return
        buf, addr = task.buffer()
        self._read_any_tier(files, task, name, file_off, n, memoryview(buf)[buf_off:buf_off + n],
                            addr + buf_off, first_block, ext)

    def _read_any_tier(self, files: "_FileSet", task: "_ReadTask", name, file_off, n, mv, addr,
                       first_block, ext) -> None:
        """Fill ``mv`` from the fastest tier whose copy of the range verifies."""
        first_error = None
        for ti, tier in enumerate(files.tiers):
            try:
                self._read_verified(files, ti, tier, name, file_off, n, mv, addr, first_block, ext, task)
            except (DataFileError, ChecksumMismatch, OSError) as e:
                if first_error is None:
                    first_error = e
                if ti + 1 < len(files.tiers) and files.first_fallback(ti, name):
                    log.warning("%s; reading this file from %s instead", e, files.tiers[ti + 1].url)
                continue
            with self._lock:
                self.bytes_read += n
                self.served[tier.url] = self.served.get(tier.url, 0) + n
            return
        raise first_error

    def _read_verified(self, files, ti, tier, name, file_off, n, mv, addr, first_block, ext,
                       task) -> None:
        key = task.ri.storage_index.fqn
        try:
            fd = files.fd(ti, name)
            if fd is not None:
                dfd, align = (None, None)
                if self.o_direct and n >= DIRECT_MIN and files.wants_direct(fd):
                    dfd, align = files.direct_fd(ti, name)
                stage = files.stage() if dfd is not None else None
                got, direct = read_range(fd, file_off, mv, addr, direct_fd=dfd, align=align, stage=stage)
                if direct:
                    with self._lock:
                        self.bytes_direct += direct
            else:
                got = files.tier_for(ti, name).read_into(name, file_off, mv)
        except FileNotFoundError:
            home = files.homes.get(name)
            where = f" (kept in the earlier checkpoint {home!r} this one is incremental on)" if home else ""
            raise DataFileError(f"data file is missing{where}; the checkpoint is incomplete or was "
                                "damaged, load another tier or step", checkpoint=tier.url, file=name,
                                key=key) from None
        if got != n:
            raise DataFileError(f"data file is truncated: wanted {n} bytes at offset {file_off}, "
                                f"got {got}", checkpoint=tier.url, file=name, key=key)
        if self.verify:
            bad = verify_blocks(mv, ext.sums, first_block, task.block_size)
            if bad is not None:
                raise ChecksumMismatch(f"checksum mismatch in block {bad} (chunk bytes "
                                       f"{bad * task.block_size}+, file offset {file_off + (bad - first_block) * task.block_size}+)",
                                       checkpoint=tier.url, file=name, key=key)


def _deliver(ri, planner, value, *, tensor: bool = False) -> None:
    if deliver_object(planner, ri, value) or tensor:
        return
    # Hand another planner the bytes it expects.  They are made here from the value already
    # decoded, so its torch.load never meets bytes read from storage.
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    planner.load_bytes(ri, buf)


@dataclasses.dataclass(frozen=True)
class ManifestServed:
    """A rank's load plan's storage data: the save its manifest is, and the tier it came from."""
    save_id: str
    tier: str | None


def _one_save(plans: list[LoadPlan], path: str | None) -> None:
    """Raise unless every rank's manifest is the same save: ranks restoring different saves of
    one step (a node-local copy an earlier attempt left) would mix two states."""
    saves: dict[str, list[tuple[int, str | None]]] = {}
    for rank, p in enumerate(plans):
        if isinstance(p.storage_data, ManifestServed):
            saves.setdefault(p.storage_data.save_id, []).append((rank, p.storage_data.tier))
    if len(saves) > 1:
        seen = "; ".join(f"save {sid}: ranks {', '.join(str(r) for r, _ in who[:4])}"
                         f"{'...' if len(who) > 4 else ''} (from {who[0][1]})" for sid, who in saves.items())
        raise ManifestError(f"ranks would restore different saves of this checkpoint ({seen}); a copy "
                            "on some tier is from another attempt: load with Checkpointer, or pass "
                            "DataStatesReader(save_id=...)", checkpoint=path)


def _batches(items: list, nbytes, target: int = 8 << 20, per_item: int = 64 << 10) -> list[list]:
    """``items`` in order, in batches of about ``target`` bytes, counting each item at least
    ``per_item`` (so a batch holds at most ``target / per_item`` small ones)."""
    out, batch, size = [], [], 0
    for x in items:
        batch.append(x)
        size += max(nbytes(x), per_item)
        if size >= target:
            out.append(batch)
            batch, size = [], 0
    if batch:
        out.append(batch)
    return out


# A piece of at most COALESCE_PIECE bytes joins the run of its file when the gap from the
# run's end is at most COALESCE_GAP; a run stops growing at COALESCE_RUN bytes.
COALESCE_PIECE = 64 << 10
COALESCE_GAP = 16 << 10
COALESCE_RUN = 4 << 20


def _coalesce(pieces: list) -> tuple[list[list], list]:
    """Split ``pieces`` ((task, range index) pairs) into runs of small pieces that lie close
    together in one file (each run sorted by file offset, at least two pieces), and the
    pieces left to read one by one."""
    small: dict[str, list] = defaultdict(list)
    rest = []
    for ti in pieces:
        t, i = ti
        if t.ranges[i][2] <= COALESCE_PIECE and not t.streamed:
            small[t.ranges[i][0]].append(ti)
        else:
            rest.append(ti)
    runs = []

    def close(run: list) -> None:
        if len(run) > 1:
            runs.append(run)
        else:
            rest.extend(run)

    for group in small.values():
        group.sort(key=lambda ti: ti[0].ranges[ti[1]][1])
        run, start, end = [], 0, 0
        for ti in group:
            _name, off, n = ti[0].ranges[ti[1]][:3]
            if run and (off - end > COALESCE_GAP or off + n - start > COALESCE_RUN or off < end):
                close(run)
                run = []
            if not run:
                start = off
            run.append(ti)
            end = off + n
        close(run)
    return runs, rest


def _read_run(reader: DataStatesReader, files: "_FileSet", run: list) -> None:
    """Read a run of small pieces of one file from the first tier with one request, then
    verify and copy each piece out.  A piece the request did not bring back whole, or whose
    blocks do not verify, is read again alone (``_run_piece``: the slower tiers, and the
    error that names the file and tensor)."""
    first, last = run[0][0].ranges[run[0][1]], run[-1][0].ranges[run[-1][1]]
    name, start = first[0], first[1]
    buf = bytearray(last[1] + last[2] - start)
    tier = files.tier_for(0, name)
    try:
        got = tier.read_into(name, start, buf, fd=files.fd(0, name))
    except OSError:
        got = 0  # missing or unreadable here: each piece reports or falls back on its own
    mv = memoryview(buf)
    served = 0
    for t, i in run:
        _name, off, n, buf_off, first_block, ext = t.ranges[i]
        lo = off - start
        piece = mv[lo:lo + n]
        if lo + n > got or (reader.verify and verify_blocks(piece, ext.sums, first_block, t.block_size)
                            is not None):
            reader._run_piece(files, t, i)
            continue
        dst, _addr = t.buffer()
        dst[buf_off:buf_off + n] = piece
        served += n
    with reader._lock:
        reader.bytes_read += served
        reader.served[files.tiers[0].url] = reader.served.get(files.tiers[0].url, 0) + served


def _probe_read_path(files: "_FileSet", tasks: list, threads: int) -> None:
    """Before a large load, measure O_DIRECT against buffered reads on the file system of its
    largest local data file (once per file system and process: ``tiers/read_path.py``)."""
    sizes: dict[str, int] = {}
    for t in tasks:
        for name, _off, n, *_rest in t.ranges:
            sizes[name] = sizes.get(name, 0) + n
    if not sizes:
        return
    name = max(sizes, key=sizes.get)
    try:
        fd = files.fd(0, name)
    except OSError:
        return  # the load itself reports it (or reads another tier)
    if fd is None or read_path.known(fd) is not None:
        return
    dfd, align = files.direct_fd(0, name)
    if dfd is not None:
        read_path.choose(fd, dfd, align, threads)


def _is_dtensor(obj) -> bool:
    return isinstance(obj, DTensor)


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class _FileSet:
    """Open file descriptors per (tier, file), opened on first use; missing files remembered."""

    def __init__(self, tiers: list[StorageTier], homes: dict[str, str]) -> None:
        self.tiers = tiers
        self.homes = homes
        self._fds: dict[tuple[int, str], int | None] = {}
        self._siblings: dict[tuple[int, str], StorageTier] = {}
        # O_DIRECT descriptor and its alignment per (tier, file); (None, None) where refused
        self._direct: dict[tuple[int, str], tuple] = {}
        self._local = threading.local()
        self._warned: set[tuple[int, str]] = set()
        self._stages: list = []
        self._lock = threading.Lock()

    def first_fallback(self, ti: int, name: str) -> bool:
        """True the first time ``name`` falls back from tier ``ti`` (one warning per file and
        tier, however many ranges of it are read)."""
        with self._lock:
            if (ti, name) in self._warned:
                return False
            self._warned.add((ti, name))
            return True

    def tier_for(self, ti: int, name: str) -> StorageTier:
        """The directory of tier ``ti`` that holds ``name``: the checkpoint's own, or the
        earlier checkpoint of the run that an incremental save took the file from."""
        home = self.homes.get(name)
        if home is None:
            return self.tiers[ti]
        with self._lock:
            t = self._siblings.get((ti, home))
            if t is None:
                t = self._siblings[(ti, home)] = self.tiers[ti].sibling(home)
            return t

    def fd(self, ti: int, name: str) -> int | None:
        tier = self.tier_for(ti, name)
        if not tier.local:
            return None
        key = (ti, name)
        with self._lock:
            if key not in self._fds:
                try:
                    self._fds[key] = open_regular(tier.path(name), checkpoint=tier.url)
                except FileNotFoundError:
                    self._fds[key] = None
            fd = self._fds[key]
        if fd is None:
            raise FileNotFoundError(name)
        return fd

    def direct_fd(self, ti: int, name: str) -> tuple[int | None, tuple[int, int] | None]:
        """An O_DIRECT descriptor and its alignment needs; (None, None) where the file system
        refuses O_DIRECT on the file."""
        tier = self.tier_for(ti, name)
        if not tier.local or not hasattr(os, "O_DIRECT"):
            return None, None
        key = (ti, name)
        with self._lock:
            if key not in self._direct:
                self._direct[key] = (None, None)
                try:
                    fd = os.open(tier.path(name), os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW)
                except OSError:  # refused (or missing: the buffered descriptor reports that)
                    return self._direct[key]
                buffered = self._fds.get(key)
                same = buffered is not None and _same_file(fd, buffered)
                align = dio_alignment(fd) if same else None
                if align is None:  # refused, or not the file the checked descriptor holds
                    os.close(fd)
                else:
                    self._direct[key] = (fd, align)
            return self._direct[key]

    def wants_direct(self, fd: int) -> bool:
        """O_DIRECT, unless the probe found buffered reads faster on ``fd``'s file system."""
        choice = read_path.known(fd)
        return choice is None or choice.direct

    def stage(self) -> StagingBuffer:
        """This thread's staging buffer for O_DIRECT reads (made on first use)."""
        st = getattr(self._local, "stage", None)
        if st is None:
            st = self._local.stage = StagingBuffer(STAGE_BYTES)
            with self._lock:
                self._stages.append(st)
        return st

    def close(self) -> None:
        for st in self._stages:
            st.close()
        self._stages.clear()
        for fd in [*self._fds.values(), *(d for d, _a in self._direct.values())]:
            if fd is not None:
                os.close(fd)


def _small_whole(ri, dest: torch.Tensor, dtype: str, chunk: Chunk) -> bool:
    """Whether ``ri`` reads small ``chunk`` whole, from one segment, straight into ``dest``: a
    contiguous CPU tensor of its dtype (most of a state's many small tensors, which then take
    a ``_SmallTask``)."""
    ext = chunk.extent
    return ext is not None and len(ext.segs) == 1 and 0 < ext.nbytes <= COALESCE_PIECE \
        and not any(ri.storage_offsets) and tuple(ri.lengths) == tuple(chunk.sizes) \
        and dest.device.type == "cpu" and dest.dtype == dtype_from_name(dtype) and dest.is_contiguous() \
        and dest.numel() * dest.element_size() == ext.nbytes


class _SmallTask:
    """A ``_ReadTask`` for the case ``_small_whole`` accepts: one range, read into the tensor."""

    __slots__ = ("ri", "dest", "block_size", "ranges", "buf_size", "_buf")
    streamed = False
    up = None
    rebuilt = None

    def __init__(self, ri, dest: torch.Tensor, ext: Extent, block_size: int) -> None:
        seg = ext.segs[0]
        self.ri, self.dest, self.block_size, self.buf_size = ri, dest, block_size, ext.nbytes
        self.ranges = [(seg.file, seg.offset, ext.nbytes, 0, 0, ext)]
        self._buf = None

    def buffer(self) -> tuple:
        if self._buf is None:  # one range: one thread asks
            flat = self.dest.reshape(-1).view(torch.uint8)
            self._buf = (flat.numpy(), flat.data_ptr())
        return self._buf

    def finalize(self) -> None:
        """Nothing: the bytes were read in place."""


class _ReadTask:
    """One ReadItem: which byte ranges to fetch, into what, and how to finish."""

    def __init__(self, reader: DataStatesReader, ri, dest: torch.Tensor, dtype_name: str,
                 chunk: Chunk, block_size: int) -> None:
        self.reader, self.ri, self.dest, self.block_size = reader, ri, dest, block_size
        self.dtype = dtype_from_name(dtype_name)
        self.chunk = chunk
        self.rebuilt = None  # the object a registered provider rebuilt, when it replaces dest
        self.ranges: list[tuple] = []
        self._buf = None
        self._direct = False
        self.streamed = False  # whole chunk into a GPU tensor: piece by piece through pinned slabs
        self._whole_gpu = False
        self.up = None  # the load's DeviceUpload, for a GPU destination
        self._buf_lock = threading.Lock()
        if chunk.extent is None:  # provider chunk: read every part whole, rebuild, then narrow
            self.parts_layout = {}
            pos = 0
            for pname, (pdt, pshape, ext) in chunk.parts.items():
                self.parts_layout[pname] = (pdt, pshape, pos, ext.nbytes)
                self._add_ranges(ext, 0, ext.nbytes, pos)
                pos += ext.nbytes
            self.buf_size = pos
            reader.bytes_needed += pos
            return
        ext = chunk.extent
        item = self.dtype.itemsize
        sizes = chunk.sizes
        offs, lens = tuple(ri.storage_offsets), tuple(ri.lengths)
        n_needed = math.prod(lens) * item
        reader.bytes_needed += n_needed
        if n_needed == 0:
            self.buf_size = 0
            return
        whole = n_needed == ext.nbytes and dest.dtype == self.dtype and dest.is_contiguous() \
            and dest.numel() * item == ext.nbytes
        self._direct = whole and dest.device.type == "cpu"  # read straight into the destination
        self._whole_gpu = whole and dest.device.type == "cuda"
        if n_needed == ext.nbytes:  # the whole chunk (a box of its size can only start at 0)
            self.base, self.buf_size = 0, ext.nbytes
            self._add_ranges(ext, 0, ext.nbytes, 0)
            return
        strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
        first = sum(o * s for o, s in zip(offs, strides)) * item
        last = (sum((o + n - 1) * s for o, n, s in zip(offs, lens, strides)) + 1) * item
        r0 = first // block_size * block_size
        r1 = min(-(-last // block_size) * block_size, ext.nbytes)
        self.base = r0  # chunk byte offset of buffer position 0
        self.buf_size = r1 - r0
        # Runs: the box as contiguous pieces; read only the blocks they touch.
        runs = _runs(offs, lens, sizes, item)
        if len(runs) > 1 and self.buf_size > 1.25 * n_needed:
            spans = []
            for a, b in runs:
                a0 = a // block_size * block_size
                b1 = min(-(-b // block_size) * block_size, ext.nbytes)
                if spans and a0 <= spans[-1][1]:
                    spans[-1][1] = max(spans[-1][1], b1)
                else:
                    spans.append([a0, b1])
            for a0, b1 in spans:
                self._add_ranges(ext, a0, b1 - a0, a0 - r0)
        else:
            self._add_ranges(ext, r0, r1 - r0, 0)

    def _add_ranges(self, ext: Extent, start: int, n: int, buf_off: int) -> None:
        """Queue chunk bytes ``[start, start + n)`` (block-aligned start) for reading into the
        buffer at ``buf_off``: per segment, in pieces of at most ``READ_PIECE``."""
        bs = self.block_size
        step = max(bs, READ_PIECE // bs * bs)
        for name, file_off, pos, length in ext.locate(start, n):
            for s in range(0, length, step):
                k = min(step, length - s)
                self.ranges.append((name, file_off + s, k, buf_off + pos + s,
                                    (start + pos + s) // bs, ext))

    def buffer(self) -> tuple:
        """The bytes to read into (a numpy view) and their memory address."""
        with self._buf_lock:
            if self._buf is None:
                if self._direct:
                    flat = self.dest.reshape(-1).view(torch.uint8)
                else:
                    flat = self._tensor = torch.empty(self.buf_size, dtype=torch.uint8)
                self._buf = flat.numpy()
                self._addr = flat.data_ptr()
            return self._buf, self._addr

    def dest_bytes(self) -> torch.Tensor:
        return self.dest.reshape(-1).view(torch.uint8)

    def finalize(self) -> None:
        if self.chunk.extent is None:
            self._finalize_provider()
            return
        if self._direct or self.streamed or self.dest.numel() == 0 or self.buf_size == 0:
            return
        self.buffer()
        item = self.dtype.itemsize
        sizes = self.chunk.sizes
        strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
        offs, lens = tuple(self.ri.storage_offsets), tuple(self.ri.lengths)
        first = sum(o * s for o, s in zip(offs, strides)) * item
        if self.up is not None:  # a box of the chunk into a GPU tensor: cut out on the device
            self.up.box(self.dest, self._tensor, self.dtype, lens, strides, (first - self.base) // item)
            return
        raw = self._tensor[first - self.base:]
        usable = raw.numel() // item * item
        typed = raw[:usable].view(self.dtype)
        src = typed.as_strided(lens, strides) if lens else typed[:1].reshape(())
        self.dest.copy_(src)

    def _finalize_provider(self) -> None:
        self.buffer()
        t = self._tensor
        leaves = {}
        for pname, (pdt, pshape, pos, n) in self.parts_layout.items():
            dt = dtype_from_name(pdt)
            leaves[pname] = t[pos:pos + n].view(dt).reshape(pshape) if n else torch.empty(pshape, dtype=dt)
        key = self.ri.storage_index.fqn
        try:
            obj = rebuild(self.chunk.provider, self.chunk.meta, self.chunk.tree, leaves)
        except ProviderError as e:
            raise ProviderError(str(e), checkpoint=self.reader.path, key=key) from e.__cause__
        if self.dest is None:  # a registered type stored as a value
            self.rebuilt = obj
            return
        src = obj
        whole = True
        for dim, (o, ln) in enumerate(zip(self.ri.storage_offsets, self.ri.lengths)):
            if ln != self.chunk.sizes[dim]:
                src = src.narrow(dim, o, ln)
                whole = False
        self.dest.copy_(src)
        if whole and tuple(self.dest.shape) == tuple(obj.shape) and self._whole_tensor():
            self.rebuilt = obj  # the loaded state holds the rebuilt object, tag and all
        elif type(self.dest) is type(obj) and hasattr(obj, "__dict__"):
            self.dest.__dict__.update(obj.__dict__)  # a resharded piece: its attributes

    def _whole_tensor(self) -> bool:
        m = self.reader.manifest
        entry = None if m is None else m.tensors.get(self.ri.storage_index.fqn)
        return entry is not None and tuple(self.chunk.sizes) == tuple(entry.size) \
            and not any(self.chunk.offsets) and not any(self.ri.dest_offsets)


def _runs(offs, lens, sizes, item) -> list[tuple[int, int]]:
    """Byte ranges (in the chunk) of the contiguous runs that make up the box."""
    nd = len(sizes)
    if nd == 0:
        return [(0, item)]
    # innermost dims where the box spans the whole dim fold into the run
    d = nd - 1
    while d > 0 and lens[d] == sizes[d]:
        d -= 1
    inner = math.prod(sizes[d + 1:])
    run_elems = lens[d] * inner
    strides = [math.prod(sizes[i + 1:]) for i in range(nd)]
    outer = [range(o, o + ln) for o, ln in zip(offs[:d], lens[:d])]
    count = math.prod(lens[:d]) if d else 1
    if count > 1 << 16:  # too many tiny runs: the covering read is cheaper
        first = sum(o * s for o, s in zip(offs, strides))
        last = sum((o + ln - 1) * s for o, ln, s in zip(offs, lens, strides)) + 1
        return [(first * item, last * item)]
    out = []
    for idx in itertools.product(*outer):
        start = (sum(i * s for i, s in zip(idx, strides[:d])) + offs[d] * strides[d]) * item
        out.append((start, start + run_elems * item))
    return out
