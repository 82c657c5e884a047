"""The cooperative load at scale, by simulation (issue 37): storage bytes per job, and one
rank's share of agreeing who reads what, at N ranks without N processes.

    python benchmarks/bench_scale_coop.py [--ranks 16384,131072] [--replicas 8] [--json FILE]

Layout ``hsdp``: the Llama-3-70B-shaped state with Adam of ``scale_model.py`` (2,892 tensors),
each tensor split along dim 0 over ``N / R`` ranks and replicated over ``R`` groups (HSDP with
``R`` replicas); each box written once (the writer rotating over its replicas, as DCP's dedup
does); Adam's ``step`` scalars replicated on every rank.

1. **Storage bytes per job** for a restart at the same layout: DCP's reader reads, on every
   rank, the whole stored item behind each of its boxes (R copies of every shard, N copies of
   every scalar); ours with the cooperative load reads each 1 MiB block once per ``FANOUT``
   ranks that need it (once for every shard block, N / FANOUT times for each scalar).  Counted
   from the layout, box by box.
2. **One rank's plan** (timed): the real ``Cooperation.plan`` of rank 0, its collectives replaced
   by the messages the other ranks would send it: as an arbiter, the asks of ``R`` ranks for as
   many shard blocks as it asks for itself, and of its ``FANOUT`` group's ranks for one in
   ``FANOUT`` of the scalars (small whole tensors, arbitrated per group; the expected share
   under the hash); as an asker, one owner per block among its replicas (a scalar: in its
   group).  Timed: listing its blocks, packing its asks for N ranks, reading the
   asks it arbitrates, choosing owners, packing replies, reading its own replies, cutting its
   ranges, with the garbage collector paused as ``read_data`` pauses it.  Not timed: the
   all-reduce and the two all-to-alls on the network (the bytes each carries are given).
   Best of 3.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import msgpack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale_model as sm

from dcp_datastates.format.checksum import BLOCK_SIZE
from dcp_datastates.gcpause import paused_gc
from dcp_datastates.load.cooperative import FANOUT, Cooperation
from dcp_datastates.load.ranges import ByteRange


def _nbytes(t: sm.Tensor, rows: int) -> int:
    inner = math.prod(t.shape[1:]) if t.shape else 1
    return rows * inner * t.dtype.itemsize


def _box_rows(t: sm.Tensor, shards: int, j: int) -> int:
    return sm._split(0, t.shape[0], shards, j)[1] if t.shape else 1


def storage_bytes(ts: list[sm.Tensor], n: int, r: int) -> dict:
    """Bytes read from storage by a job of ``n`` ranks restoring HSDP with ``r`` replicas."""
    shards = n // r
    state = dcp = ours = 0
    for t in ts:
        if not t.shape:  # a scalar every rank holds: read once per group of FANOUT ranks
            b = t.dtype.itemsize
            state += b
            dcp += n * b
            ours += math.ceil(n / FANOUT) * b
            continue
        b = sum(_nbytes(t, _box_rows(t, shards, j)) for j in range(min(shards, t.shape[0])))  # empty boxes past
        state += b
        dcp += r * b  # every replica reads its box's stored item
        ours += b if r <= FANOUT else math.ceil(r / FANOUT) * b  # each block once per FANOUT askers
    return {"state": state, "dcp": dcp, "ours": ours}


class _Task:
    """What the plan reads of a task: its ranges (no buffer is touched before the exchange)."""
    streamed = False

    def __init__(self, ranges: list[ByteRange], whole_tensor: bool) -> None:
        self.ranges = ranges
        self.block_size = BLOCK_SIZE
        self.whole_tensor = whole_tensor


def _file(writer: int) -> str:
    return f"data-r{writer:05d}-00000000000000000000000000000000-0.bin"


def _rank_tasks(ts: list[sm.Tensor], n: int, r: int, rank: int) -> list[_Task]:
    """Rank ``rank``'s read tasks: one per tensor, the stored item of its box."""
    shards = n // r
    j = rank % shards
    out = []
    for ti, t in enumerate(ts):
        if t.shape:
            writer = j + (ti % r) * shards
            nb = _nbytes(t, _box_rows(t, shards, j))
        else:
            writer = ti % n
            nb = t.dtype.itemsize
        if nb:
            out.append(_Task([ByteRange(_file(writer), ti << 30, nb, 0, 0, None)],  # type: ignore[arg-type]
                             whole_tensor=not t.shape))
    return out


