"""Planners: DCP's default planners, with what the format can use.

DCP's default planners work with ``DataStatesWriter``/``DataStatesReader``
unchanged.  These subclasses add what the format can use:

* :class:`DataStatesSavePlanner` keeps each save's id in plans DCP's plan cache
  replays, and describes regular shardings by rule (format 4);
* :class:`DataStatesLoadPlanner` receives non-tensor values already decoded
  from msgpack (``load_value``), without the ``torch.save``/``torch.load``
  round trip that DCP's ``load_bytes`` interface needs.

Where a plan's items' bytes go is ``save/placement.py``'s work, not the planner's.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import ChainMap

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import process_state
from .errors import CheckpointError
from .format.limits import SMALL_ITEM_BYTES, FormatViolation
from .format.model import ChunkMetadataView, TensorEntry
from .format.v4.rules import Geometry, Mesh, RuleTable, ShardRule, merge_tables, salt
from .gcpause import paused_gc

RULES_KEY = "\x00dcp_datastates.rules"  # in a plan's and the global metadata's planner_data


class DataStatesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with plan caching (``enable_plan_caching=True``) that keeps
    each save's storage data, and sharding rules.  (Largest first is the order of each data file,
    which ``lay_out`` places by size: the engine starts the long copies early and the small items
    coalesce at the end.)

    ``sharding_rules`` (on by default; used when several ranks save together): each DTensor
    placed with plain ``Shard``/``Replicate`` placements is described by its mesh and
    placements instead of one entry per rank (format version 4, ``docs/format.md``), and of a
    replicated box only the replica the rule names writes it, decided on each rank alone."""

    # plan cache key -> each rank's rule table, for replayed plans.  Class-level on purpose: it
    # completes DCP's own plan cache, which is class-level (shared by every planner of the
    # process, so a new planner object at the same call site replays the cached plans).
    _rank_tables: dict = {}

    def __init__(self, *args, sharding_rules: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sharding_rules = sharding_rules
        self.rules: RuleTable | None = None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        """DCP's; a state of plain nested dicts is flattened in one pass (``_flattened``) to
        the keys, order and paths DCP's two generic traversals give, and DCP's own set-up then
        takes it as flat."""
        flat = _flattened(state_dict) if self.flatten_state_dict else None
        if flat is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        flags = self.flatten_state_dict, self.flatten_sharded_tensors
        self.flatten_state_dict = self.flatten_sharded_tensors = False  # done: no ShardedTensor in it
        try:
            super().set_up_planner(flat[0], storage_meta, is_coordinator)
        finally:
            self.flatten_state_dict, self.flatten_sharded_tensors = flags
        self.mappings = flat[1]

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """DCP's final plan; when its plan cache replays an earlier save's plan, with the
        storage data the writer gave this save (its id) instead of the earlier save's."""
        plan = super().finish_plan(new_plan)
        if not new_plan.usable and new_plan.storage_data is not None:
            plan = self.plan = dataclasses.replace(plan, storage_data=new_plan.storage_data)
        return plan

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan (``_plain_plan``'s where the state is plain tensors and values).
        With rules: the rank's table rides in ``planner_data`` and replicated boxes it does not
        write are gone."""
        with paused_gc():  # a few write items per tensor, none cyclic (format/model.py)
            plan = _plain_plan(self)
            if plan is None:
                plan = super().create_local_plan()
        self.rules = None
        if self.sharding_rules and process_state.world_size() > 1 and isinstance(self.state_dict, dict):
            self.rules, items = _rules(self.state_dict, plan.items if plan.usable else self.plan.items)
            if plan.usable:
                plan = dataclasses.replace(plan, items=items,
                                           planner_data={**(plan.planner_data or {}), RULES_KEY: self.rules})
            else:
                plan = dataclasses.replace(plan, items=[])
        return plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's dedup of items several ranks hold (plain tensors every rank has), except that
        small ones go to the lowest rank holding them: with metadata parts, a rank then finds
        all of them in one part instead of one part per item."""
        if len(all_plans) == 1:  # one plan holds each item once: nothing to dedup
            return list(all_plans)
        if not self.sharding_rules:
            return super()._dedup_save_plans(all_plans)
        small = [dataclasses.replace(p, items=[i for i in p.items if _small(i)]) for p in all_plans]
        large = [dataclasses.replace(p, items=[i for i in p.items if not _small(i)]) for p in all_plans]
        small = dedup_save_plans(small, True)
        large = dedup_save_plans(large, self.dedup_save_to_lowest_rank)
        return [dataclasses.replace(p, items=a.items + b.items) for p, a, b in zip(all_plans, large, small)]

    def _create_global_plan(self, all_plans: list[SavePlan]):
        """DCP's global plan and metadata (``_whole_plans``' where every tensor is written whole,
        which needs no check of bounds or overlaps).  Plans with shards (FSDP) are seen at their
        first item and go to DCP's whole, deduplicated once."""
        whole = all(map(_whole, itertools.chain.from_iterable(p.items for p in all_plans)))
        out = _whole_plans(self._dedup_save_plans(all_plans)) if whole else None
        if out is None:
            return super()._create_global_plan(all_plans)
        plans, md = out
        if self.flatten_state_dict:
            md.planner_data = dict(ChainMap(*[p.planner_data for p in plans]))
        return plans, md

    def create_global_plan(self, all_plans: list[SavePlan]):
        """DCP's global plan; the ranks' rule tables merged into the global metadata's
        ``planner_data`` (where the writer's ``finish`` finds them).  Each rank's plan reaches
        the storage writer with the storage data the writer gave its local plan this save (a
        replica group's vote), also where DCP's plan cache stands for it (an empty plan, or
        one merged from the cached local plan, which holds the storage data of the save that
        filled the cache)."""
        key = getattr(self, "_cached_plans_key", None)
        known = self._rank_tables.get(key, [])
        tables = [(p.planner_data or {}).get(RULES_KEY) if isinstance(p.planner_data, dict) else None
                  for p in all_plans]
        tables = [t if t is not None or i >= len(known) else known[i] for i, t in enumerate(tables)]
        plans = [dataclasses.replace(p, planner_data={k: v for k, v in p.planner_data.items() if k != RULES_KEY})
                 if isinstance(p.planner_data, dict) and RULES_KEY in p.planner_data else p for p in all_plans]
        with paused_gc():  # a few metadata records per item, none cyclic (format/model.py)
            out, md = super().create_global_plan(plans)
        if any(t is not None for t in tables):
            try:
                merged = merge_tables(tables)
            except FormatViolation as e:
                raise CheckpointError(f"cannot save: {e}") from None
            md.planner_data = {**(md.planner_data or {}), RULES_KEY: merged}
            if key is not None:
                self._rank_tables[key] = tables
        out = [p if local.storage_data is None else dataclasses.replace(p, storage_data=local.storage_data)
               for p, local in zip(out, all_plans)]
        return out, md


# TensorProperties' fields, where they are what a tensor's dtype, layout, grad and pinning give
# (torch 2.11 to 2.14; 2.15 adds strides): one object serves every tensor alike
_PROPERTIES_BY_KIND = {f.name for f in dataclasses.fields(TensorProperties)} == {
    "dtype", "layout", "requires_grad", "memory_format", "pin_memory"}


def _plain_plan(planner: DefaultSavePlanner) -> SavePlan | None:
    """DCP's local plan of a flat state whose values are plain tensors (``torch.Tensor``,
    ``Parameter``) and values DCP saves as bytes, made directly (DCP's makes five records and a
    ``torch.Size`` per tensor through generic helpers), with each
    item's index hint set as DCP's global plan sets it.  None where DCP's own is needed: plan
    caching, a state not a dict, DTensors, sharded or subclassed tensors, objects that make
    their own write items."""
    state = planner.state_dict
    if getattr(planner, "_enable_plan_caching", False) or type(state) is not dict:
        return None
    items: list[WriteItem] = []
    zeros: dict[int, torch.Size] = {}
    kinds: dict[tuple, TensorProperties] = {}
    tensor, byte_io = WriteItemType.TENSOR, WriteItemType.BYTE_IO
    for fqn, obj in state.items():
        t = type(obj)
        if t in PLAIN_TENSORS:
            size = obj.size()
            off = zeros.get(len(size))
            if off is None:
                off = zeros[len(size)] = torch.Size([0] * len(size))
            if _PROPERTIES_BY_KIND:
                kind = (obj.dtype, obj.layout, obj.requires_grad, obj.is_pinned())
                props = kinds.get(kind)
                if props is None:
                    props = kinds[kind] = TensorProperties.create_from_tensor(obj)
            else:
                props = TensorProperties.create_from_tensor(obj)
            items.append(WriteItem(index=MetadataIndex(fqn, off, 0), type=tensor, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=off, sizes=size), properties=props, size=size)))
        elif isinstance(obj, (torch.Tensor, ShardedTensor)) or hasattr(obj, "__create_write_items__"):
            return None
        else:
            items.append(WriteItem(index=MetadataIndex(fqn), type=byte_io))
    plan = SavePlan(items, planner_data=planner.mappings) if planner.flatten_state_dict else SavePlan(items)
    planner.plan = plan
    return plan


