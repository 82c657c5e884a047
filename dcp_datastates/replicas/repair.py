"""Before a restore from node-local copies: each node's directory of the step given what its
ranks read, from copies on other nodes whose bytes match the digests recorded when they were
replicated (``replicas/for_run.py``).  Collectives over the replicator's group, in two steps:

1. ``NodeRepair.survey`` (before the manifest is read): the ranks of each node list what it
   holds of the save (names, sizes and recorded digests, each rank a share of the directory;
   no file read but the manifest); a node without the manifest receives it, and every rank
   reads the file list from its own node's copy (sent only where a node has none); the answer
   is whether every file the manifest lists is held, at its size, on some node.
2. ``NodeRepair.fetch`` (once each rank knows its load plan, ``replicas/for_load.py``): each node
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
from ..format.model import Span, small_ranges
from ..format.names import (
    MANIFEST_NAME,
    borrowed_dir_name,
    data_file_save_id,
    rank_file_of,
    replica_record_name,
    replica_record_of,
)
from ..tiers.borrowed import clear_borrowed
from ..tiers.manifests import checkpoint_name, load_manifest, manifest_head, one_checkpoint
from ..tiers.storage import StorageTier
from .moves import Lent, Move, Wire
from .records import ReplicaRecord, read_record
from .replicator import Replicator
from .transfer import PIECE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listing:
    """What one node holds of a save: each step file's size, the digests its replica records
    give (its own files' and those it holds for others), its manifest's digest and the save
    that manifest commits (which may be another attempt's), and the replicas the save wanted
    (its records'; 0 where none is here)."""

    sizes: dict[str, int]
    recorded: dict[str, str]
    manifest: str | None
    wanted: int = 0
    manifest_save: str | None = None


_NOTHING = Listing({}, {}, None)


@dataclass(frozen=True)
class Reads:
    """What one rank's load reads of a save's files: ``whole`` files, and byte ``ranges``
    (file -> sorted (offset, length) pairs) of files it reads only small records of (a plain
    tensor every rank held, which DCP's dedup had one rank write).  A node that lacks such a
    file, and holds no place for it, is sent those ranges for that rank, not the file: at scale
    every node would otherwise receive the whole files of the many ranks that wrote one such
    tensor each."""

    whole: frozenset[str]
    ranges: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class FileList:
    """What a save's manifest lists: its own files (name -> size), the ranks that saved it, the
    files it reads from earlier checkpoints of the run (an incremental save), by the directory
    and save that hold them: (directory, save id) -> {name: size}, and the byte ranges of its
    small records a node that lacks their files is sent alone (``format.model.small_ranges``)."""

    files: dict[str, int]
    world: int  # of an earlier directory's list (``NodeRepair.given``): the referencing save's
    referenced: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    small: tuple[Span, ...] = ()


@dataclass
class Survey:
    """What every rank knows after ``NodeRepair.survey``: each node's listing, the files the
    save's manifest lists (name -> size, earlier checkpoints' left out) and the recorded
    digests of all nodes."""

    listings: dict[str, Listing]
    files: dict[str, int]
    world: int  # the ranks that saved it
    recorded: dict[str, str] = field(default_factory=dict)
    small: tuple[Span, ...] = ()  # ``FileList.small``
    # file -> the nodes holding it at its size, sorted: made once from the listings, which the
    # repair never changes (asking each node per file cost files x nodes: seconds at 16k ranks)
    _holding: dict[str, list[str]] | None = field(default=None, init=False, repr=False)

    def wanted(self) -> int:
        """The replicas the save wanted, by the replica records any node holds (0: none)."""
        return max((x.wanted for x in self.listings.values()), default=0)

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
    wanted = 0
    for name in names[share::shares]:
        rec_of = replica_record_of(name)
        if rec_of is not None:
            rec = read_record(tier, rec_of[0], save_id) if rec_of[1] == save_id else None
            for f, v in _digests_in(rec):
                recorded[f] = v
            wanted = max(wanted, rec.replicas if rec is not None else 0)
        elif name == MANIFEST_NAME or data_file_save_id(name) == save_id:
            try:
                sizes[name] = tier.size(name)
            except OSError:
                continue
    manifest = _digest(tier, MANIFEST_NAME) if share == 0 and MANIFEST_NAME in names else None
    head = manifest_head(tier) if manifest is not None else None
    return Listing(sizes, recorded, manifest, wanted, None if head is None else head.save_id)


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
    manifest, wanted, save = None, 0, None
    for x in parts:
        sizes.update(x.sizes)
        recorded.update(x.recorded)
        manifest, save = (manifest, save) if manifest is not None else (x.manifest, x.manifest_save)
        wanted = max(wanted, x.wanted)
    return Listing(sizes, recorded, manifest, wanted, save)


class DecidedSave:
    """The save a node-local load decided on (``save_id``: the newest any node holds, or the
    one named), made the one every node holds: every rank names the same checkpoint
    (``agree``), every rank gets the file list the save's manifest gives (``file_list``), and
    only once every file of it is known to be on some node does its manifest go to each node
    that lacks it or holds another attempt's (``place``): a save that cannot be read whole
    replaces no manifest anywhere, so the restore may try an older one.  What the load reads is
    decided here, once, before any file moves; ``NodeRepair`` then moves files for that save
    alone."""

    def __init__(self, repair: "NodeRepair") -> None:
        self.rep, self.tier, self.label = repair.rep, repair.tier, repair.label
        self.ranks, self.node, self.wire = repair.ranks, repair.node, repair.wire
        self.save_id = repair.save_id

    def one_directory_a_node(self, dirs: list[tuple[str, str]]) -> None:
        """Raise, on every rank alike, where ranks that take themselves for one node's read
        different directories (a reader not given the ``node=`` the writer was)."""
        seen: dict[str, set[str]] = defaultdict(set)
        for node, url in dirs:
            seen[node].add(url)
        for node, urls in sorted(seen.items()):
            if len(urls) > 1:
                raise CheckpointError(
                    f"ranks of node {node!r} read different directories ({', '.join(sorted(urls)[:2])}); "
                    "pass DataStatesReader(node=...) (or Checkpointer(node=...)) as the save did", checkpoint=self.label)

    def agree(self, named: list) -> None:
        """Raise, on every rank alike, unless every rank names one checkpoint (and save)."""
        one_checkpoint([(r, name, save) for r, (name, save) in enumerate(named)], self.label)

    def file_list(self, listings: dict[str, Listing]) -> FileList | None:
        """The file list of the save decided on, the same on every rank (a collective): each rank
        reads its own node's manifest where it is that save's, the others are sent it once
        (None: no node holds a manifest of that save)."""
        want = self._wanted(listings)
        if want is None:
            return None
        here = listings.get(self.node, _NOTHING)
        return self._agree(self._file_list() if here.manifest == want else None)

    def _wanted(self, listings: dict[str, Listing]) -> str | None:
        """The digest of the decided save's manifest (the same bytes on every node that
        committed it); None where no node holds it."""
        ofsave = sorted({x.manifest for x in listings.values()
                         if x.manifest is not None and x.manifest_save == self.save_id})
        return ofsave[0] if ofsave else None

    def place(self, listings: dict[str, Listing], files: dict[str, int]) -> bool:
        """The decided save's manifest sent to every node that lacks it or holds one of another
        attempt of the step (a collective; called once every file of the save is on some node).
        A node's manifest of another save is replaced only so, by the load's decision, and only
        once every file of the decided save is known good on some node (``_verified``): the save
        every rank reads is then the one every node holds, and the other attempt's files stay for
        the next save there, or retention, to remove.  False where the decided save is not good
        (nothing replaced: the restore tries an older save, which may be the one kept)."""
        want = self._wanted(listings)
        if want is None:
            return True
        holders = sorted(n for n, x in listings.items() if x.manifest == want)
        moves = [Move(MANIFEST_NAME, self.ranks[holders[i % len(holders)]][0], self.ranks[n][0],
                      listings[holders[0]].sizes[MANIFEST_NAME])
                 for i, n in enumerate(sorted(self.ranks)) if listings.get(n, _NOTHING).manifest != want]
        if moves:  # the same list on every rank (from the gathered listings): all skip, or none
            replaced = sorted(n for n in self.ranks if listings.get(n, _NOTHING).manifest is not None
                              and listings[n].manifest != want)
            if replaced and not self._verified(listings, files):
                log.warning("%s: a file of save %s matches its recorded digest on no node; node(s) %s keep "
                            "their manifest of another attempt, and the restore tries an older save",
                            self.label, self.save_id, replaced)
                return False
            if replaced:
                log.warning("%s: node(s) %s hold a manifest of another attempt of this step; the load "
                            "reads save %s, whose manifest replaces it there", self.label, replaced, self.save_id)
            assert self.save_id is not None  # want is a manifest of it
            self.wire.manifest(moves, want, self.save_id)
            self.rep.group.barrier()  # every manifest received is committed before it is read
        return True

    def _verified(self, listings: dict[str, Listing], files: dict[str, int]) -> bool:
        """Whether every file of the save that a replica record vouches for has a copy on some
        node whose bytes match that digest (one no record vouches for counts as good: the load
        checks each block it reads).  Each node hashes the copies it holds, its ranks sharing
        them (a collective).  Asked only before a committed manifest of another save is
        replaced: that save may be the one the restore falls back to."""
        recorded = {f: d for x in listings.values() for f, d in x.recorded.items()}
        mates = self.ranks[self.node]
        here = listings.get(self.node, _NOTHING)
        mine = [f for f in sorted(files) if f in recorded and here.sizes.get(f) == files[f]]
        good = [f for f in mine[mates.index(self.rep.peers.me)::len(mates)] if _digest(self.tier, f) == recorded[f]]
        known_good = {f for got in self.rep.group.all_gather_object(good) for f in got}
        return all(f in known_good for f in files if f in recorded)

    def _file_list(self) -> FileList | None:
        """What this node's copy of the manifest lists; None where it cannot be read."""
        try:
            m = load_manifest(self.tier)
        except (CheckpointError, OSError) as e:  # this node's ranks read elsewhere or fail
            log.warning("%s: no readable manifest on this node after the repair: %s", self.label, e)
            return None
        if self.save_id is not None and m.save_id != self.save_id:
            log.warning("%s: this node's manifest is of save %s, not of save %s the load reads",
                        self.label, m.save_id, self.save_id)
            return None
        referenced: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
        for name, home in m.homes.items():
            save_id = data_file_save_id(name)
            if save_id is not None and name in m.files:
                referenced[(home, save_id)][name] = m.files[name]
        return FileList({n: s for n, s in m.files.items() if n not in m.homes}, m.world_size, dict(referenced),
                        small_ranges(m))

    def _agree(self, got: FileList | None) -> FileList | None:
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


class NodeRepair:
    """The repair of this node's directory ``tier`` of one save before a load (``label`` in the
    log; ``save_id`` None: the newest save any node holds).  Every rank of the replicator's
    group calls ``survey`` and then ``fetch``, in that order.

    An incremental save reads some files from earlier checkpoints of the run (its manifest's
    ``homes``): each such directory is repaired alongside (``_earlier``), limited to the files
    the save references there (``given``), so a node lost since is given those too."""

    def __init__(self, rep: Replicator, tier: StorageTier, label: str, save_id: str | None,
                 given: FileList | None = None, pg=None, votes: list | None = None) -> None:
        self.rep, self.tier, self.label, self.save_id = rep, tier, label, save_id
        self.pg = pg  # the load's process group (None: the default one)
        # every rank's ``Replicator.restore_vote``, where the restore gathered them already (the first
        # survey then settles the epoch from them, without an all-gather of its own)
        self._votes = votes
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
        self.borrowed: set[str] = set()  # the files this rank was sent ranges of (``fetch``)
        self.wire = Wire(rep.group, rep.peers.me, rep.peers.ranks, tier, label)  # the transfers (also DecidedSave's)

    @property
    def borrowed_tier(self) -> StorageTier:
        """Where this rank keeps the ranges it was sent: a subdirectory of its node's step
        directory, each file there holding only those ranges (read by this rank's load alone,
        never listed as a copy)."""
        return self.tier.child(borrowed_dir_name(self.rep.peers.rank))

    def forget(self) -> None:
        """Survey anew at the next ``survey`` (what the nodes hold has changed since)."""
        self._survey, self._complete, self._earlier = None, None, []

    def _gather(self, obj) -> list:
        return self.rep.group.all_gather_object(obj)

    def survey(self) -> bool:
        """Step 1 (once; a collective): the manifest where a node lacks it; whether every file
        it lists is held at its size on some node (False: the caller reads a slower tier or an
        older step).  On the replicator's thread, after its replications under way
        (``GroupOrder.in_turn``), like ``fetch``; over a group made again first where one
        broke (``Replicator.agree_epoch``, a collective over the load's group, or ``settle`` of
        the votes given)."""
        if self._complete is not None:
            return self._complete
        votes, self._votes = self._votes, None  # a second survey votes again
        epoch = None if self.given is not None else (
            self.rep.settle(votes) if votes is not None else self.rep.agree_epoch(self.pg, self.label))
        return self.rep.order.in_turn(self._surveyed, self.label, epoch)

    def _surveyed(self) -> bool:
        self._complete = False
        # what the load reads, the same on every rank, decided by the first gather, before
        # anything moves: the checkpoint every rank names (and the save, where one is named)
        named = None if self.given is not None else (checkpoint_name(self.tier.url), self.save_id)
        if self.given is None and self.save_id is None:
            asked = self._gather((named, manifest_head(self.tier) if self.leader else None))
            DecidedSave(self).agree([n for n, _ in asked])
            heads = [h for _, h in asked if h is not None]
            if not heads:
                return False
            self.save_id = max(heads, key=lambda h: (h.created_unix, h.save_id)).save_id
            named = None  # agreed
        mates = self.ranks[self.node]
        mine = _listing(self.tier, str(self.save_id), mates.index(self.rep.peers.me), len(mates))
        shares: dict[str, list[Listing]] = defaultdict(list)
        listed = self._gather((self.node, mine, named, self.tier.url))
        decided = DecidedSave(self)
        if named is not None:
            decided.agree([n for _, _, n, _ in listed])
        decided.one_directory_a_node([(node, url) for node, _, _, url in listed])
        for node, part, _, _ in listed:
            shares[node].append(part)
        listings = {n: _merged(parts) for n, parts in shares.items()}
        files = self.given if self.given is not None else decided.file_list(listings)
        if files is None:
            return False
        recorded = {f: d for x in listings.values() for f, d in x.recorded.items()}
        self._survey = Survey(listings, files.files, files.world, recorded, files.small)
        lost = sorted(n for n in files.files if not self._survey.holders(n))
        if lost:
            log.warning("%s: %d file(s) on no node (first: %s); reading them from a slower tier if one "
                        "holds the step", self.label, len(lost), lost[0])
        elif self.given is None and not decided.place(listings, files.files):  # whole: each node given its manifest
            return False  # the same on every rank: the restore tries an older save
        # the files it reads from earlier checkpoints, each directory surveyed in turn: every
        # rank walks the same ones in the same order (the file list is the same on all)
        self._earlier = [] if self.given is not None else [
            NodeRepair(self.rep, self.tier.sibling(home), f"{self.label} (its files in {home})", save_id,
                       FileList(names, files.world))
            for (home, save_id), names in sorted(files.referenced.items())]
        earlier_ok = [e.survey() for e in self._earlier]  # each a collective: none skipped
        self._complete = not lost and all(earlier_ok)
        return self._complete

    def fetch(self, needs: Reads | None, verify: bool = False) -> bool:
        """Step 2 (a collective): this node given the files its ranks read (``needs``: this
        rank's; None: it reads nothing from this node, or could not tell) and, with replicas,
        its place among them (``_places``); this rank sent the ranges it reads of files its node
        lacks and holds no place for (``borrowed``).  A file it holds at its size is kept unread
        (the load checks each block it reads); with ``verify``, what its ranks read is hashed
        first and checked against its recorded digest, and received again where it does not
        match, and a file read by ranges is fetched whole (a checked copy).
        Whatever it receives is checked on arrival.  The ranks of a node share the hashing and
        the transfers (the ``i``-th file or move of a node to its ``i``-th rank, modulo their
        number).  Returns whether every node holds every file it was to hold; False at once
        where the survey found no manifest on any node (every rank knows it alike: the load
        then reads a slower tier)."""
        return self.rep.order.in_turn(lambda: self._fetched(needs, verify), self.label)

    def _fetched(self, needs: Reads | None, verify: bool) -> bool:
        s = self._survey
        self.borrowed = set()
        if self.given is None:  # what an earlier load was sent (another save's, or this one's again)
            clear_borrowed(self.borrowed_tier)
        if s is None:
            return False
        ok = self._fetch(s, needs, verify)
        for e in self._earlier:  # the same on every rank (``survey``)
            ok = e.fetch(needs, verify) and ok
        return ok

    def _fetch(self, s: Survey, needs: Reads | None, verify: bool) -> bool:
        t0, hashed, received = time.perf_counter(), 0, 0
        reads: dict[str, set[str]] = {n: set() for n in self.ranks}
        places = self._places(s)
        mine, ranges = self._wanted(s, needs, verify, places[self.node])
        for pos, got in enumerate(self._gather(mine)):
            if got:
                reads[self.rep.peers.nodes.nodes[pos]].update(n for n in got if n in s.files)
        per_node = {n: reads[n] | places[n] for n in self.ranks}
        # what each node lacks at its size, the same on every rank (from what all were given)
        want = {n: {f for f in fs if s.listings.get(n, _NOTHING).sizes.get(f) != s.files[f]}
                for n, fs in per_node.items()}
        if verify:  # and what its ranks read that does not match its digest: each rank a share
            mates, bad = self.ranks[self.node], []
            for name in sorted(reads[self.node] - want[self.node])[mates.index(self.rep.peers.me)::len(mates)]:
                if name in s.recorded:
                    hashed += s.files[name]
                    if _digest(self.tier, name) != s.recorded[name]:
                        log.warning("%s: this node's copy of %s does not match its recorded digest", self.label, name)
                        bad.append(name)
            for node, names in self._gather((self.node, bad)):
                want[node].update(names)
        first = {n: set(fs) for n, fs in want.items()}  # a node's own copy is no source when bad
        tried: dict[tuple[str, str], set[str]] = {}
        while True:
            moves = []
            for node in sorted(want):
                for name in sorted(want[node]):
                    seen = tried.setdefault((node, name), set())
                    src = [h for h in s.holders(name) if name not in first[h] and h not in seen]
                    if not src:  # a file no record vouches for travels too: each block is checked on reading
                        continue
                    i = len(moves)
                    pick = src[i % len(src)]
                    seen.add(pick)
                    moves.append(Move(name, self.ranks[pick][i % len(self.ranks[pick])],
                                      self.ranks[node][i % len(self.ranks[node])], s.files[name]))
            if not moves:
                break
            kept = self.wire.files(moves, s.recorded)
            received += sum(s.files[n] for n in kept)
            for node, names in self._gather((self.node, sorted(kept))):
                want[node].difference_update(names)
        missing = sorted(f for fs in want.values() for f in fs)
        lent = self._lend(s, {f: r for f, r in ranges.items() if f not in per_node[self.node]})
        if hashed or received or lent or self.given is None:
            log.info("%s: rank %d hashed %.1f MiB and received %.1f MiB for this node, and %.1f KiB of "
                     "%d file(s) it reads a little of, in %.2f s", self.label, self.rep.peers.rank, hashed / 2**20,
                     received / 2**20, lent / 2**10, len(self.borrowed), time.perf_counter() - t0)
        if missing:
            log.warning("%s: %d file(s) have no good copy on any node (first: %s)", self.label, len(missing), missing[0])
        if self._places_known(s):
            now = {n: {f for f, z in x.sizes.items() if s.files.get(f) == z} for n, x in s.listings.items()}
            for n in per_node:
                now[n] = (now.get(n, set()) - first[n]) | (per_node[n] - want[n])
            self._record(s, now)
        return not missing

    def _wanted(self, s: Survey, needs: Reads | None, verify: bool,
                place: set[str]) -> tuple[list[str] | None, dict[str, tuple[tuple[int, int], ...]]]:
        """This rank's files to ask for whole (None: it could not tell), and the ranges it
        asks for alone: of files its node lacks at their size and holds no place for.  With
        ``verify`` every file is asked for whole (its copy checked against its digest)."""
        if needs is None:
            return None, {}
        whole = set(needs.whole)
        held = s.listings.get(self.node, _NOTHING).sizes
        ranges: dict[str, tuple[tuple[int, int], ...]] = {}
        for name, rs in needs.ranges.items():
            if name not in s.files or name in whole:
                continue
            if verify:  # hashed where the node holds it, received whole where it does not match
                whole.add(name)
            elif name not in place and held.get(name) != s.files[name]:
                ranges[name] = rs
        return sorted(n for n in whole if n in s.files), ranges

    def _lend(self, s: Survey, ranges: dict[str, tuple[tuple[int, int], ...]]) -> int:
        """The small records some rank reads of files its node lacks (this rank's: ``ranges``)
        to every rank, in collectives whose size follows those bytes, never the ranks times the
        files they come from (a collective: every rank asks, in one max-reduction over the
        save's ``small`` ranges, for those it lacks; each range asked for then comes from a
        node that holds its file, spread over the holders and their ranks); this rank keeps
        its own ranges in its borrowed directory.  The bytes this rank stored."""
        if not s.small:
            return 0
        at = {r: i for i, r in enumerate(s.small)}
        asked = torch.zeros(len(s.small), dtype=torch.uint8)
        unlisted = {f for f, rs in ranges.items() if any(Span(f, o, n) not in at for o, n in rs)}
        if unlisted:  # its load then reads them from a slower tier or fails, naming them
            log.warning("%s: rank %d reads byte ranges of %s that the manifest's small records do not "
                        "list; not asked for", self.label, self.rep.peers.rank, min(unlisted))
        wanted = {f: rs for f, rs in ranges.items() if f not in unlisted}
        for f, rs in wanted.items():
            for o, n in rs:
                asked[at[Span(f, o, n)]] = 1
        self.rep.group.all_reduce_max(asked)
        pieces: list[Lent] = []
        source: dict[str, int | None] = {}  # file -> the member that reads it (None: on no node)
        for i in asked.nonzero().flatten().tolist():
            span = s.small[i]
            if span.file not in source:
                k, holders = len(source), s.holders(span.file)
                mates = self.ranks[holders[k % len(holders)]] if holders else []
                source[span.file] = mates[k % len(mates)] if mates else None
            src = source[span.file]
            if src is not None:  # on no node: the load reads it from a slower tier or fails naming it
                pieces.append(Lent(span, src))
        kept, got = self.wire.lend(pieces, wanted, self.borrowed_tier)
        self.borrowed |= kept
        return got

    def _places_known(self, s: Survey) -> bool:
        """Whether the save was made by this group's ranks with replicas (its places known)."""
        return self._copies(s)[0] > 0

    def _copies(self, s: Survey) -> tuple[int, int]:
        """The replicas whose places this repair gives back, and the copies a record of it
        wants: on the save's world, this job's replicas, or where it keeps none (a plain
        reader is not told them) those the save's own records want, as far as this job's
        nodes can hold them; (0, 0) on another world or on nodes of unequal rank counts."""
        p = self.rep.peers
        if s.world != len(p.ranks):
            return 0, 0
        if p.replicas:
            return p.replicas, p.wanted
        names, ranks = p.nodes.layout()
        if len({len(v) for v in ranks.values()}) != 1:
            return 0, 0
        wanted = s.wanted()
        return min(wanted, len(names) - 1), wanted

    def _places(self, s: Survey) -> dict[str, set[str]]:
        """Each node's files by its place: on the save's ranks, those of its own ranks, and with
        replicas those it holds for the ranks whose replicas it keeps, so that a replaced node
        is given back its files and its copies of others', not the whole step."""
        out: dict[str, set[str]] = {n: set() for n in self.ranks}
        p = self.rep.peers
        if s.world != len(p.ranks):
            return out
        copies = self._copies(s)[0]
        member = {g: i for i, g in enumerate(p.ranks)}
        for rank, files in s.writers().items():
            if rank in member:
                i = member[rank]
                out[p.nodes.nodes[i]] |= files
                for k in range(1, copies + 1):
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
            copies, wanted = self._copies(s)
            confirmed = [p.ranks[q] for k in range(1, copies + 1)
                         if mine <= now.get(p.nodes.nodes[q := p.nodes.peer(p.me, k)], set())]
            held = {}
            for k in range(1, copies + 1):
                src = p.ranks[p.nodes.sender(p.me, k)]
                held[src] = {f: s.entry(f) for f in sorted(of.get(src, set()) & now.get(self.node, set()))}
            rec = ReplicaRecord(p.rank, save, wanted, {f: s.entry(f) for f in sorted(mine)}, confirmed, held)
            self.tier.commit_bytes(name, rec.to_bytes())
        except (OSError, CheckpointError) as e:  # the copies stay; a later repair vouches for fewer
            log.warning("%s: rank %d's replica record could not be written again: %s", self.label, p.rank, e)