class _Simulated(Cooperation):
    """Rank 0's ``Cooperation`` with the other ranks' messages made up front."""

    def __init__(self, n: int, inbound: list[list[bytes]]) -> None:
        self.group, self.checkpoint, self.rank, self.world = None, "sim", 0, n
        self.plan_s = self.exchange_s = 0.0
        self._inbound = inbound
        self.sent: list[int] = []

    def _any_failed(self, failed: bool) -> bool:
        return failed

    def _all_to_all(self, payloads: list[bytes]) -> list[bytes]:
        self.sent.append(sum(len(p) for p in payloads))
        return self._inbound.pop(0)


def _inbound(ts: list[sm.Tensor], n: int, r: int, tasks: list[_Task]) -> list[list[bytes]]:
    """What rank 0 receives: the asks it arbitrates, then the replies to its own asks."""
    shards = n // r
    asks: list[dict] = [{} for _ in range(n)]
    other = _rank_tasks(ts, n, r, 1 % shards)  # another shard's blocks, as many as rank 0's own
    replicas = [1 % shards + g * shards for g in range(r)]
    for t in other:
        for rg in t.ranges:
            if rg.nbytes > 8:
                for a in range(0, rg.nbytes, BLOCK_SIZE):
                    for q in replicas:
                        asks[q].setdefault(rg.file, []).append([rg.file_offset + a, min(BLOCK_SIZE, rg.nbytes - a)])
    small = [rg for t in tasks if t.whole_tensor for rg in t.ranges]  # arbitrated per FANOUT ranks
    for rg in small[::FANOUT]:  # its expected share: one group's asks for 1 in FANOUT of them
        for q in range(min(FANOUT, n)):
            asks[q].setdefault(rg.file, []).append([rg.file_offset, rg.nbytes])
    first = [msgpack.packb(a, use_bin_type=True) if a else b"" for a in asks]
    replies: list[dict] = [{} for _ in range(n)]
    mine = [0 + g * shards for g in range(r)]
    for t in tasks:
        for rg in t.ranges:
            for a in range(0, rg.nbytes, BLOCK_SIZE):
                off, nb = rg.file_offset + a, min(BLOCK_SIZE, rg.nbytes - a)
                if t.whole_tensor:  # a scalar: an owner in its group of FANOUT ranks
                    owner, to = 1, []
                else:
                    owner = mine[(off >> 20) % r]
                    to = [x for x in mine if x != 0] if owner == 0 else []
                replies[owner].setdefault(rg.file, []).append([off, nb, owner, to])
    second = [msgpack.packb(x, use_bin_type=True) if x else b"" for x in replies]
    return [first, second]


def plan_time(ts: list[sm.Tensor], n: int, r: int) -> dict:
    best = math.inf
    for _ in range(3):
        tasks = _rank_tasks(ts, n, r, 0)
        sim = _Simulated(n, _inbound(ts, n, r, tasks))
        inbound_bytes = [sum(len(p) for p in x) for x in sim._inbound]
        t = time.perf_counter()
        with paused_gc():  # as in DataStatesReader.read_data
            plan = sim.plan(tasks, BLOCK_SIZE)
        best = min(best, time.perf_counter() - t)
        assert plan is not None
    return {"plan_s": best, "blocks": sum(len(t.ranges) for t in tasks), "ask_bytes_out": sim.sent[0],
            "ask_bytes_in": inbound_bytes[0], "reply_bytes_out": sim.sent[1], "reply_bytes_in": inbound_bytes[1],
            "receives_from": len(plan.recvs), "sends_to": len(plan.sends)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="16384,131072")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    ts = sm.tensors()
    rows = []
    for n in [int(x) for x in a.ranks.split(",")]:
        row = {"ranks": n, "replicas": a.replicas, **storage_bytes(ts, n, a.replicas), **plan_time(ts, n, a.replicas)}
        rows.append(row)
        print(f"hsdp N={n:,} R={a.replicas}: state {row['state'] / 1e9:.1f} GB; read from storage per job: DCP "
              f"{row['dcp'] / 1e9:.1f} GB, ours {row['ours'] / 1e9:.1f} GB ({row['dcp'] / row['ours']:.2f}x fewer); "
              f"rank 0's plan {row['plan_s']:.3f} s for {row['blocks']} ranges (asks {row['ask_bytes_out'] / 1e3:.0f} kB "
              f"out, {row['ask_bytes_in'] / 1e3:.0f} kB in; replies {row['reply_bytes_out'] / 1e3:.0f} kB out, "
              f"{row['reply_bytes_in'] / 1e3:.0f} kB in)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
