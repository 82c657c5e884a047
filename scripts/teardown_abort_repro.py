"""Reproduce the exit-time abort of gloo/FSDP2 processes with torch alone (no dcp-datastates).

    python scripts/teardown_abort_repro.py [--runs 30] [--no-dcp]

Each run starts 2 ranks (gloo on 127.0.0.1) that build a small FSDP2 model, train 2 steps, save
and load it with DCP's own FileSystemWriter/FileSystemReader, destroy the process group and
exit normally.  Some ranks then die with SIGABRT ("terminate called without an active
exception") during native teardown, after all their work is done.  This script never imports
dcp_datastates; it shows the abort is not caused by it.  Measured 2026-11-30 on torch 2.13.0+cpu:
5 of 30 and 2 of 20 runs; with ``--no-dcp`` (FSDP2 training only) 2 of 30.  Work-around in a training script: ``os._exit(0)`` after ``destroy_process_group()``.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile


def rank_main(rank: int, world: int, port: int, out: str, use_dcp: bool) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    if use_dcp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(out))
        dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--no-dcp", action="store_true", help="FSDP2 training only, no checkpoint")
    ap.add_argument("--rank", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        rank_main(int(a.rank[0]), 2, int(a.rank[1]), a.rank[2], a.rank[3] == "1")
        return 0
    aborted = 0
    for i in range(a.runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as d:
            procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(port), d,
                                       "0" if a.no_dcp else "1"], stderr=subprocess.PIPE, text=True)
                     for r in range(2)]
            codes, why = [], set()
            for p in procs:
                _, err = p.communicate(timeout=300)
                codes.append(p.returncode)
                why.update(line for line in err.splitlines() if "terminate called" in line)
            if any(codes):
                aborted += 1
                print(f"run {i}: exit codes {codes} {sorted(why)}", flush=True)
    print(f"{aborted} of {a.runs} runs had a rank abort at exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
