"""What a restore's repair costs one rank at scale (issue 36), without the ranks: the objects
every rank receives from the survey's all-gather, and the bookkeeping it then does on them.

    python benchmarks/bench_repair_scale.py [--ranks 1024,4096,16384] [--per-node 8] [--stripes 1]

For each world size, one step saved by every rank with ``--stripes`` data files and a metadata
part each, on nodes of ``--per-node`` ranks, each node holding its ranks' files and the
replicas of the previous node's (``K`` = 1), every replica record vouching for its digests.
Every rank's survey share (its slice of its node's listing, ``replica_repair._listing``'s
object) is pickled as the replica group sends it; the figures are what one rank receives (the
all-gather pads each object to the largest) and the time one rank spends, after the transfer,
unpickling every share (``replica_group._objects``), merging them per node and running the
survey's check that every file the manifest lists is on some node (``Survey.holders``).
Nothing is sent: the gloo transfer of the bytes comes on top.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time

from dcp_datastates.format.names import MANIFEST_NAME, data_file_name, rank_file_name
from dcp_datastates.tiers.replica_group import _objects
from dcp_datastates.tiers.replica_repair import Listing, Survey, _merged

SAVE = "0123456789ab"


def _files(rank: int, stripes: int) -> dict[str, int]:
    out = {data_file_name(rank, SAVE, s): 64 << 20 for s in range(stripes)}
    out[rank_file_name(rank, -1, SAVE)] = 300_000
    return out


def _shares(world: int, per_node: int, stripes: int) -> list[tuple[str, Listing]]:
    """Every rank's survey share, as ``NodeRepair.survey`` gathers it: (node, its Listing)."""
    nodes = world // per_node
    out = []
    for node in range(nodes):
        held = sorted(r for n in (node, (node - 1) % nodes) for r in range(n * per_node, (n + 1) * per_node))
        entries = {MANIFEST_NAME: 5 << 20}
        for r in held:
            entries.update(_files(r, stripes))
        names = sorted(entries)
        digests = {n: f"{hash(n) & ((1 << 128) - 1):032x}" for n in names if n != MANIFEST_NAME}
        for i in range(per_node):
            mine = names[i::per_node]
            out.append((f"n{node}", Listing({n: entries[n] for n in mine}, {n: digests[n] for n in mine if n in digests},
                                            "f" * 32 if i == 0 else None)))
    return out


def one(world: int, per_node: int, stripes: int) -> dict:
    shares = _shares(world, per_node, stripes)
    blobs = [pickle.dumps(s) for s in shares]
    most = max(map(len, blobs))
    files = {n: z for r in range(world) for n, z in _files(r, stripes).items()}
    t0 = time.perf_counter()
    got = [_objects(b) for b in blobs]
    t1 = time.perf_counter()
    by_node: dict[str, list[Listing]] = {}
    for node, part in got:
        by_node.setdefault(node, []).append(part)
    listings = {n: _merged(parts) for n, parts in by_node.items()}
    recorded = {f: d for x in listings.values() for f, d in x.recorded.items()}
    s = Survey(listings, files, world, recorded)
    t2 = time.perf_counter()
    lost = [n for n in files if not s.holders(n)]
    t3 = time.perf_counter()
    assert not lost, lost[:3]
    return {"ranks": world, "nodes": world // per_node, "files": len(files),
            "received_MB": round(most * world / 1e6, 1), "largest_share_B": most,
            "unpickle_s": round(t1 - t0, 3), "merge_s": round(t2 - t1, 3), "holders_s": round(t3 - t2, 3),
            "total_s": round(t3 - t0, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--stripes", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [one(int(w), a.per_node, a.stripes) for w in a.ranks.split(",")]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
