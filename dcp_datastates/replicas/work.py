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

import functools
import logging
import os
import socket
from dataclasses import dataclass

import msgpack
import torch

from .. import process_state
from ..errors import CheckpointError
from ..format import decode_manifest
from ..format.names import (
    data_file_save_id,
    rank_file_of,
    replica_record_name,
    replica_record_of,
)
from ..format.records import CommittedSave
from ..format.values import pack_plain
from ..tiers.commit import ByDecision, commit_manifest
from ..tiers.manifests import load_manifest, manifest_head
from ..tiers.storage import StorageTier
from ..tiers.tidy import Tidy
from .group import ReplicaGroup
from .records import ReplicaRecord
from .transfer import Incoming, Outgoing, exchange_files

log = logging.getLogger(__name__)

NODE_ENV = "DCP_DATASTATES_NODE"  # overrides the node a rank is on (tests, odd launchers)


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
        return cls(tuple(process_state.gather(mine, pg)))

    def layout(self) -> tuple[list[str], dict[str, list[int]]]:
        """The node names, sorted, and each node's ranks (callers must not change them)."""
        return self._layout[0], self._layout[1]

    @functools.cached_property
    def _layout(self) -> tuple[list[str], dict[str, list[int]], list[tuple[int, int]]]:
        """``layout`` and each rank's (node's place in it, rank's place on its node): made once,
        as ``peer`` and ``sender`` are asked for every rank of a step (a repair at 16,384 ranks
        made it again per call: 30 s)."""
        names = sorted(set(self.nodes))
        ranks: dict[str, list[int]] = {n: [] for n in names}
        for r, n in enumerate(self.nodes):
            ranks[n].append(r)
        index = {n: i for i, n in enumerate(names)}
        where = [(0, 0)] * len(self.nodes)
        for n, rs in ranks.items():
            for j, r in enumerate(rs):
                where[r] = (index[n], j)
        return names, ranks, where

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
        return self._ring(rank, k)

    def sender(self, rank: int, k: int) -> int:
        """The rank whose ``k``-th replica ``rank`` holds."""
        return self._ring(rank, -k)

    def _ring(self, rank: int, k: int) -> int:
        """The rank in ``rank``'s place on the node ``k`` places on in the ring of nodes."""
        names, ranks, where = self._layout
        i, j = where[rank]
        return ranks[names[(i + k) % len(names)]][j]


class _Exchange:
    """One round: this rank's files to member ``dst`` and member ``src``'s files from it, at
    once, over ``group`` (``transfer.py``); ``src_rank`` is the rank that names the files
    ``src`` sends."""

    def __init__(self, group: ReplicaGroup, tier: StorageTier, dst: int, src: int, src_rank: int) -> None:
        self.group, self.tier, self.dst, self.src, self.src_rank = group, tier, dst, src, src_rank

    def _both(self, out: torch.Tensor | None, into: torch.Tensor | None) -> None:
        self.group.exchange(out, self.dst, into, self.src)

    def run(self, files: list[tuple[str, int]], digests: dict[str, str] | None = None, keep: bool = True
            ) -> tuple[dict[str, list], bool, list[str]]:
        """Send ``files`` (name, size) and receive the peer's.  Returns what was received and
        checked (name -> [size, digest hex]), whether the peer received and checked every file
        sent, and what went wrong here.  ``digests`` gets each sent file's digest; with
        ``keep`` False every incoming file is received and dropped."""
        head = pack_plain([[n, s] for n, s in files])
        n_in = torch.zeros(1, dtype=torch.int64)
        self._both(torch.tensor([len(head)], dtype=torch.int64), n_in)
        theirs = torch.empty(int(n_in.item()), dtype=torch.uint8)
        self._both(torch.frombuffer(bytearray(head), dtype=torch.uint8), theirs)
        incoming = [(str(n), int(s)) for n, s in msgpack.unpackb(theirs.numpy().tobytes(), raw=False)]
        out = Outgoing(self.tier, files)
        into = Incoming(self.tier, incoming, refuse=self._refuse if keep else lambda name: "")
        exchange_files(self.group, out, self.dst, into, self.src)
        if digests is not None:
            digests.update(out.digests)
        problems = out.problems + [p for p in into.problems if p]
        received = {name: [size, into.kept[name].hash.hexdigest()] for name, size in incoming if name in into.kept}
        ok_here = torch.tensor([int(len(received) == len(incoming))], dtype=torch.int64)
        ok_there = torch.zeros(1, dtype=torch.int64)
        self._both(ok_here, ok_there)  # each side says whether it received every file intact
        return received, bool(ok_there.item()) and not out.unreadable, problems

    def _refuse(self, name: str) -> str | None:
        """Why file ``name`` offered by ``src`` is received and dropped, never written here."""
        got = rank_file_of(name)
        if got is None or got[0] != self.src_rank:
            return f"rank {self.src_rank} offered {name!r}, not one of its own files"
        return None


