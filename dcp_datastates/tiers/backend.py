"""The storage seam: what a tier's filesystem must do, as two small interfaces.

``Backend`` is a checkpoint directory's filesystem, in the primitives the tiers above it use
(list, stat, read, write-and-commit, remove), each on a full path.  ``Sink`` is one data file
being written by the engine's flush threads.  ``local.py`` implements both on the operating
system's calls (``pwrite`` from any thread, ``fsync``, atomic ``rename``, O_DIRECT);
``remote.py`` on fsspec (sequential writes, commit by writing the object last, since object
stores have no rename).  ``StorageTier`` (``storage.py``) holds one and adds the directory
arithmetic; nothing above it asks which one it holds, except to use a local file descriptor
where one can exist (``local``).

Claims (``claim.py``) go through it too: ``try_lock`` and ``lock_held`` where the kernel
keeps locks, ``create_exclusive`` where it does not.

A test injects faults by wrapping a ``Backend`` (or a ``Sink``), never by branches here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class LockUnsupported(OSError):
    """The filesystem keeps no kernel locks (an object store; a mount without locks)."""


class HeldLock:
    """A file held under the kernel's lock (exclusive, or shared where asked), released by the kernel when its process
    dies.  ``read``/``write`` are the file's contents; ``still_named`` tells whether the path
    still names this very file (nobody removed or replaced it)."""

    def size(self) -> int: ...
    def read(self) -> bytes: ...
    def write(self, data: bytes) -> None: ...
    def still_named(self) -> bool: ...
    def unlock(self, *, unlink: bool) -> None: ...


class Sink:
    """Writes one data file; ``reserve`` and ``pwrite`` may be called from several threads.

    The engine ``reserve``s an aligned range at the end of the file for each piece it is about
    to write (append order, decided when the piece is ready), then ``pwrite``s it there."""

    name: str

    def reserve(self, nbytes: int) -> int: ...
    def pwrite(self, buf, offset: int, logical: int | None = None) -> None: ...
    def close(self, sync: bool = True) -> int: ...
    def abort(self) -> None: ...


class Backend(ABC):
    """A filesystem holding checkpoint directories; every path is a full path on it."""

    local: bool = False  # whether paths are the operating system's (file descriptors work)

    @abstractmethod
    def join(self, root: str, name: str) -> str:
        """The path of ``name`` inside directory ``root``."""

    @abstractmethod
    def makedirs(self, root: str) -> None: ...

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def entries(self, root: str) -> list[tuple[str, str]]:
        """``(name, kind)`` of the directory's entries without following links; ``kind`` is
        ``"file"``, ``"dir"``, ``"link"`` or ``"other"`` (object stores: files and dirs); empty
        where the directory does not exist."""

    @abstractmethod
    def is_real_dir(self, root: str) -> bool:
        """The directory exists and is not a symbolic link."""

    @abstractmethod
    def listdir(self, root: str) -> list[str]:
        """The directory's entry names, sorted; empty where it does not exist."""

    @abstractmethod
    def open_sink(self, path: str, name: str, *, o_direct: bool, drop_cache: bool) -> Sink: ...

    @abstractmethod
    def read_file(self, path: str, max_bytes: int | None, refuse, url: str) -> bytes:
        """The whole file; ``refuse(size)`` raises where its size is over ``max_bytes``, before
        anything is read."""

    @abstractmethod
    def read_into(self, path: str, offset: int, mv: memoryview, fd: int | None, url: str) -> int:
        """Fill ``mv`` from ``offset``; the bytes read (short only at the end of the file)."""

    def open_read(self, path: str, url: str) -> int | None:
        """A descriptor to read ``path`` through (``read_into``, ``pread``), held by the caller;
        None where this filesystem has none (every read then goes by path).
        ``FileNotFoundError`` where the file is missing."""
        return None

    def open_direct(self, path: str, buffered: int) -> tuple[int, tuple[int, int]] | None:
        """An O_DIRECT descriptor of ``path`` and its alignment needs (memory, offsets), where
        the filesystem takes O_DIRECT on it and it is the file ``buffered`` (from
        ``open_read``) has open; None otherwise."""
        return None

    @abstractmethod
    def commit(self, root: str, path: str, tmp_name: str, data: bytes, *, sync: bool) -> None:
        """Publish ``data`` at ``path`` atomically: whole or not at all."""

    @abstractmethod
    def rename(self, root: str, tmp_path: str, path: str) -> None:
        """Publish the whole, durable file ``tmp_path`` at ``path`` in the same directory
        ``root``, replacing what is there, and make that durable."""

    @abstractmethod
    def sync_dir(self, root: str) -> None:
        """Make the directory's entries durable (a rename in it, a file created)."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Remove one file; a missing one is not an error."""

    @abstractmethod
    def remove_dir(self, root: str) -> None:
        """Remove an empty directory (``OSError`` where it is not empty)."""

    def copy_local(self, src_path: str, path: str, tmp_name: str, size: int, *, pace, piece: int) -> None:
        """Copy ``size`` bytes of the local file ``src_path`` to ``path`` through the temporary
        ``tmp_name`` beside it, inside the kernel; ``pace()`` before each ``piece``.  ``OSError``
        where this filesystem cannot (the caller then streams the bytes)."""
        raise OSError(f"{type(self).__name__} copies no local files")

    def try_lock(self, path: str, *, shared: bool = False) -> HeldLock | None:
        """Open ``path`` (created where missing) and take the kernel's exclusive lock on it
        (a shared one with ``shared``) without waiting; ``None`` where another open file holds
        it in a way that excludes ours.  ``LockUnsupported`` where the filesystem keeps no
        locks."""
        raise LockUnsupported(f"{type(self).__name__} keeps no locks")

    def lock_held(self, path: str) -> bool:
        """Whether some open file holds the kernel's lock on ``path`` (``LockUnsupported``
        where the filesystem keeps none; ``False`` where the file does not exist)."""
        raise LockUnsupported(f"{type(self).__name__} keeps no locks")

    @abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists (False then); as atomic as the
        filesystem allows (``O_EXCL``; S3's conditional create)."""