def _whole(item: WriteItem) -> bool:
    """Whether ``item`` is a value, or a tensor written whole as one chunk."""
    if item.type == WriteItemType.BYTE_IO:
        return True
    td = item.tensor_data
    return (item.type == WriteItemType.TENSOR and td is not None and td.chunk is not None
            and td.chunk.sizes == td.size and not any(td.chunk.offsets))


def _whole_plans(plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata] | None:
    """DCP's global plan and metadata of deduplicated plans whose items are all ``_whole``,
    made directly: items already hinted (``_plain_plan``'s) are kept, others hinted as DCP
    does.  One chunk that is its whole tensor is inside it and overlaps nothing, so DCP's checks
    of the plan have nothing to find.  None where a key is written twice (DCP's way refuses it)."""
    md: dict = {}
    out = []
    for plan in plans:
        items = plan.items
        for k, item in enumerate(items):
            fqn = item.index.fqn
            if fqn in md:
                return None
            if item.type == WriteItemType.BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                continue
            td = item.tensor_data
            assert td is not None, "a tensor item carries its tensor data"
            md[fqn] = TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[td.chunk])
            if item.index.index != 0:
                if items is plan.items:
                    items = list(items)
                items[k] = dataclasses.replace(item, index=dataclasses.replace(item.index, index=0))
        out.append(plan if items is plan.items else dataclasses.replace(plan, items=items))
    return out, Metadata(md)