def commit_on_node(tier: StorageTier, committed: CommittedSave) -> None:
    """Commit save ``committed`` in this node's directory ``tier``, where the
    coordinator did not (on its node, its own commit stands), then remove what the
    coordinator's own commit removes on its node (``tidy.py``), by ownership: what the replaced
    save owned here (its ranks' files and the replicas this node held of them) and what the
    dead attempts the save took over wrote here, never a file the new manifest or another
    committed one lists.  What it replaces is older: a plain writer's replicator commits one
    save at a time in the saves' order, and ``Checkpointer`` one save of a step at a time.
    Ranks of one node may run it at once: both commit the same bytes, neither removes the
    other's temporary manifest, and a file already removed is no error."""
    head = manifest_head(tier)
    if head is not None and head.save_id == committed.save_id:
        return
    old = None
    if head is not None:
        try:
            old = load_manifest(tier)
        except (CheckpointError, OSError) as e:  # leaking its files is recoverable
            log.warning("%s: the manifest this save replaces cannot be read (%s); its files stay", tier.url, e)
    commit_manifest(tier, committed.manifest, committed.save_id, ByDecision("committed by its coordinator"))
    superseded = [old] if old is not None and old.save_id != committed.save_id else []
    if superseded or committed.took_over:
        Tidy(tier, committed.save_id, superseded=superseded, dead_ids=list(committed.took_over), temps=False).run(
            set(decode_manifest(committed.manifest, source=tier.url).files))


@dataclass(frozen=True)
class ReplicaPeers:
    """Who replicates with whom: the members of a replica group, their nodes and the copies
    wanted.  Members are known by their place in ``ranks``; ``ranks[i]`` is the global rank
    that names member ``i``'s files."""

    nodes: NodeMap  # by member
    ranks: tuple[int, ...]  # by member: its global rank in the job
    me: int  # this rank's member
    wanted: int  # the copies a step needs to count as fully replicated
    replicas: int  # the copies this job's nodes allow (``NodeMap.usable``)
    timeout_s: float

    @property
    def rank(self) -> int:
        return self.ranks[self.me]

    def node_ranks(self) -> list[int]:
        """The global ranks on this rank's node (this one included)."""
        mine = self.nodes.nodes[self.me]
        return [self.ranks[i] for i, n in enumerate(self.nodes.nodes) if n == mine]


