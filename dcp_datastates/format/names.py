"""Every file and directory name of the format, defined once.

A checkpoint directory holds data files, a manifest (or rank manifests), and small
records.  Their names carry the save that wrote them, so that cleanup can tell what a
save owns without guessing from a listing.
"""

from __future__ import annotations

import functools
import re

MANIFEST_NAME = ".metadata"  # torchtitan discovers step-N/.metadata; this file is the commit
RANK_MANIFEST_PREFIX = ".manifest.rank-"  # use_collectives=False: one manifest per rank
CLAIM_NAME = ".claim"  # held by the save writing this directory (tiers/claim.py)
BASE_LOCK = ".base-lock"  # shared by saves that reference this step, exclusive to remove from it (tiers/base_lock.py)
REPLICA_LOCK = ".replica-lock"  # shared by ranks replicating this step, exclusive to purge it (tiers/base_lock.py)
RANK_CLAIM_PREFIX = ".claim.rank-"  # use_collectives=False: one claim per rank
PURGED_MARK = ".purged"  # retention uncommitted this step (tiers/retention.py)
PERSISTED_RECORD = ".persisted"  # which slower tiers committed their copy (for `inspect`)
UPLOADED_PREFIX = ".uploaded.rank-"  # a rank finished uploading to a slow tier
FAILED_PREFIX = ".failed.rank-"  # a rank gave up uploading to a slow tier
TEMP_INFIX = ".tmp-"  # commit_bytes writes NAME.tmp-XXXXXXXX, then renames it
REPLICA_PREFIX = ".replicas.rank-"  # a rank's record of a step's peer replicas (replicas/for_run.py)
# a rank's byte ranges of files its node does not hold, fetched for a load from another node's
# copy (replicas/repair.py): a subdirectory of the node's step directory, never a copy
BORROWED_PREFIX = ".borrowed.rank-"

STEP_DIR = re.compile(r"^step-(\d+)$")
SAVE_ID = re.compile(r"^[0-9a-f]{12}$")
DATA_FILE = re.compile(r"^data-r(\d{5})-([0-9a-f]{12})-(\d{2})\.dsd$")
_DATA_PART = re.compile(r"^data-r(\d{5})-([0-9a-f]{12})-(\d{2})\.dsd\.part$")
PART_FILE = re.compile(r"^part-r(\d{5,7})-([0-9a-f]{12})\.dsm(?:\.part)?$")  # a rank's metadata (format 4)
_RANK_MANIFEST = re.compile(r"^\.manifest\.rank-(\d{5})(?:\.([0-9a-f]{12}))?$")
_REPLICA_RECORD = re.compile(r"^\.replicas\.rank-(\d{5,7})\.([0-9a-f]{12})$")
_BORROWED = re.compile(r"^\.borrowed\.rank-(\d{5,7})$")
_MARKER = re.compile(r"^\.(?:uploaded|failed)\.rank-(\d{5})\.([0-9a-f]{12})$")


_DATA_NAME = "data-r%05d-%s-%02d.dsd"
# A data file's stripe says how its bytes are stored: below PACKED_STRIPE, as they are in memory;
# from it on, as compressed blocks, each segment one stored block (``codec.py``).  A stripe, not
# a new column: format 4 names rank files by (rank, stripe), so the index needs nothing new.
PACKED_STRIPE = 50
_PART_NAME = "part-r%05d-%s.dsm"


def step_of(name: str) -> int | None:
    """The step of a run's step directory name (``step-N``), else None."""
    m = STEP_DIR.match(name)
    return None if m is None else int(m.group(1))


def data_file_name(rank: int, save_id: str, stripe: int) -> str:
    return _DATA_NAME % (rank, save_id, stripe)


def packed_file_name(rank: int, save_id: str, stripe: int) -> str:
    """The data file of compressed blocks that goes with raw stripe ``stripe``."""
    return _DATA_NAME % (rank, save_id, PACKED_STRIPE + stripe)


@functools.lru_cache(maxsize=1 << 16)
def is_packed_file(name: str) -> bool:
    """Whether data file ``name`` holds compressed blocks (each segment one stored block)."""
    m = DATA_FILE.match(name)
    return m is not None and int(m.group(3)) >= PACKED_STRIPE


def rank_file_name(rank: int, stripe: int, save_id: str) -> str:
    """``data_file_name``, or ``part_file_name`` where the stripe is negative."""
    return _PART_NAME % (rank, save_id) if stripe < 0 else _DATA_NAME % (rank, save_id, stripe)


