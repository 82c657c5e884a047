"""Restore after a lost node from peer replicas (issue 36), against a restore with nothing lost
and DCP's ``FileSystemReader``, in one run.

    python benchmarks/bench_replica_restore.py [--nodes 4] [--mib 64] [--small 0] [--reps 3] [--cold] [--phases] [--json OUT]

``--nodes`` nodes of two gloo ranks each are simulated on this machine, each node its own
node-local directory; every rank holds a ``--mib`` MiB shard of one tensor (a DTensor sharded
over all ranks).  Each round: ``Checkpointer(node_local=True, replicas=1)`` saves step 1 and
waits for its replicas; a fresh job restores it (``intact``); node 1's directory is deleted and
a fresh job restores it again (``node_lost``: the repair gives the new node its place back,
then the load); and the same state saved once with ``dcp.save`` and ``FileSystemWriter`` into
one shared directory is loaded with ``dcp.load`` and ``FileSystemReader`` (``dcp``).  Each
figure is the slowest rank's wall time of the load call, median over ``--reps`` rounds, the
methods interleaved.  Every file stays in the page cache (one disk, no cache dropping): the
figures are the repair's and the load's own cost, not the drive's.  With ``--cold`` every file
of the run is dropped from the page cache before each restore (``POSIX_FADV_DONTNEED``, no root
needed), so each restore reads the drive.  Also reported: the bytes the replacement node holds
afterwards against the whole step.  ``--small N`` adds N plain scalar tensors every rank holds
(an optimizer's step counters), which DCP's dedup has one rank write and every rank reads: also
reported, the bytes every node's directory grew by in the restore with nothing lost.
``--phases`` profiles every rank's restore with nothing lost (``cProfile``) and reports, per
phase of ``Checkpointer.load``, the slowest rank's time, median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time

PER_NODE = 2


# (label, file suffix, function name): what ``--phases`` times in the restore with nothing lost
PHASES = (("Checkpointer.load", "dcp_datastates/run/checkpointer.py", "load"),
          ("what each rank holds: steps, saves, replica votes (start_restore)", "dcp_datastates/run/steps.py",
           "start_restore"),
          ("  of it: this rank's replica vote", "dcp_datastates/replicas/replicator.py", "restore_vote"),
          ("save every rank restores (agreed_save)", "dcp_datastates/run/steps.py", "agreed_save"),
          ("survey of the nodes", "dcp_datastates/replicas/repair.py", "survey"),
          ("  of it: the replica group's epoch", "dcp_datastates/replicas/replicator.py", "agree_epoch"),
          ("dcp.load", "torch/distributed/checkpoint/state_dict_loader.py", "load"),
          ("  read_metadata", "dcp_datastates/load/reader.py", "read_metadata"),
          ("  read_data", "dcp_datastates/load/reader.py", "read_data"),
          ("    the repair's fetch", "dcp_datastates/replicas/repair.py", "fetch"),
          ("    the cooperative plan", "dcp_datastates/load/cooperative.py", "plan"),
          ("    the reads", "dcp_datastates/load/reads.py", "read_tasks"),
          ("    the check of every rank's reads (again)", "dcp_datastates/replicas/for_load.py", "again"))


def _phase_times(prof) -> dict[str, float]:
    """Cumulative seconds of each of ``PHASES`` in profile ``prof``."""
    import pstats
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    out = {}
    for label, suffix, name in PHASES:
        out[label] = sum(v[3] for (f, _line, fn), v in stats.items() if fn == name and f.endswith(suffix))
    return out


def _rank(rank: int, world: int, port: int, phase: str, base: str, mib: int, small: int, out,
          phases: bool = False) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_datastates import Checkpointer

    torch.set_num_threads(1)
    parts: dict[str, float] = {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    node = rank // PER_NODE
    rows = (mib << 20) // 4 // 256  # float32 rows of 256 per rank
    torch.manual_seed(0)
    full = torch.randn(rows * world, 256) if phase == "save" else torch.zeros(rows * world, 256)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]),
             "steps": {f"s{i}": torch.tensor(float(i) if phase == "save" else -1.0) for i in range(small)}}
    pg = dist.new_group(backend="gloo")
    took = 0.0
    if phase == "save":
        ckpt = Checkpointer([os.path.join(base, f"node{node}")], node_local=True, replicas=1,
                            node=f"n{node}", process_group=pg, async_mode=None)
        ckpt.save(1, state)
        assert ckpt.wait_replicated(600)
        ckpt.close()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(base, "dcp")))
    elif phase == "dcp":
        dist.barrier()
        t = time.perf_counter()
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(base, "dcp")))
        took = time.perf_counter() - t
    else:
        ckpt = Checkpointer([os.path.join(base, f"node{node}")], node_local=True, replicas=1,
                            node=f"n{node}", process_group=pg, async_mode=None)
        dist.barrier()
        import cProfile
        prof = cProfile.Profile() if phases and phase == "intact" else None
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        assert ckpt.load(state) == 1
        took = time.perf_counter() - t
        if prof is not None:
            prof.disable()
            parts = _phase_times(prof)
        ckpt.close()
    if phase != "save":
        torch.manual_seed(0)
        want = torch.randn(rows * world, 256)
        assert torch.equal(state["w"].to_local(), want[rank * rows:(rank + 1) * rows]), "not bit-exact"
        assert all(float(v) == i for i, v in enumerate(state["steps"].values())), "not bit-exact"
    got: list = [None] * world
    dist.all_gather_object(got, (took, parts))
    if rank == 0:
        out.put((max(g[0] for g in got), {k: max(g[1][k] for g in got) for k in got[0][1]}))
    dist.destroy_process_group()


def _run(world: int, phase: str, base: str, mib: int, small: int, phases: bool = False) -> float:
    took, parts = _run_parts(world, phase, base, mib, small, phases)
    if parts:
        _PARTS.append(parts)
    return took


_PARTS: list[dict[str, float]] = []  # ``--phases``: per round, each phase's slowest rank


def _run_parts(world: int, phase: str, base: str, mib: int, small: int, phases: bool) -> tuple[float, dict]:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, phase, base, mib, small, q, phases))
             for r in range(world)]
    for p in procs:
        p.start()
    took = q.get(timeout=1800)
    for p in procs:
        p.join(120)
        if p.exitcode:
            raise RuntimeError(f"{phase}: a rank exited with {p.exitcode}")
    return took


def _evict(root: str) -> None:
    """Drop every file under ``root`` from the page cache (written back first)."""
    from dcp_datastates.tiers.direct_io import evict_from_page_cache
    for d, _, _names in os.walk(root):
        evict_from_page_cache(d)


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.startswith(("data-", "part-")))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64, help="MiB of state per rank")
    ap.add_argument("--small", type=int, default=0, help="plain scalar tensors every rank holds")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "dcpds-replica-restore"))
    ap.add_argument("--cold", action="store_true", help="drop the run's files from the page cache before each restore")
    ap.add_argument("--phases", action="store_true",
                    help="profile the restore with nothing lost: each phase's time, slowest rank, median")
    ap.add_argument("--json")
    a = ap.parse_args()
    cold = _evict if a.cold else (lambda root: None)
    world = a.nodes * PER_NODE
    runs: dict[str, list[float]] = {"intact": [], "node_lost": [], "dcp": []}
    held = whole = 0
    grown: list[int] = []  # bytes all nodes' directories grew by in the restore with nothing lost

    def nodes_bytes() -> int:
        return sum(_bytes(os.path.join(a.dir, f"node{n}", "step-1")) for n in range(a.nodes))
    for rep in range(a.reps):
        shutil.rmtree(a.dir, ignore_errors=True)
        os.makedirs(a.dir)
        _run(world, "save", a.dir, a.mib, a.small)
        files = {}  # every file of the step, once, from whichever nodes hold it
        for n in range(a.nodes):
            d = os.path.join(a.dir, f"node{n}", "step-1")
            files.update({f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.startswith(("data-", "part-"))})
        whole = sum(files.values())
        cold(a.dir)
        before = nodes_bytes()
        runs["intact"].append(_run(world, "intact", a.dir, a.mib, a.small, a.phases))
        grown.append(nodes_bytes() - before)
        cold(a.dir)
        runs["dcp"].append(_run(world, "dcp", a.dir, a.mib, a.small))
        shutil.rmtree(os.path.join(a.dir, "node1"))
        cold(a.dir)
        runs["node_lost"].append(_run(world, "node_lost", a.dir, a.mib, a.small))
        held = _bytes(os.path.join(a.dir, "node1", "step-1"))
        print(f"rep {rep}: " + ", ".join(f"{m} {v[-1]:.2f}s" for m, v in runs.items())
              + f"; the new node holds {held / 2**20:.0f} MiB of the {whole / 2**20:.0f} MiB step; the nodes "
              f"grew by {grown[-1] / 2**20:.0f} MiB with nothing lost", flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    print(f"\n{a.nodes} nodes of {PER_NODE} ranks, {a.mib} MiB a rank ({world * a.mib} MiB), {a.small} small "
          f"tensors, median of {a.reps}:")
    for m, v in med.items():
        print(f"{m:<10} {v:.2f}s  ({v / med['dcp']:.2f}x dcp.load with FileSystemReader)")
    print(f"the replacement node holds {held / 2**20:.0f} MiB of the {whole / 2**20:.0f} MiB step "
          f"({held / max(whole, 1) * 100:.0f}%; its own ranks' share is {100 / a.nodes:.0f}%, with the replicas it "
          f"keeps {200 / a.nodes:.0f}%)")
    print(f"with nothing lost, the nodes' directories grew by {statistics.median(grown) / 2**20:.1f} MiB (median)")
    phases = {k: statistics.median(p[k] for p in _PARTS) for k in _PARTS[0]} if _PARTS else {}
    if phases:
        print("\nthe restore with nothing lost, by phase (cProfile, slowest rank, median; profiled, so slower):")
        for k, v in phases.items():
            print(f"  {k:<48} {v:.3f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"nodes": a.nodes, "per_node": PER_NODE, "mib_per_rank": a.mib, "cold": a.cold, "runs": runs,
                       "median": med,
                       "new_node_bytes": held, "step_bytes": whole, "small": a.small,
                       "intact_growth_bytes": grown, "intact_phases": phases,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