class ReplicaWork:
    """What one rank does to replicate its saves: agree with the other members on a save's
    fate, commit its manifest on this node, exchange files with the peers and record the
    outcome.  It runs where the bytes are sent from (the replicator's thread, or its helper
    process), over ``group``."""

    def __init__(self, peers: ReplicaPeers, group: ReplicaGroup) -> None:
        self.peers, self.group = peers, group

    @property
    def broken(self) -> bool:
        """Whether an operation of the group failed since it was made."""
        return self.group.broken

    def use_epoch(self, epoch: int | None) -> None:
        """Before a save given ``epoch`` (``replica_group.decide_epoch``): the group made again
        where the epoch is newer than its own (every member does, at the same save)."""
        if epoch is not None and epoch > self.group.epoch:
            self.group.remake(epoch)

    def agree(self, tier: StorageTier, save_id: str, ok: bool, coordinator: bool) -> int | None:
        """Every member's view of a plain writer's save at once (a collective): ``ok`` whether
        this rank's files of ``save_id`` are durable, ``coordinator`` whether this rank commits
        its manifest.  The coordinator's member when every member wrote the same save, else
        None (nothing is replicated)."""
        p = self.peers
        views = self.group.all_gather_object((save_id, ok, coordinator))
        failed = [p.ranks[i] for i, v in enumerate(views) if not v[1]]
        coordinators = [i for i, v in enumerate(views) if v[2]]
        if failed or len({v[0] for v in views}) != 1 or len(coordinators) != 1:
            log.info("%s: save %s did not write on every rank (failed: %s); nothing replicated",
                     tier.url, save_id, failed or "ranks disagree")
            if failed:  # DCP commits no save whose writes failed on a rank: its files are litter
                self._drop_own(tier, save_id)
            return None
        return coordinators[0]

    def _drop_own(self, tier: StorageTier, save_id: str) -> None:
        """Remove this rank's files of ``save_id``, a save that will never commit, from its
        node's directory (nobody else knows them there: the coordinator tidies its own node)."""
        try:
            for name, _ in self.own_files(tier, save_id):
                tier.remove(name)
        except OSError as e:  # litter, not loss: the next save through this path takes it over
            log.warning("%s: rank %d's files of the failed save %s could not be removed: %s", tier.url,
                        self.peers.rank, save_id, e)

    def replicate_save(self, tier: StorageTier, save_id: str, coordinator: int, committed: CommittedSave | None
                       ) -> ReplicaRecord | None:
        """After ``agree``: the coordinator's member ``coordinator`` hands over ``committed``,
        the save as it committed it (None: not committed, and nothing is replicated); it is
        committed on this node too and this rank's files are replicated (a collective)."""
        p = self.peers
        committed = self.group.broadcast_object(committed, coordinator)
        if committed is None:
            log.info("%s: save %s did not commit; nothing replicated", tier.url, save_id)
            return None
        # Every rank of another node commits it there (the first to come writes it and tidies;
        # the others find it committed) before its caller lets go of the rank's base locks:
        # from then on the manifest keeps alive what the rank's files reference.  On the
        # coordinator's node the commit is the coordinator's own, and a later save may have
        # replaced it there by now (replication lagging training): then nothing of this one is
        # sent or kept.
        superseded = None
        if p.nodes.nodes[coordinator] == p.nodes.nodes[p.me]:
            head = manifest_head(tier)
            superseded = head.save_id if head is not None and head.save_id != save_id else None
        else:
            try:
                commit_on_node(tier, committed)
            except (OSError, CheckpointError) as e:  # the peers still get this rank's files
                log.warning("%s: save %s could not be committed on this node: %s", tier.url, save_id, e)
        rec = self.replicate(tier, tier.url, save_id, superseded)
        try:
            for n in tier.listdir():  # this rank's records of the saves this one replaced
                old = replica_record_of(n)
                if old is not None and old[0] == p.rank and old[1] != save_id:
                    tier.remove(n)
        except OSError as e:  # a stale record misleads nobody: the manifest names the save
            log.warning("%s: rank %d's records of replaced saves could not be removed: %s", tier.url, p.rank, e)
        return rec

    def own_files(self, tier: StorageTier, save_id: str) -> list[tuple[str, int]]:
        """This rank's data files and part of ``save_id`` in ``tier``, with their sizes."""
        out = []
        for name in sorted(tier.listdir()):
            got = rank_file_of(name)
            if got is not None and got[0] == self.peers.rank and data_file_save_id(name) == save_id:
                out.append((name, tier.size(name)))
        return out

    def replicate(self, tier: StorageTier, label: str, save_id: str, superseded: str | None = None
                  ) -> ReplicaRecord:
        """Send this rank's files of ``save_id`` in ``tier`` to its peers, receive theirs and
        record both (a collective of the members).  ``superseded``: the save that replaced
        ``save_id`` in ``tier`` before it could be replicated (replication lagging training);
        then nothing is sent or kept here, and the record says it is degraded."""
        p = self.peers
        files = [] if superseded else self.own_files(tier, save_id)
        sent: dict = {}
        confirmed: list[int] = []
        held: dict[int, dict] = {}
        errors = [f"save {superseded} replaced it here first"] if superseded else []
        digests: dict[str, str] = {}
        for k in range(1, p.replicas + 1):
            dst, src = p.nodes.peer(p.me, k), p.nodes.sender(p.me, k)
            try:
                got, confirmed_there, problems = _Exchange(self.group, tier, dst, src, p.ranks[src]).run(
                    files, digests, not superseded)
            except (RuntimeError, OSError, CheckpointError) as e:  # a dead peer: degraded
                errors.append(f"replica {k} (to rank {p.ranks[dst]}, from rank {p.ranks[src]}): {e}")
                break  # the group may be broken: later rounds would wait out the timeout again
            held[p.ranks[src]] = got
            errors += [f"replica {k}: {q}" for q in problems]
            if confirmed_there:
                confirmed.append(p.ranks[dst])
            else:
                errors.append(f"replica {k}: rank {p.ranks[dst]} did not receive every file intact")
        for name, size in files:
            sent[name] = [size, digests.get(name, "")]
        if not errors and len(confirmed) < p.wanted:
            errors.append(f"{p.wanted} replica(s) wanted, but no other node is there to hold them")
        rec = ReplicaRecord(p.rank, save_id, p.wanted, sent, confirmed, held)
        tier.commit_bytes(replica_record_name(rec.rank, save_id), rec.to_bytes())
        if errors:
            log.warning("%s is degraded on rank %d: %s", label, rec.rank, "; ".join(errors))
        else:
            log.info("%s: rank %d's %d file(s) replicated to ranks %s", label, rec.rank, len(files), confirmed)
        return rec
