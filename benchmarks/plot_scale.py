"""Charts of a ``bench_scale.py`` run, as SVG files (no plotting library needed), and the
run as the Markdown table of ``docs/benchmarks.md`` (printed).

    python benchmarks/plot_scale.py benchmarks/results/RUN-scale.json docs/img

One chart per measure (coordinator commit, a rank ready to load, metadata bytes a rank reads),
log-log over the number of ranks, a line per layout and system: dcp-datastates solid, DCP
dashed.  Runs that were skipped are left out of their line.
"""

from __future__ import annotations

import json
import math
import os
import sys

MEASURES = [("commit_s", "coordinator commit (s)", "scale-commit.svg"),
            ("ready_same_s", "one rank ready to load, same world size (s)", "scale-ready.svg"),
            ("bytes_read_same", "metadata bytes one rank reads (MB)", "scale-bytes.svg")]
COLORS = {"fsdp": "#1f77b4", "hsdp": "#2ca02c", "tp_fsdp": "#d62728"}
W, H, L, R, T, B = 640, 400, 70, 150, 40, 50


def _log_ticks(lo: float, hi: float) -> list[float]:
    return [10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]


def chart(rows: list[dict], key: str, title: str) -> str:
    scale = 1e6 if key.startswith("bytes") else 1.0
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        if key in r and r[key] > 0:
            lines.setdefault((r["layout"], r["system"]), []).append((r["ranks"], r[key] / scale))
    xs = [x for pts in lines.values() for x, _ in pts]
    ys = [y for pts in lines.values() for _, y in pts]
    xt, yt = _log_ticks(min(xs), max(xs)), _log_ticks(min(ys), max(ys))
    lx = (math.log10(xt[0]), math.log10(xt[-1]))
    ly = (math.log10(yt[0]), math.log10(yt[-1]))

    def px(x: float) -> float:
        return L + (math.log10(x) - lx[0]) / max(1e-9, lx[1] - lx[0]) * (W - L - R)

    def py(y: float) -> float:
        return H - B - (math.log10(y) - ly[0]) / max(1e-9, ly[1] - ly[0]) * (H - T - B)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="11"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="22" font-size="13">{title}</text>']
    for x in xt:
        out.append(f'<line x1="{px(x):.1f}" y1="{T}" x2="{px(x):.1f}" y2="{H - B}" stroke="#ddd"/>'
                   f'<text x="{px(x):.1f}" y="{H - B + 15}" text-anchor="middle">{x:g}</text>')
    for y in yt:
        out.append(f'<line x1="{L}" y1="{py(y):.1f}" x2="{W - R}" y2="{py(y):.1f}" stroke="#ddd"/>'
                   f'<text x="{L - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">ranks</text>')
    for k, ((layout, system), pts) in enumerate(sorted(lines.items())):
        pts.sort()
        dash = '' if system == "ours" else ' stroke-dasharray="6,4"'
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        color = COLORS.get(layout, "black")
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>' for x, y in pts]
        name = "dcp-datastates" if system == "ours" else "DCP"
        ly_ = T + 14 * k
        out.append(f'<line x1="{W - R + 10}" y1="{ly_}" x2="{W - R + 34}" y2="{ly_}" stroke="{color}" '
                   f'stroke-width="2"{dash}/><text x="{W - R + 38}" y="{ly_ + 4}">{layout} {name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    """Ours against DCP per layout and rank count: commit, ready (same size and N/2), metadata
    bytes one rank reads to be ready, and the digest bytes it reads later with the data."""
    def pair(a, b, key, scale=1.0, fmt="{:.3f}"):
        x = a.get(key) if a else None
        y = b.get(key) if b else None
        if x is None:
            return "skipped", ""
        ratio = f"{y / x:.1f}" if y is not None and x > 0 else ""
        return f"{fmt.format(x / scale)} / " + (fmt.format(y / scale) if y is not None else "skipped"), ratio

    out = ["| layout | ranks | chunks | commit s ours / DCP | × | ready s ours / DCP | × | ready/2 s ours / DCP | × "
           "| MB read ours / DCP | × | parts read | digest MB with the data |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["system"], r["layout"], r["ranks"]): r for r in rows}
    for (system, layout, n), ours in by.items():
        if system != "ours":
            continue
        dcp = by.get(("dcp", layout, n))
        dcp = dcp if dcp and "commit_s" in dcp else None
        if "commit_s" not in ours:
            out.append(f"| {layout} | {n:,} | {ours['chunks']:,} | skipped | | | | | | | | | |")
            continue
        cells = [pair(ours, dcp, "commit_s"), pair(ours, dcp, "ready_same_s"), pair(ours, dcp, "ready_half_s"),
                 pair(ours, dcp, "bytes_read_same", 1e6, "{:.2f}")]
        out.append(f"| {layout} | {n:,} | {ours['chunks']:,} | " + " | ".join(f"{v} | {r}" for v, r in cells)
                   + f" | {ours.get('parts_read_same', 0)} | {ours.get('digest_bytes_same', 0) / 1e6:.2f} |")
    return "\n".join(out)


def main() -> None:
    rows = json.load(open(sys.argv[1]))
    os.makedirs(sys.argv[2], exist_ok=True)
    for key, title, name in MEASURES:
        with open(os.path.join(sys.argv[2], name), "w") as f:
            f.write(chart(rows, key, title))
    print(table(rows))


if __name__ == "__main__":
    main()
