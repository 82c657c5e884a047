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
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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


def cold_loads(tmpl: dict, sd: dict, ours_path: str, ref_path: str, reps: int,
               raw_path: str | None = None) -> tuple[dict, float]:
    """Alternating cold loads of both checkpoints into ``tmpl``; the raw read of ``raw_path``
    before each of ours.  Returns times per method and our share of bytes read with O_DIRECT."""
    load_t: dict[str, list[float]] = {"dcp-datastates": [], "FileSystemReader": []}
    if raw_path:
        load_t["raw read (4 files)"] = []
        load_t["raw O_DIRECT read"] = []
    direct = []
    for rep in range(reps):
        for n in (["dcp-datastates", "FileSystemReader"] if rep % 2 == 0 else ["FileSystemReader", "dcp-datastates"]):
            if raw_path and n == "dcp-datastates":
                drop_caches()
                t0 = time.perf_counter()
                raw_read(raw_path)
                load_t["raw read (4 files)"].append(time.perf_counter() - t0)
                drop_caches()
                t0 = time.perf_counter()
                raw_read_direct(raw_path)
                load_t["raw O_DIRECT read"].append(time.perf_counter() - t0)
            for v in tmpl.values():
                v.zero_()
            reader = DataStatesReader(ours_path) if n == "dcp-datastates" else dcp.FileSystemReader(ref_path)
            drop_caches()
            t0 = time.perf_counter()
            dcp.load(tmpl, storage_reader=reader, no_dist=True)
            load_t[n].append(time.perf_counter() - t0)
            assert all(torch.equal(tmpl[k], sd[k]) for k in sd), n
            if n == "dcp-datastates":
                direct.append(reader.bytes_direct / reader.bytes_read)
    return load_t, statistics.median(direct)


def restart_load(ours_path: str, ref_path: str, raw_path: str, gb: float, reps: int) -> int:
    """Child process: build the state as the trainer did (the model of a restarted job), then
    load both checkpoints into it, cold.  Prints one JSON line."""
    sd = transformer_state(gb)
    tmpl = {k: torch.empty_like(v) for k, v in sd.items()}
    load_t, direct = cold_loads(tmpl, sd, ours_path, ref_path, reps, raw_path)
    print(json.dumps({"load_s": load_t, "direct": direct}))
    return 0


def raw_read_direct(path: str, threads: int = 8) -> int:
    """Read every file of ``path`` once with O_DIRECT, 16 MiB requests on ``threads`` threads
    into per-thread huge-page buffers, no copy: the device's cold read ceiling."""
    from dcp_datastates.tiers.direct_io import StagingBuffer
    piece = 16 << 20
    jobs = []
    for name in sorted(os.listdir(path)):
        size = os.path.getsize(os.path.join(path, name))
        jobs += [(name, off) for off in range(0, size, piece)]
    fds = {n: os.open(os.path.join(path, n), os.O_RDONLY | os.O_DIRECT) for n, _ in jobs}
    local = threading.local()
    bufs = []

    def one(job) -> int:
        b = getattr(local, "buf", None)
        if b is None:
            b = local.buf = StagingBuffer(piece)
            bufs.append(b)
        return os.preadv(fds[job[0]], [b.view[:piece]], job[1])
    try:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(one, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)
        for b in bufs:
            b.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dcpds-bench")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--restart-load", nargs=3, metavar=("OURS", "REF", "RAW"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.restart_load:
        return restart_load(*args.restart_load, args.gb, args.reps)

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
    raw_path = os.path.join(args.dir, f"save-{last}-{names.index('raw write+fsync (4 files)')}")
    dropped = drop_caches()
    # A restart: a fresh process builds the model with the same code, then loads into it.
    out = subprocess.run([sys.executable, __file__, "--restart-load", ours_path, ref_path, raw_path,
                          "--gb", str(args.gb), "--reps", str(args.reps)],
                         capture_output=True, text=True, check=True)
    restart = json.loads(out.stdout.strip().splitlines()[-1])
    load_t = restart["load_s"]
    # The same loads in this long-lived process, into tensors allocated now, after twenty saves
    # of allocation churn: their page phases no longer match the saved tensors'.
    tmpl = {k: torch.empty_like(v) for k, v in sd.items()}
    churn_t, churn_direct = cold_loads(tmpl, sd, ours_path, ref_path, args.reps)
    load_ratio = statistics.median(load_t["FileSystemReader"][i] / load_t["dcp-datastates"][i]
                                   for i in range(args.reps))
    churn_ratio = statistics.median(churn_t["FileSystemReader"][i] / churn_t["dcp-datastates"][i]
                                    for i in range(args.reps))

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
    cm = {n: statistics.median(v) for n, v in churn_t.items()}
    print(f"load ({'cold: page cache dropped' if dropped else 'WARM: could not drop page cache'}), "
          f"restarted process: dcp-datastates {lm['dcp-datastates']:.2f}s, FileSystemReader "
          f"{lm['FileSystemReader']:.2f}s, ratio {load_ratio:.2f}x; {restart['direct'] * 100:.0f}% of bytes "
          f"read through O_DIRECT; raw reads of the same bytes: buffered {lm['raw read (4 files)']:.2f}s, "
          f"O_DIRECT {lm['raw O_DIRECT read']:.2f}s (a 2.0x load needs {lm['FileSystemReader'] / 2:.2f}s, "
          f"{lm['raw O_DIRECT read'] / (lm['FileSystemReader'] / 2):.2f}x the device's O_DIRECT read bandwidth)")
    print(f"load, long-lived process (destinations allocated after the saves): dcp-datastates "
          f"{cm['dcp-datastates']:.2f}s, FileSystemReader {cm['FileSystemReader']:.2f}s, ratio "
          f"{churn_ratio:.2f}x; {churn_direct * 100:.0f}% of bytes read with O_DIRECT")
    print(f"resharded load (2 ranks x half of 256 MiB): bytes read / bytes needed = "
          f"{amp[0]:.3f}, {amp[1]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "save_s": times, "load_s": load_t, "save_ratio": save_ratio,
                       "raw_frac": raw_frac, "load_ratio": load_ratio, "direct": restart["direct"],
                       "churn_load_s": churn_t, "churn_ratio": churn_ratio, "churn_direct": churn_direct,
                       "reshard_amp": amp, "cold": dropped}, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
