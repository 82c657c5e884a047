"""The bytes of a node-local restore's repair (``replica_repair.py``) on the wire: the moves it
plans, each between two members of the replica group, and what each side does with them.

Every rank walks the same list of moves in the same order and takes part in those it is a side
of, so each pair's sends and receives match.  A whole file lands in the node's directory under
a temporary name, kept only when its bytes match the digest recorded when it was replicated.
The small records ranks read of files their nodes lack travel otherwise: every rank takes part
in the same max-reductions of their bytes (each byte not zero only on its source), so what a
rank receives follows the bytes some rank lacks, not the ranks times the files they come from;
each rank keeps the ranges it reads in its borrowed directory (``borrowed.py``), checked by
the load that reads them.  A side whose storage fails still sends or receives every byte, so
that no pair falls out of step."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import xxhash

from ..errors import CheckpointError
from ..format.model import Span
from ..tiers.backend import Sink
from ..tiers.storage import StorageTier
from .group import ReplicaGroup
from .work import PIECE, Landing, piece_buffer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Move:
    """One file sent from one node's first rank to another's (group positions)."""

    name: str
    src: int
    dst: int
    size: int


@dataclass(frozen=True)
class Lent:
    """A range some rank reads of a file its node lacks (``span``): read by member ``src`` (a
    rank whose node holds the file) and reduced to every member."""

    span: Span
    src: int


class Wire:
    """One repair's transfers over ``group``, this rank being member ``me`` (global ranks
    ``ranks``) with its node's directory ``tier``; ``label`` names the step in the log."""

    def __init__(self, group: ReplicaGroup, me: int, ranks, tier: StorageTier, label: str) -> None:
        self.group, self.me, self.ranks, self.tier, self.label = group, me, ranks, tier, label

    def files(self, moves: list[Move], digests: dict[str, str]) -> set[str]:
        """Send each of ``moves`` (every rank walks the same list in the same order); the names
        this rank received and kept: each only with the digest ``digests`` records for it, or,
        where none is recorded (a file no replication vouched for), with the digest its sender
        took of what it sent (the load then checks each block it reads, as always)."""
        kept = set()
        for mv in moves:
            if self.me not in (mv.src, mv.dst):
                continue
            peer = mv.dst if self.me == mv.src else mv.src
            if self.me == mv.src:
                _send_file(self.group, self.tier, mv.name, mv.size, peer)
                continue
            ok = _recv_file(self.group, self.tier, mv.name, mv.size, peer, digests.get(mv.name))
            if ok:
                kept.add(mv.name)
            log.log(logging.INFO if ok else logging.WARNING, "%s: %s %s from rank %d", self.label,
                    "restored" if ok else "could not restore", mv.name, self.ranks[mv.src])
        return kept

    def lend(self, pieces: list[Lent], wanted: dict[str, tuple[tuple[int, int], ...]],
             into: StorageTier) -> tuple[set[str], int]:
        """Every one of ``pieces`` (the same list on every rank) to every rank, in rounds of at
        most ``PIECE`` bytes, each one max-reduction in which only a piece's source holds its
        bytes (one that cannot read them sends zeros, which the reader's block digests refuse);
        this rank stores the ranges it reads (``wanted``: file -> (offset, length) pairs) at
        their offsets in ``into``'s file of that name (the rest of it left unwritten).  The
        files of which it stored every range it wanted, and the bytes it stored."""
        rounds: list[list[Span]] = []
        size = 0
        mine: set[Span] = set()  # those this rank reads from its node's copy
        for p in pieces:
            if not rounds or size + p.span.nbytes > PIECE:
                rounds.append([])
                size = 0
            rounds[-1].append(p.span)
            size += p.span.nbytes
            if p.src == self.me:
                mine.add(p.span)
        want = {Span(f, o, n) for f, rs in wanted.items() for o, n in rs}
        sinks = _Sinks(into)
        src = _Source(self.tier)
        got = 0
        try:
            for batch in rounds:
                buf = torch.zeros(sum(x.nbytes for x in batch), dtype=torch.uint8)
                at = 0
                for x in batch:
                    if x in mine:
                        src.read(x.file, x.offset, buf[at:at + x.nbytes])
                    at += x.nbytes
                self.group.all_reduce_max(buf)
                at = 0
                for x in batch:
                    if x in want:
                        got += sinks.write(x.file, buf[at:at + x.nbytes], x.offset)
                        want.discard(x)
                    at += x.nbytes
        except BaseException:
            sinks.abort()
            raise
        finally:
            src.close()
        lacking = {x.file for x in want}  # ranges no piece brought (on no node)
        return sinks.close() - lacking, got


