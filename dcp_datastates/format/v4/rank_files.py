"""Format 4's files named by rank: each rank's data files of the save and its metadata part.

Their names follow from the rank, the stripe and the save id (``names.py``), so the index
stores them as three int64 columns (``rank_files``: rank, as the step from the row before,
stripe, size; stripe ``PART``: the rank's part) and the length of each part's head beside
them (``parts``).  At 16,384 ranks that is 32,768 files: as ``[name, size]`` pairs and
``[rank, name, size, digest, head, tail digest]`` lists they were most of the index, and
decoding them one by one most of a rank's time to read it; the two digests a part alone were
half the index's bytes.

A part vouches for itself instead: its head is a packed manifest with its own trailer, save id
and rank; its tail ends in a footer (``FOOTER``) with the save id, the rank and the xxh3-128
of the block digests before it.  Columns are validated in bulk; a name is made only from a
save id that is a plain hex id, so a crafted index cannot name a file outside the checkpoint.
A decoded index makes a name only when asked for (``FileMap``, ``FileList``: a rank uses a few
of the 32,768) and finds a name by reading it; a part's ``PartRef`` is made when first asked
for.  On the way in, each rank's own files and part arrive packed in its ``PartRecord``
(``records.py``), which the coordinator turns into the columns (``RankFileColumns``) at once.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain

import numpy as np
import xxhash

from ..columns import FileList, int_column
from ..limits import INT64, MAX_FILE_BYTES, MAX_PART_BYTES, MAX_STRIPE, FormatViolation
from ..names import PACKED_STRIPE, SAVE_ID, rank_file_name, rank_file_names, rank_file_of

PART = -1  # the stripe of a rank's metadata part in ``rank_files``
# the end of a part's tail: the save id, the rank, and the xxh3-128 of the block digests before it
FOOTER = struct.Struct("<12sQ16s")


@dataclass(frozen=True, slots=True)
class PartRef:
    """A rank's metadata part, as the index names it: a file of ``size`` bytes whose first
    ``head`` bytes are the manifest of its chunks; the rest (its tail) is the block digests of
    those chunks, read with the data they check, and a footer.  Each of the two checks itself
    and names its save and rank (the head its packed manifest with trailer, the tail its footer)."""
    rank: int
    name: str
    size: int
    head: int

    @property
    def digests(self) -> int:
        """The bytes of block digests in the tail."""
        return self.size - self.head - FOOTER.size


def seal_tail(digests: bytes, save_id: str, rank: int) -> bytes:
    """A part's tail: its block digests and the footer that names their save and rank."""
    sid = save_id.encode()
    if len(sid) != 12:
        raise ValueError(f"save id {save_id!r} is not 12 characters")
    return digests + FOOTER.pack(sid, rank, xxhash.xxh3_128_digest(digests))


def open_tail(data: bytes, save_id: str, rank: int) -> bytes:
    """The block digests of a part's tail, when its footer names this save and rank and
    matches them."""
    if len(data) < FOOTER.size:
        raise FormatViolation("its tail is shorter than its footer")
    sid, r, digest = FOOTER.unpack_from(data, len(data) - FOOTER.size)
    if sid != save_id.encode() or r != rank:
        raise FormatViolation(f"its tail holds the block digests of save {sid.decode(errors='replace')} rank {r}")
    digests = data[:len(data) - FOOTER.size]
    if xxhash.xxh3_128_digest(digests) != digest:
        raise FormatViolation("its block digests do not match their footer")
    return digests


@dataclass(slots=True)
class RankFileColumns:
    """What the coordinator gathers for the index: each rank's own data files of this save
    (rank, stripe, size: rows in the order the ranks were gathered) and each rank's part (rank,
    size, head); names are made from rank, stripe and ``save_id`` when asked for."""
    save_id: str
    rank: np.ndarray
    stripe: np.ndarray
    size: np.ndarray
    part_rank: np.ndarray
    part_size: np.ndarray
    part_head: np.ndarray

    def to_wire(self) -> dict:
        rank = np.concatenate([self.rank, self.part_rank])
        return {"rank_files": {"rank": np.diff(rank, prepend=0).tobytes(),  # steps: they pack to little
                               "stripe": np.concatenate([self.stripe, np.full(len(self.part_rank), PART, INT64)]).tobytes(),
                               "size": np.concatenate([self.size, self.part_size]).tobytes()},
                "parts": {"head": self.part_head.tobytes()}}

    def name(self, row: int) -> str:
        """The name of own file ``row``."""
        return rank_file_name(int(self.rank[row]), int(self.stripe[row]), self.save_id)

    def file_names(self) -> list[str]:
        """The rows' names in wire order."""
        return rank_file_names(self.rank.tolist() + self.part_rank.tolist(),
                               self.stripe.tolist() + [PART] * len(self.part_rank), self.save_id)

    def file_sizes(self) -> list[int]:
        """The rows' sizes in wire order."""
        return self.size.tolist() + self.part_size.tolist()

    def size_of(self, row: int) -> int:
        """The size of the file in row ``row`` of the wire order."""
        own = len(self.size)
        return int(self.size[row]) if row < own else int(self.part_size[row - own])


