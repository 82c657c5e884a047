"""Typed records from a rank's ``write_data`` to the coordinator's ``finish``.

Each ``WriteResult.storage_data`` is an :class:`ItemRecord` (DCP gathers them to the
coordinator with pickle; they hold only plain data and format records).  The first record of
each rank also carries its :class:`RankRecord`.  ``build.py`` turns them into the manifest
directly, with no encoding on the way.  In a version 4 save each rank sends one
:class:`PartRecord` instead, whose common part is packed int64 rows: the coordinator reads all
ranks' at once (:class:`Gathered`), not object by object (at 16,384 ranks, touching a dozen
objects per rank was most of its commit).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain
from operator import attrgetter

import numpy as np

from .columns import runs, starts
from .limits import INT64, FormatViolation
from .model import Extent, ValueEntry
from .names import part_file_name
from .v4.chunk_lists import HeldColumns, HeldRecord
from .v4.rank_files import PartRef, RankFileColumns


@dataclass(slots=True)
class RankRecord:
    """One rank's part of the save: the data files it wrote (and those it references in
    earlier checkpoints of the run, with their home directories), and its stage timings."""
    rank: int
    files: dict[str, int]
    homes: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class ItemRecord:
    """What one DCP ``WriteItem`` became.

    ``kind``: ``"tensor"`` (one extent), ``"provider"`` (a registered type stored as a tensor
    chunk: ``parts`` by path, ``tree`` of nested providers), ``"value"`` (``value`` inline) or
    ``"provider-value"`` (a registered type stored as a value: ``parts`` and ``tree``)."""
    kind: str
    dtype: str = ""
    sizes: tuple[int, ...] = ()
    extent: Extent | None = None
    provider: str | None = None
    meta: object = None
    parts: dict[str, tuple[str, tuple[int, ...], Extent]] = field(default_factory=dict)
    tree: dict | None = None
    value: ValueEntry | None = None
    rank: RankRecord | None = None


@dataclass(slots=True)
class RareRecord:
    """What few ranks of a version 4 save send beside their packed rows: files of other saves
    they refer to (by name, with their home directories), the chunks of their tensors without a
    sharding rule (key, offsets, sizes, and the extent of a small plain chunk, which the index
    holds itself; the others it lists with this rank as owner), their values, bytes in shared
    homes, and the records of replicated boxes whose segments lie in files not their own."""
    files: dict[str, int] = field(default_factory=dict)
    homes: dict[str, str] = field(default_factory=dict)
    listed: list[tuple[str, tuple[int, ...], tuple[int, ...], Extent | None]] = field(default_factory=list)
    values: dict[str, ValueEntry] = field(default_factory=dict)
    shared: dict[str, int] = field(default_factory=dict)  # bytes in files of other homes, by home
    held: tuple[HeldRecord, ...] = ()


# A rank's packed rows, little-endian int64: a header, then ``own`` (stripe, size) pairs, then
# ``held`` (chunk, tail_at, nsegs) triples, then their segments as (own file, offset, nbytes),
# the own file as its place among the rank's own files.
_RANK, _SAVE, _PART_SIZE, _PART_HEAD, _OWNED, _N_OWN, _N_HELD, _N_SEGS = range(8)
_HEADER = 8


@dataclass(slots=True)
class PartRecord:
    """A rank's whole result in a version 4 save (one ``WriteResult``).  What the coordinator
    needs of every rank travels as one bytes object (``rows``: its metadata part, its own data
    files, the records of the replicated boxes it wrote in those files), with the keys of those
    boxes beside it: at 16,384 ranks the coordinator reads them all at once, not rank by rank.
    The rest, which most ranks do not have, is in ``rare``.  (The rank, as the meshes number
    it, is the first of its rows.)"""
    rows: bytes
    held_keys: tuple[str, ...] = ()
    rare: RareRecord | None = None

    @classmethod
    def of(cls, rank: int, save_id: str, part: PartRef, owned: int, own: list[tuple[int, int, str]],
           held: list[HeldRecord], rare: RareRecord) -> "PartRecord":
        """``own``: the rank's own data files as (stripe, size, name); ``owned``: their bytes;
        ``held``: its replicated boxes' records, packed where every segment lies in an own file."""
        place = {name: j for j, (_, _, name) in enumerate(own)}
        packed, by_name = [], []
        for h in held:
            (packed if all(f in place for f in h.files) else by_name).append(h)
        rare = replace(rare, held=tuple(by_name))
        head = [rank, int(save_id, 16), part.size, part.head, owned, len(own), len(packed),
                sum(len(h.files) for h in packed)]
        segs = [(place[f], o, n) for h in packed for f, o, n in zip(h.files, h.offsets, h.nbytes)]
        rows = np.array(head + [x for s, z, _ in own for x in (s, z)]
                        + [x for h in packed for x in (h.chunk, h.tail_at, len(h.files))]
                        + [x for g in segs for x in g], dtype=INT64)
        quiet = not (rare.files or rare.homes or rare.listed or rare.values or rare.shared or rare.held)
        return cls(rows.tobytes(), tuple(h.key for h in packed), None if quiet else rare)


