"""Placement: a rank's DCP write items as providers' byte regions in its data files, and the
typed records of what the engine wrote.

``lay_out`` turns each ``WriteItem`` into a provider (a plain tensor, a registered type, or a
value stored in the manifest), places the providers' regions in the rank's stripe files
(``format.layout``) and makes the engine's copy items; ``results_of`` turns the placed items,
once written, into DCP's ``WriteResult`` records (``format.records``).
"""

from __future__ import annotations

import dataclasses
import io

import xxhash
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import find_state_dict_object

from ..engine import CopyItem
from ..engine.live import watch_of
from ..errors import ProviderError, UnsupportedValueError
from ..format import dtype_name
from ..format.checksum import Digests
from ..format.codec import MIN_BYTES, codec_for
from ..format.layout import place_regions, stripe_count
from ..format.model import Extent, Seg, ValueEntry
from ..format.names import data_file_name, packed_file_name
from ..format.records import ItemRecord, RankRecord
from ..gcpause import paused_gc
from ..planner import PLAIN_TENSORS, dcps_ways
from ..providers import ObjectProvider, TensorRegion, provider_for, type_provider_for
from ..tiers.incremental import Base


def original_object(planner: SavePlanner, item: WriteItem) -> tuple[object, bool]:
    """The unserialized object behind a BYTE_IO item, when the planner exposes it (DCP's
    default planner and ours do); ``(None, False)`` otherwise."""
    sd = getattr(planner, "state_dict", None)
    if isinstance(sd, dict):
        try:
            return find_state_dict_object(sd, item.index), True
        except (ValueError, KeyError):
            pass
    return None, False


def value_entry(planner: SavePlanner, item: WriteItem, *, allow_pickle: bool, checkpoint: str) -> ValueEntry:
    """A non-tensor value as the manifest stores it: msgpack, or pickle by opt-in."""
    fqn = item.index.fqn
    obj, found = original_object(planner, item)
    if found:
        enc, data, csum = ObjectProvider(obj).encode(key=fqn, checkpoint=checkpoint, allow_pickle=allow_pickle)
        return ValueEntry(enc, data, csum)
    # A planner that hides the original object: only torch.save bytes are available.
    if not allow_pickle:
        raise UnsupportedValueError(
            "this planner only exposes the value as torch.save bytes (a pickle); use "
            "DCP's DefaultSavePlanner or ours, or pass allow_pickle=True", checkpoint=checkpoint, key=fqn)
    buf = planner.resolve_data(item)
    if not isinstance(buf, io.BytesIO):
        raise UnsupportedValueError("the planner resolved a value to a tensor", checkpoint=checkpoint, key=fqn)
    data = buf.getvalue()
    return ValueEntry("torch", data, xxhash.xxh3_64_intdigest(data))


@dataclasses.dataclass(slots=True)
class Placed:
    """One item of ``write_data`` on its way to a record: its copy items, by part path."""
    item: WriteItem
    kind: str  # "tensor" | "provider" | "provider-value" | "value"
    # (part path, dtype, shape, copy item): dtype and shape are read while the source is live
    parts: list[tuple[str, str, tuple, CopyItem]] = dataclasses.field(default_factory=list)
    provider: str | None = None
    meta: object = None
    tree: dict | None = None
    value: ValueEntry | None = None


def lay_out(plan: SavePlan, planner: SavePlanner, *, rank: int, save_id: str, thread_count: int,
            base: Base | None, started: dict | None, allow_pickle: bool, checkpoint: str,
            compression: str | None = None):
    """DCP items -> providers -> regions placed in the rank's stripes, as the engine's copy
    items.  ``started``: version counters read when a lazy save started.  ``compression``:
    regions of at least ``codec.MIN_BYTES`` go, block by block compressed, to the packed file
    beside their stripe.  Returns the placed items, the copy items and the names of the rank's
    data files (the raw stripes, then the packed ones where any region is compressed)."""
    placed: list[Placed] = []
    regions = []  # (placed index, region)
    plain = _plain_tensors(planner)
    for item in plan.items:
        obj = plain(item) if plain is not None else None
        if obj is not None:  # most items: a plain tensor, its own provider's one region
            placed.append(Placed(item, "tensor"))
            regions.append((len(placed) - 1, TensorRegion("", obj)))
            continue
        try:
            obj, found = (original_object(planner, item) if item.type == WriteItemType.BYTE_IO
                          else (planner.resolve_data(item), True))
            if item.type == WriteItemType.BYTE_IO and not (found and type_provider_for(obj)):
                placed.append(Placed(item, "value", value=value_entry(
                    planner, item, allow_pickle=allow_pickle, checkpoint=checkpoint)))
                continue
            prov = provider_for(obj)
        except ProviderError as e:
            raise ProviderError(str(e), checkpoint=checkpoint, key=item.index.fqn) from e.__cause__
        p = Placed(item, "tensor" if prov.name == "tensor" else
                   ("provider-value" if item.type == WriteItemType.BYTE_IO else "provider"))
        if p.kind != "tensor":
            p.provider, p.meta, p.tree = prov.name, prov.meta(), prov.tree()
        placed.append(p)
        regions += [(len(placed) - 1, r) for r in prov.regions()]
    sizes = [r.nbytes for _, r in regions]
    n_raw = stripe_count(sum(sizes), thread_count)
    names = [data_file_name(rank, save_id, k) for k in range(n_raw)]
    where = place_regions(sizes, len(names))
    packs = compression is not None and any(n >= MIN_BYTES for n in sizes)
    if packs:
        names += [packed_file_name(rank, save_id, k) for k in range(n_raw)]
    copy_items = []
    for (i, r), at, nbytes in zip(regions, where, sizes):
        item = placed[i].item
        codec = codec_for(r.source.dtype) if packs and nbytes >= MIN_BYTES else 0
        ci = CopyItem(f"{item.index.fqn}/{r.name}" if r.name else item.index.fqn, r.source, at.offset, nbytes,
                      at.stripe + (n_raw if codec else 0), codec=codec)
        if base is not None:
            ci.base = base.extents(item.index.fqn, tuple(item.index.offset or ())).get(r.name or "")
            ci.base_files = base.here
        if started is not None:
            ci.watch = watch_of(started, r.source)
        copy_items.append(ci)
        try:
            dt = dtype_name(r.source.dtype)
        except ValueError as e:  # nothing is written yet: the save fails here, naming the tensor
            raise UnsupportedValueError(str(e), checkpoint=checkpoint, key=item.index.fqn) from None
        placed[i].parts.append((r.name, dt, tuple(r.source.shape), ci))
    return placed, copy_items, names


