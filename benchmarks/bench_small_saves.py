"""Small saves, where a commit's fsyncs are a visible share of the time: one process, a 1 MiB
state of 16 tensors, against DCP's FileSystemWriter in the same run.

    python benchmarks/bench_small_saves.py [--saves 30] [--dir /tmp/dcpds-small] [--json OUT]

Three loops, each ``--saves`` saves (the first 5 not counted), median per save: ``dcp.save``
into one directory saved over in place (``overwrite=True``: each save removes the files of the
one it replaces), ``Checkpointer(keep=2)`` saving a new step each time (retention purging the
oldest), and DCP's ``FileSystemWriter`` into one directory (``overwrite=True``).  To compare two
trees, run it with ``PYTHONPATH`` set to each in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import Checkpointer, DataStatesWriter


def _median_ms(fn, saves: int) -> float:
    ts = []
    for i in range(saves):
        t = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts[5:]) * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--saves", type=int, default=30)
    ap.add_argument("--dir", default="/tmp/dcpds-small")
    ap.add_argument("--json")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    sd = {f"t{i}": torch.randn(1 << 14) for i in range(16)}
    out = {"overwrite_ms": _median_ms(lambda i: dcp.save(
        sd, storage_writer=DataStatesWriter(f"{a.dir}/ckpt", overwrite=True), no_dist=True), a.saves)}
    ck = Checkpointer([f"{a.dir}/run"], keep=2, async_mode=None)

    def step(i: int) -> None:
        ck.save(i, sd)
        ck.wait()
        ck.wait_persisted(60)
    out["checkpointer_keep2_ms"] = _median_ms(step, a.saves)
    ck.close()
    out["dcp_filesystem_ms"] = _median_ms(lambda i: dcp.save(
        sd, storage_writer=dcp.FileSystemWriter(f"{a.dir}/dcp", overwrite=True), no_dist=True), a.saves)
    shutil.rmtree(a.dir, ignore_errors=True)
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
