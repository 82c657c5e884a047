"""Per-block compression (issue 38): what the codec buys, and our writer with it against DCP's.

    python benchmarks/bench_compression.py [--steps 300] [--random-mb 64] [--json OUT]

Two states: a small transformer trained for ``--steps`` steps with Adam (its fp32 weights and
optimizer moments, and the weights cast to bf16 and fp16, as a mixed-precision run keeps
them), and random data of each dtype.  For each, every 1 MiB checksum block is compressed on
its own with zstd (levels 1 and 3), plain and byte-shuffled first (byte ``k`` of every element
together, as blosc does), on one thread: the ratio (logical / stored) and the compress and
decompress throughput.  Then the same states are saved and loaded, in the same run, through
DCP's ``FileSystemWriter``/``FileSystemReader`` with and without its ``ZStandard()`` extension,
and through ``DataStatesWriter``/``DataStatesReader`` without compression, with
``compression="zstd"`` (floats byte-shuffled, the rule it ships with) and with zstd unshuffled
(the shipped rule swapped out in this script, to measure what the shuffle costs and buys):
bytes on disk, and save and load seconds (median of 3, default options, page cache warm).
Needs ``zstandard``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import zstandard
from torch.distributed.checkpoint._extension import ZStandard

BLOCK = 1 << 20


def trained_state(steps: int) -> dict[str, torch.Tensor]:
    """A small transformer LM trained on a fixed token pattern, with its Adam moments."""
    torch.manual_seed(0)
    vocab, d, seq = 2000, 256, 64
    emb = nn.Embedding(vocab, d)
    body = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True, dropout=0.0), 4)
    head = nn.Linear(d, vocab)
    model = nn.ModuleDict({"emb": emb, "body": body, "head": head})
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    for _ in range(steps):
        x = torch.randint(0, vocab, (16, seq))
        y = (x * 7 + 3) % vocab  # a learnable map
        logits = head(body(emb(x)))
        nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, p in model.named_parameters():
        out[f"w.{name}"] = p.detach().clone()
        st = opt.state[p]
        out[f"m.{name}"], out[f"v.{name}"] = st["exp_avg"].clone(), st["exp_avg_sq"].clone()
    return out


def as_bytes(tensors: list[torch.Tensor]) -> tuple[bytes, int]:
    flat = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    return flat, tensors[0].element_size()


def shuffle(block: bytes, item: int) -> bytes:
    n = len(block) // item * item
    a = np.frombuffer(block, dtype=np.uint8, count=n).reshape(-1, item).T
    return a.tobytes() + block[n:]


def unshuffle(block: bytes, item: int, n: int) -> bytes:
    m = n // item * item
    a = np.frombuffer(block, dtype=np.uint8, count=m).reshape(item, -1).T
    return a.tobytes() + block[m:]


def codec(data: bytes, item: int, level: int, shuffled: bool) -> dict:
    c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    blocks = [data[i:i + BLOCK] for i in range(0, len(data), BLOCK)]
    t = time.perf_counter()
    stored = [c.compress(shuffle(b, item) if shuffled else b) for b in blocks]
    tc = time.perf_counter() - t
    t = time.perf_counter()
    back = [d.decompress(s) for s in stored]
    if shuffled:
        back = [unshuffle(b, item, len(b)) for b in back]
    td = time.perf_counter() - t
    assert b"".join(back) == data
    n, z = len(data), sum(len(s) for s in stored)
    return {"ratio": round(n / z, 3), "compress_MBps": round(n / tc / 1e6), "decompress_MBps": round(n / td / 1e6)}


def dcp_roundtrip(state: dict, root: str, zstd: bool) -> dict:
    path = os.path.join(root, "zstd" if zstd else "plain")
    shutil.rmtree(path, ignore_errors=True)
    kw = {"_extensions": [ZStandard()]} if zstd else {}
    t = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, **kw), no_dist=True)
    ts = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    back = {k: torch.empty_like(v) for k, v in state.items()}
    t = time.perf_counter()
    dcp.load(back, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    tl = time.perf_counter() - t
    assert all(torch.equal(back[k], state[k]) for k in state)
    return {"bytes": size, "save_s": round(ts, 3), "load_s": round(tl, 3)}


def ours_roundtrip(state: dict, root: str, mode: str) -> dict:
    """Save and load ``state`` through our writer and reader: ``mode`` "none", "zstd" or
    "zstd-unshuffled"."""
    from dcp_datastates import DataStatesReader, DataStatesWriter, placement
    from dcp_datastates.format import codec as codecs
    path = os.path.join(root, f"ours-{mode}")
    shutil.rmtree(path, ignore_errors=True)
    shipped = placement.codec_for
    if mode == "zstd-unshuffled":
        placement.codec_for = lambda dtype: codecs.ZSTD
    try:
        t = time.perf_counter()
        dcp.save(state, storage_writer=DataStatesWriter(path, compression=None if mode == "none" else "zstd"),
                 no_dist=True)
        ts = time.perf_counter() - t
    finally:
        placement.codec_for = shipped
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    back = {k: torch.empty_like(v) for k, v in state.items()}
    t = time.perf_counter()
    dcp.load(back, storage_reader=DataStatesReader(path), no_dist=True)
    tl = time.perf_counter() - t
    assert all(torch.equal(back[k], state[k]) for k in state)
    return {"bytes": size, "save_s": round(ts, 3), "load_s": round(tl, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--random-mb", type=int, default=64)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    trained = trained_state(a.steps)
    w = [v for k, v in trained.items() if k.startswith("w.")]
    mv = [v for k, v in trained.items() if not k.startswith("w.")]
    g = torch.Generator().manual_seed(1)
    n = a.random_mb << 20
    sets = {
        "trained weights fp32": w,
        "trained weights bf16": [t.to(torch.bfloat16) for t in w],
        "trained weights fp16": [t.to(torch.float16) for t in w],
        "Adam moments fp32": mv,
        "random fp32": [torch.randn(n // 4, generator=g)],
        "random bf16": [torch.randn(n // 2, generator=g).to(torch.bfloat16)],
        "random int8": [torch.randint(-128, 128, (n,), dtype=torch.int8, generator=g)],
    }
    rows = []
    for name, tensors in sets.items():
        data, item = as_bytes(tensors)
        for level in (1, 3):
            for shuffled in (False, True):
                r = codec(data, item, level, shuffled)
                rows.append({"data": name, "MB": round(len(data) / 1e6, 1), "level": level, "shuffle": shuffled, **r})
                print(f"{name:22s} {len(data) / 1e6:7.1f} MB  zstd-{level} shuffle={shuffled!s:5s}  "
                      f"ratio {r['ratio']:5.2f}  compress {r['compress_MBps']:5d} MB/s  "
                      f"decompress {r['decompress_MBps']:5d} MB/s", flush=True)
    root = tempfile.mkdtemp(dir=a.dir)
    dcp_rows = []
    states = (("trained fp32 + Adam", trained),
              ("trained weights bf16", {k: v.to(torch.bfloat16) for k, v in trained.items() if k.startswith("w.")}),
              ("random fp32", {"x": sets["random fp32"][0]}))
    ways = [("DCP", False), ("DCP ZStandard()", True), ("ours", "none"), ("ours zstd", "zstd"),
            ("ours zstd unshuffled", "zstd-unshuffled")]
    try:
        for name, state in states:
            logical = sum(v.nbytes for v in state.values())
            reps: dict[str, list] = {w: [] for w, _ in ways}
            for _ in range(3):  # interleaved: each way sees the same machine state
                for way, arg in ways:
                    reps[way].append(dcp_roundtrip(state, root, arg) if way.startswith("DCP")
                                     else ours_roundtrip(state, root, arg))
            for way, rs in reps.items():
                r = {"bytes": rs[0]["bytes"], "save_s": statistics.median(x["save_s"] for x in rs),
                     "load_s": statistics.median(x["load_s"] for x in rs)}
                r["save_MBps"] = round(logical / r["save_s"] / 1e6)
                r["load_MBps"] = round(logical / r["load_s"] / 1e6)
                r["ratio"] = round(logical / r["bytes"], 3)
                dcp_rows.append({"data": name, "way": way, "logical": logical, **r})
                print(f"{name:22s} {way:22s} {r['bytes'] / 1e6:8.1f} MB (x{r['ratio']:.2f})  "
                      f"save {r['save_s']:.3f} s ({r['save_MBps']} MB/s)  "
                      f"load {r['load_s']:.3f} s ({r['load_MBps']} MB/s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"codec": rows, "dcp": dcp_rows, "zstandard": zstandard.__version__,
                       "torch": torch.__version__, "cpus": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    main()
