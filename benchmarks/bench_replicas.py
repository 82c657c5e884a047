"""What peer replicas cost a training loop (issue 36), against no replication, in one run.

    python benchmarks/bench_replicas.py [--steps 12] [--every 3] [--reps 2] [--device-wait S] [--batch B]
                                        [--host-idle] [--helper] [--quiet N] [--budget S] [--json OUT]

Four gloo ranks on this machine simulate two nodes of two ranks, each node its own node-local
directory.  An MLP sharded with FSDP2 and trained with Adam checkpoints through ``Checkpointer``
(node-local tier only, async THREAD saves, a gloo group of their own) every ``--every`` steps,
with ``replicas=0`` and ``replicas=1``, and the same loop runs without checkpoints; ``--helper``
adds ``replicas=1`` sent from a helper process per rank (``replicas1_helper``,
``DCP_DATASTATES_REPLICA_SENDER=process``) instead of a thread of the training process.  Reported per
method (median over ``--reps``, methods interleaved): the extra training time per checkpoint over
the loop without checkpoints (the stall), the time the loop spends blocked in checkpoint calls,
and the largest peak RSS growth of any rank, and the largest private memory (USS) of a rank's
replica helper process.

The loop totals move between runs on this machine by more than replication costs (a step's
optimizer update takes 6 to 9 ms in one run and 8 to 12 in the next).  ``--quiet N`` adds an
estimate that cancels that: each rank records every step's host time (its wall time less the
device wait), and the stall of a run is what the steps of each checkpoint cycle take above the
same run's last ``N`` steps of the cycle, which the save has left alone (``within_run``); the
host time by position in the cycle shows where the cost lands.

Four ranks training on this machine's two cores leave no CPU idle, so anything a checkpoint
does in the background slows training by its whole CPU time.  A GPU job leaves the host's
cores mostly idle while the device computes: ``--device-wait S`` adds ``S`` seconds of waiting
to each step (the rank waits as it would for its GPU) and ``--batch`` shrinks the step's own
CPU work, so that the background work can overlap training as it does there.  Even so, FSDP2's
collectives run on the host over gloo here (on GPUs they run on the device over NCCL) and take
most of a step's CPU; ``--host-idle`` leaves them out of the loop: the gradients of one real
backward pass are kept, and each step is the optimizer's in-place update on the host followed
by the device wait, as a GPU job's host mostly launches kernels and waits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time

WIDTH, DEPTH = 1024, 8  # 8.4 M parameters; with Adam 101 MB of state, a quarter per rank
PER_NODE = 2


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _uss(pid: int) -> int:
    """The private memory of process ``pid`` (what it adds to the host beyond shared pages)."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def _rank(rank: int, world: int, port: int, method: str, steps: int, every: int, base: str, out,
          device_wait: float, batch: int, host_idle: bool = False) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcp_datastates import Checkpointer
    from dcp_datastates.replicas.helper import SENDER_ENV

    torch.set_num_threads(1)
    os.environ[SENDER_ENV] = "process" if method.endswith("_helper") else "thread"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, WIDTH)

    update = []  # host-idle steps: the optimizer step's wall time (its wait for a snapshot included)

    def step() -> None:
        if host_idle:  # the device runs forward and backward; the host then updates in place
            time.sleep(device_wait)
            t = time.perf_counter()
            opt.step()
            update.append(time.perf_counter() - t)
            return
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if device_wait:
            time.sleep(device_wait)

    if host_idle:
        model(x).pow(2).mean().backward()
    step()
    ckpt = None
    if method != "none":
        ckpt = Checkpointer([os.path.join(base, f"node{rank // PER_NODE}")], node_local=True,
                            replicas=int(method.split("_")[0][-1]), node=f"n{rank // PER_NODE}",
                            process_group=dist.new_group(backend="gloo"), host_cache_bytes=64 << 20)
        ckpt.register_step_pre_hook(opt)
        if ckpt.node_copies is not None and ckpt.node_copies.replicator is not None:  # the helper's start (once, at startup) is not the loop's
            assert ckpt.node_copies.replicator.ready(120)
    peak, stop = [_rss()], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    rss0 = _rss()
    dist.barrier()
    blocked = 0.0
    t0 = time.perf_counter()
    n = 0
    host = []  # per step: its wall time less the device wait, checkpoint call included
    for s in range(1, steps + 1):
        ts = time.perf_counter()
        step()
        if ckpt is not None and s % every == 0:
            msd, osd = get_state_dict(model, opt)
            t = time.perf_counter()
            ckpt.save(s, {"model": msd, "optim": osd})
            blocked += time.perf_counter() - t
            n += 1
        host.append(time.perf_counter() - ts - device_wait)
    if ckpt is not None:
        t = time.perf_counter()
        ckpt.wait()
        blocked += time.perf_counter() - t
    dist.barrier()
    total = time.perf_counter() - t0
    replicated = ckpt.wait_replicated(300) if ckpt is not None and method != "replicas0" else None
    stop.set()
    rep = ckpt.node_copies.replicator if ckpt is not None and ckpt.node_copies is not None else None
    helper_uss = _uss(rep._work._proc.pid) if rep is not None and rep.in_helper else 0
    res = {"total_s": total, "blocked_s": blocked, "n_ckpt": n, "rss_growth": peak[0] - rss0,
           "replicated": replicated, "helper_uss": helper_uss, "host_s": host,
           "update_s": update[-len(host):] if update else []}
    got: list = [None] * world
    dist.all_gather_object(got, res)
    if rank == 0:
        out.put(got)
        out.close()
        out.join_thread()  # os._exit below would otherwise cut the queue's feeder thread short
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # FSDP2 on gloo can abort in native teardown (tests/dist.py)


