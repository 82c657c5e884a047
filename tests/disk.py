"""Helpers that act on checkpoint files on disk (a support module, not a test): flip a byte,
evict a checkpoint from the page cache, find out whether a file system takes O_DIRECT."""

from __future__ import annotations

import os


def o_direct_works(d) -> bool:
    p = os.path.join(d, "probe")
    with open(p, "wb") as f:
        f.write(b"\0" * 8192)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    finally:
        os.unlink(p)
    os.close(fd)
    return True


def drop_cache(ckpt: str) -> None:
    """Evict a checkpoint's files from the page cache (no root needed)."""
    for n in os.listdir(ckpt):
        fd = os.open(os.path.join(ckpt, n), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def full_at_the_commit(monkeypatch) -> None:
    """Wrap the storage seam (``LocalBackend.commit``) so that committing a ``.metadata`` fails
    with ENOSPC, as on a disk that filled while the save wrote its data (until ``monkeypatch``
    undoes it)."""
    from dcp_datastates.tiers.local import LocalBackend
    orig = LocalBackend.commit

    def full(self, root, p, tmp_name, data, *, sync):
        if p.endswith("/.metadata"):
            raise OSError(28, "No space left on device")
        return orig(self, root, p, tmp_name, data, sync=sync)
    monkeypatch.setattr(LocalBackend, "commit", full)