# values DCP's traversal visits as they are, and those of which a list is visited whole
_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, DTensor, int, float, bool, str, bytes, type(None)})
_SCALARS = frozenset({int, float, bool, str, type(None)})


def _flattened(state_dict) -> tuple[dict, dict] | None:
    """DCP's ``flatten_state_dict`` of a state made of ``dict``s with ``str`` keys whose leaves
    are tensors, parameters, DTensors, plain values or lists of scalars: the flat state and each
    key's path, in DCP's order.  None for anything else (other mappings, keys or leaves, lists
    holding tensors or containers, a key met twice), which DCP's own traversal handles."""
    if type(state_dict) is not dict:
        return None
    flat: dict = {}
    paths: dict = {}
    return (flat, paths) if _walk(flat, paths, "", (), state_dict) else None


def _walk(flat: dict, paths: dict, prefix: str, path: tuple, d: dict) -> bool:
    """``_flattened``'s pass over dict ``d`` at ``path``; False where DCP's traversal is needed."""
    for k, v in d.items():
        if type(k) is not str:
            return False
        t = type(v)
        if t is dict:
            if not _walk(flat, paths, f"{prefix}{k}.", (*path, k), v):
                return False
        elif t in _LEAVES or (t is list and all(type(x) in _SCALARS for x in v)):
            fqn = prefix + k
            if fqn in flat:
                return False
            flat[fqn] = v
            paths[fqn] = (*path, k)
        else:
            return False
    return True


def _small(item: WriteItem) -> bool:
    return item.type != WriteItemType.BYTE_IO and (item.tensor_storage_size() or 0) <= SMALL_ITEM_BYTES


