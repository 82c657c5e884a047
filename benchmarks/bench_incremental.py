"""Incremental checkpoints on a LoRA-style CPU fine-tune, against full saves, in one run.

    python benchmarks/bench_incremental.py [--gb 1.0] [--ckpts 10] [--dir /tmp/dcpds-inc]

Three parts:

1. **LoRA run.**  A transformer of ``--gb`` fp32 weights, all frozen, with rank-16 adapters
   on every attention projection and Adam on the adapters only, trains for real (forward,
   backward, step) and checkpoints ``--ckpts`` times through ``Checkpointer`` with
   ``incremental=True``, then again with ``incremental=False`` (synchronous saves, so the
   times are durable saves).  Reports bytes written and save time per checkpoint (after a
   ``gc.collect()``, in both modes: with torch loaded a full GC pass takes about 0.15 s here
   and otherwise lands in random saves).  Then
   retention purges all but the last 3 steps and every retained step is loaded and compared
   bit-exactly with a copy of the state taken when it was saved.
2. **Hashing cost.**  A full save (nothing reusable: the base holds other bytes) with
   incremental on, against incremental off, alternating; plus the digest throughput.
3. **Dedup unit.**  A 256 MiB embedding table (4 KiB rows) with 0.05% of its rows updated
   (sparse updates): bytes written, segments, manifest size and cold load time per unit size.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from bench_core import drop_caches  # noqa: E402

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter  # noqa: E402
from dcp_datastates.tiers.manifests import load_manifest  # noqa: E402
from dcp_datastates.tiers import StorageTier  # noqa: E402

MiB = 1 << 20


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 16) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.base.weight.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.01)
        self.b = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (LoRALinear(d, d) for _ in range(4))
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        for m in (self.up, self.down, self.n1, self.n2):
            m.requires_grad_(False)

    def forward(self, x):
        h = self.n1(x)
        att = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / math.sqrt(h.shape[-1]), -1)
        x = x + self.o(att @ self.v(h))
        return x + self.down(torch.relu(self.up(self.n2(x))))


class LoRAModel(nn.Module):
    def __init__(self, gb: float, d: int = 1024, vocab: int = 8192) -> None:
        super().__init__()
        per_layer = (4 * d * d + 8 * d * d) * 4
        layers = max(1, round((gb * 1e9 - 2 * vocab * d * 4) / per_layer))
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.embed.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _state(model, opt, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "meta": {"step": step}}


def _clone(obj):
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _nbytes(sd) -> int:
    if isinstance(sd, dict):
        return sum(_nbytes(v) for v in sd.values())
    if isinstance(sd, list):
        return sum(_nbytes(v) for v in sd)
    return sd.numel() * sd.element_size() if isinstance(sd, torch.Tensor) else 0


def lora_run(root: str, gb: float, ckpts: int, steps_between: int) -> dict:
    torch.manual_seed(0)
    model = LoRAModel(gb)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trainable, lr=1e-3)
    total = _nbytes(model.state_dict())
    frozen_frac = 1 - sum(p.numel() for p in trainable) / sum(p.numel() for p in model.parameters())
    out = {"state_bytes": total, "frozen_param_fraction": frozen_frac,
           "layers": len(model.blocks), "runs": {}}
    snapshots = {}
    for mode in ("incremental", "full"):
        torch.manual_seed(1)
        run = os.path.join(root, mode)
        shutil.rmtree(run, ignore_errors=True)
        ck = Checkpointer([run], async_mode=None, incremental=(mode == "incremental"))
        rows = []
        for c in range(1, ckpts + 1):
            for _ in range(steps_between):
                tokens = torch.randint(0, 8192, (2, 32))
                loss = model(tokens).float().logsumexp(-1).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            sd = _state(model, opt, c)
            if mode == "incremental":
                snapshots[c] = _clone({"lora": {k: v for k, v in sd["model"].items() if ".a" in k or ".b" in k},
                                       "optim": sd["optim"], "meta": sd["meta"]})
            gc.collect()  # a random full GC pass (0.15 s with torch loaded) would swamp a 0.1 s save
            t = time.perf_counter()
            ck.save(c, sd)
            dt = time.perf_counter() - t
            w = ck._last_writer_stats if hasattr(ck, "_last_writer_stats") else None
            d = ck.step_path(0, c)
            m = load_manifest(StorageTier(d))
            written = sum(s for n, s in m.files.items() if n not in m.homes)
            rows.append({"ckpt": c, "seconds": dt, "bytes_written": written, "stats": w})
            print(f"  {mode:<11} ckpt {c:>2}: {written / 2**20:9.1f} MiB written in {dt:6.3f} s", flush=True)
        out["runs"][mode] = rows
    inc, full = out["runs"]["incremental"], out["runs"]["full"]
    later_inc = [r["bytes_written"] for r in inc[1:]]
    out["written_after_first_vs_full"] = max(later_inc) / statistics.median(r["bytes_written"] for r in full)
    out["time_after_first_vs_full"] = (statistics.median(r["seconds"] for r in inc[1:])
                                       / statistics.median(r["seconds"] for r in full[1:]))
    # retention: keep the last 3 steps, then load every retained step bit-exactly
    run = os.path.join(root, "incremental")
    ck = Checkpointer([run], async_mode=None, incremental=True, keep=3)
    ck._purge()
    kept = ck.committed_steps(0)
    frozen_ref = {k: v for k, v in model.state_dict().items() if not (".a" in k or ".b" in k)}
    ok = {}
    for s in kept:
        m2 = LoRAModel(gb)
        o2 = torch.optim.Adam([p for p in m2.parameters() if p.requires_grad], lr=1e-3)
        for p in m2.parameters():
            p.data.fill_(0.5)
        sd = _state(m2, o2, -1)
        sd["optim"] = _clone(snapshots[s]["optim"])  # the structure to load into
        for t in sd["optim"]["state"].values():
            for k, v in t.items():
                if isinstance(v, torch.Tensor):
                    v.fill_(0)
        dcp.load(sd, storage_reader=DataStatesReader(ck.step_path(0, s)), no_dist=True)
        lora_ok = all(torch.equal(sd["model"][k], v) for k, v in snapshots[s]["lora"].items())
        frozen_ok = all(torch.equal(sd["model"][k], v) for k, v in frozen_ref.items())
        ok[s] = bool(lora_ok and frozen_ok and _equal(sd["optim"], snapshots[s]["optim"])
                     and sd["meta"] == {"step": s})
    out["retained"] = kept
    out["retained_bit_exact"] = ok
    out["dirs_after_purge"] = sorted(os.listdir(run))
    return out


def hashing_cost(root: str, gb: float, reps: int) -> dict:
    from dcp_datastates.bench import transformer_state
    from dcp_datastates.format.checksum import block_checksums
    sd = transformer_state(gb)
    other = {k: (v + 1 if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in sd.items()}
    base = os.path.join(root, "hash", "step-0")
    shutil.rmtree(os.path.join(root, "hash"), ignore_errors=True)
    dcp.save(other, storage_writer=DataStatesWriter(base), no_dist=True)  # nothing in it matches sd
    times = {"off": [], "on": []}
    for r in range(reps):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            d = os.path.join(root, "hash", f"step-{mode}")
            shutil.rmtree(d, ignore_errors=True)
            w = DataStatesWriter(d, incremental_base="step-0" if mode == "on" else None)
            gc.collect()
            t = time.perf_counter()
            dcp.save(sd, storage_writer=w, no_dist=True)
            times[mode].append(time.perf_counter() - t)
            assert w.last_stats["bytes_reused"] == 0
    flat = [v.contiguous().view(-1).view(torch.uint8).numpy() for v in sd.values() if isinstance(v, torch.Tensor)]
    n = sum(a.nbytes for a in flat)
    t = time.perf_counter()
    for a in flat:
        block_checksums(a)
    digest_s = time.perf_counter() - t
    ratios = [on / off for on, off in zip(times["on"], times["off"])]
    return {"bytes": n, "save_off_s": statistics.median(times["off"]), "save_on_s": statistics.median(times["on"]),
            "slowdown": statistics.median(ratios) - 1, "digest_gbps_one_core": n / digest_s / 1e9}


def unit_sweep(root: str, table_mib: int, frac: float, units: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    rows_n = table_mib * MiB // (1024 * 4)
    table = torch.randn(rows_n, 1024, generator=g)
    upd = torch.randperm(rows_n, generator=g)[: max(1, int(rows_n * frac))]
    changed = table.clone()
    changed[upd] += 1
    out = []
    for u in units:
        run = os.path.join(root, f"unit-{u}")
        shutil.rmtree(run, ignore_errors=True)
        dcp.save({"t": table}, storage_writer=DataStatesWriter(f"{run}/step-1"), no_dist=True)
        w = DataStatesWriter(f"{run}/step-2", incremental_base="step-1", dedup_unit_bytes=u * MiB)
        t = time.perf_counter()
        dcp.save({"t": changed}, storage_writer=w, no_dist=True)
        save_s = time.perf_counter() - t
        m = load_manifest(StorageTier(f"{run}/step-2"))
        segs = sum(len(c.extent.segs) for e in m.tensors.values() for c in e.chunks)
        cold = drop_caches()
        dst = {"t": torch.empty_like(table)}
        t = time.perf_counter()
        dcp.load(dst, storage_reader=DataStatesReader(f"{run}/step-2"), no_dist=True)
        load_s = time.perf_counter() - t
        assert torch.equal(dst["t"], changed)
        out.append({"unit_mib": u, "bytes_written": w.last_stats["bytes_written"], "segments": segs,
                    "manifest_bytes": os.path.getsize(f"{run}/step-2/.metadata"), "save_s": save_s,
                    "load_s": load_s, "cold": cold})
        print(f"  unit {u:>2} MiB: {w.last_stats['bytes_written'] / 2**20:7.1f} MiB written, {segs} segments, "
              f"save {save_s:.3f} s, load {load_s:.3f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--ckpts", type=int, default=10)
    ap.add_argument("--steps-between", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dcpds-inc")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sparse-rows", type=float, default=0.0005, help="fraction of table rows updated")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    print("LoRA run")
    res = {"lora": lora_run(a.dir, a.gb, a.ckpts, a.steps_between)}
    print("hashing cost")
    res["hashing"] = hashing_cost(a.dir, a.gb, a.reps)
    print("dedup unit")
    res["units"] = unit_sweep(a.dir, 256, a.sparse_rows, [1, 2, 4, 8, 16])
    lo = res["lora"]
    print(json.dumps({k: v for k, v in lo.items() if k != "runs"}, indent=1))
    print(json.dumps(res["hashing"], indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
