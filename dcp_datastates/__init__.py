"""dcp-datastates: a lazy, multi-tier storage backend for torch.distributed.checkpoint."""

from ._version import __version__
from .errors import (
    CheckpointBusyError,
    CheckpointError,
    CheckpointExistsError,
    ChecksumMismatch,
    ClaimLostError,
    CoverageError,
    DataFileError,
    ManifestError,
    MissingKeyError,
    NotACheckpointError,
    PickleNotAllowedError,
    ProviderError,
    SnapshotError,
    StorageFailedError,
    TornSnapshotError,
    UnsupportedFormatVersion,
    UnsupportedValueError,
)
from .load.reader import DataStatesReader
from .planner import DataStatesLoadPlanner, DataStatesSavePlanner
from .providers import TypeProvider, register_provider, unregister_provider
from .run.checkpointer import Checkpointer
from .save.guard import SnapshotGuard, async_save
from .save.writer import DataStatesWriter

__all__ = [
    "CheckpointError", "CheckpointExistsError", "Checkpointer", "ChecksumMismatch", "CoverageError",
    "DataStatesLoadPlanner", "DataStatesSavePlanner",
    "DataFileError", "DataStatesReader", "DataStatesWriter", "ManifestError", "MissingKeyError",
    "NotACheckpointError", "PickleNotAllowedError", "ProviderError", "SnapshotError",
    "SnapshotGuard", "StorageFailedError", "TornSnapshotError", "CheckpointBusyError", "ClaimLostError",
    "TypeProvider", "UnsupportedFormatVersion", "UnsupportedValueError", "__version__",
    "async_save", "register_provider", "unregister_provider",
]
