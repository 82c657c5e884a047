"""Reading the committed manifest of a checkpoint directory on one tier.

A collective save commits one ``.metadata``.  A ``use_collectives=False`` save commits one
manifest per rank, named with the save id all its ranks share
(``.manifest.rank-NNNNN.<save_id>``).  Rank manifests of different saves can sit side by side
(an overwrite in progress, or one that a crash cut short): only the manifests of one save are
ever merged, and the newest save whose every rank committed is the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from collections.abc import Sequence

import msgpack

from ..errors import CheckpointError, DataFileError, ManifestError, NotACheckpointError
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifest import MAGIC, decode_manifest
from ..format.model import Manifest
from ..format.names import (
    MANIFEST_NAME,
    PURGED_MARK,
    STEP_DIR,
    is_ours,
    parse_rank_manifest,
    step_of,
)
from .storage import StorageTier

log = logging.getLogger(__name__)


def _head(tier: StorageTier, nbytes: int) -> bytes | None:
    """The first ``nbytes`` (or fewer) of ``tier``'s ``.metadata``; None when there is none."""
    buf = bytearray(nbytes)
    try:
        n = tier.read_into(MANIFEST_NAME, 0, buf)
    except FileNotFoundError:
        return None
    return bytes(buf[:n])


def manifest_is_ours(tier: StorageTier) -> bool | None:
    """Whether ``tier``'s ``.metadata`` is a dcp-datastates manifest (it starts with the
    format's magic): False for another format's (DCP's pickle), None when there is none.
    Reads 16 bytes; raises ``OSError`` or ``CheckpointError`` when the file cannot be read."""
    head = _head(tier, len(MAGIC))
    return None if head is None else head == MAGIC


@dataclasses.dataclass(frozen=True)
class ManifestHead:
    """Which save a directory's ``.metadata`` is, from its first bytes (a hint for choosing
    among copies; the load itself decodes and checks the whole manifest)."""
    save_id: str
    created_unix: float


HEAD_BYTES = 4096


def manifest_head(tier: StorageTier) -> ManifestHead | None:
    """The save id and creation time at the start of ``tier``'s ``.metadata`` (the encoder
    writes them before anything large); None when there is none, it is not ours, or its first
    ``HEAD_BYTES`` do not hold them."""
    try:
        head = _head(tier, HEAD_BYTES)
    except (OSError, CheckpointError):
        return None
    return None if head is None else head_of(head)


def head_of(data: bytes) -> ManifestHead | None:
    """The save id and creation time at the start of manifest bytes ``data`` (its first
    ``HEAD_BYTES`` are read); None where they are not a dcp-datastates manifest's."""
    head = bytes(data[:HEAD_BYTES])
    if not head.startswith(MAGIC):
        return None
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=HEAD_BYTES, max_str_len=256, max_bin_len=0,
                                max_array_len=0, max_map_len=64)
    unpacker.feed(head[len(MAGIC):])
    found: dict = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key not in ("format", "version", "save_id", "created_unix"):
                break  # the encoder writes these four first
            found[key] = unpacker.unpack()
    except (msgpack.OutOfData, ValueError, TypeError, msgpack.UnpackException):
        return None
    sid, created = found.get("save_id"), found.get("created_unix")
    if not isinstance(sid, str) or isinstance(created, bool) or not isinstance(created, (int, float)):
        return None
    return ManifestHead(sid, float(created))


def read_manifest(tier: StorageTier, name: str, parts_also: Sequence[StorageTier] = ()) -> Manifest:
    """Decode manifest file ``name`` of ``tier``: size-checked before it is read, never
    through a link, and validated (``ManifestError`` names the file).  A format 4 index reads
    its ranks' parts from ``tier``, then from the copies in ``parts_also``."""
    where = f"{tier.url}/{name}"
    try:
        data = tier.read_bytes(name, max_bytes=MAX_MANIFEST_BYTES)
    except DataFileError as e:
        raise ManifestError(f"manifest unreadable: {e}", checkpoint=where) from None
    return decode_manifest(data, source=where, parts=[part_loader(t) for t in (tier, *parts_also)])


