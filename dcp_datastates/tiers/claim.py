"""One writer per checkpoint directory: the claim file.

Before a save writes anything into a directory it creates the claim (``.claim``; with
``use_collectives=False`` one per rank, ``.claim.rank-NNNNN``) with an exclusive create that
carries its save id, host, process and start time.  A second save that finds a live claim
fails with :class:`CheckpointBusyError` and touches nothing.  The claim goes when the save
has committed and tidied up, or has failed.

A claim left by a crash is *stale* and is taken over:

* its process is gone (same host), or was restarted under the same pid;
* it belongs to this very process but to no save still in flight here;
* it comes from another host and is older than ``ttl_s`` (a host cannot see another's
  processes; raise the TTL above your longest save, or remove the file by hand).

Taking over renames the stale claim aside (atomic: of two contenders one wins), then claims
afresh.  The save ids of the attempts taken over are kept: their files, named with that id,
belong to no committed checkpoint and are removed once the new save commits.

On object stores an exclusive create is not available everywhere: the claim is written after
an existence check and read back, which narrows the race to a small window but cannot close
it.  Local and network file systems get the exclusive create.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
import threading
import time

import msgpack

from ..errors import CheckpointBusyError, CheckpointError
from ..format.names import CLAIM_NAME, RANK_CLAIM_PREFIX, TEMP_INFIX
from ..format.values import pack_plain
from .storage import StorageTier

log = logging.getLogger(__name__)

DEFAULT_TTL_S = float(os.environ.get("DCP_DATASTATES_CLAIM_TTL_S", 6 * 3600))
_MAX_CLAIM_BYTES = 4096
_UNREADABLE_GRACE_S = 30.0  # a claim still being written by its creator

_live_lock = threading.Lock()
# Process-wide on purpose: a claim found on disk is live when any save of this process holds it.
# save ids of this process that hold claims -> [claims held, event set when the last goes,
# callable telling whether that save still has work in flight]
_live: dict[str, list] = {}


def _hold(save_id: str, busy) -> None:
    with _live_lock:
        entry = _live.setdefault(save_id, [0, threading.Event(), busy])
        entry[0] += 1
        entry[2] = busy


def _drop(save_id: str) -> None:
    with _live_lock:
        entry = _live.get(save_id)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del _live[save_id]
            entry[1].set()


@dataclasses.dataclass(frozen=True)
class ClaimRecord:
    save_id: str
    host: str
    pid: int
    started: int  # the process's start time (/proc), 0 where unknown
    created_unix: float

    def to_bytes(self) -> bytes:
        return pack_plain(dataclasses.asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> "ClaimRecord | None":
        try:
            d = msgpack.unpackb(data, raw=False, max_map_len=16, max_str_len=256, max_array_len=0)
            rec = cls(str(d["save_id"]), str(d["host"]), int(d["pid"]), int(d["started"]),
                      float(d["created_unix"]))
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
            log.debug("unreadable claim record (%s)", e)
            return None
        return rec


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
    """Whether process ``pid`` (started at ``started``, 0: unknown) still runs.  A zombie (it
    exited, and nobody reaped it: a killed checkpoint process, under a parent or an init that
    does not reap) runs no more, though ``kill(pid, 0)`` still finds it."""
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


def _this_record(save_id: str) -> ClaimRecord:
    pid = os.getpid()
    return ClaimRecord(save_id, socket.gethostname(), pid, _process_start(pid), time.time())


@dataclasses.dataclass
class Claim:
    """A held claim on ``tier``; ``took_over`` lists the save ids of stale claims replaced."""
    tier: StorageTier
    name: str
    record: ClaimRecord
    took_over: list[str]
    released: bool = False

    def release(self) -> None:
        """Remove the claim if it is still ours (idempotent)."""
        if self.released:
            return
        self.released = True
        try:
            cur = _read(self.tier, self.name)
            if cur is not None and cur.save_id == self.record.save_id:
                self.tier.remove(self.name)
        except (OSError, CheckpointError) as e:
            log.warning("could not release the claim %s/%s (%s); the next save takes it over",
                        self.tier.url, self.name, e)
        finally:
            _drop(self.record.save_id)


def _read(tier: StorageTier, name: str) -> ClaimRecord | None:
    return ClaimRecord.from_bytes(tier.read_bytes(name, max_bytes=_MAX_CLAIM_BYTES))


def _create(tier: StorageTier, name: str, rec: ClaimRecord) -> bool:
    """Exclusive create; False if the claim exists."""
    data = rec.to_bytes()
    if tier.local:
        try:
            fd = os.open(tier.path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        tier.sync_dir()
        return True
    if tier.exists(name):
        return False
    tier.fs.pipe_file(tier.path(name), data)
    back = _read(tier, name)
    return back is not None and back.save_id == rec.save_id


def _stale_reason(tier: StorageTier, name: str, rec: ClaimRecord | None, ttl_s: float) -> str | None:
    me = socket.gethostname()
    if rec is None:
        try:
            age = time.time() - (os.lstat(tier.path(name)).st_mtime if tier.local else 0.0)
        except FileNotFoundError:
            return "gone"
        return "unreadable" if age > _UNREADABLE_GRACE_S else None
    if rec.host == me:
        if rec.pid == os.getpid() and rec.started in (0, _process_start(rec.pid)):
            with _live_lock:
                entry = _live.get(rec.save_id)
            if entry is None or not entry[2]():
                return "left by an earlier save of this process that no longer runs"
            return None
        if not _alive(rec.pid, rec.started):
            return f"its process {rec.pid} is gone"
        return None
    if time.time() - rec.created_unix > ttl_s:
        return f"older than {ttl_s:.0f} s (from host {rec.host})"
    return None


def _always() -> bool:
    return True


def acquire(tier: StorageTier, name: str, save_id: str, *, ttl_s: float = DEFAULT_TTL_S,
            wait_own_s: float = 600.0, busy=_always) -> Claim:
    """Claim ``tier`` for save ``save_id``, or raise :class:`CheckpointBusyError`.

    ``busy()`` tells whether this save still has work in flight; a claim of this process whose
    save is no longer busy (DCP failed the save on another rank, say) is stale.  A claim held
    by a busy save of this same process (a re-save while the previous save of this directory
    is still flushing) is waited for, up to ``wait_own_s``."""
    tier.makedirs()
    rec = _this_record(save_id)
    _hold(save_id, busy)
    took_over: list[str] = []
    try:
        for _ in range(8):
            if _create(tier, name, rec):
                return Claim(tier, name, rec, took_over)
            try:
                cur = _read(tier, name)
            except FileNotFoundError:
                continue  # released meanwhile
            except CheckpointError as e:  # a link, a FIFO, a huge file: not ours to touch
                raise CheckpointBusyError(f"the claim file is unusable ({e}); remove it by hand",
                                          checkpoint=tier.url, file=name) from None
            if cur is not None and cur.save_id == save_id:
                return Claim(tier, name, rec, took_over)  # already ours (a retried step)
            if cur is not None and cur.host == rec.host and cur.pid == rec.pid:
                with _live_lock:
                    entry = _live.get(cur.save_id)
                ev = None if entry is None or not entry[2]() else entry[1]
                if ev is not None:
                    log.info("%s is being saved by an earlier save of this process (%s); waiting "
                             "for it to finish", tier.url, cur.save_id)
                    if not ev.wait(wait_own_s):
                        raise CheckpointBusyError(
                            f"an earlier save ({cur.save_id}) of this process still holds the "
                            f"directory after {wait_own_s:.0f} s", checkpoint=tier.url, file=name)
                    continue
            why = _stale_reason(tier, name, cur, ttl_s)
            if why is None:
                who = "unknown" if cur is None else f"save {cur.save_id}, host {cur.host}, pid {cur.pid}"
                raise CheckpointBusyError(
                    f"another save is writing this checkpoint ({who}); wait for it, save elsewhere, "
                    f"or remove {name} if that save is dead", checkpoint=tier.url, file=name)
            if _take_over(tier, name, save_id):
                log.info("took over the stale claim of %s (%s)", tier.url, why)
                if cur is not None:
                    took_over.append(cur.save_id)
        raise CheckpointBusyError("could not claim the directory (contended)", checkpoint=tier.url,
                                  file=name)
    except BaseException:
        _drop(save_id)
        raise


def _take_over(tier: StorageTier, name: str, save_id: str) -> bool:
    aside = f"{name}.stale-{save_id}"
    try:
        if tier.local:
            os.rename(tier.path(name), tier.path(aside))
            os.unlink(tier.path(aside))
        else:
            tier.remove(name)
        return True
    except OSError as e:
        if e.errno == errno.ENOENT:
            return False  # another contender moved it first
        raise


def claimed(tier: StorageTier) -> bool:
    """Whether any save, collective or per-rank, holds a live claim on ``tier`` (retention and
    tidy-ups leave such a directory alone)."""
    return any(holds_live_claim(tier, n) for n in tier.listdir()
               if n == CLAIM_NAME or (n.startswith(RANK_CLAIM_PREFIX) and TEMP_INFIX not in n))


def holds_live_claim(tier: StorageTier, name: str) -> bool:
    """Whether ``tier`` is claimed as ``name`` by a save that is not stale."""
    try:
        cur = _read(tier, name)
    except FileNotFoundError:
        return False
    except CheckpointError:
        return True
    return _stale_reason(tier, name, cur, DEFAULT_TTL_S) is None


__all__ = ["Claim", "ClaimRecord", "acquire", "claimed", "holds_live_claim"]
