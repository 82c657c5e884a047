"""A saving process for the crash harness: ``python -m tests.crash_child BASE MODE WORLD STEP``.

Saves ``STEP`` through a two-tier Checkpointer (tier 1 and a "persistent" tier under BASE),
synchronously or asynchronously, on WORLD gloo ranks, and waits for the persistent commit.
The harness SIGKILLs it at a fault point (``DCP_DATASTATES_FAULT``) or at a random time.
"""

from __future__ import annotations

import os
import sys

import torch


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(2048, 1024, generator=g),  # 8 MiB
            "b": torch.randn(4096, generator=g).bfloat16(),
            "small": {str(i): torch.randn(100, generator=g) for i in range(20)},
            "meta": {"step": step}}


def tiers(base: str) -> list[str]:
    return [os.path.join(base, "t1"), os.path.join(base, "t2")]


def _rank_main(rank, world, base, mode, step, started):
    from dcp_datastates import Checkpointer
    from tests.faults import install
    install()  # the harness's fault point, by wrapping the storage interface
    c = Checkpointer(tiers(base), async_mode=None if mode == "sync" else "thread")
    sd = state_for(step)
    if rank == 0 and started:
        open(started, "w").write("go")
    fut = c.save(step, sd)
    if fut is not None:
        c.wait_snapshot()
    c.wait_persisted(120)


def _spawn_entry(rank, world, port, base, mode, step, started):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _rank_main(rank, world, base, mode, step, started)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (see tests/dist.py)


def main() -> int:
    base, mode, world, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    started = os.environ.get("CRASH_STARTED")
    if world == 1:
        _rank_main(0, 1, base, mode, step, started)
        return 0
    import torch.multiprocessing as mp

    from tests.dist import free_port
    mp.spawn(_spawn_entry, args=(world, free_port(), base, mode, step, started), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
