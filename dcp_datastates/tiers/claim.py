"""One writer per checkpoint directory: the claim file.

Before a save writes anything into a directory it claims it: the claim file (``.claim``; with
``use_collectives=False`` one per rank, ``.claim.rank-NNNNN``) records its save id, host and
process.  A second save that finds a live claim fails with :class:`CheckpointBusyError` and
touches nothing.  The claim goes when the save has committed and tidied up, or has failed.

**Liveness comes from the kernel** where the filesystem keeps locks (local disks, NFS, Lustre
mounted with ``flock``).  The save holds an exclusive lock on its open claim file for its whole
life, and the kernel drops it when the process ends, however it ends (SIGKILL, the OOM killer,
a zombie nobody reaps).  A claim file whose lock can be taken is stale, whatever its record
says; taking the lock is the takeover, one atomic step with no window between reading and
replacing.  Pids and host names decide nothing, so containers that share a host name, other
pid namespaces and a job requeued on another node are all told right.

**Where no lock is kept** (object stores, mounts without locks) the claim is a lease: it is
created exclusively (S3's conditional create where fsspec offers it), its holder renews it
every ``lease_s / 5``, and it is stale once not renewed for ``lease_s`` (default 600 s,
``DCP_DATASTATES_CLAIM_LEASE_S``), or at once where its record names a process of this very
kernel and pid namespace that no longer runs.

**The fence.**  Either way a save checks, as the last step before it commits a manifest and
before it removes any file, that the claim still names its save id (:meth:`Claim.fence`), and
fails with :class:`ClaimLostError` otherwise.  A save that lost its claim (removed by hand; a
lease that lapsed while the process was stopped) never commits and never deletes.

The save ids of the attempts taken over are kept (``Claim.took_over``): their files, named
with that id, belong to no committed checkpoint and are removed once the new save commits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable

import msgpack

from .. import process_state
from ..errors import CheckpointBusyError, CheckpointError, ClaimLostError
from ..format.names import CLAIM_NAME, RANK_CLAIM_PREFIX, TEMP_INFIX
from ..format.values import pack_plain
from .backend import HeldLock, LockUnsupported
from .storage import StorageTier

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = float(os.environ.get("DCP_DATASTATES_CLAIM_LEASE_S", 600))
_MAX_CLAIM_BYTES = 4096
_UNREADABLE_GRACE_S = 30.0  # a lease claim still being written by its creator
_PROBE_RETRIES = 5  # a lock held for a moment by another process's liveness probe
_MAX_INHERITED = 64  # attempts a claim carries over (each one a save that died or failed here)


def _namespace() -> str:
    """This kernel's boot and this process's pid namespace: two records with the same one can
    compare pids; any other pair cannot (containers sharing a host name have other ones)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


_NAMESPACE = _namespace()


@dataclasses.dataclass(frozen=True)
class ClaimRecord:
    save_id: str
    host: str
    pid: int
    started: int  # the process's start time (/proc), 0 where unknown
    created_unix: float  # when written or last renewed
    namespace: str = ""  # see _namespace; "" where unknown
    inherits: tuple[str, ...] = ()  # the attempts this save took over, whose files it removes
    base: str = ""  # the sibling step an incremental save references (retention keeps it)

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(self)
        d["inherits"] = list(self.inherits)
        return pack_plain(d)

    @classmethod
    def from_bytes(cls, data: bytes) -> "ClaimRecord | None":
        try:
            d = msgpack.unpackb(data, raw=False, max_map_len=16, max_str_len=256, max_array_len=_MAX_INHERITED)
            return cls(str(d["save_id"]), str(d["host"]), int(d["pid"]), int(d["started"]),
                       float(d["created_unix"]), str(d.get("namespace", "")),
                       tuple(str(s) for s in d.get("inherits", ())), str(d.get("base", "")))
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as e:
            log.debug("unreadable claim record (%s)", e)
            return None

    def who(self) -> str:
        return f"save {self.save_id}, host {self.host}, pid {self.pid}"

    def attempts(self) -> list[str]:
        """The save ids whose files belong to whoever takes this claim over."""
        return [self.save_id, *self.inherits]


