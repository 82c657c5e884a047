"""The main job behind ``make demo`` / ``dcp-datastates demo`` (part of the CLI: it prints).

1. A 2-rank FSDP2 training step on CPU/gloo is saved with dcp-datastates and with DCP's
   FileSystemWriter, both are reloaded into one process (2 -> 1 reshard), compared, and timed.
2. A 2-rank FSDP2 training run checkpoints asynchronously every 2 steps to two tiers
   (``nvme/`` and ``pfs/`` under the run directory), is SIGKILLed mid-run, and resumes from the
   newest committed checkpoint.  The report gives the stall, throughput, the tiers holding
   each step, a verify result, and the charts written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from .bench import write_charts
from .load.reader import DataStatesReader
from .run.checkpointer import Checkpointer
from .save.writer import DataStatesWriter
from .tiers import StorageTier
from .tiers.direct_io import evict_from_page_cache
from .tiers.manifests import load_manifest
from .verify import verify_checkpoint


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(width: int, depth: int):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _fsdp(world: int, width: int, depth: int, seed: int):
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = _model(width, depth)
    for layer in model:
        if hasattr(layer, "weight"):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _state(model, opt, step):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "train": {"step": step}}


# -------------------------------------------------------------- phase 1

def _compare_rank(rank, world, port, out_dir, width, depth, q):

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, opt = _fsdp(world, width, depth, 0)
        for _ in range(2):
            model(torch.randn(16, width)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        sd = _state(model, opt, 2)
        timings = {}
        for name, make in (("dcp-datastates", lambda p: DataStatesWriter(p, overwrite=True)),
                           ("FileSystemWriter", lambda p: dcp.FileSystemWriter(p, thread_count=4))):
            path = os.path.join(out_dir, name)
            for _attempt in range(2):  # the first save of a process pays one-time setup; time the second
                dist.barrier()
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=make(path))
                dist.barrier()
                timings[name] = time.perf_counter() - t0
        if rank == 0:
            q.put(timings)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (see train_worker)


def _phase1(base: str, width: int, depth: int) -> dict:

    out = os.path.join(base, "compare")
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _port()
    procs = [ctx.Process(target=_compare_rank, args=(r, 2, port, out, width, depth, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError("a training rank failed in phase 1")
    save_t = q.get()
    ours, ref = os.path.join(out, "dcp-datastates"), os.path.join(out, "FileSystemWriter")
    m = load_manifest(StorageTier(ours))
    load_t, loaded = {}, {}
    for name, reader in (("dcp-datastates", DataStatesReader(ours)), ("FileSystemWriter", dcp.FileSystemReader(ref))):
        for d in (ours, ref):  # both cold: FileSystemWriter's files would otherwise still be cached
            evict_from_page_cache(d)
        t0 = time.perf_counter()
        loaded[name] = _load_state_dict_from_keys(storage_reader=reader)  # into 1 process: 2 -> 1
        load_t[name] = time.perf_counter() - t0
    a, b = pytree.tree_leaves(loaded["dcp-datastates"]), pytree.tree_leaves(loaded["FileSystemWriter"])
    equal = len(a) == len(b) and all((torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)
                                     for x, y in zip(a, b))
    size = sum(m.files.values())
    rows = [{"name": n, "save_s": save_t[n], "save_GBps": size / save_t[n] / 1e9,
             "load_s": load_t[n], "load_GBps": size / load_t[n] / 1e9} for n in save_t]
    return {"size": size, "tensors": len(m.tensors), "values": len(m.values), "rows": rows,
            "equal": equal, "verify": verify_checkpoint(ours)}


# -------------------------------------------------------------- phase 2

def train_worker(rank: int, world: int, port: int, run: str, steps: int, width: int, depth: int,
                 every: int) -> None:

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pg = dist.new_group(backend="gloo")  # checkpoint traffic off the training group
    model, opt = _fsdp(world, width, depth, 0)
    ckpt = Checkpointer([os.path.join(run, "nvme"), os.path.join(run, "pfs")], keep=[2, 4],
                        async_mode="thread", process_group=pg)
    blocked = []

    def hook(*_a, **_k):
        t = time.perf_counter()
        ckpt.wait_snapshot()
        blocked.append(time.perf_counter() - t)
    opt.register_step_pre_hook(hook)
    # restore the newest committed step, if any (on any tier, resharding as needed)
    start = ckpt.load(_state(model, opt, 0)) or 0
    if rank == 0:
        print(json.dumps({"event": "start", "resumed_from": start}), flush=True)
    torch.manual_seed(1234 + start)
    t0 = time.perf_counter()
    done = start
    for step in range(start + 1, steps + 1):
        model(torch.randn(16, width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        done = step
        if step % every == 0:
            ckpt.save(step, _state(model, opt, step))
        if rank == 0:
            print(json.dumps({"event": "step", "step": step}), flush=True)
    ckpt.wait_persisted()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        timeline = ckpt.last_timings
        print(json.dumps({"event": "done", "steps": done - start, "elapsed": elapsed,
                          "blocked": blocked, "n_ckpt": (done // every) - (start // every),
                          "timeline": timeline}), flush=True)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: the demo's workers have nothing left to clean up


def _spawn_train(run, steps, width, depth, every):
    mp.spawn(train_worker, args=(2, _port(), run, steps, width, depth, every), nprocs=2)


def _launch(run, steps, width, depth, every) -> tuple[subprocess.Popen, IO[str], IO[str]]:
    code = (f"from dcp_datastates.cli_demo import _spawn_train; "
            f"_spawn_train({run!r}, {steps}, {width}, {depth}, {every})")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    assert p.stdout is not None and p.stderr is not None, "both are pipes"
    return p, p.stdout, p.stderr


def _events(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def _phase2(base: str, width: int, depth: int, steps: int, kill_at: int, every: int = 2) -> dict:
    run = os.path.join(base, "train")
    shutil.rmtree(run, ignore_errors=True)
    # run 1: killed with SIGKILL right after step `kill_at`, possibly mid-save
    p, out, _ = _launch(run, steps, width, depth, every)
    killed_at = None
    for line in out:
        ev = _events(line)
        if ev and ev.get("event") == "step" and ev["step"] >= kill_at:
            killed_at = ev["step"]
            os.killpg(p.pid, signal.SIGKILL)
            break
    p.wait()
    c = Checkpointer([os.path.join(run, "nvme"), os.path.join(run, "pfs")], async_mode=None)
    latest_after_kill = c.latest_step()
    # run 2: resumes from the newest committed step
    p, out, err_pipe = _launch(run, steps, width, depth, every)
    resumed_from, done = None, None
    for line in out:
        ev = _events(line)
        if ev and ev.get("event") == "start":
            resumed_from = ev["resumed_from"]
        if ev and ev.get("event") == "done":
            done = ev
    err = err_pipe.read()
    if p.wait() != 0 or done is None:
        raise RuntimeError(f"resumed training failed:\n{err[-3000:]}")
    latest = c.latest_step()
    if latest is None:
        raise RuntimeError("resumed training committed no step")
    tiers = {url: c.committed_steps(i) for i, url in enumerate(c.tiers)}
    problems = verify_checkpoint(c.step_path(0, latest)) + verify_checkpoint(c.step_path(1, latest))
    return {"killed_after_step": killed_at, "latest_committed_after_kill": latest_after_kill,
            "resumed_from": resumed_from, "run2": done, "tiers": tiers, "latest": latest,
            "verify": problems}


def _remove_checkpoints(base: str, keep_files: list[str]) -> None:
    """Remove what the demo wrote under ``base`` but ``keep_files``, saying how much."""
    freed = 0
    for root, _dirs, files in os.walk(base):
        freed += sum(os.path.getsize(os.path.join(root, f)) for f in files
                     if os.path.join(root, f) not in keep_files and not os.path.islink(os.path.join(root, f)))
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if path in keep_files:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    print(f"removed the demo's checkpoints ({freed / 2**30:.2f} GiB) from {base}; the charts stay "
          "(--keep, or --out DIR, keeps everything)")


def run_demo(base: str | None = None, *, width: int = 2048, depth: int = 6, steps: int = 12,
             kill_at: int = 7, keep: bool = False) -> int:
    """The demo; its checkpoints go under ``base`` (a temporary directory by default, whose
    checkpoints are removed at the end unless ``keep``: the charts stay)."""
    made = base is None
    base = base or tempfile.mkdtemp(prefix="dcpds-demo-")
    os.makedirs(base, exist_ok=True)
    print(f"demo: 2-rank FSDP2 training on CPU/gloo (MLP {depth}x{width}, Adam); output under {base}")
    print("\n[1/2] save with dcp-datastates and DCP FileSystemWriter, reload into 1 rank (2 -> 1)")
    r1 = _phase1(base, width, depth)
    print("(saves durable, fsync included; loads cold: both checkpoints evicted from the page cache)")
    print(f"{'backend':<18} {'save s':>8} {'save GB/s':>10} {'load 2->1 s':>12} {'load GB/s':>10}")
    for r in r1["rows"]:
        print(f"{r['name']:<18} {r['save_s']:>8.2f} {r['save_GBps']:>10.2f} {r['load_s']:>12.2f} {r['load_GBps']:>10.2f}")
    print(f"state: {r1['size'] / 2**20:.1f} MiB of tensors, {r1['tensors']} tensors, {r1['values']} values; "
          f"reloaded: {'identical to DCP FileSystemReader' if r1['equal'] else 'MISMATCH'}; "
          f"verify: {'OK' if not r1['verify'] else r1['verify']}")

    print(f"\n[2/2] train {steps} steps, async checkpoint every 2 steps to nvme/ + pfs/, "
          f"SIGKILL after step {kill_at}, resume")
    r2 = _phase2(base, width // 2, depth, steps, kill_at)
    d = r2["run2"]
    stall = sum(d["blocked"]) / max(d["n_ckpt"], 1)
    print(f"killed after step {r2['killed_after_step']}; newest committed step then: "
          f"{r2['latest_committed_after_kill']}; resumed from step {r2['resumed_from']}")
    print(f"resumed run: {d['steps']} steps in {d['elapsed']:.2f}s ({d['steps'] / d['elapsed']:.2f} steps/s), "
          f"{d['n_ckpt']} checkpoints, stall {stall * 1000:.1f} ms per checkpoint (time blocked before optimizer.step)")
    for url, st in r2["tiers"].items():
        print(f"tier {url}: committed steps {st}")
    print(f"verify step {r2['latest']} on both tiers: {'OK' if not r2['verify'] else r2['verify']}")
    charts = write_charts(base, r1["rows"], d.get("timeline") or {})
    print("charts: " + ", ".join(charts))
    if made and not keep:
        _remove_checkpoints(base, keep_files=charts)
    ok = r1["equal"] and not r1["verify"] and not r2["verify"] and \
        r2["resumed_from"] == r2["latest_committed_after_kill"] and r2["latest"] == steps
    print("\ndemo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1
