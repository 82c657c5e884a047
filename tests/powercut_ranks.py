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

    def mark(self, step: int) -> None:
        """This process reported ``step`` saved: it must survive from now on."""
        with self.lock:
            self._emit(time.monotonic_ns(), op="mark", step=step)

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


def replay(model: Model, out: str) -> tuple[Model, list[tuple[int, int]]]:
    """Every journal of ``out`` fed to ``model`` in the order of the machine's clock; and the
    marks, as (index of the first point after it, step)."""
    events = []
    for name in os.listdir(out):
        if name.startswith("journal-"):
            with open(os.path.join(out, name)) as f:
                events += [json.loads(line) for line in f if line.endswith("\n")]
    events.sort(key=lambda e: (e["t"], e["pid"], e["seq"]))
    marks = []
    for ev in events:
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
            marks.append((len(model.points), ev["step"]))
    return model, marks
