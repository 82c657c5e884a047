"""A load from a node's own directory (``DataStatesReader(node_local=True)``, and
``Checkpointer`` with replicas): the repair's two steps (``replicas/repair.py``) around
DCP's calls, and the stored files a rank's plan reads, which is what its node is given.

A chunk's record may be in a metadata part the node lacks, so the files are found from the
index alone: a record the manifest holds names its files; one in rank ``w``'s part (the index
says which rank, ``ChunkTable.writer_at``) stands for ``w``'s part and every data file ``w``
wrote in the save, the only files that part can name besides earlier checkpoints'.  A node is
given every file of each rank it reads from, never part of a rank's."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .. import process_state
from ..errors import ChecksumMismatch, DataFileError, ManifestError, first_line
from ..format.model import Chunk, Manifest, small_segs
from ..format.names import rank_file_of
from ..tiers.storage import StorageTier
from .repair import NodeRepair, Reads
from .replicator import shared_replicator

log = logging.getLogger(__name__)


# what a read of a damaged, cut or missing copy raises (``load/files.py``): a copy another
# node holds may serve it
DAMAGE = (ChecksumMismatch, DataFileError, ManifestError, OSError)


@dataclass(frozen=True)
class ReadsSeen:
    """What every rank's first pass of reads met (``NodeLocalLoad.again``)."""

    damaged: bool  # some rank met a damaged, cut or missing copy: every rank reads again
    served_elsewhere: bool  # some rank read from a slower tier what its node's copy could not serve


class NodeLocalLoad:
    """One load's repair of this node's directory, as the reader drives it: ``before_manifest``
    (the survey: a collective in ``read_metadata``), then ``before_reads`` (this node given
    what its ranks read that it lacks: a collective at the start of ``read_data``), the reads
    themselves through ``read``, and after them ``again`` (a collective: whether some rank met a
    damaged copy, or read from a slower tier; if so the survey once more, then the checked
    fetch, and the reads made again where a copy was damaged)."""

    def __init__(self, repair: NodeRepair) -> None:
        self.repair = repair
        self._needs: Reads | None = None  # what this rank's reads need (``before_reads``)

    @classmethod
    def of(cls, tier: StorageTier, process_group=None, node: str | None = None,
           save_id: str | None = None) -> "NodeLocalLoad":
        """The load of ``tier``, this node's directory, repaired over the replica group of
        ``process_group``'s ranks (made here if this process has none: a collective)."""
        if not process_state.group_up():
            raise ValueError("node_local=True gathers copies over torch.distributed: call "
                             "dist.init_process_group first")
        return cls(NodeRepair(shared_replicator(None, process_group, node), tier, tier.url, save_id,
                              pg=process_group))

    def before_manifest(self) -> None:
        if not self.repair.survey():
            log.warning("%s: some files are on no node; the load reads them from the fallback tiers or "
                        "fails naming them", self.repair.tier.url)

    def before_reads(self, m: Manifest, items: Iterable[ReadItem], verify: bool = False) -> None:
        """A rank whose plan names what the manifest lacks asks for nothing and fails when it
        reads, naming the record; it still takes part.  ``verify``: what the node holds is
        hashed and checked against its recorded digests first (``NodeRepair.fetch``)."""
        try:
            self._needs = files_read(m, items)
        except Exception as e:  # noqa: BLE001 - logged; the collective must not be skipped
            log.warning("%s: the files this rank reads could not be told before the load (%s)",
                        self.repair.tier.url, e)
            self._needs = None
        self.repair.fetch(self._needs, verify)

    def borrowed(self) -> dict[str, StorageTier]:
        """The files this rank's reads take from the ranges it was sent (``before_reads``),
        with the directory that holds them."""
        tier = self.repair.borrowed_tier
        return {name: tier for name in self.repair.borrowed}

    def read(self, read: Callable[[bool], bool], verify: bool) -> None:
        """This rank's reads (``read``, one pass; its argument: whether ``before_reads`` checks
        the node's copies whole first; it returns whether a slower tier served some of them),
        made once; and again, on every rank, where some rank's pass met a damaged, cut or
        missing copy (``again``), with the copies checked (``verify``: the load's own setting)
        and the bad ones replaced from other nodes.  Where a slower tier served what a node's
        copy could not, the load stands and the copies are checked and replaced all the same,
        so that the next restore reads them from the nodes again."""
        failed: BaseException | None = None
        elsewhere = False
        try:
            elsewhere = read(False)
        except Exception as e:  # noqa: BLE001 - raised below unless read again: every rank must vote
            failed = e
        seen = self.again(failed, elsewhere)
        if seen.damaged:
            read(verify)
            return
        if seen.served_elsewhere:  # on every rank, before any raises: a collective
            self.repair.fetch(self._needs, True)
        if failed is not None:
            raise failed

    def again(self, failed: BaseException | None, elsewhere: bool) -> "ReadsSeen":
        """After this rank's reads (``failed``: what they raised, None where they did not;
        ``elsewhere``: whether a slower tier served some), on every rank of the load's group:
        whether some rank's reads met a damaged, cut or missing copy, and whether some rank
        read from a slower tier.  If either, the survey runs again (what the nodes hold may
        have changed since the first)."""
        votes = process_state.gather((isinstance(failed, DAMAGE), elsewhere), self.repair.pg)
        damaged = [r for r, v in enumerate(votes) if v[0]]
        served = [r for r, v in enumerate(votes) if v[1]]
        if not damaged and not served:
            return ReadsSeen(False, False)
        here = f" (here: {first_line(failed, 300)})" if failed is not None else ""
        if damaged:
            log.warning("%s: rank(s) %s read a damaged or missing copy%s; every node checks what its ranks read "
                        "against the recorded digests, takes good copies from the others, and the load reads "
                        "again", self.repair.label, damaged, here)
        else:
            log.warning("%s: rank(s) %s read from a slower tier what their node's copy could not serve; every "
                        "node checks what its ranks read against the recorded digests and takes good copies "
                        "from the others", self.repair.label, served)
        self.repair.forget()
        self.before_manifest()
        return ReadsSeen(bool(damaged), bool(served))


