"""Remote tiers: a checkpoint directory on an fsspec filesystem (object stores, mostly).

Data files are written sequentially (object stores append only); a file is published by
writing it whole, which for an object store is one PUT: the manifest object written last is
the commit.  fsspec caches listings; every query here drops the cache first, since other ranks
and processes write the same directory.
"""

from __future__ import annotations

import logging
import posixpath
import threading
from collections import deque

from ..format.layout import align_up
from .backend import Backend, Sink

log = logging.getLogger(__name__)


class SequentialSink(Sink):
    """fsspec file opened for writing (object stores append only).

    Reserved pieces are written in reservation order: one that arrives early waits in memory
    until the pieces before it are written (at most one batch's per flush thread: a flush thread
    reserves a batch's pieces, then writes them in order).  Unreserved writes
    come from a single sequential caller and go straight through."""

    def __init__(self, fs, path: str, name: str) -> None:
        self.fs, self.path, self.name = fs, path, name
        self.f = fs.open(path, "wb")
        self.pos = 0
        self._end = 0
        self._order: deque[int] = deque()
        self.pending: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> int:
        with self._lock:
            off = align_up(self._end)
            self._end = off + nbytes
            self._order.append(off)
            return off

    def _put(self, offset: int, data) -> None:
        if offset < self.pos:
            raise ValueError(f"overlapping writes to {self.path}")
        if offset > self.pos:  # alignment padding between pieces
            self.f.write(b"\0" * (offset - self.pos))
        self.f.write(data)
        self.pos = offset + len(data)

    def pwrite(self, buf, offset: int, logical: int | None = None) -> None:
        data = bytes(memoryview(buf).cast("B")[:logical])  # the cache slot is recycled after return
        with self._lock:
            if offset not in self._order:
                self._put(offset, data)
                self._end = max(self._end, self.pos)
                return
            self.pending[offset] = data
            while self._order and self._order[0] in self.pending:
                off = self._order.popleft()
                self._put(off, self.pending.pop(off))

    def close(self, sync: bool = True) -> int:
        if self.pending or self._order:
            raise OSError(f"{self.path}: {len(self._order)} reserved pieces were never written")
        self.f.close()
        return self.pos

    def abort(self) -> None:
        try:
            self.f.close()
        except (OSError, ValueError) as e:  # the upload already broke; it is being abandoned
            log.warning("closing the abandoned upload of %s failed: %s", self.path, e)
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove the partial %s (%s); no manifest refers to it", self.path, e)


class FsspecBackend(Backend):
    """An fsspec filesystem (``fs``)."""

    local = False

    def __init__(self, fs) -> None:
        self.fs = fs

    def _fresh(self, path: str) -> None:
        """Drop fsspec's listing cache: other ranks and processes write here too."""
        try:
            self.fs.invalidate_cache(path)
        except (AttributeError, NotImplementedError, TypeError):  # a filesystem without a cache
            pass

    def join(self, root: str, name: str) -> str:
        return posixpath.join(root, name)

    def makedirs(self, root: str) -> None:
        self.fs.makedirs(root, exist_ok=True)

    def exists(self, path: str) -> bool:
        self._fresh(posixpath.dirname(path))
        return self.fs.exists(path)

    def size(self, path: str) -> int:
        self._fresh(posixpath.dirname(path))
        return int(self.fs.size(path))

    def entries(self, root: str) -> list[tuple[str, str]]:
        self._fresh(root)
        try:
            infos = self.fs.ls(root, detail=True)
        except FileNotFoundError:
            return []
        return sorted((posixpath.basename(i["name"].rstrip("/")),
                       "dir" if i.get("type") == "directory" else "file") for i in infos)

    def is_real_dir(self, root: str) -> bool:
        self._fresh(root)
        return self.fs.isdir(root)

    def listdir(self, root: str) -> list[str]:
        self._fresh(root)
        try:
            return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(root, detail=False))
        except FileNotFoundError:
            return []

    def open_sink(self, path: str, name: str, *, o_direct: bool, drop_cache: bool) -> Sink:
        return SequentialSink(self.fs, path, name)

    def read_file(self, path: str, max_bytes: int | None, refuse, url: str) -> bytes:
        if max_bytes is not None:
            self._fresh(posixpath.dirname(path))
            size = int(self.fs.size(path))
            if size > max_bytes:
                refuse(size)
        return self.fs.cat_file(path)

    def read_into(self, path: str, offset: int, mv: memoryview, fd: int | None, url: str) -> int:
        data = self.fs.cat_file(path, start=offset, end=offset + mv.nbytes)
        mv[:len(data)] = data
        return len(data)

    def commit(self, root: str, path: str, tmp_name: str, data: bytes, *, sync: bool) -> None:
        self.fs.pipe_file(path, data)

    def rename(self, root: str, tmp_path: str, path: str) -> None:
        self.fs.mv(tmp_path, path)

    def sync_dir(self, root: str) -> None:
        """Nothing: an object store has no directory entries to make durable."""

    def remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """S3's conditional create where fsspec offers it (``mode="create"``); elsewhere an
        existence check first, which narrows the race but cannot close it (the fence at commit
        catches a save that lost it)."""
        self._fresh(posixpath.dirname(path))
        try:
            self.fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False
        except TypeError:  # this filesystem's pipe_file takes no mode
            pass
        if self.fs.exists(path):
            return False
        self.fs.pipe_file(path, data)
        return True

    def remove_dir(self, root: str) -> None:
        try:
            self.fs.rmdir(root)
        except (FileNotFoundError, NotImplementedError):  # an object store keeps no empty directories
            pass