def part_loader(tier: StorageTier):
    """Read bytes [start, end) of a format 4 metadata part of ``tier`` (a ranged read: the
    head to plan, the tail with the data); short at the end of the file."""
    def load(name: str, start: int, end: int) -> bytes:
        buf = bytearray(end - start)
        try:
            n = tier.read_into(name, start, buf)
        except DataFileError as e:
            raise ManifestError(str(e), checkpoint=tier.url, file=name) from None
        return bytes(buf[:n])
    return load


@dataclasses.dataclass(frozen=True)
class RankSave:
    """The rank manifests of one ``use_collectives=False`` save found in a directory."""
    save_id: str | None  # None: unversioned names written before rank manifests carried it
    world_size: int
    names: dict[int, str]  # rank -> manifest file name
    created_unix: float

    @property
    def complete(self) -> bool:
        return set(self.names) == set(range(self.world_size))

    @property
    def missing(self) -> list[int]:
        return sorted(set(range(self.world_size)) - set(self.names))


def rank_saves(tier: StorageTier, names: list[str] | None = None) -> list[tuple[RankSave, dict[int, Manifest]]]:
    """Every save with rank manifests in ``tier``, oldest first, with its decoded manifests.
    A manifest that does not decode is reported (``ManifestError``)."""
    names = tier.listdir() if names is None else names
    groups: dict[str | None, dict[int, Manifest]] = {}
    files: dict[str | None, dict[int, str]] = {}
    for n in names:
        parsed = parse_rank_manifest(n)
        if parsed is None:
            continue
        rank, sid = parsed
        m = read_manifest(tier, n)
        if sid is not None and m.save_id != sid:
            raise ManifestError(f"rank manifest names save {sid} but holds save {m.save_id}",
                                checkpoint=f"{tier.url}/{n}")
        if m.ranks != [rank]:
            raise ManifestError(f"rank manifest of rank {rank} lists ranks {m.ranks[:8]}",
                                checkpoint=f"{tier.url}/{n}")
        groups.setdefault(sid, {})[rank] = m
        files.setdefault(sid, {})[rank] = n
    out = []
    for sid, ms in groups.items():
        worlds = {m.world_size for m in ms.values()}
        if len(worlds) != 1:
            raise ManifestError(f"rank manifests of save {sid} disagree on the world size {sorted(worlds)}",
                                checkpoint=tier.url)
        out.append((RankSave(sid, worlds.pop(), files[sid], max(m.created_unix for m in ms.values())), ms))
    out.sort(key=lambda g: (g[0].created_unix, g[0].save_id or ""))
    return out


def _merge(tier: StorageTier, save: RankSave, ms: dict[int, Manifest]) -> Manifest:
    ranks = sorted(ms)
    merged = ms[ranks[0]]
    merged = dataclasses.replace(merged, files=dict(merged.files), homes=dict(merged.homes),
                                 tensors=dict(merged.tensors), values=dict(merged.values),
                                 planner_data=dict(merged.planner_data), ranks=list(merged.ranks))
    for r in ranks[1:]:
        merged.merge(ms[r], source=tier.url)
    return merged


def load_manifest(tier: StorageTier, parts_also: Sequence[StorageTier] = ()) -> Manifest:
    """The committed manifest of the checkpoint at ``tier`` (merged across rank manifests);
    ``parts_also``: other copies of the checkpoint a format 4 index may read its parts from."""
    where = tier.url
    names = tier.listdir()
    collective = MANIFEST_NAME in names or (not tier.local and tier.exists(MANIFEST_NAME))
    per_rank = any(parse_rank_manifest(n) is not None for n in names)
    if collective and not per_rank:  # the usual case: nothing to choose between
        return read_manifest(tier, MANIFEST_NAME, parts_also)
    if not collective and not per_rank:
        raise NotACheckpointError(_why_not_a_checkpoint(tier, names), checkpoint=where)
    if collective:  # both kinds: the newest committed save wins, whichever kind wrote it
        m = read_manifest(tier, MANIFEST_NAME, parts_also)
        try:
            saves = rank_saves(tier, names)
        except CheckpointError as e:  # a damaged rank manifest never hides a committed .metadata
            log.warning("%s: rank manifests beside .metadata cannot be read (%s); loading .metadata", where, e)
            return m
        done = [g for g in saves if g[0].complete and g[0].created_unix > m.created_unix]
        if not done:
            return m
        log.info("%s: per-rank save %s is newer than the collective save %s in .metadata; loading it",
                 where, done[-1][0].save_id, m.save_id)
        saves = done
    else:
        saves = rank_saves(tier, names)
    complete = [g for g in saves if g[0].complete]
    newer = [g for g in saves if not g[0].complete and (not complete or g[0].created_unix > complete[-1][0].created_unix)]
    if not complete:
        save, _ = saves[-1]
        raise NotACheckpointError(
            f"rank manifests of ranks {save.missing[:8]} are missing for save {save.save_id}: the "
            "save did not commit on every rank (those ranks are stale); load an earlier step",
            checkpoint=where)
    save, ms = complete[-1]
    if newer:
        log.warning("%s: a newer save (%s) committed only on ranks %s (missing %s); loading the "
                    "complete save %s", where, newer[-1][0].save_id, sorted(newer[-1][0].names)[:8],
                    newer[-1][0].missing[:8], save.save_id)
    return _merge(tier, save, ms)


