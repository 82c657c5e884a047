"""The states a power cut may leave when several processes write one directory tree: the ranks
of a collective save, and DCP's checkpoint process.

``tests/powercut.py`` models the calls of one process as they happen.  Here each process
records its calls instead (``Journal``: one JSON line per call under the root, each file's bytes
at each ``fsync`` beside it), and ``replay`` feeds them, merged on the clock every process of
the machine shares, to the same model.  An ``fsync`` is placed at its start (it makes durable
what was done before it began), every other call at its end, so a call that overlapped an
``fsync`` in another process counts as not covered by it.  A process reports a save by
``Journal.mark``: from that point on the save must survive.

The states are checked in this process, without restarting the job: every step directory
with a committed manifest loads bit-exactly, as a state saved there, through
``DataStatesReader``; the newest step reported by then loads in every tier."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import threading
import time

from tests.powercut import CALLS, Model, _wrap, read_all

ROOT_ENV, OUT_ENV = "DCPDS_POWERCUT_ROOT", "DCPDS_POWERCUT_OUT"


class Journal:
    """This process's calls under ``root``, as events in ``out/journal-<pid>``."""

    def __init__(self, root: str, out: str) -> None:
        self.root, self.out = os.path.abspath(root), out
        self.lock = threading.RLock()
        self.real: dict = {}
        self._fd = -1
        self._seq = 0
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.lock = threading.RLock()

    def _ours(self, path) -> bool:
        if not isinstance(path, str):
            return False
        p = os.path.abspath(path)
        return p == self.root or p.startswith(self.root + os.sep)

    def _emit(self, t: int, **ev) -> None:
        self._seq += 1
        line = json.dumps({"t": t, "pid": os.getpid(), "seq": self._seq, **ev}) + "\n"
        self.real["write"](self._fd, line.encode())

    def mark(self, step: int, what: str = "saved", rank: int = 0) -> None:
        """``rank`` reported ``step`` ``what`` (saved, replicated): it must stay so from now on."""
        with self.lock:
            self._emit(time.monotonic_ns(), op="mark", step=step, what=what, rank=rank)

    def _blob(self, data: bytes) -> str:
        h = hashlib.sha256(data).hexdigest()
        path = os.path.join(self.out, "blobs", h)
        if not os.path.exists(path):
            fd = self.real["open"](path + f".{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[self.real["write"](fd, view):]
            finally:
                self.real["close"](fd)
            self.real["replace"](path + f".{os.getpid()}", path)
        return h

    def install(self, mp) -> None:
        self.real.update({n: getattr(os, n) for n in CALLS})
        os.makedirs(os.path.join(self.out, "blobs"), exist_ok=True)
        self._fd = self.real["open"](os.path.join(self.out, f"journal-{os.getpid()}"),
                                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        tracked: set[int] = set()
        started: dict[int, int] = {}

        def before(name, a):
            if name in ("fsync", "fdatasync") and a[0] in tracked:
                started[a[0]] = time.monotonic_ns()

        def after(name, a, out):
            t = time.monotonic_ns()
            if name == "open" and self._ours(a[0]):
                tracked.add(out)
                self._emit(t, op="open", fd=out, path=os.path.abspath(a[0]), flags=a[1])
            elif name == "close" and a[0] in tracked:
                tracked.discard(a[0])
                self._emit(t, op="close", fd=a[0])
            elif name in ("write", "pwrite", "ftruncate") and a[0] in tracked:
                self._emit(t, op="wrote", fd=a[0])
            elif name == "copy_file_range" and a[1] in tracked:
                self._emit(t, op="wrote", fd=a[1])
            elif name in ("fsync", "fdatasync") and a[0] in started:
                fd = a[0]
                reg = stat.S_ISREG(os.fstat(fd).st_mode)
                sha = self._blob(read_all(fd, self.real["open"], self.real["close"])) if reg else None
                self._emit(started.pop(fd), op="sync", fd=fd, call=name, sha=sha)
            elif name in ("rename", "replace") and (self._ours(a[0]) or self._ours(a[1])):
                self._emit(t, op="rename", call=name, src=os.path.abspath(a[0]), dst=os.path.abspath(a[1]))
            elif name == "mkdir" and self._ours(a[0]):
                self._emit(t, op="mkdir", path=os.path.abspath(a[0]))
            elif name in ("unlink", "remove", "rmdir") and self._ours(a[0]):
                self._emit(t, op="remove", call=name, path=os.path.abspath(a[0]))

        for n, fn in _wrap(self.real, before, after, self.lock).items():
            mp.setattr(os, n, fn)


def install_from_env() -> None:
    """In a process the library started (DCP's checkpoint process): journal it for the test
    that set the environment (``tests/durability_site``)."""
    class _SetAttr:
        @staticmethod
        def setattr(target, name, value) -> None:
            setattr(target, name, value)
    Journal(os.environ[ROOT_ENV], os.environ[OUT_ENV]).install(_SetAttr())


def journal_spawned(root: str, out: str) -> None:
    """Every Python process this one starts from now on journals its calls under ``root``."""
    tests = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(tests, "durability_site"), os.path.dirname(tests)])
    os.environ[ROOT_ENV], os.environ[OUT_ENV] = root, out


