"""The crash harness's storage seam (``tests/crashsim.py`` runs the scenarios): a wrapper of
the library's ``Backend`` (and the ``Sink`` and ``HeldLock`` objects it hands out) that logs each
storage operation and, where a plan is armed, crashes the process right after operation k
(``os._exit``), fails it (EIO, ENOSPC, a short write, or an error after it took effect), or
kills the whole job (``kill_job``).  Tiers made after ``install`` go through it; a process the
library starts itself (a replica helper) takes the plan through ``crashsim_site``."""

from __future__ import annotations

import dataclasses
import errno
import json
import multiprocessing
import os
import random
import signal
import threading
import time

from dcp_datastates.tiers import storage as storage_mod
from dcp_datastates.tiers.backend import Backend, HeldLock, Sink
from dcp_datastates.tiers.local import LocalBackend
from dcp_datastates.tiers.remote import FsspecBackend
from tests.dist import run_ranks

CRASHED = 77
REMOTE_MARK = " @s3"  # ends the log line of an operation on the object-store tier
WRITES = {"pwrite", "commit", "lock-write", "copy"}
# operations that may fail after they took effect (fault "after"): a rename or an unlink (a
# claim's too) retried by a network file system, a commit whose directory sync fails after the
# rename
AMBIGUOUS = {"mkdir", "commit", "rename", "copy", "unlink", "unlock", "rmdir", "create-excl"}


# ------------------------------------------------------------- the plan and the wrapper
@dataclasses.dataclass
class Plan:
    mode: str = "off"  # "record", "crash", "crash-mid", "job", "fault", "hang", "off"
    k: int = 0
    err: str = "EIO"  # "EIO", "ENOSPC", "short", "after" (EIO once the operation took effect)
    log: list[str] = dataclasses.field(default_factory=list)
    thread: str | None = None  # count only the operations of the thread of this name
    # a process the test does not start itself (a replica helper): the file its plan will be
    # written to, taken at the first operation after it appears, and the file each operation it
    # counts from then on is appended to (``install_armed``)
    arm: str | None = None
    log_file: str | None = None
    match: str | None = None  # count only the operations whose "name file" starts with this
    hang_s: float = 0.0  # mode "hang": operation k waits this long, then runs (a stuck disk)
    # mode "job": the folder in which each process of the job wrote its pid (``join_job``);
    # operation k kills them all, with every process they started, as a launcher ends a job
    job: str | None = None
    # each counted operation first sleeps up to this many seconds (a seeded draw per point), so
    # that the background threads' operations interleave with the caller's in other orders
    jitter: float = 0.0
    seed: int = 0


PLAN = Plan()
_rng = random.Random()
_lock = threading.Lock()
ARM_ENV = "DCPDS_CRASHSIM_ARM"  # read by ``tests/crashsim_site/sitecustomize.py``


_armed_at = [0]  # the plan file's mtime when last taken


def _take_armed() -> None:
    """Take the plan written to ``PLAN.arm`` whenever it is written anew (under ``_lock``):
    the first one starts the count; a later one (say, mode "off") changes only the plan."""
    if PLAN.arm is None:
        return
    try:
        at = os.stat(PLAN.arm).st_mtime_ns
    except FileNotFoundError:
        return
    if at == _armed_at[0]:
        return
    with open(PLAN.arm) as f:
        spec = json.load(f)
    if not _armed_at[0]:
        PLAN.log.clear()
    _armed_at[0] = at
    PLAN.mode, PLAN.k, PLAN.err, PLAN.log_file = spec["mode"], spec["k"], spec["err"], spec["log_file"]
    PLAN.match = spec.get("match")
    PLAN.hang_s = spec.get("hang_s", 0.0)
    PLAN.job = spec.get("job")


def arm(path: str, mode: str, k: int, log_file: str, err: str = "EIO", match: str | None = None,
        hang_s: float = 0.0, job: str | None = None) -> None:
    """Write the plan an armed process takes at its next storage operation (atomically)."""
    if os.path.exists(path):  # a new plan: a new modification time, whatever the clock's step
        time.sleep(0.01)
    with open(path + ".tmp", "w") as f:
        json.dump({"mode": mode, "k": k, "err": err, "log_file": log_file, "match": match, "hang_s": hang_s,
                   "job": job}, f)
    os.replace(path + ".tmp", path)


def wrap_spawned(plan: str) -> None:
    """Every Python process this one starts from now on (a replica helper, DCP's checkpoint
    process) wraps its local tiers at its start and takes the plan written to ``plan``
    (``arm``): ``tests/crashsim_site`` goes first on their ``PYTHONPATH``."""
    tests = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(tests, "crashsim_site"), os.path.dirname(tests)])
    os.environ[ARM_ENV] = plan


