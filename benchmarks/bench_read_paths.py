"""Why cold loads go through a huge-page staging buffer: three ways to read the same files.

    python benchmarks/bench_read_paths.py [--gb 1.5] [--reps 3] [--threads 8] [--dir /tmp/dcpds-paths]

Saves a transformer-shaped state with DataStatesWriter, then reads every tensor's bytes cold
(page cache dropped; needs root) into one destination per tensor, in 16 MiB pieces on
``--threads`` threads, three ways, in rotating order (tensors under 256 KiB buffered in all):

* buffered: ``preadv`` through the page cache into the destination;
* O_DIRECT in place: ``preadv`` on an O_DIRECT descriptor straight into the destination, which
  is allocated page-aligned for this (the best case for it: PyTorch's own allocations are
  64-byte aligned, which many devices refuse for O_DIRECT); a partial last block buffered;
* staged: ``tiers/direct_io.read_range``, O_DIRECT into a per-thread buffer of 2 MiB huge pages,
  then a copy into the destination (what DataStatesReader does); and the same with a staging
  buffer of ordinary 4 KiB pages.

Destinations are allocated twice: right after start, and again after churning the allocator
(many allocations and frees), as a long-lived process would have them.  Reports median seconds
and the average request size the block device saw (from ``/sys/block/<dev>/stat``).

    python benchmarks/bench_read_paths.py --upload-proxy [--gb 1] [--reps 3] [--threads 8]

The CPU proxy of the GPU's streamed load (issue 71): ``dcp.load`` through DataStatesReader into
host tensors, cold, four ways in rotating order: read straight into the destinations (no
consumer); streamed through the staging slabs to ``engine.upload.HostUpload``, a stand-in for
the copy engine, landing each piece at once (a consumer that is never slow); the same stand-in
landing each piece a fixed latency after it is submitted (the GPU path as it is: a reader reads
on while its last piece uploads); and that stand-in made to wait for each piece before its
reader reads again (the path as it was).  The latency is the time one reader takes to read one
16 MiB piece in the first, unconsumed load: the consumer is as slow as the reads.  Reports each
load's read throughput and its ratio to the streamed load without latency (the stand-in's own
copy, which a GPU's copy engine does not take from the CPU, costs the same in both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from bench_core import drop_caches  # noqa: E402
from state import transformer_state  # noqa: E402

from dcp_datastates import DataStatesReader, DataStatesWriter  # noqa: E402
from dcp_datastates.engine.upload import SLAB_BYTES, HostUpload  # noqa: E402
from dcp_datastates.tiers.manifests import load_manifest  # noqa: E402
from dcp_datastates.tiers import StorageTier  # noqa: E402
from dcp_datastates.tiers.direct_io import STAGE_BYTES, StagingBuffer, dio_alignment, read_range  # noqa: E402

PIECE = 16 << 20


def _block_stat_path(path: str) -> str | None:
    dev = os.stat(path).st_dev
    p = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if os.path.exists(os.path.join(p, "partition")):
        p = os.path.dirname(os.path.realpath(p))
    p = os.path.join(os.path.realpath(p), "stat")
    return p if os.path.exists(p) else None


def _reads(stat: str | None) -> tuple[int, int]:
    if stat is None:
        return 0, 0
    f = open(stat).read().split()
    return int(f[0]), int(f[2]) * 512  # reads completed, bytes read


def _page_aligned(n: int) -> torch.Tensor:
    raw = torch.empty(n + 4096, dtype=torch.uint8)
    s = (-raw.data_ptr()) % 4096
    return raw[s:s + n]


class _Waiting(HostUpload):
    """The stand-in, made to wait for each piece's upload before its reader reads again."""

    def piece(self, dest_bytes, slab):
        ev = super().piece(dest_bytes, slab)
        ev.synchronize()
        return ev


