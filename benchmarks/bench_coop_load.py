"""Restart time with the persistent tier throttled per node (issue 37), in one run:
DCP's ``FileSystemReader``, our reader with the cooperative load off, and on.

    python benchmarks/bench_coop_load.py [--nodes 4] [--per-node 2] [--mb 256] [--node-mbps 200] [--reps 3]

``--nodes`` x ``--per-node`` gloo ranks on this machine load an HSDP state (mesh
(nodes, per_node): every node holds a full replica, sharded over its ranks; ``--mb`` MB of
fp32 tensors in all) saved once by each writer.  Every read from the checkpoint's files goes
through a wrapper of the storage interface that gives each simulated node ``--node-mbps`` MB/s,
shared by that node's ranks (one schedule per node in shared memory, as a node's link to a
PFS is shared): our reader's ranged reads (``loading.files.read_range``, ``StorageTier.read_into``)
and the streams DCP's ``FileSystem`` opens.  Reported per method (median over ``--reps``,
methods interleaved): the load time (slowest rank, from a barrier to the end of ``dcp.load``),
the bytes read from storage by the job, and for the cooperative load the bytes sent between
ranks and its phases on the slowest rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import tempfile
import time


class _Bucket:
    """A node's link to storage: reads on it are served one after another at ``rate`` B/s."""

    def __init__(self, shared, lock, rate: float) -> None:
        self.shared, self.lock, self.rate = shared, lock, rate

    def take(self, n: int) -> None:
        if n <= 0:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.shared.value)
            self.shared.value = start + n / self.rate
        delay = start + n / self.rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)


_stats = {"read": 0}


def _throttle(bucket: _Bucket) -> None:
    from torch.distributed.checkpoint import filesystem

    from dcp_datastates.load import files
    from dcp_datastates.tiers import StorageTier
    real_range, real_into = files.read_range, StorageTier.read_into

    def read_range(*a, **k):
        got, direct = real_range(*a, **k)
        bucket.take(got)
        _stats["read"] += got
        return got, direct

    def read_into(self, name, *a, **k):
        got = real_into(self, name, *a, **k)
        if name.startswith("data-"):
            bucket.take(got)
            _stats["read"] += got
        return got
    files.read_range = read_range
    StorageTier.read_into = read_into

    class Stream:
        def __init__(self, f) -> None:
            self._f = f

        def read(self, n=-1):
            b = self._f.read(n)
            bucket.take(len(b))
            _stats["read"] += len(b)
            return b

        def readinto(self, b):
            got = self._f.readinto(b) or 0
            bucket.take(got)
            _stats["read"] += got
            return got

        def __getattr__(self, name):
            return getattr(self._f, name)

    class FS(filesystem.FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as f:
                yield Stream(f) if str(path).endswith(".distcp") else f
    filesystem._ThrottledFS = FS  # type: ignore[attr-defined]


def _state(mesh, nbytes: int, seed: int):
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    g = torch.Generator().manual_seed(seed)
    rows = 2048
    n = max(1, nbytes // (rows * 1024 * 4))  # tensors of 8 MiB
    return {f"layer{i}.w": distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [Replicate(), Shard(0)])
            for i in range(n)}


def _rank(rank, world, port, per_node, nbytes, rate, methods, reps, base, locks, out):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, filesystem
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates import DataStatesReader, DataStatesWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world // per_node, per_node))
    sd = _state(mesh, nbytes, 0)
    ours, theirs = os.path.join(base, "ours"), os.path.join(base, "dcp")
    dcp.save(sd, storage_writer=DataStatesWriter(ours))
    dcp.save(sd, storage_writer=FileSystemWriter(theirs))
    shared, lock = locks[rank // per_node]
    _throttle(_Bucket(shared, lock, rate))
    res: dict = {m: [] for m in methods}
    for _ in range(reps):
        for m in methods:
            dest = _state(mesh, nbytes, 1)
            if m == "dcp":
                reader = FileSystemReader(theirs)
                reader.fs = filesystem._ThrottledFS()  # type: ignore[attr-defined]
            else:
                reader = DataStatesReader(ours, cooperative=m == "coop")
            _stats["read"] = 0
            dist.barrier()
            t = time.perf_counter()
            dcp.load(dest, storage_reader=reader)
            dt = time.perf_counter() - t
            ok = all(torch.equal(dest[k].to_local(), sd[k].to_local()) for k in sd)
            row = {"s": dt, "read": _stats["read"], "ok": ok}
            if m == "coop":
                st = reader.stats
                row.update(sent=st.bytes_sent, received=st.bytes_received, plan_s=st.plan_s, read_s=st.read_s,
                           exchange_s=st.exchange_s)
            res[m].append(row)
    got: list = [None] * world
    dist.all_gather_object(got, res)
    if rank == 0:
        out.put(got)
        out.close()
        out.join_thread()  # os._exit below would otherwise cut the queue's feeder thread short
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    import torch.multiprocessing as mp
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--node-mbps", type=float, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "dcpds-coop"))
    ap.add_argument("--json")
    a = ap.parse_args()
    world = a.nodes * a.per_node
    methods = ["dcp", "solo", "coop"]
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    locks = [(ctx.Value("d", 0.0, lock=False), ctx.Lock()) for _ in range(a.nodes)]
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, a.per_node, a.mb << 20, a.node_mbps * 1e6, methods,
                                             a.reps, a.dir, locks, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = q.get(timeout=1800)
    for p in procs:
        p.join(60)
    shutil.rmtree(a.dir, ignore_errors=True)
    print(f"{a.nodes} nodes x {a.per_node} ranks, HSDP with {a.nodes} replicas, {a.mb} MB of state, "
          f"{a.node_mbps:.0f} MB/s per node to storage")
    rows = {}
    for m in methods:
        times = [max(g[m][i]["s"] for g in got) for i in range(a.reps)]
        read = sum(g[m][0]["read"] for g in got)
        assert all(g[m][i]["ok"] for g in got for i in range(a.reps)), f"{m}: not bit-exact"
        rows[m] = {"s": statistics.median(times), "times": times, "read_mb": read / 1e6}
        if m == "coop":
            slow = max(range(world), key=lambda r: got[r][m][0]["s"])
            rows[m].update({k: got[slow][m][0][k] for k in ("plan_s", "read_s", "exchange_s")},
                           sent_mb=sum(g[m][0]["sent"] for g in got) / 1e6,
                           node_read_mb=[sum(got[r][m][0]["read"] for r in range(n * a.per_node, (n + 1) * a.per_node))
                                         / 1e6 for n in range(a.nodes)])
        print(f"{m:<5} load {rows[m]['s']:.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}), "
              f"read from storage {rows[m]['read_mb']:.0f} MB"
              + (f", sent between ranks {rows[m]['sent_mb']:.0f} MB; slowest rank: plan {rows[m]['plan_s']:.3f} s, "
                 f"reads {rows[m]['read_s']:.2f} s, exchange {rows[m]['exchange_s']:.2f} s; read per node "
                 + " / ".join(f"{x:.0f}" for x in rows[m]["node_read_mb"]) + " MB" if m == "coop" else ""))
    print(f"cooperative: {rows['dcp']['s'] / rows['coop']['s']:.1f}x faster than DCP's FileSystemReader, "
          f"{rows['solo']['s'] / rows['coop']['s']:.1f}x faster than without cooperation; "
          f"{rows['dcp']['read_mb'] / rows['coop']['read_mb']:.1f}x fewer bytes read than DCP")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
