"""The table of ``layout-bench-pair.sh``'s outputs: each figure per round, before and after.

    python benchmarks/results/layout_pair_summary.py /tmp/layoutpair
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def figures(out: str, side: str, r: int) -> dict[str, str]:
    def js(name):
        p = os.path.join(out, f"{name}-{side}-{r}.json")
        return json.load(open(p)) if os.path.exists(p) else None
    f: dict[str, str] = {}
    if (d := js("core")) is not None:
        f["core: durable save, s (vs best FileSystemWriter)"] = f"{_med(d['save_s']['dcp-datastates']):.2f} ({d['save_ratio']:.2f}x)"
        f["core: cold load, s (vs FileSystemReader)"] = f"{_med(d['load_s']['dcp-datastates']):.2f} ({d['load_ratio']:.2f}x)"
        f["core: bytes"] = str(d["size"])
    if (d := js("async")) is not None:
        rows = d["rows"]
        best = min(rows["dcp_thread_default"]["stall"], rows["dcp_thread_async_stager"]["stall"])
        f["async: stall per checkpoint, s (vs DCP's best stager)"] = \
            f"{rows['datastates']['stall']:.2f} ({rows['datastates']['stall'] / best:.2f}x)"
    p = os.path.join(out, f"items-{side}-{r}.log")
    if os.path.exists(p):
        for line in open(p):
            m = re.match(r"^(save|load), our planner\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x", line)
            if m:
                f[f"items: {m.group(1)}, our planner, s (vs DCP)"] = f"{float(m.group(3)):.3f} ({m.group(4)}x)"
    if (d := js("replicas")) is not None:
        rows = d["rows"]
        f["replicas: stall per checkpoint, replicas=0 / =1, s"] = \
            f"{rows['replicas0']['stall']:.3f} / {rows['replicas1']['stall']:.3f}"
    if (d := js("coop")) is not None:
        rows = d["rows"]
        f["coop: cooperative restart, s (DCP; MB read)"] = \
            f"{rows['coop']['s']:.2f} ({rows['dcp']['s']:.2f}; {rows['coop']['read_mb']:.0f})"
    if (d := js("rr")) is not None:
        m = d["median"]
        f["replica restore: nothing lost / a node lost, s (DCP)"] = \
            f"{m['intact']:.2f} / {m['node_lost']:.2f} ({m['dcp']:.2f})"
    return f


def main(out: str) -> None:
    cols = [(side, r) for r in (1, 2) for side in ("before", "after")]
    got = {c: figures(out, *c) for c in cols}
    keys = list(dict.fromkeys(k for c in cols for k in got[c]))
    print("| figure | " + " | ".join(f"{s} {r}" for s, r in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for k in keys:
        print(f"| {k} | " + " | ".join(got[c].get(k, "") for c in cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/layoutpair")
