"""Reading the replica records of a step directory (``format/replica_record.py``)."""

from __future__ import annotations

import msgpack

from ..errors import CheckpointError
from ..format.names import replica_record_name, replica_record_of
from ..format.replica_record import RECORD_MAX, ReplicaRecord
from .storage import StorageTier


def read_record(tier: StorageTier, rank: int, save_id: str) -> ReplicaRecord | None:
    """Rank ``rank``'s replica record of save ``save_id`` in ``tier``, if any and readable."""
    name = replica_record_name(rank, save_id)
    try:
        return ReplicaRecord.from_bytes(tier.read_bytes(name, max_bytes=RECORD_MAX))
    except (OSError, CheckpointError, ValueError, KeyError, TypeError, msgpack.UnpackException):
        return None


def records_in(tier: StorageTier, save_id: str) -> list[ReplicaRecord]:
    """The replica records of save ``save_id`` in directory ``tier``, by rank."""
    out = []
    for name in sorted(tier.listdir()):
        got = replica_record_of(name)
        if got is not None and got[1] == save_id:
            rec = read_record(tier, got[0], save_id)
            if rec is not None:
                out.append(rec)
    return out
