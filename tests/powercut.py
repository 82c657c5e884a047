"""What a power cut leaves on disk, at every point of a save, and what a restart makes of it.

    python -m tests.powercut [SCENARIO ...] [--jobs N] [--json OUT]

The crash harness (``tests/crashsim.py``) kills processes: the kernel still writes out all they
wrote.  ``tests/durability.py`` checks the order of the calls against POSIX's rules.  This
harness takes the next step: it *builds* the states a power cut may leave and restarts from
each.  ``Disk`` wraps the ``os`` calls through which the library writes the local tiers and
keeps a model of two views of the run directory:

* the current one: every name as the calls left it;
* the durable one: each directory's names as of its last ``fsync``, each file's bytes as of its
  last ``fsync`` (empty if it never had one).

Before every ``fsync``, rename and removal (and once the act ends) it records a crash point.
At each point the states a power cut may leave are the durable view with some changes kept
(POSIX orders none of them without an ``fsync``): every directory durable, every one current,
each one alone current and alone durable, each changed name of a directory alone kept and
alone lost, each tree under the root alone cut (a node whose power failed while the others ran
on, a tier on a device of its own) and alone kept; a file's bytes are only ever the durable
ones, and, in a *torn* variant, a file written since its last ``fsync`` (a claim record
rewritten in place) is empty.  Each distinct state is written out and given to
``crashsim.verify``: every committed step loads bit-exactly as a state saved there, the steps
that must survive load (at the last point, the one the act reported), nothing outside the run
changed, and the next save runs and leaves nothing of the dead attempt.

The model follows one process: a scenario that forks a second save (``concurrent``) is left to
the order check.  What it does not model: a file's data partly written (a torn write within a
file), and metadata a file system may keep besides names and bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import stat
import sys
import threading

from tests import crashsim

ROOT_ID = 0
CALLS = ("open", "close", "write", "pwrite", "ftruncate", "copy_file_range", "fsync", "fdatasync", "replace",
         "rename", "mkdir", "unlink", "remove", "rmdir")


@dataclasses.dataclass
class Point:
    label: str  # the call about to run ("fsync step-3/__0_0.distcp"), or "end"
    cur: dict[int, dict[str, int]]
    dur: dict[int, dict[str, int]]
    data: dict[int, bytes]
    dirty: frozenset[int]


@dataclasses.dataclass
class Model:
    """The model of ``root`` (see the module's docstring), fed the calls as events.  Ids name
    files and directories: a rename moves an id from one name to another, so the durable view
    of its old directory still finds it there.  A descriptor is named by a key: its number in
    one process (``Disk``), or (process, number) when several processes' calls are replayed
    (``replay``)."""

    root: str
    kind: dict[int, str] = dataclasses.field(default_factory=dict)  # id -> "d" or "f"
    cur: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)  # directory id -> name -> id
    dur: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    data: dict[int, bytes] = dataclasses.field(default_factory=dict)  # file id -> bytes at its last fsync
    dirty: set[int] = dataclasses.field(default_factory=set)  # files written since their last fsync
    fds: dict = dataclasses.field(default_factory=dict)  # descriptor key -> id
    names: dict = dataclasses.field(default_factory=dict)  # descriptor key -> its path, for the labels
    points: list[Point] = dataclasses.field(default_factory=list)
    lost: list[str] = dataclasses.field(default_factory=list)  # calls the model could not follow

    def __post_init__(self) -> None:
        self.root = os.path.abspath(self.root)
        self.kind[ROOT_ID] = "d"
        self._scan(self.root, ROOT_ID)

    def _new(self, kind: str) -> int:
        i = len(self.kind)
        self.kind[i] = kind
        if kind == "d":
            self.cur[i], self.dur[i] = {}, {}
        else:
            self.data[i] = b""
        return i

    def _scan(self, path: str, did: int) -> None:
        """What is there before the act is durable (the setup's saves were reported)."""
        self.cur.setdefault(did, {})
        for e in sorted(os.scandir(path), key=lambda e: e.name):
            if e.is_dir(follow_symlinks=False):
                i = self._new("d")
                self._scan(e.path, i)
            else:
                i = self._new("f")
                with open(e.path, "rb") as f:
                    self.data[i] = f.read()
            self.cur[did][e.name] = i
        self.dur[did] = dict(self.cur[did])

    def _where(self, path, note: bool = True) -> tuple[int, str] | None:
        """(the id of the directory holding ``path``, its name there), or None outside ``root``
        (``note``: a path under ``root`` whose directory the model lacks is a call it lost)."""
        if not isinstance(path, str):
            return None
        p = os.path.abspath(path)
        if not p.startswith(self.root + os.sep):
            return None
        parts = os.path.relpath(p, self.root).split(os.sep)
        did = ROOT_ID
        for name in parts[:-1]:
            nxt = self.cur.get(did, {}).get(name)
            if nxt is None or self.kind[nxt] != "d":
                if note:
                    self.lost.append(f"{p}: its directory {name} is not in the model")
                return None
            did = nxt
        return did, parts[-1]

    def ours(self, path) -> bool:
        """Whether a call on ``path`` is one the model follows."""
        if not isinstance(path, str):
            return False
        p = os.path.abspath(path)
        return p == self.root or p.startswith(self.root + os.sep)

    def _point(self, label: str) -> None:
        self.points.append(Point(label, {d: dict(e) for d, e in self.cur.items()},
                                 {d: dict(e) for d, e in self.dur.items()}, dict(self.data),
                                 frozenset(self.dirty)))

    def _rel(self, path) -> str:
        return os.path.relpath(os.path.abspath(path), self.root) if isinstance(path, str) else str(path)

    # ------------------------------------------------------------------ the events
    def opened(self, key, path: str, flags: int) -> None:
        if os.path.abspath(path) == self.root:
            self.fds[key], self.names[key] = ROOT_ID, "."
            return
        w = self._where(path)
        if w is None:
            return
        i = self.cur[w[0]].get(w[1])
        if i is None:
            if not flags & os.O_CREAT:
                self.lost.append(f"{self._rel(path)}: opened, but the model has no such name")
                return
            i = self._new("f")
            self.cur[w[0]][w[1]] = i
            self.dirty.add(i)
        elif flags & os.O_TRUNC:
            self.dirty.add(i)
        self.fds[key], self.names[key] = i, self._rel(path)

    def closed(self, key) -> None:
        self.fds.pop(key, None)

    def wrote(self, key) -> None:
        if key in self.fds:
            self.dirty.add(self.fds[key])

    def syncing(self, key, call: str) -> bool:
        """Before an ``fsync`` of ``key``: a crash point.  Whether the model follows it."""
        if key not in self.fds:
            return False
        self._point(f"{call} {self.names.get(key)}")
        return True

    def synced(self, key, data: bytes | None) -> None:
        """After it: a directory's names, or a file's bytes (``data``), are durable."""
        i = self.fds[key]
        if self.kind[i] == "d":
            self.dur[i] = dict(self.cur[i])
        elif data is not None:
            self.data[i] = data
            self.dirty.discard(i)

    def renaming(self, call: str, src: str, dst: str) -> None:
        """Before a rename: a crash point."""
        if self._where(src, False) is not None or self._where(dst, False) is not None:
            self._point(f"{call} {self._rel(src)} -> {self._rel(dst)}")

    def renamed(self, src: str, dst: str) -> None:
        s, d = self._where(src), self._where(dst)
        moved = None if s is None else self.cur[s[0]].pop(s[1], None)
        if d is not None:
            if moved is None:
                self.lost.append(f"{self._rel(dst)}: renamed from outside the model ({src})")
                return
            self.cur[d[0]][d[1]] = moved

    def made_dir(self, path: str) -> None:
        w = self._where(path)
        if w is not None:
            self.cur[w[0]][w[1]] = self._new("d")

    def removing(self, call: str, path: str) -> None:
        """Before a removal: a crash point."""
        if self._where(path, False) is not None:
            self._point(f"{call} {self._rel(path)}")

    def removed(self, path: str) -> None:
        w = self._where(path)
        if w is not None and self.cur[w[0]].pop(w[1], None) is None:
            self.lost.append(f"{self._rel(path)}: removed, but the model has no such name")


    # ------------------------------------------------------------------ the states of a cut
    def states(self) -> tuple[list[tuple[str, tuple]], dict[str, bytes]]:
        """Every distinct state a power cut may leave at some point: (where, tree) pairs, each
        tree a sorted tuple of (path, sha256 of the bytes, or None for a directory), and the
        bytes by their hash."""
        self._point("end")
        blobs: dict[str, bytes] = {}
        seen: dict[tuple, str] = {}
        for n, pt in enumerate(self.points):
            for label, base, views, torn in self._variants(pt):
                tree = self._tree(pt, base, views, torn, blobs)
                seen[tree] = f"{n}:{pt.label}: {label}"  # its latest point: the most reported by then"
        return [(where, tree) for tree, where in seen.items()], blobs

    def _subtree(self, pt: Point, top: int) -> set[int]:
        """The directories under ``top`` (itself included), in either view."""
        out, todo = set(), [top]
        while todo:
            d = todo.pop()
            if d in out:
                continue
            out.add(d)
            for view in (pt.cur.get(d, {}), pt.dur.get(d, {})):
                todo += [i for i in view.values() if self.kind[i] == "d"]
        return out

    def _variants(self, pt: Point):
        """(label, the view most directories take, directory -> its entries where it differs,
        torn) for each state considered at ``pt``."""
        dur = {d: pt.dur.get(d, {}) for d in pt.cur}
        pending = sorted(d for d in pt.cur if pt.cur[d] != dur[d])
        yield "all durable", dur, {}, False
        yield "all durable, rewritten files empty", dur, {}, True
        yield "every change kept", pt.cur, {}, False
        yield "every change kept, rewritten files empty", pt.cur, {}, True
        # one tree alone cut (a node whose power failed while the others ran on, a tier on a
        # device of its own), or alone kept
        for name, top in sorted(pt.cur[ROOT_ID].items()):
            under = self._subtree(pt, top) if self.kind[top] == "d" else set()
            if not under & set(pending):
                continue
            yield f"{name}/ alone cut", pt.cur, {d: dur[d] for d in under}, False
            yield f"{name}/ alone kept its changes", dur, {d: pt.cur[d] for d in under}, False
        for d in pending:
            yield f"only directory {d} kept its changes", dur, {d: pt.cur[d]}, False
            yield f"directory {d} alone lost its changes", pt.cur, {d: dur[d]}, False
            for name in sorted(set(pt.cur[d]) | set(dur[d])):
                if pt.cur[d].get(name) == dur[d].get(name):
                    continue
                kept, lost = dict(dur[d]), dict(pt.cur[d])
                for view, src in ((kept, pt.cur[d]), (lost, dur[d])):
                    view.pop(name, None)
                    if name in src:
                        view[name] = src[name]
                yield f"only {name} in directory {d} kept its change", dur, {d: kept}, False
                yield f"{name} in directory {d} alone lost its change", pt.cur, {d: lost}, False

    def _tree(self, pt: Point, base: dict, views: dict, torn: bool, blobs: dict[str, bytes]) -> tuple:
        out: list[tuple[str, str | None]] = []

        def walk(did: int, rel: str) -> None:
            for name, i in sorted(views.get(did, base.get(did, {})).items()):
                path = f"{rel}/{name}" if rel else name
                if self.kind[i] == "d":
                    out.append((path, None))
                    walk(i, path)
                else:
                    data = b"" if torn and i in pt.dirty else pt.data.get(i, b"")
                    h = hashlib.sha256(data).hexdigest()
                    blobs.setdefault(h, data)
                    out.append((path, h))
        walk(ROOT_ID, "")
        return tuple(out)


def read_all(fd: int, real_open, real_close) -> bytes:
    """A file's bytes through a descriptor of our own (``fd`` may be O_DIRECT)."""
    mine = real_open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    try:
        out = []
        while chunk := os.read(mine, 1 << 20):
            out.append(chunk)
        return b"".join(out)
    finally:
        real_close(mine)


def _wrap(real: dict, before, after, lock) -> dict:
    """The ``os`` calls of ``CALLS``, each running ``before(call, args)`` (for the fsyncs, whose
    crash point precedes them) and ``after(call, args, result)`` under ``lock``."""
    def make(name):
        def call(*a, **kw):
            with lock:
                before(name, a)
                out = real[name](*a, **kw)
                after(name, a, out)
                return out
        return call
    return {n: make(n) for n in CALLS}


@dataclasses.dataclass
class Disk(Model):
    """The model fed live by this process's calls (``install``)."""

    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    real: dict = dataclasses.field(default_factory=dict)

    def install(self, mp) -> None:
        self.real.update({n: getattr(os, n) for n in CALLS})
        pending: dict = {}

        def before(name, a):
            if name in ("fsync", "fdatasync"):
                pending[a[0]] = self.syncing(a[0], name)
            elif name in ("rename", "replace"):
                self.renaming(name, a[0], a[1])
            elif name in ("unlink", "remove", "rmdir"):
                self.removing(name, a[0])

        def after(name, a, out):
            if name == "open":
                if self.ours(a[0]):
                    self.opened(out, a[0], a[1])
            elif name == "close":
                self.closed(a[0])
            elif name in ("write", "pwrite", "ftruncate"):
                self.wrote(a[0])
            elif name == "copy_file_range":
                self.wrote(a[1])
            elif name == "mkdir":
                self.made_dir(a[0])
            elif name in ("rename", "replace"):
                self.renamed(a[0], a[1])
            elif name in ("unlink", "remove", "rmdir"):
                self.removed(a[0])
            elif name in ("fsync", "fdatasync") and pending.pop(a[0], False):
                fd = a[0]
                reg = self.kind[self.fds[fd]] == "f" and stat.S_ISREG(os.fstat(fd).st_mode)
                self.synced(fd, read_all(fd, self.real["open"], self.real["close"]) if reg else None)

        for n, fn in _wrap(self.real, before, after, self.lock).items():
            mp.setattr(os, n, fn)

def materialize(tree: tuple, blobs: dict[str, bytes], where: str) -> None:
    os.makedirs(where)
    for path, h in tree:
        p = os.path.join(where, path)
        if h is None:
            os.makedirs(p, exist_ok=True)
        else:
            with open(p, "wb") as f:
                f.write(blobs[h])


# ----------------------------------------------------------------------- the runner
class _SetAttr:
    @staticmethod
    def setattr(target, name, value) -> None:
        setattr(target, name, value)


def _record(sc: crashsim.Scenario, golden: str, work: str, out: str) -> None:
    """The act once, in a child, under the model; its states written to ``out``."""
    shutil.copytree(golden, work)

    def act():
        disk = Disk(work)
        disk.install(_SetAttr())
        sc.act(work)
        for n, fn in disk.real.items():
            setattr(os, n, fn)
        states, blobs = disk.states()
        os.makedirs(os.path.join(out, "blobs"))
        for h, b in blobs.items():
            with open(os.path.join(out, "blobs", h), "wb") as f:
                f.write(b)
        with open(os.path.join(out, "states.json"), "w") as f:
            json.dump({"lost": disk.lost, "points": len(disk.points),
                       "states": [[w, [list(e) for e in t]] for w, t in states]}, f)
    code = crashsim._wait(crashsim._child(act), 300)
    if code != 0:
        raise SystemExit(f"{sc.name}: the act fails under the model (exit {code})")


def _final(sc: crashsim.Scenario) -> crashsim.Scenario:
    """What the act reported once it returned: its step, holding its seed, in every tier."""
    step, seed = REPORTED[sc.name]
    allowed = {**sc.allowed, step: {seed}}
    return dataclasses.replace(sc, allowed=allowed, floor=step, floor_last=step if len(sc.tiers) > 1 else 0)


# scenario -> (the step its act saves, the seed it saves there): what must load once it returned
REPORTED = {"save": (1, 1), "overwrite": (1, 2), "async-mutation": (1, 2), "incremental-keep1": (3, 3),
            "per-rank": (1, 2), "persist-keep1": (3, 3), "other-kind": (1, 2), "incremental-persist": (3, 3)}


def _one(sc: crashsim.Scenario, tree: tuple, blobs: dict[str, bytes], work: str, out: str, last: bool) -> None:
    materialize(tree, blobs, work)
    sentinel = open(os.path.join(work, "outside", "keep.bin"), "rb").read()
    bad = crashsim.verify(_final(sc) if last else sc, work, sentinel)
    if not bad:
        shutil.rmtree(work, ignore_errors=True)
    with open(out, "w") as f:
        json.dump(bad, f)


def run_scenario(name: str, base: str, jobs: int, keep: bool = False) -> dict:
    sc = {**crashsim.SCENARIOS, **crashsim.LONG_SCENARIOS}[name]
    golden = crashsim.make_golden(sc, base)
    rec = os.path.join(base, name, "recorded")
    _record(sc, golden, os.path.join(base, name, "act"), rec)
    said = json.load(open(os.path.join(rec, "states.json")))
    blobs = {h: open(os.path.join(rec, "blobs", h), "rb").read() for h in os.listdir(os.path.join(rec, "blobs"))}
    states = [(w, tuple(tuple(e) for e in t)) for w, t in said["states"]]
    results = os.path.join(base, name, "results")
    os.makedirs(results)
    running: dict[int, int] = {}
    for k, (where, tree) in enumerate(states):
        while len(running) >= jobs:
            pid, _ = os.wait()
            running.pop(pid, None)
        last = where.split(":", 1)[1].startswith("end")
        pid = crashsim._child(lambda k=k, tree=tree, last=last: _one(
            sc, tree, blobs, os.path.join(base, name, f"state-{k}"), os.path.join(results, str(k)), last))
        running[pid] = k
    for pid in list(running):
        crashsim._wait(pid, 600)
    out = {"scenario": name, "points": said["points"], "states": len(states),
           "violations": [f"the model lost track: {v}" for v in said["lost"]]}
    for k, (where, _) in enumerate(states):
        try:
            bad = json.load(open(os.path.join(results, str(k))))
        except (OSError, ValueError):
            bad = ["no result (the state's process died)"]
        out["violations"] += [f"state {k} ({where}): {v}" for v in bad]
    if not keep:
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return out


# the model follows one process; ``concurrent`` forks a second save
SCENARIOS = [n for n in crashsim.SCENARIOS if n != "concurrent"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenarios", nargs="*", help=f"default: {' '.join(SCENARIOS)} (with --size large, "
                    "the long ones too)")
    ap.add_argument("--size", choices=list(crashsim.SIZES), default="small")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--dir", default="/tmp/dcpds-powercut")
    ap.add_argument("--json")
    ap.add_argument("--keep", action="store_true", help="keep the work directories")
    args = ap.parse_args(argv)
    os.environ.setdefault("DCP_DATASTATES_HOST_CACHE_BYTES", str(8 << 20))
    assert threading.active_count() == 1, "the runner must start no thread: it forks"
    crashsim.SIZE[0] = args.size
    names = args.scenarios or SCENARIOS + (list(crashsim.LONG_SCENARIOS) if args.size == "large" else [])
    return crashsim.report_runs(names, lambda name: run_scenario(name, args.dir, args.jobs, keep=args.keep),
                                lambda r: f"{r['points']} crash points, {r['states']} distinct states", args.json)

if __name__ == "__main__":
    sys.exit(main())
