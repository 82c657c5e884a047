"""One storage tier: a directory on a local or fsspec filesystem.

Local paths use ``os`` directly (``pwrite`` from any thread, ``fsync``,
atomic ``rename``); anything else goes through fsspec, which writes
sequentially and commits by writing the manifest object last (object stores
have no rename).  Paths stay ``str`` URLs end to end.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import stat
import threading
import uuid
from collections import deque

import fsspec

from ..errors import DataFileError, UnsafeFileError
from ..format.layout import align_up
from ..format.names import TEMP_INFIX
from .direct_io import pread_full

log = logging.getLogger(__name__)

_PWRITE_MAX = 1 << 30  # Linux caps one write at ~2 GiB; stay well below
_SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str, flags: int = os.O_RDONLY, *, checkpoint: str | None = None) -> int:
    """Open an existing checkpoint file without following a symbolic link, and only if it is
    a regular file: a link planted in place of a data file cannot make us read outside the
    checkpoint, and a FIFO or device cannot block or flood the reader (``O_NONBLOCK`` makes
    the open itself return at once; regular files ignore it)."""
    name = os.path.basename(path)
    try:
        fd = os.open(path, flags | _SAFE_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError("is a symbolic link; checkpoint files are never read through "
                                  "links (replace it with the file itself)",
                                  checkpoint=checkpoint or os.path.dirname(path), file=name) from None
        if e.errno in (errno.ENXIO, errno.ENODEV):
            raise UnsafeFileError("is a device or socket, not a regular file",
                                  checkpoint=checkpoint or os.path.dirname(path), file=name) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFileError(f"is not a regular file (mode {stat.filemode(st.st_mode)}); refusing "
                              "to read it", checkpoint=checkpoint or os.path.dirname(path), file=name)
    return fd


def _is_local(fs) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protos or "local" in protos


class Sink:
    """Writes one data file; ``reserve`` and ``pwrite`` may be called from several threads.

    The engine ``reserve``s an aligned range at the end of the file for each piece it is about
    to write (append order, decided when the piece is ready), then ``pwrite``s it there."""

    name: str

    def reserve(self, nbytes: int) -> int: ...
    def pwrite(self, buf, offset: int) -> None: ...
    def close(self, sync: bool = True) -> int: ...
    def abort(self) -> None: ...


class LocalSink(Sink):
    def __init__(self, path: str, name: str, o_direct: bool = False, drop_cache: bool = True) -> None:
        self.path = path
        self.name = name
        self.drop_cache = drop_cache
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.o_direct = False
        if o_direct and hasattr(os, "O_DIRECT"):
            try:  # probe: some file systems refuse O_DIRECT (EINVAL); then write buffered
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.o_direct = True
            except OSError as e:
                log.debug("O_DIRECT refused for %s (%s); buffered writes", path, e)
        if not self.o_direct:
            self.fd = os.open(path, flags, 0o644)
        self.size = 0
        self._end = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> int:
        with self._lock:
            off = align_up(self._end)
            self._end = off + nbytes
            return off

    def pwrite(self, buf, offset: int, logical: int | None = None) -> None:
        """Write ``buf`` at ``offset``.  With O_DIRECT, ``buf`` is block-padded and ``logical``
        is the meaningful length (the file is truncated to its logical size at close)."""
        mv = memoryview(buf).cast("B")
        n = mv.nbytes
        done = 0
        while done < n:
            w = os.pwrite(self.fd, mv[done:done + _PWRITE_MAX], offset + done)
            if w <= 0:
                raise OSError(errno.EIO, f"short write to {self.path}")
            done += w
        with self._lock:
            self.size = max(self.size, offset + (n if logical is None else logical))

    def close(self, sync: bool = True) -> int:
        try:
            if self.o_direct:
                os.ftruncate(self.fd, self.size)  # drop the padding of the last block
            if sync:
                os.fsync(self.fd)
            if sync and self.drop_cache:
                try:  # drop the now-clean pages: a checkpoint should not evict the trainer's cache
                    os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except (AttributeError, OSError):
                    pass
            return os.fstat(self.fd).st_size
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass


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

    def pwrite(self, buf, offset: int) -> None:
        data = bytes(memoryview(buf).cast("B"))  # the cache slot is recycled after return
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


class StorageTier:
    """A checkpoint directory on one filesystem."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.local = _is_local(self.fs)
        if self.local:
            self.root = os.path.abspath(self.root)

    def __repr__(self) -> str:
        return f"StorageTier({self.url!r})"

    def __getstate__(self):
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state):
        self.__init__(state["url"], state["storage_options"])

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
        return os.path.join(self.root, name) if self.local else posixpath.join(self.root, name)

    def makedirs(self) -> None:
        if self.local:
            os.makedirs(self.root, exist_ok=True)
        else:
            self.fs.makedirs(self.root, exist_ok=True)

    def _fresh(self, p: str) -> None:
        """Drop fsspec's listing cache: other ranks and processes write here too."""
        try:
            self.fs.invalidate_cache(p)
        except (AttributeError, NotImplementedError, TypeError):  # a filesystem without a cache
            pass

    def exists(self, name: str) -> bool:
        p = self.path(name)
        if self.local:
            return os.path.exists(p)
        self._fresh(self.root)
        return self.fs.exists(p)

    def size(self, name: str) -> int:
        p = self.path(name)
        if self.local:
            return os.path.getsize(p)
        self._fresh(self.root)
        return int(self.fs.size(p))

    def entries(self) -> list[tuple[str, str]]:
        """``(name, kind)`` of this directory's entries without following links; ``kind`` is
        ``"file"``, ``"dir"``, ``"link"`` or ``"other"`` (object stores: files and dirs)."""
        if self.local:
            out = []
            try:
                with os.scandir(self.root) as it:
                    for e in it:
                        if e.is_symlink():
                            kind = "link"
                        elif e.is_dir(follow_symlinks=False):
                            kind = "dir"
                        elif e.is_file(follow_symlinks=False):
                            kind = "file"
                        else:
                            kind = "other"
                        out.append((e.name, kind))
            except (FileNotFoundError, NotADirectoryError):
                return []
            return sorted(out)
        self._fresh(self.root)
        try:
            infos = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted((posixpath.basename(i["name"].rstrip("/")),
                       "dir" if i.get("type") == "directory" else "file") for i in infos)

    def is_real_dir(self) -> bool:
        """This directory exists and is not a symbolic link (local); exists (object stores)."""
        if self.local:
            try:
                return stat.S_ISDIR(os.lstat(self.root).st_mode)
            except FileNotFoundError:
                return False
        self._fresh(self.root)
        return self.fs.isdir(self.root)

    def listdir(self) -> list[str]:
        if self.local:
            try:
                return sorted(os.listdir(self.root))
            except FileNotFoundError:
                return []
        self._fresh(self.root)
        try:
            return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return []

    def open_sink(self, name: str, o_direct: bool = False, drop_cache: bool = True) -> Sink:
        """``drop_cache=False`` keeps the written pages cached: a later tier re-reads them."""
        if self.local:
            return LocalSink(self.path(name), name, o_direct, drop_cache)
        return SequentialSink(self.fs, self.path(name), name)

    def read_bytes(self, name: str, max_bytes: int | None = None) -> bytes:
        """The whole file ``name``.  Its size is checked against ``max_bytes`` before anything
        is read; locally it must be a regular file reached without a link."""
        p = self.path(name)
        if self.local:
            fd = open_regular(p, checkpoint=self.url)
            try:
                size = os.fstat(fd).st_size
                self._check_size(name, size, max_bytes)
                buf = bytearray(size)
                got = pread_full(fd, memoryview(buf), 0)
                return bytes(buf[:got])
            finally:
                os.close(fd)
        if max_bytes is not None:
            self._fresh(self.root)
            self._check_size(name, int(self.fs.size(p)), max_bytes)
        return self.fs.cat_file(p)

    def _check_size(self, name: str, size: int, max_bytes: int | None) -> None:
        if max_bytes is not None and size > max_bytes:
            raise DataFileError(f"is {size} bytes, over the {max_bytes}-byte limit for this file; "
                                "refusing to read it", checkpoint=self.url, file=name)

    def read_into(self, name: str, offset: int, buf, *, fd: int | None = None) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (short at end of file)."""
        mv = memoryview(buf).cast("B")
        n = mv.nbytes
        if self.local:
            own = fd is None
            if own:
                fd = open_regular(self.path(name), checkpoint=self.url)
            try:
                return pread_full(fd, mv, offset)
            finally:
                if own:
                    os.close(fd)
        data = self.fs.cat_file(self.path(name), start=offset, end=offset + n)
        mv[:len(data)] = data
        return len(data)

    def commit_bytes(self, name: str, data: bytes, *, sync: bool = True) -> None:
        """Publish ``name`` atomically: temp file, fsync, rename, fsync dir (local);
        a single PUT of the final object (object stores, where that PUT is the commit)."""
        if self.local:
            tmp = self.path(f"{name}{TEMP_INFIX}{uuid.uuid4().hex[:8]}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                mv = memoryview(data)
                while mv:
                    w = os.write(fd, mv)
                    mv = mv[w:]
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path(name))
            if sync:
                self.sync_dir()
        else:
            self.fs.pipe_file(self.path(name), data)

    def sync_dir(self) -> None:
        if not self.local:
            return
        dfd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def remove(self, name: str) -> None:
        p = self.path(name)
        try:
            if self.local:
                os.unlink(p)
            else:
                self.fs.rm_file(p)
        except FileNotFoundError:
            pass
