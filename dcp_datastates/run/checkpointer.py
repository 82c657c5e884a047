"""A run-level checkpointer over tiers, for users without torchtitan.

    ckpt = Checkpointer(["/local_nvme/run1", "s3://bucket/run1"], keep=[2, 10])
    ckpt.save(step, state)          # async by default; returns at once
    ...                              # forward, backward
    ckpt.wait_snapshot()            # or SnapshotGuard(optimizer, ckpt); then optimizer.step()
    ckpt.load(state)                # newest committed step, fastest complete copy

Layout: ``<tier>/step-<N>/`` on every tier, the same names as torchtitan, so its discovery
(``step-N/.metadata``) sees only committed steps.

Rules, the ones users were burned by elsewhere:

* a step counts only once its manifest is committed on a tier; an in-flight save is never
  "latest" and is never the reason anything is purged;
* retention runs after a save has committed, per tier (``keep``), and never deletes the
  newest step committed on the slowest tier, nor a step still being flushed to a slower tier;
* the first tier may be node-local: pass ``node_local=True`` and every rank keeps and purges its
  own directory; rank 0 alone purges the shared tiers.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from .. import process_state
from ..engine.device_cache import prepare_device_cache
from ..engine.host_cache import default_host_cache_bytes, prepare_host_cache
from ..format import decode_manifest
from ..format.model import Manifest
from ..format.records import committed_save
from ..planner import DataStatesSavePlanner
from ..replicas.for_run import KnownSave, NodeCopies
from ..save.guard import async_save
from ..save.writer import DataStatesWriter, checked_writer_options
from ..tiers import StorageTier
from ..tiers.storage import url_tuple
from .restore import Restore
from .retention import Protected, RunRetention
from .steps import RunSteps

log = logging.getLogger(__name__)


@dataclass
class SaveInFlight:
    """The save a ``Checkpointer`` has in flight: started, not yet seen committed."""

    step: int
    writer: DataStatesWriter
    # DCP's for an async save (a Future, or the response whose ``upload_completion`` is one);
    # None: synchronous, committed when recorded
    future: object | None
    persist: bool  # flushed to the slower tiers
    base: int | None  # the step it is incremental on


class Checkpointer:
    """Save, discover, retain and restore steps over ordered tiers (fastest first).

    Args:
        tiers: run directories, fastest first (local paths or fsspec URLs).
        keep: steps to keep per tier (an int applies to all; ``None`` or 0 keeps all).
        persist_every: flush every k-th save to the slower tiers (1: every save).
        async_mode: ``"thread"`` (default), ``"process"``, or ``None`` for synchronous saves.
        process_group: the group DCP uses (a gloo group for async saves).
        node_local: the first tier is private to each node (each rank sees only its own).
        storage_options: fsspec options per tier (a list aligned with ``tiers``).
        incremental: save each step as an incremental checkpoint on the newest committed one:
            unchanged bytes are referenced, not written again (off by default, so that every
            step directory is self-contained and can be copied or deleted on its own).  With it
            on, delete steps only through retention (``keep``), which never removes bytes a
            retained step still uses.
        writer_options: further ``DataStatesWriter`` keyword arguments.
    """

    def __init__(self, tiers: Sequence[str] | str, *, keep: list[int] | int | None = None,
                 persist_every: int = 1, async_mode: str | None = "thread", process_group=None,
                 node_local: bool = False, storage_options: list[dict | None] | None = None,
                 incremental: bool = False, replicas: int = 0, node: str | None = None,
                 **writer_options) -> None:
        tiers = url_tuple(tiers)  # one path, or several: never a path's characters
        if not tiers:
            raise ValueError("Checkpointer needs at least one tier")
        if persist_every < 1:
            raise ValueError(f"persist_every must be >= 1, got {persist_every}")
        self.tiers = [str(t) for t in tiers]
        if keep is None or isinstance(keep, int):
            keep = [keep or 0] * len(self.tiers)
        if len(keep) != len(self.tiers):
            raise ValueError(f"keep has {len(keep)} entries for {len(self.tiers)} tiers")
        self.keep = list(keep)
        self.persist_every = persist_every
        self.async_mode = async_mode
        if async_mode == "process" and not process_state.group_up():
            raise ValueError("Checkpointer(async_mode='process') needs an initialized process group "
                             "(DCP's checkpoint daemon joins it): call dist.init_process_group first, "
                             "or use async_mode='thread'")
        self.pg = process_group
        self.node_local = node_local
        self.storage_options = list(storage_options or [None] * len(self.tiers))
        self.steps = RunSteps(self.tiers, self.storage_options, node_local=node_local, pg=process_group)
        self.writer_options = checked_writer_options(
            writer_options, "Checkpointer", set(inspect.signature(Checkpointer.__init__).parameters) - {"self", "writer_options"})
        # the staging cache is allocated (pinned on a GPU machine) now, in the background
        prepare_host_cache(writer_options.get("host_cache_bytes") or default_host_cache_bytes())
        if async_mode == "thread":  # used by async saves only; PROCESS mode's is in its daemon
            prepare_device_cache(writer_options.get("device_cache_bytes") or 0)
        self.incremental = incremental
        self._last_committed: int | None = None  # newest step this process committed
        self._known: KnownSave | None = None  # and its save, as the next save's base
        self._manifests: dict[int, Manifest] = {}  # step -> Manifest, while it flushes to slower tiers
        self._saves = 0
        self._inflight: SaveInFlight | None = None
        self._persisting: dict[int, DataStatesWriter] = {}
        self._lock = threading.Lock()
        self._failed: list[str] = []  # directories of failed saves whose claims the next save lets go
        self.retention = RunRetention(self.steps, self.keep, self._protected, lambda: self.rank)
        self.last_timings: dict[str, float] = {}  # stage timings of the newest save (seconds)
        # bytes of the newest committed save, all ranks: written anew, and reused from earlier steps
        self.last_stats: dict[str, int] = {}
        self._helpers: list[threading.Thread] = []
        if replicas and not node_local:
            raise ValueError("replicas copy node-local checkpoints to other nodes: pass node_local=True")
        # this node's copy of each step (and, with replicas, its peers'); None: the tiers are shared
        self.node_copies = (NodeCopies(lambda s: self._tier(0, s), replicas, process_group, node)
                            if node_local else None)

    # ------------------------------------------------------------------ paths
    def step_path(self, tier: int, step: int) -> str:
        """The directory (or URL) of ``step`` on tier ``tier``: ``<tier>/step-<step>``."""
        return self.steps.step_path(tier, step)

    def _tier(self, i: int, step: int | None = None) -> StorageTier:
        return self.steps.tier(i, step)

    @property
    def rank(self) -> int:
        """This process's rank in the checkpointer's process group (0 without one)."""
        return process_state.rank(self.pg)

    # ------------------------------------------------------------------- save
    def save(self, step: int, state: dict):
        """Checkpoint ``state`` as ``step``; waits for the previous save to commit first."""
        self.wait()
        persist = self._saves % self.persist_every == 0 and len(self.tiers) > 1
        self._saves += 1
        base = self._base_for(step) if self.incremental else None
        base_id = None
        if base is not None and self.node_copies is not None:  # this node's copy held until it commits
            base_id = self.node_copies.hold_base(step, base, self._known)
            base = None if base_id is None else base
        try:
            return self._save(step, state, base, base_id, persist)
        except BaseException:
            if self.node_copies is not None:
                self.node_copies.let_go(step)
            raise

    def _save(self, step: int, state: dict, base: int | None, base_id: str | None, persist: bool):
        writer = DataStatesWriter(
            self.step_path(0, step), storage_options=self.storage_options[0],
            persist_to=[self.step_path(i, step) for i in range(1, len(self.tiers))],
            persist=persist, persist_options=self.storage_options[1] if len(self.tiers) > 1 else None,
            overwrite=True, async_mode=self.async_mode,
            incremental_base=None if base is None else f"step-{base}", incremental_base_save_id=base_id,
            **self.writer_options)
        if self.node_copies is not None and self.node_copies.replicator is not None:
            writer.replication.vote = self.node_copies.replicator.vote()  # in the save's plan
        with self._lock:
            failed, self._failed = self._failed, []
        writer.release_failed(failed)  # their claims, where DCP's checkpoint process holds them
        if self.async_mode is None:
            try:
                md = dcp.save(state, storage_writer=writer, process_group=self.pg, planner=DataStatesSavePlanner())
            except BaseException:
                self._forget_failed(step)
                raise
            self._inflight = SaveInFlight(step, writer, None, persist, base)
            self._on_committed(md)
            return None
        kind = AsyncCheckpointerType.PROCESS if self.async_mode == "process" else AsyncCheckpointerType.THREAD
        fut = async_save(state, storage_writer=writer, process_group=self.pg, planner=DataStatesSavePlanner(),
                         async_checkpointer_type=kind)
        self._inflight = SaveInFlight(step, writer, fut, persist, base)
        if self.node_local:  # the step is on this node (and on its way to the peers) once it commits
            done = cast(Future, getattr(fut, "upload_completion", fut))
            done.add_done_callback(functools.partial(self._node_done, step))
        return fut

    def _node_done(self, step: int, fut: Future) -> None:
        """An async save's future completed: the step is on this node (or failed)."""
        if fut.exception() is None:
            self._on_node(step, fut.result())
        elif self.node_copies is not None:
            self.node_copies.let_go(step)

    def _base_for(self, step: int) -> int | None:
        """The step an incremental save builds on: the newest committed before ``step``."""
        if self._last_committed is not None and self._last_committed < step:
            return self._last_committed
        older = [s for s in self.committed_steps(0) if s < step]
        return older[-1] if older else None

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Training may mutate the state once this returns (see ``DataStatesWriter.wait_snapshot``)."""
        cur = self._inflight
        return True if cur is None else cur.writer.wait_snapshot(timeout)

    def register_step_pre_hook(self, optimizer):
        """Make ``optimizer.step()`` wait for the current save's snapshot."""
        def hook(*_args, **_kwargs):
            self.wait_snapshot()
            return None
        return optimizer.register_step_pre_hook(hook)

    def wait(self) -> None:
        """Wait until the in-flight save is committed on the first tier (then purge)."""
        cur = self._inflight
        if cur is None or cur.future is None:
            return
        fut = cast(Future, getattr(cur.future, "upload_completion", cur.future))
        try:
            md = fut.result()
        except BaseException:  # raised once: the next save starts afresh
            if self._inflight is cur:
                self._inflight = None
            self._forget_failed(cur.step)
            raise
        self._on_committed(md)

    def _forget_failed(self, step: int) -> None:
        """``step``'s save failed: the next save lets go the claim its coordinator kept there."""
        with self._lock:
            self._failed.append(self.step_path(0, step))

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Wait until every save so far reached the slower tiers: on the coordinator (rank 0
        of the group), until each tier committed it (its manifest durable there); on another
        rank, until its own files are durable on each tier, whose commit the coordinator makes.
        False where a flush failed."""
        self.wait()
        ok = True
        for step, w in list(self._persisting.items()):
            ok = w.wait_persisted(timeout) and ok
            with self._lock:
                self._persisting.pop(step, None)
        self.retention.run_now()
        return ok

    def _on_committed(self, md) -> None:
        cur, self._inflight = self._inflight, None
        if cur is None:
            return
        step, writer = cur.step, cur.writer
        self.last_timings = writer.timings()
        body = self._on_node(step, md)
        self._last_committed = step if self._last_committed is None else max(self._last_committed, step)
        if body is not None:
            m = decode_manifest(body, source=self.step_path(0, step))
            self._known = KnownSave(step, m.save_id, frozenset(m.homes.values()))
            owned, shared = m.usage()
            self.last_stats = {"bytes_written": owned, "bytes_reused": sum(shared.values())}
        if cur.persist:
            with self._lock:
                self._persisting[step] = writer
                if body is not None:
                    self._manifests[step] = m
            t = threading.Thread(target=self._after_persist, args=(step, writer), daemon=True,
                                 name="dcpds-persist-wait")
            t.start()
            self._helpers = [h for h in self._helpers if h.is_alive()] + [t]
        self.retention.start()

    def _on_node(self, step: int, md) -> bytes | None:
        """The committed manifest's body, handed to this node's copy of the step (``NodeCopies``)
        when the first tier is node-local.  Runs when an async save's future completes (in
        DCP's thread) and again from ``wait``."""
        committed = committed_save(md)
        if self.node_copies is not None:
            try:
                if committed is not None:
                    self.node_copies.committed(step, committed)
            finally:  # from here on the node's manifest keeps alive what the step references
                self.node_copies.let_go(step)
        return None if committed is None else committed.manifest

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Wait until every save so far is replicated to its peers (``replicas``); False when a
        step ended degraded (the log says which ranks and why)."""
        self.wait()
        return True if self.node_copies is None else self.node_copies.wait(timeout)

    def _after_persist(self, step: int, writer: DataStatesWriter) -> None:
        try:
            writer.wait_persisted()
            self.last_timings = writer.timings()
        except Exception as e:  # noqa: BLE001 - reported, the fast copy stays
            log.error("step %d did not reach the slower tiers: %s", step, e)
        with self._lock:
            self._persisting.pop(step, None)
            self._manifests.pop(step, None)
        self.retention.start()

    # -------------------------------------------------------------- discovery
    def is_committed(self, i: int, step: int) -> bool:
        """Whether ``step`` has a committed manifest on tier ``i``."""
        return self.steps.is_committed(i, step)

    def committed_steps(self, i: int) -> list[int]:
        """Steps whose copy on tier ``i`` is committed (in-flight saves excluded)."""
        return self.steps.committed(i, besides=self._inflight.step if self._inflight else None)

    def latest_step(self) -> int | None:
        """The newest step committed on any tier, or None."""
        steps = set()
        for i in range(len(self.tiers)):
            steps.update(self.committed_steps(i))
        return max(steps) if steps else None

    # ---------------------------------------------------------------- restore
    def load(self, state: dict, step: int | None = None) -> int | None:
        """Load ``step`` (default: the newest committed) into ``state``; return the step loaded,
        or None where the run has no committed step (a fresh start).

        Every rank reads each byte from the fastest tier holding a valid copy; a step that no
        tier can serve completely is skipped for the next older one (``Restore``).  Where
        committed steps exist and none can be restored, ``CheckpointError`` (never None: a
        trainer would start afresh and its saves and retention would replace the run)."""
        self.wait()
        restore = Restore(self.steps, self.storage_options, self.node_copies, self.pg)
        got = restore.run(state, step, besides=self._inflight.step if self._inflight else None)
        if got is not None:
            self.last_restore = restore.last
        return got

    # ---------------------------------------------------------------- retention
    def _protected(self, tiers: Sequence[int]) -> Protected:
        """What a retention pass over ``tiers`` leaves alone now (``RunRetention``)."""
        cur = self._inflight
        with self._lock:
            protect = set(self._persisting)  # sources of flushes in flight
            flushing = tuple((f"step-{s}", m) for s, m in self._manifests.items())
        durable = self.steps.newest_durable(tiers, None if cur is None else cur.step, protect)
        if durable is not None:
            protect.add(durable)  # the newest durable checkpoint stays everywhere
        if self.node_copies is not None:
            protect.update(self.node_copies.busy())  # replicas still on their way
            held = self.node_copies.newest_replicated(self.committed_steps(0))
            if held is not None:
                protect.add(held)  # what the peers hold, until a newer step is held too
        cur = self._inflight  # read again: a save may have started meanwhile
        if cur is not None:
            protect.add(cur.step)
            if cur.base is not None:
                protect.add(cur.base)  # an incremental save in flight reads from it
        return Protected(frozenset(protect), None if cur is None else cur.step, flushing)

    def close(self) -> None:
        """Wait for the save in flight, its flushes to slower tiers, its replicas, and the
        retention pass."""
        self.wait()
        if self.node_copies is not None:  # no replication left inside gloo when the process exits
            self.node_copies.wait()
            self.node_copies.close()
        for t in list(self._helpers):
            t.join()
        self.retention.join()
