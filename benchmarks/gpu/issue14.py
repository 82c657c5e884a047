"""Issue 14 on a GPU machine, in one run: the device cache level, the first-save stall, loads
onto the GPU, D2H against the pinned peak, and bit-exact round trips.

    PYTHONPATH=. python3 benchmarks/gpu/issue14.py --out DIR [--budget 420] [--steps 60] [--load-reps 2]
                                                   [--only SECTIONS] [--plans PLANS]
    PYTHONPATH=. python3 benchmarks/gpu/issue14.py --out DIR --dry-run   # CPU, tiny sizes: checks the script

Sections (each independent: a failure is recorded and the next runs), results in
DIR/issue14.json and on stdout:

  env        versions, device, cuda-python
  d2h        the engine's snapshot rate (device -> pinned host cache) vs one plain
             cudaMemcpyAsync into pinned memory (target >= 85%); and into the device cache
  roundtrip  fp32, bf16, fp16, int8, non-contiguous: async and sync saves, device cache on and
             off, loaded onto the GPU whole (streamed through pinned slabs) and as a cast or a
             non-contiguous destination (cut out on the device); bit-exact
  workload   the issue's run: 6 x Linear(8192, 8192) fp32 + Adam (4.83 GB of state), a
             checkpoint every 20 steps (3), the previous save awaited before the next, the
             stall measured up to the optimizer step: DCP's default stager, DCP's pinned
             DefaultStager, ours with host cache = state, = 1/4, and device cache >= state
             with host cache = 1/4 (RSS growth, restore bit-exact)
  load       cold load of the last checkpoint onto the GPU (page cache dropped) against
             FileSystemReader of the same state and raw O_DIRECT / buffered reads of our files
  load_split the same kind of cold load taken apart: raw reads in the reader's pattern, plus the
             copy into a pinned slab, plus the upload; the reader into GPU tensors with and
             without digests, buffered, and into host tensors, fresh, already written, and
             written and page-aligned (a negative time: not bit-exact)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

T0 = time.monotonic()
RESULTS: dict = {}
ARGS = argparse.Namespace(out=".", budget=420.0, dry_run=False)
MiB, GiB = 1 << 20, 1 << 30


def save_results() -> None:
    with open(os.path.join(ARGS.out, "issue14.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def section(fn):
    name = fn.__name__
    left = ARGS.budget - (time.monotonic() - T0)
    if left < 20:
        RESULTS[name] = {"skipped": f"time budget exhausted ({left:.0f}s left)"}
    else:
        t = time.monotonic()
        try:
            RESULTS[name] = fn()
            RESULTS[name]["seconds"] = round(time.monotonic() - t, 1)
        except BaseException as e:  # noqa: BLE001 - recorded, the next section runs
            RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    print(f"[{name}] {json.dumps(RESULTS[name], default=str)[:2500]}", flush=True)
    save_results()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return fn


def dev() -> torch.device:
    return torch.device("cuda", 0) if not ARGS.dry_run else torch.device("cpu")


def sync() -> None:
    if dev().type == "cuda":
        torch.cuda.synchronize()


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    out = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in names:
                out[key] = int(rest.split()[0]) * 1024
    return out


# where host memory can hide from VmRSS: pinned pages (VmPin, VmLck), the anonymous, file-backed
# and shared parts of RSS, and the machine's used memory (MemTotal - MemAvailable), which grows
# with any pinned allocation, however the driver maps it
_STATUS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmPin", "VmLck")


def mem_status() -> dict[str, float]:
    """This process's memory counters and the machine's used memory, in GB."""
    got = _kib_fields("/proc/self/status", _STATUS)
    info = _kib_fields("/proc/meminfo", ("MemTotal", "MemAvailable"))
    got["machine_used"] = info.get("MemTotal", 0) - info.get("MemAvailable", 0)
    return {k: round(v / 1e9, 3) for k, v in got.items()}


class PeakRSS:
    """Samples RSS every 10 ms on a thread while open; the other counters (``mem_status``) at
    the start and the end."""

    def __enter__(self):
        self.start = self.peak = rss()
        self.status_start = mem_status()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())
        self.status_end = mem_status()


def drop_page_cache(paths: list[str]) -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        from dcp_datastates.tiers.direct_io import evict_from_page_cache
        for p in paths:
            evict_from_page_cache(p)
        return "fadvise"


def init_pg() -> None:
    if dist.is_initialized():
        return
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    backend = "cpu:gloo,cuda:nccl" if dev().type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=420)
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: check the script itself")
    ap.add_argument("--only", default=None, help="comma-separated sections (env always runs)")
    ap.add_argument("--plans", default=None, help="comma-separated workload plans (default: all)")
    ap.add_argument("--steps", type=int, default=60, help="workload steps (a checkpoint every steps/3)")
    ap.add_argument("--load-reps", type=int, default=2)
    ap.add_argument("--split-tensors", type=int, default=None,
                    help="load_split's state: this many 8192 x 8192 fp32 tensors (default 18; a dry run 4 small)")
    global ARGS
    ARGS = ap.parse_args()
    os.makedirs(ARGS.out, exist_ok=True)
    if not ARGS.dry_run and not torch.cuda.is_available():
        print("nothing to check: no CUDA device (use --dry-run to exercise the script on CPU)")
        return 0
    import cuda_ext
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_datastates import DataStatesReader, DataStatesWriter, async_save
    from dcp_datastates.engine import CopyItem, HostCache, SnapshotEngine
    from dcp_datastates.engine.device_cache import DeviceCache
    from dcp_datastates.tiers import read_path
    from dcp_datastates.tiers.direct_io import StagingBuffer, dio_alignment, pread_full

    scratch = ARGS.scratch or tempfile.mkdtemp(prefix="dcpds-i14-")
    only = set(ARGS.only.split(",")) if ARGS.only else None
    small = ARGS.dry_run

    def wanted(name):
        return only is None or name in only

    class NullSink:
        name = "null"
        o_direct = False

        def reserve(self, n):
            return 0

        def pwrite(self, buf, offset, logical=None):
            pass

        def close(self, sync=True):
            return 0

        def abort(self):
            pass

    @section
    def env():
        import importlib.metadata as md
        vers = {}
        for p in ("cuda-bindings", "cuda-python", "msgpack", "fsspec", "xxhash", "numpy"):
            try:
                vers[p] = md.version(p)
            except md.PackageNotFoundError:
                vers[p] = None
        return {"torch": torch.__version__, "cuda": torch.version.cuda,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (dry run)",
                "cuda_ext_available": cuda_ext.available(), "reason": cuda_ext.unavailable_reason(),
                "packages": vers, "cpus": os.cpu_count(), "scratch": scratch,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}

    if dev().type == "cuda" and not cuda_ext.available():
        save_results()
        return 1

    def d2h():
        n = (64 * MiB) if small else 4 * GiB
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev())
        peak = []
        if dev().type == "cuda":
            _h, host = cuda_ext.pinned_buffer(n, 0)
            host.fill_(1)
            rt, stream = cuda_ext._runtime(), cuda_ext.copy_stream(0)
            for _ in range(3):
                sync()
                t = time.perf_counter()
                cuda_ext.check(rt.cudaMemcpyAsync(host.data_ptr(), src.data_ptr(), n,
                                                  rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream), "memcpy")
                cuda_ext.check(rt.cudaStreamSynchronize(stream), "sync")
                peak.append(n / (time.perf_counter() - t) / 1e9)
            del host, _h
        cache = HostCache(n + 64 * MiB, pinned=dev().type == "cuda")
        cache.buffer().fill_(0)
        eng = SnapshotEngine(cache, io_threads=8)
        dc = DeviceCache(n + 64 * MiB, dev())
        dc.buffer()
        srcs = [src[i * (n // 16):(i + 1) * (n // 16)].view(torch.float32) for i in range(16)]
        rates = {"host": [], "device_cache": []}
        for label, level in (("host", None), ("device_cache", dc)):
            for _ in range(3):
                items = [CopyItem(f"t{i}", s, i * (n // 16), n // 16) for i, s in enumerate(srcs)]
                ready = cuda_ext.record_ready(0) if dev().type == "cuda" else None
                t = time.perf_counter()
                job = eng.submit(items, [NullSink()], copy=True, ready_event=ready, device_cache=level)
                job.wait_snapshot()
                rates[label].append(n / (time.perf_counter() - t) / 1e9)
                job.durable.result()
        eng.stop()
        out = {"bytes": n, "pinned_peak_GBps": [round(x, 1) for x in peak],
               "engine_snapshot_GBps": [round(x, 1) for x in rates["host"]],
               "device_cache_snapshot_GBps": [round(x, 1) for x in rates["device_cache"]]}
        if peak:
            out["engine_vs_peak"] = round(max(rates["host"]) / max(peak), 3)
        return out
    if wanted("d2h"):
        section(d2h)

    def roundtrip():
        g = torch.Generator(device=dev()).manual_seed(0)
        k = 1 if small else 64

        def state():
            return {"f32": torch.randn(k * MiB // 4, 4, generator=g, device=dev()),
                    "bf16": torch.randn(k * MiB // 2, generator=g, device=dev()).bfloat16(),
                    "f16": torch.randn(k * MiB // 2, generator=g, device=dev()).half(),
                    "i8": torch.randint(-128, 127, (k * MiB + 3,), dtype=torch.int8, generator=g, device=dev()),
                    "nc": torch.randn(1024, k * 256, generator=g, device=dev()).t(),
                    "small": {str(i): torch.randn(1000 + i, generator=g, device=dev()) for i in range(100)}}

        def flat(sd, p=""):
            for key, v in sd.items():
                if isinstance(v, dict):
                    yield from flat(v, f"{p}{key}.")
                else:
                    yield p + key, v

        out = {}
        for mode in ("async", "sync"):
            for dcb in (0, (8 if small else 512) * MiB):
                sd = state()
                want = {n: t.clone() for n, t in flat(sd)}
                path = os.path.join(scratch, f"rt-{mode}-{dcb}")
                w = DataStatesWriter(path, host_cache_bytes=(4 if small else 128) * MiB, device_cache_bytes=dcb)
                if mode == "async":
                    fut = async_save(sd, storage_writer=w)
                    w.wait_snapshot()
                    for _n, t in flat(sd):  # training moves on: the checkpoint must not see it
                        t.add_(1)
                    fut.result()
                else:
                    dcp.save(sd, storage_writer=w)
                res = {}
                # whole tensors (streamed through pinned slabs), then cast and non-contiguous
                # destinations (cut out on the device)
                tmpl = {n: torch.zeros_like(t) for n, t in want.items()}
                nested = {"f32": tmpl["f32"], "bf16": tmpl["bf16"], "f16": tmpl["f16"], "i8": tmpl["i8"],
                          "nc": tmpl["nc"], "small": {str(i): tmpl[f"small.{i}"] for i in range(100)}}
                r = DataStatesReader(path)
                dcp.load(nested, storage_reader=r)
                res["whole_exact"] = all(torch.equal(tmpl[n], want[n]) for n in want)
                cast = {"f32": torch.zeros(want["f32"].shape, dtype=torch.float64, device=dev())}
                dcp.load(cast, storage_reader=DataStatesReader(path))
                res["cast_exact"] = torch.equal(cast["f32"], want["f32"].double())
                nc_dest = {"nc": torch.zeros(want["nc"].shape[1], want["nc"].shape[0], device=dev()).t()}
                dcp.load(nc_dest, storage_reader=DataStatesReader(path))
                res["noncontiguous_dest_exact"] = torch.equal(nc_dest["nc"], want["nc"])
                out[f"{mode}_device_cache_{dcb >> 20}MiB"] = res
                shutil.rmtree(path, ignore_errors=True)
        out["all_exact"] = all(all(v.values()) for v in out.values() if isinstance(v, dict))
        return out
    if wanted("roundtrip"):
        section(roundtrip)

    init_pg()
    width = 512 if small else 8192
    depth = 6
    steps, every = (6, 2) if small else (ARGS.steps, max(1, ARGS.steps // 3))
    batch = 64 if small else int(os.environ.get("I14_BATCH", "4096"))
    keep: dict = {}

    def workload():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)]).to(dev())
        opt = torch.optim.Adam(model.parameters(), lr=1e-5)
        x = torch.randn(batch, width, device=dev())

        def fwd_bwd():
            model(x).pow(2).mean().backward()

        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()
        state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
        t = time.perf_counter()
        for _ in range(3):
            fwd_bwd()
            opt.step()
            opt.zero_grad(set_to_none=False)
        sync()
        step_s = (time.perf_counter() - t) / 3
        out = {"state_GB": round(state_bytes / 1e9, 2), "step_s": round(step_s, 3), "batch": batch}

        def app():
            return {"model": model.state_dict(), "optim": opt.state_dict()}

        def run(name, start_save, wait_before_step, *, check=False):
            """``steps`` steps, a checkpoint every ``every``; stall = save call + wait before the
            step, per checkpoint; the previous save is awaited before the next one (and then
            deleted: only the last checkpoint of a run is kept, for the load section)."""
            stalls, commits, pending = [], [], None
            shutil.rmtree(os.path.join(scratch, name), ignore_errors=True)
            with PeakRSS() as mem:
                prepared = start_save(None)  # construction at startup (the cache is prepared)
                for s in range(1, steps + 1):
                    fwd_bwd()
                    handle = None
                    if s % every == 0:
                        if pending is not None:
                            pending[0].result()
                            commits.append(time.perf_counter() - pending[1])
                            shutil.rmtree(pending[2], ignore_errors=True)
                        sync()
                        t0 = time.perf_counter()
                        handle = start_save(os.path.join(scratch, name, f"step-{s}"))
                        wait_before_step(handle)
                        sync()
                        stalls.append(time.perf_counter() - t0)
                        pending = (handle[0], t0, os.path.join(scratch, name, f"step-{s}"))
                        if check and s == steps:
                            keep[name] = {k: v.detach().clone() for k, v in _flat(app()).items()}
                    opt.step()
                    opt.zero_grad(set_to_none=False)
                pending[0].result()
                commits.append(time.perf_counter() - pending[1])
            del prepared
            res = {"stall_s": [round(v, 3) for v in stalls], "commit_s": [round(v, 2) for v in commits],
                   "rss_growth_GB": round((mem.peak - mem.start) / 1e9, 2),
                   "rss_start_GB": round(mem.start / 1e9, 2), "rss_end_GB": round(rss() / 1e9, 2),
                   "mem_start_GB": mem.status_start, "mem_end_GB": mem.status_end}
            if len(stalls) > 1:
                steady = sum(stalls[1:]) / len(stalls[1:])
                res["first_vs_steady"] = round(stalls[0] / max(steady, 1e-9), 2)
            return res

        def dcp_default(path):
            if path is None:
                return None
            return (dcp.async_save(app(), checkpoint_id=path),)

        def dcp_pinned(path):
            if path is None:
                return None
            # fresh per save (torch < 2.13 breaks on a reused one); pinned needs the GPU
            st = DefaultStager(StagingOptions(True, True, True, True) if dev().type == "cuda"
                               else StagingOptions(False, True, True, False))
            r = dcp.async_save(app(), checkpoint_id=path, async_stager=st,
                               async_checkpointer_type=AsyncCheckpointerType.THREAD)
            r.upload_completion.add_done_callback(lambda _f: st.close())
            return (r.upload_completion, r.staging_completion)

        def ours(host, device):
            def go(path):
                w = DataStatesWriter(path or os.path.join(scratch, "unused"), host_cache_bytes=host,
                                     device_cache_bytes=device, overwrite=True)
                if path is None:
                    return w
                return (async_save(app(), storage_writer=w), w)
            return go

        q = int(state_bytes / 4)
        full = int(state_bytes * 1.05)
        # ours with the device cache first: its RSS growth then includes allocating its host cache
        plans = [("dcp_default", dcp_default, lambda h: None, True),
                 ("dcp_pinned_DefaultStager", dcp_pinned, lambda h: h[1].result(), False),
                 ("ours_device_full_host_quarter", ours(q, full), lambda h: h[1].wait_snapshot(), True),
                 ("ours_host_quarter", ours(q, 0), lambda h: h[1].wait_snapshot(), False),
                 ("ours_host_full", ours(full, 0), lambda h: h[1].wait_snapshot(), False)]
        if ARGS.plans:
            plans = [p for p in plans if p[0] in ARGS.plans.split(",")]
        for name, fn, wait, check in plans:
            if time.monotonic() - T0 > ARGS.budget - 60:
                out[name] = "skipped: budget"
                continue
            try:
                out[name] = run(name, fn, wait, check=check)
                out[name]["mean_stall_s"] = round(sum(out[name]["stall_s"]) / len(out[name]["stall_s"]), 3)
            except BaseException as e:  # noqa: BLE001
                out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
            print(f"  workload {name}: {out[name]}", flush=True)
            if name not in ("dcp_default", "ours_device_full_host_quarter"):
                shutil.rmtree(os.path.join(scratch, name), ignore_errors=True)
            save_results()
        if "ours_device_full_host_quarter" in keep:
            o = out["ours_device_full_host_quarter"]
            o["host_cache_GB"] = round(q / 1e9, 2)
            o["rss_within_host_cache_plus_15pct"] = o["rss_growth_GB"] <= q * 1.15 / 1e9
            path = os.path.join(scratch, "ours_device_full_host_quarter", f"step-{steps}")
            want = keep["ours_device_full_host_quarter"]
            tmpl = {k: torch.zeros_like(v) for k, v in want.items()}
            dcp.load(tmpl, storage_reader=DataStatesReader(path))
            o["restore_bit_exact"] = all(torch.equal(tmpl[k], v) for k, v in want.items())
            keep["ours_path"] = path
            keep["dcp_path"] = os.path.join(scratch, "dcp_default", f"step-{steps}")
        return out
    if wanted("workload"):
        section(workload)

    def load():
        if "ours_path" not in keep:
            return {"skipped": "needs the workload's checkpoints"}
        ours_path, dcp_path = keep["ours_path"], keep["dcp_path"]
        out = {}

        def timed_load(reader, expect):
            tmpl = {k: torch.empty_like(v) for k, v in expect.items()}
            sync()
            t = time.perf_counter()
            dcp.load(tmpl, storage_reader=reader)
            sync()
            dt = time.perf_counter() - t
            ok = all(torch.equal(tmpl[k], v) for k, v in expect.items())
            return dt, ok

        files = [os.path.join(ours_path, n) for n in sorted(os.listdir(ours_path)) if not n.startswith(".")]
        nbytes = sum(os.path.getsize(f) for f in files)

        for rep in range(ARGS.load_reps):
            for name, fn in (("raw_odirect", lambda: _raw_files(files, True)),
                             ("raw_buffered", lambda: _raw_files(files, False)),
                             ("ours", lambda: timed_load(DataStatesReader(ours_path),
                                                         keep["ours_device_full_host_quarter"])),
                             ("dcp_FileSystemReader", lambda: timed_load(dcp.FileSystemReader(dcp_path),
                                                                         keep["dcp_default"]))):
                how = drop_page_cache([ours_path, dcp_path])
                read_path.forget()  # each cold load probes as a fresh process would
                r = fn()
                dt, ok = (r, True) if isinstance(r, float) else r
                out.setdefault(name, []).append(round(dt, 2))
                for dev_id, c in read_path.choices().items():  # what this load's probe chose
                    out.setdefault("read_path_choice", {}).setdefault(name, []).append(f"{dev_id}: {c.describe()}")
                if not ok:
                    out[f"{name}_mismatch"] = True
        best = {k: min(v) for k, v in out.items() if isinstance(v, list)}
        raw_best = min(best["raw_odirect"], best["raw_buffered"])
        out.update({"bytes": nbytes, "page_cache": how, "ours_vs_best_raw": round(raw_best / best["ours"], 3),
                    "ours_vs_dcp": round(best["dcp_FileSystemReader"] / best["ours"], 2),
                    "alignment": str(_alignment(files[0], dio_alignment))})
        return out
    if wanted("load"):
        section(load)

    def load_split():
        """Where a cold load onto the GPU loses against the raw read: the same bytes read cold
        in steps that add one part of the reader's GPU path at a time (the 16 MiB pieces and
        4 MiB O_DIRECT requests of the reader, the copy from the O_DIRECT stage into a pinned
        slab, the upload and its wait), and the reader itself into GPU tensors, into GPU tensors
        without digests, buffered, and into host tensors."""
        n_t = ARGS.split_tensors or (4 if small else 18)
        side = 512 if small and not ARGS.split_tensors else 8192
        path = os.path.join(scratch, "split")
        g = torch.Generator(device=dev()).manual_seed(1)
        sd = {f"w{i}": torch.randn(side, side, generator=g, device=dev()) for i in range(n_t)}
        dcp.save(sd, storage_writer=DataStatesWriter(path, host_cache_bytes=(16 if small else 1024) * MiB))
        files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.startswith("data-")]
        piece, req = 16 * MiB, 4 * MiB
        pieces = [(f, o) for f in files for o in range(0, os.path.getsize(f), piece)]
        cuda = dev().type == "cuda"
        up_stream = torch.cuda.Stream() if cuda else None
        kits: queue.SimpleQueue = queue.SimpleQueue()  # one (stage, pinned slab, device piece) a thread
        for _ in range(8):
            kits.put(types.SimpleNamespace(
                stage=StagingBuffer(req), dst=torch.empty(piece, dtype=torch.uint8, device=dev()),
                slab=cuda_ext.pinned_buffer(piece, 0)[1] if cuda else _page_aligned_bytes(piece),
                # two candidate fixes: a second slab, so that a piece is read while the one
                # before uploads; and a slab in 2 MiB huge pages, pinned where it lies
                # (cudaHostRegister), which O_DIRECT can fill in whole 4 MiB requests
                slab2=cuda_ext.pinned_buffer(piece, 0)[1] if cuda else _page_aligned_bytes(piece),
                huge=_huge_slab(piece, cuda), pending=[]))

        def raw_pieces(memmove: bool, upload: bool, into_slab: bool = False, huge: bool = False,
                       overlap: bool = False):
            def one(job):
                f, off = job
                local = kits.get()
                try:
                    read_one(f, off, local)
                finally:
                    kits.put(local)

            def read_one(f, off, local):
                if overlap:  # read into the slab whose upload is not the newest; wait for it first
                    local.slab, local.slab2 = local.slab2, local.slab
                    if len(local.pending) > 1:
                        local.pending.pop(0).synchronize()
                slab = local.huge[0] if huge else local.slab
                fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
                try:
                    got = 0
                    while got < piece:
                        if into_slab:  # O_DIRECT straight into the slab (4 KiB pages, or huge ones)
                            r = pread_full(fd, memoryview(slab.numpy())[got:got + req], off + got)
                            got += r
                            if r < req:
                                break
                            continue
                        r = pread_full(fd, local.stage.view, off + got)
                        if memmove and r:
                            ctypes.memmove(slab.data_ptr() + got, local.stage.address, r)
                        got += r
                        if r < req:
                            break
                finally:
                    os.close(fd)
                if upload and cuda:
                    with torch.cuda.stream(up_stream):
                        local.dst[:got].copy_(slab[:got], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(up_stream)
                    if overlap:
                        local.pending.append(ev)
                    else:
                        ev.synchronize()
            t = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, pieces))
            sync()
            for _ in range(8):  # no upload left pending into the next row
                local = kits.get()
                local.pending.clear()
                kits.put(local)
            return time.perf_counter() - t

        def page_aligned(v):
            raw = torch.zeros(v.numel() * v.element_size() + 4096, dtype=torch.uint8)
            shift = (-raw.data_ptr()) % 4096
            return raw[shift:shift + v.numel() * v.element_size()].view(v.dtype).view(v.shape)

        def ours(device, touched=False, aligned=False, **kw):
            new = torch.zeros if touched else torch.empty  # touched: no page faults on the first write
            tmpl = {k: page_aligned(v) if aligned else new(v.shape, dtype=v.dtype, device=device)
                    for k, v in sd.items()}
            sync()
            t = time.perf_counter()
            dcp.load(tmpl, storage_reader=DataStatesReader(path, **kw))
            sync()
            dt = time.perf_counter() - t
            ok = all(torch.equal(tmpl[k].to(dev()), sd[k]) for k in ("w0", f"w{n_t - 1}"))
            return dt if ok else -dt

        steps = (("raw_files", lambda: _raw_files(files, True)),
                 ("raw_pieces", lambda: raw_pieces(False, False)),
                 ("raw_pieces_memmove", lambda: raw_pieces(True, False)),
                 ("raw_pieces_memmove_upload", lambda: raw_pieces(True, True)),
                 ("raw_pieces_into_slab", lambda: raw_pieces(False, False, into_slab=True)),
                 ("raw_pieces_memmove_upload_overlap", lambda: raw_pieces(True, True, overlap=True)),
                 ("raw_pieces_into_huge_slab_upload", lambda: raw_pieces(False, True, into_slab=True, huge=True)),
                 ("ours_gpu", lambda: ours(dev())),
                 ("ours_gpu_direct", lambda: ours(dev(), o_direct=True)),  # no probe: O_DIRECT
                 ("ours_gpu_noverify", lambda: ours(dev(), verify=False)),
                 ("ours_gpu_buffered", lambda: ours(dev(), o_direct=False)),
                 ("ours_host", lambda: ours("cpu")),
                 ("ours_host_touched", lambda: ours("cpu", touched=True)),
                 ("ours_host_aligned", lambda: ours("cpu", aligned=True)))
        out: dict = {"bytes": sum(os.path.getsize(f) for f in files), "files": len(files)}
        for _rep in range(2):
            for name, fn in steps:
                drop_page_cache([path])
                read_path.forget()
                out.setdefault(name, []).append(round(fn(), 3))
                for dev_id, c in read_path.choices().items():  # what the probe chose, if it ran
                    out.setdefault("read_path_choice", {}).setdefault(name, []).append(f"{dev_id}: {c.describe()}")
        shutil.rmtree(path, ignore_errors=True)
        out["GBps_best"] = {k: round(out["bytes"] / min(v) / 1e9, 2) for k, v in out.items()
                            if isinstance(v, list) and isinstance(v[0], float) and min(v) > 0}
        return out
    if wanted("load_split"):
        section(load_split)

    shutil.rmtree(scratch, ignore_errors=True)
    RESULTS["total_seconds"] = round(time.monotonic() - T0, 1)
    save_results()
    return 0


def _raw_files(files: list[str], direct: bool) -> float:
    """Every file read once, 4 MiB requests, one thread per file (as the files were written),
    O_DIRECT into aligned memory or buffered: the raw read a load is measured against."""
    from dcp_datastates.tiers.direct_io import StagingBuffer, pread_full  # as main() imports them
    def one(f):
        fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        buf = StagingBuffer(4 * MiB)
        try:
            off = 0
            while True:
                got = pread_full(fd, buf.view, off)
                off += got
                if got < buf.nbytes:
                    return off
        finally:
            buf.close()
            os.close(fd)
    t = time.perf_counter()
    with ThreadPoolExecutor(len(files)) as pool:
        list(pool.map(one, files))
    return time.perf_counter() - t


def _huge_slab(n: int, cuda: bool) -> tuple[torch.Tensor, object]:
    """``n`` bytes in 2 MiB transparent huge pages as a uint8 tensor, registered with CUDA as
    pinned memory where a GPU is used (the buffer is kept beside it)."""
    from dcp_datastates.tiers.direct_io import StagingBuffer  # as main() imports it
    buf = StagingBuffer(n)
    if cuda:
        err = torch.cuda.cudart().cudaHostRegister(buf.address, buf.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
    return torch.frombuffer(buf.view, dtype=torch.uint8)[:n], buf


def _page_aligned_bytes(n: int) -> torch.Tensor:
    """``n`` zeroed bytes at a 4 KiB-aligned address in 4 KiB pages (as pinned memory is)."""
    raw = torch.zeros(n + 4096, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % 4096
    return raw[shift:shift + n]


def _alignment(path, dio_alignment):
    fd = os.open(path, os.O_RDONLY)
    try:
        return dio_alignment(fd)
    finally:
        os.close(fd)


def _flat(sd, p=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{p}{k}."))
        elif isinstance(v, torch.Tensor):
            out[p + str(k)] = v
    return out


if __name__ == "__main__":
    sys.exit(main())