def end_children() -> None:
    """Kill the processes this one started, as a launcher ends a whole job: DCP's checkpoint
    process (or a replica helper) would otherwise outlive a rank that leaves by ``os._exit``
    a while, holding its claims."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join()


def install_armed(path: str) -> None:
    """In a process started by the library (a replica helper): wrap its local tiers, counting
    nothing until the plan appears at ``path``."""
    install()
    PLAN.arm = path


def _op(name: str, path: str, remote: bool = False) -> int:
    """Count one operation; fail it where the plan says (before it runs)."""
    if PLAN.thread is not None and threading.current_thread().name != PLAN.thread:
        return 0  # not counted: never a crash or fault point
    with _lock:
        _take_armed()
        line = f"{name} {os.path.basename(path)}" + (REMOTE_MARK if remote else "")
        if PLAN.match is not None and not line.startswith(PLAN.match):
            return 0
        PLAN.log.append(line)
        k = len(PLAN.log)
        if PLAN.log_file is not None:
            with open(PLAN.log_file, "a") as f:
                f.write(PLAN.log[-1] + "\n")
        pause = _rng.random() * PLAN.jitter
    if pause:
        time.sleep(pause)
    if PLAN.mode == "hang" and k == PLAN.k:
        time.sleep(PLAN.hang_s)
    if PLAN.mode == "fault" and k == PLAN.k and PLAN.err != "after" and (PLAN.err == "EIO" or name in WRITES):
        code = errno.EIO if PLAN.err == "EIO" else errno.ENOSPC
        raise OSError(code, f"injected {os.strerror(code)} at operation {k} ({name} {path})")
    return k


def plan_for(mode: str) -> tuple[str, str]:
    """The plan's mode and error for a multi-rank test's mode: "after" is a fault whose
    operation took effect before its caller is told EIO (``AMBIGUOUS``)."""
    return ("fault", "after") if mode == "after" else (mode, "EIO")


def is_point(mode: str, op: str) -> bool:
    """Whether recorded operation ``op`` is a point of a test's ``mode`` ("after": only one that
    can fail after it took effect; at another it would be no fault at all)."""
    return mode != "after" or op.split()[0] in AMBIGUOUS


def _after(k: int) -> None:
    if PLAN.mode == "crash" and k == PLAN.k:
        os._exit(CRASHED)
    if PLAN.mode == "fault" and k == PLAN.k and PLAN.err == "after":
        # the operation took effect, and its caller is told it failed: a network file system's
        # retried rename or unlink, a directory sync failing after the rename
        raise OSError(errno.EIO, f"injected EIO after operation {k} took effect")
    if PLAN.mode == "job" and k == PLAN.k:
        assert PLAN.job is not None
        kill_job(PLAN.job)


def join_job(folder: str) -> None:
    """Write this process's pid into ``folder``: a process of the job ``kill_job`` ends."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, str(os.getpid())), "w") as f:
        f.write("")


