"""Megatron-Core's ``dist_checkpointing`` (Megatron-LM, Megatron-Bridge, NeMo 2) with
dcp-datastates as the storage of its sharded checkpoints.  Switch with one argument::

    from dcp_datastates.integrations.megatron import DataStatesSaveStrategy
    strategy = DataStatesSaveStrategy()                    # once; options: DataStatesWriter's
    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=strategy)
    # Megatron-LM: checkpointing_context["save_strategy"] = strategy

``torch_dist``, Megatron's DCP format, translates Megatron's ``ShardedTensor``\\ s into DCP's
and saves them with ``FileSystemWriterAsync``: a plan in the trainer, the writes in a
checkpoint worker (a forked process or a persistent one), a finalize on every rank.  This
strategy translates as ``torch_dist`` does (Megatron's own functions and planner) and saves
through ``DataStatesWriter`` instead, with DCP's ``async_save`` in a thread of the trainer: the
state is copied out while training goes on, and the request it hands Megatron is done, in the
checkpoint worker, once the save is committed on every rank.  Synchronous saves
(``async_sharded_save=False``) run the same request to its end.

The checkpoint's ``metadata.json`` names the backend ``datastates``; importing this module
registers :class:`DataStatesLoadStrategy` as Megatron's load strategy for it, so Megatron-LM's
own ``load_checkpoint`` (which asks the registry) reads it.  The load strategy reads DCP's own
format too, through DCP's ``FileSystemReader``: a job saved with ``torch_dist`` before the
switch resumes.  :func:`to_torch_dist` makes a checkpoint of ours one that Megatron reads
without this package (the switch back).

Training may change the state once the save's snapshot is complete: pass the optimizer
(``DataStatesSaveStrategy(optimizer=opt)``) and only its next ``step()`` waits for it (a step
pre-hook, the lazy snapshot); without one, ``async_save`` returns once the state is copied out,
as ``torch_dist``'s own preload does.  Only the Megatron-Core versions this was tested with are
accepted (``TESTED``); another raises a one-line ``RuntimeError``.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from concurrent.futures import Future
from multiprocessing import Pipe
from pathlib import Path
from typing import cast

import megatron.core.dist_checkpointing.strategies.torch as mcore_torch  # pyright: ignore[reportMissingImports] (optional: its own venv)
from megatron.core.dist_checkpointing.core import (  # pyright: ignore[reportMissingImports] (optional: its own venv)
    CheckpointingConfig,
    maybe_load_config,
    save_config,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest  # pyright: ignore[reportMissingImports] (optional: its own venv)
from megatron.core.dist_checkpointing.strategies.base import (  # pyright: ignore[reportMissingImports] (optional: its own venv)
    StrategyAction,
    register_default_strategy,
)

from .. import convert, process_state
from ..save.guard import async_save
from ..save.writer import checked_writer_options
from . import routing
from .routing import ours_while, reader_for, writer_for

log = logging.getLogger(__name__)

TESTED = ("0.16",)  # megatron-core major.minor versions the strategies were tested with
BACKEND, VERSION = "datastates", 1  # what metadata.json names; the registry's key
TORCH_DIST = "torch_dist"


def check_version(version: str | None = None) -> str:
    """The installed Megatron-Core's version, where it is one of ``TESTED``; else ``RuntimeError``."""
    return routing.check_version("megatron-core", TESTED, "keep Megatron's torch_dist strategy", version)


def _wait(done) -> None:  # a Connection (typeshed calls Pipe's ends PipeConnection on Windows)
    """The request's work, in Megatron's checkpoint worker (or, saving synchronously, here):
    wait for the byte the trainer sends once the save ended.  Never raises: the error is the
    finalize's to raise, on every rank."""
    try:
        done.recv_bytes()
    except (EOFError, OSError):  # the trainer closed it: the save ended without a word
        log.debug("save's end signalled by a closed pipe")


class _SaveEnd:
    """One save's end, in a form Megatron's worker can wait on: a pipe whose reading end goes
    with the request (inherited by a forked worker, sent to a persistent one) and whose writing
    end gets a byte when the save's future completes, committed or failed."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.reading, self._writing = Pipe(duplex=False)
        future.add_done_callback(self._signal)

    def _signal(self, _future: Future) -> None:
        try:
            self._writing.send_bytes(b"1")
        except OSError as e:  # the worker is gone; the finalize still reports the save's outcome
            log.warning("could not tell Megatron's checkpoint worker the save ended: %s", e)

    def finalize(self) -> None:
        """On every rank, after every worker is done: the save's outcome (raises its error)."""
        try:
            self.future.result()
        finally:
            self.reading.close()
            self._writing.close()


