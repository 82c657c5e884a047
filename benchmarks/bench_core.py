"""Core benchmark: durable save, cold load and resharded load against DCP, in one run.

    python benchmarks/bench_core.py [--gb 1.5] [--reps 3] [--dir /tmp/dcpds-bench]

Every method is run ``--reps`` times in rotating order, each save into a fresh directory;
the table gives medians and the ratios are medians of per-round ratios, because this
machine's disk is noisy.  Page cache is dropped before loads when permitted (root).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from state import nbytes, transformer_state  # noqa: E402

from dcp_datastates import DataStatesReader, DataStatesWriter  # noqa: E402


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _raw_file(path: str, bufs: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for mv in bufs:
            off = 0
            while off < mv.nbytes:
                off += os.write(fd, mv[off:off + (1 << 30)])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(path: str, bufs: list[memoryview], files: int = 1) -> None:
    """The same bytes written plainly: ``files`` files, one thread each, then fsync."""
    os.makedirs(path, exist_ok=True)
    if files == 1:
        _raw_file(os.path.join(path, "raw.bin"), bufs)
        return
    from concurrent.futures import ThreadPoolExecutor
    groups: list[list[memoryview]] = [[] for _ in range(files)]
    sizes = [0] * files
    for mv in sorted(bufs, key=lambda m: -m.nbytes):
        k = sizes.index(min(sizes))
        groups[k].append(mv)
        sizes[k] += mv.nbytes
    with ThreadPoolExecutor(files) as pool:
        list(pool.map(lambda kg: _raw_file(os.path.join(path, f"raw{kg[0]}.bin"), kg[1]),
                      enumerate(groups)))


def raw_read(path: str, threads: int = 4) -> int:
    """Read every file of ``path`` once (one thread per file, 16 MiB preads into one reused
    buffer per thread): the disk's cold read ceiling for the same bytes."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> int:
        buf = bytearray(16 << 20)
        mv = memoryview(buf)
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        got = 0
        try:
            while True:
                n = os.preadv(fd, [mv], got)
                if n <= 0:
                    return got
                got += n
        finally:
            os.close(fd)
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, sorted(os.listdir(path))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dcpds-bench")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()

    sd = transformer_state(args.gb)
    size = nbytes(sd)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    bufs = [memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in sd.values()]
    print(f"state: {len(sd)} tensors, {size / 1e9:.2f} GB (fp32 + bf16)", flush=True)

    savers = {"raw write+fsync": None, "raw write+fsync (4 files)": None,
              "dcp-datastates": lambda p: DataStatesWriter(p)}
    for tc in (1, 2, 4, 8):
        savers[f"FileSystemWriter(thread_count={tc})"] = (lambda tc: lambda p: dcp.FileSystemWriter(p, thread_count=tc))(tc)
    names = list(savers)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for n in order:
            path = os.path.join(args.dir, f"save-{rep}-{names.index(n)}")
            t0 = time.perf_counter()
            if savers[n] is None:
                raw_write(path, bufs, 4 if "4 files" in n else 1)
            else:
                dcp.save(sd, storage_writer=savers[n](path), no_dist=True)
            times[n].append(time.perf_counter() - t0)
            if rep < args.reps - 1:
                shutil.rmtree(path)
        print(f"round {rep}: " + ", ".join(f"{n}={times[n][-1]:.2f}s" for n in names), flush=True)

    fs_names = [n for n in names if n.startswith("FileSystemWriter")]
    best_fs = min(fs_names, key=lambda n: statistics.median(times[n]))
    save_ratio = statistics.median(min(times[f][i] for f in fs_names) / times["dcp-datastates"][i]
                                   for i in range(args.reps))
    raw_names = [n for n in names if n.startswith("raw")]
    raw_frac = statistics.median(min(times[r][i] for r in raw_names) / times["dcp-datastates"][i]
                                 for i in range(args.reps))

    # cold loads of the last round's checkpoints
    last = args.reps - 1
    ours_path = os.path.join(args.dir, f"save-{last}-{names.index('dcp-datastates')}")
    ref_path = os.path.join(args.dir, f"save-{last}-{names.index(best_fs)}")
    dropped = drop_caches()
    raw_path = os.path.join(args.dir, f"save-{last}-{names.index('raw write+fsync (4 files)')}")
    load_t: dict[str, list[float]] = {"dcp-datastates": [], "FileSystemReader": [], "raw read (4 files)": []}
    # The destination is an already-materialized model, as in a real restart: allocate it once.
    tmpl = {k: torch.empty_like(v) for k, v in sd.items()}
    for rep in range(args.reps):
        for n in (["dcp-datastates", "FileSystemReader"] if rep % 2 == 0 else ["FileSystemReader", "dcp-datastates"]):
            if rep == 0 and n == "dcp-datastates":
                drop_caches()
                t0 = time.perf_counter()
                raw_read(raw_path)
                load_t["raw read (4 files)"].append(time.perf_counter() - t0)
            for v in tmpl.values():
                v.zero_()
            reader = DataStatesReader(ours_path) if n == "dcp-datastates" else dcp.FileSystemReader(ref_path)
            drop_caches()
            t0 = time.perf_counter()
            dcp.load(tmpl, storage_reader=reader, no_dist=True)
            load_t[n].append(time.perf_counter() - t0)
            assert all(torch.equal(tmpl[k], sd[k]) for k in sd), n
    load_ratio = statistics.median(load_t["FileSystemReader"][i] / load_t["dcp-datastates"][i]
                                   for i in range(args.reps))
    for rep in range(1, args.reps):
        drop_caches()
        t0 = time.perf_counter()
        raw_read(raw_path)
        load_t["raw read (4 files)"].append(time.perf_counter() - t0)

    # resharded load: each of 2 "ranks" loads one half of a stored 256 MiB tensor
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
    big = torch.randn(8192, 8192)  # 256 MiB
    big_path = os.path.join(args.dir, "big")
    dcp.save({"t": big}, storage_writer=DataStatesWriter(big_path), no_dist=True)
    amp = []
    for half in (0, 1):
        r = DataStatesReader(big_path)
        r.set_up_storage_reader(r.read_metadata(), True)
        dest = torch.empty(4096, 8192)

        class P(DefaultLoadPlanner):
            def resolve_tensor(self, ri):
                return dest
        p = P()
        p.state_dict = {}
        ri = ReadItem(LoadItemType.TENSOR, MetadataIndex("t", (half * 4096, 0)), torch.Size((0, 0)),
                      MetadataIndex("t", (0, 0)), torch.Size((half * 4096, 0)), torch.Size((4096, 8192)))
        r.read_data(LoadPlan([ri]), p).wait()
        assert torch.equal(dest, big[half * 4096:(half + 1) * 4096])
        amp.append(r.bytes_read / r.bytes_needed)

    med = {n: statistics.median(v) for n, v in times.items()}
    print()
    print(f"{'save (durable)':<34} {'median s':>9} {'GB/s':>7}")
    for n in names:
        print(f"{n:<34} {med[n]:>9.2f} {size / med[n] / 1e9:>7.2f}")
    print(f"\nsave: dcp-datastates vs best FileSystemWriter ({best_fs}): {save_ratio:.2f}x faster "
          f"(median of per-round ratios); reaches {raw_frac * 100:.0f}% of the better raw write+fsync bandwidth")
    raw_best = min(med[r] for r in raw_names)
    print(f"      a 2.0x save needs {med[best_fs] / 2:.2f}s: {raw_best / (med[best_fs] / 2):.2f}x the "
          f"raw write+fsync bandwidth of this disk")
    lm = {n: statistics.median(v) for n, v in load_t.items()}
    print(f"load ({'cold: page cache dropped' if dropped else 'WARM: could not drop page cache'}): "
          f"dcp-datastates {lm['dcp-datastates']:.2f}s, FileSystemReader {lm['FileSystemReader']:.2f}s, "
          f"ratio {load_ratio:.2f}x; raw read of the same bytes {lm['raw read (4 files)']:.2f}s "
          f"(dcp-datastates at {lm['raw read (4 files)'] / lm['dcp-datastates'] * 100:.0f}% of it; a 2.0x load "
          f"needs {lm['FileSystemReader'] / 2:.2f}s)")
    print(f"resharded load (2 ranks x half of 256 MiB): bytes read / bytes needed = "
          f"{amp[0]:.3f}, {amp[1]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "save_s": times, "load_s": load_t, "save_ratio": save_ratio,
                       "raw_frac": raw_frac, "load_ratio": load_ratio, "reshard_amp": amp,
                       "cold": dropped}, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