def _rules(state_dict: dict, items: list[WriteItem]) -> tuple[RuleTable, list[WriteItem]]:
    """This rank's rule table, and its items less the replicated boxes another replica writes
    by the rule.  A DTensor whose box the rule does not reproduce fails the save here."""
    meshes: list[Mesh] = []
    mesh_at: dict[int, tuple[int, tuple]] = {}  # id(device mesh) -> (index, this rank's coordinate)
    rules: dict[str, ShardRule] = {}
    keep = []
    for item in items:
        fqn = item.index.fqn
        obj = state_dict.get(fqn)
        dims = _dims(obj) if isinstance(obj, DTensor) and item.tensor_data is not None else None
        if dims is None or not isinstance(obj, DTensor) or item.tensor_data is None:
            keep.append(item)
            continue
        dm = obj.device_mesh
        if id(dm) not in mesh_at:
            mesh_at[id(dm)] = (len(meshes), tuple(dm.get_coordinate() or ()))
            meshes.append(Mesh.of(dm.mesh.shape, dm.mesh.flatten().tolist()))
        m, coord = mesh_at[id(dm)]
        rule = ShardRule(m, dims)
        g = Geometry(tuple(obj.shape), meshes[m], rule, salt(fqn), obj.dtype.itemsize)
        i = g.chunk_of(coord)
        chunk = item.tensor_data.chunk
        if g.box(i) != (tuple(chunk.offsets), tuple(chunk.sizes)):
            raise CheckpointError(
                f"the sharding rule of {obj.placements} gives box {g.box(i)} on mesh coordinate {coord}, "
                f"but DTensor holds {(tuple(chunk.offsets), tuple(chunk.sizes))}; save with "
                "DataStatesSavePlanner(sharding_rules=False) and report this", key=fqn)
        rules[fqn] = rule
        if g.writer(i) == coord:
            keep.append(item)
    return RuleTable.of(meshes, rules), keep


def _dims(dt: DTensor) -> tuple[int, ...] | None:
    """Per mesh dimension, the tensor dimension it shards (-1: replicated); None where a
    placement is anything else (partial, strided shards) or two shard one dimension."""
    dims = []
    for p in dt.placements:
        if type(p) is Shard:
            dims.append(p.dim % max(1, dt.ndim))
        elif isinstance(p, Replicate):
            dims.append(-1)
        else:
            return None
    sharded = [d for d in dims if d >= 0]
    return tuple(dims) if len(set(sharded)) == len(sharded) else None


class DataStatesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, for ``DataStatesReader``: plans against the saved chunks
    that overlap the rank's boxes only, and takes values already decoded."""

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan, computed against only the saved chunks that overlap this rank's boxes.

        DCP's planner sweeps every saved chunk of every tensor it loads: a tensor sharded over
        N ranks costs each rank O(N), and every rank pays that for every tensor.  A version 3 or 4
        manifest answers "which chunks overlap these boxes" over its columns or rules, so each
        tensor's metadata is narrowed to those first; a box that is exactly one saved chunk (a
        same-size FSDP restart) is read directly."""
        with paused_gc():  # a few read items and records per tensor, none cyclic
            return self._plan()

    def _plan(self) -> LoadPlan:
        full = self.metadata
        if full is None:
            return super().create_local_plan()
        narrowed: dict = {}
        direct: dict[str, list[ReadItem]] = {}
        memo: dict = {}  # box arithmetic shared by tensors of one layout (``_reads``)
        for fqn, obj in self.state_dict.items():
            tmd = full.state_dict_metadata.get(fqn)
            if not isinstance(obj, torch.Tensor) or not isinstance(tmd, TensorStorageMetadata) \
                    or not isinstance(tmd.chunks, ChunkMetadataView) or obj.size() != tmd.size:
                continue  # DCP's planner plans it (and refuses a tensor of another size)
            item = _whole_read(fqn, obj, tmd)
            if item is not None:
                direct[fqn] = [item]
                continue
            boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in _create_chunk_list(obj)]
            items, keep = _reads(fqn, tmd, boxes, memo)
            if items is not None:
                direct[fqn] = items
                continue
            narrowed[fqn] = narrow(tmd, boxes, keep)
        if not narrowed and not direct:
            return super().create_local_plan()
        rest = {k: v for k, v in self.state_dict.items() if k not in direct}
        metadata = dataclasses.replace(full, state_dict_metadata={
            **{k: v for k, v in full.state_dict_metadata.items() if k not in direct}, **narrowed})
        if full.state_dict_metadata.keys() <= self.state_dict.keys():
            # every saved key is asked for: DCP's planner makes exactly this call
            plan = create_default_local_load_plan(rest, metadata, not self.allow_partial_load)
        else:
            plan = self._dcps_plan(rest, metadata)
        return dataclasses.replace(plan, items=[*itertools.chain.from_iterable(direct.values()), *plan.items])

    def _dcps_plan(self, state_dict: dict, metadata: Metadata) -> LoadPlan:
        """DCP's own ``create_local_plan`` of ``state_dict`` against ``metadata``.  Where saved
        keys are not asked for, DCP tells the keys of a checkpoint saved before torch 2.4 apart
        from keys left out on purpose, reading both from ``self``; that logic stays DCP's, so
        the two fields are lent to it for the call and given back."""
        sd, full = self.state_dict, self.metadata
        self.state_dict, self.metadata = state_dict, metadata
        try:
            return super().create_local_plan()
        finally:
            self.metadata = full
            if self.state_dict is state_dict:  # DCP swaps in a pre-2.4 flattening where it finds one
                self.state_dict = sd

    def load_value(self, read_item, value) -> None:
        """Set a decoded non-tensor value (the reader calls this instead of ``load_bytes``)."""
        _set_in_state_dict(self, read_item.dest_index.fqn, value)

    def resolve_tensor(self, read_item: ReadItem):
        """DCP's: the tensor a read fills.  A plain tensor read whole is itself (what DCP's
        lookup and narrowing return for it), found without them; anything else, or a subclass
        that changes the lookup or the narrowing, goes DCP's way."""
        obj = self.state_dict.get(read_item.dest_index.fqn)
        if isinstance(obj, torch.Tensor) and type(obj) in PLAIN_TENSORS and not any(read_item.dest_offsets) \
                and tuple(read_item.lengths) == obj.shape \
                and not any(read_item.dest_index.offset or ()) and getattr(self, "_dcps_lookup", False):
            return obj
        return super().resolve_tensor(read_item)

    def set_up_planner(self, *args, **kwargs) -> None:
        super().set_up_planner(*args, **kwargs)
        # whether ``resolve_tensor`` may skip DCP's lookup and narrowing: asked once per load
        self._dcps_lookup = dcps_ways(self, DefaultLoadPlanner, ("lookup_tensor", "transform_tensor"))


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # types saved and loaded as plain tensors


