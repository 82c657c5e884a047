"""A rank's replica record of one step (``names.replica_record_name``): which of its files it
sent to peers on other nodes and who confirmed them, and which files of other ranks its node's
directory holds for them; and reading the records of a step directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeGuard

import msgpack

from ..errors import CheckpointError
from ..format.names import replica_record_name, replica_record_of
from ..format.values import pack_plain
from ..tiers.storage import StorageTier

log = logging.getLogger(__name__)

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
        """``ValueError`` (or ``msgpack.UnpackException``) where ``data`` is not a record: a
        record is input, checked field by field as a manifest is, before anything uses it."""
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except TypeError as e:  # a map whose key is a list or a map
            raise ValueError(f"not msgpack this library writes: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("not a map")
        rank, save_id, replicas = d.get("rank"), d.get("save_id"), d.get("replicas")
        if not (_is_int(rank) and rank >= 0):
            raise ValueError(f"rank {rank!r} is not a rank")
        if not isinstance(save_id, str):
            raise ValueError(f"save_id {save_id!r} is not a string")
        if not (_is_int(replicas) and replicas >= 0):
            raise ValueError(f"replicas {replicas!r} is not a count")
        confirmed = d.get("confirmed")
        if not (isinstance(confirmed, list) and all(_is_int(r) and r >= 0 for r in confirmed)):
            raise ValueError("confirmed is not a list of ranks")
        held = d.get("held")
        if not (isinstance(held, dict) and all(_is_int(r) and r >= 0 for r in held)):
            raise ValueError("held is not a map of ranks")
        return cls(rank, save_id, replicas, _files(d.get("sent"), "sent"), list(confirmed),
                   {int(r): _files(v, f"held[{r}]") for r, v in held.items()})

    @property
    def complete(self) -> bool:
        """Whether every replica of this rank's files was confirmed."""
        return len(set(self.confirmed)) >= self.replicas


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _files(x, what: str) -> dict[str, list]:
    """A record's files: name -> [size, digest hex or ""]."""
    if not isinstance(x, dict):
        raise ValueError(f"{what} is not a map of files")
    for name, v in x.items():
        if not (isinstance(name, str) and isinstance(v, (list, tuple)) and len(v) == 2 and _is_int(v[0])
                and v[0] >= 0 and isinstance(v[1], str)):
            raise ValueError(f"{what} lists {name!r} as {v!r}, not [size, digest]")
    return {name: list(v) for name, v in x.items()}


def read_record(tier: StorageTier, rank: int, save_id: str) -> ReplicaRecord | None:
    """Rank ``rank``'s replica record of save ``save_id`` in ``tier``, if any and valid.  A
    record that cannot be read or is not a record is skipped, with a warning naming it: it only
    vouches for copies, which are then checked as any unvouched copy is."""
    name = replica_record_name(rank, save_id)
    try:
        data = tier.read_bytes(name, max_bytes=RECORD_MAX)
    except FileNotFoundError:
        return None
    except (OSError, CheckpointError) as e:
        log.warning("%s/%s: replica record unreadable, skipped: %s", tier.url, name, e)
        return None
    try:
        rec = ReplicaRecord.from_bytes(data)
    except (ValueError, msgpack.UnpackException) as e:
        log.warning("%s/%s: not a replica record, skipped: %s", tier.url, name, e)
        return None
    if rec.rank != rank or rec.save_id != save_id:
        log.warning("%s/%s: the record names rank %d of save %s, skipped", tier.url, name, rec.rank, rec.save_id)
        return None
    return rec


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
