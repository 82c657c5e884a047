"""Every error dcp-datastates raises on purpose.

All of them subclass :class:`CheckpointError`, itself a plain ``Exception``
(unlike DCP's ``CheckpointException``, which is a ``BaseException``), and each
message names the checkpoint, and where it applies the file and the tensor,
then says what to do next.  They are picklable, so they cross DCP's
``gather_object`` and the PROCESS-mode pipe intact.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every dcp-datastates error."""

    def __init__(self, message: str, *, checkpoint: str | None = None,
                 file: str | None = None, key: str | None = None) -> None:
        parts = [message]
        where = []
        if checkpoint is not None:
            where.append(f"checkpoint={checkpoint}")
        if file is not None:
            where.append(f"file={file}")
        if key is not None:
            where.append(f"tensor={key}")
        if where:
            parts.append("[" + ", ".join(where) + "]")
        super().__init__(" ".join(parts))
        self.reason = message  # the message without where
        self.checkpoint = checkpoint
        self.file = file
        self.key = key

    def __reduce__(self):  # keep keyword fields through pickling
        return (_rebuild, (type(self), self.args[0]))


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first line of ``e``'s message (its type's name where it has none), cut to ``limit``
    characters: for a one-line log record or error that quotes another error.  DCP's
    ``CheckpointException``, whose text names only the ranks that failed, is quoted by the
    cause of its lowest rank's failure."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(cause, BaseException):
            more = len(failures) - 1
            tail = f" (and {more} other rank{'s' if more > 1 else ''})" if more else ""
            return f"rank {rank}: {first_line(cause, limit)}{tail}"
    lines = str(e).splitlines()
    text = lines[0] if lines and lines[0] else type(e).__name__
    return text if limit is None else text[:limit]


def _rebuild(cls, text):
    obj = cls.__new__(cls)
    Exception.__init__(obj, text)
    obj.reason, obj.checkpoint, obj.file, obj.key = text, None, None, None
    return obj


class NotACheckpointError(CheckpointError):
    """The path holds no committed checkpoint (no manifest was ever committed)."""


class ManifestError(CheckpointError):
    """The manifest is truncated, corrupt, hostile, or of an unknown version."""


class UnsupportedFormatVersion(ManifestError):
    """The manifest was written by a newer format this release cannot read."""


class ChecksumMismatch(CheckpointError):
    """Bytes read from storage do not match the checksum recorded at save."""


class DataFileError(CheckpointError):
    """A data file is missing or shorter than the manifest says."""


class CheckpointExistsError(CheckpointError):
    """The destination already holds a committed checkpoint and overwrite is off."""


class UnsupportedValueError(CheckpointError):
    """A non-tensor value cannot be stored without pickle, and pickle is not enabled."""


class PickleNotAllowedError(CheckpointError):
    """The checkpoint holds pickled values and the reader was not given ``allow_pickle=True``."""


class MissingKeyError(CheckpointError):
    """A key requested by the load is absent from the checkpoint."""


class CoverageError(CheckpointError):
    """Part of a destination tensor would stay unfilled after the load."""


class SnapshotError(CheckpointError):
    """The background snapshot or flush of an async save failed."""


class CheckpointBusyError(CheckpointError):
    """Another save holds the checkpoint directory (its claim file is live)."""


class ClaimLostError(CheckpointBusyError):
    """A save no longer holds its directory's claim at its commit or clean-up: it commits and
    removes nothing (the fence)."""


class UnsafeFileError(DataFileError):
    """A checkpoint file is a symlink, a device, a FIFO or otherwise not a regular file."""


class TornSnapshotError(SnapshotError):
    """Live state changed before the lazy snapshot copied it: the save is not committed."""


class ProviderError(CheckpointError):
    """A state provider failed (its ``flatten`` or ``unflatten`` raised), or the checkpoint
    names a provider this process has not registered."""


class ForeignFormatError(ManifestError):
    """The path holds a checkpoint of another format (DCP's own ``FileSystemWriter``)."""


class StorageFailedError(CheckpointError, OSError):
    """A storage operation failed (a full disk, an I/O error, permission denied): the message
    names the tier and the file; still an ``OSError`` (``errno`` kept) for callers that
    handle those."""

    @classmethod
    def of(cls, e: OSError, what: str, *, checkpoint: str, file: str) -> "StorageFailedError":
        err = cls(f"{what} failed: {e.strerror or e}", checkpoint=checkpoint, file=file)
        err.errno = e.errno
        return err


class PeerLoadError(CheckpointError):
    """A cooperative load could not exchange blocks with another rank (it died or hung)."""
