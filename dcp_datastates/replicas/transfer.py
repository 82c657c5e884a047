"""One file transfer between two members of the replica group: replication's and the repair's.

A file goes as pieces of at most ``PIECE`` bytes, then the 16-byte xxh3-128 digest its sender
took of what it sent.  The receiver writes the pieces under a temporary name as they come and
renames the file into place only when the whole matches that digest (and, where the caller
knows one, the digest recorded when the file was replicated); a manifest is held in memory
instead, for its caller to commit through ``tiers.commit``.

Both sides walk the same list of messages (:func:`messages`) whatever fails on the way: a file
that cannot be read goes as zeros with a zero digest, which no receiver keeps; one that cannot
be stored is still received, and dropped.  So neither side ever waits for a message the other
will not send; only a peer that died leaves the other to the group's timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import xxhash

from ..errors import CheckpointError
from ..format.layout import ALIGNMENT, align_up
from ..format.names import TEMP_INFIX
from ..tiers.storage import StorageTier
from .group import ReplicaGroup

log = logging.getLogger(__name__)

PIECE = 4 << 20  # bytes per message: two buffers of it per exchange
DIGEST = 16


@dataclass(frozen=True)
class Message:
    """One message of a transfer: ``nbytes`` of file ``file`` (its index in the list) from
    ``offset``, or, where ``offset`` is -1, that file's digest."""

    file: int
    offset: int
    nbytes: int

    @property
    def is_digest(self) -> bool:
        return self.offset < 0


def messages(files: list[tuple[str, int]]) -> list[Message]:
    """The messages that carry ``files`` (name, size), in order: each file's pieces (one empty
    piece for an empty file), then its digest."""
    out = []
    for i, (_, size) in enumerate(files):
        out += [Message(i, a, min(PIECE, size - a)) for a in range(0, max(size, 1), PIECE)]
        out.append(Message(i, -1, DIGEST))
    return out


