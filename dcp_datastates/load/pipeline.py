"""One ``dcp.load`` on this rank: from the manifest to every byte in its destination.

``LoadPipeline`` owns where the bytes come from and what happens when a read fails; DCP's
adapter (``reader.py``) only calls it in DCP's order.

**Sources**, fastest first: the checkpoint's directory (with ``node_local``, this node's copy,
which the repair makes whole first: ``replicas.for_load.NodeLocalLoad``), the byte ranges this
rank was lent of files its node lacks (``borrowed``), then the slower tiers (``fallback``),
per file and per range.  The manifest comes from the first source holding a valid committed
one of the save asked for.

**Cooperation** is a transform of the task list: where the coordinator agreed on it
(``plans.LoadTerms``), each stored block is read by one rank and sent to the others that need
it (``cooperative.py``).

**Retries**, the one policy: a block that fails its digest, or a file missing, is read from the
next source (``files.Fetcher``); a value whose bytes fail their checksum comes from the next
source's manifest (``values.py``); with node copies, a pass in which any rank met a damaged or
missing copy runs once more after every node's copies are checked against their recorded
digests and mended (``NodeLocalLoad.read``).  Nothing else is retried; a peer that dies in a
cooperative exchange fails the load (``peer_error``) once what this rank received is read again
from storage.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor

from .. import process_state
from ..errors import CoverageError, ManifestError, NotACheckpointError, PeerLoadError
from ..format import Manifest, dtype_from_name
from ..gcpause import paused_gc
from ..replicas.for_load import NodeLocalLoad
from ..replicas.repair import NodeRepair
from ..tiers import StorageTier
from ..tiers.manifests import load_manifest
from .cooperative import Cooperation, group_for
from .files import ReadStats
from .reads import ReadOptions, read_tasks
from .tasks import ReadTask, SmallTask, is_whole, small_whole
from .values import deliver, load_value

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where a load's bytes may come from: ``path``, then the slower copies ``fallback``."""

    path: str
    storage_options: dict | None = None
    fallback: tuple[str, ...] = ()
    fallback_options: dict | None = None

    def tiers(self) -> list[StorageTier]:
        return [StorageTier(self.path, self.storage_options)] + \
            [StorageTier(u, self.fallback_options) for u in self.fallback]


@dataclasses.dataclass(frozen=True)
class LoadSettings:
    """How a load reads (``DataStatesReader``'s arguments of the same names)."""

    read: ReadOptions = ReadOptions()
    allow_pickle: bool = False
    save_id: str | None = None
    process_group: object = None
    node_local: bool = False
    node: str | None = None


