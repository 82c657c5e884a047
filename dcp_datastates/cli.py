"""``dcp-datastates`` / ``python -m dcp_datastates``: inspect, verify, clean, convert, bench, demo.

Exit codes: 0 ok; 1 damaged (verify found a problem); 2 bad usage or a refused request (a
pickle without ``--allow-pickle``); 3 the path does not exist; 4 the path holds no committed
checkpoint (a run directory where a step is needed, an interrupted save, a purged step);
5 the path holds a checkpoint of another format (DCP's own); 6 any other checkpoint error.
Known errors print one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys
import warnings

import msgpack
from torch.distributed.checkpoint.api import CheckpointException

from . import convert
from ._version import __version__
from .bench import run_bench
from .cli_demo import run_demo
from .errors import (
    CheckpointError,
    ForeignFormatError,
    ManifestError,
    NotACheckpointError,
    PickleNotAllowedError,
    UnsupportedFormatVersion,
    first_line,
)
from .format import MANIFEST_NAME
from .format.dtypes import dtype_from_name
from .format.names import PERSISTED_RECORD, data_file_rank
from .format.values import decode_value
from .replicas.records import records_in
from .tiers import StorageTier
from .tiers.manifests import load_manifest
from .verify import (
    Verified,
    clean_run,
    inspect_run,
    leftovers,
    verify_checkpoint,
    verify_node_copy,
    verify_run,
)

EXIT_DAMAGED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_NOT_A_CHECKPOINT, EXIT_FOREIGN, EXIT_ERROR = 1, 2, 3, 4, 5, 6
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.I)


def parse_size(text: str) -> int:
    """``5GB``, ``512MiB``, ``1.5G`` or plain bytes (``200000``): decimal units for ``KB``...,
    binary for ``KiB``...."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 200000, 512MiB, 5GB)")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    scale = (1024 if binary else 1000) ** " KMGT".index(unit or " ")
    return int(num * scale)


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
        rows, left = inspect_run(tier), leftovers(tier)
        if args.json:
            print(json.dumps({"path": args.path, "steps": rows,
                              "uncommitted": [dataclasses.asdict(x) for x in left]}, indent=1))
            return 0
        print(f"run {args.path}: {len(rows)} committed steps")
        print(f"{'step':>8}  {'owned':>12}  {'shared':>12}  {'used by later':>14}")
        for r in rows:
            print(f"{r['step']:>8}  {_fmt_bytes(r['owned_bytes']):>12}  {_fmt_bytes(r['shared_bytes']):>12}  "
                  f"{_fmt_bytes(r['used_by_later']):>14}")
        for x in left:
            print(f"{x.dir}: uncommitted, {_fmt_bytes(x.reclaimable_bytes)} in {x.files} file(s) no committed step "
                  f"references" + (" (a save is writing it now)" if x.claimed else " (`dcp-datastates clean` removes them)"))
        return 0
    m = load_manifest(tier)
    replicas = [{"rank": r.rank, "replicas": r.replicas, "confirmed_by": r.confirmed, "complete": r.complete,
                 "holds_files_of": sorted(r.held)} for r in records_in(tier, m.save_id)]
    tiers = [args.path]
    try:
        if tier.exists(PERSISTED_RECORD):
            tiers += list(msgpack.unpackb(tier.read_bytes(PERSISTED_RECORD, max_bytes=1 << 20)))
    except (CheckpointError, OSError, ValueError, TypeError, msgpack.UnpackException) as e:
        print(f"note: the record of slower tiers is unreadable ({e}); listing this tier only",
              file=sys.stderr)
    rows = []
    elsewhere = 0
    for fqn, t in sorted(m.tensors.items()):
        try:
            chunks = t.chunks
        except ManifestError as e:  # a node's copy: the records of other nodes' ranks are there
            if e.file is None or tier.exists(e.file):
                raise
            if not args.node_local:
                raise ManifestError(f"{e.reason}; if this is a node's own copy of a step (node_local=True), "
                                    "pass --node-local", checkpoint=e.checkpoint, file=e.file) from None
            itemsize = dtype_from_name(t.dtype).itemsize
            rows.append({"key": fqn, "dtype": t.dtype, "shape": list(t.size), "chunks": t.count(),
                         "bytes": math.prod(t.size) * itemsize, "records": "on other nodes"})
            elsewhere += 1
            continue
        exts = [e for c in chunks for e in ([c.extent] if c.extent else [p[2] for p in c.parts.values()])]
        nbytes, stored = sum(e.nbytes for e in exts), sum(e.stored for e in exts)
        per_rank: dict = {}
        for c in chunks:
            e = c.extent if c.extent else next(iter(c.parts.values()))[2]
            r = data_file_rank(e.file)
            per_rank[r] = per_rank.get(r, 0) + 1
        rows.append({"key": fqn, "dtype": t.dtype, "shape": list(t.size), "chunks": len(t.chunks),
                     "chunks_per_rank": {str(k): v for k, v in sorted(per_rank.items(), key=str)},
                     "bytes": nbytes, "stored_bytes": stored})
    for fqn, v in sorted(m.values.items()):
        row = {"key": fqn, "dtype": f"value/{v.encoding}", "shape": [], "chunks": 1, "bytes": len(v.data)}
        if v.node is not None:
            row.update(dtype=f"value/{v.node.provider}", chunks=len(v.node.parts),
                       bytes=sum(e.nbytes for _, _, e in v.node.parts.values()))
        elif v.encoding == "msgpack" and len(v.data) <= 256:
            try:
                val = decode_value(v.data)
            except ValueError:
                val = None
            if isinstance(val, (int, float, str, bool)) or val is None:
                row["value"] = val  # scalars are shown: step counters, learning rates, names
        rows.append(row)
    owned, shared = m.usage()
    own_files = {n: sz for n, sz in m.files.items() if n not in m.homes}
    info = {"path": args.path, "format_version": m.version, "save_id": m.save_id,
            "world_size": m.world_size, "files": own_files, "total_bytes": sum(own_files.values()),
            "owned_bytes": owned, "shared_bytes": sum(shared.values()), "shared_from": shared,
            "committed_tiers": tiers, "replicas": replicas, "entries": rows}
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"checkpoint {args.path}: format v{m.version}, save {m.save_id}, world size {m.world_size}, "
          f"{len(own_files)} data files, {_fmt_bytes(sum(own_files.values()))}")
    print(f"owns {_fmt_bytes(owned)} of tensor data, shares {_fmt_bytes(sum(shared.values()))}"
          + (" from " + ", ".join(f"{h} ({_fmt_bytes(n)})" for h, n in sorted(shared.items())) if shared else ""))
    logical = sum(r["bytes"] for r in rows if "stored_bytes" in r)
    stored = sum(r["stored_bytes"] for r in rows if "stored_bytes" in r)
    if stored != logical:  # compressed blocks
        print(f"tensors: {_fmt_bytes(logical)} logical, {_fmt_bytes(stored)} stored "
              f"({logical / max(stored, 1):.2f}x compressed)")
    print("committed on: " + ", ".join(tiers))
    if elsewhere:
        print(f"{elsewhere} tensor(s) have chunk records in metadata parts this node does not hold "
              "(another node's ranks): their chunks per rank are not shown")
    for r in replicas:
        print(f"replicas: rank {r['rank']}'s files on rank(s) {r['confirmed_by']} "
              f"({'complete' if r['complete'] else 'DEGRADED'}, {r['replicas']} wanted); "
              f"this directory holds copies of rank(s) {r['holds_files_of']}")
    kw = max([len(r["key"]) for r in rows] + [3])
    print(f"{'key':<{kw}}  {'dtype':<14} {'shape':<20} {'chunks (per rank)':<22} {'bytes':>12} {'stored':>12}")
    for r in rows:
        cpr = r.get("chunks_per_rank") or {}
        chunks = f"{r['chunks']} (" + " ".join(f"r{k}:{v}" for k, v in cpr.items()) + ")" if cpr else str(r["chunks"])
        shown = f"  = {r['value']!r}" if "value" in r else ""
        print(f"{r['key']:<{kw}}  {r['dtype']:<14} {str(r['shape']):<20} {chunks:<22} "
              f"{_fmt_bytes(r['bytes']):>12} {_fmt_bytes(r.get('stored_bytes', r['bytes'])):>12}{shown}")
    return 0


