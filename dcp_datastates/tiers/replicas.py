"""Peer replicas of node-local checkpoints: ``Checkpointer(..., node_local=True, replicas=K)``
and ``DataStatesWriter(..., replicas=K)``.

After a step commits on the node-local tier, each rank sends the files it wrote there (its data
files and, in format 4, its metadata part) to ``K`` ranks on other nodes, which store them in
their own node-local directory of the same step.  The names carry the rank and the save, so a
replica sits beside the receiving node's own files without clashing, and a reader on that node
finds it as it finds any file of the step.

Who holds whose copy (``NodeMap``): the ranks of each node in order, nodes sorted by name; the
``k``-th replica of local rank ``j`` of node ``i`` goes to local rank ``j`` of node
``(i + k) mod n``, so every node sends and receives the same number of files and no replica
lands on its own node.  The bytes travel over a gloo group of their own (never interleaved
with training's collectives), in 4 MiB messages, both directions at once, each file followed by
the xxh3-128 of its bytes, checked on arrival.  A file is written under a temporary name and
renamed once it checks out.

Each rank records what it sent and each receiver what it holds, per step
(``names.replica_record``): the sender's record ``sent`` lists its files with their sizes and
digests and the peers that confirmed them; the receiver's record ``held`` the same for the
sender's files it holds.  A step is *fully replicated* when every rank's record says ``K``
peers confirmed; one whose replication failed (a peer died, a digest did not match) keeps
what exists, its records say what is missing, and the log says ``degraded``.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

import msgpack
import torch
import torch.distributed as dist
import xxhash
from torch.futures import Future as TorchFuture

from ..errors import CheckpointError
from ..format import decode_manifest
from ..format.layout import ALIGNMENT, align_up
from ..format.names import (
    MANIFEST_NAME,
    TEMP_INFIX,
    data_file_save_id,
    rank_file_of,
    replica_record_name,
    replica_record_of,
)
from ..format.replica_record import ReplicaRecord
from ..format.values import pack_plain
from .manifests import load_manifest, manifest_head
from .storage import StorageTier
from .tidy import Tidy

log = logging.getLogger(__name__)

NODE_ENV = "DCP_DATASTATES_NODE"  # overrides the node a rank is on (tests, odd launchers)
PIECE = 4 << 20  # bytes per message: two buffers of it per exchange


def node_name() -> str:
    """This process's node: ``DCP_DATASTATES_NODE``, else torchrun's ``GROUP_RANK``, else the
    host name."""
    for key in (NODE_ENV, "GROUP_RANK"):
        v = os.environ.get(key)
        if v:
            return v
    return socket.gethostname()


@dataclass(frozen=True)
class NodeMap:
    """The node of every rank of a group, and who holds whose replicas."""

    nodes: tuple[str, ...]  # by group rank

    @classmethod
    def gather(cls, pg=None, node: str | None = None) -> "NodeMap":
        """Every rank's node, gathered over ``pg`` (a collective)."""
        mine = node or node_name()
        if not (dist.is_available() and dist.is_initialized()):
            return cls((mine,))
        got: list = [None] * dist.get_world_size(pg)
        dist.all_gather_object(got, mine, group=pg)
        return cls(tuple(got))

    def layout(self) -> tuple[list[str], dict[str, list[int]]]:
        names = sorted(set(self.nodes))
        ranks: dict[str, list[int]] = {n: [] for n in names}
        for r, n in enumerate(self.nodes):
            ranks[n].append(r)
        return names, ranks

    def usable(self, k: int) -> int:
        """How many of ``k`` replicas can each go to another node (fewer nodes: fewer replicas,
        said in the log; ranks spread unevenly over nodes: ``ValueError`` in one line)."""
        names, ranks = self.layout()
        sizes = {len(v) for v in ranks.values()}
        if len(sizes) != 1:
            raise ValueError(f"replicas need the same number of ranks on every node, found {sorted(sizes)}")
        if k >= len(names):
            log.warning("replicas=%d needs at least %d nodes; with %d, %d replica(s) per file", k, k + 1,
                        len(names), len(names) - 1)
        return min(k, len(names) - 1)

    def peer(self, rank: int, k: int) -> int:
        """The rank that holds the ``k``-th replica (1-based) of ``rank``'s files."""
        names, ranks = self.layout()
        i = names.index(self.nodes[rank])
        j = ranks[self.nodes[rank]].index(rank)
        return ranks[names[(i + k) % len(names)]][j]

    def sender(self, rank: int, k: int) -> int:
        """The rank whose ``k``-th replica ``rank`` holds."""
        names, ranks = self.layout()
        i = names.index(self.nodes[rank])
        j = ranks[self.nodes[rank]].index(rank)
        return ranks[names[(i - k) % len(names)]][j]


