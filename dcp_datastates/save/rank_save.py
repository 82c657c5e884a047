"""``RankSave``: one save on one rank, from DCP's set-up call to its end.

The writer makes one per save (``set_up_storage_writer``) and hands it DCP's calls; it holds
everything that belongs to that save and to no other: the tier, the incremental base, the
directory claims, the engine job, the flush to slower tiers, and the records it sent.  A save
that begins while an earlier one still flushes has its own, so the two never share a field.

Lifecycle (DCP drives it; see ``save/writer.py`` for the calls):

1. ``plan_local`` (all ranks): the directory exists, no committed checkpoint is replaced
   unless asked, the incremental base is found.
2. ``claim`` (the coordinator; every rank with per-rank manifests): the directory is claimed
   on every tier before anything is written.
3. ``write`` (all ranks): the items are placed (``save/placement.py``) and handed to the engine;
   the future resolves with DCP's results once the data files are durable.
4. ``commit`` (the coordinator; every rank with per-rank manifests): the manifest is built
   from every rank's records and committed; what it superseded is tidied and the claim let go.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import process_state
from .._version import __version__
from ..engine import get_engine
from ..engine.device_cache import device_cache_for
from ..engine.host_cache import shared_host_cache
from ..engine.live import any_gpu, ready_point, want_pinned
from ..engine.snapshot import CopyItem, SaveJob
from ..errors import CheckpointError, CheckpointExistsError
from ..format import MANIFEST_NAME, encode_manifest
from ..format.assemble import PART_INDEX, PartItem, index_of, manifest_of, part_of
from ..format.model import Manifest
from ..format.names import is_packed_file, rank_manifest_name
from ..format.records import MANIFEST_KEY, REPLICA_EPOCH_KEY, SAVE_ID_KEY, TOOK_OVER_KEY
from ..format.v4.rules import RuleTable
from ..gcpause import paused_gc
from ..planner import RULES_KEY
from ..tiers import StorageTier
from ..tiers.base_lock import BaseHold
from ..tiers.commit import ByClaim, commit_manifest
from ..tiers.incremental import Base, load_base, still_committed
from ..tiers.manifests import committed_here
from ..tiers.ownership import SaveClaims
from ..tiers.persist import Persistence
from .options import WriterOptions
from .placement import Placed, Written, lay_out, results_of
from .progress import SaveSession

log = logging.getLogger(__name__)

WRITER_NAME = f"dcp-datastates {__version__}"
# The save each thread runs now (thread ident -> save id), of this process: a thread runs one
# save at a time, so one it began before is over (``RankSave.running``).
_SAVE_IN_THREAD: dict[int | None, str] = {}


@process_state.in_child
def _no_saves_in_child() -> None:
    """A forked child runs none of its parent's saves."""
    _SAVE_IN_THREAD.clear()


PLANNED_GRACE_S = 120.0  # a claim whose save planned but has not written for this long is stale


@dataclass(frozen=True)
class PlannedSave:
    """What the coordinator's global plan hands each rank (``SavePlan.storage_data``)."""

    rank: int  # the rank's place in the save: names its files
    save_id: str
    # the incremental base the coordinator read, as (directory name, its save id), or None
    # (written in full): a rank references no other base (see ``RankSave.agree_base``)
    base: tuple[str, str] | None = None
    # the replica group's epoch of the save, from the ranks' votes (``replica_group.decide_epoch``)
    replica_epoch: int | None = None