class _NamedThenRanked(Mapping):
    """A format 4 ``Manifest.files``: the files named by name (``named``: another save's), then
    each rank's own files and its part, in the index's order; walked from the columns, without
    a map.  A subclass gives the rank files' names, sizes and a name's size."""

    __slots__ = ("named",)
    named: Mapping[str, int]

    def _rank_names(self) -> list[str]:
        raise NotImplementedError

    def _rank_sizes(self) -> list[int]:
        raise NotImplementedError

    def _rank_count(self) -> int:
        raise NotImplementedError

    def _rank_size(self, name: str) -> int | None:
        raise NotImplementedError

    def __getitem__(self, name: str) -> int:
        size = self.named.get(name)
        if size is None and isinstance(name, str):
            size = self._rank_size(name)
        if size is None:
            raise KeyError(name)
        return size

    def __iter__(self):
        yield from self.named
        yield from self._rank_names()

    def __len__(self) -> int:
        return len(self.named) + self._rank_count()

    def items(self):
        """(name, size) of every file, walked without looking each name up."""
        return [*self.named.items(), *zip(self._rank_names(), self._rank_sizes())]

    def values(self):
        """Every file's size, in order."""
        return [*self.named.values(), *self._rank_sizes()]


class GatheredFiles(_NamedThenRanked):
    """The files of the index the coordinator writes, from the names the ranks sent; a name's
    size or place (``positions``, which segments record) is found through one map of every
    name, made on first use."""

    __slots__ = ("_ranked", "_at", "_names")

    def __init__(self, named: dict[str, int], ranked: RankFileColumns) -> None:
        self.named, self._ranked = named, ranked
        self._at: dict[str, int] | None = None
        self._names: list[str] | None = None

    def _rank_names(self) -> list[str]:
        if self._names is None:
            self._names = self._ranked.file_names()
        return self._names

    def _rank_sizes(self) -> list[int]:
        return self._ranked.file_sizes()

    def _rank_count(self) -> int:
        return len(self._ranked.size) + len(self._ranked.part_size)

    def _rank_size(self, name: str) -> int | None:
        at = self.positions().get(name)
        return None if at is None else self._ranked.size_of(at - len(self.named))

    def positions(self) -> dict[str, int]:
        """Each file's place in the index's file order, by name."""
        if self._at is None:
            self._at = dict(zip(chain(self.named, self._rank_names()), range(len(self))))
        return self._at

    def positions_near(self, rows: Iterable[int]) -> dict[str, int]:
        """The places of the named files and of the rank files in ``rows`` (the files of the
        few ranks whose records name files: inline chunks, held records in another save's
        files), without a map of every name; a name outside them is looked up in
        ``positions()`` when asked."""
        near = _Positions(self)
        near.update(zip(self.named, range(len(self.named))))
        name, first = self._ranked.name, len(self.named)
        near.update((name(r), first + r) for r in rows)
        return near


class _Positions(dict):
    """Some files' places; any other's from the full map, made on the first miss."""

    def __init__(self, files: GatheredFiles) -> None:
        super().__init__()
        self._files = files

    def __missing__(self, name: str) -> int:
        every = self._files.positions()
        if name not in every:
            raise KeyError(name)
        self.update(every)
        return every[name]


class RankFiles:
    """The decoded ``rank_files`` columns: each row's rank, stripe and size, and its name, made
    when asked for (a rank reads a few of the 32,768 at 16,384 ranks)."""

    def __init__(self, raw, world: int, save_id: str) -> None:
        step = int_column(raw, "rank", None, 1 - world, world - 1, "rank_files")  # each row's rank less the last's
        rank = np.cumsum(step)
        n = len(rank)
        if n and (int(rank.min()) < 0 or int(rank.max()) >= world):
            raise FormatViolation(f"rank_files names a rank outside [0, {world})")
        stripe = int_column(raw, "stripe", n, PART, MAX_STRIPE, "rank_files")
        size = int_column(raw, "size", n, 0, MAX_FILE_BYTES, "rank_files")
        if n and not SAVE_ID.match(save_id):
            raise FormatViolation(f"save id {save_id!r} cannot name files")
        key = rank * (MAX_STRIPE + 2) + (stripe - PART)  # one number per (rank, stripe)
        self._order = np.argsort(key, kind="stable")
        self._sorted = key[self._order]
        if n > 1 and bool((self._sorted[1:] == self._sorted[:-1]).any()):
            raise FormatViolation("rank_files lists a rank's file twice")
        self.rank, self.stripe, self.size, self.save_id = rank, stripe, size, save_id
        self._names: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.rank)

    def name(self, row: int) -> str:
        got = self._names.get(row)
        if got is None:
            got = self._names[row] = rank_file_name(int(self.rank[row]), int(self.stripe[row]), self.save_id)
        return got

    def names(self) -> list[str]:
        """Every row's name, in order."""
        return rank_file_names(self.rank.tolist(), self.stripe.tolist(), self.save_id)

    def row_of(self, name: str) -> int | None:
        """The row that names ``name``, else None."""
        got = rank_file_of(name)
        if got is None or got[2] != self.save_id or not len(self.rank):
            return None
        key = got[0] * (MAX_STRIPE + 2) + (got[1] - PART)
        i = int(np.searchsorted(self._sorted, key))
        return int(self._order[i]) if i < len(self._sorted) and int(self._sorted[i]) == key else None


