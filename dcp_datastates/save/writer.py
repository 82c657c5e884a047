"""``DataStatesWriter``: DCP's ``StorageWriter`` and ``AsyncStager``, as an adapter.

It turns DCP's calls into calls on the objects below it and holds no policy of its own: the
options are a ``WriterOptions``, the saves through it and how each begins are its
``WriterSessions`` (``save/progress.py``), each save on this rank is a ``RankSave``
(``save/rank_save.py``), which owns the save's tier, base, claims, engine job and flush, and the
replicas of its saves are its ``WriterReplicas`` (``replicas/for_writer.py``).

Call order under ``dcp.save`` / ``dcp.async_save`` (DCP drives it):

0. (caller thread, async only) ``stage(state_dict)`` returns at once: small tensors are
   copied now, the rest lazily by the engine (the *lazy* snapshot); version counters are read.
1. (all ranks) ``reset(checkpoint_id)`` when an id is given, then ``set_up_storage_writer``
   (a new ``RankSave``) and ``prepare_local_plan`` (directory, incremental base; the replica
   group's vote).
2. (coordinator; every rank with ``use_collectives=False``) ``prepare_global_plan`` claims the
   directory on every tier before anything is written, names one save id for all ranks (and
   the replica group's epoch).
3. (all ranks) ``write_data`` lays the rank's items out in its data files and hands them to
   the engine; its future resolves once the files are fsynced.  With replicas, the save is
   queued on the rank's replicator.
4. (coordinator) ``finish`` builds the manifest from the typed records of every rank and
   commits it (temp file, fsync, rename): that rename is the commit.  Then it removes what the
   replaced manifest owned and lets the claim go.  With ``use_collectives=False`` every rank
   commits its own rank manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..engine.device_cache import prepare_device_cache
from ..engine.host_cache import default_host_cache_bytes, prepare_host_cache
from ..engine.snapshot import SaveJob
from ..errors import CheckpointError, first_line
from ..format.v4.rules import RuleTable
from ..replicas.for_writer import WriterReplicas
from ..tiers import StorageTier
from ..tiers.storage import url_tuple
from .options import DEFAULT_DEDUP_UNIT, FileSystemWriterArgs, WriterOptions
from .rank_save import PlannedSave, RankSave
from .staging import SAVE_IDS, WriterSessions

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_DEDUP_UNIT", "DataStatesWriter", "checked_writer_options"]


class DataStatesWriter(StorageWriter):
    """Save DCP checkpoints in the dcp-datastates format (options: ``docs/configuration.md``).

    Args:
        path: checkpoint directory (local path or fsspec URL), or ``checkpoint_id`` of ``dcp.save``.
        overwrite: replace a committed checkpoint at ``path`` (it stays loadable until the new
            manifest commits).  Off: saving over one raises ``CheckpointExistsError``.
        thread_count: flush threads per rank.  host_cache_bytes: the bounded staging cache of
            this process (default 2 GiB or ``DCP_DATASTATES_HOST_CACHE_BYTES``).
        device_cache_bytes: a first cache level on the GPU for async saves (0: off).
        allow_pickle: store values msgpack cannot express with pickle (the reader must opt in too).
        sync_files: fsync data files and the manifest.  storage_options: fsspec options.
        async_mode: ``"process"`` says in advance that saves run in DCP's checkpoint process
            (``async_checkpointer_type=PROCESS``; ``dcp_datastates.async_save`` sets it): CPU
            tensors then move into shared memory at the call and are copied lazily over there.
            Without it, DCP's PROCESS mode still works: the writer learns it when DCP pickles the
            save, and copies CPU tensors outside shared memory then, up to ``host_cache_bytes +
            eager_copy_bytes`` (GPU tensors are read lazily either way).
        persist_to / persist / persist_options: slower tiers this checkpoint is flushed to in the
            background, each committing on its own (``tiers/persist.py``).
        incremental_base: a committed sibling checkpoint whose unchanged bytes are referenced,
            per ``dedup_unit_bytes`` (a multiple of 1 MiB, default 4 MiB); with
            ``incremental_base_save_id``, only while it holds that save (else written in full).
        o_direct: write local data files with O_DIRECT from the aligned host cache.
        step_barrier_s: optimizers' ``step()`` waits up to this for an async save's snapshot (0: off).
        eager_copy_bytes: an async save copies tensors of at most 64 KiB when it is called, up to
            this many bytes in all (0: none); the rest are copied lazily.
        snapshot: ``"lazy"`` (the default) copies the state while training runs; ``"at_call"``
            copies it before ``async_save`` returns, as far as the first cache level's size
            allows (``host_cache_bytes`` for CPU tensors, ``device_cache_bytes`` for GPU ones),
            so no in-place change, however made, can reach the checkpoint.
        replicas: each rank's files of a save also land on ``replicas`` other nodes' directories
            (``path`` is then node-local: every node has its own), sent over a gloo group of
            their own in the background once the save commits (``replicas/work.py``); each
            node commits the manifest in its own directory.  Load with
            ``DataStatesReader(path, node_local=True)``, which first makes every node's
            directory whole from its peers' copies.  ``node``: this rank's node (default:
            ``DCP_DATASTATES_NODE``, ``GROUP_RANK`` or the host name).  ``process_group``: the
            group given to ``dcp.save`` (default: the default group).
        compression: ``"zstd"`` stores each 1 MiB block of tensors of 64 KiB or more compressed
            on its own (floats byte-shuffled first); off by default: it pays on a slow or
            paid-per-byte tier, not on a fast local disk (``docs/configuration.md``).
        single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict,
        serialization_format, _extensions: ``FileSystemWriter``'s, accepted so that code written
            for it runs unchanged (``options.FileSystemWriterArgs``; ``docs/faq.md``);
            ``_extensions=[ZStandard()]`` means ``compression="zstd"``.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, path: str | None = None, *, overwrite: bool = False,
                 thread_count: int = 4, host_cache_bytes: int | None = None,
                 allow_pickle: bool = False, sync_files: bool = True,
                 storage_options: dict | None = None, async_mode: str | None = None,
                 persist_to: list[str] | str | None = None, persist: bool = True,
                 persist_options: dict | None = None, o_direct: bool = True,
                 incremental_base: str | None = None, incremental_base_save_id: str | None = None,
                 dedup_unit_bytes: int = DEFAULT_DEDUP_UNIT,
                 step_barrier_s: float = 600.0, device_cache_bytes: int = 0,
                 eager_copy_bytes: int = 64 << 20, snapshot: str = "lazy",
                 compression: str | None = None, replicas: int = 0, node: str | None = None,
                 process_group=None, single_file_per_rank: bool = True, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, serialization_format: object = None,
                 _extensions: Sequence[object] | None = None) -> None:
        super().__init__()
        self.fs_args = FileSystemWriterArgs(
            single_file_per_rank=single_file_per_rank, per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict, serialization_format=serialization_format,
            extensions=tuple(_extensions or ()))
        opts = WriterOptions(
            overwrite=overwrite, thread_count=thread_count, host_cache_bytes=host_cache_bytes,
            device_cache_bytes=device_cache_bytes, allow_pickle=allow_pickle, sync_files=sync_files,
            storage_options=storage_options, async_mode=async_mode,
            persist_to=url_tuple(persist_to),
            persist=persist, persist_options=persist_options, o_direct=o_direct,
            incremental_base=incremental_base, incremental_base_save_id=incremental_base_save_id,
            dedup_unit_bytes=dedup_unit_bytes,
            step_barrier_s=step_barrier_s, eager_copy_bytes=eager_copy_bytes, snapshot=snapshot,
            compression=compression or self.fs_args.compression, replicas=replicas, node=node)
        cache_bytes = host_cache_bytes or default_host_cache_bytes()
        self.options = dataclasses.replace(opts, host_cache_bytes=cache_bytes)
        prepare_host_cache(cache_bytes)  # in the background: ready for the first save
        if async_mode != "process":  # there, the level lives in DCP's checkpoint process
            prepare_device_cache(device_cache_bytes)
        self.path = None if path is None else str(path)
        self.rank, self.is_coordinator, self.use_collectives = 0, True, True
        self.save_id = uuid.uuid4().hex[:12]
        self.sessions = WriterSessions()  # one save at a time through this writer
        self._save: RankSave | None = None  # the save whose calls run now, or the last one
        self.process_group = process_group
        self.replication = WriterReplicas(self.options.replicas, self.options.node,
                                          self.options.async_mode == "process", process_group)

    @property
    def async_mode(self) -> str | None:
        """``"process"`` when saves run in DCP's checkpoint process (``dcp_datastates.async_save``
        sets it from the checkpointer type it is given)."""
        return self.options.async_mode

    @async_mode.setter
    def async_mode(self, mode: str | None) -> None:
        self.options = dataclasses.replace(self.options, async_mode=mode)

    @property
    def last_stats(self) -> dict[str, int]:
        """Byte counts of the last save on this rank (``bytes_written``, ``bytes_reused``...)."""
        return {} if self._save is None else self._save.stats

    @property
    def last_timings(self) -> dict[str, float]:
        """The engine's stage timings of the last save on this rank."""
        return {} if self._save is None else self._save.timings

    @property
    def _job(self) -> SaveJob | None:
        """The engine job of the save in flight, until its data is durable."""
        return None if self._save is None else self._save.job

    # ------------------------------------------------------------ AsyncStager
    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        """Start a lazy snapshot: copy the small tensors now (``eager_copy_bytes``), the rest
        later; return the state dict DCP saves.  Waits while a previous save through this
        writer still runs (``session.SaveSlot``).  DCP makes the staged save's calls in another
        thread (or process); a save from this thread meanwhile waits for it."""
        return self.sessions.begin_async(state_dict, self.options, self.path)

    def synchronize_staging(self) -> None:
        self.wait_snapshot()

    def close(self) -> None:
        """Nothing to release: the engine and cache are per process and reused."""

    def release_failed(self, paths: Sequence[str]) -> None:
        """Saves into ``paths`` failed (their futures raised): the process that runs this
        writer's save lets their claims go first (``WriterSessions.release_failed``)."""
        self.sessions.release_failed(paths)

    def attach(self, future) -> None:
        """Let :meth:`wait_snapshot` see failures that happen before ``write_data``."""
        self.sessions.attach(future)

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Block until the current async save has copied every byte out of the live state; then
        training may mutate it.  False only on timeout; raises if the save failed."""
        s = self.sessions.current
        return True if s is None or not s.lazy else s.wait_snapshot(timeout)

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Block until the last save reached every ``persist_to`` tier (coordinator: committed
        there; other ranks: uploaded).  False on timeout; raises if the flush failed."""
        s = self.sessions.current
        return True if s is None or not self.options.flushing else s.wait_persisted(timeout)

    def timings(self) -> dict[str, float]:
        """Seconds from the last save's call to each stage it reached (``snapshot_done_s``...)."""
        s = self.sessions.current
        return {} if s is None else s.timings()

    # ---------------------------------------------------------- StorageWriter
    def reset(self, checkpoint_id=None) -> None:
        self.sessions.begin_sync(self.path)
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        if self.path is None:
            raise CheckpointError("DataStatesWriter has no path: pass one to the constructor "
                                  "or give dcp.save a checkpoint_id")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        if self._save is not None:
            self._save.release()  # a previous save through this writer that DCP abandoned
        self.save_id = uuid.uuid4().hex[:12]
        if not self.use_collectives:
            self.save_id = SAVE_IDS.agree(self.save_id)
        self.sessions.set_up(self.path)
        self.replication.set_up(self.path, is_coordinator, self.use_collectives)
        self._save = RankSave(path=self.path, tier=StorageTier(self.path, self.options.storage_options),
                              opts=self.options, rank=self.rank, is_coordinator=is_coordinator,
                              use_collectives=self.use_collectives, save_id=self.save_id,
                              end=self.sessions.end)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        with self._failing() as save:
            save.plan_local()
        return self.replication.local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        with self._failing() as save:
            save.claim()
        base = save.planned_base()
        if len(plans) == 1 and not self.use_collectives:
            return [dataclasses.replace(plans[0], storage_data=PlannedSave(self.rank, self.save_id, base))]
        epoch = self.replication.epoch(plans)
        return [dataclasses.replace(p, storage_data=PlannedSave(i, self.save_id, base, epoch))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written: Future = Future()
        try:
            with self._failing() as save:
                sd = plan.storage_data
                if not isinstance(sd, PlannedSave):  # no global plan of this writer's (DCP replayed one)
                    sd = PlannedSave(self.rank, self.save_id, save.planned_base())
                self.rank = sd.rank
                self.save_id = SAVE_IDS.fresh(sd.save_id, self.save_id, coordinator=self.is_coordinator,
                                              path=self.path)
                rules = getattr(planner, "rules", None)
                save.take_plan(sd, self.save_id, rules if self.use_collectives and isinstance(rules, RuleTable) else None)
                written = save.write(plan, planner, self.sessions.session(), on_failed=lambda e: self._fail(e, save))
                return written
        except BaseException as e:
            written.set_exception(e)
            raise
        finally:
            if (save := self._save) is not None:
                self.replication.queue(save.tier, save.save_id, written, save.hold, save.replica_epoch)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with self._failing() as save:
            save.commit(metadata, results, self.sessions.current)
            self.sessions.end()
        self.replication.committed(metadata)

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Wait until the last save through this writer is replicated (``replicas``); False when
        it ended degraded or did not commit (the log says why).  In DCP's PROCESS mode the
        replicas are sent from its checkpoint process, and this returns at once."""
        return self.replication.wait(timeout, self.path, self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never auto-selected by DCP; users pass the writer explicitly

    # --------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _failing(self) -> Iterator[RankSave]:
        """The save whose calls run now; if the block raises, the save is marked failed and its
        claims let go."""
        save = self._save
        if save is None:
            raise CheckpointError("DCP called the writer before set_up_storage_writer", checkpoint=self.path)
        try:
            yield save
        except BaseException as e:
            self._fail(e, save)
            raise

    def _fail(self, e: BaseException, save: RankSave | None = None) -> None:
        self.sessions.fail(e)
        self.replication.committed(None)  # nothing committed: the other ranks replicate nothing
        save = save or self._save
        if save is not None:
            save.release()

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_save"] = None  # a save belongs to the process that made it; the daemon makes its own
        d["process_group"] = None  # the daemon's group is its default one (and its own replicator)
        return d


def checked_writer_options(options: dict, owner: str, also: Iterable[str] = ()) -> dict:
    """``options`` for ``DataStatesWriter``, given to ``owner`` (a ``Checkpointer``, an
    integration), checked now: a misspelled name (``also``: the owner's own names, offered as
    suggestions) or a value the writer refuses fails with one line naming ``owner``, not at the
    first save hundreds of steps later."""
    known = set(inspect.signature(DataStatesWriter.__init__).parameters) - {"self", "path"}
    for name in options:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known | set(also)), n=1)
            raise ValueError(f"{owner} got an unknown option {name!r}"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + "; see docs/configuration.md for the options it takes")
    fields = {f.name for f in dataclasses.fields(WriterOptions)}
    try:
        WriterOptions(**{k: v for k, v in options.items() if k in fields})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{owner}: {first_line(e)}") from None
    return dict(options)
