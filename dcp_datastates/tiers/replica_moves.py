"""The bytes of a node-local restore's repair (``replica_repair.py``) on the wire: the moves it
plans, each between two members of the replica group, and what each side does with them.

Every rank walks the same list of moves in the same order and takes part in those it is a side
of, so each pair's sends and receives match.  A whole file lands in the node's directory under
a temporary name, kept only when its bytes match the digest recorded when it was replicated; a
rank's byte ranges of a file land in its borrowed directory (``borrowed.py``), checked by the
load that reads them.  A side whose storage fails still sends or receives every byte, so that
no pair falls out of step."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import xxhash

from ..errors import CheckpointError
from .replica_group import ReplicaGroup
from .replicas import PIECE, Landing, piece_buffer
from .storage import StorageTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Move:
    """One file sent from one node's first rank to another's (group positions)."""

    name: str
    src: int
    dst: int
    size: int


@dataclass(frozen=True)
class Borrow:
    """Byte ranges of file ``name`` sent from a rank whose node holds it (``src``) to a rank
    that reads them (``dst``; group positions); the ranges travel from ``dst`` first."""

    name: str
    src: int
    dst: int


class Wire:
    """One repair's transfers over ``group``, this rank being member ``me`` (global ranks
    ``ranks``) with its node's directory ``tier``; ``label`` names the step in the log."""

    def __init__(self, group: ReplicaGroup, me: int, ranks, tier: StorageTier, label: str) -> None:
        self.group, self.me, self.ranks, self.tier, self.label = group, me, ranks, tier, label

    def files(self, moves: list[Move], digests: dict[str, str]) -> set[str]:
        """Send each of ``moves`` (every rank walks the same list in the same order); the names
        this rank received and kept."""
        kept = set()
        for mv in moves:
            if self.me not in (mv.src, mv.dst):
                continue
            peer = mv.dst if self.me == mv.src else mv.src
            if self.me == mv.src:
                _send_file(self.group, self.tier, mv.name, mv.size, peer)
                continue
            ok = _recv_file(self.group, self.tier, mv.name, mv.size, peer, digests[mv.name])
            if ok:
                kept.add(mv.name)
            log.log(logging.INFO if ok else logging.WARNING, "%s: %s %s from rank %d", self.label,
                    "restored" if ok else "could not restore", mv.name, self.ranks[mv.src])
        return kept

    def ranges(self, moves: list[Borrow], ranges: dict[str, tuple[tuple[int, int], ...]],
               into: StorageTier) -> tuple[set[str], int]:
        """Each of ``moves`` (the same list on every rank): this rank's ``ranges`` of its file
        received into ``into`` where it is the receiving side, served from ``tier`` where it
        is the sending one.  The files this rank received and kept, and the bytes received."""
        kept, got = set(), 0
        for mv in moves:
            if self.me == mv.src:
                _send_ranges(self.group, self.tier, mv.name, mv.dst)
            elif self.me == mv.dst:
                if _recv_ranges(self.group, into, mv.name, ranges[mv.name], mv.src):
                    kept.add(mv.name)
                got += sum(n for _o, n in ranges[mv.name])
        return kept, got


def _send_file(group: ReplicaGroup, tier: StorageTier, name: str, size: int, peer: int) -> None:
    """Send ``size`` bytes of ``name`` and their digest; a file that cannot be read goes as
    zeros with a digest of zeros, which its receiver drops (and neither side waits)."""
    buf = torch.empty(PIECE, dtype=torch.uint8)
    h = xxhash.xxh3_128()
    ok = True
    for a in range(0, size, PIECE):
        n = min(PIECE, size - a)
        if ok:
            try:
                tier.read_into(name, a, buf[:n].numpy())
            except (OSError, CheckpointError) as e:
                log.warning("%s/%s cannot be read to send to group member %d: %s", tier.url, name, peer, e)
                ok = False
        if not ok:
            buf[:n].zero_()
        h.update(buf[:n].numpy().data)
        group.send(buf[:n], peer)
    tail = h.digest() if ok else bytes(16)
    group.send(torch.frombuffer(bytearray(tail), dtype=torch.uint8), peer)