def _why_not_a_checkpoint(tier: StorageTier, names: list[str]) -> str:
    """The most useful explanation of a directory without a committed manifest."""
    if not names and not tier.is_real_dir():
        return "the directory does not exist (check the path)"
    steps = []
    for n, kind in tier.entries():
        if kind == "dir" and STEP_DIR.match(n) and MANIFEST_NAME in tier.child(n).listdir():
            steps.append(n)
    if steps:
        steps.sort(key=lambda n: step_of(n) or 0)
        shown = ", ".join(steps[-5:])
        return (f"this is a run directory, not a checkpoint: it holds {len(steps)} committed "
                f"step(s) ({shown}); load one of them, e.g. {tier.child(steps[-1]).url}, or use "
                "Checkpointer.load, which picks the newest")
    if not names:
        return "the directory is empty: nothing was ever saved here"
    if PURGED_MARK in names:
        return ("this step was purged by retention; what is left are files that later steps of "
                "the run still use (an incremental husk), not a checkpoint of its own")
    if not any(is_ours(n) for n in names):
        return (f"no checkpoint here: none of its {len(names)} entries was written by dcp-datastates "
                "(a mistyped path?)")
    return ("no committed manifest: this directory holds a save that never committed (it was "
            "interrupted or is still running); load an earlier step")


def committed_here(tier: StorageTier, *, rank: int | None) -> bool:
    """Whether ``tier`` holds a committed checkpoint a save would replace: a ``.metadata``, or
    (``rank`` given: per-rank manifests) a manifest of that rank."""
    names = tier.listdir()
    if MANIFEST_NAME in names or (not tier.local and tier.exists(MANIFEST_NAME)):
        return True
    return rank is not None and any(
        (p := parse_rank_manifest(n)) is not None and p[0] == rank for n in names)


def checkpoint_name(url: str) -> str | None:
    """The checkpoint a load names, where its directory's name says it: the step directory's
    name (``step-3``), the same on every rank whether the directory is shared or each node has
    its own.  None for any other name (a node's copy may be called anything): no opinion."""
    name = posixpath.basename(url.rstrip("/"))
    return name if STEP_DIR.match(name) else None


def one_checkpoint(named: Sequence[tuple[int, str | None, str | None]], label: str) -> None:
    """Raise, the same on every rank, unless the ranks of a load agree on one checkpoint:
    ``named`` holds each rank's (rank, step directory name or None, save id or None); None is
    no opinion.  Ranks that name different steps, or different saves, would otherwise read,
    or repair, two states."""
    for what, at in (("checkpoints", 1), ("saves", 2)):
        seen: dict[str, list[int]] = {}
        for n in named:
            if n[at] is not None:
                seen.setdefault(str(n[at]), []).append(n[0])
        if len(seen) > 1:
            parts = "; ".join(f"{v!r} on rank(s) {', '.join(map(str, r[:4]))}{'...' if len(r) > 4 else ''}"
                              for v, r in seen.items())
            raise CheckpointError(f"the ranks of this load name different {what} ({parts}); every rank "
                                  "must load the same one", checkpoint=label)
