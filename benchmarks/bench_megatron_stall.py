"""The training stall per checkpoint of Megatron-Core's ``dist_checkpointing`` with its own
``torch_dist`` storage and with ours, sync and async, in one run.

    .venv-frameworks/bin/python benchmarks/bench_megatron_stall.py [--rounds 4] [--every 3] [--dir /tmp/dcpds-mcore]

Two gloo ranks each train their part of a model sharded as Megatron shards experts (each
rank's layers are its slice of tensors of global shape ``(2, W, W)``), with Adam: model and
optimizer state about 1.26 GB in all.  Each round runs, for each method in turn (the order
alternating between rounds), ``--every`` training steps starting with a checkpoint, as
Megatron-LM does: ``dist_checkpointing.save`` into a new directory, an async request scheduled
in Megatron's ``AsyncCallsQueue`` (its forked worker) and ``maybe_finalize_async_calls`` after
every step, blocking before the next save.  The stall per checkpoint is the interval's time
over the same steps without a checkpoint in the same round; a first round warms every path
up and is not counted.  Methods: ``torch_dist`` and
``torch_dist_async`` (Megatron's ``FileSystemWriterAsync``), ``datastates`` and
``datastates_async`` (``DataStatesSaveStrategy(optimizer=opt)``: only the next step waits for
the snapshot).  Megatron's checkpoint code asks CUDA for a device and a sync in a few places;
on a CPU-only machine the CPU answers there (as in ``tests/test_megatron.py``).
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

WIDTH, DEPTH = 2560, 8  # each rank: 8 x 2560^2 fp32 ~ 0.21 GB; two ranks with Adam ~ 1.26 GB
METHODS = ("torch_dist", "datastates", "torch_dist_async", "datastates_async")


def _rank(rank: int, world: int, rounds: int, every: int, base: str, width: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from dcp_datastates.integrations import megatron as ours

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.manual_seed(rank)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(DEPTH)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(64, width)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def state() -> dict:
        msd = {f"l{i}": ShardedTensor.from_rank_offsets(f"layer{i}.weight", m.weight, (0, rank, world),
                                                        replica_id=0, prepend_axis_num=1)
               for i, m in enumerate(model)}
        osd = opt.state_dict()
        optim_state_to_sharding_state(osd, get_param_id_to_sharded_param_map(msd, model.parameters()),
                                      exclude_keys=("step",))
        return {"model": msd, "optimizer": osd}

    step()  # Adam's state exists from here on
    strategies = {"datastates": ours.DataStatesSaveStrategy(),
                  "datastates_async": ours.DataStatesSaveStrategy(optimizer=opt)}
    calls = AsyncCallsQueue()
    times: dict[str, list[float]] = {m: [] for m in (*METHODS, "none")}
    for r in range(rounds + 1):  # round 0 warms every path up (first saves set up groups, caches) and is dropped
        for m in ("none", *(METHODS if r % 2 == 0 else METHODS[::-1])):
            where = os.path.join(base, m, f"iter_{r}")
            os.makedirs(where, exist_ok=True)
            dist.barrier()
            t = time.perf_counter()
            if m != "none":
                request = dist_checkpointing.save(state(), where, sharded_strategy=strategies.get(m.removesuffix(
                    "_async")), async_sharded_save=m.endswith("_async"))
                if request is not None:
                    calls.schedule_async_request(request)
            for _ in range(every):
                step()
                calls.maybe_finalize_async_calls(blocking=False)
            t_steps = time.perf_counter() - t
            calls.maybe_finalize_async_calls(blocking=True)  # before the next save, as Megatron-LM does
            if r > 0:
                times[m].append(t_steps)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(where, ignore_errors=True)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dcpds-mcore")
    ap.add_argument("--width", type=int, default=WIDTH)
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    times = run_ranks(2, _rank, args.rounds, args.every, args.dir, args.width)
    if times is None:
        return 1
    stalls = {m: [t - n for t, n in zip(times[m], times["none"], strict=True)] for m in METHODS}
    for m in METHODS:
        print(json.dumps({"method": m, "stall_per_checkpoint_s": round(statistics.median(stalls[m]), 3),
                          "rounds_s": [round(v, 3) for v in stalls[m]]}))
    print(json.dumps({"interval_without_checkpoint_s": round(statistics.median(times["none"]), 3)}))
    for mode in ("", "_async"):
        ratios = [d / t for d, t in zip(stalls["datastates" + mode], stalls["torch_dist" + mode], strict=True)]
        print(json.dumps({f"datastates{mode}_over_torch_dist{mode}": round(statistics.median(ratios), 3)}))
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
