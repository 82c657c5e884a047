"""Many small tensors restored from an object store: dcp-datastates against DCP's fsspec reader.

    python benchmarks/bench_remote_items.py [--tensors 5000] [--floats 16] [--reps 3]

Starts a local S3-protocol server (moto's standalone server, as the tests do), saves a flat
state of ``--tensors`` fp32 tensors once with each system (``DataStatesWriter`` and DCP's
``FsspecWriter``) into its bucket, then loads each ``--reps`` times, alternating, and counts
the ranged reads our reader makes (``StorageTier.read_into``, wrapped).  A real object store
adds tens of milliseconds per request where this local server adds about one, so the request
count is the figure that carries over.  Needs ``moto`` and ``s3fs`` (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state import small_tensors_state  # noqa: E402

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesWriter  # noqa: E402
from dcp_datastates.tiers import StorageTier  # noqa: E402


def _server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit("moto server did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=5000)
    ap.add_argument("--floats", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    proc, endpoint = _server()
    try:
        opts = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        import boto3  # the test extra, like moto
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket="bench")
        state = small_tensors_state(args.tensors, args.floats)
        ours, theirs = "s3://bench/ours", "s3://bench/dcp"
        saves: dict[str, list[float]] = {"ours": [], "dcp": []}
        for rep in range(args.reps):  # each save over the previous one (overwrite)
            for name in (("ours", "dcp") if rep % 2 == 0 else ("dcp", "ours")):
                t0 = time.perf_counter()
                if name == "ours":
                    dcp.save(state, storage_writer=DataStatesWriter(ours, storage_options=opts, overwrite=True),
                             no_dist=True)
                else:
                    dcp.save(state, storage_writer=FsspecWriter(theirs, **opts), no_dist=True)
                saves[name].append(time.perf_counter() - t0)
        calls = [0]
        real = StorageTier.read_into

        def counted(tier, *a, **kw):
            calls[0] += 1
            return real(tier, *a, **kw)

        StorageTier.read_into = counted
        times: dict[str, list[float]] = {"ours": [], "dcp": []}
        for rep in range(args.reps):
            for name in (("ours", "dcp") if rep % 2 == 0 else ("dcp", "ours")):
                out = {k: torch.empty_like(v) for k, v in state.items()}
                t0 = time.perf_counter()
                if name == "ours":
                    calls[0] = 0
                    dcp.load(out, storage_reader=DataStatesReader(ours, storage_options=opts),
                             planner=DataStatesLoadPlanner(), no_dist=True)
                else:
                    dcp.load(out, storage_reader=FsspecReader(theirs, **opts), no_dist=True)
                times[name].append(time.perf_counter() - t0)
                assert all(torch.equal(out[k], state[k]) for k in state), name
        ratio = statistics.median(d / o for d, o in zip(times["dcp"], times["ours"]))
        print(f"{args.tensors} tensors of {args.floats} fp32 from a local S3 server, {args.reps} rounds, "
              f"torch {torch.__version__}")
        sratio = statistics.median(d / o for d, o in zip(saves["dcp"], saves["ours"]))
        print(f"save: DCP FsspecWriter {statistics.median(saves['dcp']):.3f} s, ours "
              f"{statistics.median(saves['ours']):.3f} s ({sratio:.2f}x)")
        print(f"load: DCP FsspecReader {statistics.median(times['dcp']):.3f} s, ours "
              f"{statistics.median(times['ours']):.3f} s ({ratio:.2f}x); our ranged reads per load: {calls[0]}")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
