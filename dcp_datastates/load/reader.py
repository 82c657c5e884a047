"""``DataStatesReader``: DCP's ``StorageReader`` for the dcp-datastates format.

This module is DCP's adapter only: it loads the committed manifest from the fastest tier
holding a valid one, tells DCP what it holds (``load/metadata.py``), checks that every rank
restores the same save and that the plan fills every destination tensor, delivers values, and
runs the read tasks (``load/tasks.py``) through a fetcher that falls back tier by tier
(``load/files.py``).  Nothing read from storage is ever unpickled unless the reader was
built with ``allow_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import pickle
from collections import defaultdict

import torch
import xxhash
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.futures import Future

from .. import process_state
from ..errors import (
    ChecksumMismatch,
    CoverageError,
    ManifestError,
    NotACheckpointError,
    PeerLoadError,
    PickleNotAllowedError,
)
from ..format import MANIFEST_NAME, Manifest, dtype_from_name
from ..format.model import ValueEntry
from ..format.values import decode_value
from ..gcpause import paused_gc
from ..planner import deliver_object
from ..replicas.for_load import NodeLocalLoad
from ..replicas.repair import NodeRepair
from ..tiers import StorageTier
from ..tiers.manifests import checkpoint_name, load_manifest, one_checkpoint
from ..tiers.storage import url_tuple
from .cooperative import Cooperation, cooperative_for, group_for
from .files import ReadStats
from .metadata import manifest_to_metadata
from .reads import ReadOptions, read_tasks
from .tasks import ReadTask, SmallTask, is_whole, small_whole

log = logging.getLogger(__name__)

__all__ = ["DataStatesReader", "LoadTerms", "ManifestServed"]


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
        cooperative: each stored block the job needs is read from storage by one rank and sent
            to the others that need it (``load/cooperative.py``): HSDP replicas and
            replicated parameters are then read once per job, not once per rank.  ``"auto"``
            (the default): on when ``dcp.load`` runs on more than one rank of
            ``process_group``; ``False``: every rank reads for itself.
        process_group: the group given to ``dcp.load`` (default: the default group); the
            cooperative load sends over it (over a gloo group of its ranks where its backend
            has no gloo).
        node_local: ``path`` is this node's own directory of a checkpoint saved with
            ``DataStatesWriter(replicas=K)``: before the manifest is read, a node that lacks it
            receives it; before the data is read, each node receives the files its ranks read
            that it lacks or holds damaged (collectives over ``process_group``), from other
            nodes' copies whose bytes match their recorded digests.  ``node``: this rank's node
            (default: ``DCP_DATASTATES_NODE``, ``GROUP_RANK`` or the host name).
        _extension_registry: ``FileSystemReader``'s, accepted so that code written for it runs
            unchanged; without effect, since the manifest records how each block is stored.
    """

    def __init__(self, path: str | None = None, *, thread_count: int = 8, allow_pickle: bool = False,
                 verify: bool = True, storage_options: dict | None = None,
                 fallback: list[str] | str | None = None, fallback_options: dict | None = None,
                 o_direct: bool | str = "auto", save_id: str | None = None,
                 cooperative: bool | str = "auto", process_group=None, node_local: bool = False,
                 node: str | None = None, _extension_registry: object = None,
                 _node_repair: NodeRepair | None = None) -> None:
        super().__init__()
        del _extension_registry  # FileSystemReader's: our manifest names how each block is stored
        if o_direct not in (True, False, "auto"):
            raise ValueError(f"o_direct must be True, False or 'auto', got {o_direct!r}")
        if cooperative not in (True, False, "auto"):
            raise ValueError(f"cooperative must be True, False or 'auto', got {cooperative!r}")
        self.path = None if path is None else str(path)
        self.thread_count = max(1, thread_count)
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.storage_options = storage_options
        self.fallback = list(url_tuple(fallback))
        self.fallback_options = fallback_options
        self.o_direct = o_direct
        self._options = ReadOptions(self.thread_count, verify, o_direct)
        self.save_id = save_id
        self.cooperative = cooperative
        self.process_group = process_group
        self.node_local, self.node = node_local, node
        self._given_repair = _node_repair  # ``Checkpointer``'s, surveyed before the load
        self._local: NodeLocalLoad | None = None
        self._metadata_failure: Exception | None = None  # why this load's ``read_metadata`` failed
        # a peer that died in this load's exchange: DCP's own collective after ``read_data`` then
        # fails with the process group's error, and ``Checkpointer`` raises this one instead
        self.peer_error: PeerLoadError | None = None
        self.manifest: Manifest | None = None
        self.manifest_tier: str | None = None  # the tier the manifest came from
        self.stats = ReadStats()  # the last load's
        self._skip: set[str] = set()  # tiers holding another save (``save_id``)
        self._cast_warned: set[str] = set()

    # the last load's figures (``stats``), by their older names
    @property
    def bytes_read(self) -> int:
        return self.stats.bytes_read

    @property
    def bytes_needed(self) -> int:
        return self.stats.bytes_needed

    @property
    def bytes_direct(self) -> int:
        return self.stats.bytes_direct

    @property
    def served(self) -> dict[str, int]:
        return self.stats.served

    # --------------------------------------------------------- StorageReader
    def reset(self, checkpoint_id=None) -> None:
        """DCP: start a load; ``checkpoint_id`` (when given) replaces the path."""
        if checkpoint_id is not None and str(checkpoint_id) != self.path:
            self.path = str(checkpoint_id)
            self._given_repair = None  # it was of another directory
        self.manifest = None
        self.peer_error = None
        self._local = None
        self._metadata_failure = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """DCP: the committed manifest (fastest tier holding a valid one) as DCP's ``Metadata``;
        with ``node_local``, once every node holds the manifest (``NodeLocalLoad``).

        DCP asks again for a rank's own metadata (``rank=``) on the ranks whose first call
        failed, and on those alone; a checkpoint has no such metadata, so that call fails at
        once with the first call's reason and never joins a collective the other ranks will
        not make (the node-local survey)."""
        if kwargs.get("rank") is not None:
            if self._metadata_failure is not None:
                raise self._metadata_failure
            raise NotACheckpointError("dcp-datastates keeps one manifest per checkpoint, no rank-local "
                                      f"metadata for rank {kwargs['rank']}", checkpoint=self.path)
        try:
            return self._read_metadata()
        except Exception as e:  # re-raised: kept only to give DCP's second call the same reason
            self._metadata_failure = e
            raise

    def _read_metadata(self) -> Metadata:
        if self._given_repair is not None:
            self._local = NodeLocalLoad(self._given_repair)
        elif self.node_local:
            self._local = NodeLocalLoad.of(self._tiers(every=True)[0], self.process_group, self.node, self.save_id)
        if self._local is not None:
            self._local.before_manifest()
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
        return dataclasses.replace(plan, storage_data=ManifestServed(
            self.manifest.save_id, self.manifest_tier, checkpoint_name(self.path or "")))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """DCP: once every rank is shown to load the same save, the plans, each telling its rank
        whether the load is cooperative (``LoadTerms``)."""
        _one_save(plans, self.path)
        terms = LoadTerms(cooperative_for(self.cooperative, len(plans), self.process_group, self.path))
        return [dataclasses.replace(p, storage_data=terms) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP: read every item of ``plan`` (coverage checked first, every block verified,
        slower tiers used for what the first cannot serve) and hand it to ``planner``."""
        try:
            with paused_gc():  # a few records and buffers per item, none cyclic
                if self._local is None:
                    self._read_plan(plan, planner)
                else:  # read again where some rank met a damaged copy, once the copies are checked
                    self._local.read(lambda check: self._read_plan(plan, planner, check), self.verify)
        except PeerLoadError as e:
            self.peer_error = e
            raise
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        """DCP: never chosen automatically; pass the reader explicitly."""
        return False

    # ------------------------------------------------------------- manifest
    def _tiers(self, every: bool = False) -> list[StorageTier]:
        if self.path is None:
            raise NotACheckpointError("DataStatesReader has no path: pass one to the constructor "
                                      "or give dcp.load a checkpoint_id")
        tiers = [StorageTier(self.path, self.storage_options)]
        tiers += [StorageTier(u, self.fallback_options) for u in self.fallback]
        return tiers if every else [t for t in tiers if t.url not in self._skip]

    def _load_manifest(self) -> Manifest:
        errors: list[Exception] = []
        every = self._tiers(every=True)
        for tier in every:
            try:  # a format 4 index reads its parts from this tier, then from the others of this save
                m = load_manifest(tier, [x for x in every if x.url != tier.url and x.url not in self._skip])
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

    # ------------------------------------------------------------------ reads
    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner, verify_copies: bool = False) -> bool:
        """One pass of this rank's reads; whether a tier other than the first served some."""
        tiers = self._tiers()
        m = self.manifest or self._load_manifest()
        self.manifest = m
        stats = self.stats = ReadStats()
        if self._local is not None:
            self._local.before_reads(m, plan.items, verify_copies)
        coop = self._cooperation(plan)
        try:
            tensor_items = [ri for ri in plan.items if ri.type != LoadItemType.BYTE_IO]
            self._check_coverage(tensor_items, planner, m)
            tasks = self._tasks(plan, planner, m, tensor_items)
        except Exception:
            if coop is not None:  # the other ranks are about to ask: say this rank failed, then raise
                coop.plan(None, m.block_size)
            raise
        borrowed = self._local.borrowed() if self._local is not None else None
        share = read_tasks(tasks, tiers, m.homes, m.block_size, coop, stats, self._options, borrowed)
        self._deliver_all(tasks, planner)
        rank = process_state.rank()
        if len(tiers) > 1 and stats.served:
            log.info("rank %d restored %s", rank, ", ".join(
                f"{n / 2**20:.1f} MiB from {u}" for u, n in stats.served.items()))
        if share is not None:
            log.info("rank %d: %.1f MiB read from storage, %.1f MiB received from and %.1f MiB sent to other "
                     "ranks; plan %.3f s, reads %.3f s, exchange %.3f s", rank, stats.bytes_read / 2**20,
                     stats.bytes_received / 2**20, stats.bytes_sent / 2**20, stats.plan_s, stats.read_s,
                     stats.exchange_s)
        return any(url != tiers[0].url for url in stats.served)

    def _cooperation(self, plan: LoadPlan) -> Cooperation | None:
        """The cooperative load the coordinator agreed on for every rank (``LoadTerms``)."""
        terms = plan.storage_data
        if not (isinstance(terms, LoadTerms) and terms.cooperative):
            return None
        return Cooperation(group_for(self.process_group), self.path)

    def _tasks(self, plan: LoadPlan, planner, m: Manifest, tensor_items) -> list[ReadTask | SmallTask]:
        """One read task per item (values are delivered here, from the manifest)."""
        tasks: list[ReadTask | SmallTask] = []
        for ri in plan.items:
            if ri.type != LoadItemType.BYTE_IO:
                continue
            v = m.values.get(ri.storage_index.fqn)
            if v is not None and v.node is not None:  # a registered type: read its parts
                tasks.append(ReadTask(ri, None, "uint8", v.node, m.block_size, checkpoint=self.path))
            else:
                self._load_value(ri, planner, m)
        return tasks + [self._make_task(ri, planner, m) for ri in tensor_items]

    def _make_task(self, ri: ReadItem, planner, m: Manifest) -> ReadTask | SmallTask:
        fqn = ri.storage_index.fqn
        key = tuple(ri.storage_index.offset) if ri.storage_index.offset is not None else ()
        entry = m.tensors.get(fqn)
        chunk = None if entry is None else entry.record_at(ri.storage_index.index, key)
        if entry is None or chunk is None:
            raise ManifestError(f"no stored chunk at offsets {list(key)}", checkpoint=self.path, key=fqn)
        dest = planner.resolve_tensor(ri).detach()
        if dest.dtype != dtype_from_name(entry.dtype) and fqn not in self._cast_warned:
            self._cast_warned.add(fqn)
            log.warning("%s: tensor %s was saved as %s and is loaded into a %s tensor: its values are "
                        "cast", self.path, fqn, entry.dtype, str(dest.dtype).replace("torch.", ""))
        if chunk.extent is not None and small_whole(ri, dest, entry.dtype, chunk):
            return SmallTask(ri, dest, chunk.extent, m.block_size,
                             whole_tensor=is_whole(chunk, tuple(entry.size)))
        return ReadTask(ri, dest, entry.dtype, chunk, m.block_size, checkpoint=self.path,
                        tensor_size=tuple(entry.size))

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
            want = _local_numel(obj)
            if covered[fqn] < want:
                raise CoverageError(
                    f"the checkpoint covers only {covered[fqn]} of the {want} elements this "
                    "rank must load; the save did not record every chunk (was it saved with "
                    "use_collectives=False and a rank manifest lost?)", checkpoint=self.path, key=fqn)

    def _deliver_all(self, tasks: list[ReadTask | SmallTask], planner) -> None:
        """Hand every finished task's tensor (or rebuilt object) to the planner."""
        sd = getattr(planner, "state_dict", None)
        for t in tasks:
            if t.rebuilt is not None and not (isinstance(sd, dict) and isinstance(sd.get(t.ri.dest_index.fqn), DTensor)):
                # what the provider rebuilt replaces the placeholder (a DTensor entry keeps its
                # place in the mesh and only receives the bytes)
                _deliver(t.ri, planner, t.rebuilt, tensor=t.dest is not None)
            if t.dest is not None:
                planner.commit_tensor(t.ri, t.dest)

    # ----------------------------------------------------------------- values
    def _load_value(self, ri: ReadItem, planner, m: Manifest) -> None:
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

    def _value_from_fallback(self, fqn: str) -> ValueEntry | None:
        for tier in self._tiers()[1:]:
            try:
                other = load_manifest(tier).values.get(fqn)
            except (NotACheckpointError, ManifestError, OSError):
                continue
            if other is not None and xxhash.xxh3_64_intdigest(other.data) == other.checksum:
                log.warning("value %s is damaged in %s; using the copy in %s", fqn, self.path, tier.url)
                return other
        return None


def _local_numel(t: torch.Tensor) -> int:
    """The elements this rank holds of ``t``: a DTensor's local shard, a ``ShardedTensor``'s
    local shards (which answer no tensor function themselves), or the whole tensor."""
    if isinstance(t, DTensor):
        return t.to_local().numel()
    if isinstance(t, ShardedTensor):
        return sum(s.tensor.numel() for s in t.local_shards())
    return t.numel()


def _deliver(ri: ReadItem, planner, value, *, tensor: bool = False) -> None:
    if deliver_object(planner, ri, value) or tensor:
        return
    # Hand another planner the bytes it expects.  They are made here from the value already
    # decoded, so its torch.load never meets bytes read from storage.
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    planner.load_bytes(ri, buf)


@dataclasses.dataclass(frozen=True)
class LoadTerms:
    """What the coordinator tells every rank about a load: whether it is cooperative."""
    cooperative: bool


@dataclasses.dataclass(frozen=True)
class ManifestServed:
    """A rank's load plan's storage data: the save its manifest is, the tier it came from and
    the checkpoint the rank named (``tiers.manifests.checkpoint_name``)."""
    save_id: str
    tier: str | None
    checkpoint: str | None = None


def _one_save(plans: list[LoadPlan], path: str | None) -> None:
    """Raise unless every rank's manifest is the same save: ranks restoring different saves of
    one step (a node-local copy an earlier attempt left) would mix two states; ranks that name
    different checkpoints are told so first."""
    one_checkpoint([(r, p.storage_data.checkpoint, None) for r, p in enumerate(plans)
                    if isinstance(p.storage_data, ManifestServed)], path or "")
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
