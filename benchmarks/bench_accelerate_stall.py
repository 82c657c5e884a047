"""The training stall per checkpoint of accelerate's sharded checkpoints (what the ``transformers``
Trainer's ``save_state`` runs), with accelerate's own storage and with ours, in one run.

    .venv-frameworks/bin/python benchmarks/bench_accelerate_stall.py [--rounds 4] [--every 2] [--dir /tmp/dcpds-acc]

Two gloo ranks train an MLP sharded with FSDP2 (model and Adam state about 1.2 GB) and, every
``--every`` steps, checkpoint it as ``Accelerator.save_state`` does for FSDP's
``SHARDED_STATE_DICT``: ``save_fsdp_model`` then ``save_fsdp_optimizer`` into a new directory
(the Trainer's ``checkpoint-N``), then a barrier.  accelerate saves synchronously, so the
training stall per checkpoint is the time from the first call to the barrier's end.  The
methods alternate within each round (``accelerate``: its ``FileSystemWriter``; ``datastates``:
the same calls after ``use_datastates()``), so both see the same machine.  accelerate turns
FSDP on only with an accelerator, so on a CPU-only machine the loop calls the two functions
itself, as ``save_state`` would.  Prints one JSON line per method and the median of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks

WIDTH, DEPTH = 2560, 16  # 16 x 2560^2 fp32 params ~ 0.42 GB; with Adam ~ 1.26 GB
METHODS = ("accelerate", "datastates")


def _rank(rank: int, world: int, rounds: int, every: int, base: str) -> dict:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcp_datastates.integrations import accelerate as ours

    acc = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(64, WIDTH)

    def step() -> float:
        t = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t

    step()  # Adam's state exists from here on
    steps, stalls = [], {m: [] for m in METHODS}
    for r in range(rounds):
        for m in (METHODS if r % 2 == 0 else METHODS[::-1]):
            (ours.use_datastates if m == "datastates" else ours.stop_using_datastates)()
            steps += [step() for _ in range(every)]
            where = os.path.join(base, m, f"checkpoint-{r}")
            dist.barrier()
            t = time.perf_counter()
            ours.fsdp_utils.save_fsdp_model(plugin, acc, model, where)
            ours.fsdp_utils.save_fsdp_optimizer(plugin, acc, opt, model, where)
            dist.barrier()
            stalls[m].append(time.perf_counter() - t)
            if rank == 0 and r > 0:  # the Trainer's rotation (save_total_limit=1), outside the stall
                shutil.rmtree(os.path.join(base, m, f"checkpoint-{r - 1}"), ignore_errors=True)
    ours.stop_using_datastates()
    return {"step_s": statistics.median(steps), "stalls": stalls}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/dcpds-acc")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    got = run_ranks(2, _rank, args.rounds, args.every, args.dir)
    if got is None:
        return 1
    med = {m: statistics.median(v) for m, v in got["stalls"].items()}
    for m in METHODS:
        print(json.dumps({"method": m, "stall_per_checkpoint_s": round(med[m], 3),
                          "all_s": [round(v, 3) for v in got["stalls"][m]], "step_s": round(got["step_s"], 3)}))
    ratios = [d / a for d, a in zip(got["stalls"]["datastates"], got["stalls"]["accelerate"], strict=True)]
    print(json.dumps({"datastates_over_accelerate": round(statistics.median(ratios), 3),  # per round
                      "rounds": [round(r, 3) for r in ratios]}))
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
