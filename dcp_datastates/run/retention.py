"""``RunRetention``: a ``Checkpointer``'s retention over its run's tiers, one pass at a time.

Per tier with a ``keep``, a pass purges the steps beyond the newest ``keep`` committed there,
and the leftovers of interrupted saves older than the newest committed step, by mark and sweep
(``tiers/retention.py``); never a step the checkpointer still needs (``Protected``: the save in
flight and its base, steps flushing to slower tiers or replicating to peers, the newest durable
step, the newest step the node's peers hold) and never bytes a retained step uses.  A
node-local first tier is purged by every rank on its own node, the shared tiers by rank 0
alone.  Passes run on a thread of their own, one at a time (the commit and the flush threads
both ask for one); a failed pass is logged, never raised: retention must not break training.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..format.model import Manifest
from ..tiers.retention import purge_steps
from .steps import RunSteps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Protected:
    """What a pass must leave alone, as its checkpointer sees it when the pass starts."""

    steps: frozenset[int]  # kept on every tier whatever ``keep`` says
    in_flight: int | None = None  # the step being saved: not yet a committed step anywhere
    # (step directory, manifest) of saves still flushing to the slower tiers: the bytes they
    # reference there stay, though no committed manifest there names them yet
    flushing: tuple[tuple[str, Manifest], ...] = ()


class RunRetention:
    """Retention passes over ``steps`` (``keep``: steps kept per tier, 0 for all), leaving what
    ``protected(tiers)`` names for a pass over ``tiers``; ``rank()``: this process's rank in the
    checkpointer's group."""

    def __init__(self, steps: RunSteps, keep: list[int], protected: Callable[[Sequence[int]], Protected],
                 rank: Callable[[], int]) -> None:
        self.steps, self.keep = steps, list(keep)
        self._protected, self._rank = protected, rank
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()  # one pass at a time

    def start(self) -> None:
        """A pass on the retention thread, once the running one ended."""
        if not any(self.keep):
            return
        with self._lock:
            self.join()
            t = threading.Thread(target=self.run, daemon=True, name="dcpds-purge")
            t.start()
            self._thread = t

    def run_now(self) -> None:
        """A pass in this thread, once the running one ended."""
        with self._lock:
            self.join()
            self.run()

    def join(self) -> None:
        """Wait for the running pass (not from the pass itself)."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def run(self) -> None:
        """One pass over every tier this process purges."""
        try:
            tiers = [i for i, k in enumerate(self.keep)
                     if k and ((i == 0 and self.steps.node_local) or self._rank() == 0)]
            if not tiers:  # nothing of this process's to purge: no tier is even asked
                return
            protected = self._protected(tiers)
            for i in tiers:
                self._tier(i, self.keep[i], protected)
        except Exception:  # retention must never break training
            log.exception("retention pass failed")

    def _tier(self, i: int, k: int, protected: Protected) -> None:
        committed = self.steps.committed(i, besides=protected.in_flight)
        keep = set(committed[-k:]) | protected.steps
        newest = committed[-1] if committed else None
        # a directory without a committed manifest older than the newest step is an
        # interrupted or a purged save; one holding another format's checkpoint is not ours
        drop = [s for s in self.steps.step_dirs(i) if s not in keep
                and (s in committed or (newest is not None and s < newest and not self.steps.foreign(i, s)))]
        if drop:
            log.info("retention: purging steps %s on %s", drop, self.steps.tiers[i])
            purge_steps(self.steps.tier(i), [f"step-{s}" for s in drop],
                        also=list(protected.flushing) if i > 0 else [])


__all__ = ["Protected", "RunRetention"]
