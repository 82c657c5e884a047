"""GPU verification of the CUDA path (issues 3 and 8), run once on a GPU machine:

    PYTHONPATH=. python3 benchmarks/gpu/gpu_check.py --out DIR [--budget 420]

Sections, each independent (a failure is recorded and the next runs):
  env        versions and device
  d2h        engine device-to-host throughput vs one plain cudaMemcpyAsync into pinned memory
  roundtrip  bit-exact GPU -> storage -> GPU, fp32/bf16/fp16, multi-GB, sync and async save
  ordering   10 snapshots taken while the producer's and next iteration's kernels are queued
  stall      training-loop stall: DCP async (default stager, pinned DefaultStager) vs ours
Results go to DIR/gpu_results.json and stdout.  Exits 0 with "nothing to check" on a CPU box.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

T0 = time.monotonic()
RESULTS: dict = {}
OUT = "."
ONLY: set = set()


def save_results() -> None:
    with open(os.path.join(OUT, "gpu_results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def section(name, budget):
    def deco(fn):
        def run(*a, **kw):
            if ONLY and name not in ONLY and name != "env":
                return
            left = budget - (time.monotonic() - T0)
            if left < 20:
                RESULTS[name] = {"skipped": f"time budget exhausted ({left:.0f}s left)"}
                print(f"[{name}] skipped: budget", flush=True)
                return
            t = time.monotonic()
            try:
                RESULTS[name] = fn(*a, **kw)
                RESULTS[name]["seconds"] = round(time.monotonic() - t, 1)
            except BaseException as e:  # noqa: BLE001
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            print(f"[{name}] {json.dumps(RESULTS[name], default=str)[:1500]}", flush=True)
            save_results()
            gc.collect()
            torch.cuda.empty_cache()
        return run
    return deco


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class NullSink:
    """Discards bytes: isolates the copy path from storage speed."""
    name = "null"
    supports_random_writes = True

    def pwrite(self, buf, offset):
        pass

    def close(self, sync=True):
        return 0

    def abort(self):
        pass


def main() -> int:
    global OUT

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=420)
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--only", default=None, help="comma-separated sections to run (env always runs)")
    args = ap.parse_args()
    OUT = args.out
    if args.only:
        ONLY.update(args.only.split(","))
    os.makedirs(OUT, exist_ok=True)
    if not torch.cuda.is_available():
        print("nothing to check: no CUDA device")
        return 0
    import cuda_ext
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter, async_save
    from dcp_datastates.engine import CopyItem, HostCache, SnapshotEngine
    scratch = args.scratch or tempfile.mkdtemp(prefix="dcpds-gpu-")
    B = args.budget
    GiB = 1 << 30

    @section("env", B)
    def env():
        import importlib.metadata as md
        vers = {}
        for p in ("cuda-bindings", "cuda-python", "cuda-core", "msgpack", "fsspec", "xxhash", "numpy"):
            try:
                vers[p] = md.version(p)
            except Exception:
                vers[p] = None
        return {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
                "cuda_ext_available": cuda_ext.available(), "reason": cuda_ext.unavailable_reason(),
                "packages": vers, "cpus": os.cpu_count(), "scratch": scratch}
    env()
    if not cuda_ext.available():
        save_results()
        return 1

    @section("d2h", B)
    def d2h():
        rt = cuda_ext._runtime()
        n = 4 * GiB
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        t = time.monotonic()
        handle, host = cuda_ext.pinned_buffer(n + 64 * (1 << 20), 0)
        pin_s = time.monotonic() - t
        host[:n].fill_(1)  # fault in
        stream = cuda_ext.copy_stream(0)
        ceil = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            cuda_ext.check(rt.cudaMemcpyAsync(host.data_ptr(), src.data_ptr(), n,
                                              rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream), "memcpy")
            cuda_ext.check(rt.cudaStreamSynchronize(stream), "sync")
            ceil.append(n / (time.perf_counter() - t) / 1e9)
        ok_plain = torch.equal(host[:n].to("cuda"), src)
        # the engine: 16 x 256 MiB tensors through a pinned cache as large as the state
        del host, handle
        gc.collect()
        cache = HostCache(n + 256 * (1 << 20), pinned=True)
        cache.buffer()[:].fill_(0)
        eng = SnapshotEngine(cache, io_threads=8)
        srcs = [src[i * (n // 16):(i + 1) * (n // 16)].view(torch.float32) for i in range(16)]
        rates = []
        for _ in range(3):
            items = [CopyItem(f"t{i}", s, i * (n // 16), n // 16) for i, s in enumerate(srcs)]
            ready = cuda_ext.record_ready(0)
            t = time.perf_counter()
            job = eng.submit(items, [NullSink()], copy=True, ready_event=ready)
            job.wait_snapshot()
            rates.append(n / (time.perf_counter() - t) / 1e9)
            job.durable.result()
        # bit-exactness of what landed in the cache (single job, cache fresh per piece order)
        return {"pin_seconds_4GiB_cudaHostAlloc": round(pin_s, 2), "plain_memcpy_GBps": [round(x, 1) for x in ceil],
                "engine_snapshot_GBps": [round(x, 1) for x in rates],
                "engine_vs_ceiling": round(max(rates) / max(ceil), 3), "plain_copy_exact": ok_plain,
                "piece_bytes": eng.piece_bytes}
    d2h()

    @section("roundtrip", B)
    def roundtrip():
        torch.manual_seed(0)
        sd = {"f32": torch.randn(256 << 20 >> 2, 4, device="cuda"),            # 1 GiB... as (64Mi,4)
              "bf16": torch.randn(512 << 20 >> 1, device="cuda").bfloat16(),    # 512 MiB
              "f16": torch.randn(512 << 20 >> 1, device="cuda").half(),         # 512 MiB
              "f32_view": torch.randn(4096, 8192, device="cuda").t(),           # non-contiguous 128 MiB
              "small": [torch.randn(1000, device="cuda") for _ in range(200)]}
        sd["small"] = {str(i): t for i, t in enumerate(sd["small"])}
        total = sum(t.numel() * t.element_size() for t in [sd["f32"], sd["bf16"], sd["f16"], sd["f32_view"]])
        out = {}
        for mode in ("sync", "async", "sync_two_tier", "async_two_tier"):
            path = os.path.join(scratch, f"rt-{mode}")
            tier2 = os.path.join(scratch, f"rt-{mode}-tier2")
            two = mode.endswith("two_tier")
            w = DataStatesWriter(path, host_cache_bytes=1 * GiB, persist_to=[tier2] if two else None)
            t = time.perf_counter()
            if mode.startswith("sync"):
                dcp.save(sd, storage_writer=w, no_dist=True)
                snap = None
            else:
                fut = async_save(sd, storage_writer=w, no_dist=True)
                w.wait_snapshot()
                snap = time.perf_counter() - t
                fut.result()
            dt = time.perf_counter() - t
            if two:
                w.wait_persisted(300)
            persisted = time.perf_counter() - t
            res = {"save_s": round(dt, 2), "snapshot_s": None if snap is None else round(snap, 3),
                   "GB": round(total / 1e9, 2)}
            for label, where in (("tier1", path), ("tier2", tier2)) if two else (("tier1", path),):
                tmpl = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {kk: torch.zeros_like(vv) for kk, vv in v.items()})
                        for k, v in sd.items()}
                tl = time.perf_counter()
                dcp.load(tmpl, storage_reader=DataStatesReader(where), no_dist=True)  # this tier alone
                res[f"{label}_load_s"] = round(time.perf_counter() - tl, 2)
                res[f"{label}_bit_exact"] = all(torch.equal(tmpl[k], sd[k]) for k in ("f32", "bf16", "f16", "f32_view")) and \
                    all(torch.equal(tmpl["small"][k], sd["small"][k]) for k in sd["small"])
            if two:
                res["persisted_s"] = round(persisted, 2)
            out[mode] = res
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(tier2, ignore_errors=True)
        return out
    roundtrip()

    @section("ordering", B)
    def ordering():
        a = torch.randn(8192, 8192, device="cuda")
        base = torch.randn(64 << 20, device="cuda")  # 256 MiB state
        w_state = torch.empty_like(base)
        results = []
        for i in range(10):
            path = os.path.join(scratch, f"ord-{i}")
            for _ in range(8):
                a = torch.tanh(a @ a) * 0.5       # slow producer kernels queued first
            w_state.copy_(base * float(i + 1) + a[0, 0] * 0)  # the values the snapshot must see
            expected = base * float(i + 1)
            writer = DataStatesWriter(path, host_cache_bytes=64 << 20)  # cache << state
            fut = async_save({"w": w_state}, storage_writer=writer, no_dist=True)
            for _ in range(8):
                a = torch.tanh(a @ a) * 0.5       # next iteration's kernels, overlapping the copies
            writer.wait_snapshot()
            w_state.add_(1000.0)                  # in-place update after the barrier
            fut.result()
            out = {"w": torch.zeros_like(w_state)}
            dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
            results.append(bool(torch.equal(out["w"], expected)))
            shutil.rmtree(path, ignore_errors=True)
        return {"matches": results, "all_ok": all(results)}
    ordering()

    @section("stall", B)
    def stall():
        import torch.nn as nn
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        torch.manual_seed(0)
        width, depth = 8192, 10
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)]).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-5)
        x = torch.randn(4096, width, device="cuda")

        def step(before_update=None):
            model(x).float().pow(2).mean().backward()
            if before_update:
                before_update()
            opt.step()
            opt.zero_grad(set_to_none=False)

        step()
        torch.cuda.synchronize()
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        base = min(times)
        out = {"state_GB": round(state_bytes / 1e9, 2), "iteration_s": round(base, 3)}

        def measure(name, do_save, wait_before_update):
            path = os.path.join(scratch, f"stall-{name}")
            shutil.rmtree(path, ignore_errors=True)
            rss0 = rss_bytes()
            peak = rss0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = do_save(path)
            t1 = time.perf_counter()
            step(lambda: wait_before_update(handle))
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            fut = handle[0]
            while not fut.done():
                peak = max(peak, rss_bytes())
                time.sleep(0.01)
            fut.result()
            t3 = time.perf_counter()
            peak = max(peak, rss_bytes())
            shutil.rmtree(path, ignore_errors=True)
            return {"call_s": round(t1 - t0, 3), "stall_s": round((t2 - t0) - base, 3),
                    "commit_s": round(t3 - t0, 2), "rss_growth_GB": round((peak - rss0) / 1e9, 2)}

        def dcp_default(path):
            f = dcp.async_save(sd, checkpoint_id=path)
            return (f,)

        import torch.distributed as dist
        if not dist.is_initialized():
            import socket
            with socket.socket() as so:
                so.bind(("127.0.0.1", 0))
                port = so.getsockname()[1]
            dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=0, world_size=1)

        def dcp_pinned(kind):
            def go(path):
                # a fresh stager per save: torch 2.11/2.12 break on a reused DefaultStager
                # (KeyError: <class 'type'>, pytorch#170163 fix in PR #170431, repaired in 2.13)
                st = DefaultStager(StagingOptions(True, True, True, True))
                r = dcp.async_save(sd, checkpoint_id=path, async_stager=st,
                                   async_checkpointer_type=kind)
                r.upload_completion.add_done_callback(lambda _f: st.close())
                return (r.upload_completion, r.staging_completion)
            return go

        def ours(cache):
            def go(path):
                w = DataStatesWriter(path, host_cache_bytes=cache)
                f = async_save(sd, storage_writer=w)
                return (f, w)
            return go

        plans = [("dcp_default_stager_thread", dcp_default, lambda h: None),
                 ("dcp_DefaultStager_pinned_thread", dcp_pinned(AsyncCheckpointerType.THREAD), lambda h: h[1].result()),
                 ("dcp_DefaultStager_pinned_process", dcp_pinned(AsyncCheckpointerType.PROCESS), lambda h: h[1].result()),
                 ("datastates_cache_quarter", ours(int(state_bytes / 4)), lambda h: h[1].wait_snapshot()),
                 ("datastates_cache_full", ours(int(state_bytes * 1.05)), lambda h: h[1].wait_snapshot())]
        for name, fn, wait in plans:
            if time.monotonic() - T0 > B - 40:
                out[name] = "skipped: budget"
                continue
            try:
                measure(name, fn, wait)  # warm-up (allocations, pinning)
                out[name] = measure(name, fn, wait)
            except BaseException as e:  # noqa: BLE001
                out[name] = f"error: {type(e).__name__}: {e}"
            print(f"  stall {name}: {out[name]}", flush=True)
            save_results()
        out["note"] = ("rss_growth is measured after one warm-up save: the pinned host cache and DCP's "
                       "pinned staging buffers are allocated in the warm-up")
        return out
    stall()
    shutil.rmtree(scratch, ignore_errors=True)
    RESULTS["total_seconds"] = round(time.monotonic() - T0, 1)
    save_results()
    print(json.dumps({k: v for k, v in RESULTS.items() if k != "env"}, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
