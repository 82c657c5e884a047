"""Ranks for a benchmark: ``world`` spawned processes in one gloo group on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import sys


def _entry(rank: int, world: int, port: int, target, args: tuple, out) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = target(rank, world, *args)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def run_ranks(world: int, target, *args):
    """``target(rank, world, *args)`` on each rank; what rank 0 returned, or None (said on
    stderr) where a rank failed."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_entry, args=(r, world, port, target, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print("a rank failed", file=sys.stderr)
        return None
    return out.get()
