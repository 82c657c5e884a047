"""``dcp-datastates`` / ``python -m dcp_datastates``: demo, inspect, verify."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import CheckpointError, PickleNotAllowedError
from .verify import _rank_of, inspect_run, verify_checkpoint
import msgpack
from .format import MANIFEST_NAME
from .reader import load_manifest
from .tiers import StorageTier
from .cli_demo import run_demo
from . import convert
from .bench import run_bench


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _progress(done: int, total: int, label: str) -> None:
    if not sys.stderr.isatty():
        return
    width = 30
    frac = done / total if total else 1.0
    bar = "#" * int(frac * width)
    sys.stderr.write(f"\r{label} [{bar:<{width}}] {frac * 100:5.1f}%")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


# ----------------------------------------------------------------- inspect

def _opts(args) -> dict | None:
    return json.loads(args.storage_options) if getattr(args, "storage_options", None) else None


def cmd_inspect(args) -> int:

    tier = StorageTier(args.path, _opts(args))
    if not tier.exists(MANIFEST_NAME) and any(n.startswith("step-") for n in tier.listdir()):
        rows = inspect_run(tier)
        if args.json:
            print(json.dumps({"path": args.path, "steps": rows}, indent=1))
            return 0
        print(f"run {args.path}: {len(rows)} committed steps")
        print(f"{'step':>8}  {'owned':>12}  {'shared':>12}  {'used by later':>14}")
        for r in rows:
            print(f"{r['step']:>8}  {_fmt_bytes(r['owned_bytes']):>12}  {_fmt_bytes(r['shared_bytes']):>12}  "
                  f"{_fmt_bytes(r['used_by_later']):>14}")
        return 0
    m = load_manifest(tier)
    tiers = [args.path]
    try:
        if tier.exists(".persisted"):
            tiers += list(msgpack.unpackb(tier.read_bytes(".persisted")))
    except (CheckpointError, OSError, ValueError, TypeError, msgpack.UnpackException) as e:
        print(f"note: the record of slower tiers is unreadable ({e}); listing this tier only",
              file=sys.stderr)
    rows = []
    for fqn, t in sorted(m.tensors.items()):
        nbytes = sum((c.extent.nbytes if c.extent else sum(p[2].nbytes for p in c.parts.values()))
                     for c in t.chunks)
        per_rank: dict = {}
        for c in t.chunks:
            e = c.extent if c.extent else next(iter(c.parts.values()))[2]
            r = _rank_of(e.file)
            per_rank[r] = per_rank.get(r, 0) + 1
        rows.append({"key": fqn, "dtype": t.dtype, "shape": list(t.size), "chunks": len(t.chunks),
                     "chunks_per_rank": {str(k): v for k, v in sorted(per_rank.items(), key=str)},
                     "bytes": nbytes})
    for fqn, v in sorted(m.values.items()):
        rows.append({"key": fqn, "dtype": f"value/{v.encoding}", "shape": [], "chunks": 1,
                     "bytes": len(v.data)})
    owned, shared = m.usage()
    own_files = {n: sz for n, sz in m.files.items() if n not in m.homes}
    info = {"path": args.path, "format_version": m.version, "save_id": m.save_id,
            "world_size": m.world_size, "files": own_files, "total_bytes": sum(own_files.values()),
            "owned_bytes": owned, "shared_bytes": sum(shared.values()), "shared_from": shared,
            "committed_tiers": tiers, "entries": rows}
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"checkpoint {args.path}: format v{m.version}, save {m.save_id}, world size {m.world_size}, "
          f"{len(own_files)} data files, {_fmt_bytes(sum(own_files.values()))}")
    print(f"owns {_fmt_bytes(owned)} of tensor data, shares {_fmt_bytes(sum(shared.values()))}"
          + (" from " + ", ".join(f"{h} ({_fmt_bytes(n)})" for h, n in sorted(shared.items())) if shared else ""))
    print("committed on: " + ", ".join(tiers))
    kw = max([len(r["key"]) for r in rows] + [3])
    print(f"{'key':<{kw}}  {'dtype':<14} {'shape':<20} {'chunks (per rank)':<22} {'bytes':>12}")
    for r in rows:
        cpr = r.get("chunks_per_rank") or {}
        chunks = f"{r['chunks']} (" + " ".join(f"r{k}:{v}" for k, v in cpr.items()) + ")" if cpr else str(r["chunks"])
        print(f"{r['key']:<{kw}}  {r['dtype']:<14} {str(r['shape']):<20} {chunks:<22} "
              f"{_fmt_bytes(r['bytes']):>12}")
    return 0


# ------------------------------------------------------------------ verify

def cmd_verify(args) -> int:
    problems = verify_checkpoint(args.path, _opts(args), progress=None if args.json else _progress)
    if args.json:
        print(json.dumps({"path": args.path, "ok": not problems, "problems": problems}))
    elif problems:
        print(f"DAMAGED: {args.path}")
        for p in problems:
            print(f"  {p}")
        print("restore from another tier or an earlier step")
    else:
        print(f"OK: {args.path}: every block matches its checksum")
    return 1 if problems else 0


# -------------------------------------------------------------------- demo

def cmd_demo(args) -> int:
    return run_demo(args.out, width=args.width, depth=args.depth, steps=args.steps, kill_at=args.kill_at)


# ----------------------------------------------------------------- convert

def cmd_convert(args) -> int:
    if args.to == "dcp":
        convert.to_dcp(args.src, args.dst)
    elif args.to == "datastates":
        try:
            convert.from_dcp(args.src, args.dst, allow_pickle=args.allow_pickle)
        except PickleNotAllowedError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        shard = int(args.max_shard_bytes) if args.max_shard_bytes else None
        files = convert.to_safetensors(args.src, args.dst, max_shard_bytes=shard)
        if not args.json:
            print(f"wrote {len(files)} safetensors file(s) under {args.dst}")
    if args.json:
        print(json.dumps({"src": args.src, "dst": args.dst, "to": args.to, "ok": True}))
    elif args.to != "safetensors":
        print(f"converted {args.src} -> {args.dst} ({args.to})")
    return 0


# ------------------------------------------------------------------- bench

def cmd_bench(args) -> int:
    res = run_bench(args.out, gb=args.gb, charts=not args.no_charts, progress=None if args.json else _progress)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{'backend':<34} {'save s':>8} {'save GB/s':>10} {'load s':>8} {'load GB/s':>10}")
    for r in res["rows"]:
        print(f"{r['name']:<34} {r['save_s']:>8.2f} {r['save_GBps']:>10.2f} "
              f"{r.get('load_s', float('nan')):>8.2f} {r.get('load_GBps', float('nan')):>10.2f}")
    t = res["timeline"]
    print("\none async two-tier checkpoint, seconds after the save call: " +
          ", ".join(f"{k[:-2]} {v:.2f}" for k, v in t.items()))
    for c in res.get("charts", []):
        print(f"chart: {c}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dcp-datastates", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="the main job: 2-rank FSDP2 training; save vs DCP; kill and resume")
    p.add_argument("--out", help="directory for the checkpoints (default: a temp dir)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--steps", type=int, default=12, help="training steps of the kill/resume run")
    p.add_argument("--kill-at", type=int, default=7, help="SIGKILL the run after this step")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("convert", help="to/from DCP's FileSystemWriter format, to safetensors")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", choices=["dcp", "datastates", "safetensors"], required=True,
                   help="dcp: ours -> DCP; datastates: DCP -> ours; safetensors: ours -> safetensors")
    p.add_argument("--max-shard-bytes", help="safetensors: shard into files of at most this size")
    p.add_argument("--allow-pickle", action="store_true",
                   help="datastates: read DCP's pickled .metadata and torch.save values (trusted "
                        "checkpoints only), and keep values msgpack cannot express, as pickle")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("bench", help="benchmark against DCP in one run; table and PNG charts")
    p.add_argument("--out", default="bench-out", help="directory for checkpoints and charts")
    p.add_argument("--gb", type=float, default=0.5, help="state size in GB")
    p.add_argument("--no-charts", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_bench)
    for name, fn, help_ in (("inspect", cmd_inspect, "list keys, dtypes, shapes, chunks and bytes"),
                            ("verify", cmd_verify, "check every checksum; exit 1 on damage")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("path", help="checkpoint directory or fsspec URL")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--storage-options", help="fsspec options as JSON, for URLs")
        p.set_defaults(fn=fn)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


