"""torchtitan with dcp-datastates as its checkpoint backend (tested with torchtitan 0.3.0).

Activate it without touching torchtitan, with its override mechanism::

    torchrun ... -m torchtitan.train ... --checkpoint.enable \\
        --override.imports dcp_datastates.integrations.torchtitan.use_datastates

The writer's options are the override's kwargs (torchtitan parses ``target=<json>``)::

    --override.imports 'dcp_datastates.integrations.torchtitan.use_datastates={"host_cache_bytes": 4294967296, "thread_count": 4}'

``DataStatesCheckpointManager`` subclasses torchtitan's ``CheckpointManager`` and

* saves through ``DataStatesWriter`` and loads through ``DataStatesReader`` (``dcp_save`` /
  ``dcp_load``), in every ``--checkpoint.async_mode``: ``disabled`` is a synchronous save;
  ``async`` is a THREAD-mode lazy snapshot; ``async_with_pinned_mem`` is a PROCESS-mode lazy
  snapshot (the host cache is pinned when a GPU is used);
* maps ``maybe_wait_for_staging()``, which torchtitan calls right before ``optimizer.step()``,
  onto ``wait_snapshot()`` in both async modes, so the optimizer never mutates state that is
  still being copied;
* keeps torchtitan's discovery (``step-N/.metadata``: our manifest, committed last) and its
  purge, counting only committed steps and never the save in flight.

HuggingFace exports (``last_save_in_hf``, ``initial_load_in_hf``) go to torchtitan's own code.
"""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpointer import CheckpointManager  # pyright: ignore[reportMissingImports] (optional: its own venv)
from torchtitan.components.checkpointer.dcp import AsyncMode  # pyright: ignore[reportMissingImports] (optional: its own venv)
from torchtitan.config.override import derive, override  # pyright: ignore[reportMissingImports] (optional: its own venv)
from torchtitan.tools import filesystem  # pyright: ignore[reportMissingImports] (optional: its own venv)
from torchtitan.tools.logging import logger  # pyright: ignore[reportMissingImports] (optional: its own venv)
from torchtitan.tools.utils import GarbageCollection  # pyright: ignore[reportMissingImports] (optional: its own venv)

from ..engine.device_cache import prepare_device_cache
from ..engine.host_cache import default_host_cache_bytes, prepare_host_cache
from ..format.names import MANIFEST_NAME
from ..load.reader import DataStatesReader
from ..planner import DataStatesLoadPlanner, DataStatesSavePlanner
from ..save.guard import async_save
from ..save.writer import DataStatesWriter
from ..tiers import StorageTier
from ..tiers.manifests import manifest_is_ours

log = logging.getLogger(__name__)

MODEL = "model"


class _NoStager:
    def close(self) -> None:
        pass


class DataStatesCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` saving through ``DataStatesWriter`` (lazy snapshots,
    the bounded host cache) and loading through ``DataStatesReader``; everything else
    (discovery, retention, the training loop's calls) is torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        host_cache_bytes: int = 0
        """Host staging cache per process in bytes (0: dcp-datastates' default, 2 GiB)."""

        thread_count: int = 4
        """Flush threads per rank."""

        device_cache_bytes: int = 0
        """A first cache level on the GPU, per process, in bytes (0: off; see
        ``docs/configuration.md``): the snapshot then ends after a device-to-device copy."""

        compression: str = ""
        """``"zstd"``: tensors stored as compressed 1 MiB blocks ("": as they are; see
        ``docs/configuration.md`` for when it pays)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self._ds_config = config
        if self.enable:
            cache = config.host_cache_bytes or default_host_cache_bytes()
            prepare_host_cache(cache)  # in the background, so the first checkpoint finds it ready
            if str(config.async_mode) == "async":  # THREAD saves; PROCESS mode's is in its daemon
                prepare_device_cache(config.device_cache_bytes)
            logger.info(f"dcp-datastates checkpointing: host cache {cache >> 20} MiB, device cache "
                        f"{config.device_cache_bytes >> 20} MiB, {config.thread_count} flush threads per rank")
        self._ds_writer: DataStatesWriter | None = None
        self._ds_inflight: str | None = None
        # torchtitan builds a pinned DefaultStager for async_with_pinned_mem when this is None;
        # we stage lazily ourselves, so give it a stand-in that is never used.
        self.stager = _NoStager()

    # ------------------------------------------------------------------ save
    def dcp_save(self, state_dict, checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False):
        """Save ``state_dict`` to ``checkpoint_id`` with a fresh ``DataStatesWriter`` (HF exports
        stay torchtitan's)."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        writer = DataStatesWriter(
            checkpoint_id, overwrite=True, thread_count=self._ds_config.thread_count,
            host_cache_bytes=self._ds_config.host_cache_bytes or None,
            device_cache_bytes=self._ds_config.device_cache_bytes,
            compression=self._ds_config.compression or None,
            async_mode="process" if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM else None)
        self._ds_writer = writer
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=writer, planner=DataStatesSavePlanner())
            if enable_garbage_collection:
                GarbageCollection.collect("GC collection invoked by checkpointer.")
            return None
        kind = (AsyncCheckpointerType.PROCESS if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
                else AsyncCheckpointerType.THREAD)
        self._ds_inflight = checkpoint_id
        upload = async_save(state_dict, storage_writer=writer, process_group=self.pg,
                            planner=DataStatesSavePlanner(), async_checkpointer_type=kind)
        assert isinstance(upload, Future), "DCP returns a plain future without an async stager"
        upload.add_done_callback(lambda _f: setattr(self, "_ds_inflight", None))
        if async_mode == AsyncMode.ASYNC:
            return upload
        # torchtitan expects (staging, upload) here: staging completes at the snapshot
        staging: Future = Future()

        def snapshot() -> None:
            try:
                writer.wait_snapshot()
                staging.set_result(None)
            except BaseException as e:  # noqa: BLE001 - delivered through torchtitan's staging future
                staging.set_exception(e)
        threading.Thread(target=snapshot, daemon=True, name="dcpds-titan-staging").start()
        return AsyncSaveResponse(staging_completion=staging, upload_completion=upload)

    def _maybe_wait_for_staging(self) -> None:
        """Called by torchtitan right before ``optimizer.step()``: the lazy-snapshot barrier."""
        if self._ds_writer is not None:
            self._ds_writer.wait_snapshot()
        super()._maybe_wait_for_staging()

    # ------------------------------------------------------------------ load
    def dcp_load(self, state_dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load ``checkpoint_id`` with ``DataStatesReader`` and ``DataStatesLoadPlanner`` (HF
        imports stay torchtitan's)."""
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        if manifest_is_ours(StorageTier(checkpoint_id)) is False:
            # a step saved before the run switched to dcp-datastates: DCP's own format
            logger.info("%s is in DCP's own format (saved before this run used dcp-datastates); "
                        "loading it with DCP's reader", checkpoint_id)
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, storage_reader=DataStatesReader(checkpoint_id), planner=DataStatesLoadPlanner())
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    # ----------------------------------------------------------------- purge
    def _purge_stale_checkpoints(self):
        """Keep the newest ``keep_latest_k`` *committed* steps; the save in flight and steps
        without a committed manifest never count (torchtitan's own purge counts both)."""
        if not self._should_purge():
            return
        committed = []
        for name in filesystem.listdir(self.folder):
            m = re.fullmatch(r"step-(\d+)", name)
            if not m:
                continue
            path = filesystem.join(self.folder, name)
            if path == self._ds_inflight:
                continue
            if filesystem.isfile(filesystem.join(path, MANIFEST_NAME)):
                committed.append((int(m.group(1)), path))
        committed.sort()
        if self.purge_thread is None:  # torchtitan starts it whenever keep_latest_k > 0
            return
        for _, path in committed[: -self.keep_latest_k]:
            self.purge_queue.put(path)


@override(target=CheckpointManager.Config, exact=True,
          description="use dcp-datastates as the DCP storage backend")
def use_datastates(cfg: CheckpointManager.Config, *, host_cache_bytes: int = 0,
                   thread_count: int = 4, device_cache_bytes: int = 0) -> DataStatesCheckpointManager.Config:
    """The checkpoint config, as dcp-datastates' manager.  The writer's options come as the
    override's kwargs: ``--override.imports
    'dcp_datastates.integrations.torchtitan.use_datastates={"host_cache_bytes": 4294967296}'``."""
    new = derive(cfg, DataStatesCheckpointManager.Config)
    new.host_cache_bytes = int(host_cache_bytes)
    new.thread_count = int(thread_count)
    new.device_cache_bytes = int(device_cache_bytes)
    return new


__all__ = ["DataStatesCheckpointManager", "use_datastates"]
