"""The bytes of a node-local restore's repair (``repair.py``) on the wire: the moves it
plans, each between two members of the replica group, and what each side does with them.

Every rank walks the same list of moves in the same order and takes part in those it is a side
of, so each pair's sends and receives match.  A whole file goes as ``transfer.py`` sends every
file, kept only when its bytes match the digest recorded when it was replicated; the decided
save's manifest is received into memory and committed through ``tiers.commit``.
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

from ..errors import CheckpointError
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.model import Span
from ..format.names import MANIFEST_NAME
from ..tiers.backend import Sink
from ..tiers.commit import ByDecision, commit_manifest
from ..tiers.storage import StorageTier
from .group import ReplicaGroup
from .transfer import PIECE, Held, Incoming, Landing, recv_files, send_files

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
        return set(self._moved(moves, digests, Landing))

    def manifest(self, moves: list[Move], digest: str, save_id: str) -> bool:
        """Send the manifest of save ``save_id`` as ``moves`` say (the same list on every rank);
        where this rank receives it and its bytes match ``digest``, commit it in this node's
        directory on the load's decision (``tiers.commit``): whether it did.  A node whose
        storage fails the commit keeps what it had (its ranks are sent the file list)."""
        held = self._moved(moves, {MANIFEST_NAME: digest}, Held).get(MANIFEST_NAME)
        if not isinstance(held, Held):  # not received here (another rank's move, or dropped)
            return False
        try:
            return commit_manifest(self.tier, bytes(held.data), save_id, ByDecision("the save this load reads"))
        except (OSError, CheckpointError) as e:
            log.warning("%s: the manifest of save %s could not be committed here: %s", self.label, save_id, e)
            return False

    def _moved(self, moves: list[Move], digests: dict[str, str], land: type) -> dict[str, Landing | Held]:
        kept: dict[str, Landing | Held] = {}
        for mv in moves:
            if self.me not in (mv.src, mv.dst):
                continue
            if self.me == mv.src:
                out = send_files(self.group, self.tier, [(mv.name, mv.size)], mv.dst)
                for p in out.problems:
                    log.warning("%s: %s (sent to rank %d as zeros)", self.label, p, self.ranks[mv.dst])
                continue
            big = land is Held and mv.size > MAX_MANIFEST_BYTES  # received and dropped
            into = Incoming(self.tier, [(mv.name, mv.size)], expect=digests, land=land, make_dir=True,
                            refuse=lambda name, big=big: f"{name} is over the manifest size limit" if big else None)
            got = recv_files(self.group, into, mv.src)
            kept.update(got.kept)
            for p in got.problems:
                log.warning("%s: %s", self.label, p)
            ok = mv.name in got.kept
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