def _proc_stat(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name (empty where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return []


def _process_start(pid: int) -> int:
    try:
        return int(_proc_stat(pid)[19])
    except (ValueError, IndexError):
        return 0


def _alive(pid: int, started: int) -> bool:
    """Whether process ``pid`` (started at ``started``, 0: unknown) of this pid namespace still
    runs; a zombie runs no more, though ``kill(pid, 0)`` still finds it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    if fields[:1] in ([b"Z"], [b"X"]):
        return False
    return not started or _process_start(pid) in (0, started)


def _this_record(save_id: str, base: str = "") -> ClaimRecord:
    pid = os.getpid()
    return ClaimRecord(save_id, socket.gethostname(), pid, _process_start(pid), time.time(), _NAMESPACE,
                       base=base)


# ------------------------------------------------------- the claims this process holds
@dataclasses.dataclass
class _Holder:
    """A save of this process that holds claims.  Process-wide on purpose: a claim found on
    disk whose save id is here belongs to this process, live while the save is ``busy()``
    (work in flight) or ``running()`` (its commit and cleanup still to come): the same rule as
    for a claim of another process, whose lock lives until that process lets it go."""
    busy: Callable[[], bool]
    running: Callable[[], bool]
    claims: list["Claim"] = dataclasses.field(default_factory=list)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


_live_lock = threading.Lock()
_live: dict[str, _Holder] = {}


def _holder(save_id: str) -> _Holder | None:
    with _live_lock:
        return _live.get(save_id)


def _forget(claim: "Claim") -> None:
    with _live_lock:
        h = _live.get(claim.record.save_id)
        if h is None or claim not in h.claims:
            return
        h.claims.remove(claim)
        if not h.claims:
            del _live[claim.record.save_id]
            h.done.set()


class _Renewer:
    """Renews the lease claims of this process every ``period`` seconds (one thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._added = threading.Event()  # wakes the thread: a new claim's lease may be shorter

    def ensure(self) -> None:
        """Called once a lease claim is registered in ``_live``."""
        with self._lock:
            self._added.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dcp-datastates-lease", daemon=True)
                self._thread.start()

    @staticmethod
    def _leases() -> list["Claim"]:
        with _live_lock:
            return [c for h in _live.values() for c in h.claims if c.lock is None]

    def _run(self) -> None:
        while True:
            with self._lock:  # decided under the lock ``ensure`` takes: a claim added meanwhile is seen
                self._added.clear()
                leases = self._leases()
                if not leases:
                    self._thread = None
                    return
            for c in leases:
                c.renew()
            self._added.wait(max(0.05, min(c.lease_s for c in leases) / 5))


_renewer = _Renewer()


def _forget_claims_in_child() -> None:
    """A forked child holds none of its parent's claims: it never renews or lets go of them
    (their lock files' descriptors are closed in it: ``local._drop_locks_in_child``)."""
    global _live_lock, _renewer
    process_state.keep(dict(_live), _renewer)
    _live_lock, _renewer = threading.Lock(), _Renewer()
    _live.clear()


process_state.in_child(_forget_claims_in_child)


# ------------------------------------------------------------------- a claim
@dataclasses.dataclass(eq=False)
class Claim:
    """A held claim on ``tier``; ``took_over`` lists the save ids of stale claims replaced.
    ``lock`` is the kernel's lock on the claim file; ``None`` for a lease."""
    tier: StorageTier
    name: str
    record: ClaimRecord
    took_over: list[str]
    lock: HeldLock | None
    lease_s: float = DEFAULT_LEASE_S
    released: bool = False
    # a renewal (the renewer's thread) and the release exclude each other: a renewal that read
    # the record as ours before the release removed it would otherwise write it back
    _mutex: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def _names_us(self) -> bool:
        try:
            if self.lock is not None:
                cur = ClaimRecord.from_bytes(self.lock.read()) if self.lock.still_named() else None
            else:
                cur = _read(self.tier, self.name)
        except (OSError, CheckpointError) as e:
            log.warning("could not read the claim %s/%s back (%s)", self.tier.url, self.name, e)
            return False
        return cur is not None and cur.save_id == self.record.save_id

    def fence(self) -> None:
        """Raise :class:`ClaimLostError` unless the claim still names this save: the check
        before a manifest is committed and before any file is removed."""
        if self.released or not self._names_us():
            raise ClaimLostError(
                f"save {self.record.save_id} no longer holds this directory's claim (removed, "
                "or taken over after its lease lapsed); it commits nothing and removes nothing",
                checkpoint=self.tier.url, file=self.name)

    def carry(self, save_ids: list[str]) -> None:
        """Add to the record the saves this one will supersede once it commits: should it die
        between its commit and its tidy-up, whoever takes the claim over removes their files."""
        with self._mutex:  # not interleaved with a renewal, which writes the record it read
            new = [s for s in save_ids if s != self.record.save_id and s not in self.record.inherits]
            if not new:
                return
            self.record = dataclasses.replace(self.record,
                                              inherits=(*self.record.inherits, *new)[-_MAX_INHERITED:])
            self._store()

    def renew(self) -> None:
        """Lease claims: write the record again with the current time, while it is ours."""
        if self.lock is not None:
            return
        with self._mutex:
            if self.released:
                return
            try:
                if self._names_us():
                    self.record = dataclasses.replace(self.record, created_unix=time.time())
                    self._store()
            except (OSError, CheckpointError) as e:
                log.warning("could not renew the claim %s/%s (%s)", self.tier.url, self.name, e)

    def _store(self) -> None:
        """Write the record: in place under the lock, or as a whole new object (a lease)."""
        if self.lock is not None:
            self.lock.write(self.record.to_bytes())
        else:
            self.tier.commit_bytes(self.name, self.record.to_bytes())

    def release(self, *, keep_record: bool = False) -> None:
        """Let the claim go (idempotent), removing its file if it is still ours.  A save that
        failed keeps the record (``keep_record``): the next save here takes it over and removes
        this attempt's files, found by its save id, whatever this one could not."""
        with self._mutex:
            if self.released:
                return
            self.released = True
            try:
                if self.lock is not None:
                    self.lock.unlock(unlink=not keep_record)
                elif not keep_record:
                    cur = _read(self.tier, self.name)
                    if cur is not None and cur.save_id == self.record.save_id:
                        self.tier.remove(self.name)
            except (OSError, CheckpointError) as e:
                log.warning("could not release the claim %s/%s (%s); the next save takes it over",
                            self.tier.url, self.name, e)
            finally:
                _forget(self)


def release_idle(urls: Iterable[str] | None) -> None:
    """Let go the claims this process holds on ``urls`` (None: anywhere) for saves that no
    longer run, keeping their records (the next save there, or retention, removes those
    attempts' files).  For a caller that knows those saves failed (it saw their futures fail,
    or its process runs one save at a time and starts the next): DCP tells a writer nothing
    when a save fails on another rank, so the coordinator's claim would otherwise stay held
    until the process ends."""
    want = None if urls is None else set(urls)
    if want is not None and not want:
        return
    with _live_lock:
        holders = list(_live.values())
    for h in holders:
        if h.busy():
            continue
        for c in list(h.claims):
            if want is None or c.tier.url in want:
                log.info("releasing the claim of %s left by save %s of this process, which failed",
                         c.tier.url, c.record.save_id)
                c.release(keep_record=True)


def _read(tier: StorageTier, name: str) -> ClaimRecord | None:
    return ClaimRecord.from_bytes(tier.read_bytes(name, max_bytes=_MAX_CLAIM_BYTES))


def _lease_stale(tier: StorageTier, name: str, rec: ClaimRecord | None, lease_s: float) -> str | None:
    """Why a lease claim (no kernel lock) is stale, or None while it is live."""
    if rec is None:
        try:
            age = time.time() - (os.lstat(tier.path(name)).st_mtime if tier.local else 0.0)
        except FileNotFoundError:
            return "gone"
        return "unreadable" if age > _UNREADABLE_GRACE_S else None
    if rec.namespace and rec.namespace == _NAMESPACE:
        if rec.pid == os.getpid() and rec.started in (0, _process_start(rec.pid)):
            if _holder(rec.save_id) is None:
                return "left by an earlier save of this process that no longer runs"
        elif not _alive(rec.pid, rec.started):
            return f"its process {rec.pid} is gone"
    if time.time() - rec.created_unix > lease_s:
        return f"not renewed for {lease_s:.0f} s (from host {rec.host})"
    return None


def _always() -> bool:
    return True


class _Acquire:
    """One attempt to claim ``tier`` as ``name`` for ``save_id`` (see :func:`acquire`)."""

    def __init__(self, tier: StorageTier, name: str, save_id: str, lease_s: float,
                 wait_own_s: float, base: str = "") -> None:
        self.tier, self.name, self.path = tier, name, tier.path(name)
        self.rec = _this_record(save_id, base)
        self.lease_s, self.wait_own_s = lease_s, wait_own_s
        self.took_over: list[str] = []

    def ours_in_flight(self, cur: ClaimRecord | None) -> bool:
        """``cur`` belongs to another save of this process: wait for it if it still runs, else
        let it go (a save DCP abandoned).  True when the caller should try again."""
        h = None if cur is None else _holder(cur.save_id)
        if h is None or cur is None or cur.save_id == self.rec.save_id:
            return False
        if h.busy() or h.running():
            log.info("%s is being saved by another save of this process (%s); waiting for it "
                     "to finish", self.tier.url, cur.save_id)
            if not h.done.wait(self.wait_own_s):
                raise CheckpointBusyError(
                    f"an earlier save ({cur.save_id}) of this process still holds the directory "
                    f"after {self.wait_own_s:.0f} s", checkpoint=self.tier.url, file=self.name)
        else:
            log.info("releasing the claim of %s left by save %s of this process, which no "
                     "longer runs", self.tier.url, cur.save_id)
            for c in list(h.claims):
                if c.name == self.name and c.tier.url == self.tier.url:
                    c.release(keep_record=True)
        return True

    def busy(self, cur: ClaimRecord | None) -> CheckpointBusyError:
        who = "unknown" if cur is None else cur.who()
        return CheckpointBusyError(
            f"another save is writing this checkpoint ({who}); wait for it, or save elsewhere",
            checkpoint=self.tier.url, file=self.name)

    def unusable(self, why: str) -> CheckpointBusyError:
        return CheckpointBusyError(f"the claim file is unusable ({why}); remove it by hand",
                                   checkpoint=self.tier.url, file=self.name)

    def by_lock(self) -> Claim:
        """Claim under the kernel's lock (``LockUnsupported`` where there is none)."""
        for _ in range(8):
            lock = None
            for _ in range(_PROBE_RETRIES):
                lock = self.tier.backend.try_lock(self.path)
                if lock is not None:
                    break
                time.sleep(0.02)
            if lock is None:
                cur = self.current()
                if self.ours_in_flight(cur):
                    continue
                raise self.busy(cur)
            try:
                if lock.size() > _MAX_CLAIM_BYTES:
                    raise self.unusable(f"{lock.size()} bytes, over {_MAX_CLAIM_BYTES}")
                old = ClaimRecord.from_bytes(lock.read()) if lock.size() else None
                if old is not None and old.save_id != self.rec.save_id and _holder(old.save_id) is not None:
                    raise self.busy(old)  # a lock this process holds that the kernel did not see
                if old is not None and old.save_id != self.rec.save_id:
                    self.inherit(old)
                lock.write(self.rec.to_bytes())
            except BaseException:
                lock.unlock(unlink=False)
                raise
            if old is not None and old.save_id != self.rec.save_id:
                log.info("took over the stale claim of %s (%s: its lock was free)", self.tier.url, old.who())
            return Claim(self.tier, self.name, self.rec, self.took_over, lock)
        raise CheckpointBusyError("could not claim the directory (contended)",
                                  checkpoint=self.tier.url, file=self.name)

    def inherit(self, old: ClaimRecord) -> None:
        """Take over ``old``'s attempts: their files are this save's to remove once it commits,
        and, should it fail too, the next one's (the record carries them)."""
        for sid in old.attempts():
            if sid != self.rec.save_id and sid not in self.took_over:
                self.took_over.append(sid)
        del self.took_over[:-_MAX_INHERITED]
        self.rec = dataclasses.replace(self.rec, inherits=tuple(self.took_over))

    def current(self) -> ClaimRecord | None:
        try:
            return _read(self.tier, self.name)
        except FileNotFoundError:
            return None
        except CheckpointError as e:  # a link, a FIFO, a huge file: not ours to touch
            raise self.unusable(str(e)) from None

    def by_lease(self) -> Claim:
        """Claim as a lease: an exclusive create, renewed while the save runs."""
        for _ in range(8):
            if self.tier.backend.create_exclusive(self.path, self.rec.to_bytes()):
                return Claim(self.tier, self.name, self.rec, self.took_over, None, self.lease_s)
            try:
                cur = _read(self.tier, self.name)
            except FileNotFoundError:
                continue  # released meanwhile
            except CheckpointError as e:
                raise self.unusable(str(e)) from None
            if cur is not None and cur.save_id == self.rec.save_id:
                raise self.busy(cur)  # this very save already holds it
            if self.ours_in_flight(cur):
                continue
            why = _lease_stale(self.tier, self.name, cur, self.lease_s)
            if why is None:
                raise self.busy(cur)
            # Remove and create again.  Two contenders can both remove a stale lease, the second
            # one removing the first's fresh claim: the first one's fence then fails.
            self.tier.remove(self.name)
            log.info("took over the stale claim of %s (%s)", self.tier.url, why)
            if cur is not None:
                self.inherit(cur)
        raise CheckpointBusyError("could not claim the directory (contended)",
                                  checkpoint=self.tier.url, file=self.name)


def acquire(tier: StorageTier, name: str, save_id: str, *, lease_s: float = DEFAULT_LEASE_S,
            wait_own_s: float = 600.0, busy: Callable[[], bool] = _always,
            running: Callable[[], bool] = _always, base: str = "") -> Claim:
    """Claim ``tier`` for save ``save_id``, or raise :class:`CheckpointBusyError`.

    ``busy()`` tells whether this save still has work in flight, ``running()`` whether its
    commit and cleanup are still to come.  A claim held by another save of this same process
    that is either (a re-save while the previous save of this directory is still flushing, or
    a second writer while the first commits) is waited for, up to ``wait_own_s``; one whose
    save is neither (it failed, or DCP abandoned it) is let go.  ``base``: the sibling directory an
    incremental save references, which retention then leaves alone while the claim lives."""
    tier.makedirs()
    # the directory's name, durable whoever made it: one that made it and died before making
    # it durable (``makedirs``) left a step directory a power cut may still take
    tier.parent().sync_dir()
    attempt = _Acquire(tier, name, save_id, lease_s, wait_own_s, base)
    try:
        claim = attempt.by_lock()
    except LockUnsupported as e:
        log.debug("%s keeps no locks (%s): the claim is a lease", tier.url, e)
        claim = attempt.by_lease()
    with _live_lock:
        h = _live.setdefault(save_id, _Holder(busy, running))
        h.busy, h.running = busy, running
        h.claims.append(claim)
    if claim.lock is None:
        _renewer.ensure()
    return claim


def live_claims(tier: StorageTier, *, per_rank_only: bool = False) -> list[str]:
    """The claim files of ``tier`` (``.claim`` and ``.claim.rank-N``; only the latter with
    ``per_rank_only``) that a save holds live."""
    return [n for n in tier.listdir()
            if ((n == CLAIM_NAME and not per_rank_only) or (n.startswith(RANK_CLAIM_PREFIX) and TEMP_INFIX not in n))
            and holds_live_claim(tier, n)]


def claimed(tier: StorageTier) -> bool:
    """Whether any save, collective or per-rank, holds a live claim on ``tier`` (retention and
    tidy-ups leave such a directory alone)."""
    return bool(live_claims(tier))


@dataclasses.dataclass(frozen=True)
class BasesInFlight:
    """The step directories of a run that saves in flight there use as incremental bases."""

    names: frozenset[str]
    # live claims whose record could not be read (being written: a claim file exists before
    # its record, and a record rewritten in place is empty or cut short for a moment): their
    # save's base is unknown, so every step may be one
    unknown: tuple[str, ...] = ()

    def keeps(self, name: str) -> bool:
        """Whether step directory ``name`` may be the base of a save in flight."""
        return bool(self.unknown) or name in self.names


def bases_in_flight(run: StorageTier) -> BasesInFlight:
    """What the saves in flight in ``run`` use as incremental bases, found through their live
    claims (whatever wrote them)."""
    names: set[str] = set()
    unknown: list[str] = []
    for d, kind in run.entries():
        if kind != "dir":
            continue
        t = run.child(d)
        for n in live_claims(t):
            try:
                rec = _read(t, n)
            except FileNotFoundError:  # released between the listing and the read
                continue
            except (OSError, CheckpointError) as e:
                log.debug("the live claim %s/%s cannot be read (%s)", t.url, n, e)
                rec = None
            if rec is None:
                unknown.append(f"{t.url}/{n}")
            elif rec.base:
                names.add(rec.base)
    return BasesInFlight(frozenset(names), tuple(unknown))


def holds_live_claim(tier: StorageTier, name: str) -> bool:
    """Whether ``tier`` is claimed as ``name`` by a save that is not stale."""
    try:
        return tier.backend.lock_held(tier.path(name))
    except LockUnsupported:
        pass
    except CheckpointError:
        return True  # a link or a FIFO in its place: leave the directory alone
    try:
        cur = _read(tier, name)
    except FileNotFoundError:
        return False
    except CheckpointError:
        return True
    h = None if cur is None else _holder(cur.save_id)
    if h is not None:
        return h.busy() or h.running()
    return _lease_stale(tier, name, cur, DEFAULT_LEASE_S) is None


__all__ = ["BasesInFlight", "Claim", "ClaimRecord", "acquire", "bases_in_flight", "claimed", "holds_live_claim",
           "live_claims", "release_idle"]
