"""Cooperative loads: each stored block a job needs is read from storage once, by one rank, and
sent over the process group to the other ranks that need it.

Why: in a restart every rank loads at once, and with HSDP (R replica groups) or replicated
parameters R ranks need the same stored bytes.  Read per rank, the storage tier serves them R
times while the network between the nodes sits idle.

How, in four steps, each rank doing work in proportion to what it loads itself:

1. *Ask.*  The ranks first agree that every one of them is ready (one all-reduce of a flag).
   Each lists the checksum blocks its reads cover (``BlockKey``: file, offset, length) and
   sends each to the block's *arbiter*, a rank chosen by a hash of the key, in one
   all-to-all.  No rank sees another's chunk lists or plan.
2. *Assign.*  An arbiter that got a block from two or more ranks makes one of them its *owner*
   (the least loaded by the bytes this arbiter gave it, ties spread by the key's hash; one
   owner per ``FANOUT`` askers, so that a block every rank needs is not sent by one rank to
   all; small whole tensors arbitrated per group of ``FANOUT`` ranks, so that no arbiter
   hears from every rank of a large job) and tells every asker who owns it, and the owner whom to send it to (a second
   all-to-all).  A block one rank asked for is read by that rank, as without cooperation.
3. *Read.*  Each rank reads, through the load's fetcher (fastest tier that verifies), its own
   ranges less the blocks others own.  A read that fails marks its blocks as not sent.
4. *Send.*  Each receiver posts, before reading, a receive for every block it is sent, into
   its own buffers (each block with a tag of its own: its place in the pair's key order).  Each
   owner sends a block as soon as the range holding it is read, straight from the buffer it
   was read into, so that reads and sends overlap; after its reads, one status byte per block
   (read or not) to each receiver.  No staging memory: the bytes travel
   between the buffers the load needs anyway.  A received block is checked against its digest
   like one read from storage; one that was not sent, or does not verify, is read from storage
   by the receiver (logged).  A peer that dies fails the load within the group's timeout with a
   ``PeerLoadError`` naming it.

Blocks read into a GPU through pinned slabs, compressed blocks (whose digest covers the stored
bytes, not the decoded ones the owner holds) and empty ranges are not shared: each rank reads
them itself.  A rank that fails before step 1 (a coverage error, say) still takes part in it,
saying so, and then every rank reads for itself; so a collective is never left waiting on a
rank that raised.

Not yet: owners are balanced by bytes per arbiter, not over nodes (HSDP replicas usually sit
on different nodes, which spreads them anyway); blocks travel over gloo from host memory, not over NCCL from the GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch
import torch.distributed as dist
import xxhash

from .. import process_state
from ..errors import PeerLoadError, first_line
from ..format.checksum import verify_blocks
from ..format.values import pack_plain
from .files import Fetcher, ReadStats
from .ranges import ByteRange, Piece, Ranged

log = logging.getLogger(__name__)

STATUS_TAG, DATA_TAG = 7101, 7102
# An owner sends a block to at most FANOUT - 1 ranks: a block every rank needs (an optimizer's
# step counter) is read once per FANOUT ranks, not sent by one rank to all of them.
FANOUT = 64
# A whole tensor under SMALL bytes (an optimizer's step counter, a replicated bias: often
# needed by every rank) is arbitrated per group of FANOUT consecutive ranks, so that no arbiter
# is asked for one key by every rank of a large job; its bytes are read once per group.  Shards
# (HSDP's replicas are ranks far apart) and larger tensors are arbitrated job-wide.
SMALL = 64 << 10


@dataclass(frozen=True, slots=True, order=True)
class BlockKey:
    """One checksum block of a stored file: the unit a cooperative load reads once."""
    file: str
    offset: int
    nbytes: int


@dataclass
class SharePlan:
    """What this rank does in a cooperative load (``Cooperation.plan``): the ranges it reads
    from storage; the blocks it sends, per range read (``sends``: where each lies here, and to
    which rank with which tag); the blocks it receives, per owner, in key order (``recvs``: the
    one-block range each lands in; the tag is ``DATA_TAG`` + its place in that list, as on the
    owner's side); and the local copies of a received block that a second task of this rank
    also needs."""
    reads: list[Piece]
    sends: dict[tuple[int, int], list[Outgoing]] = field(default_factory=dict)
    recvs: dict[int, list[tuple[BlockKey, Piece]]] = field(default_factory=dict)
    copies: list[tuple[Piece, Piece]] = field(default_factory=list)
    block_size: int = 1 << 20  # the checkpoint's checksum block

    @property
    def bytes_out(self) -> int:
        return sum(o.key.nbytes for lst in self.sends.values() for o in lst)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One block to send, once the range holding it is read: from ``task``'s buffer at ``offset``
    to group rank ``to`` with ``tag``."""
    key: BlockKey
    task: Ranged
    offset: int
    to: int
    tag: int



def _shared(task: Ranged, r: ByteRange) -> bool:
    """Whether ``r`` of ``task`` may be read by another rank and sent here."""
    return not task.streamed and r.stored < 0 and r.nbytes > 0


def _blocks(r: ByteRange, bs: int) -> list[BlockKey]:
    return [BlockKey(r.file, r.file_offset + a, min(bs, r.nbytes - a)) for a in range(0, r.nbytes, bs)]


def _sub(r: ByteRange, a: int, n: int, bs: int) -> ByteRange:
    """Bytes ``[a, a + n)`` of range ``r`` (``a`` on a block boundary) as a range of their own."""
    return dataclasses.replace(r, file_offset=r.file_offset + a, nbytes=n, buf_offset=r.buf_offset + a,
                               first_block=r.first_block + a // bs)


class Cooperation:
    """One cooperative load on ``group`` (every rank of it calls :meth:`plan`, then, when it
    returned a plan, :meth:`exchange`)."""

    def __init__(self, group, checkpoint: str | None) -> None:
        self.group = group
        self.checkpoint = checkpoint
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.plan_s = 0.0
        self.exchange_s = 0.0
        self._t0 = 0.0
        self._works: list = []
        self._status: dict[int, torch.Tensor] = {}
        self._failed_post: RuntimeError | None = None

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r)

    def _all_to_all(self, payloads: list[bytes]) -> list[bytes]:
        """``payloads[r]`` to group rank ``r``; what every rank sent here, by rank."""
        sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
        got = torch.empty(self.world, dtype=torch.int64)
        dist.all_to_all_single(got, sizes, group=self.group)
        ins = got.tolist()
        out = torch.empty(sum(ins), dtype=torch.uint8)
        data = b"".join(payloads)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        dist.all_to_all_single(out, src, ins, sizes.tolist(), group=self.group)
        raw = out.numpy().tobytes()
        res, pos = [], 0
        for n in ins:
            res.append(raw[pos:pos + n])
            pos += n
        return res

    def _any_failed(self, failed: bool) -> bool:
        """Whether any rank of the group says it failed (a collective)."""
        flag = torch.tensor([int(failed)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _payloads(self, to: dict[int, dict[str, list]]) -> list[bytes]:
        """One message per group rank: ``to[r]`` packed, nothing for a rank with nothing."""
        out = [b""] * self.world
        for r, d in to.items():
            out[r] = pack_plain(dict(d))
        return out

    def _arbiter(self, key: BlockKey, grouped: bool) -> int:
        """The rank that chooses ``key``'s owner: by the key's hash; ``grouped`` (a small whole
        tensor, see ``SMALL``), by the key's and this rank's group of ``FANOUT`` ranks."""
        group = f"\0{self.rank // FANOUT}" if grouped else ""
        return xxhash.xxh3_64_intdigest(f"{key.file}\0{key.offset}{group}".encode()) % self.world

    # ------------------------------------------------------------------ plan
    def plan(self, tasks: Sequence[Ranged] | None, block_size: int) -> SharePlan | None:
        """Steps 1 and 2 (collective).  ``tasks`` None: this rank failed before its load could
        start; it still takes part, and every rank gets None (each reads for itself).  A peer
        that dies meanwhile: ``PeerLoadError``, nothing read yet."""
        try:
            return self._plan(tasks, block_size)
        except RuntimeError as e:
            raise self._error(e, "the plan") from None

    def _plan(self, tasks: Sequence[Ranged] | None, block_size: int) -> SharePlan | None:
        t0 = time.perf_counter()
        wanted: dict[BlockKey, bool] = {}  # the blocks this rank's reads cover: arbitrated per group?
        for t in tasks or []:
            grouped = t.whole_tensor and sum(r.nbytes for r in t.ranges) < SMALL
            for r in t.ranges:
                if _shared(t, r):
                    wanted.update(dict.fromkeys(_blocks(r, block_size), grouped))
        if self._any_failed(tasks is None) or tasks is None:
            self.plan_s = time.perf_counter() - t0
            return None
        asks: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for k, grouped in wanted.items():
            asks[self._arbiter(k, grouped)][k.file].append([k.offset, k.nbytes])
        got = self._all_to_all(self._payloads(asks))
        msgs = [msgpack.unpackb(g, raw=False) if g else {} for g in got]
        askers: dict[BlockKey, list[int]] = defaultdict(list)
        for r, m in enumerate(msgs):
            for f, lst in m.items():
                for off, n in lst:
                    askers[BlockKey(f, off, n)].append(r)
        load: dict[int, int] = defaultdict(int)
        replies: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for k in sorted(askers):
            spin = xxhash.xxh3_64_intdigest(f"{k.file}\0{k.offset}".encode())
            for g in range(0, len(askers[k]), FANOUT):  # one owner per FANOUT askers
                who = askers[k][g:g + FANOUT]
                if len(who) < 2:
                    continue
                owner = min(who, key=lambda r: (load[r], (r + spin) % self.world))
                load[owner] += k.nbytes
                for r in who:
                    to = [x for x in who if x != owner] if r == owner else []
                    replies[r][k.file].append([k.offset, k.nbytes, owner, to])
        got = self._all_to_all(self._payloads(replies))
        owner_of: dict[BlockKey, int] = {}
        sends: dict[int, list[BlockKey]] = defaultdict(list)
        for g in got:
            for f, lst in (msgpack.unpackb(g, raw=False) if g else {}).items():
                for off, n, owner, to in lst:
                    k = BlockKey(f, off, n)
                    owner_of[k] = owner
                    for q in to:
                        sends[q].append(k)
        plan = self._split(tasks, block_size, owner_of, sends)
        self.plan_s = time.perf_counter() - t0
        return plan

    def _split(self, tasks: Sequence[Ranged], bs: int, owner_of: dict[BlockKey, int],
               sends: dict[int, list[BlockKey]]) -> SharePlan:
        """Each task's ranges cut where the owner of their blocks changes: runs of blocks this
        rank reads stay one range; a block another rank sends becomes a range of its own."""
        plan = SharePlan(reads=[], block_size=bs)
        where: dict[BlockKey, tuple[Ranged, int, int]] = {}  # a block read here: task, offset, range
        landed: dict[BlockKey, Piece] = {}  # a block received: the range it lands in
        recvs: dict[int, list[tuple[BlockKey, Piece]]] = defaultdict(list)

        def read(t: Ranged, r: ByteRange, new: list[ByteRange], a: int, b: int) -> None:
            for k, x in zip(_blocks(_sub(r, a, b - a, bs), bs), range(a, b, bs)):
                where.setdefault(k, (t, r.buf_offset + x, len(new)))
            plan.reads.append((t, len(new)))
            new.append(_sub(r, a, b - a, bs))

        for t in tasks:
            new: list[ByteRange] = []
            for r in t.ranges:
                if not _shared(t, r):
                    plan.reads.append((t, len(new)))
                    new.append(r)
                    continue
                run = -1  # start of the run of blocks read here, in the range
                for k, a in zip(_blocks(r, bs), range(0, r.nbytes, bs)):
                    owner = owner_of.get(k, self.rank)
                    if owner == self.rank:
                        if run < 0:
                            run = a
                        continue
                    if run >= 0:
                        read(t, r, new, run, a)
                        run = -1
                    piece = (t, len(new))
                    new.append(_sub(r, a, k.nbytes, bs))
                    if k in landed:
                        plan.copies.append((landed[k], piece))
                    else:
                        landed[k] = piece
                        recvs[owner].append((k, piece))
                if run >= 0:
                    read(t, r, new, run, r.nbytes)
            t.ranges = new
        out: dict[tuple[int, int], list[Outgoing]] = defaultdict(list)
        for q, keys in sends.items():
            for j, k in enumerate(sorted(keys)):
                t, off, i = where[k]
                out[(id(t), i)].append(Outgoing(k, t, off, q, DATA_TAG + j))
        plan.sends = dict(out)
        plan.recvs = {p: sorted(lst, key=lambda x: x[0]) for p, lst in recvs.items()}
        return plan

    # -------------------------------------------------------------- exchange
    def open(self, plan: SharePlan) -> None:
        """Step 4 begins, before any read: every block this rank is to receive, and the status
        of each, is posted to land in its buffer."""
        self._t0 = time.perf_counter()
        self._works = []
        self._status = {p: torch.empty(len(lst), dtype=torch.uint8) for p, lst in plan.recvs.items()}
        self._failed_post = None
        try:
            for p, lst in plan.recvs.items():
                for j, (k, (t, i)) in enumerate(lst):
                    self._works.append(dist.irecv(_view(t, t.ranges[i].buf_offset, k.nbytes), self._global(p),
                                                  group=self.group, tag=DATA_TAG + j))
                self._works.append(dist.irecv(self._status[p], self._global(p), group=self.group, tag=STATUS_TAG))
        except RuntimeError as e:  # a peer already gone
            self._failed_post = e

    def ready(self, plan: SharePlan, pieces: list[Piece]) -> None:
        """``pieces`` were read (or failed to be): send the blocks in them that others wait for.
        A block whose read failed is sent all the same, so that its receiver is not left
        waiting, and its status says so."""
        if self._failed_post is not None:
            return
        try:
            for t, i in pieces:
                for o in plan.sends.get((id(t), i), ()):
                    self._works.append(dist.isend(_view(o.task, o.offset, o.key.nbytes), self._global(o.to),
                                                  group=self.group, tag=o.tag))
        except RuntimeError as e:
            self._failed_post = e

    def finish(self, plan: SharePlan, fetch: Fetcher, failed: list[Piece], stats: ReadStats, *,
               verify: bool) -> None:
        """Step 4 ends (:meth:`close`); the received ranges it could not bring are read from
        storage, received blocks copied where a second task of this rank needs them, and the
        load's figures set; then the exchange's error, if a peer died, is raised."""
        bad = blocks_of(failed, plan.block_size)
        done = self.close(plan, bad, verify=verify)
        for t, i in done.redo:
            fetch.piece(t, i)
        copy_landed(plan)
        if done.error is not None:
            raise done.error
        stats.plan_s, stats.exchange_s = self.plan_s, self.exchange_s
        stats.bytes_received = sum(k.nbytes for lst in plan.recvs.values() for k, _p in lst) - \
            sum(t.ranges[i].nbytes for t, i in done.redo)
        stats.bytes_sent = plan.bytes_out - sum(o.key.nbytes for lst in plan.sends.values() for o in lst
                                                if o.key in bad)

    def close(self, plan: SharePlan, failed: set[BlockKey], *, verify: bool) -> Exchanged:
        """Step 4 ends: each owner sends its receivers one status byte per block (1: read and
        sent), then every transfer is waited for.  Returns the received ranges this rank must
        read itself: those not read by their owner, or not matching their digests (logged), and
        all of them when a peer died (``Exchanged.error``)."""
        received = [piece for lst in plan.recvs.values() for _k, piece in lst]
        outgoing: dict[int, list[BlockKey]] = defaultdict(list)
        for lst in plan.sends.values():
            for o in lst:
                outgoing[o.to].append(o.key)
        try:
            if self._failed_post is not None:
                raise self._failed_post
            for q, keys in outgoing.items():
                ok = torch.tensor([k not in failed for k in sorted(keys)], dtype=torch.uint8)
                self._works.append(dist.isend(ok, self._global(q), group=self.group, tag=STATUS_TAG))
            self._wait(self._works, "blocks")
        except (RuntimeError, PeerLoadError) as e:  # whatever arrived may be partial: all read again here
            err = e if isinstance(e, PeerLoadError) else self._error(e, "blocks")
            log.warning("%s: reading the %d block(s) this rank was to receive from storage, then failing the "
                        "load", self.checkpoint, len(received))
            self.exchange_s = time.perf_counter() - self._t0
            return Exchanged(received, err)
        unsent = [piece for p, lst in plan.recvs.items()
                  for (_k, piece), ok in zip(lst, self._status[p].tolist()) if not ok]
        redo = list(unsent)
        if unsent:
            log.warning("%s: %d block(s) their owners could not read; reading them here", self.checkpoint, len(unsent))
        skip = {(id(t), i) for t, i in unsent}
        for p, lst in plan.recvs.items():
            for k, (t, i) in lst:
                r = t.ranges[i]
                if not verify or (id(t), i) in skip:
                    continue
                buf, _addr = t.buffer()
                if verify_blocks(buf.data[r.buf_offset:r.buf_offset + r.nbytes], r.extent.sums, r.first_block,
                                 t.block_size) is not None:
                    log.warning("%s: block at offset %d of %s sent by rank %d does not match its digest; "
                                "reading it from storage", self.checkpoint, k.offset, k.file, p)
                    redo.append((t, i))
        self.exchange_s = time.perf_counter() - self._t0
        return Exchanged(redo, None)

    def _wait(self, works, what: str) -> None:
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:  # a peer died or the group timed out
            raise self._error(e, what) from None

    def _error(self, e: BaseException, what: str) -> PeerLoadError:
        err = PeerLoadError(f"cooperative load: exchanging {what} with the other ranks failed ({first_line(e)}); a "
                            "peer died or stopped answering", checkpoint=self.checkpoint)
        log.error("%s", err)
        return err


@dataclass
class Exchanged:
    """What an exchange left this rank to do: the received ranges to read from storage, and
    the error to raise after (a peer died: what arrived is read again, so that no destination
    is left with a partial or unchecked block)."""
    redo: list[Piece]
    error: PeerLoadError | None


def cooperative_for(setting: bool | str, ranks: int, pg, path: str | None) -> bool:
    """The coordinator's decision: whether a load by ``ranks`` ranks is cooperative.  It is when
    ``setting`` is not False, more than one rank loads, and DCP's group is ``pg`` (the default
    group if None): another group's ranks would not all take part."""
    if setting is False or ranks < 1 or not process_state.group_up():
        return False
    size = dist.get_world_size(pg)
    if ranks != size:
        if setting is True or ranks > 1:
            log.info("%s: a load by %d ranks is not cooperative: this reader's process group has %d (pass "
                     "DataStatesReader(process_group=...) the group given to dcp.load)", path, ranks, size)
        return False
    return ranks > 1


def copy_landed(plan: SharePlan) -> None:
    """Copy each received block to the other ranges of this rank that need it."""
    for (st, si), (dt, di) in plan.copies:
        s, d = st.ranges[si], dt.ranges[di]
        sbuf, _ = st.buffer()
        dbuf, _ = dt.buffer()
        dbuf[d.buf_offset:d.buf_offset + d.nbytes] = sbuf[s.buf_offset:s.buf_offset + s.nbytes]


def _view(task: Ranged, off: int, n: int) -> torch.Tensor:
    buf, _addr = task.buffer()
    return torch.from_numpy(np.asarray(buf[off:off + n]))


def blocks_of(pieces: list[Piece], bs: int) -> set[BlockKey]:
    """The blocks ``pieces`` cover (those another rank might be waiting for)."""
    out: set[BlockKey] = set()
    for t, i in pieces:
        r = t.ranges[i]
        if _shared(t, r):
            out.update(_blocks(r, bs))
    return out


def group_for(pg) -> object:
    """A group able to send host tensors among ``pg``'s ranks: ``pg`` itself when its backend
    runs gloo, else a gloo group of the same ranks (made once per process and rank set)."""
    backend = str(dist.get_backend(pg))
    if "gloo" in backend:
        return pg if pg is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else tuple(range(dist.get_world_size()))
    g = _GLOO.get(ranks)
    if g is None:
        g = _GLOO[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return g


_GLOO: dict[tuple[int, ...], object] = {}


@process_state.in_child
def _forget_groups_in_child() -> None:
    """A forked child is no member of its parent's gloo groups."""
    process_state.keep(dict(_GLOO))
    _GLOO.clear()