def _entry(tmd: TensorStorageMetadata) -> TensorEntry:
    """The manifest's record of a tensor whose DCP metadata this reader made lazily."""
    chunks = tmd.chunks
    if not isinstance(chunks, ChunkMetadataView):
        raise TypeError("the tensor's chunks are not a manifest's (ChunkMetadataView)")
    return chunks.entry


def _whole_read(fqn: str, obj: torch.Tensor, tmd: TensorStorageMetadata) -> ReadItem | None:
    """The read of a plain tensor stored whole as one chunk of its shape (most small tensors),
    as DCP's planner would make it, without its per-item sweep; None for anything else."""
    if type(obj) not in PLAIN_TENSORS or obj.numel() == 0:  # DCP plans no read for an empty tensor
        return None
    entry = _entry(tmd)
    if entry.count() != 1:
        return None
    offsets, sizes = entry.box(0)
    if any(offsets) or tuple(sizes) != tuple(tmd.size) or tuple(obj.shape) != tuple(sizes):
        return None
    return _chunk_read(fqn, offsets, sizes, 0)


def _chunk_read(fqn: str, offsets: tuple, sizes: tuple, chunk: int) -> ReadItem:
    """The read of saved chunk number ``chunk`` whole, into the rank's one box, which is that
    chunk's box (``offsets``, ``sizes``), as DCP's planner makes it."""
    zeros = torch.Size([0] * len(sizes))
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, offsets, 0), dest_offsets=zeros,
                    storage_index=MetadataIndex(fqn, offsets, chunk), storage_offsets=zeros,
                    lengths=torch.Size(sizes))


def _reads(fqn: str, tmd: TensorStorageMetadata, boxes: list[tuple[tuple, tuple]], memo: dict | None = None) \
        -> tuple[list[ReadItem] | None, list[int] | None]:
    """The reads of a rank's ``boxes`` from the saved chunks that overlap them, the items DCP's
    resharding makes, without its sweep over every chunk; each names its saved chunk by number,
    so the reader finds the record without a search.  ``(None, overlapping)`` where a box is
    empty (DCP's own handling then applies to the overlapping chunks).

    ``memo`` (one plan's): the box arithmetic of tensors whose chunks have the same boxes by
    construction (``TensorEntry.layout_key``: one rule over one size; a model's
    layers and their optimizer states), kept by key and boxes and reused for the next such."""
    entry = _entry(tmd)
    key = entry.layout_key() if memo is not None else None
    if key is None:
        spans, keep = _spans(entry, boxes)
    else:
        key = (key, tuple(boxes))
        assert memo is not None, "a key is made only with a memo"
        got = memo.get(key)
        if got is None:
            got = memo[key] = _spans(entry, boxes)
        spans, keep = got
        keep = list(keep)  # the memo's stays as it is
    if spans is None:
        return None, keep
    dests = [MetadataIndex(fqn, lo, li) for li, (lo, _) in enumerate(boxes)]
    return [ReadItem(type=LoadItemType.TENSOR, dest_index=dests[li], dest_offsets=d_off,
                     storage_index=MetadataIndex(fqn, so, i), storage_offsets=s_off, lengths=n)
            for li, i, so, d_off, s_off, n in spans], keep