def within_run(got: list[dict], every: int, quiet: int) -> tuple[float, list[float]]:
    """The stall per checkpoint of one run measured against the same run's quiet steps, and
    the mean host time of the steps at each position of the checkpoint cycle.

    A step's host time is its wall time less the device wait (the save call included on the
    step that saves); a synchronous job waits each step for its slowest rank, so the series is
    the per-step maximum over the ranks.  The last ``quiet`` steps of each cycle (the save is
    at position 0) are the run's own baseline: the run's speed, which moves by more between
    runs on this machine than a replica costs, cancels.  The stall is what the other positions
    take above that baseline, per cycle, over the cycles after the first save."""
    steps = len(got[0]["host_s"])
    worst = [max(r["host_s"][i] for r in got) for i in range(steps)]
    cycles = [worst[c:c + every] for c in range(every - 1, steps - every + 1, every)]  # index 0: the save step
    base = statistics.mean(x for c in cycles for x in c[every - quiet:])
    profile = [statistics.mean(c[k] for c in cycles) for k in range(every)]
    return sum(p - base for p in profile[:every - quiet]), profile


def run(method: str, steps: int, every: int, base: str, device_wait: float = 0.0, batch: int = 32,
        host_idle: bool = False) -> list[dict]:
    import torch.multiprocessing as mp
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 4, port, method, steps, every, base, q, device_wait, batch,
                                                      host_idle)) for r in range(4)]
    for p in procs:
        p.start()
    got = q.get(timeout=900)
    for p in procs:
        p.join(60)
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "dcpds-replicas"))
    ap.add_argument("--device-wait", type=float, default=0.0, help="seconds each step waits, as for a GPU")
    ap.add_argument("--batch", type=int, default=32, help="rows per step (the step's CPU work)")
    ap.add_argument("--host-idle", action="store_true", help="steps are the optimizer update and the device wait")
    ap.add_argument("--helper", action="store_true", help="also replicas=1 sent from a helper process")
    ap.add_argument("--quiet", type=int, default=0,
                    help="the last N steps of each checkpoint cycle are the run's own baseline (see within_run)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds: start no new round after this many (0: no limit); at least one round runs")
    ap.add_argument("--json")
    a = ap.parse_args()
    t0 = time.monotonic()
    methods = ["none", "replicas0", "replicas1"] + (["replicas1_helper"] if a.helper else [])
    runs: dict[str, list] = {m: [] for m in methods}
    for rep in range(a.reps):
        if rep and a.budget and time.monotonic() - t0 > a.budget:
            print(f"budget of {a.budget:.0f}s spent: {rep} rounds", flush=True)
            break
        for m in methods:
            got = run(m, a.steps, a.every, a.dir, a.device_wait, a.batch, a.host_idle)
            runs[m].append(got)
            print(f"rep {rep} {m}: total {max(r['total_s'] for r in got):.2f}s "
                  f"blocked {max(r['blocked_s'] for r in got):.2f}s "
                  f"rss+ {max(r['rss_growth'] for r in got) / 1e6:.0f} MB replicated {got[0]['replicated']} "
                  f"helper USS {max(r['helper_uss'] for r in got) / 1e6:.0f} MB",
                  flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    base = statistics.median(max(r["total_s"] for r in g) for g in runs["none"])
    rows = {}
    for m in methods[1:]:
        n = runs[m][0][0]["n_ckpt"]
        rows[m] = {"stall": statistics.median((max(r["total_s"] for r in g) - base) / n for g in runs[m]),
                   "blocked": statistics.median(max(r["blocked_s"] for r in g) / n for g in runs[m]),
                   "rss_growth": max(r["rss_growth"] for g in runs[m] for r in g),
                   "helper_uss": max(r["helper_uss"] for g in runs[m] for r in g)}
    print(f"\nloop without checkpoints {base:.2f}s; {a.steps} steps, a checkpoint every {a.every}, "
          f"device wait {a.device_wait}s a step, batch {a.batch}{', host idle' if a.host_idle else ''}")
    for m, r in rows.items():
        print(f"{m:<10} stall/ckpt {r['stall']:.3f}s  blocked/ckpt {r['blocked']:.3f}s  "
              f"peak RSS growth {r['rss_growth'] / 1e6:.0f} MB  helper USS {r['helper_uss'] / 1e6:.0f} MB")
    s0 = rows["replicas0"]["stall"]
    for m in methods[2:]:
        pairs = [(max(r["total_s"] for r in g1) - max(r["total_s"] for r in g0)) / runs[m][0][0]["n_ckpt"]
                 for g0, g1 in zip(runs["replicas0"], runs[m])]
        se = statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else float("nan")
        print(f"{m} adds {rows[m]['stall'] - s0:+.3f}s per checkpoint ({(rows[m]['stall'] - s0) / max(s0, 1e-9) * 100:+.0f}% "
              f"of the stall); paired mean {statistics.mean(pairs):+.4f}s, standard error {se:.4f}s")
    if a.quiet:
        print(f"\nagainst each run's own quiet steps (the last {a.quiet} of every {a.every}; per-step maximum over ranks):")
        for m in methods[1:]:
            est = [within_run(g, a.every, a.quiet) for g in runs[m]]
            profile = [statistics.mean(p[k] for _, p in est) for k in range(a.every)]
            rows[m]["stall_within"] = statistics.mean(e for e, _ in est)
            rows[m]["profile"] = profile
            print(f"{m:<16} stall/ckpt {rows[m]['stall_within']:.4f}s; host time by position "
                  + " ".join(f"{x * 1000:.1f}" for x in profile) + " ms")
        for m in methods[2:]:
            pairs = [within_run(g1, a.every, a.quiet)[0] - within_run(g0, a.every, a.quiet)[0]
                     for g0, g1 in zip(runs["replicas0"], runs[m])]
            se = statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else float("nan")
            rows[m]["added_within"] = [statistics.mean(pairs), se]
            print(f"{m} adds {statistics.mean(pairs):+.4f}s per checkpoint (paired, standard error {se:.4f}s), "
                  f"{statistics.mean(pairs) / max(rows['replicas0']['stall_within'], 1e-9) * 100:+.0f}% of the stall")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device_wait": a.device_wait, "batch": a.batch, "host_idle": a.host_idle, "every": a.every,
                       "quiet": a.quiet, "runs": runs, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
