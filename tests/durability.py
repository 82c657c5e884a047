"""What a power cut would keep: the file system calls of a save, traced, checked against the
rules that make a commit survive one.

The crash harness (``tests/crashsim.py``) kills processes; the kernel then still writes out
everything they wrote.  A power cut keeps only what was made durable, and POSIX promises little:
a file's data is durable after an ``fsync`` of the file, and a name in a directory (a file
created or renamed there, a directory made there) after an ``fsync`` of that directory.  Some
file systems give more (ext4 and XFS commit their journal in order, so an older name is never
lost while a newer one survives), but a checkpoint may live on others.  ``Trace`` wraps the
``os`` calls through which the library writes (``tiers/local.py`` is the only writer of the
local tiers) and keeps, per file, whether it holds data written since its last ``fsync``, and,
per directory, the names changed there since its last ``fsync``.  Its rules:

* *data before name*: a file is renamed into place only with its data durable (else the name
  may survive the cut and point at missing data);
* *name before removal*: a file is removed from a directory only once every earlier change of
  a name there is durable (else the removal may survive and the change be lost: a manifest's
  replacement lost, the old one's files gone).  Across directories the order is retention's to
  keep: it removes a step only while a newer one is durable and, with replicas, fully
  replicated by its committed records (a rule over every directory at once flags the purge of
  step 1 while step 3's replicas arrive, step 2 whole);
* *names before the commit*: a manifest is renamed into place only once every earlier change
  of a name in its directory is durable (else the manifest may survive the cut and the files
  it references, made there before it, not);
* *uncommit before removal*: a file is removed only once the removal of every manifest of its
  directory is durable (else the files may go and the manifest come back);
* *removals before the claim goes*: a claim is removed only once the removals before it in its
  directory are durable (else they may be lost with the claim gone, whose record names the
  saves the next save cleans up after);
* *durable when reported*: when a save is reported committed, every name it made is durable.

Temporary names (a rename replaces them, or they are removed: ``.tmp``, a persist upload's
``.part``) and lock files are exempt: losing one loses nothing."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import weakref
from dataclasses import dataclass, field

from dcp_datastates.format.names import CLAIM_NAME, RANK_CLAIM_PREFIX, is_manifest_name

_LIVE: weakref.WeakSet = weakref.WeakSet()


def _after_fork() -> None:  # a child forked while a thread held a trace's lock
    for t in list(_LIVE):
        t.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _transient(name: str) -> bool:
    return ".tmp" in name or name.endswith((".part", "lock")) or name.startswith(".lock")


@dataclass
class Change:
    kind: str  # "create", "rename", "mkdir", "remove"
    name: str
    at: float = field(default_factory=time.monotonic)  # the clock every process of the machine shares


@dataclass
class Trace:
    """Install with ``install(monkeypatch)``; only paths under ``root`` (and the directories
    above it) are traced."""

    root: str
    fds: dict[int, str] = field(default_factory=dict)
    dirty: dict[tuple[int, int], str] = field(default_factory=dict)  # inode -> path it was written as
    pending: dict[str, list[Change]] = field(default_factory=dict)  # directory -> changes since its fsync
    synced: dict[str, float] = field(default_factory=dict)  # directory -> when this process last fsynced it
    broken: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    dump_to: str | None = None  # a file outside ``root`` written after every change (``install_from_env``)

    def _ours(self, path) -> bool:
        """Under ``root``, or one of the directories above it (whose fsync makes it durable)."""
        if not isinstance(path, str):
            return False
        p = os.path.abspath(path)
        return (p + os.sep).startswith(self.root + os.sep) or (self.root + os.sep).startswith(p.rstrip(os.sep) + os.sep)

    def _changed(self, path: str, kind: str) -> None:
        path = os.path.abspath(path)
        self.pending.setdefault(os.path.dirname(path), []).append(Change(kind, os.path.basename(path)))
        self._write_dump()

    def _inode(self, fd: int) -> tuple[int, int]:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino

    def __hash__(self) -> int:
        return id(self)

    def install(self, mp) -> None:
        _LIVE.add(self)
        real = {n: getattr(os, n) for n in ("open", "close", "write", "pwrite", "ftruncate", "copy_file_range",
                                             "fsync", "fdatasync", "replace", "rename", "mkdir", "unlink",
                                             "remove", "rmdir")}

        def open_(path, flags, mode=0o777, *a, **kw):
            new = self._ours(path) and bool(flags & os.O_CREAT) and not os.path.lexists(path)
            fd = real["open"](path, flags, mode, *a, **kw)
            if self._ours(path):
                with self.lock:
                    self.fds[fd] = os.path.abspath(path)
                    if new:
                        self._changed(path, "create")
                    if flags & os.O_TRUNC:
                        self.dirty[self._inode(fd)] = os.path.abspath(path)
            return fd

        def close(fd):
            with self.lock:
                self.fds.pop(fd, None)
            return real["close"](fd)

        def wrote(fd):
            with self.lock:
                if fd in self.fds:
                    self.dirty[self._inode(fd)] = self.fds[fd]

        def writer(name):
            def call(fd, *a, **kw):
                n = real[name](fd, *a, **kw)
                wrote(fd)
                return n
            return call

        def copy_file_range(src, dst, *a, **kw):
            n = real["copy_file_range"](src, dst, *a, **kw)
            wrote(dst)
            return n

        def sync(name):
            def call(fd):
                real[name](fd)
                with self.lock:
                    path = self.fds.get(fd)
                    if path is None:
                        return
                    if stat.S_ISDIR(os.fstat(fd).st_mode):
                        self.pending.pop(path, None)
                        self.synced[path] = time.monotonic()
                        self._write_dump()
                    else:
                        self.dirty.pop(self._inode(fd), None)
            return call

        def rename(name):
            def call(src, dst, *a, **kw):
                if not self._ours(dst):
                    return real[name](src, dst, *a, **kw)
                with self.lock:
                    try:
                        st = os.lstat(src)
                    except OSError:
                        st = None
                    if st is not None and (st.st_dev, st.st_ino) in self.dirty:
                        self.broken.append(f"data before name: {dst} renamed into place from {src} "
                                           "with data not yet fsynced")
                    d = os.path.dirname(os.path.abspath(dst))
                    if is_manifest_name(os.path.basename(dst)):
                        before = [f"{c.kind} {c.name}" for c in self.pending.get(d, ()) if not _transient(c.name)]
                        if before:
                            self.broken.append(f"names before the commit: {dst} renamed into place while "
                                               f"{before} in its directory is not durable")
                real[name](src, dst, *a, **kw)
                with self.lock:
                    self._changed(dst, "rename")
                    if os.path.dirname(os.path.abspath(src)) != os.path.dirname(os.path.abspath(dst)):
                        self._changed(src, "remove")
            return call

        def mkdir(path, *a, **kw):
            real["mkdir"](path, *a, **kw)
            if self._ours(path):
                with self.lock:
                    self._changed(path, "mkdir")

        def remover(name):
            def call(path, *a, **kw):
                if self._ours(path):
                    with self.lock:
                        d = os.path.dirname(os.path.abspath(path))
                        before = [f"{c.kind} {os.path.join(d, c.name)}" for c in self.pending.get(d, ())
                                  if c.kind != "remove" and not _transient(c.name)
                                  and os.path.lexists(os.path.join(d, c.name))]
                        if before and not _transient(os.path.basename(path)):
                            self.broken.append(f"name before removal: {path} removed while {before} "
                                               "is not durable")
                        gone = os.path.basename(path)
                        removed = [c.name for c in self.pending.get(d, ()) if c.kind == "remove"]
                        uncommits = [n for n in removed if is_manifest_name(n)]
                        if uncommits and not is_manifest_name(gone) and not _transient(gone):
                            self.broken.append(f"uncommit before removal: {path} removed while the removal "
                                               f"of {uncommits} is not durable")
                        if (gone == CLAIM_NAME or gone.startswith(RANK_CLAIM_PREFIX)) and removed:
                            self.broken.append(f"removals before the claim goes: {path} removed while the "
                                               f"removal of {removed} is not durable")
                real[name](path, *a, **kw)
                if self._ours(path):
                    with self.lock:
                        self._changed(path, "remove")
            return call

        for n, fn in (("open", open_), ("close", close), ("write", writer("write")), ("pwrite", writer("pwrite")),
                      ("ftruncate", writer("ftruncate")), ("copy_file_range", copy_file_range),
                      ("fsync", sync("fsync")), ("fdatasync", sync("fdatasync")), ("replace", rename("replace")),
                      ("rename", rename("rename")), ("mkdir", mkdir), ("unlink", remover("unlink")),
                      ("remove", remover("remove")), ("rmdir", remover("rmdir"))):
            mp.setattr(os, n, fn)

    def not_durable(self, synced: dict[str, float] | None = None) -> list[str]:
        """The names that exist now whose last change is not durable (*durable when reported*).
        ``synced``: when other processes of the machine last fsynced each directory (an
        ``fsync`` of a directory makes every earlier change there durable, whoever made it)."""
        with self.lock:
            out = []
            for d, changes in self.pending.items():
                last = {c.name: c for c in changes}
                for name, c in last.items():
                    if (c.kind != "remove" and not _transient(name) and os.path.lexists(os.path.join(d, name))
                            and (synced or {}).get(d, -1.0) <= c.at):
                        out.append(f"durable when reported: {c.kind} of {os.path.join(d, name)} not fsynced in {d}")
            return sorted(out)

    def dump(self, path: str) -> None:
        """For ``across``: what this process broke, changed and synced."""
        with self.lock:
            self._write_dump(path)

    def _write_dump(self, path: str | None = None) -> None:  # under the lock
        path = path or self.dump_to
        if path is None:
            return
        pending = {d: [[c.kind, c.name, c.at] for c in cs] for d, cs in self.pending.items()}
        with open(path + ".new", "w") as f:
            json.dump({"broken": self.broken, "pending": pending, "synced": self.synced}, f)
        os.replace(path + ".new", path)  # outside ``root``: not traced


ROOT_ENV, DUMPS_ENV = "DCPDS_DURABILITY_ROOT", "DCPDS_DURABILITY_DUMPS"


def trace_spawned(root: str, dumps: str) -> None:
    """Every Python process this one starts from now on (DCP's checkpoint process, a replica
    helper) traces its calls under ``root`` from its start and keeps its trace in ``dumps``
    (``tests/durability_site`` goes first on their ``PYTHONPATH``)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(tests, "durability_site"), os.path.dirname(tests)])
    os.environ[ROOT_ENV], os.environ[DUMPS_ENV] = root, dumps


class _SetAttr:
    """``monkeypatch.setattr`` for a process with no test around it (it never undoes)."""

    @staticmethod
    def setattr(target, name, value) -> None:
        setattr(target, name, value)


def install_from_env() -> None:
    """In a process started by the library: trace it for the test that set the environment."""
    t = Trace(os.environ[ROOT_ENV], dump_to=os.path.join(os.environ[DUMPS_ENV], f"trace-spawned-{os.getpid()}"))
    t.install(_SetAttr())


def across(paths: list[str]) -> list[str]:
    """The rules over several processes of one machine (``Trace.dump`` of each): a name one of
    them changed is durable once any of them fsynced its directory afterwards."""
    dumps = [json.load(open(p)) for p in paths]
    synced: dict[str, float] = {}
    for d in dumps:
        for k, t in d["synced"].items():
            synced[k] = max(synced.get(k, -1.0), t)
    out = []
    for p, d in zip(paths, dumps):
        t = Trace(root="")
        t.pending = {k: [Change(kind, name, at) for kind, name, at in cs] for k, cs in d["pending"].items()}
        out += [f"{os.path.basename(p)}: {v}" for v in d["broken"] + t.not_durable(synced)]
    return out
