"""Before a restore from node-local copies: each node's directory of the step given what its
ranks read, from copies on other nodes whose bytes match the digests recorded when they were
replicated (``replicas.py``).  Collectives over the replicator's group, in two steps:

1. ``NodeRepair.survey`` (before the manifest is read): the ranks of each node list what it
   holds of the save (names, sizes and recorded digests, each rank a share of the directory;
   no file read but the manifest); a node without the manifest receives it, and every rank
   reads the file list from its own node's copy (sent only where a node has none); the answer
   is whether every file the manifest lists is held, at its size, on some node.
2. ``NodeRepair.fetch`` (once each rank knows its load plan, ``loading/node_local.py``): each node
   receives the files its ranks read that it lacks, each from a node that holds it, checked on
   arrival against the digest recorded when it was replicated.  What a node holds at its size
   is read once, by the load, which checks every block against its digest; where some rank's
   load meets a damaged copy, every rank surveys again and fetches with ``verify``: a node then
   hashes what its ranks read, and receives what it holds damaged too.  A node never receives
   a file its ranks do not read: a node lost from a large job is given back its share, not the
   whole checkpoint."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import xxhash

from ..errors import CheckpointError
from ..format.names import (
    MANIFEST_NAME,
    data_file_save_id,
    rank_file_of,
    replica_record_name,
    replica_record_of,
)
from ..format.replica_record import ReplicaRecord
from .manifests import load_manifest, manifest_head
from .replica_group import ReplicaGroup
from .replica_records import read_record
from .replicas import PIECE, Landing, piece_buffer
from .replicator import Replicator
from .storage import StorageTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listing:
    """What one node holds of a save: each step file's size, the digests its replica records
    give (its own files' and those it holds for others), and its manifest's digest."""

    sizes: dict[str, int]
    recorded: dict[str, str]
    manifest: str | None


_NOTHING = Listing({}, {}, None)


@dataclass(frozen=True)
class Move:
    """One file sent from one node's first rank to another's (group positions)."""

    name: str
    src: int
    dst: int
    size: int


@dataclass(frozen=True)
class FileList:
    """What a save's manifest lists: its own files (name -> size), the ranks that saved it, and
    the files it reads from earlier checkpoints of the run (an incremental save), by the
    directory and save that hold them: (directory, save id) -> {name: size}."""

    files: dict[str, int]
    world: int  # of an earlier directory's list (``NodeRepair.given``): the referencing save's
    referenced: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)


@dataclass
class Survey:
    """What every rank knows after ``NodeRepair.survey``: each node's listing, the files the
    save's manifest lists (name -> size, earlier checkpoints' left out) and the recorded
    digests of all nodes."""

    listings: dict[str, Listing]
    files: dict[str, int]
    world: int  # the ranks that saved it
    recorded: dict[str, str] = field(default_factory=dict)
    # file -> the nodes holding it at its size, sorted: made once from the listings, which the
    # repair never changes (asking each node per file cost files x nodes: seconds at 16k ranks)
    _holding: dict[str, list[str]] | None = field(default=None, init=False, repr=False)

    def writers(self) -> dict[int, set[str]]:
        """The files each rank wrote (its data files and metadata part)."""
        out: dict[int, set[str]] = defaultdict(set)
        for name in self.files:
            got = rank_file_of(name)
            if got is not None:
                out[got[0]].add(name)
        return out

    def entry(self, name: str) -> list:
        """``name`` as a replica record lists it: [size, recorded digest or ""]."""
        return [self.files[name], self.recorded.get(name, "")]

    def holders(self, name: str) -> list[str]:
        """The nodes holding ``name`` at the size the manifest gives, sorted."""
        if self._holding is None:
            holding: dict[str, list[str]] = defaultdict(list)
            for node in sorted(self.listings):
                for f, size in self.listings[node].sizes.items():
                    if self.files.get(f) == size:
                        holding[f].append(node)
            self._holding = holding
        return list(self._holding.get(name, ()))


def _digest(tier: StorageTier, name: str) -> str | None:
    """The xxh3-128 of file ``name`` of ``tier``; None where it cannot be read."""
    h = xxhash.xxh3_128()
    at = 0
    buf = bytearray(PIECE)
    try:
        while True:
            n = tier.read_into(name, at, buf)
            h.update(memoryview(buf)[:n])
            at += n
            if n < len(buf):
                return h.hexdigest()
    except (OSError, CheckpointError) as e:
        log.warning("%s/%s cannot be read for the replica check: %s", tier.url, name, e)
        return None


def _listing(tier: StorageTier, save_id: str, share: int = 0, shares: int = 1) -> Listing:
    """Share ``share`` of ``shares`` of ``tier``'s entries of ``save_id``: the sizes of its
    files (data files, parts, the manifest) and the digests its replica records give; the
    manifest's digest in share 0.  The shares of a node's ranks together are its listing."""
    try:
        names = sorted(tier.listdir())
    except OSError:
        return _NOTHING
    recorded: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for name in names[share::shares]:
        rec_of = replica_record_of(name)
        if rec_of is not None:
            rec = read_record(tier, rec_of[0], save_id) if rec_of[1] == save_id else None
            for f, v in _digests_in(rec):
                recorded[f] = v
        elif name == MANIFEST_NAME or data_file_save_id(name) == save_id:
            try:
                sizes[name] = tier.size(name)
            except OSError:
                continue
    manifest = _digest(tier, MANIFEST_NAME) if share == 0 and MANIFEST_NAME in names else None
    return Listing(sizes, recorded, manifest)


def _digests_in(rec: ReplicaRecord | None) -> Iterable[tuple[str, str]]:
    """The (file, digest) pairs replica record ``rec`` vouches for: its own files and those it
    holds for others."""
    if rec is None:
        return
    for files in (rec.sent, *rec.held.values()):
        for f, v in files.items():
            if len(v) > 1 and v[1]:
                yield f, v[1]


def _merged(parts: Iterable[Listing]) -> Listing:
    """One node's listing from its ranks' shares."""
    sizes: dict[str, int] = {}
    recorded: dict[str, str] = {}
    manifest = None
    for x in parts:
        sizes.update(x.sizes)
        recorded.update(x.recorded)
        manifest = manifest or x.manifest
    return Listing(sizes, recorded, manifest)


class NodeRepair:
    """The repair of this node's directory ``tier`` of one save before a load (``label`` in the
    log; ``save_id`` None: the newest save any node holds).  Every rank of the replicator's
    group calls ``survey`` and then ``fetch``, in that order.

    An incremental save reads some files from earlier checkpoints of the run (its manifest's
    ``homes``): each such directory is repaired alongside (``_earlier``), limited to the files
    the save references there (``given``), so a node lost since is given those too."""

    def __init__(self, rep: Replicator, tier: StorageTier, label: str, save_id: str | None,
                 given: FileList | None = None, pg=None) -> None:
        self.rep, self.tier, self.label, self.save_id = rep, tier, label, save_id
        self.pg = pg  # the load's process group (None: the default one)
        # an earlier checkpoint's directory: the files a later save references there, from its
        # manifest (the directory's own manifest may be gone: retention keeps a purged step's
        # referenced files, and their replica records, as a husk)
        self.given = given
        self._earlier: list[NodeRepair] = []
        _names, self.ranks = rep.peers.nodes.layout()
        self.node = rep.peers.nodes.nodes[rep.peers.me]
        self.leader = self.ranks[self.node][0] == rep.peers.me  # hashes and receives its node's manifest
        self._survey: Survey | None = None
        self._complete: bool | None = None

    def forget(self) -> None:
        """Survey anew at the next ``survey`` (what the nodes hold has changed since)."""
        self._survey, self._complete, self._earlier = None, None, []

    def _gather(self, obj) -> list:
        return self.rep.group.all_gather_object(obj)

    def survey(self) -> bool:
        """Step 1 (once; a collective): the manifest where a node lacks it; whether every file
        it lists is held at its size on some node (False: the caller reads a slower tier or an
        older step).  On the replicator's thread, after its replications under way
        (``Replicator.in_turn``), like ``fetch``; over a group made again first where one
        broke (``Replicator.agree_epoch``, a collective over the load's group)."""
        if self._complete is not None:
            return self._complete
        epoch = self.rep.agree_epoch(self.pg, self.label) if self.given is None else None
        return self.rep.in_turn(self._surveyed, self.label, epoch)

    def _surveyed(self) -> bool:
        self._complete = False
        if self.given is None and self.save_id is None:
            heads = [h for h in self._gather(manifest_head(self.tier) if self.leader else None) if h is not None]
            if not heads:
                return False
            self.save_id = max(heads, key=lambda h: (h.created_unix, h.save_id)).save_id
        mates = self.ranks[self.node]
        mine = _listing(self.tier, str(self.save_id), mates.index(self.rep.peers.me), len(mates))
        shares: dict[str, list[Listing]] = defaultdict(list)
        for node, part in self._gather((self.node, mine)):
            shares[node].append(part)
        listings = {n: _merged(parts) for n, parts in shares.items()}
        files = self.given if self.given is not None else self._manifest_everywhere(listings)
        if files is None:
            return False
        recorded = {f: d for x in listings.values() for f, d in x.recorded.items()}
        self._survey = Survey(listings, files.files, files.world, recorded)
        lost = sorted(n for n in files.files if not self._survey.holders(n))
        if lost:
            log.warning("%s: %d file(s) on no node (first: %s); reading them from a slower tier if one "
                        "holds the step", self.label, len(lost), lost[0])
        # the files it reads from earlier checkpoints, each directory surveyed in turn: every
        # rank walks the same ones in the same order (the file list is the same on all)
        self._earlier = [] if self.given is not None else [
            NodeRepair(self.rep, self.tier.sibling(home), f"{self.label} (its files in {home})", save_id,
                       FileList(names, files.world))
            for (home, save_id), names in sorted(files.referenced.items())]
        earlier_ok = [e.survey() for e in self._earlier]  # each a collective: none skipped
        self._complete = not lost and all(earlier_ok)
        return self._complete

    def _manifest_everywhere(self, listings: dict[str, Listing]) -> FileList | None:
        """The manifest sent to every node that lacks it (a collective); the file list it gives,
        the same on every rank (None: no node holds a manifest of the save)."""
        counts: dict[str, int] = {}
        for x in listings.values():
            if x.manifest is not None:
                counts[x.manifest] = counts.get(x.manifest, 0) + 1
        if not counts:
            return None
        # the manifest: the copy most nodes share (every node committed the same bytes), only to
        # nodes that lack one: a node's committed manifest of another save is never replaced
        want = max(counts, key=lambda d: (counts[d], d))
        holders = sorted(n for n, x in listings.items() if x.manifest == want)
        moves = [Move(MANIFEST_NAME, self.ranks[holders[i % len(holders)]][0], self.ranks[n][0],
                      listings[holders[0]].sizes[MANIFEST_NAME])
                 for i, n in enumerate(sorted(self.ranks)) if MANIFEST_NAME not in listings.get(n, _NOTHING).sizes]
        self._transfer(moves, {MANIFEST_NAME: want})
        self.rep.group.barrier()  # every manifest received is committed before it is read
        here = listings.get(self.node, _NOTHING)
        # a manifest received (none was here) was kept only with the digest wanted; one of
        # another save, or one whose digest could not be taken, is not this save's list
        received = MANIFEST_NAME not in here.sizes and self.tier.exists(MANIFEST_NAME)
        return self._agree_file_list(self._file_list() if here.manifest == want or received else None)

    def _file_list(self) -> FileList | None:
        """What this node's copy of the manifest lists; None where it cannot be read."""
        try:
            m = load_manifest(self.tier)
        except (CheckpointError, OSError) as e:  # this node's ranks read elsewhere or fail
            log.warning("%s: no readable manifest on this node after the repair: %s", self.label, e)
            return None
        referenced: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
        for name, home in m.homes.items():
            save_id = data_file_save_id(name)
            if save_id is not None and name in m.files:
                referenced[(home, save_id)][name] = m.files[name]
        return FileList({n: s for n, s in m.files.items() if n not in m.homes}, m.world_size, dict(referenced))

    def _agree_file_list(self, got: FileList | None) -> FileList | None:
        """Every rank's file list, the same on all: each read its own node's manifest; only
        where a rank could not is the list sent, once, from the first rank that could (None:
        no rank could).  What a rank receives grows with the list, not with the ranks."""
        me, ranks = self.rep.peers.me, self.rep.peers.ranks
        flags = torch.tensor([int(got is not None), me if got is not None else len(ranks)], dtype=torch.int64)
        self.rep.group.all_reduce_min(flags)
        everyone, first = bool(flags[0]), int(flags[1])
        if everyone:
            return got
        if first == len(ranks):
            return None
        return self.rep.group.broadcast_object(got, first)

    def fetch(self, needs: Iterable[str] | None, verify: bool = False) -> bool:
        """Step 2 (a collective): this node given the files its ranks read (``needs``: this
        rank's; None: it reads nothing from this node, or could not tell) and, with replicas,
        its place among them (``_places``).  A file it holds at its size is kept unread (the
        load checks each block it reads); with ``verify``, what its ranks read is hashed first
        and checked against its recorded digest, and received again where it does not match.
        Whatever it receives is checked on arrival.  The ranks of a node share the hashing and
        the transfers (the ``i``-th file or move of a node to its ``i``-th rank, modulo their
        number).  Returns whether every node holds every file it was to hold; False at once
        where the survey found no manifest on any node (every rank knows it alike: the load
        then reads a slower tier)."""
        return self.rep.in_turn(lambda: self._fetched(needs, verify), self.label)

    def _fetched(self, needs: Iterable[str] | None, verify: bool) -> bool:
        s = self._survey
        if s is None:
            return False
        needs = set(needs) if needs is not None else None
        ok = self._fetch(s, needs, verify)
        for e in self._earlier:  # the same on every rank (``survey``)
            ok = e.fetch(needs, verify) and ok
        return ok

    def _fetch(self, s: Survey, needs: Iterable[str] | None, verify: bool) -> bool:
        t0, hashed, received = time.perf_counter(), 0, 0
        reads: dict[str, set[str]] = {n: set() for n in self.ranks}
        mine = sorted(n for n in needs if n in s.files) if needs is not None else None
        for pos, got in enumerate(self._gather(mine)):
            if got:
                reads[self.rep.peers.nodes.nodes[pos]].update(n for n in got if n in s.files)
        places = self._places(s)
        per_node = {n: reads[n] | places[n] for n in self.ranks}
        mates = self.ranks[self.node]
        lacking: list[str] = []  # of this rank's share of the node's list; what its ranks read, hashed
        for name in sorted(per_node[self.node])[mates.index(self.rep.peers.me)::len(mates)]:
            if s.listings.get(self.node, _NOTHING).sizes.get(name) != s.files[name]:
                lacking.append(name)
            elif verify and name in reads[self.node] and name in s.recorded:
                hashed += s.files[name]
                if _digest(self.tier, name) != s.recorded[name]:
                    log.warning("%s: this node's copy of %s does not match its recorded digest", self.label, name)
                    lacking.append(name)
        want: dict[str, set[str]] = {n: set() for n in self.ranks}
        for node, names in self._gather((self.node, lacking)):
            want[node].update(names)
        first = {n: set(fs) for n, fs in want.items()}  # a node's own copy is no source when bad
        tried: dict[tuple[str, str], set[str]] = {}
        while True:
            moves = []
            for node in sorted(want):
                for name in sorted(want[node]):
                    seen = tried.setdefault((node, name), set())
                    src = [h for h in s.holders(name) if name not in first[h] and h not in seen]
                    if name not in s.recorded or not src:
                        continue
                    i = len(moves)
                    pick = src[i % len(src)]
                    seen.add(pick)
                    moves.append(Move(name, self.ranks[pick][i % len(self.ranks[pick])],
                                      self.ranks[node][i % len(self.ranks[node])], s.files[name]))
            if not moves:
                break
            kept = self._transfer(moves, s.recorded)
            received += sum(s.files[n] for n in kept)
            for node, names in self._gather((self.node, sorted(kept))):
                want[node].difference_update(names)
        missing = sorted(f for fs in want.values() for f in fs)
        if hashed or received or self.given is None:
            log.info("%s: rank %d hashed %.1f MiB and received %.1f MiB for this node in %.2f s", self.label,
                     self.rep.peers.rank, hashed / 2**20, received / 2**20, time.perf_counter() - t0)
        if missing:
            log.warning("%s: %d file(s) have no good copy on any node (first: %s)", self.label, len(missing), missing[0])
        if self._places_known(s):
            now = {n: {f for f, z in x.sizes.items() if s.files.get(f) == z} for n, x in s.listings.items()}
            for n in per_node:
                now[n] = (now.get(n, set()) - first[n]) | (per_node[n] - want[n])
            self._record(s, now)
        return not missing

    def _places_known(self, s: Survey) -> bool:
        """Whether the save was made by this group's ranks with replicas (its places known)."""
        p = self.rep.peers
        return bool(p.replicas) and s.world == len(p.ranks)

    def _places(self, s: Survey) -> dict[str, set[str]]:
        """Each node's files by its place: with replicas, on the save's ranks, those of its own
        ranks and those it holds for the ranks whose replicas it keeps, so that a replaced node
        is given back its files and its copies of others', not the whole step."""
        out: dict[str, set[str]] = {n: set() for n in self.ranks}
        if not self._places_known(s):
            return out
        p = self.rep.peers
        member = {g: i for i, g in enumerate(p.ranks)}
        for rank, files in s.writers().items():
            if rank in member:
                i = member[rank]
                out[p.nodes.nodes[i]] |= files
                for k in range(1, p.replicas + 1):
                    out[p.nodes.nodes[p.nodes.peer(i, k)]] |= files
        return out

    def _record(self, s: Survey, now: dict[str, set[str]]) -> None:
        """A rank whose replica record of the save is gone (its node replaced) writes it anew
        from what the nodes hold after the repair: its files with their recorded digests, the
        peers whose nodes hold them all, the files it holds for the ranks it keeps copies of
        (in an earlier checkpoint's directory, of the files a later save references there).
        A file no record vouched for is recorded without a digest (never a source)."""
        p, save = self.rep.peers, str(self.save_id)
        name = replica_record_name(p.rank, save)
        try:
            if self.tier.exists(name):
                return
            of = s.writers()
            mine = of.get(p.rank, set())
            confirmed = [p.ranks[q] for k in range(1, p.replicas + 1)
                         if mine <= now.get(p.nodes.nodes[q := p.nodes.peer(p.me, k)], set())]
            held = {}
            for k in range(1, p.replicas + 1):
                src = p.ranks[p.nodes.sender(p.me, k)]
                held[src] = {f: s.entry(f) for f in sorted(of.get(src, set()) & now.get(self.node, set()))}
            rec = ReplicaRecord(p.rank, save, p.wanted, {f: s.entry(f) for f in sorted(mine)}, confirmed, held)
            self.tier.commit_bytes(name, rec.to_bytes())
        except (OSError, CheckpointError) as e:  # the copies stay; a later repair vouches for fewer
            log.warning("%s: rank %d's replica record could not be written again: %s", self.label, p.rank, e)

    def _transfer(self, moves: list[Move], digests: dict[str, str]) -> set[str]:
        """Send each of ``moves`` (every rank walks the same list in the same order); the names
        this rank received and kept."""
        me, kept = self.rep.peers.me, set()
        for mv in moves:
            if me not in (mv.src, mv.dst):
                continue
            peer = mv.dst if me == mv.src else mv.src
            if me == mv.src:
                _send_file(self.rep.group, self.tier, mv.name, mv.size, peer)
                continue
            ok = _recv_file(self.rep.group, self.tier, mv.name, mv.size, peer, digests[mv.name])
            if ok:
                kept.add(mv.name)
            log.log(logging.INFO if ok else logging.WARNING, "%s: %s %s from rank %d", self.label,
                    "restored" if ok else "could not restore", mv.name, self.rep.peers.ranks[mv.src])
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
