"""What the read-path probe costs (issue 14): cold loads in fresh processes with
``o_direct="auto"`` (probe, then the chosen path) against ``o_direct=True`` (no probe).

    python benchmarks/bench_read_probe.py [--gb 1.5] [--rounds 6] [--dir /tmp/dcpds-probe]

Each round runs both, in alternating order, each in a new process that builds the state as a
restarted trainer would, drops the page cache (needs root) and times ``dcp.load``.  Prints each
load (seconds, the probe's seconds, the share read with O_DIRECT, the choice) and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from bench_core import drop_caches  # noqa: E402
from state import transformer_state  # noqa: E402

from dcp_datastates import DataStatesReader, DataStatesWriter  # noqa: E402
from dcp_datastates.tiers import read_path  # noqa: E402


def child(path: str, gb: float, mode: str) -> None:
    spent = [0.0]
    choose = read_path.choose

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return choose(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t
    read_path.choose = timed
    sd = transformer_state(gb)
    tmpl = {k: torch.empty_like(v) for k, v in sd.items()}
    drop_caches()
    r = DataStatesReader(path, o_direct="auto" if mode == "auto" else True)
    t = time.perf_counter()
    dcp.load(tmpl, storage_reader=r, no_dist=True)
    dt = time.perf_counter() - t
    assert all(torch.equal(tmpl[k], sd[k]) for k in sd)
    print(json.dumps({"s": dt, "probe_s": spent[0], "direct": r.bytes_direct / r.bytes_read,
                      "choice": [c.describe() for c in read_path.choices().values()]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dir", default="/tmp/dcpds-probe")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    path = os.path.join(args.dir, "ckpt")
    if args.child:
        child(path, args.gb, args.child)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    dcp.save(transformer_state(args.gb), storage_writer=DataStatesWriter(path), no_dist=True)
    res: dict[str, list[float]] = {"auto": [], "direct": []}
    for rnd in range(args.rounds):
        for m in (["auto", "direct"] if rnd % 2 == 0 else ["direct", "auto"]):
            out = subprocess.run([sys.executable, __file__, "--gb", str(args.gb), "--dir", args.dir,
                                  "--child", m], capture_output=True, text=True, check=True)
            d = json.loads(out.stdout.strip().splitlines()[-1])
            res[m].append(d["s"])
            print(f"round {rnd} {m:<6} load {d['s']:.3f}s probe {d['probe_s']:.3f}s "
                  f"O_DIRECT share {d['direct']:.3f} {d['choice']}", flush=True)
    for m, v in res.items():
        print(f"{m:<6} median {statistics.median(v):.3f}s")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