def piece_buffer() -> torch.Tensor:
    """``PIECE`` bytes at an ``ALIGNMENT`` boundary, so that a piece can be written O_DIRECT."""
    raw = torch.empty(PIECE + ALIGNMENT, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGNMENT
    return raw[shift:shift + PIECE]


class Landing:
    """A replica arriving: written under a temporary name and hashed as its pieces come, kept
    under its own name only when the whole file matches the digest its sender gives.  Written
    O_DIRECT where the filesystem allows: a replica is not read again soon, and on a busy node
    the page cache's writeback of another node's bytes costs training more than direct writes
    from the receive buffer."""

    def __init__(self, tier: StorageTier, name: str) -> None:
        self.tier, self.name = tier, name
        self.tmp = name + TEMP_INFIX + "replica"
        self.hash = xxhash.xxh3_128()
        self.sink = tier.open_sink(self.tmp, o_direct=True, drop_cache=True)

    def write(self, buf: torch.Tensor, n: int, offset: int) -> None:
        """The ``n`` bytes at the start of ``buf`` (a ``piece_buffer``) go at ``offset`` (a
        multiple of ``PIECE``)."""
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
        os.replace(self.tier.path(self.tmp), self.tier.path(self.name))
        return True

    def abort(self) -> None:
        self.sink.abort()


class _Exchange:
    """One round: this rank's files to ``dst`` and ``src``'s files from it, at once, over
    ``group`` (global ranks)."""

    def __init__(self, group, tier: StorageTier, dst: int, src: int) -> None:
        self.group, self.tier, self.dst, self.src = group, tier, dst, src

    def _both(self, out: torch.Tensor | None, into: torch.Tensor | None) -> None:
        works = []
        if out is not None:
            works.append(dist.isend(out, self.dst, group=self.group))
        if into is not None:
            works.append(dist.irecv(into, self.src, group=self.group))
        for w in works:
            w.wait()

    def run(self, files: list[tuple[str, int]], digests: dict[str, str] | None = None
            ) -> tuple[dict[str, list], bool, list[str]]:
        """Send ``files`` (name, size) and receive the peer's.  Returns what was received and
        checked (name -> [size, digest hex]), whether the peer received and checked every file
        sent, and what went wrong here.  Both sides exchange exactly the messages their headers
        announce whatever fails on the way (a file that cannot be read is sent as zeros with a
        digest that cannot match), so neither side waits for a message the other will not send;
        only a peer that died leaves the other to the group's timeout.  ``digests`` gets each
        sent file's digest."""
        head = pack_plain([[n, s] for n, s in files])
        n_in = torch.zeros(1, dtype=torch.int64)
        self._both(torch.tensor([len(head)], dtype=torch.int64), n_in)
        theirs = torch.empty(int(n_in.item()), dtype=torch.uint8)
        self._both(torch.frombuffer(bytearray(head), dtype=torch.uint8), theirs)
        incoming = [(str(n), int(s)) for n, s in msgpack.unpackb(theirs.numpy().tobytes(), raw=False)]
        problems: list[str] = []
        refused = set()
        for i, (name, _) in enumerate(incoming):
            got = rank_file_of(name)
            if got is None or got[0] != self.src:  # received and dropped: never written here
                problems.append(f"rank {self.src} offered {name!r}, not one of its own files")
                refused.add(i)
        out_seq = _with_digests(_pieces(files))
        in_seq = _with_digests(_pieces(incoming))
        hashers = [xxhash.xxh3_128() for _ in files]
        unreadable: set[int] = set()
        sinks: dict[int, Landing] = {}
        received: dict[str, list] = {}
        sendbuf = torch.empty(PIECE, dtype=torch.uint8)
        recvbuf = piece_buffer()
        try:
            for k in range(max(len(out_seq), len(in_seq))):
                out = into = None
                if k < len(out_seq):
                    out = self._outgoing(files, out_seq[k], hashers, unreadable, sendbuf, digests, problems)
                if k < len(in_seq):
                    i, a, n = in_seq[k]
                    into = recvbuf[:16] if a < 0 else recvbuf[:n]
                self._both(out, into)
                if k < len(in_seq):
                    self._incoming(incoming, in_seq[k], refused, sinks, recvbuf, received, problems)
        finally:
            for landing in sinks.values():
                landing.abort()
        ok_here = torch.tensor([int(len(received) == len(incoming))], dtype=torch.int64)
        ok_there = torch.zeros(1, dtype=torch.int64)
        self._both(ok_here, ok_there)  # each side says whether it received every file intact
        return received, bool(ok_there.item()) and not unreadable, problems

    def _outgoing(self, files, piece, hashers, unreadable: set, buf: torch.Tensor, digests, problems) -> torch.Tensor:
        i, a, n = piece
        name = files[i][0]
        if a < 0:  # the digest of file i; zeros where the file could not be read
            if i in unreadable:
                return torch.zeros(16, dtype=torch.uint8)
            if digests is not None:
                digests[name] = hashers[i].hexdigest()
            return torch.frombuffer(bytearray(hashers[i].digest()), dtype=torch.uint8)
        if i not in unreadable:
            try:
                got = self.tier.read_into(name, a, buf[:n].numpy())
                if got != n:
                    raise OSError(f"{name} is shorter than its {files[i][1]} bytes")
                hashers[i].update(buf[:n].numpy().data)
                return buf[:n]
            except (OSError, CheckpointError) as e:
                problems.append(f"{name} could not be read: {e}")
                unreadable.add(i)
        buf[:n].zero_()
        return buf[:n]

    def _incoming(self, incoming, piece, refused: set, sinks: dict[int, Landing], buf: torch.Tensor,
                  received: dict, problems: list) -> None:
        """Piece ``piece`` of an incoming file, just received into ``buf``.  A local failure to
        store it (the step's directory purged meanwhile, a full disk) drops the file and keeps
        receiving, so the peer is never left waiting."""
        try:
            self._store(incoming, piece, refused, sinks, buf, received, problems)
        except (OSError, CheckpointError) as e:
            i = piece[0]
            problems.append(f"the replica of {incoming[i][0]} could not be stored here: {e}")
            refused.add(i)
            landing = sinks.pop(i, None)
            if landing is not None:
                landing.abort()

    def _store(self, incoming, piece, refused: set, sinks: dict[int, Landing], buf: torch.Tensor,
               received: dict, problems: list) -> None:
        i, a, n = piece
        name, size = incoming[i]
        if i in refused:
            return
        if a < 0:  # the file's digest: keep it only when it matches
            landing = sinks.pop(i, None)
            if landing is None:
                return
            if not landing.keep(buf[:16].numpy().tobytes()):
                problems.append(f"the replica of {name} from rank {self.src} does not match its digest")
                return
            received[name] = [size, landing.hash.hexdigest()]
            return
        if i not in sinks:
            sinks[i] = Landing(self.tier, name)
        sinks[i].write(buf, n, a)


def _pieces(files: list[tuple[str, int]]) -> list[tuple[int, int, int]]:
    """``(file, offset, nbytes)`` of each file in messages of at most ``PIECE`` bytes (one empty
    message for an empty file)."""
    return [(i, a, min(PIECE, s - a)) for i, (_, s) in enumerate(files) for a in range(0, max(s, 1), PIECE)]


def _with_digests(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``pieces`` in order, with ``(file, -1, 16)`` after the last piece of each file."""
    out = []
    for x, nxt in zip(pieces, pieces[1:] + [(-1, 0, 0)]):
        out.append(x)
        if nxt[0] != x[0]:
            out.append((x[0], -1, 16))
    return out


def _commit_here(tier: StorageTier, save_id: str, body: bytes) -> None:
    """Commit the manifest ``body`` of save ``save_id`` in this node's directory ``tier`` (the
    coordinator's node has it already), then remove what the save it replaces owned here, as
    the coordinator's own commit does on its node (``tidy.py``): the replaced save's files, its
    ranks' and the replicas this node held of them, never a file the new manifest lists."""
    head = manifest_head(tier)
    if head is not None and head.save_id == save_id:
        return
    old = None
    if head is not None:
        try:
            old = load_manifest(tier)
        except (CheckpointError, OSError) as e:  # leaking its files is recoverable
            log.warning("%s: the manifest this save replaces cannot be read (%s); its files stay", tier.url, e)
    tier.commit_bytes(MANIFEST_NAME, body)
    if old is not None and old.save_id != save_id:
        Tidy(tier, save_id, superseded=[old]).run(set(decode_manifest(body, source=tier.url).files))


@dataclass(frozen=True)
class SaveToReplicate:
    """One save of a plain ``DataStatesWriter(replicas=K)`` on this rank."""

    tier: StorageTier  # this node's directory of the checkpoint
    save_id: str
    written: TorchFuture  # DCP's future of this rank's writes: resolved once its files are durable
    manifest: Future | None  # the coordinator's: the committed manifest's bytes, or None (not committed)


class Replicator:
    """Replicates each committed step of this rank, one step at a time, on a thread of its own
    over a gloo group of its own (made here: a collective over ``pg``'s ranks)."""

    def __init__(self, replicas: int, pg=None, node: str | None = None, timeout_s: float = 300.0) -> None:
        self.nodes = NodeMap.gather(pg, node)
        self.wanted = replicas  # what a step needs to count as fully replicated
        self.replicas = self.nodes.usable(replicas)  # what this job's nodes allow
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
        self.global_ranks = ranks
        self.group = cast(dist.ProcessGroup, dist.new_group(ranks=ranks, backend="gloo",
                                                           timeout=datetime.timedelta(seconds=timeout_s)))
        self.rank = dist.get_rank(pg)
        self.timeout_s = timeout_s
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dcpds-replicas", daemon=True)
        self._thread.start()

    def submit(self, tier: StorageTier, step: int, save_id: str) -> Future:
        """Replicate this rank's files of ``save_id`` in ``tier`` (the step's node-local
        directory, committed on every node); the future resolves to its ``ReplicaRecord``."""
        return self._queue(lambda: self._replicate(tier, f"step {step}", save_id))

    def submit_save(self, save: SaveToReplicate) -> Future:
        """A plain writer's save (``SaveToReplicate``), queued when DCP asks this rank for its
        data, so every rank queues its saves in DCP's order.  Once every rank's files are
        durable and the coordinator committed the manifest, the manifest is committed on this
        node too and this rank's files are replicated; the future resolves to its
        ``ReplicaRecord``, or None when the save did not commit (nothing is replicated)."""
        return self._queue(lambda: self._replicate_save(save))

    def _queue(self, work: Callable[[], ReplicaRecord | None]) -> Future:
        fut: Future = Future()
        self._q.put((work, fut))
        return fut

    def _run(self) -> None:
        while True:
            work, fut = self._q.get()
            try:
                fut.set_result(work())
            except BaseException as e:  # noqa: BLE001 - delivered through the future, and logged there
                fut.set_exception(e)

    def _replicate_save(self, save: SaveToReplicate) -> ReplicaRecord | None:
        try:
            save.written.wait()
            ok = True
        except Exception as e:  # noqa: BLE001 - the save failed on this rank; DCP raises it to the caller
            log.debug("%s: save %s failed on this rank (%s); it will not be replicated", save.tier.url,
                      save.save_id, e)
            ok = False
        views: list = [None] * len(self.global_ranks)
        dist.all_gather_object(views, (save.save_id, ok, save.manifest is not None), group=self.group)
        failed = [self.global_ranks[r] for r, v in enumerate(views) if not v[1]]
        ids = {v[0] for v in views}
        coordinators = [self.global_ranks[r] for r, v in enumerate(views) if v[2]]
        if failed or len(ids) != 1 or len(coordinators) != 1:
            log.info("%s: save %s did not write on every rank (failed: %s); nothing replicated",
                     save.tier.url, save.save_id, failed or "ranks disagree")
            return None
        body = [None]
        if save.manifest is not None:
            try:
                body[0] = save.manifest.result(self.timeout_s)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                log.warning("%s: save %s was not committed within %.0f s; nothing replicated",
                            save.tier.url, save.save_id, self.timeout_s)
        dist.broadcast_object_list(body, src=coordinators[0], group=self.group)
        if body[0] is None:
            log.info("%s: save %s did not commit; nothing replicated", save.tier.url, save.save_id)
            return None
        me = self.global_ranks[self.rank]
        if self.node_ranks()[0] == me:  # one rank per node commits there and tidies
            try:
                _commit_here(save.tier, save.save_id, bytes(body[0]))
            except (OSError, CheckpointError) as e:  # the peers still get this rank's files
                log.warning("%s: save %s could not be committed on this node: %s", save.tier.url,
                            save.save_id, e)
        rec = self._replicate(save.tier, save.tier.url, save.save_id)
        try:
            for n in save.tier.listdir():  # this rank's records of the saves this one replaced
                got = replica_record_of(n)
                if got is not None and got[0] == me and got[1] != save.save_id:
                    save.tier.remove(n)
        except OSError as e:  # a stale record misleads nobody: the manifest names the save
            log.warning("%s: rank %d's records of replaced saves could not be removed: %s", save.tier.url, me, e)
        return rec

    def node_ranks(self) -> list[int]:
        """The global ranks on this rank's node (this one included)."""
        mine = self.nodes.nodes[self.rank]
        return [self.global_ranks[r] for r, n in enumerate(self.nodes.nodes) if n == mine]

    def own_files(self, tier: StorageTier, save_id: str) -> list[tuple[str, int]]:
        """This rank's data files and part of ``save_id`` in ``tier``, with their sizes."""
        out = []
        for name in sorted(tier.listdir()):
            got = rank_file_of(name)
            if got is not None and got[0] == self.global_ranks[self.rank] and data_file_save_id(name) == save_id:
                out.append((name, tier.size(name)))
        return out

    def _replicate(self, tier: StorageTier, label: str, save_id: str) -> ReplicaRecord:
        files = self.own_files(tier, save_id)
        sent: dict = {}
        confirmed: list[int] = []
        held: dict[int, dict] = {}
        errors = []
        digests: dict[str, str] = {}
        for k in range(1, self.replicas + 1):
            dst = self.global_ranks[self.nodes.peer(self.rank, k)]
            src = self.global_ranks[self.nodes.sender(self.rank, k)]
            try:
                got, confirmed_there, problems = _Exchange(self.group, tier, dst, src).run(files, digests)
            except (RuntimeError, OSError, CheckpointError) as e:  # a dead peer: degraded
                errors.append(f"replica {k} (to rank {dst}, from rank {src}): {e}")
                break  # the group may be broken: later rounds would wait out the timeout again
            held[src] = got
            errors += [f"replica {k}: {p}" for p in problems]
            if confirmed_there:
                confirmed.append(dst)
            else:
                errors.append(f"replica {k}: rank {dst} did not receive every file intact")
        for name, size in files:
            sent[name] = [size, digests.get(name, "")]
        if not errors and len(confirmed) < self.wanted:
            errors.append(f"{self.wanted} replica(s) wanted, but no other node is there to hold them")
        rec = ReplicaRecord(self.global_ranks[self.rank], save_id, self.wanted, sent, confirmed, held)
        tier.commit_bytes(replica_record_name(rec.rank, save_id), rec.to_bytes())
        if errors:
            log.warning("%s is degraded on rank %d: %s", label, rec.rank, "; ".join(errors))
        else:
            log.info("%s: rank %d's %d file(s) replicated to ranks %s", label, rec.rank, len(files),
                     confirmed)
        return rec


_SHARED: dict[tuple, Replicator] = {}
_SHARED_LOCK = threading.Lock()


def shared_replicator(replicas: int | None, pg=None, node: str | None = None) -> Replicator:
    """This process's replicator of ``replicas`` copies among ``pg``'s ranks (None: any number,
    for a repair), made on first use (a collective over them: every rank asks at the same point
    of its program, as writers made before each ``dcp.save`` do) and reused by every later
    writer or reader that asks alike."""
    ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else tuple(range(dist.get_world_size()))
    key = (replicas or 0, node or node_name(), ranks, dist.group.WORLD)  # a new job's group: a new one
    with _SHARED_LOCK:
        rep = _SHARED.get(key)
        if rep is None and replicas is None:
            rep = next((r for k, r in _SHARED.items() if k[1:] == key[1:]), None)
        if rep is None:
            rep = _SHARED[key] = Replicator(replicas or 0, pg, node)
        return rep
