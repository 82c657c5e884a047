"""Where a save of many small tensors spends its time, phase by phase, in one process.

    PYTHONPATH=. python benchmarks/save_phases.py [--tensors 20000] [--floats 16] [--reps 3]

Saves (``dcp.save``, synchronous, ``DataStatesSavePlanner``) a flat state of ``--tensors``
tensors into a fresh directory ``--reps`` times and prints, for each save, its wall time, the
time the cyclic collector ran (``gc.callbacks``) and the time inside each of the writer's and
the engine's phases (the functions are wrapped with a timer; the engine's run on its threads).
To compare two trees, run it with ``PYTHONPATH`` set to each in turn, alternating.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state import small_tensors_state  # noqa: E402

import dcp_datastates.save.rank_save as saving  # noqa: E402
from dcp_datastates import DataStatesSavePlanner, DataStatesWriter  # noqa: E402
from dcp_datastates.engine import snapshot  # noqa: E402

PHASES = [(saving, "lay_out"), (snapshot.SnapshotEngine, "_stage"), (snapshot.SnapshotEngine, "_flush_batch"),
          (saving, "results_of"), (DataStatesWriter, "write_data"), (saving, "manifest_of"),
          (saving, "encode_manifest"), (DataStatesWriter, "finish")]


def _timed(spent: dict, owner, name: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=20000)
    ap.add_argument("--floats", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dcpds-save-phases")
    args = ap.parse_args()
    state = small_tensors_state(args.tensors, args.floats)
    spent: dict[str, float] = {}
    for owner, name in PHASES:
        _timed(spent, owner, name)
    collecting = {"total": 0.0, "since": 0.0}

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            collecting["since"] = time.perf_counter()
        else:
            collecting["total"] += time.perf_counter() - collecting["since"]
    gc.callbacks.append(on_gc)
    print(f"{args.tensors} tensors of {args.floats} fp32, torch {torch.__version__}")
    for rep in range(args.reps):
        path = os.path.join(args.dir, str(rep))
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()
        spent.clear()
        collecting["total"] = 0.0
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=DataStatesWriter(path), planner=DataStatesSavePlanner(), no_dist=True)
        took = time.perf_counter() - t0
        print(f"save {took:.3f} s, collector {collecting['total']:.3f} s: "
              + " ".join(f"{k}={v:.3f}" for k, v in spent.items()))
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