class DataStatesSaveStrategy(mcore_torch.TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy, saving through ``DataStatesWriter``.

    ``keep_only_main_replica`` is ``torch_dist``'s; ``process_group``: the group DCP's
    collectives of the background save use (default: a gloo group of every rank, made at the
    first save, so that they never share a communicator with training); ``optimizer``: whose
    next ``step()`` waits for the snapshot; every other keyword is ``DataStatesWriter``'s."""

    def __init__(self, *, keep_only_main_replica: bool = True, process_group=None, optimizer=None,
                 **datastates_options) -> None:
        check_version()
        self.datastates_options = checked_writer_options({"overwrite": True, **datastates_options},
                                                         type(self).__name__)
        super().__init__(BACKEND, VERSION, keep_only_main_replica=keep_only_main_replica)
        self.process_group = process_group
        self._writer = None  # the newest save's, for wait_snapshot
        self._hook = None if optimizer is None else optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, *_args, **_kwargs) -> None:
        self.wait_snapshot()

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Training may change the saved state once this returns (raises if the save failed)."""
        return True if self._writer is None else self._writer.wait_snapshot(timeout)

    def async_save(self, sharded_state_dict, checkpoint_dir: Path) -> AsyncRequest:
        state, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica)
        planner = mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                               flatten_state_dict=False)
        writer = writer_for(checkpoint_dir, self.datastates_options)
        if self.process_group is None:
            self.process_group = process_state.checkpoint_group()
        future = cast(Future, async_save(mcore_torch.mcore_to_pyt_state_dict(state, False), storage_writer=writer,
                                         planner=planner, process_group=self.process_group))  # THREAD mode
        self._writer = writer
        end = _SaveEnd(future)
        if self._hook is None:  # no optimizer to hold back: the state is out before training goes on
            writer.wait_snapshot()
        return AsyncRequest(functools.partial(_wait, end.reading), (), [end.finalize])

    def close(self) -> None:
        """Unhook the optimizer."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _reader(checkpoint_dir, cache_metadata: bool = False):
    return reader_for(checkpoint_dir)


class DataStatesLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """Megatron's ``torch_dist`` load strategy, reading through ``DataStatesReader`` (or DCP's
    ``FileSystemReader``, for a checkpoint in DCP's own format: ``torch_dist``'s)."""

    def __init__(self) -> None:
        check_version()
        super().__init__()

    def _ours(self):
        return ours_while({}, {mcore_torch._get_filesystem_reader: _reader})

    def load(self, sharded_state_dict, checkpoint_dir: Path):
        with self._ours():
            return super().load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata=None):
        with self._ours():
            return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path):
        with self._ours():
            return super().load_sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str):
        raise NotImplementedError(f"{checkpoint_dir}: removing tensors from a dcp-datastates checkpoint is not "
                                  "supported; convert it with to_torch_dist first")


def to_torch_dist(src: str, dst: str) -> None:
    """Make ``dst`` a ``torch_dist`` checkpoint of what ``src`` (saved with
    :class:`DataStatesSaveStrategy`) holds, readable by Megatron without this package: the
    tensors and objects in DCP's ``FileSystemWriter`` format (``convert.to_dcp``), Megatron's
    ``common.pt`` and other files of its own copied, ``metadata.json`` naming ``torch_dist``."""
    config = maybe_load_config(src)
    if config is None or config.sharded_backend != BACKEND:
        raise ValueError(f"{src}: not a Megatron checkpoint saved with dcp-datastates "
                         f"(metadata.json names {getattr(config, 'sharded_backend', None)!r})")
    convert.to_dcp(src, dst)
    ours = set(os.listdir(dst))
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name.endswith(".pt") and name not in ours and os.path.isfile(path):  # Megatron's common.pt
            shutil.copyfile(path, os.path.join(dst, name))
    save_config(CheckpointingConfig(TORCH_DIST, config.sharded_backend_version,
                                    config.common_backend, config.common_backend_version), dst)


register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, DataStatesLoadStrategy())

__all__ = ["BACKEND", "TESTED", "DataStatesLoadStrategy", "DataStatesSaveStrategy", "check_version", "to_torch_dist"]
