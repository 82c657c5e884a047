"""Requests each rank makes to a shared object-store tier per checkpoint.

    python benchmarks/bench_tier_requests.py [--ranks 4] [--steps 8] [--keep 2,6] [--json OUT]

Starts a local S3-protocol server (moto's standalone server, as the tests do).  ``--ranks``
gloo ranks, each its own node with a node-local directory, save a small state with
``Checkpointer([node dir, s3://...], node_local=True, keep=[1, K])`` and persist every step, for
each ``K`` of ``--keep`` (steps kept on S3).  Every request the ranks make to S3 is counted
(``fsspec.asyn.sync`` wrapped: each s3fs call, a listing, a ranged read, a PUT, a removal)
during the last save, from the call to the end of its flushes and retention passes.
Reported: the coordinator's count and the largest of the other ranks'.  A real object store
adds tens of milliseconds per request where this local server adds about one; what carries
over is the count, and how it grows with the ranks and the steps kept.  Needs ``moto`` and
``s3fs`` (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import sys
import tempfile
import threading

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_remote_items import _server  # noqa: E402


def _rank(rank: int, world: int, port: int, endpoint: str, base: str, steps: int, keep: int, out) -> None:
    import fsspec.asyn

    from dcp_datastates import Checkpointer
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    real = fsspec.asyn.sync

    def counted(loop, func, *args, **kwargs):
        with lock:
            counts[getattr(func, "__name__", "?").lstrip("_")] += 1
        return real(loop, func, *args, **kwargs)
    fsspec.asyn.sync = counted
    opts = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    c = Checkpointer([os.path.join(base, f"node{rank}"), f"s3://bench/run-{keep}"], node_local=True,
                     keep=[1, keep], storage_options=[None, opts], async_mode=None, host_cache_bytes=8 << 20)
    for step in range(1, steps + 1):
        counts.clear()
        c.save(step, {"w": torch.full((1 << 16,), float(step * world + rank)), "step": step})
        c.wait_persisted(120)
        dist.barrier()  # every rank's flush over, rank 0's commit on S3 too
        c.retention.join()
        dist.barrier()
    c.close()
    out.put((rank, dict(counts)))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--keep", default="2,6", help="steps kept on S3, one run per value")
    ap.add_argument("--json")
    args = ap.parse_args()
    import boto3  # the test extra, like moto
    import torch.multiprocessing as mp
    proc, endpoint = _server()
    report = []
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket="bench")
        for keep in (int(k) for k in args.keep.split(",")):
            base = tempfile.mkdtemp(prefix="dcpds-tier-requests-")
            ctx = mp.get_context("spawn")
            q = ctx.SimpleQueue()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ps = [ctx.Process(target=_rank, args=(r, args.ranks, port, endpoint, base, args.steps, keep, q))
                  for r in range(args.ranks)]
            for p in ps:
                p.start()
            for p in ps:
                p.join(600)
            got = dict(q.get() for _ in range(args.ranks))
            shutil.rmtree(base, ignore_errors=True)
            others = max(range(1, args.ranks), key=lambda r: sum(got[r].values()))
            row = {"keep_on_s3": keep, "ranks": args.ranks, "coordinator": sum(got[0].values()),
                   "other_rank_max": sum(got[others].values()), "other_rank_by_call": got[others],
                   "coordinator_by_call": got[0]}
            report.append(row)
            print(f"keep {keep} on S3, {args.ranks} ranks: coordinator {row['coordinator']} requests in the "
                  f"last save, another rank at most {row['other_rank_max']} ({got[others]})", flush=True)
    finally:
        proc.terminate()
        proc.wait(10)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