# ------------------------------------------------------------------ verify

def cmd_verify(args) -> int:
    progress = None if args.json else _progress
    tier = StorageTier(args.path, _opts(args))
    single = tier.exists(MANIFEST_NAME) or not any(n.startswith("step-") for n in tier.listdir())
    if single:
        _classify(tier)  # missing, not a checkpoint, another format: its own exit code
        if args.node_local:
            results = {args.path: verify_node_copy(args.path, _opts(args), progress=progress)}
        else:
            results = {args.path: Verified(verify_checkpoint(args.path, _opts(args), progress=progress))}
    else:  # a run directory: every committed step
        results = {tier.child(k).url: v for k, v in
                   verify_run(args.path, _opts(args), progress, node_copy=args.node_local).items()}
        if not results:
            raise NotACheckpointError("the run directory holds no committed step", checkpoint=args.path)
        foreign = [v.foreign for v in results.values() if v.foreign]
        if len(foreign) == len(results):  # a run of another format's steps: its exit code, in one line
            raise ForeignFormatError(f"every step of this run ({len(results)}) is in DCP's own format "
                                     "(FileSystemWriter), which verify does not check: FileSystemReader loads "
                                     "them, `dcp-datastates convert` converts one", checkpoint=args.path)
    bad = {k: v for k, v in results.items() if v.problems}

    def row(path: str, v: Verified) -> dict:
        out = {"path": path, "ok": not v.problems, "problems": v.problems, "foreign": bool(v.foreign)}
        if args.node_local:
            out.update(files_elsewhere=v.elsewhere, ranks_elsewhere=v.ranks_elsewhere)
        return out
    if args.json:
        if single:
            print(json.dumps(row(args.path, results[args.path])))
        else:
            print(json.dumps({"path": args.path, "ok": not bad,
                              "checkpoints": [row(k, v) for k, v in results.items()]}))
        return EXIT_DAMAGED if bad else 0
    for path, v in results.items():
        elsewhere = (f"; {len(v.elsewhere)} file(s) of rank(s) {_ranks(v.ranks_elsewhere)} are on other nodes"
                     if v.elsewhere else "")
        if v.foreign:
            print(f"SKIPPED: {path}: DCP's own format, not checked")
        elif v.problems:
            print(f"DAMAGED: {path}{elsewhere}")
            for p in v.problems:
                print(f"  {p}")
        elif args.node_local:
            print(f"OK: {path}: every block this node holds matches its checksum{elsewhere}")
        else:
            print(f"OK: {path}: every block matches its checksum")
    if bad:
        print("restore the damaged checkpoint(s) from another tier or load an earlier step")
        if not args.node_local and any(all(p.startswith("file ") and p.endswith(": missing") or "metadata part"
                                           in p for p in v.problems) for v in bad.values()):
            print("a node's own copy of a step (node_local=True) holds only its ranks' files: "
                  "check it with --node-local")
    return EXIT_DAMAGED if bad else 0


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


