"""Local tiers: a checkpoint directory on the operating system's filesystem.

Files are written with ``pwrite`` from any flush thread (O_DIRECT from the aligned host cache
where the filesystem takes it), made durable with ``fsync``, and published with an atomic
``rename`` followed by an ``fsync`` of the directory.  A checkpoint file is only ever opened
as a regular file reached without a symbolic link.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import uuid
import weakref

from .. import process_state
from ..errors import UnsafeFileError
from ..format.layout import align_up
from .backend import Backend, HeldLock, LockUnsupported, Sink
from .direct_io import dio_alignment, pread_full

log = logging.getLogger(__name__)

_PWRITE_MAX = 1 << 30  # Linux caps one write at ~2 GiB; stay well below
_SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str, flags: int = os.O_RDONLY, *, checkpoint: str | None = None,
                 mode: int = 0o644) -> int:
    """Open an existing checkpoint file without following a symbolic link, and only if it is
    a regular file: a link planted in place of a data file cannot make us read outside the
    checkpoint, and a FIFO or device cannot block or flood the reader (``O_NONBLOCK`` makes
    the open itself return at once; regular files ignore it)."""
    name = os.path.basename(path)
    try:
        fd = os.open(path, flags | _SAFE_FLAGS, mode)
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


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
_HELD = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


def _lock(fd: int, kind: int) -> bool:
    """Take (``F_WRLCK``, ``F_RDLCK``) or drop (``F_UNLCK``) the lock of ``fd``'s open file
    description without waiting; False where another holds it.

    Open-file-description locks (Linux) belong to the open file, not to the process: two saves
    of one process conflict, closing another descriptor of the file drops nothing, and NFS
    carries them to the server.  ``flock`` stands in where they are missing."""
    try:
        if hasattr(fcntl, "F_OFD_SETLK"):
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("@hhqqi0q", kind, os.SEEK_SET, 0, 0, 0))
                return True
            except OSError as e:
                if e.errno != errno.EINVAL:  # a kernel before 3.15
                    raise
        op = {fcntl.F_WRLCK: fcntl.LOCK_EX, fcntl.F_RDLCK: fcntl.LOCK_SH}.get(kind, fcntl.LOCK_UN)
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in _HELD:
            return False
        if e.errno in _NO_LOCKS:
            raise LockUnsupported(e.errno, f"the filesystem keeps no locks ({os.strerror(e.errno)})") from None
        raise


def _sync_dir(root: str) -> None:
    try:
        dfd = os.open(root, os.O_RDONLY)
    except PermissionError as e:  # write and pass-through only (mode 333): no call can fsync it
        log.debug("cannot open %s to make its entries durable (%s); left as it is", root, e)
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class FileLock(HeldLock):
    """A claim or base-lock file held under an open-file-description lock (see ``_lock``)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        self._entry_durable = False  # the directory entry of a file we may have created
        _LOCKS_HELD.add(self)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read(self) -> bytes:
        buf = bytearray(self.size())
        return bytes(buf[:pread_full(self.fd, memoryview(buf), 0)])

    def write(self, data: bytes) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)
        if not self._entry_durable:
            _sync_dir(os.path.dirname(self.path))
            self._entry_durable = True

    def still_named(self) -> bool:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self.fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def unlock(self, *, unlink: bool) -> None:
        """Let the lock go (removing the file first where ``unlink``: a contender that opened
        it meanwhile finds, once it holds the lock, that the path no longer names it)."""
        if self.fd < 0:  # a forked child's copy, closed at the fork
            return
        try:
            if unlink and self.still_named():
                os.unlink(self.path)
        finally:
            fd, self.fd = self.fd, -1
            _LOCKS_HELD.discard(self)
            os.close(fd)  # the last descriptor of the open file: the kernel drops its lock


# A process forked from the trainer (a DataLoader worker, forked again at each epoch) inherits
# every descriptor, and an open-file-description lock lives while any descriptor of it is open:
# a worker forked while a save held a base lock would hold it for its whole life, and retention
# would leave that directory alone meanwhile.  The child closes its copies at once; the parent
# still holds each lock through its own descriptor.
_LOCKS_HELD: weakref.WeakSet[FileLock] = weakref.WeakSet()


def _drop_locks_in_child() -> None:
    for held in list(_LOCKS_HELD):
        fd, held.fd = held.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass  # closed already
    _LOCKS_HELD.clear()


process_state.in_child(_drop_locks_in_child)


