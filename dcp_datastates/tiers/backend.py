"""The storage seam: what a tier's filesystem must do, as two small interfaces.

``Backend`` is a checkpoint directory's filesystem, in the primitives the tiers above it use
(list, stat, read, write-and-commit, remove), each on a full path.  ``Sink`` is one data file
being written by the engine's flush threads.  ``local.py`` implements both on the operating
system's calls (``pwrite`` from any thread, ``fsync``, atomic ``rename``, O_DIRECT);
``remote.py`` on fsspec (sequential writes, commit by writing the object last, since object
stores have no rename).  ``StorageTier`` (``storage.py``) holds one and adds the directory
arithmetic; nothing above it asks which one it holds, except to use a local file descriptor
where one can exist (``local``).

A test injects faults by wrapping a ``Backend`` (or a ``Sink``), never by branches here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Sink:
    """Writes one data file; ``reserve`` and ``pwrite`` may be called from several threads.

    The engine ``reserve``s an aligned range at the end of the file for each piece it is about
    to write (append order, decided when the piece is ready), then ``pwrite``s it there."""

    name: str

    def reserve(self, nbytes: int) -> int: ...
    def pwrite(self, buf, offset: int) -> None: ...
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

    @abstractmethod
    def commit(self, root: str, path: str, tmp_name: str, data: bytes, *, sync: bool) -> None:
        """Publish ``data`` at ``path`` atomically: whole or not at all."""

    @abstractmethod
    def sync_dir(self, root: str) -> None:
        """Make the directory's entries durable (a rename in it, a file created)."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Remove one file; a missing one is not an error."""

    @abstractmethod
    def remove_dir(self, root: str) -> None:
        """Remove an empty directory (``OSError`` where it is not empty)."""