def _recv_file(group: ReplicaGroup, tier: StorageTier, name: str, size: int, peer: int, digest: str) -> bool:
    """Receive ``name`` into ``tier``; keep it only when its bytes match ``digest``.  Where this
    node's storage cannot take it, the bytes are still received (the sender, and every rank
    after it in the moves, stays in step) and dropped: False."""
    buf = piece_buffer()
    landing: Landing | None = None
    try:
        tier.makedirs()
        landing = Landing(tier, name)
    except OSError as e:
        log.warning("%s/%s cannot be stored here (%s): received and dropped", tier.url, name, e)
    try:
        for a in range(0, size, PIECE):
            n = min(PIECE, size - a)
            group.recv(buf[:n], peer)
            if landing is not None:
                try:
                    landing.write(buf, n, a)
                except OSError as e:
                    log.warning("%s/%s cannot be stored here (%s): received and dropped", tier.url, name, e)
                    landing.abort()
                    landing = None
        tail = torch.empty(16, dtype=torch.uint8)
        group.recv(tail, peer)
    except BaseException:
        if landing is not None:
            landing.abort()
        raise
    if landing is None:
        return False
    try:
        return landing.keep(tail.numpy().tobytes() if landing.hash.hexdigest() == digest else b"")
    except OSError as e:
        log.warning("%s/%s cannot be stored here (%s): dropped", tier.url, name, e)
        return False


def _stream(ranges, start: int, n: int):
    """The pieces of ``ranges`` ((offset, length), one after another in a stream) that bytes
    ``start`` to ``start + n`` of the stream hold: (position in those bytes, offset, length)."""
    at = 0
    for off, size in ranges:
        lo, hi = max(at, start), min(at + size, start + n)
        if lo < hi:
            yield lo - start, off + lo - at, hi - lo
        at += size
        if at >= start + n:
            return


def _send_ranges(group: ReplicaGroup, tier: StorageTier, name: str, peer: int) -> None:
    """Serve the ranges of ``name`` that group member ``peer`` asks for (the count, then each
    range's offset and length): their bytes one after another, in messages of ``PIECE`` (small
    ranges travel together, not a message each); bytes that cannot be read go as zeros, which
    the reader's block digests refuse (it then reads a slower tier or fails)."""
    count = torch.zeros(1, dtype=torch.int64)
    group.recv(count, peer)
    asked = torch.zeros(2 * int(count), dtype=torch.int64)
    if int(count):
        group.recv(asked, peer)
    ranges = asked.view(-1, 2).tolist()
    total = sum(size for _off, size in ranges)
    buf = torch.empty(min(PIECE, total), dtype=torch.uint8)
    fd, readable = None, True
    try:  # one descriptor for every range (None: this filesystem reads by path)
        fd = tier.backend.open_read(tier.path(name), tier.url)
    except (OSError, CheckpointError) as e:
        log.warning("%s/%s cannot be read to send to group member %d: %s", tier.url, name, peer, e)
        readable = False
    try:
        for start in range(0, total, PIECE):
            n = min(PIECE, total - start)
            for at, off, size in _stream(ranges, start, n):
                got = 0
                if readable:
                    try:
                        got = tier.read_into(name, off, buf[at:at + size].numpy(), fd=fd)
                    except (OSError, CheckpointError) as e:
                        log.warning("%s/%s cannot be read to send to group member %d: %s", tier.url, name, peer, e)
                        readable = False
                buf[at + got:at + size].zero_()
            group.send(buf[:n], peer)
    finally:
        if fd is not None:
            os.close(fd)


def _recv_ranges(group: ReplicaGroup, tier: StorageTier, name: str, ranges: tuple[tuple[int, int], ...],
                 peer: int) -> bool:
    """Ask group member ``peer`` for ``ranges`` of ``name`` and write them at their offsets in
    ``tier``'s file of that name (the rest of it left unwritten); False where they cannot be
    stored (they are received all the same, so that both sides stay in step)."""
    group.send(torch.tensor([len(ranges)], dtype=torch.int64), peer)
    if ranges:
        group.send(torch.tensor([x for r in ranges for x in r], dtype=torch.int64), peer)
    total = sum(size for _off, size in ranges)
    buf = torch.empty(min(PIECE, total), dtype=torch.uint8)
    sink = None
    try:
        tier.makedirs()
        if not tier.is_real_dir():  # a link put in its place: nothing is written through it
            raise NotADirectoryError(f"{tier.url} is not a directory of its own")
        sink = tier.open_sink(name, o_direct=False, drop_cache=False)
    except OSError as e:
        log.warning("%s/%s cannot be stored here (%s): received and dropped", tier.url, name, e)
    try:
        for start in range(0, total, PIECE):
            n = min(PIECE, total - start)
            group.recv(buf[:n], peer)
            if sink is None:
                continue
            try:
                for at, off, size in _stream(ranges, start, n):
                    sink.pwrite(buf[at:at + size].numpy(), off)
            except OSError as e:
                log.warning("%s/%s cannot be stored here (%s): received and dropped", tier.url, name, e)
                sink.abort()
                sink = None
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    if sink is None:
        return False
    try:
        sink.close(sync=False)  # read by this load, at once; a lost copy is asked for again
    except OSError as e:
        log.warning("%s/%s cannot be stored here (%s): dropped", tier.url, name, e)
        return False
    return True
