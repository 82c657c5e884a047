"""Checkpoint metadata at scale, by simulation: N ranks without N processes.

    python benchmarks/bench_scale.py [--ranks 8,64,512,2048,16384] [--layouts fsdp,hsdp,tp_fsdp]
                                     [--max-chunks 6000000] [--dir /tmp/dcpds-scale] [--out DIR]

A Llama-3-70B-shaped state with Adam (``scale_model.py``: 2,892 tensors) is laid out over N
ranks (FSDP, HSDP, TP x FSDP).  For each layout, N and system, one fresh process:

1. builds what every rank would hand the coordinator after writing its data (the simulation's
   own work, not timed): for dcp-datastates the typed records of ``format/records.py`` as its
   writer returns them, for DCP the ``WriteResult``s of ``FileSystemWriter`` and the global
   ``Metadata`` its planner builds;
2. **commit** (timed, with the peak RSS of the process): the coordinator's real code.  Ours:
   the manifest built from the records, encoded and committed (``writer._manifest_for``,
   ``encode_manifest``, ``StorageTier.commit_bytes``).  DCP: ``FileSystemWriter.finish``
   (its storage metadata, the pickle, the rename);
3. **ready to load** (timed, with the metadata bytes read): one rank's ``read_metadata`` through
   the public reader, then the load planning of that rank's boxes (DCP's resharding algorithm,
   ``create_read_items_for_chunk_list``), at the same world size and resharded to N/2.  For
   dcp-datastates twice: as ``DataStatesLoadPlanner`` plans (each tensor's metadata narrowed
   first to the chunks overlapping the rank's boxes, found over the manifest's columns), and
   as DCP's ``DefaultLoadPlanner`` does (a sweep over every chunk).

Runs whose chunk count exceeds ``--max-chunks`` are skipped (the simulation itself would not
fit this machine's memory), and reported as such.
"""

from __future__ import annotations

import argparse
import json
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
from dcp_datastates.format.manifest import Extent, Seg, encode_manifest  # noqa: E402
from dcp_datastates.format.model import ChunkMetadataView, paused_gc  # noqa: E402
from dcp_datastates.planner import narrow as narrowed_to  # noqa: E402
from dcp_datastates.format.names import data_file_name  # noqa: E402
from dcp_datastates.format.records import ItemRecord, RankRecord  # noqa: E402
from dcp_datastates.tiers import StorageTier  # noqa: E402
from dcp_datastates.writer import _manifest_for  # noqa: E402

SAVE_ID = "0123456789ab"
DIGEST = b"\x5a" * DIGEST_BYTES


def chunk_count(layout: str, n: int, ts) -> int:
    return sum(len(sm.boxes(t, ti, layout, n, r)) if sm.writes(t, ti, layout, n, r) else 0
               for r in range(n) for ti, t in enumerate(ts))


def _global_metadata(ts, per_rank) -> Metadata:
    chunks: dict[int, list] = {}
    for rows in per_rank:
        for ti, offs, sizes in rows:
            chunks.setdefault(ti, []).append(ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)))
    sdm = {t.fqn: TensorStorageMetadata(TensorProperties(dtype=t.dtype), torch.Size(t.shape), chunks.get(ti, []))
           for ti, t in enumerate(ts)}
    return Metadata(state_dict_metadata=sdm, planner_data={t.fqn: tuple(t.fqn.split(".")) for t in ts})