@dataclass(slots=True)
class Gathered:
    """Every rank's packed rows, read at once: the ranks in gathered order, the columns of their
    own files and parts, the bytes in own files, where each rank's own files start among the
    rows, and the held records' columns (``held_rows``: tensor keys not yet numbered; files as
    rows of ``files``)."""
    ranks: np.ndarray
    files: RankFileColumns
    owned: int
    own_start: np.ndarray
    own_count: np.ndarray
    held_keys: list[str]
    held_rows: tuple[np.ndarray, ...]  # chunk, tail_at, nsegs, own row, offset, nbytes

    @classmethod
    def of(cls, records: list[PartRecord], save_id: str) -> "Gathered":
        """Raises ``FormatViolation`` where a record's rows do not add up or name another save."""
        blobs = list(map(attrgetter("rows"), records))
        n = len(blobs)
        words = np.fromiter(map(len, blobs), dtype=INT64, count=n) // 8
        a = np.frombuffer(b"".join(blobs), dtype=INT64)
        start = starts(words)
        if n and int(words.min()) < _HEADER:
            raise FormatViolation("a rank's part record is shorter than its header")
        head = a[start[:, None] + np.arange(_HEADER)] if n else np.zeros((0, _HEADER), INT64)
        n_own, n_held, n_segs = head[:, _N_OWN], head[:, _N_HELD], head[:, _N_SEGS]
        if n and (int(min(n_own.min(), n_held.min(), n_segs.min())) < 0
                  or bool((words != _HEADER + 2 * n_own + 3 * n_held + 3 * n_segs).any())):
            raise FormatViolation("a rank's part record does not add up")
        other = np.nonzero(head[:, _SAVE] != int(save_id, 16))[0]
        if len(other):
            r = int(head[other[0], _RANK])
            raise FormatViolation(f"rank {r} wrote metadata part {part_file_name(r, f'{int(head[other[0], _SAVE]):012x}')!r}, "
                       "not this save's")
        rank = head[:, _RANK]
        own = _rows(a, start + _HEADER, n_own, 2)
        held = _rows(a, start + _HEADER + 2 * n_own, n_held, 3)
        segs = _rows(a, start + _HEADER + 2 * n_own + 3 * n_held, n_segs, 3)
        if int(held[2].sum()) != int(n_segs.sum()) or (len(held[2]) and int(held[2].min()) < 1):
            raise FormatViolation("a rank's held records and their segments do not add up")
        of_seg = np.repeat(np.arange(n), n_segs)
        own_start = starts(n_own)
        if len(segs[0]) and bool(((segs[0] < 0) | (segs[0] >= n_own[of_seg])).any()):
            raise FormatViolation("a held record's segment names a file its rank did not write")
        keys = list(chain.from_iterable(map(attrgetter("held_keys"), records)))
        if len(keys) != len(held[0]):
            raise FormatViolation("a rank's held records and their keys do not add up")
        files = RankFileColumns(save_id, np.repeat(rank, n_own), own[0], own[1], rank,
                                head[:, _PART_SIZE].copy(), head[:, _PART_HEAD].copy())
        return cls(rank, files, int(head[:, _OWNED].sum()), own_start, n_own, keys,
                   (*held, own_start[of_seg] + segs[0], segs[1], segs[2]))

    def held(self, at: dict[str, int], first_row: int) -> HeldColumns:
        """The packed held records as columns: ``at`` numbers their tensors, and rank files'
        places start at ``first_row`` in the index's file list."""
        try:
            tensor = np.fromiter(map(at.__getitem__, self.held_keys), dtype=INT64, count=len(self.held_keys))
        except KeyError as e:
            raise FormatViolation(f"a rank sent the record of a replicated box of {e.args[0]!r}, which the save has not") from None
        chunk, tail_at, nsegs, row, offset, nbytes = self.held_rows
        return HeldColumns(tensor, chunk, tail_at, nsegs, row + first_row, offset, nbytes)

    def rows_of(self, which: list[int]) -> list[int]:
        """The rows of the own files of the ranks at places ``which`` in gathered order."""
        at = np.asarray(which, dtype=INT64)
        return runs(self.own_start[at], self.own_count[at]).tolist()


def _rows(a: np.ndarray, first: np.ndarray, count: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
    """The ``width`` columns of rows that start at ``first`` (one run of ``count`` rows per rank) in ``a``."""
    at = runs(first, count, width)
    return tuple(a[at + k] for k in range(width))


# The committed save as DCP hands it to every rank: the coordinator's ``finish`` puts these in
# the save's ``Metadata.storage_data``.
MANIFEST_KEY = "dcp_datastates.manifest"  # the committed manifest's bytes in the save's Metadata.storage_data
TOOK_OVER_KEY = "dcp_datastates.took_over"  # beside it: the dead attempts whose claim the save took over
SAVE_ID_KEY = "dcp_datastates.save_id"  # and the save's id
REPLICA_EPOCH_KEY = "dcp_datastates.replica_epoch"  # and the replica group's epoch it was given


@dataclass(frozen=True)
class CommittedSave:
    """What the coordinator's commit of a plain writer's save hands to the other nodes."""

    save_id: str
    manifest: bytes  # the committed manifest
    took_over: tuple[str, ...] = ()  # save ids of dead attempts whose claim the save took over
    # the replica group's epoch the coordinator gave the save (``replica_group.decide_epoch``);
    # None: not decided (the ranks did not vote)
    replica_epoch: int | None = None


def committed_save(metadata) -> CommittedSave | None:
    """The save as its coordinator committed it, from the ``Metadata`` DCP hands every rank
    (``storage_data``); None where it carries none (not committed by this writer)."""
    sd = getattr(metadata, "storage_data", None)
    if not isinstance(sd, dict) or sd.get(MANIFEST_KEY) is None or sd.get(SAVE_ID_KEY) is None:
        return None
    epoch = sd.get(REPLICA_EPOCH_KEY)
    return CommittedSave(str(sd[SAVE_ID_KEY]), sd[MANIFEST_KEY], tuple(sd.get(TOOK_OVER_KEY, ())),
                         None if epoch is None else int(epoch))
