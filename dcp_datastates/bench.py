"""The ``dcp-datastates bench`` suite: save and load against DCP in one run, plus the stage
timeline of one asynchronous two-tier checkpoint; PNG charts through matplotlib (optional)."""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future

import torch
import torch.distributed.checkpoint as dcp

from .load.reader import DataStatesReader
from .save.guard import async_save
from .save.writer import DataStatesWriter
from .tiers.direct_io import evict_from_page_cache


def transformer_state(total_gb: float = 1.5, hidden: int = 2048, vocab: int = 32000) -> dict:
    """A few large tensors and hundreds of small ones, fp32 and bf16, about ``total_gb`` GB."""
    g = torch.Generator().manual_seed(0)
    vocab = max(256, min(vocab, int(total_gb * 1e9 * 0.18 / (hidden * 4))))
    sd = {"embed.weight": torch.randn(vocab, hidden, generator=g)}
    layer_bytes = (4 * hidden * hidden + 3 * hidden * 4 * hidden) * 2
    n_layers = max(1, int((total_gb * 1e9 - sd["embed.weight"].nbytes) // (layer_bytes + 12 * hidden * 4)))
    for i in range(n_layers):
        p = f"layers.{i}."
        sd[p + "attn.qkv"] = torch.randn(3 * hidden, hidden, generator=g).bfloat16()
        sd[p + "attn.out"] = torch.randn(hidden, hidden, generator=g).bfloat16()
        sd[p + "mlp.up"] = torch.randn(4 * hidden, hidden, generator=g).bfloat16()
        sd[p + "mlp.gate"] = torch.randn(4 * hidden, hidden, generator=g).bfloat16()
        sd[p + "mlp.down"] = torch.randn(hidden, 4 * hidden, generator=g).bfloat16()
        for n in ("ln1.w", "ln1.b", "ln2.w", "ln2.b", "q_norm", "k_norm", "attn.bias",
                  "out.bias", "mlp.b1", "mlp.b2", "mlp.b3", "scale"):
            sd[p + n] = torch.randn(hidden, generator=g)
    return sd


def nbytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def run_bench(out: str, *, gb: float = 0.5, charts: bool = True, progress=None) -> dict:
    os.makedirs(out, exist_ok=True)
    sd = transformer_state(gb, hidden=1024 if gb < 0.5 else 2048)
    size = nbytes(sd)
    tmpl = {k: torch.empty_like(v) for k, v in sd.items()}
    methods = [
        ("dcp-datastates", lambda p: DataStatesWriter(p, overwrite=True), lambda p: DataStatesReader(p)),
        ("FileSystemWriter(thread_count=4)", lambda p: dcp.FileSystemWriter(p, thread_count=4),
         lambda p: dcp.FileSystemReader(p)),
        ("FileSystemWriter(thread_count=1)", lambda p: dcp.FileSystemWriter(p), lambda p: dcp.FileSystemReader(p)),
    ]
    rows = []
    for i, (name, mk_w, mk_r) in enumerate(methods):
        path = os.path.join(out, f"ckpt-{i}")
        shutil.rmtree(path, ignore_errors=True)
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=mk_w(path), no_dist=True)
        save_s = time.perf_counter() - t0
        evict_from_page_cache(path)  # cold load for every method (a buffered save leaves it cached)
        t0 = time.perf_counter()
        dcp.load(tmpl, storage_reader=mk_r(path), no_dist=True)
        load_s = time.perf_counter() - t0
        if not all(torch.equal(tmpl[k], sd[k]) for k in sd):
            raise RuntimeError(f"bench: {name} loaded different values than it saved")
        rows.append({"name": name, "save_s": save_s, "save_GBps": size / save_s / 1e9,
                     "load_s": load_s, "load_GBps": size / load_s / 1e9})
        shutil.rmtree(path, ignore_errors=True)
        if progress:
            progress(i + 1, len(methods) + 1, "bench")
    # the stages of one async checkpoint over two tiers
    t1, t2 = os.path.join(out, "timeline", "tier1"), os.path.join(out, "timeline", "tier2")
    shutil.rmtree(os.path.join(out, "timeline"), ignore_errors=True)
    w = DataStatesWriter(t1, persist_to=[t2])
    fut = async_save(sd, storage_writer=w, no_dist=True)
    w.wait_snapshot()
    assert isinstance(fut, Future), "DCP returns a plain future without an async stager"
    fut.result()
    w.wait_persisted()
    timeline = w.timings()
    shutil.rmtree(os.path.join(out, "timeline"), ignore_errors=True)
    if progress:
        progress(len(methods) + 1, len(methods) + 1, "bench")
    res = {"state_bytes": size, "rows": rows, "timeline": timeline}
    if charts:
        res["charts"] = write_charts(out, rows, timeline)
    return res


def write_charts(out: str, rows: list[dict], timeline: dict) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("charts need matplotlib: pip install 'dcp-datastates[bench]' "
                           "(or pass --no-charts)") from e
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["name"].replace("FileSystemWriter", "FSWriter") for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["save_GBps"] for r in rows], width=0.4, label="save (durable)")
    ax.bar([i + 0.2 for i in x], [r["load_GBps"] for r in rows], width=0.4, label="load")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title("Throughput against DCP's FileSystemWriter/Reader")
    ax.legend()
    fig.tight_layout()
    p = os.path.join(out, "throughput.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    fig, ax = plt.subplots(figsize=(8, 2.8))
    stages = [("snapshot (copy out of live state)", 0.0, timeline.get("snapshot_done_s", 0.0)),
              ("tier-1 data written", timeline.get("snapshot_done_s", 0.0), timeline.get("data_written_s", 0.0)),
              ("tier-1 commit", timeline.get("data_written_s", 0.0), timeline.get("committed_s", 0.0)),
              ("persistent tier commit", timeline.get("committed_s", 0.0), timeline.get("persisted_s", 0.0))]
    for i, (_label, a, b) in enumerate(stages):
        ax.barh(i, max(b - a, 0.001), left=a)
        ax.text(b, i, f" {b:.2f}s", va="center", fontsize=8)
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([s[0] for s in stages], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds after the save call")
    ax.set_title("One asynchronous two-tier checkpoint")
    fig.tight_layout()
    p = os.path.join(out, "timeline.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths
