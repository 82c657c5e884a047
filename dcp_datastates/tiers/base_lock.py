"""Who may remove a step's files while a save references them: the base lock.

An incremental save reads its base's manifest when each rank plans, and references the base's
files (and the files the base itself references in older steps) from then on; its own manifest
names them only once it commits, and its claim, which names the base, exists only from the
global plan.  A re-save of the base that tidies, or a retention pass that purges it, in that
window would remove bytes the save then commits references to.  So the rule, kept here and
used by every path that removes a committed save's files (``tidy.py``, ``retention.py``):

* **Removing.**  Files are removed from a step directory only under its base lock
  (``.base-lock``) held *exclusive*, and only after reading, under it, first the run's live
  claims, then its committed manifests.
* **Referencing.**  A save holds the base lock *shared* on every directory it may reference,
  taken before it reads what is there, and held until the manifest naming what it references
  is committed in the directory the references live in.  The coordinator holds it to its
  commit.  Another rank references only the base the coordinator read (the same save:
  ``RankSave.agree_base``); where it shares the coordinator's directory it lets go when its
  part of the save is over (the coordinator's locks and claim cover the same directories to
  the commit); where its node has a directory of its own (``replicas``, ``Checkpointer(
  node_local=True)``) the locks are let go by whoever commits the manifest on that node, once
  it did (``Replicator``, ``NodeCopies.hold_base``).

* **Replicating.**  A purge (retention) also holds the step's replica lock (``.replica-lock``)
  exclusive; every rank replicating the step holds it shared from the step's commit on its node
  until its replication ends (``Replicator.submit``), so no rank of the node purges a step
  another still sends or receives.  Replacing a save (``tidy``) does not take it: the
  replaced save's replication is then cut short, as a superseded save's is.

So a removal either comes before the save's reads (which then see what is left) or after its
claim exists and then its commit (which protect what it references).  Nobody waits: the kernel
lock is tried, not queued for.  A save that finds a removal under way writes in full; a removal
that finds a save reading spares those files, and the next save or retention pass there
removes them.  The kernel drops the locks of a process that dies.  Where the filesystem keeps
no locks (object stores) the claim's base record is all there is (``docs/design.md``).  A
directory holding another format's checkpoint (DCP's own) gets no lock file: nothing of ours
references it, and nothing of ours removes from it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from ..errors import CheckpointError
from ..format.names import BASE_LOCK
from .backend import HeldLock, LockUnsupported
from .manifests import manifest_is_ours
from .storage import StorageTier

log = logging.getLogger(__name__)

_TRIES = 5  # a removal holds the lock for milliseconds: a few tries before writing in full
_PAUSE_S = 0.02


class BaseHold:
    """The shared base locks one rank's save holds on the directories it may reference (or,
    with ``name=REPLICA_LOCK``, the replica locks a rank holds on the steps it replicates)."""

    def __init__(self, name: str = BASE_LOCK) -> None:
        self.name = name
        self._held: dict[str, HeldLock] = {}
        self._lock = threading.Lock()  # uploads to several slower tiers take locks at once

    def take(self, tier: StorageTier) -> bool:
        """Hold ``tier``'s base lock shared (at once where held already).  False where a removal
        holds it now, or it cannot be taken (the directory is gone): reference nothing there.
        True without a lock where the filesystem keeps none or the directory is read-only."""
        with self._lock:
            if tier.url in self._held:
                return True
        if _foreign(tier):
            return True
        path = tier.path(self.name)
        for attempt in range(_TRIES):
            try:
                held = tier.backend.try_lock(path, shared=True)
            except LockUnsupported:
                return True
            except (PermissionError, FileNotFoundError) as e:
                # read-only: nobody removes from it either; gone: nothing there to reference
                return isinstance(e, PermissionError)
            except OSError as e:
                log.warning("cannot hold %s's base lock (%s); referencing nothing there", tier.url, e)
                return False
            if held is not None:
                with self._lock:
                    extra = self._held.setdefault(tier.url, held) is not held
                if extra:  # another thread took it meanwhile
                    held.unlock(unlink=False)
                return True
            if attempt + 1 < _TRIES:
                time.sleep(_PAUSE_S)
        return False

    def release(self) -> None:
        """Let every lock go (idempotent)."""
        with self._lock:
            held, self._held = self._held, {}
        for lock in held.values():
            try:
                lock.unlock(unlink=False)
            except OSError as e:  # the descriptor is closed whatever happens: the lock went with it
                log.debug("letting a base lock go: %s", e)


@contextlib.contextmanager
def removing(tier: StorageTier, name: str = BASE_LOCK) -> Iterator[bool]:
    """Hold ``tier``'s base lock (or lock ``name``) exclusive while removing from it.  Yields False where a save
    holds it shared now (it may reference any committed file there: remove none of them this
    time); True where held, and where the filesystem keeps no locks or the directory holds
    another format's checkpoint (which no removal of ours touches)."""
    if _foreign(tier):
        yield True
        return
    try:
        held = tier.backend.try_lock(tier.path(name))
    except (LockUnsupported, FileNotFoundError):  # no locks kept; or no directory, nothing in it
        yield True
        return
    except OSError as e:
        log.warning("cannot hold %s's base lock (%s); removing none of its committed files", tier.url, e)
        yield False
        return
    try:
        yield held is not None
    finally:
        if held is not None:
            held.unlock(unlink=False)


def _foreign(tier: StorageTier) -> bool:
    """Whether ``tier`` holds another format's checkpoint (a lock file there would be ours in
    someone else's directory)."""
    try:
        return manifest_is_ours(tier) is False
    except (OSError, CheckpointError):
        return False  # unreadable: lock it as ours, the safe side


__all__ = ["BaseHold", "removing"]