def chunk_files(chunk: Chunk) -> set[str]:
    """The files a record's bytes are in (its extent, or its provider parts')."""
    out = set(chunk.extent.files()) if chunk.extent is not None else set()
    for _path, _size, ext in chunk.parts.values():
        out.update(ext.files())
    return out


def files_read(m: Manifest, items: Iterable[ReadItem]) -> Reads:
    """What loading ``items`` reads of ``m``'s files.  Whole files, by whole ranks: every file
    of each rank whose part holds a record the plan reads (a node holds all the files of a rank
    or none, as replication leaves them and as ``verify --node-local`` expects), with those of
    an earlier checkpoint an incremental save took from it (its ``homes``) under the name of
    the rank that wrote them there.  A small record the index holds itself (``small_segs``: a
    plain tensor of one rank's writing that every rank reads, an optimizer's step counter) is
    read as the byte ranges of its segments.  A record this rank cannot find adds nothing (the
    read raises, naming it)."""
    named: set[str] = set()  # files records name directly
    ranges: dict[str, set[tuple[int, int]]] = defaultdict(set)
    writers: set[int] = set()
    for ri in items:
        fqn = ri.storage_index.fqn
        if ri.type == LoadItemType.BYTE_IO:
            v = m.values.get(fqn)
            if v is not None and v.node is not None:  # a registered type: its parts' files
                named |= chunk_files(v.node)
            continue
        entry = m.tensors.get(fqn)
        if entry is None:
            continue
        key = tuple(ri.storage_index.offset) if ri.storage_index.offset is not None else ()
        w = entry.writer_at(ri.storage_index.index, key)
        if w is not None:
            writers.add(w)
        elif (chunk := entry.record_at(ri.storage_index.index, key)) is not None:
            segs = small_segs(m, entry, chunk)
            if segs is not None:
                for s in segs:
                    ranges[s.file].add((s.offset, s.nbytes))
            else:
                named |= chunk_files(chunk)
    by_rank: dict[int, set[str]] = defaultdict(set)
    for name in m.files:
        if (got := rank_file_of(name)) is not None:
            by_rank[got[0]].add(name)
    writers |= {got[0] for name in named if (got := rank_file_of(name)) is not None}
    whole = {n for n in named if n in m.files}
    for w in writers:
        whole |= by_rank.get(w, set())
    return Reads(frozenset(whole), {n: tuple(sorted(rs)) for n, rs in ranges.items() if n in m.files and n not in whole})