def _spans(entry, boxes: list[tuple[tuple, tuple]]) -> tuple[list[tuple] | None, list[int]]:
    """``_reads``' arithmetic, which depends on the boxes alone: for each read, the local box
    number, the saved chunk's number and offsets, and the read's destination offsets, source
    offsets and lengths (as ``torch.Size``, shared by the items made from them)."""
    if len(boxes) == 1 and all(boxes[0][1]):
        i = entry.exact(boxes[0])
        if i is not None:  # the box is one saved chunk (a same-size restart)
            lo, lz = boxes[0]
            zeros = torch.Size([0] * len(lz))
            return [(0, i, lo, zeros, zeros, torch.Size(lz))], [i]
    keep = entry.overlapping(boxes)
    if not all(all(z) for _, z in boxes):
        return None, keep
    saved = [(i, *entry.box(i)) for i in keep]
    spans = []
    for li, (lo, lz) in enumerate(boxes):
        for i, so, sz in saved:
            s_off, d_off, n = [], [], []
            for a, x, b, y in zip(so, sz, lo, lz):  # saved offset and size, local offset and size
                start, end = max(a, b), min(a + x, b + y)
                if end <= start:
                    break
                s_off.append(start - a)
                d_off.append(start - b)
                n.append(end - start)
            else:
                spans.append((li, i, so, torch.Size(d_off), torch.Size(s_off), torch.Size(n)))
    return spans, keep


def plan_reads(fqn: str, tmd: TensorStorageMetadata, boxes: list[tuple[tuple, tuple]],
               memo: dict | None = None) -> list[ReadItem]:
    """The reads of one tensor's ``boxes`` as ``DataStatesLoadPlanner`` plans them (for tools
    and benchmarks that plan without a state dict): the reads of the overlapping chunks
    directly, else (an empty box) DCP's resharding against the overlapping chunks only.
    ``memo``: a dict kept across one rank's tensors, as the planner keeps it (``_reads``)."""
    items, keep = _reads(fqn, tmd, boxes, memo)
    if items is not None:
        return items
    local = [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in boxes]
    return create_read_items_for_chunk_list(fqn, narrow(tmd, boxes, keep), local)


def narrow(tmd: TensorStorageMetadata, boxes: list[tuple[tuple, tuple]],
           keep: list[int] | None = None) -> TensorStorageMetadata:
    """``tmd`` (its chunks a ``ChunkMetadataView``) with only the saved chunks that overlap
    ``boxes`` ((offsets, sizes) pairs), found over the manifest's columns or rules."""
    keep = _entry(tmd).overlapping(boxes) if keep is None else keep
    return TensorStorageMetadata(tmd.properties, tmd.size, [tmd.chunks[i] for i in keep])


def dcps_ways(planner, base: type, names: tuple[str, ...]) -> bool:
    """Whether ``planner`` uses ``base``'s own methods ``names`` (DCP's extension points): its
    class overrides none of them, nor does the object itself."""
    return all(getattr(getattr(planner, name, None), "__func__", None) is getattr(base, name) for name in names)


def _set_in_state_dict(planner: DefaultLoadPlanner, fqn: str, value) -> None:
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def deliver_object(planner, read_item, value) -> bool:
    """Put ``value`` (a decoded value, or an object a provider rebuilt) into the state dict
    being loaded, in place of what is there.  True when done: our planner, or DCP's default
    planner (its state dict and key mappings); False for another planner, which then gets
    ``load_bytes`` (a tensor entry of such a planner keeps the bytes copied into it)."""
    if hasattr(planner, "load_value"):
        planner.load_value(read_item, value)
        return True
    if isinstance(planner, DefaultLoadPlanner):
        _set_in_state_dict(planner, read_item.dest_index.fqn, value)
        return True
    return False
