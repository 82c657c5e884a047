"""What a restore's repair costs one rank at scale (issue 36), without the ranks: the objects
every rank receives from the survey's all-gather, and the bookkeeping it then does on them.

    python benchmarks/bench_repair_scale.py [--ranks 1024,4096,16384] [--per-node 8] [--stripes 1]
    python benchmarks/bench_repair_scale.py --small 291 [--ranks ...]

For each world size, one step saved by every rank with ``--stripes`` data files and a metadata
part each, on nodes of ``--per-node`` ranks, each node holding its ranks' files and the
replicas of the previous node's (``K`` = 1), every replica record vouching for its digests.
Every rank's survey share (its slice of its node's listing, ``replica_repair._listing``'s
object) is pickled as the replica group sends it; the figures are what one rank receives (the
all-gather pads each object to the largest) and the time one rank spends, after the transfer,
unpickling every share (``replica_group._objects``), merging them per node and running the
survey's check that every file the manifest lists is on some node (``Survey.holders``).
Nothing is sent: the gloo transfer of the bytes comes on top.

``--small P``: the fetch's small records instead, with nothing lost: ``P`` step counters of 4
bytes (Adam's, one per parameter), which DCP's planner spreads over the ranks, every rank
reading all of them.  ``before``: what the repair did until each rank's list of the files it
borrows ranges of travelled in the fetch's all-gather and each (rank, file) became a move of
its own (reconstructed here: the per-rank objects, their unpickling, and the list of moves
every rank walks); ``now``: the byte per range of the max-reduction that marks what some rank
lacks, the bytes of the reductions that bring them, and the pieces every rank plans
(``NodeRepair._lend``'s list, built with the same ``Survey.holders``).
"""

from __future__ import annotations

import argparse
import json
import pickle
import time

from dcp_datastates.format.model import Span
from dcp_datastates.format.names import MANIFEST_NAME, data_file_name, rank_file_name
from dcp_datastates.replicas.group import _objects
from dcp_datastates.replicas.moves import Lent
from dcp_datastates.replicas.repair import Listing, Survey, _merged
from dcp_datastates.replicas.work import PIECE

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


def small(world: int, per_node: int, params: int) -> dict:
    """The fetch's small records at ``world`` ranks: before and now (see the module's text)."""
    nodes = world // per_node
    files = {n: z for r in range(world) for n, z in _files(r, 1).items()}
    held = {f"n{node}": {n: files[n] for r in range(world) if r // per_node in (node, (node - 1) % nodes)
                         for n in _files(r, 1)} for node in range(nodes)}
    s = Survey({n: Listing(h, {}, None) for n, h in held.items()}, files, world)
    writer = [(j * world) // params for j in range(params)]  # DCP's dedup: spread over the ranks
    counters = sorted((data_file_name(w, SAVE, 0), 4 * j) for j, w in enumerate(writer))
    lacked = {f"n{node}": sorted({f for f, _o in counters if f not in held[f"n{node}"]}) for node in range(nodes)}
    # before: each rank's (whole files, files it borrows ranges of) in the all-gather
    blobs = [pickle.dumps((sorted(_files(r, 1)), lacked[f"n{r // per_node}"])) for r in range(world)]
    most = max(map(len, blobs))
    t0 = time.perf_counter()
    got = [_objects(b) for b in blobs]
    borrows = [(pos, n) for pos, (_whole, names) in enumerate(got) for n in names]
    moves = []
    for i, (pos, name) in enumerate(borrows):
        src = s.holders(name)
        pick = src[i % len(src)]
        moves.append((name, int(pick[1:]) * per_node + i % per_node, pos))
    me = 0
    walked = sum(1 for mv in moves if me in (mv[1], mv[2]))
    t1 = time.perf_counter()
    before = {"received_MB": round(most * world / 1e6, 1), "moves": len(moves), "moves_of_rank_0": walked,
              "plan_s": round(t1 - t0, 2)}
    del got, borrows, moves
    # now: a byte per range marked, then the ranges' bytes, both reduced over the ranks
    small_list = tuple(sorted((f, o, 4) for f, o in counters))
    t0 = time.perf_counter()
    at = {r: i for i, r in enumerate(small_list)}
    asked = bytearray(len(small_list))
    for f, o in counters:
        if f in lacked["n0"]:
            asked[at[(f, o, 4)]] = 1
    pieces, source = [], {}
    for i, flag in enumerate(asked):
        if not flag:
            continue
        name, offset, size = small_list[i]
        if name not in source:
            src = s.holders(name)
            k = len(source)
            source[name] = int(src[k % len(src)][1:]) * per_node + k % per_node
        pieces.append(Lent(Span(name, offset, size), source[name]))
    t1 = time.perf_counter()
    lent = sum(p.span.nbytes for p in pieces)
    reduced = len(small_list) + lent
    now = {"reduced_B": reduced, "rounds": 1 + -(-lent // PIECE), "plan_s": round(t1 - t0, 4)}
    return {"ranks": world, "nodes": nodes, "counters": params, "before": before, "now": now}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--stripes", type=int, default=1)
    ap.add_argument("--small", type=int, default=0, help="the fetch's small records, P step counters")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [small(int(w), a.per_node, a.small) if a.small else one(int(w), a.per_node, a.stripes)
            for w in a.ranks.split(",")]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