@dataclasses.dataclass(frozen=True)
class Mark:
    at: int  # the index of the first crash point after it
    step: int
    what: str  # "saved", "replicated"
    rank: int


def _ready(model: Model, ev: dict) -> bool:
    """Whether the model can follow ``ev`` now: the directory it names is there, and so is
    the name it opens without creating, moves or removes."""
    op = ev["op"]
    if op not in ("open", "mkdir", "rename", "remove"):
        return True
    path = ev["dst"] if op == "rename" else ev["path"]
    if model.ours(path) and os.path.abspath(path) != model.root and model._where(path, False) is None:
        return False
    needs = {"rename": ev.get("src"), "remove": ev.get("path")}.get(op)
    if op == "open" and not ev["flags"] & os.O_CREAT:
        needs = ev["path"]
    if needs is not None and model.ours(needs) and os.path.abspath(needs) != model.root:
        w = model._where(needs, False)
        return w is not None and w[1] in model.cur[w[0]]
    return True


def _apply(model: Model, ev: dict, out: str, marks: list) -> None:
    key, op = (ev["pid"], ev.get("fd")), ev["op"]
    if op == "open":
        model.opened(key, ev["path"], ev["flags"])
    elif op == "close":
        model.closed(key)
    elif op == "wrote":
        model.wrote(key)
    elif op == "sync":
        if model.syncing(key, ev["call"]):
            data = None
            if ev["sha"] is not None:
                with open(os.path.join(out, "blobs", ev["sha"]), "rb") as f:
                    data = f.read()
            model.synced(key, data)
    elif op == "rename":
        model.renaming(ev["call"], ev["src"], ev["dst"])
        model.renamed(ev["src"], ev["dst"])
    elif op == "mkdir":
        model.made_dir(ev["path"])
    elif op == "remove":
        model.removing(ev["call"], ev["path"])
        model.removed(ev["path"])
    elif op == "mark":
        marks.append(Mark(len(model.points), ev["step"], ev["what"], ev["rank"]))


def replay(model: Model, out: str) -> tuple[Model, list[Mark]]:
    """Every journal of ``out`` fed to ``model`` in the order of the machine's clock; and the
    marks, each with the index of the first crash point after it.

    A process preempted between a call and its reading of the clock stamps the call late, so a
    call of another process that depended on it (made a file in the directory it made) may
    come first.  Such a call, and the later calls of its process, wait until the model can
    follow it."""
    events = []
    for name in os.listdir(out):
        if name.startswith("journal-"):
            with open(os.path.join(out, name)) as f:
                events += [json.loads(line) for line in f if line.endswith("\n")]
    events.sort(key=lambda e: (e["t"], e["pid"], e["seq"]))
    marks: list[Mark] = []
    held: dict[int, list[dict]] = {}  # process -> its calls waiting, in order
    for ev in events:
        if ev["pid"] in held or not _ready(model, ev):
            held.setdefault(ev["pid"], []).append(ev)
            continue
        _apply(model, ev, out, marks)
        moved = True
        while moved:  # what waited may follow now
            moved = False
            for pid in list(held):
                while held[pid] and _ready(model, held[pid][0]):
                    _apply(model, held[pid].pop(0), out, marks)
                    moved = True
                if not held[pid]:
                    del held[pid]
    for pid, evs in held.items():
        model.lost.append(f"process {pid}: {len(evs)} calls the model never could follow, from {evs[0]}")
    return model, marks
