"""Per-item cost: many small tensors through the public API, against DCP, in one process.

    python benchmarks/bench_items.py [--tensors 20000] [--floats 16] [--reps 3] [--dir /tmp/dcpds-items]

Saves (``dcp.save``, synchronous, fsync on) and loads (``dcp.load`` into preallocated tensors)
a flat state of ``--tensors`` tensors of ``--floats`` fp32 values each, with dcp-datastates and
with DCP's FileSystemWriter/Reader, alternating, each save into a fresh directory; and times
``read_metadata`` alone; ours saves once more with ``DataStatesSavePlanner`` and loads once
more with ``DataStatesLoadPlanner`` (each compared with DCP through its own planner).
``async_save``: the time until training may change the tensors again (DCP: the call, which
stages a copy; ours: the call and ``wait_snapshot()``, the lazy snapshot), each save then
waited for.  Medians of ``--reps`` rounds; ratios are medians of
per-round ratios.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state import small_tensors_state  # noqa: E402

from dcp_datastates import (DataStatesLoadPlanner, DataStatesReader, DataStatesSavePlanner,  # noqa: E402
                            DataStatesWriter, async_save)


def _timed(fn) -> float:
    gc.collect()  # each timed call, either system's, starts without the last one's garbage
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _until_mutable(name: str, writer, state: dict) -> float:
    """Seconds from ``async_save`` until the tensors may change; the save is then waited for."""
    gc.collect()
    t0 = time.perf_counter()
    if name == "ours":
        fut = async_save(state, storage_writer=writer, no_dist=True)
        writer.wait_snapshot()
    else:
        fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
    took = time.perf_counter() - t0
    getattr(fut, "upload_completion", fut).result()
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=20000)
    ap.add_argument("--floats", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dcpds-items")
    args = ap.parse_args()
    state = small_tensors_state(args.tensors, args.floats)
    systems = {
        "ours": (lambda p: DataStatesWriter(p), lambda p: DataStatesReader(p)),
        "dcp": (lambda p: dcp.FileSystemWriter(p), lambda p: dcp.FileSystemReader(p)),
    }
    times: dict[str, dict[str, list[float]]] = {s: {"save": [], "load": [], "read_metadata": [],
                                                     "save, our planner": [], "load, our planner": [],
                                                     "async_save": []} for s in systems}
    for rep in range(args.reps):
        order = list(systems) if rep % 2 == 0 else list(reversed(systems))
        for name in order:
            make_w, make_r = systems[name]
            path = os.path.join(args.dir, f"{name}-{rep}")
            shutil.rmtree(path, ignore_errors=True)
            times[name]["save"].append(_timed(lambda: dcp.save(state, storage_writer=make_w(path), no_dist=True)))
            if name == "ours":  # the same save with DataStatesSavePlanner (public API too)
                again = path + "-planner"
                shutil.rmtree(again, ignore_errors=True)
                times[name]["save, our planner"].append(_timed(lambda: dcp.save(
                    state, storage_writer=make_w(again), planner=DataStatesSavePlanner(), no_dist=True)))
                shutil.rmtree(again, ignore_errors=True)
            else:
                times[name]["save, our planner"].append(times[name]["save"][-1])  # DCP's own planner
            out = {k: torch.empty_like(v) for k, v in state.items()}
            times[name]["load"].append(_timed(lambda: dcp.load(out, storage_reader=make_r(path), no_dist=True)))
            assert all(torch.equal(out[k], state[k]) for k in state)
            if name == "ours":  # the same load with DataStatesLoadPlanner (public API too)
                out = {k: torch.empty_like(v) for k, v in state.items()}
                times[name]["load, our planner"].append(_timed(lambda: dcp.load(
                    out, storage_reader=make_r(path), planner=DataStatesLoadPlanner(), no_dist=True)))
                assert all(torch.equal(out[k], state[k]) for k in state)
            else:
                times[name]["load, our planner"].append(times[name]["load"][-1])  # DCP's own planner
            times[name]["read_metadata"].append(_timed(lambda: make_r(path).read_metadata()))
            shutil.rmtree(path, ignore_errors=True)
            times[name]["async_save"].append(_until_mutable(name, make_w(path), state))
            shutil.rmtree(path, ignore_errors=True)
    print(f"{args.tensors} tensors of {args.floats} fp32, {args.reps} rounds, torch {torch.__version__}")
    print(f"{'':18} {'DCP s':>8} {'ours s':>8} {'ours vs DCP':>12}")
    for what in ("save", "save, our planner", "load", "load, our planner", "read_metadata", "async_save"):
        ratio = statistics.median(d / o for d, o in zip(times["dcp"][what], times["ours"][what]))
        print(f"{what:18} {statistics.median(times['dcp'][what]):>8.3f} {statistics.median(times['ours'][what]):>8.3f} "
              f"{ratio:>11.2f}x")


if __name__ == "__main__":
    main()