class FileMap(_NamedThenRanked):
    """``Manifest.files`` of a decoded index: rank files' names are made only when the map is
    walked, and a name is found by reading it."""

    __slots__ = ("_ranked",)

    def __init__(self, named: dict[str, int], ranked: RankFiles) -> None:
        if any(ranked.row_of(name) is not None for name in named):
            raise FormatViolation("a file named by rank is also listed by name")
        self.named, self._ranked = named, ranked

    def _rank_names(self) -> list[str]:
        return self._ranked.names()

    def _rank_sizes(self) -> list[int]:
        return self._ranked.size.tolist()

    def _rank_count(self) -> int:
        return len(self._ranked)

    def _rank_size(self, name: str) -> int | None:
        row = self._ranked.row_of(name)
        return None if row is None else int(self._ranked.size[row])

    def positions(self) -> FileList:
        """The files by position, as the index's segments number them (named ones first)."""
        return FileList(list(self.named.items()), self._ranked.size, self._ranked.name,
                        self._ranked.stripe >= PACKED_STRIPE)


class PartTable:
    """The parts of the index by rank (a ``Mapping`` of rank to ``PartRef`` for its readers),
    from the part rows of ``rank_files`` and the ``parts`` columns beside them."""

    def __init__(self, raw, files: RankFiles, world: int) -> None:
        rows = np.nonzero(files.stripe == PART)[0]
        n = len(rows)
        size = files.size[rows]
        head = int_column(raw, "head", n, 1, MAX_PART_BYTES, "parts")
        if n and (int(size.min()) < 1 or int(size.max()) > MAX_PART_BYTES):
            raise FormatViolation(f"a part's size is outside [1, {MAX_PART_BYTES}]")
        if n and bool((head + FOOTER.size > size).any()):
            raise FormatViolation("a part's head is longer than the part less its tail's footer")
        self._ranks = files.rank[rows]
        self._at = dict(zip(self._ranks.tolist(), range(n)))
        self._size, self._head = size.tolist(), head.tolist()
        self._rows, self._files = rows.tolist(), files
        self._world = world
        self._refs: dict[int, PartRef] = {}
        self._sorted: np.ndarray | None = None  # the ranks with a part, sorted (made on first use)

    def __contains__(self, rank) -> bool:
        return rank in self._at

    def __len__(self) -> int:
        return len(self._at)

    def __iter__(self):
        return iter(self._at)

    def get(self, rank: int) -> PartRef | None:
        ref = self._refs.get(rank)
        if ref is None:
            i = self._at.get(rank)
            if i is None:
                return None
            ref = self._refs[rank] = PartRef(rank, self._files.name(self._rows[i]), self._size[i], self._head[i])
        return ref

    def digests(self, rank: int) -> int | None:
        """The bytes of block digests in rank ``rank``'s part tail (None: it has no part),
        without making its ``PartRef``."""
        i = self._at.get(rank)
        return None if i is None else self._size[i] - self._head[i] - FOOTER.size

    def __getitem__(self, rank: int) -> PartRef:
        ref = self.get(rank)
        if ref is None:
            raise KeyError(rank)
        return ref

    def ranks(self) -> list[int]:
        """The ranks with a part, in order."""
        return sorted(self._at)

    def missing(self, ranks: range | tuple[int, ...] | np.ndarray, first: int = 8) -> list[int]:
        """Up to ``first`` of ``ranks`` (in range of the world) that have no part, found in time
        linear in the parts the index lists, never by walking a declared range: a range can only
        be whole if its span holds as many parts on its step as it has ranks."""
        if not isinstance(ranks, range):  # listed in the index: as long as the bytes that list them
            want = np.unique(np.asarray(ranks, dtype=INT64))
            return [int(r) for r in want if int(r) not in self._at][:first]
        if ranks.step < 0:
            ranks = ranks[::-1]
        if not ranks:
            return []
        if self._sorted is None:
            self._sorted = np.sort(self._ranks)
        lo, hi = ranks[0], ranks[-1]
        span = self._sorted[np.searchsorted(self._sorted, lo):np.searchsorted(self._sorted, hi, side="right")]
        on_step = span[(span - lo) % ranks.step == 0]
        if len(on_step) == len(ranks):
            return []
        out = []  # at most len(on_step) + first ranks are walked before ``first`` are missing
        for r in ranks:
            if r not in self._at:
                out.append(r)
                if len(out) == first:
                    break
        return out
