"""Lightning (the Trainer and Fabric) with dcp-datastates as the storage of its distributed
checkpoints.  Switch with one argument::

    from dcp_datastates.integrations.lightning import DataStatesModelParallelStrategy
    trainer = Trainer(strategy=DataStatesModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))

One strategy for each Lightning strategy that saves through DCP, taking every argument of
Lightning's own: ``DataStatesModelParallelStrategy`` (the Trainer's ``ModelParallelStrategy``:
FSDP2 and tensor parallelism over DTensor), ``DataStatesFSDPStrategy`` (the Trainer's
``FSDPStrategy``, FSDP1; ``state_dict_type`` defaults to ``"sharded"`` here) and
``DataStatesFabricModelParallelStrategy`` (Fabric's ``ModelParallelStrategy``).  Each saves a
distributed checkpoint as a directory: the model and optimizer shards through DCP (Lightning's
helpers in ``lightning.fabric.strategies.fsdp``, ``dcp.save(state, checkpoint_id=path)``, and
DCP's ``FileSystemReader`` for FSDP1's optimizer state), and the rest of Lightning's checkpoint
(loops, callbacks, hyperparameters) as ``meta.pt`` with ``torch.save``.  Lightning refuses a
``CheckpointIO`` plugin for these strategies; a strategy subclass is its supported route.  Ours
run Lightning's own ``save_checkpoint`` and ``load_checkpoint`` with DCP's storage ours for the
length of the call (``routing.py``): the shards go through ``DataStatesWriter``
(``datastates_options`` are its options) and come back through ``DataStatesReader``, or DCP's
``FileSystemReader`` for a checkpoint saved before the switch.  ``meta.pt`` stays Lightning's.

What differs from Lightning's default: a save into a directory that holds a checkpoint replaces
it only once the new one is committed, every block is checksummed and checked on load, and
values are never pickled by us (``meta.pt`` is Lightning's ``torch.save``).  Saves stay
synchronous, as Lightning makes them.  Only the Lightning versions this was tested with are
accepted (``TESTED``); another raises a one-line ``RuntimeError``.
"""

from __future__ import annotations

from pathlib import Path

import lightning.fabric.strategies.fsdp as fabric_fsdp  # pyright: ignore[reportMissingImports] (optional: its own venv)
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.model_parallel import (  # pyright: ignore[reportMissingImports] (optional: its own venv)
    ModelParallelStrategy as FabricModelParallelStrategy,
)
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # pyright: ignore[reportMissingImports] (optional: its own venv)

from ..save.writer import checked_writer_options
from . import routing
from .routing import ours_while, reader_for, writer_for

TESTED = ("2.6",)  # lightning major.minor versions the strategy was tested with


def check_version(version: str | None = None) -> str:
    """The installed Lightning's version, where it is one of ``TESTED``; else ``RuntimeError``."""
    return routing.check_version("lightning", TESTED, "use Lightning's own ModelParallelStrategy", version)


class _ThroughOurs:
    """Lightning's own ``save_checkpoint``/``load_checkpoint`` of a strategy, with DCP's storage
    (and Lightning's two DCP helpers) ours for the length of the call."""

    datastates_options: dict

    def _take(self, datastates_options: dict | None) -> None:
        check_version()
        self.datastates_options = checked_writer_options({"overwrite": True, **(datastates_options or {})},
                                                         type(self).__name__)

    # the Trainer's strategies and Fabric's take different arguments: each passes on its own
    def save_checkpoint(self, *args, **kwargs):
        with ours_while(self.datastates_options, self._helpers()):
            return super().save_checkpoint(*args, **kwargs)  # pyright: ignore[reportAttributeAccessIssue]

    def load_checkpoint(self, *args, **kwargs):
        with ours_while(self.datastates_options, self._helpers()):
            return super().load_checkpoint(*args, **kwargs)  # pyright: ignore[reportAttributeAccessIssue]

    def _helpers(self) -> dict:
        options = self.datastates_options

        def save(state: dict, path: Path) -> None:
            dcp.save(state, storage_writer=writer_for(path, options))

        def load(state: dict, path: Path) -> None:
            dcp.load(state, storage_reader=reader_for(path))
        return {fabric_fsdp._distributed_checkpoint_save: save, fabric_fsdp._distributed_checkpoint_load: load}


class DataStatesModelParallelStrategy(_ThroughOurs, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (every argument its own), whose distributed
    checkpoints go through dcp-datastates; ``datastates_options``: ``DataStatesWriter``'s."""

    def __init__(self, *args, datastates_options: dict | None = None, **kwargs) -> None:
        self._take(datastates_options)
        super().__init__(*args, **kwargs)


class DataStatesFabricModelParallelStrategy(_ThroughOurs, FabricModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (every argument its own), whose distributed
    checkpoints (``fabric.save``/``fabric.load``) go through dcp-datastates."""

    def __init__(self, *args, datastates_options: dict | None = None, **kwargs) -> None:
        self._take(datastates_options)
        super().__init__(*args, **kwargs)


class DataStatesFSDPStrategy(_ThroughOurs, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1; every argument its own), whose sharded checkpoints
    go through dcp-datastates.  ``state_dict_type`` defaults to ``"sharded"`` here (Lightning's
    default, ``"full"``, saves one ``torch.save`` file on rank 0 and uses no storage of DCP's)."""

    def __init__(self, *args, datastates_options: dict | None = None, state_dict_type: str = "sharded",
                 **kwargs) -> None:
        self._take(datastates_options)
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)  # pyright: ignore[reportCallIssue] (Lightning's, unseen here)


__all__ = ["TESTED", "DataStatesFSDPStrategy", "DataStatesFabricModelParallelStrategy", "DataStatesModelParallelStrategy", "check_version"]
