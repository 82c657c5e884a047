"""Retention with shared extents: purge steps by mark and sweep.

An incremental checkpoint references files of earlier steps of its run (``Manifest.homes``),
so a step directory cannot simply be deleted: a retained step may still read from it.
Purging ``drop`` steps of a run directory on one tier goes:

1. **Uncommit.** Each dropped step gets a ``.purged`` mark; then the claims of the saves in
   flight are read, and a step one of them names as its incremental base loses its mark
   again and stays, while every other loses its manifest(s).  From the mark on nobody takes
   it as an incremental base: a save checks its base for the mark after its claim, which
   names the base, is in place (``incremental.still_committed``), so of a save and a purge
   racing on one base at least one sees the other.  A crash at any later point leaves every
   retained step intact (a step marked but not yet uncommitted stays committed, and is no
   base for an incremental save, until a pass drops it again).
2. **Mark.** Every file referenced by a committed manifest of the run, in a directory of any
   name (plus ``also``: manifests of steps still being flushed to this tier), is live.
3. **Sweep.** In each dropped directory, and in every directory still carrying a
   ``.purged`` mark from an interrupted purge, every file of ours that is not live is removed;
   a directory left empty disappears.  A directory that still holds live files stays as a
   *husk* until the steps referencing it are purged too; it keeps the step's replica records,
   which vouch for those files' digests when a lost node is given them again
   (``replica_repair.py``).

What retention never does: follow a symbolic link (a step that is a link is skipped and
reported, so is a link inside a step), leave the run directory (each step's real path must
be a child of the run's), remove what the format does not write (a subdirectory, a user's
file: reported and kept), touch a step a live save has claimed, or stop the whole pass
because one entry fails (logged, then the next one).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

from ..errors import CheckpointError
from ..format.model import Manifest
from ..format.names import (
    PURGED_MARK,
    REPLICA_LOCK,
    STEP_DIR,
    is_borrowed_dir,
    is_manifest_name,
    is_ours,
    replica_record_of,
)
from .base_lock import removing
from .borrowed import clear_borrowed
from .claim import BasesInFlight, bases_in_flight, claimed
from .manifests import manifest_is_ours
from .storage import StorageTier
from .tidy import run_references

log = logging.getLogger(__name__)

__all__ = ["PURGED_MARK", "STEP_DIR", "live_files", "purge_steps"]


def _manifests(t: StorageTier) -> list[str]:
    return [n for n in t.listdir() if is_manifest_name(n)]


def live_files(run: StorageTier, also: Sequence[tuple[str, Manifest]] = ()) -> dict[str, set[str]]:
    """``{directory: files}`` referenced by the committed manifests under ``run``, and by
    ``also``: ``(directory, manifest)`` of steps not committed here yet (flushes in flight)."""
    return run_references(run, also=also)


def _inside(run: StorageTier, name: str) -> StorageTier | None:
    """``run/name`` if it is a real directory inside ``run`` (never through a link)."""
    t = run.child(name)
    if not t.local:
        return t
    try:
        if not t.is_real_dir():
            return None
        if os.path.dirname(os.path.realpath(t.root)) != os.path.realpath(run.root):
            return None
    except OSError:
        return None
    return t


def purge_steps(run: StorageTier, drop: list[str], *,
                also: Sequence[tuple[str, Manifest]] = ()) -> list[str]:
    """Purge step directories ``drop`` of ``run`` without breaking any retained step.
    Returns the directories removed completely (husks that stay are not listed)."""
    kinds = dict(run.entries())
    husks = [n for n, k in kinds.items() if k == "dir" and STEP_DIR.match(n) and n not in drop
             and run.child(n).exists(PURGED_MARK)]
    with contextlib.ExitStack() as held:
        # each directory under its base lock (``base_lock.py``) before the claims, then the
        # manifests, are read: a save reading one as its base keeps it whole
        free = {name for name in [*drop, *husks] if kinds.get(name) == "dir" and _locked(run, name, held)}
        foreign = _uncommit(run, [n for n in drop if n in free or kinds.get(n) != "dir"], kinds)
        foreign |= set(drop) - free
        live = live_files(run, also)
        gone = []
        for name in sorted(((set(drop) - foreign) & {n for n, k in kinds.items() if k == "dir"})
                           | (set(husks) & free)):
            t = _inside(run, name)
            if t is None:
                continue
            try:
                if _sweep(t, live.get(name, set())):
                    gone.append(name)
            except (OSError, CheckpointError) as e:
                log.warning("retention: sweeping %s failed (%s); the next pass retries", t.url, e)
        return gone


def _locked(run: StorageTier, name: str, held: contextlib.ExitStack) -> bool:
    """Hold ``run/name``'s base lock and replica lock exclusive for this pass; False where a
    save holds the first shared (it reads that step as its incremental base now) or a rank
    the second (it replicates that step now)."""
    t = _inside(run, name)
    if t is None:
        return True  # left alone below, with the reason
    if not held.enter_context(removing(t)):
        log.info("retention: %s is being read as the base of an incremental save; not purging it this pass", t.url)
        return False
    if not held.enter_context(removing(t, REPLICA_LOCK)):
        log.info("retention: %s is being replicated; not purging it this pass", t.url)
        return False
    return True


def _uncommit(run: StorageTier, drop: list[str], kinds: dict[str, str]) -> set[str]:
    """Mark and uncommit each of ``drop`` (step 1); the names left alone."""
    foreign: set[str] = set()  # dropped names left alone: not uncommitted, so not swept
    marked: list[StorageTier] = []
    bases = bases_in_flight(run)  # those already known are not even marked
    for name in drop:
        if kinds.get(name) != "dir":
            if name in kinds:
                log.warning("retention: %s/%s is a %s, not a step directory; left alone",
                            run.url, name, kinds[name])
            continue
        t = _inside(run, name)
        if t is None:
            log.warning("retention: %s/%s leaves the run directory; left alone", run.url, name)
            foreign.add(name)
            continue
        if claimed(t):
            log.warning("retention: %s is being saved right now; not purging it", t.url)
            foreign.add(name)
            continue
        if bases.keeps(name):
            _say_kept(t, bases, "is")
            foreign.add(name)
            continue
        try:
            if manifest_is_ours(t) is False:
                log.warning("retention: %s holds a checkpoint in another format (DCP's own?); "
                            "left alone", t.url)
                foreign.add(name)
                continue
            have = t.listdir()
            if not have:
                continue
            if PURGED_MARK not in have:
                t.commit_bytes(PURGED_MARK, b"")
            marked.append(t)
        except (OSError, CheckpointError) as e:
            log.warning("retention: could not uncommit %s (%s); skipping it", t.url, e)
            foreign.add(name)
    return foreign | _unmanifest(run, marked)


def _say_kept(t: StorageTier, bases: BasesInFlight, verb: str) -> None:
    """Why step ``t`` stays, which ``bases.keeps``: a claim whose record is being written
    (a save starting; the next pass decides) or a save in flight that names it as its base."""
    if bases.unknown:
        log.info("retention: %s is not purged this pass: the claim of a save in flight (%s) is "
                 "being written, and the save may use it as its incremental base", t.url, bases.unknown[0])
    else:
        log.warning("retention: %s %s the base of an incremental save in flight; not purging it", t.url, verb)


def _unmanifest(run: StorageTier, marked: list[StorageTier]) -> set[str]:
    """The manifests of the ``marked`` steps removed, but of those a save in flight claimed
    as its base meanwhile (read after every mark is in place): their marks go again and they
    stay.  The names left alone."""
    if not marked:
        return set()
    try:
        bases = bases_in_flight(run)
    except OSError as e:
        log.warning("retention: the run's claims cannot be read again (%s); uncommitting nothing", e)
        bases = None
    kept: set[str] = set()
    for t in marked:
        keep = bases is None or bases.keeps(t.name)
        if keep and bases is not None:
            _say_kept(t, bases, "became")
        try:
            for n in [PURGED_MARK] if keep else _manifests(t):
                t.remove(n)
            if not keep:  # uncommitted for good before any file goes (POSIX orders no two removals)
                t.sync_dir()
        except (OSError, CheckpointError) as e:
            log.warning("retention: could not uncommit %s (%s); skipping it", t.url, e)
            keep = True
        if keep:
            kept.add(t.name)
    return kept


def _sweep(t: StorageTier, keep: set[str]) -> bool:
    """Remove ``t``'s files that are ours and not live; True if the directory went."""
    if "*" in keep or _manifests(t) or claimed(t):
        return False  # unreadable user of it, committed again since, or being saved now
    foreign = []
    for n, kind in t.entries():
        if kind == "dir" and is_borrowed_dir(n):  # what a load was sent for its reads alone
            if not clear_borrowed(t.child(n)):
                foreign.append(f"{n} ({kind})")
            continue
        if kind != "file" or not is_ours(n):
            foreign.append(f"{n} ({kind})" if kind != "file" else n)
            continue
        if n in keep or n == PURGED_MARK or (keep and replica_record_of(n) is not None):
            continue  # a husk keeps the replica records that vouch for its files' digests
        try:
            t.remove(n)
        except OSError as e:
            log.warning("retention: could not remove %s/%s (%s)", t.url, n, e)
    if foreign:
        log.warning("retention: %s holds entries dcp-datastates did not write (%s); they are "
                    "kept, and so is the directory", t.url, ", ".join(sorted(foreign)[:8]))
    if keep:
        log.info("retention: %s stays as a husk of %d files that later steps reference",
                 t.url, len(keep))
        return False
    if foreign:
        return False
    t.remove(PURGED_MARK)
    _rmdir(t)
    log.info("retention: removed %s", t.url)
    return True


def _rmdir(t: StorageTier) -> None:
    """Remove the now-empty directory ``t`` (never recursively)."""
    try:
        t.remove_dir()
    except OSError as e:
        log.warning("retention: could not remove the directory %s (%s); a later pass retries", t.url, e)
