"""Our load of 20,000 small tensors alone, for A/B runs of two trees of this repository.

    PYTHONPATH=TREE python benchmarks/ab_small_load.py LABEL [--tensors 20000] [--reps 7]

Saves ``--tensors`` tensors of 16 fp32 once with ``DataStatesWriter``, then loads them
``--reps`` times with ``DataStatesLoadPlanner`` (each after ``gc.collect()``) and prints the
sorted load times.  ``bench_items.py`` interleaves DCP's loads with ours, whose collector state
ours inherits; this times ours alone, so that two versions can be compared by running the
script alternately with each tree on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.planner import DataStatesLoadPlanner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--tensors", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    sd = {f"t{i}": torch.randn(16) for i in range(args.tensors)}
    path = tempfile.mkdtemp(prefix="dcpds-ab-")
    try:
        dcp.save(sd, storage_writer=DataStatesWriter(path), no_dist=True)
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        times = []
        for _ in range(args.reps):
            gc.collect()
            t0 = time.perf_counter()
            dcp.load(out, storage_reader=DataStatesReader(path), planner=DataStatesLoadPlanner(), no_dist=True)
            times.append(time.perf_counter() - t0)
        assert all(torch.equal(out[k], v) for k, v in sd.items())
        print(args.label, sorted(round(t, 3) for t in times))
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