class LoadPipeline:
    """One load of ``sources`` on this rank, as ``settings`` say; ``repair``: the node-local
    repair a ``Checkpointer`` already surveyed (else one is made where ``node_local``)."""

    def __init__(self, sources: Sources, settings: LoadSettings, repair: NodeRepair | None = None) -> None:
        self.sources, self.settings = sources, settings
        self.local: NodeLocalLoad | None = None
        if repair is not None:
            self.local = NodeLocalLoad(repair)
        elif settings.node_local:
            self.local = NodeLocalLoad.of(StorageTier(sources.path, sources.storage_options),
                                          settings.process_group, settings.node, settings.save_id)
        self.manifest: Manifest | None = None
        self.manifest_tier: str | None = None  # the source the manifest came from
        self.stats = ReadStats()  # the last pass's
        self.peer_error: PeerLoadError | None = None  # a peer died in this load's exchange
        self._skip: set[str] = set()  # sources holding another save than ``save_id``
        self._cast_warned: set[str] = set()

    # ------------------------------------------------------------ manifest
    def open(self) -> Manifest:
        """The manifest, once the node's copy holds one (node-local loads)."""
        if self.local is not None:
            self.local.before_manifest()
        return self.load_manifest()

    def load_manifest(self) -> Manifest:
        """The manifest of the first source holding a valid committed one of the save asked for."""
        if self.manifest is not None:
            return self.manifest
        errors: list[Exception] = []
        every = self.sources.tiers()
        for tier in every:
            try:  # a format 4 index reads its parts from this tier, then from the others of this save
                m = load_manifest(tier, [x for x in every if x.url != tier.url and x.url not in self._skip])
                if self.settings.save_id is not None and m.save_id != self.settings.save_id:
                    self._skip.add(tier.url)
                    raise ManifestError(f"holds save {m.save_id} of this step, not save {self.settings.save_id} "
                                        "(a copy left by another attempt?)", checkpoint=tier.url)
            except (NotACheckpointError, ManifestError, OSError) as e:
                errors.append(e)
                if self.sources.fallback:
                    log.warning("no usable manifest on %s (%s); trying the next tier", tier.url, e)
                continue
            self.manifest, self.manifest_tier = m, tier.url
            if errors:
                log.warning("manifest served by %s", tier.url)
            return m
        raise errors[0]

    def _tiers(self) -> list[StorageTier]:
        return [t for t in self.sources.tiers() if t.url not in self._skip]

    # --------------------------------------------------------------- reads
    def read(self, plan: LoadPlan, planner: LoadPlanner, cooperative: bool) -> None:
        """Every item of ``plan`` read, checked and handed to ``planner``, retried as the module
        says."""
        try:
            with paused_gc():  # a few records and buffers per item, none cyclic
                if self.local is None:
                    self._pass(plan, planner, cooperative)
                else:  # read again where some rank met a damaged copy, once the copies are checked
                    self.local.read(lambda check: self._pass(plan, planner, cooperative, check),
                                    self.settings.read.verify)
        except PeerLoadError as e:
            self.peer_error = e
            raise

    def _pass(self, plan: LoadPlan, planner: LoadPlanner, cooperative: bool, verify_copies: bool = False) -> bool:
        """One pass of this rank's reads; whether a source other than the first served some."""
        tiers = self._tiers()
        m = self.load_manifest()
        stats = self.stats = ReadStats()
        if self.local is not None:
            self.local.before_reads(m, plan.items, verify_copies)
        coop = Cooperation(group_for(self.settings.process_group), self.sources.path) if cooperative else None
        try:
            tensor_items = [ri for ri in plan.items if ri.type != LoadItemType.BYTE_IO]
            self._check_coverage(tensor_items, planner, m)
            tasks = self._tasks(plan, planner, m, tensor_items, tiers[1:])
        except Exception:
            if coop is not None:  # the other ranks are about to ask: say this rank failed, then raise
                coop.plan(None, m.block_size)
            raise
        borrowed = self.local.borrowed() if self.local is not None else None
        share = read_tasks(tasks, tiers, m.homes, m.block_size, coop, stats, self.settings.read, borrowed)
        self._deliver_all(tasks, planner)
        self._report(tiers, share is not None)
        return any(url != tiers[0].url for url in stats.served)

    def _report(self, tiers: list[StorageTier], shared: bool) -> None:
        rank, stats = process_state.rank(), self.stats
        if len(tiers) > 1 and stats.served:
            log.info("rank %d restored %s", rank, ", ".join(
                f"{n / 2**20:.1f} MiB from {u}" for u, n in stats.served.items()))
        if shared:
            log.info("rank %d: %.1f MiB read from storage, %.1f MiB received from and %.1f MiB sent to other "
                     "ranks; plan %.3f s, reads %.3f s, exchange %.3f s", rank, stats.bytes_read / 2**20,
                     stats.bytes_received / 2**20, stats.bytes_sent / 2**20, stats.plan_s, stats.read_s,
                     stats.exchange_s)

    def _tasks(self, plan: LoadPlan, planner, m: Manifest, tensor_items,
               slower: list[StorageTier]) -> list[ReadTask | SmallTask]:
        """One read task per item (values are delivered here, from the manifest; a damaged one
        from the ``slower`` sources')."""
        tasks: list[ReadTask | SmallTask] = []
        for ri in plan.items:
            if ri.type != LoadItemType.BYTE_IO:
                continue
            v = m.values.get(ri.storage_index.fqn)
            if v is not None and v.node is not None:  # a registered type: read its parts
                tasks.append(ReadTask(ri, None, "uint8", v.node, m.block_size, checkpoint=self.sources.path))
            else:
                load_value(ri, planner, m, checkpoint=self.sources.path, allow_pickle=self.settings.allow_pickle,
                           fallback=slower)
        return tasks + [self.make_task(ri, planner, m) for ri in tensor_items]

    def make_task(self, ri: ReadItem, planner, m: Manifest) -> ReadTask | SmallTask:
        """The read task of tensor item ``ri``: its stored chunk into its destination."""
        fqn, path = ri.storage_index.fqn, self.sources.path
        key = tuple(ri.storage_index.offset) if ri.storage_index.offset is not None else ()
        entry = m.tensors.get(fqn)
        chunk = None if entry is None else entry.record_at(ri.storage_index.index, key)
        if entry is None or chunk is None:
            raise ManifestError(f"no stored chunk at offsets {list(key)}", checkpoint=path, key=fqn)
        dest = planner.resolve_tensor(ri).detach()
        if dest.dtype != dtype_from_name(entry.dtype) and fqn not in self._cast_warned:
            self._cast_warned.add(fqn)
            log.warning("%s: tensor %s was saved as %s and is loaded into a %s tensor: its values are "
                        "cast", path, fqn, entry.dtype, str(dest.dtype).replace("torch.", ""))
        if chunk.extent is not None and small_whole(ri, dest, entry.dtype, chunk):
            return SmallTask(ri, dest, chunk.extent, m.block_size, whole_tensor=is_whole(chunk, tuple(entry.size)))
        return ReadTask(ri, dest, entry.dtype, chunk, m.block_size, checkpoint=path, tensor_size=tuple(entry.size))

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
                    "use_collectives=False and a rank manifest lost?)", checkpoint=self.sources.path, key=fqn)

    @staticmethod
    def _deliver_all(tasks: list[ReadTask | SmallTask], planner) -> None:
        """Hand every finished task's tensor (or rebuilt object) to the planner."""
        sd = getattr(planner, "state_dict", None)
        for t in tasks:
            if t.rebuilt is not None and not (isinstance(sd, dict) and isinstance(sd.get(t.ri.dest_index.fqn), DTensor)):
                # what the provider rebuilt replaces the placeholder (a DTensor entry keeps its
                # place in the mesh and only receives the bytes)
                deliver(t.ri, planner, t.rebuilt, tensor=t.dest is not None)
            if t.dest is not None:
                planner.commit_tensor(t.ri, t.dest)


def _local_numel(t: torch.Tensor) -> int:
    """The elements this rank holds of ``t``: the chunks it names through DCP's checkpointable
    protocol (Megatron-Core's ``torch_dist`` tensors, whose shape is the global one), a DTensor's
    local shard, a ``ShardedTensor``'s local shards (which answer no tensor function
    themselves), or the whole tensor."""
    if hasattr(t, "__create_chunk_list__") and not isinstance(t, DTensor):
        return sum(math.prod(c.sizes) for c in t.__create_chunk_list__())  # pyright: ignore[reportAttributeAccessIssue]
    if isinstance(t, DTensor):
        return t.to_local().numel()
    if isinstance(t, ShardedTensor):
        return sum(s.tensor.numel() for s in t.local_shards())
    return t.numel()


__all__ = ["LoadPipeline", "LoadSettings", "Sources"]
