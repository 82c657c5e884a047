"""Whole-checkpoint checks shared by the CLI and the demo: ``verify`` (every checksum of every
file, every tier) and the per-step usage of a run directory (``inspect RUN``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

from .errors import CheckpointError, ForeignFormatError, ManifestError
from .format.checksum import verify_blocks
from .format.codec import decode_block
from .format.limits import FormatViolation
from .format.names import STEP_DIR, is_manifest_name, is_ours, rank_file_of, step_of
from .replicas.records import records_in
from .tiers import StorageTier
from .tiers.claim import claimed
from .tiers.manifests import load_manifest
from .tiers.retention import live_files, purge_steps


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


@dataclass(frozen=True)
class Leftover:
    """A step directory under a run that holds no committed manifest: what an interrupted save
    (Ctrl-C, a full disk, a killed job) or a purge's husk left.  ``reclaimable_bytes``: the
    size of its files no committed checkpoint of the run references; ``claimed``: a save is
    writing it right now (never cleaned)."""

    dir: str
    reclaimable_bytes: int
    files: int
    claimed: bool


def leftovers(run) -> list[Leftover]:
    """The uncommitted step directories of ``run`` (a ``StorageTier``), by step."""
    live = live_files(run)
    out = []
    for name, kind in run.entries():
        if kind != "dir" or not STEP_DIR.match(name):
            continue
        t = run.child(name)
        entries = t.entries()
        if any(is_manifest_name(n) for n, _ in entries):
            continue
        keep = live.get(name, set())
        mine = [n for n, k in entries if k == "file" and is_ours(n) and n not in keep]
        sizes = 0
        for n in mine:
            try:
                sizes += t.size(n)
            except OSError:  # removed meanwhile
                continue
        out.append(Leftover(name, sizes, len(mine), claimed(t)))
    return sorted(out, key=lambda x: step_of(x.dir) or 0)


def clean_run(run, *, dry_run: bool = True) -> list[Leftover]:
    """Remove what the uncommitted step directories of ``run`` hold that no committed checkpoint
    references (retention's own sweep, ``purge_steps``: under the same locks, never a step a
    save is writing, never a file a committed step reads).  ``dry_run``: remove nothing.
    Returns what was (or would be) cleaned."""
    found = [x for x in leftovers(run) if not x.claimed]
    if not dry_run and found:
        purge_steps(run, [x.dir for x in found])
    return found


VERIFY_PIECE = 16 << 20  # bytes read and checked at a time: memory stays bounded


@dataclass(frozen=True)
class Verified:
    """What ``verify`` found in one checkpoint directory: ``problems`` (one line each; empty
    when intact) and, for a node's copy, the files it does not hold (``elsewhere``: another
    node's ranks) and the ranks they belong to."""

    problems: list[str]
    elsewhere: list[str] = field(default_factory=list)
    foreign: str | None = None  # another format's checkpoint (DCP's own): why it is not checked

    @property
    def ranks_elsewhere(self) -> list[int]:
        return sorted({got[0] for got in map(rank_file_of, self.elsewhere) if got is not None})


def verify_checkpoint(path: str, storage_options=None, progress=None) -> list[str]:
    """Check every block of every extent of the checkpoint at ``path``; one line per problem
    (empty when intact).  A missing or unreadable manifest is a problem too (the CLI tells a
    path that holds no checkpoint at all apart before it calls this)."""
    return _verify(StorageTier(path, storage_options), progress, node_copy=False).problems


def verify_node_copy(path: str, storage_options=None, progress=None) -> Verified:
    """``verify_checkpoint`` of one node's copy of a step (``Checkpointer(node_local=True)``):
    every block of the files it holds (its ranks' and the replicas it keeps) is checked, and
    a file of the manifest it does not hold is not a problem but ``elsewhere``, as is a
    chunk whose record is in a metadata part it does not hold.  A node holds every file of a
    rank or none: a missing file of a rank it holds others of, or of a rank its replica
    records say it holds, is a problem."""
    return _verify(StorageTier(path, storage_options), progress, node_copy=True)