def kill_job(folder: str) -> None:
    """SIGKILL every process that wrote its pid into ``folder`` and every process they
    started (DCP's checkpoint process, a replica helper), then die: every rank of a job ends
    at once wherever it is, and none of them gets to clean up after its save."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, me = [int(n) for n in os.listdir(folder)], os.getpid()
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os._exit(CRASHED)


def _short(k: int, name: str) -> bool:
    return PLAN.mode == "fault" and k == PLAN.k and PLAN.err == "short" and name in WRITES


class RecSink(Sink):
    def __init__(self, inner: Sink, remote: bool = False) -> None:
        self.inner, self.name, self.remote = inner, inner.name, remote

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def reserve(self, nbytes: int) -> int:
        return self.inner.reserve(nbytes)

    def pwrite(self, buf, offset: int, **kw) -> None:
        k = _op("pwrite", self.name, self.remote)
        if _short(k, "pwrite"):
            if not getattr(self.inner, "o_direct", False):
                half = memoryview(buf).cast("B")[: memoryview(buf).nbytes // 2]
                self.inner.pwrite(half, offset)
            raise OSError(errno.ENOSPC, f"injected short write at operation {k}")
        self.inner.pwrite(buf, offset, **kw)
        _after(k)

    def close(self, sync: bool = True) -> int:
        k = _op("close", self.name, self.remote)
        out = self.inner.close(sync)
        _after(k)
        return out

    def abort(self) -> None:
        k = _op("abort", self.name, self.remote)
        self.inner.abort()
        _after(k)


class RecLock(HeldLock):
    def __init__(self, inner: HeldLock, path: str) -> None:
        self.inner, self.path = inner, path

    def size(self) -> int:
        return self.inner.size()

    def read(self) -> bytes:
        return self.inner.read()

    def still_named(self) -> bool:
        return self.inner.still_named()

    def write(self, data: bytes) -> None:
        k = _op("lock-write", self.path)
        self.inner.write(data)
        _after(k)

    def unlock(self, *, unlink: bool) -> None:
        if not unlink:
            return self.inner.unlock(unlink=False)
        try:
            k = _op("unlock", self.path)
        except OSError:
            self.inner.unlock(unlink=False)  # the unlink failed; the lock goes anyway
            raise
        self.inner.unlock(unlink=True)
        _after(k)


class RecBackend(Backend):
    """A ``LocalBackend`` whose every mutating operation is counted, and crashed or failed
    where the plan says."""

    local = True

    def __init__(self) -> None:
        self.inner = LocalBackend()

    def join(self, root, name):
        return self.inner.join(root, name)

    def exists(self, path):
        return self.inner.exists(path)

    def size(self, path):
        return self.inner.size(path)

    def entries(self, root):
        return self.inner.entries(root)

    def is_real_dir(self, root):
        return self.inner.is_real_dir(root)

    def listdir(self, root):
        return self.inner.listdir(root)

    def read_file(self, path, max_bytes, refuse, url):
        return self.inner.read_file(path, max_bytes, refuse, url)

    def read_into(self, path, offset, mv, fd, url):
        return self.inner.read_into(path, offset, mv, fd, url)

    def lock_held(self, path):
        return self.inner.lock_held(path)

    def makedirs(self, root):
        if os.path.isdir(root):
            return
        k = _op("mkdir", root)
        self.inner.makedirs(root)
        _after(k)

    def open_sink(self, path, name, *, o_direct, drop_cache):
        k = _op("create", path)
        out = RecSink(self.inner.open_sink(path, name, o_direct=o_direct, drop_cache=drop_cache))
        _after(k)
        return out

    def commit(self, root, path, tmp_name, data, *, sync):
        k = _op("commit", path)
        if PLAN.mode == "crash-mid" and k == PLAN.k:  # the temp file is durable, not renamed
            with open(os.path.join(root, tmp_name), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os._exit(CRASHED)
        if _short(k, "commit"):
            with open(os.path.join(root, tmp_name), "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, f"injected short write at operation {k}")
        self.inner.commit(root, path, tmp_name, data, sync=sync)
        _after(k)

    def rename(self, root, tmp_path, path):
        k = _op("rename", path)
        self.inner.rename(root, tmp_path, path)
        _after(k)

    def sync_dir(self, root):
        k = _op("fsync-dir", root)
        self.inner.sync_dir(root)
        _after(k)

    def remove(self, path):
        k = _op("unlink", path)
        self.inner.remove(path)
        _after(k)

    def remove_dir(self, root):
        k = _op("rmdir", root)
        self.inner.remove_dir(root)
        _after(k)

    def copy_local(self, src_path, path, tmp_name, size, *, pace, piece):
        k = _op("copy", path)
        if _short(k, "copy"):
            raise OSError(errno.ENOSPC, f"injected short write at operation {k}")
        self.inner.copy_local(src_path, path, tmp_name, size, pace=pace, piece=piece)
        _after(k)

    def try_lock(self, path, *, shared=False):
        k = _op("lock", path)
        held = self.inner.try_lock(path, shared=shared)
        _after(k)
        return None if held is None else RecLock(held, path)

    def create_exclusive(self, path, data):
        k = _op("create-excl", path)
        out = self.inner.create_exclusive(path, data)
        _after(k)
        return out


class RecFsspecBackend(FsspecBackend):
    """An ``FsspecBackend`` (an object-store tier) whose every mutating operation is counted,
    and crashed or failed where the plan says.  Making a directory and syncing one are nothing
    on an object store, so they are not operations; a commit is one PUT, whole or absent, so it
    has no point between a temporary file and its rename, and a short commit writes nothing."""

    def open_sink(self, path, name, *, o_direct, drop_cache):
        k = _op("create", path, remote=True)
        out = RecSink(super().open_sink(path, name, o_direct=o_direct, drop_cache=drop_cache), remote=True)
        _after(k)
        return out

    def commit(self, root, path, tmp_name, data, *, sync):
        k = _op("commit", path, remote=True)
        if _short(k, "commit"):
            raise OSError(errno.ENOSPC, f"injected short write at operation {k}")
        super().commit(root, path, tmp_name, data, sync=sync)
        _after(k)

    def rename(self, root, tmp_path, path):
        k = _op("rename", path, remote=True)
        super().rename(root, tmp_path, path)
        _after(k)

    def remove(self, path):
        k = _op("unlink", path, remote=True)
        super().remove(path)
        _after(k)

    def remove_dir(self, root):
        k = _op("rmdir", root, remote=True)
        super().remove_dir(root)
        _after(k)

    def create_exclusive(self, path, data):
        k = _op("create-excl", path, remote=True)
        out = super().create_exclusive(path, data)
        _after(k)
        return out


def ranks_at_point(world: int, fn, *args) -> list[int]:
    """Run ``fn`` on ``world`` gloo ranks (``tests.dist.run_ranks``); the exit codes of those
    that died at the point (``CRASHED``, or SIGKILL with the job).  Any other failure raises."""
    try:
        run_ranks(world, fn, *args, timeout=180)
    except AssertionError as e:
        said = str(e).strip().splitlines()[-1]
        if not said.startswith("ranks exited with codes "):
            raise
        codes = json.loads(said.removeprefix("ranks exited with codes "))
        if not set(codes) <= {CRASHED, -signal.SIGKILL}:
            raise
        return codes
    return []


def install() -> None:
    """Every tier made from now on, local or on an object store, goes through a recording wrapper."""
    storage_mod.LocalBackend = RecBackend  # type: ignore[misc]
    storage_mod.FsspecBackend = RecFsspecBackend  # type: ignore[misc]
