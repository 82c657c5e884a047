"""Peer replicas of node-local checkpoints: ``Checkpointer(..., node_local=True, replicas=K)``.

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

import datetime
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgpack
import torch
import torch.distributed as dist
import xxhash

from .errors import CheckpointError
from .format import decode_manifest
from .format.layout import ALIGNMENT, align_up
from .format.names import (
    MANIFEST_NAME,
    TEMP_INFIX,
    data_file_save_id,
    rank_file_of,
    replica_record_name,
)
from .format.replica_record import ReplicaRecord
from .format.values import pack_plain
from .tiers import StorageTier
from .tiers.manifests import load_manifest, manifest_head
from .tiers.replica_records import read_record, records_in

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

    def _layout(self) -> tuple[list[str], dict[str, list[int]]]:
        names = sorted(set(self.nodes))
        ranks: dict[str, list[int]] = {n: [] for n in names}
        for r, n in enumerate(self.nodes):
            ranks[n].append(r)
        return names, ranks

    def usable(self, k: int) -> int:
        """How many of ``k`` replicas can each go to another node (fewer nodes: fewer replicas,
        said in the log; ranks spread unevenly over nodes: ``ValueError`` in one line)."""
        names, ranks = self._layout()
        sizes = {len(v) for v in ranks.values()}
        if len(sizes) != 1:
            raise ValueError(f"replicas need the same number of ranks on every node, found {sorted(sizes)}")
        if k >= len(names):
            log.warning("replicas=%d needs at least %d nodes; with %d, %d replica(s) per file", k, k + 1,
                        len(names), len(names) - 1)
        return min(k, len(names) - 1)

    def peer(self, rank: int, k: int) -> int:
        """The rank that holds the ``k``-th replica (1-based) of ``rank``'s files."""
        names, ranks = self._layout()
        i = names.index(self.nodes[rank])
        j = ranks[self.nodes[rank]].index(rank)
        return ranks[names[(i + k) % len(names)]][j]

    def sender(self, rank: int, k: int) -> int:
        """The rank whose ``k``-th replica ``rank`` holds."""
        names, ranks = self._layout()
        i = names.index(self.nodes[rank])
        j = ranks[self.nodes[rank]].index(rank)
        return ranks[names[(i - k) % len(names)]][j]