class LocalBackend(Backend):
    """The operating system's filesystem."""

    local = True

    def join(self, root: str, name: str) -> str:
        return os.path.join(root, name)

    def makedirs(self, root: str) -> None:
        """Make ``root`` and its missing parents, each one's name durable in its parent before
        anything is written below it: a file's ``fsync`` and its directory's make the file's
        name durable in that directory, not the directory's own name in its parent (POSIX; ext4
        and XFS happen to commit it in order).  Without this a power cut after a commit could
        lose the step directory whole, while retention's removals of older steps survive."""
        missing = []
        d = os.path.abspath(root)
        while not os.path.isdir(d) and os.path.dirname(d) != d:
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:  # made meanwhile by another rank or process, which syncs it
                if not os.path.isdir(d):
                    raise
                continue
            _sync_dir(os.path.dirname(d))

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def entries(self, root: str) -> list[tuple[str, str]]:
        out = []
        try:
            with os.scandir(root) as it:
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

    def is_real_dir(self, root: str) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(root).st_mode)
        except FileNotFoundError:
            return False

    def listdir(self, root: str) -> list[str]:
        try:
            return sorted(os.listdir(root))
        except FileNotFoundError:
            return []

    def open_sink(self, path: str, name: str, *, o_direct: bool, drop_cache: bool) -> Sink:
        return LocalSink(path, name, o_direct, drop_cache)

    def read_file(self, path: str, max_bytes: int | None, refuse, url: str) -> bytes:
        fd = open_regular(path, checkpoint=url)
        try:
            size = os.fstat(fd).st_size
            if max_bytes is not None and size > max_bytes:
                refuse(size)
            buf = bytearray(size)
            got = pread_full(fd, memoryview(buf), 0)
            return bytes(buf[:got])
        finally:
            os.close(fd)

    def read_into(self, path: str, offset: int, mv: memoryview, fd: int | None, url: str) -> int:
        own = fd is None
        if fd is None:
            fd = open_regular(path, checkpoint=url)
        try:
            return pread_full(fd, mv, offset)
        finally:
            if own:
                os.close(fd)

    def open_read(self, path: str, url: str) -> int | None:
        return open_regular(path, checkpoint=url)

    def open_direct(self, path: str, buffered: int) -> tuple[int, tuple[int, int]] | None:
        if not hasattr(os, "O_DIRECT"):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW)
        except OSError:  # refused (a missing file is the buffered descriptor's to report)
            return None
        a, b = os.fstat(fd), os.fstat(buffered)
        align = dio_alignment(fd) if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) else None
        if align is None:  # refused, or not the file the checked descriptor holds
            os.close(fd)
            return None
        return fd, align

    def commit(self, root: str, path: str, tmp_name: str, data: bytes, *, sync: bool) -> None:
        """With ``sync``: the temp file's bytes durable, then the directory's names (so no file a
        manifest references, made there before it, can be lost to a power cut while the
        manifest's name survives: POSIX orders no two names of a directory without an ``fsync``
        of it), then the rename, made durable."""
        tmp = os.path.join(root, tmp_name)
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
        if sync:
            self.sync_dir(root)
        os.replace(tmp, path)
        if sync:
            self.sync_dir(root)

    def rename(self, root: str, tmp_path: str, path: str) -> None:
        os.replace(tmp_path, path)
        self.sync_dir(root)

    def sync_dir(self, root: str) -> None:
        _sync_dir(root)

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def remove_dir(self, root: str) -> None:
        os.rmdir(root)

    def copy_local(self, src_path: str, path: str, tmp_name: str, size: int, *, pace, piece: int) -> None:
        """``copy_file_range``: no user-space buffer, a reflink where the filesystem has them."""
        tmp = os.path.join(os.path.dirname(path), tmp_name)
        fi = open_regular(src_path)
        try:
            fo = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                left = size
                while left > 0:
                    pace()
                    n = os.copy_file_range(fi, fo, min(left, piece))
                    if n <= 0:
                        raise OSError(f"copy_file_range stopped with {left} bytes of {src_path} left")
                    left -= n
                os.fsync(fo)
                for fd in (fi, fo):  # neither copy needs to stay in the page cache
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    except (AttributeError, OSError):
                        pass
            finally:
                os.close(fo)
            os.replace(tmp, path)
        except BaseException:
            self.remove(tmp)
            raise
        finally:
            os.close(fi)

    def try_lock(self, path: str, *, shared: bool = False) -> HeldLock | None:
        for _ in range(64):
            fd = open_regular(path, os.O_RDWR | os.O_CREAT, checkpoint=os.path.dirname(path))
            try:
                if not _lock(fd, fcntl.F_RDLCK if shared else fcntl.F_WRLCK):
                    os.close(fd)
                    return None
            except BaseException:
                os.close(fd)
                raise
            held = FileLock(fd, path)
            if held.still_named():
                return held
            held.unlock(unlink=False)  # removed by its holder between our open and our lock
        raise OSError(errno.EAGAIN, f"{path} keeps being replaced while it is locked")

    def lock_held(self, path: str) -> bool:
        try:
            fd = open_regular(path, checkpoint=os.path.dirname(path))
        except FileNotFoundError:
            return False
        try:
            return not _lock(fd, fcntl.F_RDLCK)
        finally:
            os.close(fd)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.sync_dir(os.path.dirname(path))
        return True


def temp_name(name: str, infix: str) -> str:
    """A fresh temporary name beside ``name`` (``NAME<infix>XXXXXXXX``)."""
    return f"{name}{infix}{uuid.uuid4().hex[:8]}"
