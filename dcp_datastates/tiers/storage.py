"""One storage tier: a checkpoint directory on a local or fsspec filesystem.

``StorageTier`` is the directory: its URL, its place among its siblings (a run's steps) and
the operations the layers above use, each delegated to the tier's ``Backend``
(``backend.py``: the storage seam; ``local.py`` and ``remote.py`` implement it).  Paths stay
``str`` URLs end to end.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import fsspec

from ..errors import DataFileError
from ..format.names import TEMP_INFIX, is_manifest_name
from .backend import Backend, Sink
from .local import LocalBackend, temp_name
from .remote import FsspecBackend


def _is_local(fs) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protos or "local" in protos


def _not_a_manifest(name: str) -> str:
    """``name``, which must not be a manifest's: those are committed by ``commit.py`` alone."""
    if is_manifest_name(name):
        raise ValueError(f"{name!r} is a manifest; it is committed through tiers.commit.commit_manifest only")
    return name


def url_tuple(x: Sequence[str] | str | None) -> tuple[str, ...]:
    """One URL, several, or none, as a tuple of strings."""
    return tuple(str(p) for p in ([x] if isinstance(x, str) else x or []))


class StorageTier:
    """A checkpoint directory on one filesystem."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.backend: Backend = LocalBackend() if _is_local(self.fs) else FsspecBackend(self.fs)
        if self.backend.local:
            self.root = os.path.abspath(self.root)

    @property
    def local(self) -> bool:
        """Whether the directory is on the operating system's filesystem (file descriptors work)."""
        return self.backend.local

    def __repr__(self) -> str:
        return f"StorageTier({self.url!r})"

    def __getstate__(self):
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state):
        self.__init__(state["url"], state["storage_options"])

    # ------------------------------------------------------------ directories
    def child(self, name: str) -> "StorageTier":
        """The directory ``name`` inside this one (a step of a run directory)."""
        if self.local:
            return StorageTier(os.path.join(self.root, name), self.storage_options)
        return StorageTier(f"{self.url.rstrip('/')}/{name}", self.storage_options)

    def sibling(self, name: str) -> "StorageTier":
        """The directory ``name`` next to this one (another checkpoint of the same run)."""
        return self.parent().child(name)

    @property
    def name(self) -> str:
        """This directory's own name."""
        return os.path.basename(self.root.rstrip("/")) if self.local else \
            self.url.rstrip("/").rpartition("/")[2]

    def parent(self) -> "StorageTier":
        if self.local:
            return StorageTier(os.path.dirname(self.root), self.storage_options)
        return StorageTier(self.url.rstrip("/").rpartition("/")[0], self.storage_options)

    def path(self, name: str) -> str:
        return self.backend.join(self.root, name)

    # ------------------------------------------------------------- the seam
    def makedirs(self) -> None:
        self.backend.makedirs(self.root)

    def exists(self, name: str) -> bool:
        return self.backend.exists(self.path(name))

    def size(self, name: str) -> int:
        return self.backend.size(self.path(name))

    def entries(self) -> list[tuple[str, str]]:
        """``(name, kind)`` of this directory's entries without following links; ``kind`` is
        ``"file"``, ``"dir"``, ``"link"`` or ``"other"`` (object stores: files and dirs)."""
        return self.backend.entries(self.root)

    def is_real_dir(self) -> bool:
        """This directory exists and is not a symbolic link (local); exists (object stores)."""
        return self.backend.is_real_dir(self.root)

    def listdir(self) -> list[str]:
        return self.backend.listdir(self.root)

    def open_sink(self, name: str, o_direct: bool = False, drop_cache: bool = True) -> Sink:
        """``drop_cache=False`` keeps the written pages cached: a later tier re-reads them."""
        return self.backend.open_sink(self.path(_not_a_manifest(name)), name, o_direct=o_direct,
                                      drop_cache=drop_cache)

    def read_bytes(self, name: str, max_bytes: int | None = None) -> bytes:
        """The whole file ``name``.  Its size is checked against ``max_bytes`` before anything
        is read; locally it must be a regular file reached without a link."""
        def refuse(size: int) -> None:
            raise DataFileError(f"is {size} bytes, over the {max_bytes}-byte limit for this file; "
                                "refusing to read it", checkpoint=self.url, file=name)
        return self.backend.read_file(self.path(name), max_bytes, refuse, self.url)

    def read_into(self, name: str, offset: int, buf, *, fd: int | None = None) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (short at end of file)."""
        return self.backend.read_into(self.path(name), offset, memoryview(buf).cast("B"), fd, self.url)

    def commit_bytes(self, name: str, data: bytes, *, sync: bool = True) -> None:
        """Publish ``name`` atomically: temp file, fsync, rename, fsync dir (local);
        a single PUT of the final object (object stores, where that PUT is the commit).
        Never a manifest (``commit.py`` commits those)."""
        self.backend.commit(self.root, self.path(_not_a_manifest(name)), temp_name(name, TEMP_INFIX), data, sync=sync)

    def publish(self, tmp: str, name: str) -> None:
        """Put the whole, durable file ``tmp`` of this directory in place as ``name``,
        replacing what is there (a rename, made durable).  Never a manifest."""
        self.backend.rename(self.root, self.path(tmp), self.path(_not_a_manifest(name)))

    def sync_dir(self) -> None:
        self.backend.sync_dir(self.root)

    def remove(self, name: str) -> None:
        """Remove file ``name``; a missing one is not an error."""
        self.backend.remove(self.path(name))

    def remove_dir(self) -> None:
        """Remove this directory, which must be empty."""
        self.backend.remove_dir(self.root)


__all__ = ["Backend", "Sink", "StorageTier"]
