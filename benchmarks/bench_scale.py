"""Checkpoint metadata at scale, by simulation: N ranks without N processes.

    python benchmarks/bench_scale.py [--ranks 8,64,512,2048,16384] [--layouts fsdp,hsdp,tp_fsdp]
                                     [--max-chunks 2500000] [--dir /tmp/dcpds-scale] [--json FILE]

A Llama-3-70B-shaped state with Adam (``scale_model.py``: 2,892 tensors) is laid out over N
ranks (FSDP, HSDP, TP x FSDP).  For each layout, N and system, one fresh process:

1. builds what every rank would hand the coordinator after writing its data (the simulation's
   own work, not timed).  dcp-datastates (format 4): the rule table ``DataStatesSavePlanner``
   merges into the global metadata, and one ``PartRecord`` per rank; the metadata parts of the
   ranks the measured loads need are written for real (the others are never read).  DCP: the
   ``WriteResult``s of ``FileSystemWriter`` and the global ``Metadata`` its planner builds;
2. **commit** (timed, with the peak RSS of the process): the coordinator's real code.  Ours:
   the index built and committed (``format.assemble.index_of``, ``StorageTier.commit_bytes``).  DCP:
   ``FileSystemWriter.finish`` (its storage metadata, the pickle, the rename).  The best of 3
   where the first took under a second (both systems; ``commit_first_s``: the first alone);
3. **ready to load** (timed, with the metadata bytes read): one rank's ``read_metadata`` through
   the public reader, the load planning of that rank's boxes (DCP's resharding algorithm,
   ``create_read_items_for_chunk_list``), and finding where each planned item's bytes are
   (ours: its chunk record, from the parts it needs; DCP: its storage data), at the same world
   size and resharded to N/2.  For dcp-datastates also as DCP's ``DefaultLoadPlanner`` plans
   (a sweep over every chunk), up to 512 ranks.  The best of 3 where the first took under a
   second, as for the commit.

DCP runs, and ours for TP x FSDP (whose strided boxes are listed, not ruled), whose chunk count
exceeds ``--max-chunks`` are skipped (the simulation would not fit this machine), and reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale_model as sm  # noqa: E402

from dcp_datastates import DataStatesReader  # noqa: E402
from dcp_datastates.format import MANIFEST_NAME  # noqa: E402
from dcp_datastates.format.checksum import BLOCK_SIZE, DIGEST_BYTES, Digests  # noqa: E402
from dcp_datastates.format.dtypes import dtype_name  # noqa: E402
from dcp_datastates.format.model import Extent, Seg  # noqa: E402
from dcp_datastates.format.manifest import encode_part  # noqa: E402
from dcp_datastates.format.model import ChunkMetadataView  # noqa: E402
from dcp_datastates.gcpause import paused_gc  # noqa: E402
from dcp_datastates.planner import plan_reads  # noqa: E402
from dcp_datastates.format.names import data_file_name  # noqa: E402
from dcp_datastates.format.records import ItemRecord  # noqa: E402
from dcp_datastates.tiers import StorageTier  # noqa: E402
from dcp_datastates.format.build import build_manifest  # noqa: E402
from dcp_datastates.format.table import tail_offsets  # noqa: E402
from dcp_datastates.format.v4.chunk_lists import HeldRecord  # noqa: E402
from dcp_datastates.format.v4.rank_files import PartRef  # noqa: E402
from dcp_datastates.format.names import part_file_name  # noqa: E402
from dcp_datastates.format.records import PartRecord, RareRecord  # noqa: E402
from dcp_datastates.format.v4.rules import Geometry, Mesh, RuleTable, ShardRule, salt  # noqa: E402
from dcp_datastates.planner import RULES_KEY  # noqa: E402
from dcp_datastates.format.assemble import PART_INDEX  # noqa: E402
from dcp_datastates.format.assemble import index_of as _index_for  # noqa: E402

SAVE_ID = "0123456789ab"


def _pieces(size: int, parts: int) -> int:
    """Non-empty pieces of a dimension of ``size`` split in ``parts`` as torch.chunk does."""
    return -(-size // -(-size // parts)) if size else 0


def chunk_count(layout: str, n: int, ts) -> int:
    """Chunks written for a layout (non-empty boxes, each once), counted without listing them."""
    total = 0
    for t in ts:
        if not t.shape:
            total += 1
        elif layout == "fsdp":
            total += _pieces(t.shape[0], n)
        elif layout == "hsdp":
            total += _pieces(t.shape[0], min(8, n))
        elif t.kind == sm.COL:
            total += sum(_pieces(sm._split(0, t.shape[0], 8, k)[1], max(1, n // 8)) for k in range(8))
        elif t.kind == sm.ROW:
            total += _pieces(t.shape[0], max(1, n // 8)) * _pieces(t.shape[1], 8)
        else:
            total += _pieces(t.shape[0], max(1, n // 8))
    return total


def _global_metadata(ts, per_rank) -> Metadata:
    chunks: dict[int, list] = {}
    for rows in per_rank:
        for ti, offs, sizes in rows:
            chunks.setdefault(ti, []).append(ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)))
    sdm = {t.fqn: TensorStorageMetadata(TensorProperties(dtype=t.dtype), torch.Size(t.shape), chunks.get(ti, []))
           for ti, t in enumerate(ts)}
    return Metadata(state_dict_metadata=sdm, planner_data={t.fqn: tuple(t.fqn.split(".")) for t in ts})


def _dcp_results(ts, per_rank) -> list[list[WriteResult]]:
    out = []
    for rank, rows in enumerate(per_rank):
        pos, res = 0, []
        for ti, offs, sizes in rows:
            t = ts[ti]
            n = max(1, int(torch.Size(sizes).numel())) * t.dtype.itemsize + 1100  # torch.save framing
            res.append(WriteResult(index=MetadataIndex(t.fqn, torch.Size(offs)), size_in_bytes=n,
                                   storage_data=_StorageInfo(f"__{rank}_0.distcp", pos, n)))
            pos += n
        out.append(res)
    return out


# ------------------------------------------------------------------ format 4 (ours)

def _rules(ts, layout: str, n: int) -> tuple[RuleTable, list]:
    """The rule table ``DataStatesSavePlanner`` merges for this layout, and per tensor its
    geometry (None: no rule; the chunks are listed, as for TP's strided splits of dim 0)."""
    mesh = Mesh.of((n,), range(n)) if layout == "fsdp" else Mesh.of((max(1, n // 8), min(8, n)), range(n))
    rules, geoms = {}, []
    for t in ts:
        dims = None
        if t.shape and layout == "fsdp":
            dims = (0,)
        elif t.shape and layout == "hsdp":
            dims = (-1, 0)
        elif t.shape and t.kind == sm.ROW:
            dims = (0, 1)
        elif t.shape and t.kind == sm.NORM:
            dims = (0, -1)
        if dims is not None:
            rules[t.fqn] = ShardRule(0, dims)
        geoms.append(None if dims is None else Geometry(tuple(t.shape), mesh, rules[t.fqn], salt(t.fqn),
                                                        t.dtype.itemsize))
    return RuleTable.of([mesh], rules), geoms


def _explicit_writes(ts, geoms, layout: str, n: int, rank: int) -> list[tuple[int, tuple, tuple]]:
    """Chunks without a rule that ``rank`` writes: small plain tensors (the Adam steps) go to
    the lowest rank holding them (``DataStatesSavePlanner``'s dedup), TP's strided boxes to their holder."""
    out = [(ti, (), ()) for ti, t in enumerate(ts) if not t.shape and rank == 0]
    return out + [(ti, o, z) for ti, t in enumerate(ts) if t.shape and geoms[ti] is None
                  for o, z in sm.boxes(t, ti, layout, n, rank)]


def _ours_writes(ts, geoms, layout: str, n: int, rank: int) -> list[tuple[int, tuple, tuple]]:
    """Every chunk ``rank`` writes under the rules (replicated boxes: the replica the rule names)."""
    out = _explicit_writes(ts, geoms, layout, n, rank)
    for ti, g in enumerate(geoms):
        if g is None:
            continue
        coord = tuple(divmod(rank, g.mesh.shape[1])) if len(g.mesh.shape) == 2 else (rank,)
        i = g.chunk_of(coord)
        if g.writer(i) == coord:
            out.append((ti, *g.box(i)))
    return out


def _needed(ts, geoms, explicit: dict, layout: str, world: int, rank: int) -> set[int]:
    """Ranks whose parts hold a chunk overlapping what ``rank`` of ``world`` loads."""
    need = set()
    for ti, t in enumerate(ts):
        boxes = sm.boxes(t, ti, layout, world, rank)
        g = geoms[ti]
        if g is not None and g.replicas() > 1:  # replicated boxes: their records are in the index
            continue
        if g is not None:
            need.update(g.owner(i) for i in g.overlapping(boxes))
        else:
            need.update(r for o, z, r in explicit.get(ti, ()) if not z or any(
                all(a < bo + bz and bo < a + b for a, b, bo, bz in zip(o, z, *bx)) for bx in boxes))
    return need


def _held_writes(geoms) -> dict[int, list[tuple[int, tuple, tuple]]]:
    """The replicated boxes (tensor, offsets, sizes) by the rank that writes each."""
    out: dict[int, list] = {}
    for ti, g in enumerate(geoms):
        if g is not None and g.replicas() > 1:
            for i in range(g.count()):
                out.setdefault(g.owner(i), []).append((ti, *g.box(i)))
    return out


def _part(ts, rows, rank: int, n: int) -> tuple[bytes, bytes, dict, dict, dict]:
    """Rank ``rank``'s metadata part (head and tail), as ``DataStatesWriter`` commits it; its
    files; each chunk's extent by (tensor index, offsets); and where its digests start in the tail."""
    name = data_file_name(rank, SAVE_ID, 0)
    pos, recs, shapes, exts = 0, [], {}, {}
    for ti, offs, sizes in rows:
        t = ts[ti]
        nb = (int(torch.Size(sizes).numel()) if sizes else 1) * t.dtype.itemsize
        # random digests, as real ones are: the packed head must not compress them away
        ext = Extent([Seg(name, pos, nb)] if nb else [], nb, Digests(os.urandom(DIGEST_BYTES * max(1, -(-nb // BLOCK_SIZE)))))
        pos += nb
        shapes[t.fqn] = (dtype_name(t.dtype), tuple(t.shape))
        exts[(ti, tuple(offs))] = ext
        recs.append((t.fqn, tuple(offs), ItemRecord("tensor", dtype_name(t.dtype), tuple(sizes), ext)))
    m = build_manifest(shapes=shapes, results=[recs], planner_data={}, save_id=SAVE_ID, world_size=n,
                       torch_version="", writer="bench")
    m.ranks, m.files = [rank], ({name: pos} if pos else {})
    head, tail = encode_part(m)
    offsets = tail_offsets(m.tensors)
    at = {(ti, o): offsets[(ts[ti].fqn, o)] for ti, o in exts}
    return head, tail, m.files, exts, at


def _v4_inputs(ts, layout: str, n: int, path: str, measured: list[tuple[int, int]]):
    """Global metadata (dtypes and sizes: all the index takes from it) and one part record per
    rank; the parts of the ranks that the measured loads need are written for real."""
    table, geoms = _rules(ts, layout, n)
    explicit: dict[int, list] = {}
    rows_of = {}
    for r in range(n):
        rows_of[r] = _explicit_writes(ts, geoms, layout, n, r) if (r == 0 or layout == "tp_fsdp") else []
        for ti, o, z in rows_of[r]:
            if ts[ti].shape:  # small plain chunks (the steps) are in the index itself
                explicit.setdefault(ti, []).append((o, z, r))
    need = {0}  # rank 0 wrote the steps: its part gives their extents, inlined in the index
    for world, rank in measured:
        need |= _needed(ts, geoms, explicit, layout, world, rank)
    held_of = _held_writes(geoms)
    results, per = [], max(1, sum(math.prod(t.shape) * t.dtype.itemsize for t in ts) // n)
    for r in range(n):
        pname = part_file_name(r, SAVE_ID)
        exts, held = {}, ()
        if r in need or r in held_of:  # a part the loads read, or whose held records the index takes
            rows = _ours_writes(ts, geoms, layout, n, r) if r in need else held_of[r] + rows_of[r]
            head, tail, files, exts, tail_at = _part(ts, rows, r, n)
            if r in need:
                with open(os.path.join(path, pname), "wb") as f:
                    f.write(head + tail)
            ref = PartRef(r, pname, len(head) + len(tail), len(head))
            held = tuple(HeldRecord.of(ts[ti].fqn, geoms[ti].index_of(tuple(o)), exts[(ti, tuple(o))],
                                       tail_at[(ti, tuple(o))])
                         for ti, o, z in rows if geoms[ti] is not None and geoms[ti].replicas() > 1)
        else:  # never read by the measured loads (sizes of a part with 1,000 records)
            files = {data_file_name(r, SAVE_ID, 0): per}
            ref = PartRef(r, pname, 36000, 20000)
        listed = [(ts[ti].fqn, tuple(o), tuple(z), None if ts[ti].shape else exts[(ti, tuple(o))])
                  for ti, o, z in rows_of[r]]
        results.append([WriteResult(index=PART_INDEX, size_in_bytes=ref.size,
                                    storage_data=PartRecord.of(
                                        r, SAVE_ID, ref, sum(files.values()), [(0, size, f) for f, size in files.items()],
                                        list(held), RareRecord(listed=listed)))])
    sdm = {t.fqn: TensorStorageMetadata(TensorProperties(dtype=t.dtype), torch.Size(t.shape), []) for t in ts}
    md = Metadata(state_dict_metadata=sdm, planner_data={RULES_KEY: table, **{t.fqn: t.fqn.split(".") for t in ts}})
    return md, results


def _plan_one_rank(md: Metadata, ts, layout: str, n: int, rank: int, narrow: bool) -> list:
    """The resharding planning of the boxes ``rank`` of ``n`` holds; returns read items.
    ``narrow``: as ``DataStatesLoadPlanner`` does, each tensor's metadata is first narrowed to
    the chunks that overlap the rank's boxes (found over the manifest's columns); otherwise
    DCP's ``DefaultLoadPlanner`` sweeps every chunk."""
    items, memo = [], {}
    for ti, t in enumerate(ts):
        boxes = sm.boxes(t, ti, layout, n, rank)
        tmd = md.state_dict_metadata[t.fqn]
        if narrow and isinstance(tmd.chunks, ChunkMetadataView):  # as DataStatesLoadPlanner plans
            items += plan_reads(t.fqn, tmd, [(tuple(o), tuple(s)) for o, s in boxes], memo)
            continue
        local = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        items += create_read_items_for_chunk_list(t.fqn, tmd, local)
    return items


def _resolve(reader, meta: Metadata, items: list) -> None:
    """Find where each read item's bytes are, as ``read_data`` does first (ours: the chunk's
    record, from a part; DCP: its storage data)."""
    if isinstance(reader, DataStatesReader):  # as LoadPipeline.make_task finds them
        m = reader.manifest
        for it in items:
            si = it.storage_index
            if m.tensors[si.fqn].record_at(si.index, tuple(si.offset)) is None:
                raise RuntimeError(f"no record for {it.storage_index}")
    else:
        sd = meta.storage_data
        for it in items:
            sd[it.storage_index]


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _commit(system: str, md: Metadata, results: list, path: str) -> float:
    """Seconds for the coordinator to build and commit the checkpoint's metadata."""
    t0 = time.perf_counter()
    if system == "ours":  # as DataStatesWriter.finish does it
        with paused_gc():
            manifest, body = _index_for(md, results, SAVE_ID, md.planner_data[RULES_KEY], path)
        StorageTier(path).commit_bytes(MANIFEST_NAME, body)
        del manifest, body
    else:
        w = FileSystemWriter(path)
        w.set_up_storage_writer(True)
        w.finish(md, results)
    return time.perf_counter() - t0


def _ready(system: str, path: str, ts, layout: str, world: int, rank: int, narrow: bool,
           meta_bytes: int) -> dict:
    """One rank of ``world`` ready to load: the best of 3 where the first took under a second,
    as for the commit (the collector and the machine add noise to short runs; a run of many
    seconds is its own average)."""
    best = None
    for attempt in range(3):
        if attempt and best[3] - best[0] >= 1.0:
            break
        t0 = time.perf_counter()
        reader = DataStatesReader(path) if system == "ours" else FileSystemReader(path)
        meta = reader.read_metadata()
        t1 = time.perf_counter()
        if system == "ours":  # as DataStatesLoadPlanner and DataStatesReader.read_data do
            with paused_gc():
                items = _plan_one_rank(meta, ts, layout, world, rank, narrow)
                t2 = time.perf_counter()
                _resolve(reader, meta, items)
        else:
            items = _plan_one_rank(meta, ts, layout, world, rank, narrow)
            t2 = time.perf_counter()
            _resolve(reader, meta, items)
        t3 = time.perf_counter()
        if best is None or t3 - t0 < best[3] - best[0]:
            best = (t0, t1, t2, t3)
    t0, t1, t2, t3 = best
    parts = getattr(reader.manifest, "index", None) if system == "ours" else None
    return {"ready_{}_s": round(t3 - t0, 3), "read_metadata_{}_s": round(t1 - t0, 3),
            "plan_{}_s": round(t2 - t1, 3), "resolve_{}_s": round(t3 - t2, 3), "read_items_{}": len(items),
            "bytes_read_{}": meta_bytes + (sum(parts.parts[r].head for r in parts._loaded) if parts else 0),
            # the digests of the parts read: not read to be ready, but with the data they check
            "digest_bytes_{}": sum(parts.parts[r].size - parts.parts[r].head for r in parts._loaded) if parts else 0,
            "parts_read_{}": len(parts._loaded) if parts else 0}


def one(system: str, layout: str, n: int, root: str) -> dict:
    ts = sm.tensors()
    path = os.path.join(root, f"{system}-{layout}-{n}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    measured = [(n, n // 2), (max(1, n // 2), max(1, n // 2) // 2)]  # a rank from the middle
    t0 = time.perf_counter()
    if system == "ours":
        md, results = _v4_inputs(ts, layout, n, path, measured)
    else:
        per_rank = [sm.written_by(layout, n, r, ts) for r in range(n)]
        md = _global_metadata(ts, per_rank)
        results = _dcp_results(ts, per_rank)
        del per_rank
    sim_s = time.perf_counter() - t0
    rss0 = _rss_peak()
    commits = [_commit(system, md, results, path)]
    commit_rss = max(0, _rss_peak() - rss0)  # of the first commit
    while len(commits) < 3 and commits[0] < 1.0:  # best of 3 where cheap, as for ready (noise)
        commits.append(_commit(system, md, results, path))
    commit_s = min(commits)
    meta_bytes = os.path.getsize(os.path.join(path, MANIFEST_NAME))
    del md, results
    out = {"system": system, "layout": layout, "ranks": n, "simulate_s": round(sim_s, 2),
           "commit_s": round(commit_s, 3), "commit_first_s": round(commits[0], 3),
           "commit_rss_growth": commit_rss, "metadata_bytes": meta_bytes}
    # warm-up, not timed: the first read of a process pays imports and caches, for both systems
    (DataStatesReader(path) if system == "ours" else FileSystemReader(path)).read_metadata()
    # DCP's own planner over our metadata sweeps every chunk: run where it fits the time, and
    # after both of our planner's runs (its sweep leaves a million objects' churn in the heap)
    variants = (True, False) if system == "ours" and n <= 512 else (system == "ours",)
    for narrow in variants:
        for label, (world, rank) in zip(("same", "half"), measured):
            tag = label if narrow or system == "dcp" else f"{label}_dcp_planner"
            got = _ready(system, path, ts, layout, world, rank, narrow, meta_bytes)
            out.update({k.format(tag): v for k, v in got.items()})
    shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="8,64,512,2048,16384")
    ap.add_argument("--layouts", default="fsdp,hsdp,tp_fsdp")
    ap.add_argument("--systems", default="ours,dcp")
    ap.add_argument("--max-chunks", type=float, default=2.5e6)
    ap.add_argument("--dir", default="/tmp/dcpds-scale")
    ap.add_argument("--json", default=None, help="write every row to this file")
    ap.add_argument("--one", nargs=3, metavar=("SYSTEM", "LAYOUT", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], int(args.one[2]), args.dir)))
        return
    ts = sm.tensors()
    rows = []
    start = time.perf_counter()
    for layout in args.layouts.split(","):
        for n in [int(x) for x in args.ranks.split(",")]:
            chunks = chunk_count(layout, n, ts)
            for system in args.systems.split(","):
                # ours: the index grows in tensors + ranks, but TP's strided boxes are listed
                if chunks > args.max_chunks and (system == "dcp" or layout == "tp_fsdp"):
                    row = {"system": system, "layout": layout, "ranks": n, "chunks": chunks, "skipped":
                           f"{chunks:,} chunks > --max-chunks"}
                else:
                    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--dir", args.dir,
                                        "--one", system, layout, str(n)], capture_output=True, text=True)
                    if r.returncode != 0:
                        row = {"system": system, "layout": layout, "ranks": n, "chunks": chunks,
                               "failed": r.stderr.strip().splitlines()[-1:]}
                    else:
                        row = dict(json.loads(r.stdout.strip().splitlines()[-1]), chunks=chunks)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    _table(rows)


def _table(rows: list[dict]) -> None:
    print(f"\n{'layout':8} {'ranks':>6} {'chunks':>10} {'system':6} {'commit s':>9} {'commit RSS MB':>13} "
          f"{'meta MB':>8} {'read MB':>8} {'parts':>5} {'ready s':>8} {'ready/2 s':>9} {'ready, DCP planner s':>20}")
    for r in rows:
        if "commit_s" not in r:
            print(f"{r['layout']:8} {r['ranks']:>6} {r['chunks']:>10,} {r['system']:6} "
                  f"{r.get('skipped') or r.get('failed')}")
            continue
        print(f"{r['layout']:8} {r['ranks']:>6} {r['chunks']:>10,} {r['system']:6} {r['commit_s']:>9.3f} "
              f"{r['commit_rss_growth'] / 1e6:>13.0f} {r['metadata_bytes'] / 1e6:>8.1f} "
              f"{r['bytes_read_same'] / 1e6:>8.2f} {r.get('parts_read_same', 0):>5} "
              f"{r['ready_same_s']:>8.3f} {r['ready_half_s']:>9.3f} "
              f"{r.get('ready_same_dcp_planner_s', float('nan')):>20.3f}")


if __name__ == "__main__":
    main()
