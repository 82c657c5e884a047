"""The committed metadata of a save, assembled from what its ranks sent the coordinator.

* :func:`manifest_of`: a version 3 manifest from DCP's global metadata and every rank's
  ``ItemRecord`` (``records.py``, ``build.py``).
* :func:`part_of`: format 4, on each rank: its metadata part (a version 3 manifest of its own
  chunks, ``v4/index.py``) and the one packed ``PartRecord`` it sends the coordinator instead of a
  record per item.
* :func:`index_of`: format 4, on the coordinator: the index, from DCP's global metadata, the
  merged sharding rules and one ``PartRecord`` per rank; it grows in tensors + ranks.

Nothing here does I/O: the writer commits the bytes these return.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import compress, count
from operator import attrgetter

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointError
from .build import build_manifest
from .dtypes import dtype_name
from .limits import SMALL_ITEM_BYTES, FormatViolation
from .manifest import encode_index, encode_part
from .model import Chunk, Extent, Manifest
from .names import data_file_stripe, part_file_name
from .records import Gathered, ItemRecord, PartRecord, RankRecord, RareRecord
from .table import tail_offsets
from .v4.chunk_lists import HeldRecord
from .v4.index import HeldColumns, IndexTensor, ListedChunk, index_wire
from .v4.rank_files import GatheredFiles, PartRef
from .v4.rules import RuleTable

# the index's key of the one result a format 4 rank sends (its part record)
PART_INDEX = MetadataIndex("\x00dcp_datastates.part")


def planner_paths(metadata: Metadata) -> dict[str, list]:
    """DCP's flattening paths (key -> path of str and int keys); anything else is left out
    (format 4's rule table among them)."""
    raw = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    paths = {k: v for k, v in raw.items() if isinstance(v, (tuple, list))}
    if {type(k) for k in paths} <= {str} and {type(x) for v in paths.values() for x in v} <= {str, int}:
        return {k: list(v) for k, v in paths.items()}  # the usual case, checked at once
    return {k: list(v) for k, v in paths.items()
            if isinstance(k, str) and all(isinstance(x, (str, int)) for x in v)}


def manifest_of(metadata: Metadata, results: list[list[WriteResult]], save_id: str, *, world: int,
                torch_version: str, writer: str) -> Manifest:
    """The version 3 manifest of a save from DCP's global metadata and every rank's records."""
    shapes = {fqn: (dtype_name(md.properties.dtype), tuple(md.size))
              for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    return build_manifest(
        shapes=shapes, planner_data=planner_paths(metadata), save_id=save_id, world_size=world,
        torch_version=torch_version, writer=writer,
        results=[[(wr.index.fqn, wr.index.offset, wr.storage_data) for wr in rr] for rr in results])


@dataclass(frozen=True)
class PartItem:
    """One item a rank wrote, as its part needs it: ``offsets`` None for a value; ``size`` the
    tensor's global size (None for a value)."""
    fqn: str
    offsets: tuple[int, ...] | None
    record: ItemRecord
    size: tuple[int, ...] | None


@dataclass(frozen=True)
class Part:
    """A rank's metadata part: its file's bytes (head then digest tail) and its record."""
    name: str
    body: bytes
    record: PartRecord


def part_of(items: list[PartItem], rank_record: RankRecord | None, rules: RuleTable, *, rank: int,
            world: int, save_id: str, torch_version: str, writer: str) -> Part:
    """Format 4: rank ``rank``'s records as its metadata part, and the record naming it."""
    files = dict(rank_record.files) if rank_record else {}
    homes = dict(rank_record.homes) if rank_record else {}
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    chunks: list[tuple[str, tuple[int, ...] | None, ItemRecord]] = []
    listed: list[tuple[str, tuple[int, ...], tuple[int, ...], Extent | None]] = []
    for it in items:
        rec = it.record
        if it.offsets is None or it.size is None:  # values go to the index, as build_manifest makes them
            chunks.append((it.fqn, None, rec))
            continue
        shapes[it.fqn] = (rec.dtype, it.size)
        chunks.append((it.fqn, it.offsets, rec))
        if it.fqn not in rules.rules:  # no rule: listed in the index; small plain chunks in full
            small = rec.kind == "tensor" and rec.extent is not None and rec.extent.nbytes <= SMALL_ITEM_BYTES
            listed.append((it.fqn, it.offsets, tuple(rec.sizes), rec.extent if small else None))
    part = build_manifest(shapes=shapes, results=[chunks], planner_data={}, save_id=save_id, world_size=world,
                          torch_version=torch_version, writer=writer)
    part.ranks, part.files, part.homes = [rank], files, homes
    values, part.values = part.values, {}
    owned, shared = part.usage()
    tail_at = tail_offsets(part.tensors)
    held = [HeldRecord.of(fqn, rules.chunk_of(fqn, shapes[fqn][1], offs), rec.extent, tail_at[(fqn, offs)])
            for fqn, offs, rec in chunks
            if offs is not None and rec.kind == "tensor" and rec.extent is not None and rules.replicas(fqn) > 1]
    head, tail = encode_part(part)
    body = head + tail
    name = part_file_name(rank, save_id)
    stripes = {f: data_file_stripe(f, rank, save_id) for f in files}
    own = [(s, files[f], f) for f, s in stripes.items() if s is not None]
    rare = RareRecord({f: size for f, size in files.items() if stripes[f] is None}, homes, listed, values, shared)
    ref = PartRef(rank, name, len(body), len(head))
    return Part(name, body, PartRecord.of(rank, save_id, ref, owned, own, held, rare))


def index_of(metadata: Metadata, results: list[list[WriteResult]], save_id: str, rules: RuleTable,
             path: str | None, *, world: int = 1, torch_version: str = "", writer: str = "") -> tuple[Manifest, bytes]:
    """Format 4: the index of a save and its bytes (``world``: at least the ranks that sent a
    record)."""
    tensors = [IndexTensor(fqn, dtype_name(md.properties.dtype), tuple(md.size), rules.rules.get(fqn))
               for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)]
    at = {t.fqn: i for i, t in enumerate(tensors)}
    records = [wr.storage_data for rr in results for wr in rr]  # one per rank
    if not all(map(PartRecord.__instancecheck__, records)):
        raise CheckpointError("a rank wrote no metadata part although the save planner gave "
                              "sharding rules (are all ranks using DataStatesSavePlanner?)", checkpoint=path)
    try:  # every rank's packed rows at once (16,384 at scale); the few ranks with more, one by one
        g = Gathered.of(records, save_id)
    except FormatViolation as e:
        raise CheckpointError(f"the ranks' records do not make an index: {e}", checkpoint=path) from None
    which = list(compress(count(), map(attrgetter("rare"), records)))  # the few ranks with more
    rare = [records[i].rare for i in which]
    named: dict[str, int] = {}
    homes: dict[str, str] = {}
    values: dict = {}
    listed: list[ListedChunk] = []
    shared: dict[str, int] = {}
    seen: set[tuple] = set()
    named_held: list[HeldRecord] = []
    for rank, rec in zip(g.ranks[which].tolist(), rare):
        for home, n in rec.shared.items():
            shared[home] = shared.get(home, 0) + n
        named.update(rec.files)  # files not named by rank (another save's), by name
        homes.update(rec.homes)
        values.update(rec.values)
        named_held += rec.held
        for fqn, offs, sizes, ext in rec.listed:
            if (fqn, offs) not in seen:  # a replicated item written by several ranks: keep one
                seen.add((fqn, offs))
                listed.append(ListedChunk(at[fqn], offs, sizes, rank,
                                              None if ext is None else Chunk(offs, sizes, ext)))
    files = GatheredFiles(named, g.files)
    ranks = g.ranks.tolist()
    ranks.sort()  # DCP gathers by rank: already in order, so the sort is cheap
    world = max(world, ranks[-1] + 1 if ranks else 1)
    m = Manifest(save_id=save_id, world_size=world, ranks=ranks, files=files,
                 tensors={}, values=values, planner_data=planner_paths(metadata), homes=homes, version=4,
                 created_unix=time.time(), torch_version=torch_version, writer=writer)
    try:
        fidx = files.positions_near(g.rows_of(which))  # the rows of the ranks with inline or named records
        held = HeldColumns.join(g.held(at, len(named)), HeldColumns.of(named_held, at, fidx))
        wire = index_wire(list(rules.meshes), tensors, listed, files, g.files, (g.owned, shared), held, fidx)
    except FormatViolation as e:
        raise CheckpointError(f"the ranks' records do not make an index: {e}", checkpoint=path) from None
    return m, encode_index(m, wire)