def upload_proxy(args) -> int:
    shutil.rmtree(args.dir, ignore_errors=True)
    sd = transformer_state(args.gb)
    ckpt = os.path.join(args.dir, "ckpt")
    dcp.save(sd, storage_writer=DataStatesWriter(ckpt), no_dist=True)
    total = sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))
    cold = drop_caches()
    dests = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}

    def load(uploads) -> float:
        if cold:
            drop_caches()
        t0 = time.perf_counter()
        dcp.load(dests, storage_reader=DataStatesReader(ckpt, thread_count=args.threads, _host_uploads=uploads),
                 no_dist=True)
        return time.perf_counter() - t0

    first = load(None)
    latency = args.threads * SLAB_BYTES / (total / first)  # one reader's time for one piece
    ways = {"straight into the destinations": None,
            "streamed, stand-in without latency": lambda: HostUpload(0.0),
            "streamed, stand-in with the latency": lambda: HostUpload(latency),
            "streamed, each reader waits for its upload (as before)": lambda: _Waiting(latency)}
    times: dict[str, list[float]] = {w: [] for w in ways}
    for rep in range(args.reps):
        names = list(ways)
        for w in names[rep % len(names):] + names[:rep % len(names)]:
            times[w].append(load(ways[w]))
    assert all(torch.equal(dests[k], sd[k]) for k in dests)
    base = statistics.median(times["streamed, stand-in without latency"])
    print(f"{'cold' if cold else 'warm (not root)'} loads of {total / 1e9:.2f} GB, {args.threads} threads, "
          f"upload stand-in latency {latency * 1e3:.1f} ms a 16 MiB piece, {args.reps} rounds")
    rows = {}
    for w, v in times.items():
        t = statistics.median(v)
        rows[w] = {"median_s": t, "runs_s": v, "gbps": total / t / 1e9, "vs_no_latency": base / t}
        print(f"{w:<56} {t:>7.3f} s  {total / t / 1e9:>5.2f} GB/s  {base / t:>6.1%} of streamed without latency  "
              f"runs {[round(x, 3) for x in v]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": total, "threads": args.threads, "latency_s": latency, "cold": cold, "rows": rows}, f,
                      indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dir", default="/tmp/dcpds-paths")
    ap.add_argument("--upload-proxy", action="store_true", help="the CPU proxy of the GPU's streamed load")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.upload_proxy:
        return upload_proxy(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    sd = transformer_state(args.gb)
    ckpt = os.path.join(args.dir, "ckpt")
    dcp.save(sd, storage_writer=DataStatesWriter(ckpt), no_dist=True)
    m = load_manifest(StorageTier(ckpt))
    # one destination per tensor, as a restore has them: (fqn, file, file offset, bytes)
    extents = [(fqn, s.file, s.offset, s.nbytes) for fqn, e in m.tensors.items()
               for c in e.chunks for s in c.extent.segs]
    files = sorted({x[1] for x in extents})
    total = sum(x[3] for x in extents)
    if not drop_caches():
        print("cannot drop the page cache (needs root): the reads would be warm; stopping")
        return 1
    stat = _block_stat_path(ckpt)

    def destinations(aligned: bool) -> dict[str, torch.Tensor]:
        return {fqn: (_page_aligned(n) if aligned else torch.empty(n, dtype=torch.uint8)).fill_(0)
                for fqn, _f, _o, n in extents}

    def churn() -> None:
        g = torch.Generator().manual_seed(1)
        for _ in range(40):
            junk = [torch.empty(int(x)).fill_(1) for x in torch.randint(1 << 10, 1 << 22, (40,), generator=g)]
            del junk

    pieces = [(fqn, f, o + k, min(PIECE, n - k), k) for fqn, f, o, n in extents for k in range(0, n, PIECE)]

    def run(method: str, dest: dict[str, torch.Tensor]) -> None:
        fds = {f: os.open(os.path.join(ckpt, f), os.O_RDONLY) for f in files}
        dfds = {f: os.open(os.path.join(ckpt, f), os.O_RDONLY | os.O_DIRECT) for f in files}
        align = dio_alignment(next(iter(dfds.values())))
        local = threading.local()
        stages: list[StagingBuffer] = []

        def one(p):
            fqn, f, o, n, k = p
            t = dest[fqn][k:k + n]
            mv = memoryview(t.numpy())
            if method == "buffered" or n < (256 << 10):
                got = os.preadv(fds[f], [mv], o)
            elif method == "O_DIRECT in place":
                body = n // 4096 * 4096  # whole blocks in place, the partial last block buffered
                got = os.preadv(dfds[f], [mv[:body]], o)
                if body < n:
                    got += os.preadv(fds[f], [mv[body:]], o + body)
            else:
                st = getattr(local, "stage", None)
                if st is None:
                    st = local.stage = StagingBuffer(STAGE_BYTES, huge_pages="4 KiB" not in method)
                    stages.append(st)
                got, _ = read_range(fds[f], o, mv, t.data_ptr(), direct_fd=dfds[f], stage=st, align=align)
            assert got == n, (fqn, o, got, n)
        try:
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(one, pieces))
        finally:
            for st in stages:
                st.close()
            for fd in [*fds.values(), *dfds.values()]:
                os.close(fd)

    methods = ["buffered", "O_DIRECT in place", "staged, 4 KiB pages", "staged (DataStatesReader)"]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    reference = {fqn: sd[fqn].contiguous().view(-1).view(torch.uint8) for fqn in sd}
    drop_caches()
    for when in ("fresh", "after churn"):
        if when == "after churn":
            churn()
        dests = {m: destinations(aligned=(m == "O_DIRECT in place")) for m in methods}
        for rep in range(args.reps):
            order = methods[rep % len(methods):] + methods[:rep % len(methods)]
            for m in order:
                drop_caches()
                r0, b0 = _reads(stat)
                t0 = time.perf_counter()
                run(m, dests[m])
                dt = time.perf_counter() - t0
                r1, b1 = _reads(stat)
                req = (b1 - b0) / max(1, r1 - r0) / 2**20 if stat else float("nan")
                results.setdefault((when, m), []).append((dt, req))
        for m in methods:  # every method delivered the file contents
            assert all(torch.equal(dests[m][fqn], reference[fqn]) for fqn in reference), m
        del dests
    print(f"cold reads of {total / 1e9:.2f} GB ({len(extents)} tensors) from {len(files)} files, "
          f"{args.threads} threads, 16 MiB pieces, {args.reps} rounds")
    print(f"{'destinations':<13} {'method':<27} {'median s':>8} {'GB/s':>6} {'avg request MiB':>16}")
    for (when, m), v in results.items():
        t = statistics.median(x[0] for x in v)
        req = statistics.median(x[1] for x in v)
        print(f"{when:<13} {m:<27} {t:>8.3f} {total / t / 1e9:>6.2f} {req:>16.2f}")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
