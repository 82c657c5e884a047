"""Where a load's bytes come from, and how they are checked.

``FileSet`` opens each data file once per tier (a descriptor for local files, plus an
O_DIRECT one where the file system takes it), remembers missing files, and finds a file an
incremental save left in an earlier checkpoint of the run.  ``Fetcher`` reads a range from
the fastest tier whose copy of it verifies against its block digests, falling back tier by
tier, and counts what it read in the load's ``ReadStats``.

Thread safety: one ``FileSet`` and one ``Fetcher`` serve all reader threads of one load; each
thread has its own O_DIRECT staging buffer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from ..engine.upload import StagedPieces
from ..errors import CheckpointError, ChecksumMismatch, DataFileError
from ..format.checksum import verify_blocks
from ..format.codec import CodecMissing, decode_block
from ..format.limits import FormatViolation
from ..tiers import StorageTier, read_path
from ..tiers.direct_io import DIRECT_MIN, STAGE_BYTES, StagingBuffer, read_range
from .ranges import ByteRange, Piece, Ranged
from .tasks import ReadTask

log = logging.getLogger(__name__)


@dataclass
class ReadStats:
    """What one load read, on this rank."""
    bytes_read: int = 0  # from storage, every tier
    bytes_needed: int = 0  # of stored chunks its items need (the rest is rounding to whole blocks)
    bytes_direct: int = 0  # of bytes_read, read through O_DIRECT (tiers/direct_io.py)
    served: dict[str, int] = field(default_factory=dict)  # bytes read per tier URL
    bytes_received: int = 0  # cooperative load: blocks other ranks read and sent here, verified
    bytes_sent: int = 0  # cooperative load: blocks read here and sent to other ranks
    plan_s: float = 0.0  # cooperative load: agreeing who reads what
    read_s: float = 0.0  # reading from storage
    exchange_s: float = 0.0  # cooperative load: sending and receiving blocks
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, tier_url: str, nbytes: int) -> None:
        """``nbytes`` read from ``tier_url`` and verified."""
        with self._lock:
            self.bytes_read += nbytes
            self.served[tier_url] = self.served.get(tier_url, 0) + nbytes

    def count_direct(self, nbytes: int) -> None:
        """``nbytes`` read with O_DIRECT (counted when read, verified or not)."""
        with self._lock:
            self.bytes_direct += nbytes


_MISSING = -1  # a file a tier does not hold, remembered as such (never a descriptor)


class FileSet:
    """Open file descriptors per (tier, file), opened on first use; missing files remembered."""

    def __init__(self, tiers: list[StorageTier], homes: dict[str, str],
                 borrowed: dict[str, StorageTier] | None = None) -> None:
        self.tiers = tiers
        self.homes = homes
        # files the first tier (a node's own directory) serves from the ranges this rank was
        # sent of them (``replicas/repair.py``): the directory that holds those ranges
        self.borrowed = borrowed or {}
        self._fds: dict[tuple[int, str], int | None] = {}
        self._siblings: dict[tuple[int, str], StorageTier] = {}
        # O_DIRECT descriptor and its alignment per (tier, file); (None, None) where refused
        self._direct: dict[tuple[int, str], tuple[int | None, tuple[int, int] | None]] = {}
        self._local = threading.local()
        self._warned: set[tuple[int, str]] = set()
        self._stages: list[StagingBuffer] = []
        self._lock = threading.Lock()

    def first_fallback(self, ti: int, name: str) -> bool:
        """True the first time ``name`` falls back from tier ``ti`` (one warning per file and
        tier, however many ranges of it are read)."""
        with self._lock:
            if (ti, name) in self._warned:
                return False
            self._warned.add((ti, name))
            return True

    def tier_for(self, ti: int, name: str) -> StorageTier:
        """The directory of tier ``ti`` that holds ``name``: the checkpoint's own, the earlier
        checkpoint of the run that an incremental save took the file from, or (the first tier)
        where this rank keeps the ranges of it that it was sent."""
        if ti == 0 and name in self.borrowed:
            return self.borrowed[name]
        home = self.homes.get(name)
        if home is None:
            return self.tiers[ti]
        with self._lock:
            t = self._siblings.get((ti, home))
            if t is None:
                t = self._siblings[(ti, home)] = self.tiers[ti].sibling(home)
            return t

    def fd(self, ti: int, name: str) -> int | None:
        """A buffered descriptor of the file (None: its tier's filesystem reads by path, not
        through descriptors); raises ``FileNotFoundError`` for a missing one, every time it is
        asked."""
        tier = self.tier_for(ti, name)
        key = (ti, name)
        with self._lock:
            if key not in self._fds:
                try:
                    self._fds[key] = tier.backend.open_read(tier.path(name), tier.url)
                except FileNotFoundError:
                    self._fds[key] = _MISSING
            fd = self._fds[key]
        if fd == _MISSING:
            raise FileNotFoundError(name)
        return fd

    def direct_fd(self, ti: int, name: str) -> tuple[int | None, tuple[int, int] | None]:
        """An O_DIRECT descriptor of the file ``fd`` opened and its alignment needs; (None,
        None) where its filesystem refuses O_DIRECT on it, or reads by path."""
        tier = self.tier_for(ti, name)
        key = (ti, name)
        with self._lock:
            if key not in self._direct:
                buffered = self._fds.get(key)
                got = None if buffered is None or buffered == _MISSING else \
                    tier.backend.open_direct(tier.path(name), buffered)
                self._direct[key] = (None, None) if got is None else got
            return self._direct[key]

    @staticmethod
    def wants_direct(fd: int) -> bool:
        """O_DIRECT, unless the probe found buffered reads faster on ``fd``'s file system."""
        choice = read_path.known(fd)
        return choice is None or choice.direct

    def stage(self) -> StagingBuffer:
        """This thread's staging buffer for O_DIRECT reads (made on first use)."""
        st = getattr(self._local, "stage", None)
        if st is None:
            st = self._local.stage = StagingBuffer(STAGE_BYTES)
            with self._lock:
                self._stages.append(st)
        return st

    def close(self) -> None:
        for st in self._stages:
            st.close()
        self._stages.clear()
        for fd in [*self._fds.values(), *(d for d, _a in self._direct.values())]:
            if fd is not None and fd != _MISSING:
                os.close(fd)