# -------------------------------------------------------------------- demo

def cmd_demo(args) -> int:
    return run_demo(args.out, width=args.width, depth=args.depth, steps=args.steps, kill_at=args.kill_at,
                    keep=args.keep)


# ----------------------------------------------------------------- convert

def _classify(tier: StorageTier) -> None:
    """Raise the reader's error when ``tier`` holds no checkpoint of ours at all; a damaged one
    (an invalid manifest) is left for ``verify`` to report."""
    try:
        load_manifest(tier)
    except (NotACheckpointError, ForeignFormatError, UnsupportedFormatVersion):
        raise
    except CheckpointError:
        pass


def cmd_convert(args) -> int:
    logging.getLogger("dcp_datastates.convert").setLevel(logging.ERROR)  # reported below instead
    if args.to != "datastates":
        _classify(StorageTier(args.src))
    opts = convert.ConvertOptions(batch_bytes=args.batch_bytes, progress=None if args.json else _progress)
    if args.to == "dcp":
        convert.to_dcp(args.src, args.dst, options=opts)
    elif args.to == "datastates":
        convert.from_dcp(args.src, args.dst, allow_pickle=args.allow_pickle, options=opts)
    else:
        res = convert.to_safetensors(args.src, args.dst, max_shard_bytes=args.max_shard_bytes,
                                     keys=args.keys, strip_prefix=args.strip_prefix, options=opts)
        if not args.json:
            where = args.dst if args.dst.endswith(".safetensors") else f"in {args.dst}"
            print(f"wrote {len(res.files)} safetensors file(s) {where}")
            if res.left_out:
                print(f"left out {len(res.left_out)} non-tensor value(s), written to {res.values_file}: "
                      + ", ".join(res.left_out[:10]) + (" ..." if len(res.left_out) > 10 else ""))
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


def _unwrap(e: BaseException) -> BaseException:
    for f in (getattr(e, "failures", None) or {}).values():
        return f[0] if isinstance(f, tuple) else getattr(f, "exc", f)
    return e