def piece_buffer() -> torch.Tensor:
    """``PIECE`` bytes at an ``ALIGNMENT`` boundary, so that a piece can be written O_DIRECT."""
    raw = torch.empty(PIECE + ALIGNMENT, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGNMENT
    return raw[shift:shift + PIECE]


class Landing:
    """A file arriving into a directory: written under a temporary name and hashed as its
    pieces come, kept under its own name only when the whole matches.  Written O_DIRECT where
    the filesystem allows: a replica is not read again soon, and on a busy node the page
    cache's writeback of another node's bytes costs training more than direct writes."""

    def __init__(self, tier: StorageTier, name: str, size: int) -> None:
        self.tier, self.name = tier, name
        self.tmp = name + TEMP_INFIX + "replica"
        self.hash = xxhash.xxh3_128()
        self.sink = tier.open_sink(self.tmp, o_direct=True, drop_cache=True)

    def write(self, buf: torch.Tensor, n: int, offset: int) -> None:
        """The ``n`` bytes at the start of ``buf`` (a ``piece_buffer``) go at ``offset``."""
        chunk = buf[:n].numpy()
        self.hash.update(chunk.data)
        if not n:
            return
        if getattr(self.sink, "o_direct", False):  # whole blocks; the file is cut to its size at close
            self.sink.pwrite(buf[:align_up(n)].numpy().data, offset, logical=n)
        else:
            self.sink.pwrite(chunk, offset)

    def keep(self, digest: bytes) -> bool:
        """Make it durable; rename it into place when its bytes match ``digest``, else drop it."""
        try:
            self.sink.close(sync=True)
        except BaseException:
            self.sink.abort()
            raise
        if digest != self.hash.digest():
            self.tier.remove(self.tmp)
            return False
        self.tier.publish(self.tmp, self.name)
        return True

    def abort(self) -> None:
        self.sink.abort()


class Held:
    """A file arriving into memory (a manifest, which only ``tiers.commit`` may write)."""

    def __init__(self, tier: StorageTier, name: str, size: int) -> None:
        self.name, self.data = name, bytearray(size)
        self.hash = xxhash.xxh3_128()

    def write(self, buf: torch.Tensor, n: int, offset: int) -> None:
        chunk = buf[:n].numpy()
        self.hash.update(chunk.data)
        self.data[offset:offset + n] = chunk.tobytes()

    def keep(self, digest: bytes) -> bool:
        return digest == self.hash.digest()

    def abort(self) -> None:
        self.data = bytearray()


class Outgoing:
    """The messages of ``files`` of ``tier``, read as they are asked for.  ``digests`` gets
    each file's digest as it is sent; ``problems`` says what could not be read."""

    def __init__(self, tier: StorageTier, files: list[tuple[str, int]]) -> None:
        self.tier, self.files = tier, files
        self.buf = torch.empty(PIECE, dtype=torch.uint8)
        self._hash = [xxhash.xxh3_128() for _ in files]
        self.unreadable: set[int] = set()
        self.digests: dict[str, str] = {}
        self.problems: list[str] = []

    def message(self, m: Message) -> torch.Tensor:
        name = self.files[m.file][0]
        if m.is_digest:  # zeros where the file could not be read: no receiver keeps it
            if m.file in self.unreadable:
                return torch.zeros(DIGEST, dtype=torch.uint8)
            self.digests[name] = self._hash[m.file].hexdigest()
            return torch.frombuffer(bytearray(self._hash[m.file].digest()), dtype=torch.uint8)
        out = self.buf[:m.nbytes]
        if m.file not in self.unreadable:
            try:
                if self.tier.read_into(name, m.offset, out.numpy()) != m.nbytes:
                    raise OSError(f"{name} is shorter than its {self.files[m.file][1]} bytes")
                self._hash[m.file].update(out.numpy().data)
                return out
            except (OSError, CheckpointError) as e:
                self.problems.append(f"{name} could not be read: {e}")
                self.unreadable.add(m.file)
        out.zero_()
        return out


@dataclass
class Incoming:
    """The messages of ``files`` arriving into ``tier``.  A file is kept when its digest
    matches and, where ``expect`` names one, that digest too; ``refuse(name)`` (a reason, or
    None) drops a file unwritten; ``land`` says where a file's bytes go; ``make_dir`` creates
    the directory where it is missing (a repair's; replication never makes again a directory
    that retention removed).  A file that cannot be stored here is dropped and the rest still
    received."""

    tier: StorageTier
    files: list[tuple[str, int]]
    expect: dict[str, str] = field(default_factory=dict)
    refuse: Callable[[str], str | None] = lambda name: None
    land: type = Landing
    make_dir: bool = False
    kept: dict[str, Landing | Held] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buf = piece_buffer()
        self._open: dict[int, Landing | Held] = {}
        self._dropped: set[int] = set()
        for i, (name, _) in enumerate(self.files):
            why = self.refuse(name)
            if why is not None:
                self.problems.append(why)
                self._dropped.add(i)

    def buffer(self, m: Message) -> torch.Tensor:
        """Where message ``m`` is received."""
        return self.buf[:DIGEST] if m.is_digest else self.buf[:m.nbytes]

    def took(self, m: Message) -> None:
        """Message ``m``, just received into ``buffer(m)``."""
        if m.file in self._dropped:
            return
        name, size = self.files[m.file]
        try:
            if not m.is_digest:
                if m.file not in self._open:
                    if self.make_dir:
                        self.tier.makedirs()
                    self._open[m.file] = self.land(self.tier, name, size)
                self._open[m.file].write(self.buf, m.nbytes, m.offset)
                return
            into = self._open.pop(m.file, None)
            if into is None:
                return
            sent = self.buf[:DIGEST].numpy().tobytes()
            want = self.expect.get(name)
            if into.keep(sent if want is None or into.hash.hexdigest() == want else b""):
                self.kept[name] = into
            else:
                self.problems.append(f"{name} does not match its digest: dropped")
        except (OSError, CheckpointError) as e:
            self.problems.append(f"{self.tier.url}/{name} cannot be stored here ({e}): received and dropped")
            self._dropped.add(m.file)
            into = self._open.pop(m.file, None)
            if into is not None:
                into.abort()

    def abort(self) -> None:
        for into in self._open.values():
            into.abort()
        self._open.clear()


def send_files(group: ReplicaGroup, tier: StorageTier, files: list[tuple[str, int]], peer: int) -> Outgoing:
    """Send ``files`` of ``tier`` to member ``peer``, which runs :func:`recv_files`."""
    out = Outgoing(tier, files)
    for m in messages(files):
        group.send(out.message(m), peer)
    return out


def recv_files(group: ReplicaGroup, into: Incoming, peer: int) -> Incoming:
    """Receive ``into.files`` from member ``peer``, which runs :func:`send_files`."""
    try:
        for m in messages(into.files):
            group.recv(into.buffer(m), peer)
            into.took(m)
    finally:
        into.abort()
    return into


def exchange_files(group: ReplicaGroup, out: Outgoing, dst: int, into: Incoming, src: int) -> None:
    """Send ``out.files`` to member ``dst`` while receiving ``into.files`` from member ``src``."""
    sends, recvs = messages(out.files), messages(into.files)
    try:
        for k in range(max(len(sends), len(recvs))):
            group.exchange(out.message(sends[k]) if k < len(sends) else None, dst,
                           into.buffer(recvs[k]) if k < len(recvs) else None, src)
            if k < len(recvs):
                into.took(recvs[k])
    finally:
        into.abort()


__all__ = ["PIECE", "Held", "Incoming", "Landing", "Message", "Outgoing", "exchange_files", "messages",
           "piece_buffer", "recv_files", "send_files"]
