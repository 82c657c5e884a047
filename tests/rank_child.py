"""Per-rank-manifest saves on 2 gloo ranks, for the SIGKILL trials of tests/test_no_loss.py:
``python -m tests.rank_child PATH SEED`` saves ``state_for(SEED, rank)`` with
``use_collectives=False`` and ``overwrite=True``."""

from __future__ import annotations

import os
import sys

import torch


def state_for(seed: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return {f"r{rank}": torch.randn(1024, 1024, generator=g), f"small{rank}": torch.randn(7, generator=g),
            "shared_seed": torch.tensor([seed])}


def _entry(rank, world, port, path, seed):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dcp.save(state_for(seed, rank), storage_writer=DataStatesWriter(path, overwrite=True),
             use_collectives=False)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (see tests/dist.py)


def main() -> int:
    import torch.multiprocessing as mp

    from tests.dist import free_port
    path, seed = sys.argv[1], int(sys.argv[2])
    mp.spawn(_entry, args=(2, free_port(), path, seed), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
