"""What one save owns on its tiers: the claims it holds, and what each commit may remove.

``SaveClaims`` claims the save's directory on every tier before anything is written
(``claim.py``), reads under those claims what the save will replace (``tidy.py``), and after
each tier commits removes what that tier's superseded manifest or a dead attempt owned, then
lets the claim go.  A save that fails lets every claim go at once.

``fence(url)`` is the check before every commit and every removal: it raises
:class:`ClaimLostError` unless this save still holds that tier's claim.
"""

from __future__ import annotations

import logging

from ..errors import CheckpointError, ClaimLostError
from ..format.model import Manifest
from ..format.names import CLAIM_NAME, rank_claim_name
from .claim import Claim, acquire
from .manifests import rank_saves
from .storage import StorageTier
from .tidy import Tidy, other_kind_superseded, rank_superseded, superseded_here

log = logging.getLogger(__name__)


class SaveClaims:
    """Claims and tidy-ups of one save (``rank`` set: per-rank manifests, one claim per rank)."""

    def __init__(self, save_id: str, *, rank: int | None, busy, running, base: str = "") -> None:
        self.save_id = save_id
        self.running = running
        self.base = base  # an incremental save's base directory name (kept while this claim lives)
        self.rank = rank
        self.busy = busy
        self._claims: dict[str, Claim] = {}
        self._tidies: dict[str, Tidy] = {}
        self.unclaimed: dict[str, Exception] = {}  # slower tiers it could not claim: not flushed to

    def acquire(self, tiers: list[StorageTier]) -> None:
        """Claim each tier's directory; the first tier must succeed.  A slower tier that cannot
        be reached does not fail the save (its flush reports the failure); a busy one does."""
        name = CLAIM_NAME if self.rank is None else rank_claim_name(self.rank)
        try:
            for i, t in enumerate(tiers):
                try:
                    c = acquire(t, name, self.save_id, busy=self.busy, running=self.running, base=self.base)
                except CheckpointError:
                    raise  # busy: another save holds it
                except Exception as e:  # fsspec backends raise their own types
                    if i == 0:
                        raise
                    log.warning("could not claim %s (%s); this save is not flushed there", t.url, e)
                    self.unclaimed[t.url] = e
                    continue
                self._claims[t.url] = c
                old = superseded_here(t, rank=self.rank)
                c.carry([m.save_id for m in old])
                self._tidies[t.url] = Tidy(t, self.save_id, old, list(c.took_over), self.rank, fence=c.fence)
        except BaseException:
            self.abandon()
            raise

    def took_over(self, url: str) -> tuple[str, ...]:
        """The save ids of the dead attempts whose claim on ``url`` this save took over (while
        it holds that claim)."""
        c = self._claims.get(url)
        return () if c is None else tuple(c.took_over)

    def after_commit(self, tier: StorageTier, manifest: Manifest) -> None:
        """``tier`` committed this save: remove what it superseded, then let its claim go."""
        try:
            tidy = self._tidies.pop(tier.url, None)
            if tidy is None:
                return
            saves = rank_saves(tier)  # read once, for both kinds
            if self.rank is None:
                names, old, protect = [], [], {f for f in manifest.files if f not in manifest.homes}
            else:
                names, old, protect = rank_superseded(tier, self.rank, self.save_id, saves)
            kind_names, kind_old = other_kind_superseded(tier, manifest, rank=self.rank, saves=saves)
            tidy.fence()
            claim = self._claims.get(tier.url)
            if claim is not None and kind_old:  # should this save die now, the next one removes them
                claim.carry([m.save_id for m in kind_old])
            for n in names + kind_names:  # uncommit first: a crash from here on leaves only leftovers
                tier.remove(n)
            if names or kind_names:  # and for good before a file they reference goes
                tier.sync_dir()
            if self.rank is not None:
                tidy.superseded = old
            tidy.superseded += kind_old
            if tidy.run(protect):
                # the removals durable before the claim goes: after a power cut either they
                # stand or the claim does, whose record names the saves they belonged to
                tier.sync_dir()
            if tidy.deferred:  # the record names the save whose files stayed: the next save here removes them
                self.abandon(tier.url)
        except (OSError, CheckpointError) as e:
            log.warning("%s committed, but tidying superseded files failed (%s); the claim's record "
                        "stays, and the next save here removes them", tier.url, e)
            self.abandon(tier.url)  # the record names what this save superseded: the next one removes it
        finally:
            self.release(tier.url)

    def fence(self, url: str) -> None:
        """Raise :class:`ClaimLostError` unless this save still holds ``url``'s claim."""
        c = self._claims.get(url)
        if c is None:
            raise ClaimLostError(f"save {self.save_id} holds no claim here; it commits nothing",
                                 checkpoint=url)
        c.fence()

    def release(self, url: str | None = None) -> None:
        """Let the claim of ``url`` (default: every claim) go."""
        self._let_go(url, failed=False)

    def abandon(self, url: str | None = None) -> None:
        """This save failed on ``url`` (default: everywhere): let its claims go but keep their
        records, so the next save there takes them over and removes this attempt's files."""
        self._let_go(url, failed=True)

    def _let_go(self, url: str | None, *, failed: bool) -> None:
        for u in list(self._claims) if url is None else [url]:
            self._tidies.pop(u, None)
            c = self._claims.pop(u, None)
            if c is not None:
                c.release(keep_record=failed)
