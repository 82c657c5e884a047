"""Multi-level flush: commit times per tier, training stall with 1 vs 2 tiers, restore per tier.

    python benchmarks/bench_tiers.py [--gb 1.5] [--dir /tmp/dcpds-tiers]

Both tiers are directories on this machine's one disk (``nvme/`` and ``pfs/``), so the
numbers show the pipeline's overheads, not a real NVMe/PFS gap.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def commit_times(base: str, gb: float) -> dict:
    import torch  # noqa: F401

    from bench_core import drop_caches
    from dcp_datastates import Checkpointer
    from state import nbytes, transformer_state
    sd = transformer_state(gb)
    size = nbytes(sd)
    out = {"state_GB": size / 1e9, "tier1_commit_s": [], "persist_commit_s": []}
    for rep in range(2):
        shutil.rmtree(base, ignore_errors=True)
        c = Checkpointer([os.path.join(base, "nvme"), os.path.join(base, "pfs")], async_mode="thread")
        t0 = time.perf_counter()
        c.save(1, sd)
        c.wait()
        t1 = time.perf_counter()
        c.wait_persisted()
        t2 = time.perf_counter()
        out["tier1_commit_s"].append(t1 - t0)
        out["persist_commit_s"].append(t2 - t0)
    # restore: from tier 1, then with tier 1 gone (the persistent copy serves)
    tmpl = {k: torch.empty_like(v) for k, v in sd.items()}
    for name in ("restore_tier1_s", "restore_persistent_s"):
        if name == "restore_persistent_s":
            shutil.rmtree(c.step_path(0, 1))
        drop_caches()
        t = time.perf_counter()
        assert c.load(tmpl) == 1
        out[name] = time.perf_counter() - t
        assert all(torch.equal(tmpl[k], sd[k]) for k in sd)
    shutil.rmtree(base, ignore_errors=True)
    return out


def train_loop(base: str, tiers: int, steps: int, every: int) -> dict:
    import torch
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dcp_datastates import Checkpointer
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2560, 2560, bias=False) for _ in range(16)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(64, 2560)
    dirs = [os.path.join(base, "nvme"), os.path.join(base, "pfs")][:tiers] if tiers else []
    c = Checkpointer(dirs, async_mode="thread", keep=2) if dirs else None
    if c:
        c.register_step_pre_hook(opt)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if c and step % every == 0:
            msd, osd = get_state_dict(model, opt)
            c.save(step, {"model": msd, "optim": osd})
    train_s = time.perf_counter() - t0
    if c:
        c.wait_persisted()
    return {"train_s": train_s, "n_ckpt": steps // every if c else 0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--dir", default="/tmp/dcpds-tiers")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--loop", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loop is not None:
        print("RESULT " + json.dumps(train_loop(args.dir, args.loop, args.steps, args.every)))
        return 0
    ct = commit_times(args.dir, args.gb)
    print(json.dumps(ct), flush=True)
    loops: dict[int, list[float]] = {0: [], 1: [], 2: []}
    for rep in range(args.reps):
        for tiers in (0, 1, 2):
            shutil.rmtree(args.dir, ignore_errors=True)
            out = subprocess.run([sys.executable, __file__, "--loop", str(tiers), "--dir", args.dir,
                                  "--steps", str(args.steps), "--every", str(args.every)],
                                 capture_output=True, text=True, timeout=900)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                print(out.stderr[-3000:])
                return 1
            r = json.loads(line[0][7:])
            loops[tiers].append(r["train_s"])
            print(f"rep {rep} tiers={tiers}: train {r['train_s']:.2f}s", flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    n = args.steps // args.every
    base = statistics.median(loops[0])
    stall1 = (statistics.median(loops[1]) - base) / n
    stall2 = (statistics.median(loops[2]) - base) / n
    print(f"\nstate {ct['state_GB']:.2f} GB: tier-1 commit {statistics.median(ct['tier1_commit_s']):.2f}s, "
          f"persistent commit {statistics.median(ct['persist_commit_s']):.2f}s after the save call")
    print(f"restore: tier 1 {ct['restore_tier1_s']:.2f}s, persistent tier {ct['restore_persistent_s']:.2f}s")
    print(f"training loop ({args.steps} steps, save every {args.every}): no checkpoints {base:.2f}s; "
          f"stall per checkpoint: 1 tier {stall1:.3f}s, 2 tiers {stall2:.3f}s; "
          f"2-tier loop / 1-tier loop = {statistics.median(loops[2]) / statistics.median(loops[1]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