def _our_results(ts, per_rank) -> list[list[WriteResult]]:
    out = []
    for rank, rows in enumerate(per_rank):
        name = data_file_name(rank, SAVE_ID, 0)
        pos, res = 0, []
        for ti, offs, sizes in rows:
            t = ts[ti]
            n = max(1, int(torch.Size(sizes).numel())) * t.dtype.itemsize
            ext = Extent([Seg(name, pos, n)], n, Digests(DIGEST * max(1, -(-n // BLOCK_SIZE))))  # as the writer makes it
            pos += n
            rec = ItemRecord("tensor", dtype_name(t.dtype), tuple(sizes), ext)
            res.append(WriteResult(index=MetadataIndex(t.fqn, torch.Size(offs)), size_in_bytes=n,
                                   storage_data=rec))
        if res:
            res[0].storage_data.rank = RankRecord(rank, {name: pos}, {}, {})
        out.append(res)
    return out


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


def _plan_one_rank(md: Metadata, ts, layout: str, n: int, rank: int, narrow: bool) -> int:
    """The resharding planning of the boxes ``rank`` of ``n`` holds; returns read items.
    ``narrow``: as ``DataStatesLoadPlanner`` does, each tensor's metadata is first narrowed to
    the chunks that overlap the rank's boxes (found over the manifest's columns); otherwise
    DCP's ``DefaultLoadPlanner`` sweeps every chunk."""
    items = 0
    for ti, t in enumerate(ts):
        boxes = sm.boxes(t, ti, layout, n, rank)
        local = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        tmd = md.state_dict_metadata[t.fqn]
        if narrow and isinstance(tmd.chunks, ChunkMetadataView):
            tmd = narrowed_to(tmd, [(tuple(o), tuple(s)) for o, s in boxes])
        items += len(create_read_items_for_chunk_list(t.fqn, tmd, local))
    return items


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one(system: str, layout: str, n: int, root: str) -> dict:
    ts = sm.tensors()
    t0 = time.perf_counter()
    per_rank = [sm.written_by(layout, n, r, ts) for r in range(n)]
    md = _global_metadata(ts, per_rank)
    results = _our_results(ts, per_rank) if system == "ours" else _dcp_results(ts, per_rank)
    del per_rank
    sim_s = time.perf_counter() - t0
    path = os.path.join(root, f"{system}-{layout}-{n}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    rss0 = _rss_peak()
    t0 = time.perf_counter()
    if system == "ours":  # as DataStatesWriter.finish does it
        with paused_gc():
            manifest = _manifest_for(md, results, SAVE_ID)
        manifest.world_size = n
        StorageTier(path).commit_bytes(MANIFEST_NAME, encode_manifest(manifest))
        del manifest
    else:
        w = FileSystemWriter(path)
        w.set_up_storage_writer(True)
        w.finish(md, results)
    commit_s = time.perf_counter() - t0
    commit_rss = max(0, _rss_peak() - rss0)
    meta_bytes = os.path.getsize(os.path.join(path, MANIFEST_NAME))
    del md, results
    out = {"system": system, "layout": layout, "ranks": n, "simulate_s": round(sim_s, 2),
           "commit_s": round(commit_s, 3), "commit_rss_growth": commit_rss, "metadata_bytes": meta_bytes}
    for label, world in (("same", n), ("half", max(1, n // 2))):
        for narrow in ((True, False) if system == "ours" else (False,)):
            t0 = time.perf_counter()
            reader = DataStatesReader(path) if system == "ours" else FileSystemReader(path)
            meta = reader.read_metadata()
            t1 = time.perf_counter()
            items = _plan_one_rank(meta, ts, layout, world, world // 2, narrow)  # a rank from the middle
            t2 = time.perf_counter()
            tag = label if narrow or system == "dcp" else f"{label}_dcp_planner"
            out[f"ready_{tag}_s"] = round(t2 - t0, 3)
            out[f"read_metadata_{tag}_s"] = round(t1 - t0, 3)
            out[f"plan_{tag}_s"] = round(t2 - t1, 3)
            out[f"read_items_{tag}"] = items
            out[f"bytes_read_{tag}"] = meta_bytes
            del meta
    shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="8,64,512,2048,16384")
    ap.add_argument("--layouts", default="fsdp,hsdp,tp_fsdp")
    ap.add_argument("--systems", default="ours,dcp")
    ap.add_argument("--max-chunks", type=float, default=6e6)
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
                if chunks > args.max_chunks:
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
          f"{'meta MB':>8} {'ready s':>8} {'ready/2 s':>9} {'ready, DCP planner s':>20}")
    for r in rows:
        if "commit_s" not in r:
            print(f"{r['layout']:8} {r['ranks']:>6} {r['chunks']:>10,} {r['system']:6} "
                  f"{r.get('skipped') or r.get('failed')}")
            continue
        print(f"{r['layout']:8} {r['ranks']:>6} {r['chunks']:>10,} {r['system']:6} {r['commit_s']:>9.3f} "
              f"{r['commit_rss_growth'] / 1e6:>13.0f} {r['metadata_bytes'] / 1e6:>8.1f} "
              f"{r['ready_same_s']:>8.3f} {r['ready_half_s']:>9.3f} "
              f"{r.get('ready_same_dcp_planner_s', r['ready_same_s']):>20.3f}")


if __name__ == "__main__":
    main()
