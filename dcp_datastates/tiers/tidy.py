"""What may be deleted after a commit, decided by ownership, never by a directory listing.

A save that committed into a directory removes exactly:

* the files that the manifest it *superseded* owned (its own data files, not those it
  referenced in an earlier step), read under the claim before this save wrote anything;
* the files of attempts it *took over* (their claim was stale: the save died), found by the
  save id in their names;
* its own temporary files and upload markers;

and of these never a file that a committed manifest anywhere in the run references (an
incremental step in a directory of any name), a manifest still being flushed references
(``inflight``), or a rank manifest of this directory still lists.  If the run cannot be
read, nothing is deleted and a warning says so: leaking a file is recoverable, deleting a
used one is not.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

from .. import process_state
from ..errors import CheckpointError, ForeignFormatError, NotACheckpointError
from ..format.model import Manifest
from ..format.names import (
    CLAIM_NAME,
    MANIFEST_NAME,
    PERSISTED_RECORD,
    TEMP_INFIX,
    data_file_save_id,
    is_manifest_name,
    is_temp_manifest,
    marker_save_id,
    parse_rank_manifest,
)
from .base_lock import removing
from .claim import bases_in_flight, holds_live_claim, live_claims
from .manifests import load_manifest, rank_saves, read_manifest
from .storage import StorageTier

log = logging.getLogger(__name__)

_RELISTS = 3  # reads of a step directory whose manifest keeps vanishing before it counts as unreadable

# Process-wide on purpose: a tidy-up of any save must see the steps any writer of the process is
# still flushing, whose files it must not remove.
_inflight_lock = threading.Lock()
_inflight: dict[tuple[str, str], Manifest] = {}  # (run url, step dir) -> manifest being flushed


_pins: dict[tuple[str, str, str], int] = {}  # (run url, step dir, file) -> holders


def _new_lock_in_child() -> None:
    """A forked child keeps its parent's saves in flight and their pins (it removes none of their
    files, as its parent would not), under a lock no thread of its parent may hold."""
    global _inflight_lock
    _inflight_lock = threading.Lock()


process_state.in_child(_new_lock_in_child)


def pin(run: StorageTier, name: str, file: str, *, on: bool = True) -> None:
    """Hold (or let go, ``on=False``) ``run/name/file`` live: a file an upload is putting on a
    slower tier for a manifest not committed there yet (an incremental save's reference into a
    step that tier never had)."""
    key = (run.url.rstrip("/"), name, file)
    with _inflight_lock:
        n = _pins.get(key, 0) + (1 if on else -1)
        if n > 0:
            _pins[key] = n
        else:
            _pins.pop(key, None)


def flushing(run: StorageTier, name: str, m: Manifest | None) -> None:
    """Register (or, with ``m=None``, unregister) a manifest being flushed to ``run/name``: its
    references are live there before it commits."""
    with _inflight_lock:
        if m is None:
            _inflight.pop((run.url.rstrip("/"), name), None)
        else:
            _inflight[(run.url.rstrip("/"), name)] = m


def _add(live: dict[str, set[str]], own_dir: str, m: Manifest) -> None:
    for f in m.files:
        live.setdefault(m.homes.get(f, own_dir), set()).add(f)


def run_references(run: StorageTier, *, skip: str | None = None,
                   also: Sequence[tuple[str, Manifest]] = ()) -> dict[str, set[str]]:
    """``{directory: files}`` referenced by the committed manifests in every real directory
    of ``run`` (links are not followed), by manifests registered as flushing, and by ``also``.
    ``"*"`` in a directory's set means keep everything there.  A committed manifest that cannot
    be read now (a read error, a format version this release does not know) could reference
    files in any directory of the run, an incremental step's base among them, so then every
    directory holds ``"*"``: the pass deletes nothing, and says so once.  Raises ``OSError`` when
    ``run`` cannot be listed."""
    live: dict[str, set[str]] = {}
    dirs: list[str] = []
    unreadable: list[tuple[str, Exception]] = []
    for name, kind in run.entries():
        if kind != "dir":
            continue
        dirs.append(name)
        if name == skip:
            continue
        t = run.child(name)
        for attempt in range(_RELISTS):
            if not any(is_manifest_name(n) for n in t.listdir()):
                break
            try:
                _add(live, name, load_manifest(t))
            except (FileNotFoundError, NotACheckpointError) as e:
                # uncommitted between the listing and the read (retention; a superseded rank
                # manifest), before the read found the file or after: look again, it is gone
                # or another one stands there now
                if attempt + 1 == _RELISTS:
                    unreadable.append((t.url, e))
                continue
            except ForeignFormatError:
                # DCP's own format (a run being migrated): its files are its own, none of ours
                log.debug("%s holds a checkpoint in DCP's own format; it references none of ours", t.url)
            except (CheckpointError, OSError) as e:
                unreadable.append((t.url, e))
            break
    if unreadable:
        url, e = unreadable[0]
        log.warning("cannot read the committed manifest of %s%s (%s); it may use files of any step "
                    "of %s, so this pass deletes nothing there", url,
                    f" and {len(unreadable) - 1} more" if len(unreadable) > 1 else "", e, run.url)
        for name in dirs:
            live.setdefault(name, set()).add("*")
    with _inflight_lock:
        pending = [(d, m) for (u, d), m in _inflight.items() if u == run.url.rstrip("/")]
        for u, d, f in _pins:
            if u == run.url.rstrip("/"):
                live.setdefault(d, set()).add(f)
    for name, m in [*pending, *also]:
        _add(live, name, m)
    return live


@dataclasses.dataclass
class Tidy:
    """What one commit into ``tier`` may remove (see the module docstring)."""
    tier: StorageTier
    save_id: str
    superseded: list[Manifest] = dataclasses.field(default_factory=list)
    dead_ids: list[str] = dataclasses.field(default_factory=list)
    rank: int | None = None  # per-rank manifests: touch only this rank's leftovers
    fence: Callable[[], None] = lambda: None  # raises where the save lost its claim
    # its own temporary files (under the claim nobody else commits this manifest here); False
    # where others may be committing the same manifest right now (a node's copy, ``replicas``)
    temps: bool = True
    deferred: bool = False  # set by ``run``: superseded files stay while a save reads them as a base

    def _own_temp(self, n: str) -> bool:
        base = n.partition(TEMP_INFIX)[0]
        if self.rank is None:
            return base in (MANIFEST_NAME, PERSISTED_RECORD)
        p = parse_rank_manifest(base)
        return p is not None and p[0] == self.rank

    def run(self, protect_own: set[str]) -> list[str]:
        """Remove what this save may remove, sparing ``protect_own`` (files of manifests that
        stay in this directory) and everything the run references.  Returns what it removed.
        The run's manifests are read only when there is something to remove.  Where a save
        holds this directory's base lock (``base_lock.py``, taken only where data files would
        go), no data file goes this time and ``deferred`` is set: the caller keeps its claim's
        record for the next save here."""
        t = self.tier
        doomed: set[str] = set()
        for m in self.superseded:
            doomed.update(f for f in m.files if f not in m.homes)
        names = t.listdir()
        dead = set(self.dead_ids) - {self.save_id}
        mine = "" if self.rank is None else f"-r{self.rank:05d}-"
        for n in names:
            base = n.partition(TEMP_INFIX)[0]  # a marker or file whose commit a crash cut short
            sid = data_file_save_id(base) or marker_save_id(base)
            if sid is not None and (sid in dead or (sid == self.save_id and marker_save_id(base))):
                if mine in base or marker_save_id(base):
                    doomed.add(n)
            elif self.temps and (is_temp_manifest(n) or TEMP_INFIX in n) and self._own_temp(n):
                doomed.add(n)  # under the claim nobody else commits this manifest here
        doomed = (doomed & set(names)) - protect_own
        data = {n for n in doomed if data_file_save_id(n.partition(TEMP_INFIX)[0]) is not None}
        if not data:  # markers and temporary manifests: nothing a save references
            return self._remove(doomed)
        with removing(t) as free:
            if not free:
                log.info("%s: a save is reading this step as its incremental base; %d superseded "
                         "file(s) stay", t.url, len(data))
                self.deferred = True
                doomed -= data
            return self._remove(doomed)

    def _remove(self, doomed: set[str]) -> list[str]:
        """Remove ``doomed`` but what a save in flight or a committed manifest of the run may
        use (read in that order: a save that commits and lets its claim go between the two
        reads is seen by the second)."""
        t = self.tier
        if self.superseded and doomed:  # files an incremental save in flight references are named by no manifest yet
            try:
                bases = bases_in_flight(t.parent())
            except OSError as e:
                log.warning("not removing superseded files of %s: the run's claims cannot be read (%s)", t.url, e)
                return []
            if bases.keeps(t.name):
                spared = doomed & {f for m in self.superseded for f in m.files}
                if spared:
                    log.warning("%s: %d file(s) of the save this one replaced stay: a save in flight may use "
                                "them as its incremental base", t.url, len(spared))
                doomed -= spared
        if not doomed:
            return []
        try:
            live = run_references(t.parent(), skip=t.name)
        except OSError as e:
            log.warning("not removing superseded files of %s: the run directory cannot be "
                        "listed (%s)", t.url, e)
            return []
        keep = live.get(t.name, set())
        if "*" in keep:
            log.warning("not removing superseded files of %s: a checkpoint of the run that may use "
                        "them cannot be read", t.url)
            return []
        removed = []
        self.fence()
        for n in sorted(doomed - keep):
            t.remove(n)
            removed.append(n)
        if removed:
            log.debug("removed %d superseded or leftover files from %s", len(removed), t.url)
        return removed


def rank_superseded(tier: StorageTier, rank: int, save_id: str,
                    saves: list | None = None) -> tuple[list[str], list[Manifest], set[str]]:
    """For rank ``rank`` that just committed its manifest of ``save_id`` in ``tier``: its own
    older rank manifests that a complete newer save supersedes (names and manifests), and the
    files every remaining rank manifest lists (to protect).  Nothing is superseded until a
    complete save newer than it exists."""
    saves = rank_saves(tier) if saves is None else saves
    complete = [s for s, _ in saves if s.complete]
    if not complete:
        return [], [], {f for _s, ms in saves for m in ms.values() for f in m.files}
    newest = complete[-1]
    names, old = [], []
    protect: set[str] = set()
    for s, ms in saves:
        mine_old = s.created_unix < newest.created_unix or (s.save_id is None and newest.save_id is not None)
        for r, m in ms.items():
            if r == rank and mine_old and s.save_id != save_id and s is not newest:
                names.append(s.names[r])
                old.append(m)
            else:
                protect.update(m.files)
    return names, old, protect


def other_kind_superseded(tier: StorageTier, manifest: Manifest, *, rank: int | None,
                          saves: list | None = None) -> tuple[list[str], list[Manifest]]:
    """The manifests of the other kind that ``manifest``, just committed in ``tier``, supersedes
    (their names, to uncommit, and the manifests, whose files go): for a collective save, every
    older rank manifest; for a save with rank manifests once it is complete on every rank, an
    older ``.metadata``.  None while a save of the other kind holds its claim here.  ``saves``:
    ``rank_saves(tier)``, where the caller has it already."""
    saves = rank_saves(tier) if saves is None else saves
    if rank is None:
        if live_claims(tier, per_rank_only=True):
            return [], []
        names, old = [], []
        for s, ms in saves:
            if s.created_unix < manifest.created_unix:
                names += list(s.names.values())
                old += list(ms.values())
        return names, old
    mine = [s for s, _ in saves if s.save_id == manifest.save_id]
    if not mine or not mine[0].complete or not tier.exists(MANIFEST_NAME) or holds_live_claim(tier, CLAIM_NAME):
        return [], []
    old_m = read_manifest(tier, MANIFEST_NAME)
    return ([MANIFEST_NAME], [old_m]) if old_m.created_unix < mine[0].created_unix else ([], [])


def superseded_here(tier: StorageTier, *, rank: int | None) -> list[Manifest]:
    """The committed manifest(s) a save into ``tier`` will replace, read before it writes:
    ``.metadata`` for a collective save, the rank's own rank manifests otherwise."""
    if rank is None:
        try:
            return [read_manifest(tier, MANIFEST_NAME)] if tier.exists(MANIFEST_NAME) else []
        except CheckpointError as e:
            log.warning("the manifest being replaced in %s cannot be read (%s); its files stay", tier.url, e)
            return []
    out = []
    for n in tier.listdir():
        p = parse_rank_manifest(n)
        if p is not None and p[0] == rank:
            try:
                out.append(read_manifest(tier, n))
            except CheckpointError as e:
                log.warning("rank manifest %s/%s cannot be read (%s); its files stay", tier.url, n, e)
    return out
