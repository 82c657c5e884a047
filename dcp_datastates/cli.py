"""``dcp-datastates`` / ``python -m dcp_datastates``: demo, inspect, verify."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


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


def _rank_of(file: str) -> int | None:
    import re
    m = re.match(r"^data-r(\d{5})-", file)
    return int(m.group(1)) if m else None


def cmd_inspect(args) -> int:
    import msgpack

    from .reader import load_manifest
    from .tiers import StorageTier
    tier = StorageTier(args.path, _opts(args))
    m = load_manifest(tier)
    tiers = [args.path]
    try:
        if tier.exists(".persisted"):
            tiers += list(msgpack.unpackb(tier.read_bytes(".persisted")))
    except Exception:  # noqa: BLE001 - the record is informational
        pass
    rows = []
    for fqn, t in sorted(m.tensors.items()):
        nbytes = sum((c.extent.nbytes if c.extent else sum(p[2].nbytes for p in c.parts.values()))
                     for c in t.chunks)
        per_rank: dict = {}
        for c in t.chunks:
            f = c.extent.file if c.extent else next(iter(c.parts.values()))[2].file
            r = _rank_of(f)
            per_rank[r] = per_rank.get(r, 0) + 1
        rows.append({"key": fqn, "dtype": t.dtype, "shape": list(t.size), "chunks": len(t.chunks),
                     "chunks_per_rank": {str(k): v for k, v in sorted(per_rank.items(), key=str)},
                     "bytes": nbytes})
    for fqn, v in sorted(m.values.items()):
        rows.append({"key": fqn, "dtype": f"value/{v.encoding}", "shape": [], "chunks": 1,
                     "bytes": len(v.data)})
    info = {"path": args.path, "format_version": 1, "save_id": m.save_id, "world_size": m.world_size,
            "files": m.files, "total_bytes": sum(m.files.values()), "committed_tiers": tiers,
            "entries": rows}
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"checkpoint {args.path}: format v1, save {m.save_id}, world size {m.world_size}, "
          f"{len(m.files)} data files, {_fmt_bytes(sum(m.files.values()))}")
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

def verify_checkpoint(path: str, storage_options=None, progress=None) -> list[str]:
    """Check every block of every extent; return one line per problem (empty when intact)."""
    import xxhash

    from .errors import CheckpointError
    from .format.checksum import verify_blocks
    from .reader import load_manifest
    from .tiers import StorageTier
    tier = StorageTier(path, storage_options)
    try:
        m = load_manifest(tier)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    extents = []
    for fqn, t in m.tensors.items():
        for c in t.chunks:
            if c.extent is not None:
                extents.append((fqn, c.extent))
            for pname, (_, _, ext) in c.parts.items():
                extents.append((f"{fqn}/{pname}", ext))
    for fqn, v in m.values.items():
        if xxhash.xxh3_64_intdigest(v.data) != v.checksum:
            problems.append(f"value {fqn}: checksum mismatch in the manifest")
    sizes = {}
    for name, want in m.files.items():
        try:
            sizes[name] = tier.size(name)
        except (FileNotFoundError, OSError):
            problems.append(f"file {name}: missing")
            continue
        if sizes[name] < want:
            problems.append(f"file {name}: truncated ({sizes[name]} of {want} bytes)")
    total = sum(e.nbytes for _, e in extents) or 1
    done = 0
    for fqn, e in extents:
        if e.file not in sizes or sizes[e.file] < e.offset + e.nbytes:
            problems.append(f"tensor {fqn}: extent in {e.file} is missing or truncated")
            continue
        buf = bytearray(e.nbytes)
        tier.read_into(e.file, e.offset, buf)
        bad = verify_blocks(buf, e.sums, 0, m.block_size)
        if bad is not None:
            problems.append(f"tensor {fqn}: checksum mismatch in {e.file} block {bad}")
        done += e.nbytes
        if progress:
            progress(done, total, "verify")
    return problems


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

def _demo_model(width: int, depth: int):
    import torch.nn as nn
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _demo_state(world: int, width: int, depth: int, steps: int, seed: int):
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = _demo_model(width, depth)
    for layer in model:
        if hasattr(layer, "weight"):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(torch.randn(16, width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    return model, opt, {"model": msd, "optim": osd, "train": {"step": steps}}


def _demo_rank(rank, world, port, out_dir, width, depth, results):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from . import DataStatesWriter
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _, _, sd = _demo_state(world, width, depth, 2, 0)
        timings = {}
        for name, make in (("dcp-datastates", lambda p: DataStatesWriter(p)),
                           ("FileSystemWriter", lambda p: dcp.FileSystemWriter(p, thread_count=4))):
            path = os.path.join(out_dir, name)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=make(path))
            dist.barrier()
            timings[name] = time.perf_counter() - t0
        if rank == 0:
            results.put(timings)
    finally:
        dist.destroy_process_group()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if not n.startswith("."))


def cmd_demo(args) -> int:
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    from . import DataStatesReader
    from .reader import load_manifest
    from .tiers import StorageTier

    base = args.out or tempfile.mkdtemp(prefix="dcpds-demo-")
    os.makedirs(base, exist_ok=True)
    world, width, depth = 2, args.width, args.depth
    print(f"demo: {world}-rank FSDP2 training on CPU/gloo, MLP {depth}x{width}, Adam; "
          f"checkpoints under {base}")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_demo_rank, args=(r, world, port, base, width, depth, q))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print("demo: a training rank failed", file=sys.stderr)
        return 1
    save_t = q.get()

    # Reload both checkpoints into ONE process (2 -> 1 reshard) and compare.
    ours, ref = os.path.join(base, "dcp-datastates"), os.path.join(base, "FileSystemWriter")
    m = load_manifest(StorageTier(ours))
    load_t = {}
    loaded = {}
    for name, path, reader in (("dcp-datastates", ours, DataStatesReader(ours)),
                               ("FileSystemWriter", ref, dcp.FileSystemReader(ref))):
        t0 = time.perf_counter()
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
        loaded[name] = _load_state_dict_from_keys(storage_reader=reader)
        load_t[name] = time.perf_counter() - t0
    import torch.utils._pytree as pytree
    a, b = pytree.tree_leaves(loaded["dcp-datastates"]), pytree.tree_leaves(loaded["FileSystemWriter"])
    equal = len(a) == len(b) and all(
        (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y) for x, y in zip(a, b))
    size = sum(m.files.values())
    print()
    print(f"{'backend':<18} {'save s':>8} {'save GB/s':>10} {'load 2->1 s':>12} {'load GB/s':>10} {'on disk':>10}")
    for name, path in (("dcp-datastates", ours), ("FileSystemWriter", ref)):
        nbytes = _dir_bytes(path)
        print(f"{name:<18} {save_t[name]:>8.2f} {size / save_t[name] / 1e9:>10.2f} "
              f"{load_t[name]:>12.2f} {size / load_t[name] / 1e9:>10.2f} {_fmt_bytes(nbytes):>10}")
    print()
    print(f"state: {_fmt_bytes(size)} of tensors, {len(m.tensors)} tensors, {len(m.values)} values")
    print(f"2-rank save reloaded into 1 rank: {'identical to DCP FileSystemReader' if equal else 'MISMATCH'}")
    problems = verify_checkpoint(ours)
    print(f"verify: {'OK' if not problems else problems}")
    return 0 if equal and not problems else 1


# ----------------------------------------------------------------- convert

def cmd_convert(args) -> int:
    from . import convert
    if args.to == "dcp":
        convert.to_dcp(args.src, args.dst)
    elif args.to == "datastates":
        convert.from_dcp(args.src, args.dst, allow_pickle=args.allow_pickle)
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
    from .bench import run_bench
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
    p = sub.add_parser("demo", help="2-rank FSDP2 training, save, reshard-load, compare with DCP")
    p.add_argument("--out", help="directory for the checkpoints (default: a temp dir)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=6)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("convert", help="to/from DCP's FileSystemWriter format, to safetensors")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", choices=["dcp", "datastates", "safetensors"], required=True,
                   help="dcp: ours -> DCP; datastates: DCP -> ours; safetensors: ours -> safetensors")
    p.add_argument("--max-shard-bytes", help="safetensors: shard into files of at most this size")
    p.add_argument("--allow-pickle", action="store_true",
                   help="datastates: keep values msgpack cannot express, as pickle")
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