def _verify(tier: StorageTier, progress, *, node_copy: bool) -> Verified:
    try:
        m = load_manifest(tier)
    except ForeignFormatError as e:  # not damaged: not ours to check
        return Verified([], foreign=str(e))
    except CheckpointError as e:
        return Verified([str(e)])
    problems: list[str] = []
    absent: set[str] = set()  # a node's copy: the files it does not hold

    def note(e: ManifestError) -> None:
        if not (node_copy and e.file in absent) and str(e) not in problems:
            problems.append(str(e))  # said once, not once per chunk a bad part holds
    sizes = {}
    homes = {name: tier.sibling(home) for name, home in m.homes.items()}
    for name, want in m.files.items():
        where = f" (in {m.homes[name]})" if name in m.homes else ""
        try:
            sizes[name] = homes.get(name, tier).size(name)
        except OSError:
            if node_copy:
                absent.add(name)
            else:
                problems.append(f"file {name}{where}: missing")
            continue
        if sizes[name] < want:
            problems.append(f"file {name}{where}: truncated ({sizes[name]} of {want} bytes)")
    if absent:  # a node holds all the files of a rank or none: of its own ranks and of those it keeps
        here = {got[0] for got in map(rank_file_of, sizes) if got is not None}
        for rec in records_in(tier, m.save_id):
            here |= {rec.rank, *rec.held}
        for name in sorted(absent):
            got = rank_file_of(name)
            if got is None or got[0] in here:
                problems.append(f"file {name}: missing (rank {got[0] if got else '?'} is on this node)")
                absent.discard(name)
    extents = []
    if m.index is not None:  # format 4: every part's head and digest tail, also those no chunk record needs
        for rank in m.index.part_ranks():
            try:
                m.index.check_part(rank)
            except ManifestError as e:
                note(e)
    for fqn, t in m.tensors.items():
        for i in range(t.count()):  # chunk by chunk: a bad part hides only the chunks it holds
            try:
                c = t.chunk_at(i)
            except ManifestError as e:
                note(e)
                continue
            if c.extent is not None:
                extents.append((fqn, c.extent))
            for pname, (_, _, ext) in c.parts.items():
                extents.append((f"{fqn}/{pname}", ext))
    for fqn, v in m.values.items():
        if v.node is not None:  # a registered type: its parts are extents
            extents += [(f"{fqn}/{pname}", ext) for pname, (_, _, ext) in v.node.parts.items()]
        elif xxhash.xxh3_64_intdigest(v.data) != v.checksum:
            problems.append(f"value {fqn}: checksum mismatch in the manifest")
    total = sum(e.nbytes for _, e in extents) or 1
    done = 0
    for fqn, e in extents:
        if node_copy and any(s.file in absent for s in e.segs):
            continue  # on another node
        if any(s.file not in sizes or sizes[s.file] < s.offset + s.nbytes for s in e.segs):
            problems.append(f"tensor {fqn}: extent in {', '.join(sorted(e.files()))} is missing or truncated")
            continue
        try:
            problem = _check_extent(tier, homes, m.block_size, fqn, e)
        except (CheckpointError, OSError) as err:
            problem = f"tensor {fqn}: {err}"
        if problem:
            problems.append(problem)
        done += e.nbytes
        if progress:
            progress(done, total, "verify")
    return Verified(problems, sorted(absent))


def _check_extent(tier, homes, block_size: int, fqn: str, e) -> str | None:
    if e.packed:  # compressed blocks: the digests cover the stored bytes; each must also decode
        out = memoryview(bytearray(block_size))
        for b, g in enumerate(e.segs):
            stored = bytearray(g.nbytes)
            homes.get(g.file, tier).read_into(g.file, g.offset, stored)
            if xxhash.xxh3_128_digest(stored) != e.sums[b]:
                return f"tensor {fqn}: checksum mismatch in {g.file} compressed block {b} (file offset {g.offset})"
            try:
                decode_block(stored, out[:min(block_size, e.nbytes - b * block_size)])
            except FormatViolation as err:
                return f"tensor {fqn}: {g.file} compressed block {b} (file offset {g.offset}): {err}"
        return None
    step = max(block_size, VERIFY_PIECE // block_size * block_size)
    buf = bytearray(min(step, max(e.nbytes, 1)))
    for start in range(0, e.nbytes, step):
        n = min(step, e.nbytes - start)
        mv = memoryview(buf)[:n]
        for name, off, pos, k in e.locate(start, n):
            homes.get(name, tier).read_into(name, off, mv[pos:pos + k])
        bad = verify_blocks(mv, e.sums, start // block_size, block_size)
        if bad is not None:
            (name, off, _p, _n), = e.locate(bad * block_size, 1)
            return f"tensor {fqn}: checksum mismatch in {name} block {bad} (file offset {off})"
    return None


def verify_run(path: str, storage_options=None, progress=None, *, node_copy: bool = False
               ) -> dict[str, Verified]:
    """Verify every committed step of a run directory (``node_copy``: a node's directory of
    the run, each step as ``verify_node_copy`` checks it): ``{step directory: Verified}``."""
    run = StorageTier(path, storage_options)
    out = {}
    for name, kind in run.entries():
        if kind != "dir" or not STEP_DIR.match(name):
            continue
        step = run.child(name)
        if not any(is_manifest_name(n) for n in step.listdir()):
            continue  # uncommitted, in flight, or a purged step's husk: not a checkpoint
        out[name] = _verify(step, progress, node_copy=node_copy)
    return dict(sorted(out.items(), key=lambda kv: step_of(kv[0]) or 0))
