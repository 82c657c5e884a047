"""dcp-datastates: a lazy, multi-tier storage backend for torch.distributed.checkpoint."""

from ._version import __version__
from .checkpointer import Checkpointer  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointBusyError,
    CheckpointError,
    CheckpointExistsError,
    ChecksumMismatch,
    CoverageError,
    DataFileError,
    ManifestError,
    MissingKeyError,
    NotACheckpointError,
    PickleNotAllowedError,
    ProviderError,
    SnapshotError,
    TornSnapshotError,
    UnsupportedFormatVersion,
    UnsupportedValueError,
)
from .guard import SnapshotGuard, async_save  # noqa: E402
from .planner import DataStatesLoadPlanner, DataStatesSavePlanner  # noqa: E402
from .providers import TypeProvider, register_provider, unregister_provider  # noqa: E402
from .reader import DataStatesReader  # noqa: E402
from .writer import DataStatesWriter  # noqa: E402

__all__ = [
    "CheckpointError", "CheckpointExistsError", "Checkpointer", "ChecksumMismatch", "CoverageError",
    "DataStatesLoadPlanner", "DataStatesSavePlanner",
    "DataFileError", "DataStatesReader", "DataStatesWriter", "ManifestError", "MissingKeyError",
    "NotACheckpointError", "PickleNotAllowedError", "ProviderError", "SnapshotError",
    "SnapshotGuard", "TornSnapshotError", "CheckpointBusyError",
    "TypeProvider", "UnsupportedFormatVersion", "UnsupportedValueError", "__version__",
    "async_save", "register_provider", "unregister_provider",
]
