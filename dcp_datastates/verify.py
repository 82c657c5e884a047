"""Whole-checkpoint checks shared by the CLI and the demo: ``verify`` (every checksum of every
file, every tier) and the per-step usage of a run directory (``inspect RUN``)."""

from __future__ import annotations
import re
from .errors import CheckpointError
from .reader import load_manifest
from .tiers.retention import STEP_DIR
import xxhash
from .format.checksum import verify_blocks
from .tiers import StorageTier

def _rank_of(file: str) -> int | None:
    m = re.match(r"^data-r(\d{5})-", file)
    return int(m.group(1)) if m else None


def inspect_run(tier) -> list[dict]:
    """One row per committed step under a run directory: bytes owned, shared from earlier
    steps, and owned bytes that later steps still reference."""
    rows = []
    for name in tier.listdir():
        if not STEP_DIR.match(name):
            continue
        try:
            m = load_manifest(tier.child(name))
        except CheckpointError:
            continue
        owned, shared = m.usage()
        rows.append({"step": int(name.split("-")[1]), "dir": name, "owned_bytes": owned,
                     "shared_bytes": sum(shared.values()), "shared_from": shared, "used_by_later": 0})
    rows.sort(key=lambda r: r["step"])
    by_dir = {r["dir"]: r for r in rows}
    for r in rows:
        for home, n in r["shared_from"].items():
            if home in by_dir:
                by_dir[home]["used_by_later"] += n
    return rows


def verify_checkpoint(path: str, storage_options=None, progress=None) -> list[str]:
    """Check every block of every extent; return one line per problem (empty when intact)."""

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
    homes = {name: tier.sibling(home) for name, home in m.homes.items()}
    for name, want in m.files.items():
        where = f" (in {m.homes[name]})" if name in m.homes else ""
        try:
            sizes[name] = homes.get(name, tier).size(name)
        except (FileNotFoundError, OSError):
            problems.append(f"file {name}{where}: missing")
            continue
        if sizes[name] < want:
            problems.append(f"file {name}{where}: truncated ({sizes[name]} of {want} bytes)")
    total = sum(e.nbytes for _, e in extents) or 1
    done = 0
    for fqn, e in extents:
        if any(s.file not in sizes or sizes[s.file] < s.offset + s.nbytes for s in e.segs):
            problems.append(f"tensor {fqn}: extent in {', '.join(sorted(e.files()))} is missing or truncated")
            continue
        buf = bytearray(e.nbytes)
        for name, off, pos, n in e.locate(0, e.nbytes):
            homes.get(name, tier).read_into(name, off, memoryview(buf)[pos:pos + n])
        bad = verify_blocks(buf, e.sums, 0, m.block_size)
        if bad is not None:
            (name, off, _p, _n), = e.locate(bad * m.block_size, 1)
            problems.append(f"tensor {fqn}: checksum mismatch in {name} block {bad} (file offset {off})")
        done += e.nbytes
        if progress:
            progress(done, total, "verify")
    return problems
