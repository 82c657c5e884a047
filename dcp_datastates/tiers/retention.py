"""Retention with shared extents: purge steps by mark and sweep.

An incremental checkpoint references files of earlier steps of its run (``Manifest.homes``),
so a step directory cannot simply be deleted: a retained step may still read from it.
Purging ``drop`` steps of a run directory on one tier goes:

1. **Uncommit.** Each dropped step gets a ``.purged`` mark, then loses its manifest(s).
   From here on nobody loads it or takes it as an incremental base; a crash at any later
   point leaves every retained step intact.
2. **Mark.** Every file referenced by a committed manifest of the run (plus ``also``:
   manifests of steps still being flushed to this tier) is live, wherever it lives.
3. **Sweep.** In each dropped directory, and in every directory still carrying a
   ``.purged`` mark from an interrupted purge, every file that is not live is removed;
   a directory left with nothing live disappears.  A directory that still holds live
   files stays as a *husk* until the steps referencing it are purged too.

Retained steps are never written to, so the purge is safe to re-run after a crash: it
resumes at the sweep.  Directories with neither a manifest nor a mark are in-flight or
crashed saves; the caller decides about them (they are swept the same way when dropped).
"""

from __future__ import annotations

import logging
import re

from .. import _faults
from ..errors import CheckpointError
from ..format.manifest import Manifest, is_manifest_name
from .storage import StorageTier

log = logging.getLogger(__name__)

PURGED_MARK = ".purged"
STEP_DIR = re.compile(r"^step-(\d+)$")


def _manifests(t: StorageTier) -> list[str]:
    return [n for n in t.listdir() if is_manifest_name(n)]


def live_files(run: StorageTier, also: list[tuple[str, Manifest]] = ()) -> dict[str, set[str]]:
    """``{directory: files}`` referenced by the committed manifests under ``run``, and by
    ``also``: ``(directory, manifest)`` of steps not committed here yet (flushes in flight)."""
    from ..reader import load_manifest
    live: dict[str, set[str]] = {}

    def add(own_dir: str, m: Manifest) -> None:
        for f in m.files:
            live.setdefault(m.homes.get(f, own_dir), set()).add(f)
    for name in run.listdir():
        t = run.child(name)
        if not STEP_DIR.match(name) or not _manifests(t):
            continue
        try:
            add(name, load_manifest(t))
        except CheckpointError as e:
            # an unreadable manifest cannot tell what it needs: keep everything it might
            log.warning("retention: cannot read the manifest of %s (%s); keeping its files", t.url, e)
            live.setdefault(name, set()).add("*")
    for name, m in also:
        add(name, m)
    return live


def purge_steps(run: StorageTier, drop: list[str], *,
                also: list[tuple[str, Manifest]] = ()) -> list[str]:
    """Purge step directories ``drop`` of ``run`` without breaking any retained step.
    Returns the directories removed completely (husks that stay are not listed)."""
    for name in drop:
        t = run.child(name)
        have = t.listdir()
        if not have:
            continue
        if PURGED_MARK not in have:
            t.commit_bytes(PURGED_MARK, b"")
        for n in _manifests(t):
            t.remove(n)
        _faults.point("purge")
    live = live_files(run, also)
    gone = []
    for name in sorted(set(drop) | {n for n in run.listdir() if STEP_DIR.match(n)
                                    and run.child(n).exists(PURGED_MARK)}):
        t = run.child(name)
        keep = live.get(name, set())
        if "*" in keep:
            continue
        files = t.listdir()
        if _manifests(t):  # committed again since (a re-save of this step): not ours to sweep
            continue
        for n in files:
            if n in keep or n == PURGED_MARK:
                continue
            t.remove(n)
            _faults.point("purge")
        if not keep:
            t.remove(PURGED_MARK)
            _rmdir(t)
            gone.append(name)
            log.info("retention: removed %s", t.url)
        else:
            log.info("retention: %s stays as a husk of %d files that later steps reference",
                     t.url, len(keep))
    return gone


def _rmdir(t: StorageTier) -> None:
    import os
    import shutil
    try:
        if t.local:
            if os.path.isdir(t.root):
                shutil.rmtree(t.root)  # only leftovers such as empty sub-dirs remain
        else:
            try:
                t.fs.rm(t.root, recursive=True)
            except FileNotFoundError:
                pass
    except OSError as e:  # pragma: no cover - a later purge retries
        log.debug("could not remove %s: %s", t.url, e)


def referenced_from_siblings(tier: StorageTier) -> set[str]:
    """Files of checkpoint directory ``tier`` that other committed checkpoints of its run use."""
    try:
        live = live_files(tier.parent())
    except Exception:  # noqa: BLE001 - no parent listing (object store root): nothing known
        return set()
    return live.get(tier.name, set())