def _exit_code(e: CheckpointError, path: str | None) -> int:
    if isinstance(e, PickleNotAllowedError):
        return EXIT_USAGE
    if isinstance(e, ForeignFormatError):
        return EXIT_FOREIGN
    if isinstance(e, NotACheckpointError):
        missing = path is not None and "://" not in path and not os.path.exists(path)
        return EXIT_NOT_FOUND if missing else EXIT_NOT_A_CHECKPOINT
    return EXIT_ERROR


def cmd_clean(args) -> int:
    """Remove what interrupted saves left in a run directory; a dry run unless ``--yes``."""
    tier = StorageTier(args.path, _opts(args))
    found = clean_run(tier, dry_run=not args.yes)
    if not found:
        print(f"run {args.path}: nothing to clean")
        return 0
    total = _fmt_bytes(sum(x.reclaimable_bytes for x in found))
    for x in found:
        print(f"{'removed' if args.yes else 'would remove'} {x.dir}: {_fmt_bytes(x.reclaimable_bytes)} "
              f"in {x.files} file(s)")
    print(f"run {args.path}: {total} {'freed' if args.yes else 'to free; run again with --yes to remove it'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; known errors print one line and return their exit code."""
    # the CLI runs in one process: DCP's notes about a missing process group are noise here
    warnings.filterwarnings("ignore", message=r"torch.distributed is (disabled|unavailable)")
    args = _parser().parse_args(argv)
    path = getattr(args, "path", None) or getattr(args, "src", None)
    try:
        return args.fn(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return _exit_code(e, path)
    except CheckpointException as e:  # DCP wraps each rank's error: report ours, in one line
        inner = _unwrap(e)
        print(f"error: {first_line(inner)}", file=sys.stderr)
        return _exit_code(inner, path) if isinstance(inner, CheckpointError) else EXIT_ERROR
    except FileNotFoundError as e:
        print(f"error: {e.filename or path}: no such file or directory", file=sys.stderr)
        return EXIT_NOT_FOUND
    except BrokenPipeError:  # `inspect --json | head`: the reader went away; nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dcp-datastates", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"dcp-datastates {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="the main job: 2-rank FSDP2 training; save vs DCP; kill and resume")
    p.add_argument("--out", help="directory for the checkpoints, kept (default: a temp dir whose checkpoints "
                                 "are removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints of the default temp dir")
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
    p.add_argument("--keys", nargs="+", metavar="GLOB",
                   help="safetensors: export only these flattened names (globs, e.g. 'model.*')")
    p.add_argument("--strip-prefix", help="safetensors: remove this prefix from names (e.g. 'model.')")
    p.add_argument("--max-shard-bytes", type=parse_size,
                   help="safetensors: shard into files of at most this size (200000, 512MiB, 5GB)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="datastates: read DCP's pickled .metadata and torch.save values (trusted "
                        "checkpoints only), and keep values msgpack cannot express, as pickle")
    p.add_argument("--batch-bytes", type=parse_size, default=256 << 20,
                   help="the most tensor bytes held in memory at once (default 256MiB; a larger "
                        "tensor is read alone)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("bench", help="benchmark against DCP in one run; table and PNG charts")
    p.add_argument("--out", default="bench-out", help="directory for checkpoints and charts")
    p.add_argument("--gb", type=float, default=0.5, help="state size in GB")
    p.add_argument("--no-charts", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("clean", help="remove what interrupted saves left in a run directory (dry run "
                                     "unless --yes); committed steps and saves in flight are never touched")
    p.add_argument("path", help="run directory (holding step-N directories) or fsspec URL")
    p.add_argument("--yes", action="store_true", help="remove them (default: only list them)")
    p.add_argument("--storage-options", help="fsspec options as JSON, for URLs")
    p.set_defaults(fn=cmd_clean)
    for name, fn, help_ in (("inspect", cmd_inspect, "list keys, dtypes, shapes, chunks and bytes"),
                            ("verify", cmd_verify, "check every checksum; exit 1 on damage")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("path", help="checkpoint directory or fsspec URL")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--storage-options", help="fsspec options as JSON, for URLs")
        p.add_argument("--node-local", action="store_true",
                       help="a node's own copy of a step (node_local=True): its ranks' files and the "
                            "replicas it keeps; other nodes' files are not missing")
        p.set_defaults(fn=fn)
    return ap


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