def rank_file_of(name: str) -> tuple[int, int, str] | None:
    """(rank, stripe, save id) of a name ``rank_file_name`` makes (stripe -1: a part), else None."""
    m = DATA_FILE.match(name)
    if m:
        got = int(m.group(1)), int(m.group(3)), m.group(2)
    else:
        m = PART_FILE.match(name)
        if not m:
            return None
        got = int(m.group(1)), -1, m.group(2)
    return got if rank_file_name(*got) == name else None  # only the one spelling of each


def rank_file_names(ranks: list[int], stripes: list[int], save_id: str) -> list[str]:
    """Many ranks' file names at once: ``data_file_name``, or ``part_file_name`` where the
    stripe is negative (format 4's index makes 32,768 of them at 16,384 ranks)."""
    data, part = _DATA_NAME, _PART_NAME
    return [part % (r, save_id) if s < 0 else data % (r, save_id, s) for r, s in zip(ranks, stripes)]


def data_file_stripe(name: str, rank: int, save_id: str) -> int | None:
    """The stripe of ``name`` when it is ``rank``'s data file of save ``save_id``, else None."""
    m = DATA_FILE.match(name)
    return int(m.group(3)) if m and m.group(2) == save_id and int(m.group(1)) == rank else None


def part_file_name(rank: int, save_id: str) -> str:
    return _PART_NAME % (rank, save_id)


def data_file_rank(name: str) -> int | None:
    """The rank that wrote data file ``name``, else None (not a data file)."""
    m = DATA_FILE.match(name)
    return int(m.group(1)) if m else None


def data_file_save_id(name: str) -> str | None:
    """The save that wrote data file or metadata part ``name`` (or its partial upload
    ``name.part``)."""
    m = DATA_FILE.match(name) or _DATA_PART.match(name) or PART_FILE.match(name)
    return m.group(2) if m else None


def rank_manifest_name(rank: int, save_id: str) -> str:
    return f"{RANK_MANIFEST_PREFIX}{rank:05d}.{save_id}"


def parse_rank_manifest(name: str) -> tuple[int, str | None] | None:
    """``(rank, save_id)`` of a rank manifest name; ``save_id`` is None for the
    unversioned names written before rank manifests carried their save."""
    m = _RANK_MANIFEST.match(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def is_manifest_name(name: str) -> bool:
    """A committed manifest: ``.metadata`` or one rank's manifest (not a temp file)."""
    return name == MANIFEST_NAME or _RANK_MANIFEST.match(name) is not None


def rank_claim_name(rank: int) -> str:
    return f"{RANK_CLAIM_PREFIX}{rank:05d}"


def uploaded_marker(rank: int, save_id: str) -> str:
    return f"{UPLOADED_PREFIX}{rank:05d}.{save_id}"


def failed_marker(rank: int, save_id: str) -> str:
    return f"{FAILED_PREFIX}{rank:05d}.{save_id}"


def replica_record_name(rank: int, save_id: str) -> str:
    return f"{REPLICA_PREFIX}{rank:05d}.{save_id}"


def replica_record_of(name: str) -> tuple[int, str] | None:
    """(rank, save id) of a replica record's name, else None."""
    m = _REPLICA_RECORD.match(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def marker_save_id(name: str) -> str | None:
    m = _MARKER.match(name)
    return m.group(2) if m else None


def is_temp_manifest(name: str) -> bool:
    base, sep, _ = name.partition(TEMP_INFIX)
    return bool(sep) and is_manifest_name(base)


def borrowed_dir_name(rank: int) -> str:
    """The subdirectory of a node's step directory where rank ``rank`` keeps what it borrowed."""
    return f"{BORROWED_PREFIX}{rank:05d}"


def is_borrowed_dir(name: str) -> bool:
    return _BORROWED.match(name) is not None


def is_ours(name: str) -> bool:
    """A name this format writes into a checkpoint directory.  Anything else there (a user's
    notes, a subdirectory) is foreign: cleanup and retention leave it alone."""
    base = name.partition(TEMP_INFIX)[0]
    return (is_manifest_name(base) or data_file_save_id(base) is not None
            or marker_save_id(base) is not None or replica_record_of(base) is not None
            or base in (PURGED_MARK, PERSISTED_RECORD, CLAIM_NAME, BASE_LOCK, REPLICA_LOCK)
            or (base.startswith(RANK_CLAIM_PREFIX) and base[len(RANK_CLAIM_PREFIX):].isdigit()))
