"""The one way a manifest is committed.

A step is loadable from a directory once a manifest (``.metadata``, or a rank's own
``.manifest.rank-*``) is there, so committing one is the act every other guarantee rests on.
Every route that does it goes through :func:`commit_manifest`: a save's first tier, a slower
tier, a node's copy committed by replication and a node's copy placed by a restore's repair.
``StorageTier`` refuses to write a file of a manifest's name any other way.

A commit names the save whose manifest it is (the bytes must say the same) and the authority
it acts on:

- :class:`ByClaim`: the save holds the directory's claim; the commit goes ahead only while
  the claim still names this save (``fence``, checked just before the rename) and then
  replaces whatever manifest is there, as the claim's owner may.
- :class:`ByDecision`: a save decided elsewhere (committed by its coordinator under its claim,
  or agreed on by every rank of a load); it replaces a manifest of another save, and writes
  nothing where the directory already holds this save's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CheckpointError, StorageFailedError
from ..format.names import MANIFEST_NAME, TEMP_INFIX, is_manifest_name
from .local import temp_name
from .manifests import head_of, manifest_head
from .storage import StorageTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ByClaim:
    """The committing save holds the directory's claim: ``fence()`` raises where it lost it."""

    fence: Callable[[], None]


@dataclass(frozen=True)
class ByDecision:
    """A save decided elsewhere; ``why`` says by whom, for the log."""

    why: str


Authority = ByClaim | ByDecision


def commit_manifest(tier: StorageTier, body: bytes, save_id: str, by: Authority, *,
                    name: str = MANIFEST_NAME, sync: bool = True) -> bool:
    """Commit manifest ``body`` of save ``save_id`` as ``name`` in ``tier`` on authority ``by``
    (temp file, fsync, rename; one PUT on an object store).  False where nothing was written
    (a decision whose save the directory already holds).  A failure of the storage raises
    ``StorageFailedError`` naming the tier and the file."""
    if not is_manifest_name(name):
        raise ValueError(f"{name!r} is not a manifest's name")
    head = head_of(body)
    if head is None or head.save_id != save_id:
        raise CheckpointError(f"refusing to commit a manifest of save {head.save_id if head else '?'} "
                              f"as save {save_id}", checkpoint=tier.url, file=name)
    if isinstance(by, ByDecision):
        here = manifest_head(tier) if name == MANIFEST_NAME else None
        if here is not None and here.save_id == save_id:
            return False
        if here is not None:
            log.info("%s: the manifest of save %s replaces save %s's (%s)", tier.url, save_id, here.save_id, by.why)
    else:
        by.fence()
    try:
        tier.backend.commit(tier.root, tier.path(name), temp_name(name, TEMP_INFIX), body, sync=sync)
    except StorageFailedError:
        raise
    except OSError as e:  # a full disk, say: the error names the tier and the file
        raise StorageFailedError.of(e, "committing the manifest", checkpoint=tier.url, file=name) from e
    return True


__all__ = ["Authority", "ByClaim", "ByDecision", "commit_manifest"]
