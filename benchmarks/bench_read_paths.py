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
"""

from __future__ import annotations

import argparse
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

from dcp_datastates import DataStatesWriter  # noqa: E402
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dir", default="/tmp/dcpds-paths")
    args = ap.parse_args()
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
