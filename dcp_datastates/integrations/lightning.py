"""Lightning's Trainer with dcp-datastates as the storage of its distributed checkpoints.
Switch with one argument::

    from dcp_datastates.integrations.lightning import DataStatesModelParallelStrategy
    trainer = Trainer(strategy=DataStatesModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))

``ModelParallelStrategy`` (FSDP2 and tensor parallelism over DTensor) saves a distributed
checkpoint as a directory: the model and optimizer shards through DCP (its helpers in
``lightning.fabric.strategies.fsdp``, ``dcp.save(state, checkpoint_id=path)``), and the rest of
Lightning's checkpoint (loops, callbacks, hyperparameters) as ``meta.pt`` with ``torch.save``.
Lightning refuses a ``CheckpointIO`` plugin for it; a strategy subclass is its supported route.
This one runs Lightning's own ``save_checkpoint`` and ``load_checkpoint`` with DCP's storage
ours for the length of the call (``routing.py``): the shards go through ``DataStatesWriter``
(``datastates_options`` are its options) and come back through ``DataStatesReader``, or DCP's
``FileSystemReader`` for a checkpoint saved before the switch.  ``meta.pt`` stays Lightning's.

What differs from Lightning's default: a save into a directory that holds a checkpoint replaces
it only once the new one is committed, every block is checksummed and checked on load, and
values are never pickled by us (``meta.pt`` is Lightning's ``torch.save``).  Saves stay
synchronous, as Lightning makes them.  Only the Lightning versions this was tested with are
accepted (``TESTED``); another raises a one-line ``RuntimeError``.  ``FSDPStrategy`` (FSDP1)
runs only on a GPU in Lightning and is not covered yet.
"""

from __future__ import annotations

from pathlib import Path

import lightning.fabric.strategies.fsdp as fabric_fsdp  # pyright: ignore[reportMissingImports] (optional: its own venv)
import lightning.fabric.strategies.model_parallel  # noqa: F401  # pyright: ignore[reportMissingImports] (optional: its own venv)
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy  # pyright: ignore[reportMissingImports] (optional: its own venv)

from ..save.writer import checked_writer_options
from . import routing
from .routing import ours_while, reader_for, writer_for

TESTED = ("2.6",)  # lightning major.minor versions the strategy was tested with


def check_version(version: str | None = None) -> str:
    """The installed Lightning's version, where it is one of ``TESTED``; else ``RuntimeError``."""
    return routing.check_version("lightning", TESTED, "use Lightning's own ModelParallelStrategy", version)


class DataStatesModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (every argument its own), whose distributed
    checkpoints go through dcp-datastates; ``datastates_options``: ``DataStatesWriter``'s."""

    def __init__(self, *args, datastates_options: dict | None = None, **kwargs) -> None:
        check_version()
        self.datastates_options = checked_writer_options({"overwrite": True, **(datastates_options or {})},
                                                         type(self).__name__)
        super().__init__(*args, **kwargs)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        with ours_while(self.datastates_options, self._helpers()):
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        with ours_while(self.datastates_options, self._helpers()):
            return super().load_checkpoint(checkpoint_path, weights_only)

    def _helpers(self) -> dict:
        options = self.datastates_options

        def save(state: dict, path: Path) -> None:
            dcp.save(state, storage_writer=writer_for(path, options))

        def load(state: dict, path: Path) -> None:
            dcp.load(state, storage_reader=reader_for(path))
        return {fabric_fsdp._distributed_checkpoint_save: save, fabric_fsdp._distributed_checkpoint_load: load}


__all__ = ["TESTED", "DataStatesModelParallelStrategy", "check_version"]