class _Source:
    """Reads of this node's copies for the pieces a rank sends (one descriptor per file); a
    file that cannot be read gives zeros from then on."""

    def __init__(self, tier: StorageTier) -> None:
        self.tier = tier
        self._fds: dict[str, int | None] = {}
        self._bad: set[str] = set()

    def read(self, name: str, offset: int, out: torch.Tensor) -> None:
        if name in self._bad:
            return
        try:
            if name not in self._fds:  # None: this filesystem reads by path
                self._fds[name] = self.tier.backend.open_read(self.tier.path(name), self.tier.url)
            n = self.tier.read_into(name, offset, out.numpy(), fd=self._fds[name])
            out[n:].zero_()
        except (OSError, CheckpointError) as e:
            log.warning("%s/%s cannot be read to lend its ranges: %s", self.tier.url, name, e)
            self._bad.add(name)
            out.zero_()

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()


class _Sinks:
    """The files of ranges a rank stores in its borrowed directory ``tier``, opened at their
    first range; one that cannot be stored is dropped (its ranges received all the same)."""

    def __init__(self, tier: StorageTier) -> None:
        self.tier = tier
        self._open: dict[str, Sink | None] = {}

    def write(self, name: str, data: torch.Tensor, offset: int) -> int:
        """``data`` at ``offset`` of ``name``; the bytes stored (0 where it is dropped)."""
        if name not in self._open:
            self._open[name] = self._start(name)
        sink = self._open[name]
        if sink is None:
            return 0
        try:
            sink.pwrite(data.numpy(), offset)
        except OSError as e:
            log.warning("%s/%s cannot be stored here (%s): received and dropped", self.tier.url, name, e)
            sink.abort()
            self._open[name] = None
            return 0
        return data.numel()

    def _start(self, name: str) -> Sink | None:
        try:
            self.tier.makedirs()
            if not self.tier.is_real_dir():  # a link put in its place: nothing is written through it
                raise NotADirectoryError(f"{self.tier.url} is not a directory of its own")
            return self.tier.open_sink(name, o_direct=False, drop_cache=False)
        except OSError as e:
            log.warning("%s/%s cannot be stored here (%s): received and dropped", self.tier.url, name, e)
            return None

    def abort(self) -> None:
        for sink in self._open.values():
            if sink is not None:
                sink.abort()
        self._open.clear()

    def close(self) -> set[str]:
        """Close every file (read by this load, at once; a lost copy is asked for again): the
        names stored."""
        kept = set()
        for name, sink in self._open.items():
            if sink is None:
                continue
            try:
                sink.close(sync=False)
                kept.add(name)
            except OSError as e:
                log.warning("%s/%s cannot be stored here (%s): dropped", self.tier.url, name, e)
        self._open.clear()
        return kept


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


def _recv_file(group: ReplicaGroup, tier: StorageTier, name: str, size: int, peer: int,
               digest: str | None) -> bool:
    """Receive ``name`` into ``tier``; keep it only when its bytes match ``digest`` (None: the
    digest its sender sends after the bytes, which one that could not read them zeroes).  Where this
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
        sent = tail.numpy().tobytes()
        return landing.keep(sent if digest is None or landing.hash.hexdigest() == digest else b"")
    except OSError as e:
        log.warning("%s/%s cannot be stored here (%s): dropped", tier.url, name, e)
        return False
