"""``DataStatesReader``: DCP's ``StorageReader`` for the dcp-datastates format.

DCP's adapter only: it turns DCP's calls into one ``LoadPipeline`` per load
(``load/pipeline.py``: where the bytes come from, cooperation, the retry policy), tells DCP
what the manifest holds (``load/metadata.py``) and checks, on the coordinator, that every rank
restores one save of one checkpoint (``load/plans.py``).  Nothing read from storage is ever
unpickled unless the reader was built with ``allow_pickle=True``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..engine.upload import HostUpload
from ..errors import NotACheckpointError, PeerLoadError
from ..format import Manifest
from ..gcpause import paused_gc
from ..replicas.repair import NodeRepair
from ..tiers.manifests import checkpoint_name
from ..tiers.storage import url_tuple
from .cooperative import cooperative_for
from .files import ReadStats
from .metadata import manifest_to_metadata
from .pipeline import LoadPipeline, LoadSettings, Sources
from .plans import LoadTerms, ManifestServed, one_save
from .reads import ReadOptions

__all__ = ["DataStatesReader", "LoadTerms", "ManifestServed"]


class DataStatesReader(StorageReader):
    """Load checkpoints written by :class:`DataStatesWriter`.

    Args:
        path: checkpoint directory (local path or fsspec URL); may be omitted
            when ``checkpoint_id`` is passed to ``dcp.load``.
        thread_count: parallel ranged reads.
        allow_pickle: allow values that were saved with ``allow_pickle=True``.
            Off by default: loading such a checkpoint raises ``PickleNotAllowedError``.
        verify: check block checksums of every byte read (on by default).
        storage_options: passed to fsspec for URLs.
        fallback: slower copies of the same checkpoint (persistent tiers), in order.  The
            manifest comes from the first tier holding a valid committed one; each byte range
            is read from the first tier whose file is present and passes its checksums, so a
            missing, partial or corrupt fast copy falls back per file, per rank.
        fallback_options: fsspec storage options for the ``fallback`` URLs.
        o_direct: read cold ranges of local files with O_DIRECT into a per-thread staging
            buffer of huge pages, then copy them into place (``tiers/direct_io.py`` says why
            this beats both buffered reads and O_DIRECT into the destination).  Ranges mostly
            in the page cache already, ranges under 256 KiB and file systems that refuse
            O_DIRECT are read buffered.  ``"auto"`` (the default): the first load of 512 MiB or
            more from a file system measures both paths on it and keeps the faster for the
            process (``tiers/read_path.py``); ``True``: always O_DIRECT; ``False``: buffered.
        save_id: load only this save: a tier whose manifest is another save of the path (a
            node-local copy an earlier attempt left) is not read.  Whatever it is, ranks that
            read manifests of different saves fail the load before reading any byte.
        cooperative: each stored block the job needs is read from storage by one rank and sent
            to the others that need it (``load/cooperative.py``): HSDP replicas and
            replicated parameters are then read once per job, not once per rank.  ``"auto"``
            (the default): on when ``dcp.load`` runs on more than one rank of
            ``process_group``; ``False``: every rank reads for itself.
        process_group: the group given to ``dcp.load`` (default: the default group); the
            cooperative load sends over it (over a gloo group of its ranks where its backend
            has no gloo).
        node_local: ``path`` is this node's own directory of a checkpoint saved with
            ``DataStatesWriter(replicas=K)``: before the manifest is read, a node that lacks it
            receives it; before the data is read, each node receives the files its ranks read
            that it lacks or holds damaged (collectives over ``process_group``), from other
            nodes' copies whose bytes match their recorded digests.  ``node``: this rank's node
            (default: ``DCP_DATASTATES_NODE``, ``GROUP_RANK`` or the host name).
        _extension_registry: ``FileSystemReader``'s, accepted so that code written for it runs
            unchanged; without effect, since the manifest records how each block is stored.
    """

    def __init__(self, path: str | None = None, *, thread_count: int = 8, allow_pickle: bool = False,
                 verify: bool = True, storage_options: dict | None = None,
                 fallback: list[str] | str | None = None, fallback_options: dict | None = None,
                 o_direct: bool | str = "auto", save_id: str | None = None,
                 cooperative: bool | str = "auto", process_group=None, node_local: bool = False,
                 node: str | None = None, _extension_registry: object = None,
                 _node_repair: NodeRepair | None = None,
                 _host_uploads: Callable[[], HostUpload] | None = None) -> None:
        super().__init__()
        del _extension_registry  # FileSystemReader's: our manifest names how each block is stored
        if o_direct not in (True, False, "auto"):
            raise ValueError(f"o_direct must be True, False or 'auto', got {o_direct!r}")
        if cooperative not in (True, False, "auto"):
            raise ValueError(f"cooperative must be True, False or 'auto', got {cooperative!r}")
        self.path = None if path is None else str(path)
        self.thread_count = max(1, thread_count)
        self.allow_pickle, self.verify, self.o_direct = allow_pickle, verify, o_direct
        self.storage_options, self.fallback_options = storage_options, fallback_options
        self.fallback = list(url_tuple(fallback))
        self.save_id, self.cooperative, self.process_group = save_id, cooperative, process_group
        self.node_local, self.node = node_local, node
        # ``_host_uploads``: a stand-in for the GPU's uploads into host destinations (tests and
        # the CPU proxy of ``bench_read_paths.py`` run the GPU's streamed path with it)
        self.settings = LoadSettings(ReadOptions(self.thread_count, verify, o_direct, _host_uploads), allow_pickle,
                                     save_id, process_group, node_local, node)
        self._given_repair = _node_repair  # ``Checkpointer``'s, surveyed before the load
        self._pipeline: LoadPipeline | None = None
        self._metadata_failure: Exception | None = None  # why this load's ``read_metadata`` failed

    # what the last load found and did (its pipeline's)
    @property
    def manifest(self) -> Manifest | None:
        return self._pipeline.manifest if self._pipeline is not None else None

    @property
    def manifest_tier(self) -> str | None:
        return self._pipeline.manifest_tier if self._pipeline is not None else None

    @property
    def peer_error(self) -> PeerLoadError | None:
        """A peer that died in this load's exchange (``Checkpointer`` raises it: DCP's own
        collective after ``read_data`` then fails with the process group's error)."""
        return self._pipeline.peer_error if self._pipeline is not None else None

    @property
    def stats(self) -> ReadStats:
        return self._pipeline.stats if self._pipeline is not None else ReadStats()

    @property
    def bytes_read(self) -> int:
        return self.stats.bytes_read

    @property
    def bytes_needed(self) -> int:
        return self.stats.bytes_needed

    @property
    def bytes_direct(self) -> int:
        return self.stats.bytes_direct

    @property
    def served(self) -> dict[str, int]:
        return self.stats.served

    def _new_pipeline(self, *, local: bool = True) -> LoadPipeline:
        if self.path is None:
            raise NotACheckpointError("DataStatesReader has no path: pass one to the constructor "
                                      "or give dcp.load a checkpoint_id")
        sources = Sources(self.path, self.storage_options, tuple(self.fallback), self.fallback_options)
        settings = self.settings if local else dataclasses.replace(self.settings, node_local=False)
        self._pipeline = LoadPipeline(sources, settings, self._given_repair if local else None)
        return self._pipeline

    # --------------------------------------------------------- StorageReader
    def reset(self, checkpoint_id=None) -> None:
        """DCP: start a load; ``checkpoint_id`` (when given) replaces the path."""
        if checkpoint_id is not None and str(checkpoint_id) != self.path:
            self.path = str(checkpoint_id)
            self._given_repair = None  # it was of another directory
        self._pipeline = None
        self._metadata_failure = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """DCP: the committed manifest (fastest tier holding a valid one) as DCP's ``Metadata``;
        with ``node_local``, once every node holds the manifest (``NodeLocalLoad``).

        DCP asks again for a rank's own metadata (``rank=``) on the ranks whose first call
        failed, and on those alone; a checkpoint has no such metadata, so that call fails at
        once with the first call's reason and never joins a collective the other ranks will
        not make (the node-local survey)."""
        if kwargs.get("rank") is not None:
            if self._metadata_failure is not None:
                raise self._metadata_failure
            raise NotACheckpointError("dcp-datastates keeps one manifest per checkpoint, no rank-local "
                                      f"metadata for rank {kwargs['rank']}", checkpoint=self.path)
        try:
            m = self._new_pipeline().open()
        except Exception as e:  # re-raised: kept only to give DCP's second call the same reason
            self._metadata_failure = e
            raise
        with paused_gc():
            return manifest_to_metadata(m, self.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        """DCP: make sure the manifest is loaded (another reader may have read the metadata)."""
        (self._pipeline or self._new_pipeline(local=False)).load_manifest()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """DCP: the plan, telling the coordinator which save this rank's manifest is."""
        if plan.storage_data is not None or self.manifest is None:
            return plan
        return dataclasses.replace(plan, storage_data=ManifestServed(
            self.manifest.save_id, self.manifest_tier, checkpoint_name(self.path or "")))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """DCP: once every rank is shown to load the same save, the plans, each telling its rank
        whether the load is cooperative (``LoadTerms``)."""
        one_save(plans, self.path)
        terms = LoadTerms(cooperative_for(self.cooperative, len(plans), self.process_group, self.path))
        return [dataclasses.replace(p, storage_data=terms) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP: read every item of ``plan`` and hand it to ``planner`` (``LoadPipeline.read``)."""
        pipeline = self._pipeline or self._new_pipeline(local=False)
        terms = plan.storage_data
        pipeline.read(plan, planner, isinstance(terms, LoadTerms) and terms.cooperative)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        """DCP: never chosen automatically; pass the reader explicitly."""
        return False
