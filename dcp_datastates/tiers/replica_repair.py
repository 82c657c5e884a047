"""Before a restore from node-local copies: every node's directory of the step made whole
(``repair``), from copies on other nodes whose bytes match the digests recorded when they were
replicated (``replicas.py``).  A collective over the replicator's group: one rank per node
hashes what its node holds and receives what it lacks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import xxhash

from ..errors import CheckpointError
from ..format.names import MANIFEST_NAME, data_file_save_id
from .manifests import load_manifest, manifest_head
from .replica_records import records_in
from .replicas import PIECE, Landing, piece_buffer
from .replicator import Replicator
from .storage import StorageTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holding:
    """A file one node holds for a step: its size and the xxh3-128 of its bytes, and whether
    that digest matches the one recorded when the file was replicated."""

    size: int
    digest: str
    vouched: bool


def _inventory(tier: StorageTier, save_id: str) -> dict[str, Holding]:
    """The step files of ``save_id`` in ``tier`` (data files, parts, the manifest), each hashed
    and checked against the digests the replica records there give."""
    try:
        names = tier.listdir()
        recs = records_in(tier, save_id)
    except OSError:
        return {}
    recorded: dict[str, str] = {}
    for rec in recs:
        for f, v in rec.sent.items():
            if len(v) > 1 and v[1]:
                recorded[f] = v[1]
        for files in rec.held.values():
            for f, v in files.items():
                recorded[f] = v[1]
    out = {}
    for name in names:
        if name != MANIFEST_NAME and data_file_save_id(name) != save_id:
            continue
        h = xxhash.xxh3_128()
        size = 0
        buf = bytearray(PIECE)
        try:
            while True:
                n = tier.read_into(name, size, buf)
                h.update(memoryview(buf)[:n])
                size += n
                if n < len(buf):
                    break
        except (OSError, CheckpointError) as e:
            log.warning("%s/%s cannot be read for the replica check: %s", tier.url, name, e)
            continue
        digest = h.hexdigest()
        out[name] = Holding(size, digest, recorded.get(name) == digest)
    return out


def repair(rep: Replicator, tier: StorageTier, label: str, save_id: str | None) -> bool:
    """Before a restore of a step (``label`` in the log; a collective over the replicator's group): make every
    node's directory ``tier`` of the step hold the manifest and every file it lists, copied from
    a node whose copy matches its recorded digest.  Returns whether every file the manifest
    lists is on every node; False when some file has no good copy left (the caller then reads
    a slower tier or an older step).  ``save_id``: the save to repair (None: the newest any
    node holds)."""
    names, ranks = rep.peers.nodes.layout()
    mine = rep.peers.nodes.nodes[rep.peers.me]
    leader = ranks[mine][0] == rep.peers.me  # one rank per node hashes and receives
    inv = {}
    if save_id is None:
        heads: list = [None] * len(rep.peers.ranks)
        local = manifest_head(tier) if leader else None
        dist.all_gather_object(heads, local, group=rep.group)
        found = [h for h in heads if h is not None]
        if not found:
            return False
        save_id = max(found, key=lambda h: (h.created_unix, h.save_id)).save_id
    if leader:
        inv = _inventory(tier, str(save_id))
    views: list = [None] * len(rep.peers.ranks)
    dist.all_gather_object(views, (mine, inv) if leader else None, group=rep.group)
    per_node = {v[0]: v[1] for v in views if v is not None}
    manifest = [(n, h) for n, h in per_node.items() if MANIFEST_NAME in h]
    if not manifest:
        return False
    # the manifest: from the node whose copy most nodes share (every node committed the same bytes)
    counts: dict[str, int] = {}
    for _n, h in manifest:
        counts[h[MANIFEST_NAME].digest] = counts.get(h[MANIFEST_NAME].digest, 0) + 1
    want_manifest = max(counts, key=lambda d: (counts[d], d))
    # only to nodes that lost theirs: a node's committed manifest of another save is never replaced
    _transfer(rep, tier, {n: h for n, h in per_node.items()}, ranks, {MANIFEST_NAME: want_manifest}, label,
              skip=lambda node: MANIFEST_NAME in per_node.get(node, {}))
    m = None
    if leader:
        try:
            m = load_manifest(tier)
        except (CheckpointError, OSError) as e:  # none came: this node's ranks will read elsewhere or fail
            log.warning("%s: no readable manifest on this node after the repair: %s", label, e)
    need = sorted(n for n in (m.files if m is not None else {}) if n not in m.homes) if m is not None else []
    lists: list = [None] * len(rep.peers.ranks)
    dist.all_gather_object(lists, need if leader else None, group=rep.group)
    need = sorted({n for x in lists if x for n in x})
    good: dict[str, str] = {}
    for n in need:
        vouched = {h[n].digest for h in per_node.values() if n in h and h[n].vouched}
        if len(vouched) == 1:
            good[n] = vouched.pop()
    lost = [n for n in need if n not in good]
    _transfer(rep, tier, per_node, ranks, good, label)
    if lost:
        log.warning("%s: no good copy of %d file(s) on any node (first: %s); reading them from a "
                    "slower tier if one holds the step", label, len(lost), lost[0])
    return not lost


def _transfer(rep: Replicator, tier: StorageTier, per_node: dict[str, dict[str, Holding]],
              ranks: dict[str, list[int]], files: dict[str, str], label: str, skip=None) -> None:
    """Copy each of ``files`` (name -> digest) to every node whose leader lacks a copy with that
    digest (and that ``skip(node)`` does not exclude), from a node that has one; every rank walks
    the same list in the same order."""
    moves = []
    for name in sorted(files):
        holders = sorted(n for n, h in per_node.items() if name in h and h[name].digest == files[name])
        if not holders:
            continue
        for i, node in enumerate(sorted(ranks)):
            h = per_node.get(node, {})
            if (name in h and h[name].digest == files[name]) or (skip is not None and skip(node)):
                continue
            src = holders[i % len(holders)]
            moves.append((name, ranks[src][0], ranks[node][0], per_node[src][name].size))
    me = rep.peers.me
    for name, src, dst, size in moves:
        if me not in (src, dst):
            continue
        peer = rep.peers.ranks[dst if me == src else src]
        if me == src:
            _send_file(rep.group, tier, name, size, peer)
        else:
            ok = _recv_file(rep.group, tier, name, size, peer, files[name])
            log.log(logging.INFO if ok else logging.WARNING, "%s: %s %s from rank %d", label,
                    "restored" if ok else "could not restore", name, src)


def _send_file(group, tier: StorageTier, name: str, size: int, peer: int) -> None:
    buf = torch.empty(PIECE, dtype=torch.uint8)
    h = xxhash.xxh3_128()
    for a in range(0, size, PIECE):
        n = min(PIECE, size - a)
        tier.read_into(name, a, buf[:n].numpy())
        h.update(buf[:n].numpy().data)
        dist.send(buf[:n], peer, group=group)
    dist.send(torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8), peer, group=group)


def _recv_file(group, tier: StorageTier, name: str, size: int, peer: int, digest: str) -> bool:
    """Receive ``name`` into ``tier``; keep it only when its bytes match ``digest``."""
    buf = piece_buffer()
    tier.makedirs()
    landing = Landing(tier, name)
    try:
        for a in range(0, size, PIECE):
            n = min(PIECE, size - a)
            dist.recv(buf[:n], peer, group=group)
            landing.write(buf, n, a)
    except BaseException:
        landing.abort()
        raise
    tail = torch.empty(16, dtype=torch.uint8)
    dist.recv(tail, peer, group=group)
    return landing.keep(tail.numpy().tobytes() if landing.hash.hexdigest() == digest else b"")