class Fetcher:
    """Reads a load's ranges into their tasks' buffers, each from the fastest tier whose copy
    verifies; ``verify=False`` skips the digests (never the sizes)."""

    def __init__(self, files: FileSet, stats: ReadStats, *, verify: bool, o_direct: bool | str,
                 staging: StagedPieces | None = None) -> None:
        self.files, self.stats, self.verify, self.o_direct = files, stats, verify, o_direct
        self.staging = staging  # the slabs of streamed tasks

    def piece(self, task: Ranged, i: int) -> None:
        """Range ``i`` of ``task``, alone."""
        r = task.ranges[i]
        if task.streamed:  # read into a slab, upload it into place, and read on meanwhile
            assert isinstance(task, ReadTask) and task.up is not None and self.staging is not None, \
                "a streamed task has uploads and slabs"
            with self.staging.slot() as slot:
                self._any_tier(task, r, slot.slab[:r.nbytes].numpy().data, slot.slab.data_ptr())
                slot.uploading(task.up.piece(task.dest_bytes()[r.buf_offset:r.buf_offset + r.nbytes], slot.slab))
            return
        buf, addr = task.buffer()
        self._any_tier(task, r, buf.data[r.buf_offset:r.buf_offset + r.nbytes], addr + r.buf_offset)

    def run(self, run: list[Piece]) -> None:
        """A run of small pieces of one file from the first tier with one request, then each
        verified and copied out.  A piece the request did not bring back whole, or whose
        blocks do not verify, is read again alone (:meth:`piece`: the slower tiers, and the
        error that names the file and tensor)."""
        files = self.files
        first, last = run[0][0].ranges[run[0][1]], run[-1][0].ranges[run[-1][1]]
        name, start = first.file, first.file_offset
        buf = bytearray(last.file_offset + last.nbytes - start)
        try:
            got = files.tier_for(0, name).read_into(name, start, buf, fd=files.fd(0, name))
        except OSError:
            got = 0  # missing or unreadable here: each piece reports or falls back on its own
        mv = memoryview(buf)
        served = 0
        for t, i in run:
            r = t.ranges[i]
            lo = r.file_offset - start
            piece = mv[lo:lo + r.nbytes]
            if lo + r.nbytes > got or (self.verify and verify_blocks(
                    piece, r.extent.sums, r.first_block, t.block_size) is not None):
                self.piece(t, i)
                continue
            dst, _addr = t.buffer()
            dst[r.buf_offset:r.buf_offset + r.nbytes] = piece
            served += r.nbytes
        self.stats.count(files.tiers[0].url, served)

    def _any_tier(self, task: Ranged, r: ByteRange, mv: memoryview, addr: int) -> None:
        """Fill ``mv`` with range ``r`` from the fastest tier whose copy of it verifies."""
        files = self.files
        first_error: Exception | None = None
        for ti, tier in enumerate(files.tiers):
            try:
                self._verified(ti, tier, task, r, mv, addr)
            except (DataFileError, ChecksumMismatch, OSError) as e:
                if first_error is None:
                    first_error = e
                if ti + 1 < len(files.tiers) and files.first_fallback(ti, r.file):
                    log.warning("%s; reading this file from %s instead", e, files.tiers[ti + 1].url)
                continue
            self.stats.count(tier.url, r.nbytes if r.stored < 0 else r.stored)
            return
        assert first_error is not None, "a load has at least one tier"
        raise first_error

    def _verified(self, ti: int, tier: StorageTier, task: Ranged, r: ByteRange, mv: memoryview,
                  addr: int) -> None:
        """Read ``r`` from tier ``ti`` into ``mv`` and check it."""
        files, key, name = self.files, task.ri.storage_index.fqn, r.file
        if r.stored >= 0:
            self._unpacked(ti, tier, task, r, mv)
            return
        try:
            fd = files.fd(ti, name)
            if fd is not None:
                dfd, align = (None, None)
                if self.o_direct and r.nbytes >= DIRECT_MIN and files.wants_direct(fd):
                    dfd, align = files.direct_fd(ti, name)
                stage = files.stage() if dfd is not None else None
                got, direct = read_range(fd, r.file_offset, mv, addr, direct_fd=dfd, align=align, stage=stage)
                if direct:
                    self.stats.count_direct(direct)
            else:
                got = files.tier_for(ti, name).read_into(name, r.file_offset, mv)
        except FileNotFoundError:
            home = files.homes.get(name)
            where = f" (kept in the earlier checkpoint {home!r} this one is incremental on)" if home else ""
            raise DataFileError(f"data file is missing{where}; the checkpoint is incomplete or was "
                                "damaged, load another tier or step", checkpoint=tier.url, file=name,
                                key=key) from None
        if got != r.nbytes:
            raise DataFileError(f"data file is truncated: wanted {r.nbytes} bytes at offset {r.file_offset}, "
                                f"got {got}", checkpoint=tier.url, file=name, key=key)
        if self.verify:
            bs = task.block_size
            bad = verify_blocks(mv, r.extent.sums, r.first_block, bs)
            if bad is not None:
                raise ChecksumMismatch(f"checksum mismatch in block {bad} (chunk bytes {bad * bs}+, file "
                                       f"offset {r.file_offset + (bad - r.first_block) * bs}+)",
                                       checkpoint=tier.url, file=name, key=key)

    def _unpacked(self, ti: int, tier: StorageTier, task: Ranged, r: ByteRange, mv: memoryview) -> None:
        """Compressed block ``r`` from tier ``ti``: its stored bytes read and checked against
        their digest, then decoded into ``mv``."""
        files, name, key = self.files, r.file, task.ri.storage_index.fqn
        stored = bytearray(r.stored)
        try:
            got = files.tier_for(ti, name).read_into(name, r.file_offset, stored, fd=files.fd(ti, name))
        except FileNotFoundError:
            raise DataFileError("data file is missing; the checkpoint is incomplete or was damaged, load "
                                "another tier or step", checkpoint=tier.url, file=name, key=key) from None
        if got != r.stored:
            raise DataFileError(f"data file is truncated: wanted {r.stored} bytes at offset {r.file_offset}, "
                                f"got {got}", checkpoint=tier.url, file=name, key=key)
        b = r.first_block
        if self.verify and xxhash.xxh3_128_digest(stored) != r.extent.sums[b]:
            raise ChecksumMismatch(f"checksum mismatch in compressed block {b} (chunk bytes {b * task.block_size}+, "
                                   f"file offset {r.file_offset}+)", checkpoint=tier.url, file=name, key=key)
        try:
            decode_block(stored, mv)
        except FormatViolation as e:
            raise DataFileError(f"compressed block {b} at file offset {r.file_offset}: {e}",
                                checkpoint=tier.url, file=name, key=key) from None
        except CodecMissing as e:
            raise CheckpointError(str(e), checkpoint=tier.url, file=name, key=key) from None

    def probe(self, tasks: Sequence[Ranged], threads: int) -> None:
        """Before a large load, measure O_DIRECT against buffered reads on the file system of its
        largest local data file (once per file system and process: ``tiers/read_path.py``)."""
        sizes: dict[str, int] = {}
        for t in tasks:
            for r in t.ranges:
                sizes[r.file] = sizes.get(r.file, 0) + r.nbytes
        if not sizes:
            return
        name = max(sizes, key=lambda n: sizes[n])
        try:
            fd = self.files.fd(0, name)
        except OSError:
            return  # the load itself reports it (or reads another tier)
        if fd is None or read_path.known(fd) is not None:
            return
        dfd, align = self.files.direct_fd(0, name)
        if dfd is not None and align is not None:
            read_path.choose(fd, dfd, align, threads)
