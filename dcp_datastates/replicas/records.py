"""A rank's replica record of one step (``names.replica_record_name``): which of its files it
sent to peers on other nodes and who confirmed them, and which files of other ranks its node's
directory holds for them; and reading the records of a step directory."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from ..errors import CheckpointError
from ..format.names import replica_record_name, replica_record_of
from ..format.values import pack_plain
from ..tiers.storage import StorageTier

RECORD_MAX = 1 << 20  # bytes a record may have: a damaged one is never read whole


@dataclass(frozen=True)
class ReplicaRecord:
    """The files this rank sent (``sent``: name -> [size, digest hex]) and the peers that
    confirmed them, and the files of other ranks it holds (``held``: sender rank -> {name:
    [size, digest hex]})."""

    rank: int
    save_id: str
    replicas: int
    sent: dict
    confirmed: list
    held: dict

    def to_bytes(self) -> bytes:
        return pack_plain({"rank": self.rank, "save_id": self.save_id, "replicas": self.replicas,
                           "sent": self.sent, "confirmed": self.confirmed, "held": self.held})

    @classmethod
    def from_bytes(cls, data: bytes) -> "ReplicaRecord":
        """``ValueError``, ``KeyError``, ``TypeError`` or ``msgpack.UnpackException`` where
        ``data`` is not a record."""
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return cls(int(d["rank"]), str(d["save_id"]), int(d["replicas"]), dict(d["sent"]),
                   list(d["confirmed"]), {int(k): dict(v) for k, v in d["held"].items()})

    @property
    def complete(self) -> bool:
        """Whether every replica of this rank's files was confirmed."""
        return len(set(self.confirmed)) >= self.replicas


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