def _plain_tensors(planner: SavePlanner):
    """For a planner that finds objects as DCP's default planner does: a function giving a
    TENSOR item's object when it is a plain tensor saved whole with no registered provider (what
    ``resolve_data`` and ``provider_for`` would give), else None (the item takes their way)."""
    sd = getattr(planner, "state_dict", None)
    if not isinstance(sd, dict) or not dcps_ways(planner, DefaultSavePlanner,
                                                  ("resolve_data", "lookup_object", "transform_object")):
        return None
    tensor, registered = WriteItemType.TENSOR, type_provider_for

    def plain(item: WriteItem):
        if item.type != tensor:
            return None
        obj = sd.get(item.index.fqn)
        if type(obj) not in PLAIN_TENSORS or any(item.index.offset or ()) or registered(obj) is not None:
            return None
        return obj
    return plain


def records_for(placed: list[Placed], names: list[str], sizes: list[int], base: Base | None):
    """Typed records of the placed items, once the engine wrote them: each copy item's extent
    (its new segments in this save's files, its reused ones in the base's), the base files
    referenced (with their homes), and the files written with their sizes."""
    refs: dict[str, str] = {}
    written = {n: sz for n, sz in zip(names, sizes) if sz > 0}

    def extent(ci: CopyItem) -> Extent:
        if len(ci.placed) == 1 and type(ci.placed[0][1]) is int:  # most: one segment, this save's
            _pos, f, off, n = ci.placed[0]
            return Extent([Seg(names[f], off, n)], ci.nbytes, Digests(ci.sums[0] if len(ci.sums) == 1
                                                                      else b"".join(ci.sums)))
        segs = []
        for f, off, n in ci.segments():
            if isinstance(f, str):  # a base file: referenced, not written
                assert base is not None, "only an incremental save reuses a base's bytes"
                refs[f] = base.homes[f]
            else:
                assert isinstance(f, int), "a sink's index"
                f = names[f]
            segs.append(Seg(f, off, n))
        # one string per chunk, not an object per 1 MiB block: DCP pickles the records to
        # the coordinator, which joins them into the manifest
        return Extent(segs, ci.nbytes, Digests(b"".join(ci.sums)))
    records = []
    for p in placed:
        if p.kind == "value":
            records.append(ItemRecord("value", value=p.value))
            continue
        td = p.item.tensor_data
        dtype = dtype_name(td.properties.dtype) if td is not None else ""
        sizes_ = tuple(td.chunk.sizes) if td is not None else ()
        if p.kind == "tensor":
            records.append(ItemRecord("tensor", dtype, sizes_, extent(p.parts[0][3])))
            continue
        parts = {name: (dt, shape, extent(ci)) for name, dt, shape, ci in p.parts}
        records.append(ItemRecord(p.kind, dtype, sizes_, None, p.provider, p.meta, parts, p.tree))
    return records, refs, written


@dataclasses.dataclass(frozen=True)
class Written:
    """What one rank's ``write_data`` produced: DCP's results, the base files it references
    (``{file: (home, size)}``) and its byte counts."""
    results: list[WriteResult]
    refs: dict[str, tuple[str, int]]
    stats: dict[str, int]


def results_of(placed: list[Placed], names: list[str], sizes: list[int], base: Base | None,
               rank: int, timings: dict | None) -> Written:
    """DCP's ``WriteResult``s of one rank (typed records; the first carries the rank's files),
    the base files it references and the save's byte counts."""
    with paused_gc():  # a few records per item, none cyclic
        records, refs, written = records_for(placed, names, sizes, base)
        base_files = base.manifest.files if base is not None else {}
        out = [WriteResult(index=p.item.index, size_in_bytes=_item_bytes(p), storage_data=rec)
               for p, rec in zip(placed, records)]
    if out:
        out[0].storage_data.rank = RankRecord(rank, {**written, **{f: base_files[f] for f in refs}},
                                              refs, dict(timings or {}))
    stats = {"bytes_written": sum(written.values()), "files_written": len(written),
             "bytes_reused": sum(x[3].reused_bytes for p in placed for x in p.parts) if base is not None else 0,
             "files_referenced": len(refs)}
    return Written(out, {f: (home, base_files[f]) for f, home in refs.items()}, stats)


def _item_bytes(p: Placed) -> int:
    parts = p.parts
    if len(parts) == 1:  # most items: one region
        return parts[0][3].nbytes
    if parts:
        return sum(x[3].nbytes for x in parts)
    return len(p.value.data) if p.value is not None else 0