class RankSave:
    """One save on one rank (see the module's docstring for its calls).

    ``on_failed(e)`` is called when one of its steps fails after its claims were taken, so
    the writer can mark the save failed and free its slot; ``end(session)`` when this rank's
    part of the save is over."""

    def __init__(self, *, path: str, tier: StorageTier, opts: WriterOptions, rank: int,
                 is_coordinator: bool, use_collectives: bool, save_id: str,
                 end: Callable[[SaveSession], None]) -> None:
        self.path, self.tier, self.opts = path, tier, opts
        self.rank, self.is_coordinator, self.use_collectives = rank, is_coordinator, use_collectives
        self.save_id = save_id
        self._end = end
        self.base: Base | None = None
        self.hold = BaseHold()  # shared base locks of the directories this save may reference
        self.claims: SaveClaims | None = None
        self.persistence: Persistence | None = None
        self.job: SaveJob | None = None  # the engine's job while its data is not durable
        self.rules: RuleTable | None = None  # format 4: the rank's sharding rules
        self.refs: dict[str, tuple[str, int]] = {}  # base files referenced: {file: (home, size)}
        self.part_file: dict[str, int] = {}  # format 4: this rank's metadata part, flushed with its data
        self.stats: dict[str, int] = {}
        self.timings: dict[str, float] = {}
        self.replica_epoch: int | None = None  # the coordinator's: handed to every rank with the Metadata
        self._planned_at = 0.0
        self._thread: threading.Thread | None = None  # where the save's calls run (``claim``)
        self._ended = False  # committed here and tidied, its part over, or failed
        self._wrote = False
        self._writing = False  # in ``write``, before the engine's job exists

    # ------------------------------------------------------------- planning
    def persist_tiers(self) -> list[StorageTier]:
        return [StorageTier(u, self.opts.persist_options) for u in self.opts.persist_to] if self.opts.persist else []

    def committed_here(self) -> bool:
        return committed_here(self.tier, rank=None if self.use_collectives else self.rank)

    def plan_local(self) -> None:
        self.tier.makedirs()
        if not self.opts.overwrite and self.committed_here():
            raise CheckpointExistsError(
                "Checkpoint already exists: a committed checkpoint is here; pass overwrite=True to "
                "DataStatesWriter to replace it, or save to a new path (unlike DCP's "
                "FileSystemWriter, which overwrites by default)", checkpoint=self.path)
        self.base = load_base(self.tier, self.opts.incremental_base, self.opts.storage_options, self.hold,
                              self.opts.incremental_base_save_id)

    def claim(self) -> None:
        self._planned_at, self._wrote = time.monotonic(), False
        self._thread = threading.current_thread()
        _SAVE_IN_THREAD[self._thread.ident] = self.save_id  # the save this thread runs now
        self.claims = SaveClaims(self.save_id, rank=None if self.use_collectives else self.rank, busy=self.busy,
                                 running=self.running,
                                 base="" if self.base is None else self.base.name)
        self.claims.acquire([self.tier, *self.persist_tiers()])
        if self.base is not None and not still_committed(self.tier, self.base):
            log.info("%s: its incremental base %s changed before the claim that names it; writing in full",
                     self.path, self.base.name)
            self.base = None
            self.hold.release()
        if not self.opts.overwrite and self.committed_here():
            raise CheckpointExistsError("Checkpoint already exists: a committed checkpoint appeared here "
                                        "while this save was planning; pass overwrite=True to replace it",
                                        checkpoint=self.path)

    def planned_base(self) -> tuple[str, str] | None:
        """The base this rank read, as ``PlannedSave.base`` names it."""
        return None if self.base is None else (self.base.name, self.base.manifest.save_id)

    def take_plan(self, planned: PlannedSave, save_id: str, rules: RuleTable | None) -> None:
        """The coordinator's global plan for this rank (``write_data``): its place in the save,
        the save's id (``save_id``: the planned one, or a fresh one where it repeats a save
        of this process), the base to reference, the replica group's epoch and the sharding
        rules of a format 4 save (None: no rules)."""
        self.rank, self.save_id = planned.rank, save_id
        self.agree_base(planned.base)
        self.replica_epoch = planned.replica_epoch
        self.rules = rules

    def agree_base(self, planned: tuple[str, str] | None) -> None:
        """Reference only the base the coordinator read (``planned``): the one its claim names
        and its base locks hold, with the directories that base references, to the commit.  A
        rank that read another (the coordinator found the base being changed and writes in
        full, or the base was saved again between their reads) writes in full."""
        if self.base is not None and planned != self.planned_base():
            log.info("%s: the coordinator planned with base %s, this rank read %s; writing in full",
                     self.path, planned, self.planned_base())
            self.base = None
            self.hold.release()

    def _over(self, session: SaveSession) -> None:
        """Another rank's part of the save is over: where its directory is the coordinator's,
        the coordinator's claim covers what it references from here to the commit.  With
        ``replicas`` the directory is this node's, which the replicator commits later: it lets
        the base locks go then (``SaveToReplicate.hold``)."""
        if not self.opts.replicas:
            self.hold.release()
        self._ended = True
        self._end(session)

    def busy(self) -> bool:
        """Whether this save still runs (a claim of one DCP abandoned after planning is stale)."""
        if self._writing or self.job is not None:  # its data is not durable yet
            return True
        if self.persistence is not None and self.persistence.pending():
            return True
        return not self._wrote and time.monotonic() - self._planned_at < PLANNED_GRACE_S

    def running(self) -> bool:
        """Whether this save has not ended: its manifest is still to be committed here and its
        cleanup done.  A save runs in one thread (DCP's, or the caller's for ``dcp.save``),
        which runs one save at a time: once that thread ended, or began another save, this
        one is over, whether or not it was told (DCP tells a writer nothing of a save that
        failed on another rank)."""
        t = self._thread
        return (not self._ended and t is not None and t.is_alive()
                and _SAVE_IN_THREAD.get(t.ident) == self.save_id)

    def release(self, url: str | None = None) -> None:
        """This save failed on ``url`` (default: every tier): let its claims go, keeping their
        records for the next save there to take over (see ``SaveClaims.abandon``)."""
        if url is None:
            self._ended = True
        if self.claims is not None:
            self.claims.abandon(url)
        if url is None or url == self.tier.url:
            self.hold.release()

    def fence(self, url: str) -> None:
        """The last check before a manifest is committed on ``url``: this save still holds
        its claim there (``ClaimLostError`` otherwise)."""
        if self.claims is None:
            raise CheckpointError("this save never claimed its directory; it commits nothing",
                                  checkpoint=url)
        self.claims.fence(url)

    def took_over(self) -> tuple[str, ...]:
        """The save ids of the dead attempts whose claim this save took over on its first tier
        (their files there are this save's to remove, on every node where they landed)."""
        return () if self.claims is None else self.claims.took_over(self.tier.url)

    def after_commit(self, tier: StorageTier, manifest: Manifest) -> None:
        if self.claims is not None:
            self.claims.after_commit(tier, manifest)

    # --------------------------------------------------------------- writing
    def write(self, plan: SavePlan, planner: SavePlanner, session: SaveSession,
              on_failed: Callable[[BaseException], None]) -> Future:
        """Place the plan's items and hand them to the engine; the future gets DCP's results.
        The save is ``busy`` throughout: laying out a large plan and opening its files takes
        a while before the engine's job exists."""
        self._wrote = self._writing = True
        try:
            return self._write(plan, planner, session, on_failed)
        finally:
            self._writing = False  # the job, if any, keeps it busy from here

    def _write(self, plan: SavePlan, planner: SavePlanner, session: SaveSession,
               on_failed: Callable[[BaseException], None]) -> Future:
        with paused_gc():  # a few records per item, none cyclic
            placed, copy_items, names = lay_out(
                plan, planner, rank=self.rank, save_id=self.save_id, thread_count=self.opts.thread_count,
                base=self.base, started=session.versions if session.lazy else None,
                allow_pickle=self.opts.allow_pickle, checkpoint=self.path, compression=self.opts.compression)
        fut: Future = Future()
        if not self.is_coordinator:  # this rank's part of the save is over once DCP has its results
            fut.add_done_callback(lambda f: self._over(session))
        self.persistence = Persistence(self.tier, self.persist_tiers(), self.save_id, self.rank,
                                       on_done=session.mark_persisted, after_commit=self.after_commit,
                                       on_tier_failed=self.release, fence=self.fence,
                                       unclaimed=self.claims.unclaimed if self.claims is not None else None)
        persistence = self.persistence
        if not copy_items:
            session.mark_snapshot()
            res = self._results(placed, names, [])
            persistence.start_uploads(dict(self.part_file), {}, waits_for_commit=self._commits_persist())
            fut.set_result(res)
            return fut
        # compressed blocks are written as they come, of any length: never with O_DIRECT
        sinks = [self.tier.open_sink(n, o_direct=self.opts.o_direct and not is_packed_file(n),
                                     drop_cache=not self.opts.flushing) for n in names]
        job = self.job = self._submit(copy_items, sinks, session)
        job.snapshotted.add_done_callback(lambda f: session.mark_snapshot() if f.exception() is None else None)

        def durable(f) -> None:
            try:
                sizes = f.result().file_sizes
                session.stamp("data_written")
                for n, sz in zip(names, sizes):
                    if sz == 0:  # every byte of this stripe was reused from the base
                        self.tier.remove(n)
                res = self._results(placed, names, sizes, f.result().timings)
                persistence.start_uploads({**{n: sz for n, sz in zip(names, sizes) if sz > 0}, **self.part_file},
                                          self.refs, waits_for_commit=self._commits_persist())
                fut.set_result(res)
            except BaseException as e:  # noqa: BLE001 - delivered through DCP's future
                on_failed(e)
                fut.set_exception(CheckpointError(f"writing rank {self.rank}'s data failed: {e}",
                                                  checkpoint=self.path, file=names[0]))
            finally:
                # over: the save keeps nothing of the job, neither the state's tensors (its
                # items) nor, through this callback, its records, which would otherwise live on
                # in a cycle until the collector's next full pass
                self.job = None
        job.durable.add_done_callback(durable)
        if not session.lazy:
            job.durable.exception()  # synchronous dcp.save: DCP waits on the future right away
        return fut

    def _submit(self, copy_items: list[CopyItem], sinks: list, session: SaveSession) -> SaveJob:
        """Queue this rank's copies on the process's engine: through the host cache, and for an
        async save through the device cache first (``engine/device_cache.py``)."""
        opts = self.opts
        sources = [i.live() for i in copy_items]
        ready = session.ready if session.lazy else None
        assert opts.host_cache_bytes is not None, "the writer resolves the cache size"
        engine = get_engine(shared_host_cache(opts.host_cache_bytes, want_pinned(copy_items)), opts.thread_count)
        direct = any(getattr(s, "o_direct", False) for s in sinks)
        return engine.submit(
            copy_items, sinks, copy=session.lazy or direct or any_gpu(copy_items),
            label=f"{self.path} rank {self.rank}", unit_bytes=opts.dedup_unit_bytes,
            device_cache=device_cache_for(sources, opts.device_cache_bytes if session.lazy else 0),
            ready_event=ready if ready is not None else ready_point(sources))

    def _commits_persist(self) -> bool:
        """Whether this rank's flush is over only when a slow tier commits (not at upload)."""
        return self.is_coordinator or not self.use_collectives

    def _results(self, placed: list[Placed], names: list[str], sizes: list[int],
                 timings: dict | None = None) -> list[WriteResult]:
        written = results_of(placed, names, sizes, self.base, self.rank, timings)
        self.refs, self.stats = written.refs, written.stats
        self.timings = dict(timings or {})
        self.part_file = {}
        return [self._write_part(placed, written)] if self.rules is not None else written.results

    def _write_part(self, placed: list[Placed], written: Written) -> WriteResult:
        """Format 4: commit this rank's records as its metadata part beside its data files; the
        one result the coordinator gets names it."""
        assert self.rules is not None, "a part is written where the planner gave rules"
        grank = process_state.rank(default=self.rank)
        out = written.results
        items = [PartItem(wr.index.fqn, None, wr.storage_data, None)
                 if wr.storage_data.kind in ("value", "provider-value") else
                 PartItem(wr.index.fqn, tuple(wr.index.offset or ()), wr.storage_data,
                          tuple(p.item.tensor_data.size) if p.item.tensor_data is not None else ())
                 for p, wr in zip(placed, out)]
        part = part_of(items, out[0].storage_data.rank if out else None, self.rules, rank=grank,
                       world=max(process_state.world_size(), grank + 1), save_id=self.save_id, torch_version=torch.__version__,
                       writer=WRITER_NAME)
        self.tier.commit_bytes(part.name, part.body, sync=self.opts.sync_files)
        self.part_file = {part.name: len(part.body)}
        self.stats["part_bytes"] = len(part.body)
        return WriteResult(index=PART_INDEX, size_in_bytes=len(part.body), storage_data=part.record)

    # ------------------------------------------------------------ committing
    def commit(self, metadata: Metadata, results: list[list[WriteResult]], session: SaveSession | None) -> None:
        """Build the manifest from every rank's records and commit it (temp file, fsync,
        rename: the rename is the commit), then tidy what it superseded and let the claim go."""
        manifest, body = self._manifest(metadata, results)
        name = MANIFEST_NAME if self.use_collectives else rank_manifest_name(self.rank, self.save_id)
        commit_manifest(self.tier, body, self.save_id, ByClaim(lambda: self.fence(self.tier.url)), name=name,
                        sync=self.opts.sync_files)
        if self.use_collectives:
            # DCP broadcasts this Metadata to every rank as the save's result: a run-level
            # checkpointer on another node commits the manifest on its own disk from it.
            metadata.storage_data = {MANIFEST_KEY: body, SAVE_ID_KEY: self.save_id,
                                     TOOK_OVER_KEY: list(self.took_over()), REPLICA_EPOCH_KEY: self.replica_epoch}
        if session is not None:
            session.mark_committed()
        mib = sum(manifest.files.values()) / 2**20
        took = session.timings() if session is not None else {}
        cost = (f" in {took['committed_s']:.2f} s from the save call ({mib / max(took['committed_s'], 1e-6):.0f} MiB/s"
                f"; snapshot done at {took.get('snapshot_done_s', 0.0):.2f} s)") if "committed_s" in took else ""
        log.info("committed %s (%d tensors, %d values, %.1f MiB)%s", self.path, len(manifest.tensors),
                 len(manifest.values), mib, cost)
        # tidy this tier before a slower tier can commit: that commit writes this directory's
        # `.persisted` record, whose temporary file the tidy would take for a leftover of its own
        self.after_commit(self.tier, manifest)
        self._ended = True  # committed and tidied here: what is left is the flush (``busy``)
        self.hold.release()  # the manifest names what it references now
        if self.persistence is not None:
            self.persistence.start_commits(manifest, body, name, collective=self.use_collectives,
                                           record_on=self.tier)

    def _manifest(self, metadata: Metadata, results: list[list[WriteResult]]) -> tuple[Manifest, bytes]:
        """The manifest to commit and its bytes: a format 4 index where the planner gave
        sharding rules, else a version 3 manifest (of this rank alone with per-rank manifests)."""
        raw = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        rules = raw.get(RULES_KEY)
        with paused_gc():
            if isinstance(rules, RuleTable) and self.use_collectives:
                return index_of(metadata, results, self.save_id, rules, self.path, world=process_state.world_size(),
                                torch_version=torch.__version__, writer=WRITER_NAME)
            manifest = manifest_of(metadata, results, self.save_id, world=process_state.world_size(),
                                   torch_version=torch.__version__, writer=WRITER_NAME)
        if not self.use_collectives:
            manifest.ranks = [self.rank]
        return manifest, encode_manifest(manifest)