def _piece_buffer() -> torch.Tensor:
    """``PIECE`` bytes at an ``ALIGNMENT`` boundary, so that a piece can be written O_DIRECT."""
    raw = torch.empty(PIECE + ALIGNMENT, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGNMENT
    return raw[shift:shift + PIECE]


class _Landing:
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
        """The ``n`` bytes at the start of ``buf`` (a ``_piece_buffer``) go at ``offset`` (a
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
        sinks: dict[int, _Landing] = {}
        received: dict[str, list] = {}
        sendbuf = torch.empty(PIECE, dtype=torch.uint8)
        recvbuf = _piece_buffer()
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

    def _incoming(self, incoming, piece, refused: set, sinks: dict[int, _Landing], buf: torch.Tensor,
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

    def _store(self, incoming, piece, refused: set, sinks: dict[int, _Landing], buf: torch.Tensor,
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
            sinks[i] = _Landing(self.tier, name)
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


class Replicator:
    """Replicates each committed step of this rank, one step at a time, on a thread of its own
    over a gloo group of its own (made here: a collective over ``pg``'s ranks)."""

    def __init__(self, replicas: int, pg=None, node: str | None = None, timeout_s: float = 300.0) -> None:
        self.nodes = NodeMap.gather(pg, node)
        self.wanted = replicas  # what a step needs to count as fully replicated
        self.replicas = self.nodes.usable(replicas)  # what this job's nodes allow
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
        self._global = ranks
        self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank(pg)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dcpds-replicas", daemon=True)
        self._thread.start()

    def submit(self, tier: StorageTier, step: int, save_id: str) -> Future:
        """Replicate this rank's files of ``save_id`` in ``tier`` (the step's node-local
        directory); the future resolves to its ``ReplicaRecord``."""
        fut: Future = Future()
        self._q.put((tier, step, save_id, fut))
        return fut

    def _run(self) -> None:
        while True:
            tier, step, save_id, fut = self._q.get()
            try:
                fut.set_result(self._replicate(tier, step, save_id))
            except BaseException as e:  # noqa: BLE001 - delivered through the future, and logged there
                fut.set_exception(e)

    def node_ranks(self) -> list[int]:
        """The global ranks on this rank's node (this one included)."""
        mine = self.nodes.nodes[self.rank]
        return [self._global[r] for r, n in enumerate(self.nodes.nodes) if n == mine]

    def own_files(self, tier: StorageTier, save_id: str) -> list[tuple[str, int]]:
        """This rank's data files and part of ``save_id`` in ``tier``, with their sizes."""
        out = []
        for name in sorted(tier.listdir()):
            got = rank_file_of(name)
            if got is not None and got[0] == self._global[self.rank] and data_file_save_id(name) == save_id:
                out.append((name, tier.size(name)))
        return out

    def _replicate(self, tier: StorageTier, step: int, save_id: str) -> ReplicaRecord:
        files = self.own_files(tier, save_id)
        sent: dict = {}
        confirmed: list[int] = []
        held: dict[int, dict] = {}
        errors = []
        digests: dict[str, str] = {}
        for k in range(1, self.replicas + 1):
            dst = self._global[self.nodes.peer(self.rank, k)]
            src = self._global[self.nodes.sender(self.rank, k)]
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
        rec = ReplicaRecord(self._global[self.rank], save_id, self.wanted, sent, confirmed, held)
        tier.commit_bytes(replica_record_name(rec.rank, save_id), rec.to_bytes())
        if errors:
            log.warning("step %d is degraded on rank %d: %s", step, rec.rank, "; ".join(errors))
        else:
            log.info("step %d: rank %d's %d file(s) replicated to ranks %s", step, rec.rank, len(files),
                     confirmed)
        return rec


@dataclass(frozen=True)
class Holding:
    """A file one node holds for a step: its size and the xxh3-128 of its bytes, and whether
    that digest matches the one recorded when the file was replicated."""

    size: int
    digest: str
    vouched: bool


def _inventory(tier: StorageTier, save_id: str) -> dict[str, Holding]:
    """The step files of ``save_id`` in ``tier`` (data files, parts, the manifest), each hashed
    and checked against the digests the replica records there give."""
    try:
        names = tier.listdir()
        recs = records_in(tier, save_id)
    except OSError:
        return {}
    recorded: dict[str, str] = {}
    for rec in recs:
        for f, v in rec.sent.items():
            if len(v) > 1 and v[1]:
                recorded[f] = v[1]
        for files in rec.held.values():
            for f, v in files.items():
                recorded[f] = v[1]
    out = {}
    for name in names:
        if name != MANIFEST_NAME and data_file_save_id(name) != save_id:
            continue
        h = xxhash.xxh3_128()
        size = 0
        buf = bytearray(PIECE)
        try:
            while True:
                n = tier.read_into(name, size, buf)
                h.update(memoryview(buf)[:n])
                size += n
                if n < len(buf):
                    break
        except (OSError, CheckpointError) as e:
            log.warning("%s/%s cannot be read for the replica check: %s", tier.url, name, e)
            continue
        digest = h.hexdigest()
        out[name] = Holding(size, digest, recorded.get(name) == digest)
    return out


def repair(rep: "Replicator", tier: StorageTier, step: int, save_id: str | None) -> bool:
    """Before a restore of ``step`` (a collective over the replicator's group): make every
    node's directory ``tier`` of the step hold the manifest and every file it lists, copied from
    a node whose copy matches its recorded digest.  Returns whether every file the manifest
    lists is on every node; False when some file has no good copy left (the caller then reads
    a slower tier or an older step).  ``save_id``: the save to repair (None: the newest any
    node holds)."""
    names, ranks = rep.nodes._layout()
    mine = rep.nodes.nodes[rep.rank]
    leader = ranks[mine][0] == rep.rank  # one rank per node hashes and receives
    inv = {}
    if save_id is None:
        heads: list = [None] * len(rep._global)
        local = manifest_head(tier) if leader else None
        dist.all_gather_object(heads, local, group=rep.group)
        found = [h for h in heads if h is not None]
        if not found:
            return False
        save_id = max(found, key=lambda h: (h.created_unix, h.save_id)).save_id
    if leader:
        inv = _inventory(tier, str(save_id))
    views: list = [None] * len(rep._global)
    dist.all_gather_object(views, (mine, inv) if leader else None, group=rep.group)
    per_node = {v[0]: v[1] for v in views if v is not None}
    manifest = [(n, h) for n, h in per_node.items() if MANIFEST_NAME in h]
    if not manifest:
        return False
    # the manifest: from the node whose copy most nodes share (every node committed the same bytes)
    counts: dict[str, int] = {}
    for _n, h in manifest:
        counts[h[MANIFEST_NAME].digest] = counts.get(h[MANIFEST_NAME].digest, 0) + 1
    want_manifest = max(counts, key=lambda d: (counts[d], d))
    # only to nodes that lost theirs: a node's committed manifest of another save is never replaced
    _transfer(rep, tier, {n: h for n, h in per_node.items()}, ranks, {MANIFEST_NAME: want_manifest}, step,
              skip=lambda node: MANIFEST_NAME in per_node.get(node, {}))
    m = None
    if leader:
        try:
            m = load_manifest(tier)
        except (CheckpointError, OSError) as e:  # none came: this node's ranks will read elsewhere or fail
            log.warning("step %d: no readable manifest on this node after the repair: %s", step, e)
    need = sorted(n for n in (m.files if m is not None else {}) if n not in m.homes) if m is not None else []
    lists: list = [None] * len(rep._global)
    dist.all_gather_object(lists, need if leader else None, group=rep.group)
    need = sorted({n for x in lists if x for n in x})
    good: dict[str, str] = {}
    for n in need:
        vouched = {h[n].digest for h in per_node.values() if n in h and h[n].vouched}
        if len(vouched) == 1:
            good[n] = vouched.pop()
    lost = [n for n in need if n not in good]
    _transfer(rep, tier, per_node, ranks, good, step)
    if lost:
        log.warning("step %d: no good copy of %d file(s) on any node (first: %s); reading them from a "
                    "slower tier if one holds the step", step, len(lost), lost[0])
    return not lost


def _transfer(rep: "Replicator", tier: StorageTier, per_node: dict[str, dict[str, Holding]],
              ranks: dict[str, list[int]], files: dict[str, str], step: int, skip=None) -> None:
    """Copy each of ``files`` (name -> digest) to every node whose leader lacks a copy with that
    digest (and that ``skip(node)`` does not exclude), from a node that has one; every rank walks
    the same list in the same order."""
    moves = []
    for name in sorted(files):
        holders = sorted(n for n, h in per_node.items() if name in h and h[name].digest == files[name])
        if not holders:
            continue
        for i, node in enumerate(sorted(ranks)):
            h = per_node.get(node, {})
            if (name in h and h[name].digest == files[name]) or (skip is not None and skip(node)):
                continue
            src = holders[i % len(holders)]
            moves.append((name, ranks[src][0], ranks[node][0], per_node[src][name].size))
    me = rep.rank
    for name, src, dst, size in moves:
        if me not in (src, dst):
            continue
        peer = rep._global[dst if me == src else src]
        if me == src:
            _send_file(rep.group, tier, name, size, peer)
        else:
            ok = _recv_file(rep.group, tier, name, size, peer, files[name])
            log.log(logging.INFO if ok else logging.WARNING, "step %d: %s %s from rank %d", step,
                    "restored" if ok else "could not restore", name, src)


def _send_file(group, tier: StorageTier, name: str, size: int, peer: int) -> None:
    buf = torch.empty(PIECE, dtype=torch.uint8)
    h = xxhash.xxh3_128()
    for a in range(0, size, PIECE):
        n = min(PIECE, size - a)
        tier.read_into(name, a, buf[:n].numpy())
        h.update(buf[:n].numpy().data)
        dist.send(buf[:n], peer, group=group)
    dist.send(torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8), peer, group=group)


def _recv_file(group, tier: StorageTier, name: str, size: int, peer: int, digest: str) -> bool:
    """Receive ``name`` into ``tier``; keep it only when its bytes match ``digest``."""
    buf = _piece_buffer()
    tier.makedirs()
    landing = _Landing(tier, name)
    try:
        for a in range(0, size, PIECE):
            n = min(PIECE, size - a)
            dist.recv(buf[:n], peer, group=group)
            landing.write(buf, n, a)
    except BaseException:
        landing.abort()
        raise
    tail = torch.empty(16, dtype=torch.uint8)
    dist.recv(tail, peer, group=group)
    return landing.keep(tail.numpy().tobytes() if landing.hash.hexdigest() == digest else b"")


class NodeCopies:
    """This node's copy of each step of a run whose first tier is node-local: the manifest the
    coordinator committed on its own node, committed here too; with ``replicas``, this rank's
    files of the step sent on to its peers' nodes (``Replicator``); before a restore, this
    node's directory of the step repaired from the others (``repair``).  ``tier_of(step)``: the
    step's node-local directory."""

    def __init__(self, tier_of: Callable[[int], StorageTier], replicas: int = 0, pg=None,
                 node: str | None = None) -> None:
        self.tier_of = tier_of
        self.replicator: Replicator | None = None
        if replicas:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("replicas travel over torch.distributed: call dist.init_process_group first")
            self.replicator = Replicator(replicas, pg, node)  # a collective: every rank
        self._lock = threading.Lock()
        self._done: set[int] = set()  # steps this node committed
        self._replicating: dict[int, Future] = {}

    def committed(self, step: int, body: bytes) -> None:
        """Step ``step`` committed with manifest ``body``: commit it on this node, and start its
        replication.  Called when an async save's future completes and again from the next
        wait; the second call finds it done."""
        with self._lock:
            if step in self._done:
                return
            self._done.add(step)
            t = self.tier_of(step)
            if not t.exists(MANIFEST_NAME):
                t.makedirs()
                t.commit_bytes(MANIFEST_NAME, body)
            if self.replicator is not None:
                self._replicating[step] = self.replicator.submit(t, step, decode_manifest(body).save_id)

    def record(self, step: int, timeout: float | None = None) -> ReplicaRecord:
        """This rank's replica record of ``step``, once its replication ended."""
        return self._replicating[step].result(timeout)

    def busy(self) -> set[int]:
        """Steps whose replication has not ended: retention keeps them."""
        return {step for step, fut in self._replicating.items() if not fut.done()}

    def newest_replicated(self, steps: list[int]) -> int | None:
        """The newest of ``steps`` (committed on this node) that every rank of this node has
        fully replicated, by their records in the node's directory: retention keeps it, so that
        a node lost while newer steps replicate leaves a step its peers hold.  Every rank of
        the node reads the same records, so every purge of the directory keeps the same step
        (or a newer one, once its records are complete)."""
        if self.replicator is None:
            return None
        local = self.replicator.node_ranks()
        for step in sorted(steps, reverse=True):
            t = self.tier_of(step)
            head = manifest_head(t)
            if head is None:
                continue
            recs = [read_record(t, r, head.save_id) for r in local]
            if all(rec is not None and rec.complete for rec in recs):
                return step
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every step so far is replicated; False when one ended degraded."""
        ok = True
        for step, fut in sorted(self._replicating.items()):
            try:
                ok = fut.result(timeout).complete and ok
            except (RuntimeError, OSError, CheckpointError) as e:
                log.warning("step %d: replication failed: %s", step, e)
                ok = False
        return ok

    def repair(self, step: int, save_id: str | None) -> bool:
        """Before restoring ``step``: whether this node (and every other) holds a good copy of
        each of its files, after the repair (``repair``); True without replicas."""
        return True if self.replicator is None else repair(self.replicator, self.tier_of(step), step, save_id)
