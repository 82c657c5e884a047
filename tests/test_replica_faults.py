"""Peer replicas when peers fail (issue 36): a sender or receiver whose storage fails, a peer
killed or hung mid-replication, a load while a replication runs or after a peer hung, malformed
records; each degrades only what it must and no rank waits out more than the group's timeout."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dcp_datastates import Checkpointer
from dcp_datastates.replicas import moves
from dcp_datastates.replicas.group import ReplicaVote
from dcp_datastates.replicas.helper import SENDER_ENV
from dcp_datastates.replicas.records import read_record
from dcp_datastates.replicas.replicator import TIMEOUT_ENV
from dcp_datastates.tiers import StorageTier
from tests.dist import run_ranks
from tests.replica_jobs import (
    GROUP_TIMEOUT_S,
    HUNG_S,
    PER_NODE,
    _hang_replication_once,
    _killed,
    _lose_own_files,
    _model,
    _record_of,
    _restore,
    _short_timeout,
    _state,
    _tiers,
    _train,
)


def _faulty_sender(rank, world, base):
    """Rank 2's disk fails under its first replication (a wrapped storage read): its peer must
    drop the partial copy, rank 2's step is degraded and said so, nobody waits for a timeout,
    training goes on, and the next step replicates in full."""
    os.environ[SENDER_ENV] = "thread"  # the default; the wrapped storage below lives in this process
    import errno
    import threading
    import time

    from dcp_datastates.tiers import StorageTier
    if rank == 2:
        real, left = StorageTier.read_into, [1]

        def read_into(self, name, offset, buf, *, fd=None):
            if threading.current_thread().name == "dcpds-replicas" and left[0] and name.startswith("data-"):
                left[0] -= 1
                raise OSError(errno.EIO, "injected: the disk under the replica sender failed")
            return real(self, name, offset, buf, fd=fd)
        StorageTier.read_into = read_into
    model, opt = _model(world)
    ckpt = Checkpointer(_tiers(base, rank // PER_NODE, False), node_local=True, replicas=1,
                        node=f"n{rank // PER_NODE}",
                        process_group=dist.new_group(backend="gloo"))
    ckpt.register_step_pre_hook(opt)
    for step in (1, 2):
        _train(model, opt, step)
        ckpt.save(step, _state(model, opt))
    t = time.monotonic()
    ok = ckpt.wait_replicated(120)
    assert time.monotonic() - t < 60
    first, second = ckpt.node_copies.record(1), ckpt.node_copies.record(2)
    assert ok == (rank != 2) and first.complete == (rank != 2) and second.complete, (rank, first, second)
    _train(model, opt, 3)  # training was never held up
    ckpt.close()
    dist.barrier()
    if rank == 0:  # rank 2's peer kept nothing of the broken copy
        here = os.listdir(os.path.join(base, "node0", "step-1"))
        assert not [n for n in here if n.startswith("data-r00002-") or ".tmp-" in n], here
        assert [n for n in os.listdir(os.path.join(base, "node0", "step-2")) if n.startswith("data-r00002-")]


def test_a_sender_that_fails_mid_replication_degrades_only_its_step(tmp_path):
    run_ranks(4, _faulty_sender, str(tmp_path))


def _stop_rank2_helper(rank, world, base, sender, sd):
    """A synchronous ``Checkpointer`` with one replica per node-local step, sending from
    ``sender``; with the helper process, a first step replicates (every helper is up and in its
    group) and rank 2's helper is then stopped (SIGSTOP).  The checkpointer and the next step."""
    ckpt = Checkpointer(_tiers(base, rank // PER_NODE, False), node_local=True, replicas=1,
                        node=f"n{rank // PER_NODE}", process_group=dist.new_group(backend="gloo"),
                        async_mode=None)
    rep = ckpt.node_copies.replicator
    assert rep.in_helper == (sender == "process")
    if sender == "thread":
        return ckpt, 1
    ckpt.save(1, sd)
    assert ckpt.wait_replicated(120)
    dist.barrier()
    if rank == 2:
        os.kill(rep._work._proc.pid, signal.SIGSTOP)
    return ckpt, 2


def _peer_dies(rank, world, base, sender):
    """Rank 2's sender dies in the middle of replication.  With the thread sender, rank 2 is
    SIGKILLed while sending its replica (a wrapped storage read kills the process); with the
    helper process, rank 2's helper is stopped, then SIGKILLed while rank 0's waits for it in
    the exchange, and rank 2 trains on.  Rank 0 learns it from the broken connection, not from
    a timeout; rank 0's step is then not fully replicated, and no training thread waited."""
    import threading

    from dcp_datastates.tiers import StorageTier
    os.environ[SENDER_ENV] = sender
    if rank == 2 and sender == "thread":
        real = StorageTier.read_into

        def read_into(self, name, offset, buf, *, fd=None):
            if threading.current_thread().name == "dcpds-replicas" and name.startswith("data-") and offset > 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, name, offset, buf, fd=fd)
        StorageTier.read_into = read_into
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    # 24 MiB a rank: a data file of two messages, killed after the first
    big = {"w": distribute_tensor(torch.randn(world << 21, 3), mesh, [Shard(0)])}
    ckpt, step = _stop_rank2_helper(rank, world, base, sender, big)
    if rank == 2 and sender == "process":
        helper = ckpt.node_copies.replicator._work._proc.pid
    ckpt.save(step, big)
    ckpt.wait()  # committed here; replication runs in the background
    t = time.monotonic()
    x = torch.randn(256, 256)
    for _ in range(20):  # training goes on meanwhile
        x = torch.tanh(x @ x.T / 256)
    if rank == 2 and sender == "process":
        time.sleep(1)  # the others' helpers are in the exchange, waiting for this one
        os.kill(helper, signal.SIGKILL)
    ok = ckpt.wait_replicated(120)
    if rank in (0, 2):
        assert not ok and time.monotonic() - t < 60, (ok, time.monotonic() - t)
    if rank == 0:
        rec = ckpt.node_copies.record(step)
        assert not rec.complete and rec.confirmed == [], rec
        here = os.listdir(os.path.join(base, "node0", f"step-{step}"))
        assert not [n for n in here if n.startswith(f"data-r00002-{rec.save_id}")], here  # nor a temporary file
    elif rank in (1, 3):
        assert ok
    if sender == "process":  # training goes on, and so do its saves: never wedged
        x = torch.tanh(x @ x.T / 256)
        ckpt.save(step + 1, big)
        ckpt.wait()
        assert ckpt.committed_steps(0)[-1] == step + 1
    os._exit(0)  # the group lost rank 2: skip the teardown collectives


@pytest.mark.parametrize("sender", ["thread", "process"])
def test_a_peer_killed_mid_replication_degrades_the_step_without_waiting(tmp_path, sender):
    if sender == "thread":
        with pytest.raises(AssertionError, match=r"exited with codes \[-9\]"):
            run_ranks(4, _peer_dies, str(tmp_path), sender)
    else:
        run_ranks(4, _peer_dies, str(tmp_path), sender)


def _peer_hangs(rank, world, base, sender):
    """Rank 2's replication hangs past the replica group's timeout in a step's exchange, alive
    (the thread sender: a storage read stalls; the helper process: stopped, then continued):
    rank 0 gives up on it, gloo closes their connections, and rank 2 finds them closed when
    it goes on.  That step is degraded on both; the next save, planned once every rank's
    replication is idle, is given a new epoch, every rank makes the group again, and that step
    is fully replicated on every rank.  Training never waited."""
    os.environ[SENDER_ENV] = sender
    os.environ[TIMEOUT_ENV] = str(GROUP_TIMEOUT_S)
    _hang_replication_once(sender, rank)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.randn(world << 16, 8), mesh, [Shard(0)])}  # 2 MiB a rank
    ckpt, step = _stop_rank2_helper(rank, world, base, sender, sd)
    rep = ckpt.node_copies.replicator
    t = time.monotonic()
    ckpt.save(step, sd)
    ckpt.wait()
    assert time.monotonic() - t < GROUP_TIMEOUT_S, "the save waited for replication"
    if rank == 2 and sender == "process":
        time.sleep(HUNG_S)
        os.kill(rep._work._proc.pid, signal.SIGCONT)
    ok = ckpt.wait_replicated(120)
    rec = ckpt.node_copies.record(step)
    assert ok == (rank in (1, 3)) and rec.complete == ok, (rank, rec)
    assert rep.vote().broken == (rank in (0, 2)) and rep.vote().idle
    dist.barrier()  # every rank's replication is idle: the next save makes the group again
    ckpt.save(step + 1, sd)
    rec = ckpt.node_copies.record(step + 1, 120)
    assert rec.complete and rec.confirmed == [(rank + PER_NODE) % world], (rank, rec)
    assert rep.vote() == ReplicaVote(1, False, True)
    ckpt.save(step + 2, sd)  # and so are the steps after it, over the same group
    assert ckpt.node_copies.record(step + 2, 120).complete and rep.vote().epoch == 1
    ckpt.close()


@pytest.mark.parametrize("sender", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_a_peer_that_hung_is_replicated_to_again_from_the_next_save(tmp_path, sender):
    run_ranks(4, _peer_hangs, str(tmp_path), sender)


def _step_1_replicated(rank, world, base):
    """A synchronous ``Checkpointer`` with one replica, sending from its thread, and a 2 MiB
    shard a rank saved as step 1 and replicated in full: the checkpointer, the state and this
    rank's shard as saved."""
    os.environ[SENDER_ENV] = "thread"
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.randn(world << 16, 8), mesh, [Shard(0)])}  # 2 MiB a rank
    node = rank // PER_NODE
    ckpt = Checkpointer(_tiers(base, node, False), node_local=True, replicas=1, node=f"n{node}",
                        process_group=dist.new_group(backend="gloo"), async_mode=None)
    ckpt.save(1, sd)
    assert ckpt.wait_replicated(120)
    dist.barrier()
    return ckpt, sd, sd["w"].to_local().clone()


def _load_while_replicating(rank, world, base):
    """A load of step 1 right after step 2 was saved, while rank 2's replication of step 2 is
    stalled (3 s at its first read of a file to send) and node 1 has lost its own files of
    step 1: the load's repair gives node 1 those files from node 0, over the replica group the
    replication uses, between the same ranks.  Step 1 loads bit-exactly and step 2 is fully
    replicated all the same."""
    ckpt, sd, want = _step_1_replicated(rank, world, base)
    node = rank // PER_NODE
    if node == 1:  # its ranks' own files of step 1 are lost; its replicas of node 0's stay
        _lose_own_files(base, rank, 1)
    dist.barrier()
    _hang_replication_once("thread", rank, 3)
    sd["w"].to_local().add_(1)
    ckpt.save(2, sd)
    sd["w"].to_local().zero_()
    assert ckpt.load(sd, step=1) == 1
    assert torch.equal(sd["w"].to_local(), want)
    rec = ckpt.node_copies.record(2, 120)
    assert rec.complete and rec.confirmed == [(rank + PER_NODE) % world], (rank, rec)
    assert not ckpt.node_copies.replicator.vote().broken
    ckpt.close()


def test_a_load_while_a_replication_is_under_way_repairs_and_replicates_both(tmp_path):
    run_ranks(4, _load_while_replicating, str(tmp_path))


def _load_after_a_peer_hung(rank, world, base):
    """A load of step 1 in the same job, after rank 2's replication of step 2 hung past the
    group's timeout (ranks 0 and 2 hold a broken group) and before a save made the group again;
    node 1 has lost its own files of step 1, so the repair sends them from node 0 over the
    pair that broke.  The load makes the group again first: step 1 loads bit-exactly, and the
    next step replicates in full."""
    os.environ[TIMEOUT_ENV] = str(GROUP_TIMEOUT_S)
    ckpt, sd, want = _step_1_replicated(rank, world, base)
    rep, node = ckpt.node_copies.replicator, rank // PER_NODE
    _hang_replication_once("thread", rank)
    sd["w"].to_local().add_(1)
    ckpt.save(2, sd)
    assert ckpt.wait_replicated(120) == (rank in (1, 3))
    assert rep.vote().broken == (rank in (0, 2))
    if node == 1:  # its ranks' own files of step 1 are lost; its replicas of node 0's stay
        _lose_own_files(base, rank, 1)
    dist.barrier()
    sd["w"].to_local().zero_()
    assert ckpt.load(sd, step=1) == 1
    assert torch.equal(sd["w"].to_local(), want)
    assert not rep.vote().broken
    ckpt.save(3, sd)
    rec = ckpt.node_copies.record(3, 120)
    assert rec.complete and rec.confirmed == [(rank + PER_NODE) % world], (rank, rec)
    ckpt.close()


def test_a_load_after_a_peer_hung_makes_the_replica_group_again(tmp_path):
    run_ranks(4, _load_after_a_peer_hung, str(tmp_path))


def _one_node(rank, world, base):
    """Two ranks on one node asked for a replica: there is no other node, so the step is
    saved and committed but never counted as fully replicated."""
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.randn(64, 8), mesh, [Shard(0)])}
    ckpt = Checkpointer(_tiers(base, 0, False), node_local=True, replicas=1, node="n0",
                        process_group=dist.new_group(backend="gloo"), async_mode=None)
    ckpt.save(1, sd)
    assert ckpt.wait_replicated(60) is False
    rec = ckpt.node_copies.record(1)
    assert not rec.complete and rec.replicas == 1 and rec.confirmed == []
    ckpt.close()


def test_without_another_node_a_step_is_never_called_fully_replicated(tmp_path):
    run_ranks(2, _one_node, str(tmp_path))


def _faulty_receiver(rank, world, base):
    """Rank 2 cannot store what it receives (a wrapped sink that fails, as a full disk would):
    it drops rank 0's copy and keeps receiving, so rank 0's step is degraded at once, not after
    a timeout, and rank 2's own files still reach rank 0."""
    os.environ[SENDER_ENV] = "thread"  # the default; the wrapped storage below lives in this process
    import errno
    import time as _time

    from dcp_datastates.tiers import StorageTier
    if rank == 2:
        real = StorageTier.open_sink

        def open_sink(self, name, o_direct=False, drop_cache=True):
            if ".tmp-replica" in name:
                raise OSError(errno.ENOSPC, "injected: no space left for the replica")
            return real(self, name, o_direct, drop_cache)
        StorageTier.open_sink = open_sink
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.randn(world << 20, 2), mesh, [Shard(0)])}  # 8 MiB a rank
    ckpt = Checkpointer(_tiers(base, rank // PER_NODE, False), node_local=True, replicas=1,
                        node=f"n{rank // PER_NODE}", process_group=dist.new_group(backend="gloo"),
                        async_mode=None)
    ckpt.save(1, sd)
    t = _time.monotonic()
    ok = ckpt.wait_replicated(120)
    assert _time.monotonic() - t < 60
    rec = ckpt.node_copies.record(1)
    assert ok == (rank != 0) and rec.complete == (rank != 0), (rank, rec)
    ckpt.close()


def test_a_receiver_that_cannot_store_a_replica_degrades_only_that_copy(tmp_path):
    run_ranks(4, _faulty_receiver, str(tmp_path))


def test_a_save_is_given_a_new_epoch_only_when_a_group_broke_and_every_rank_is_idle():
    from dcp_datastates.replicas.group import decide_epoch
    idle, busy = ReplicaVote(2, False, True), ReplicaVote(2, False, False)
    assert decide_epoch([idle, idle]) == 2
    assert decide_epoch([ReplicaVote(2, True, True), idle]) == 3
    assert decide_epoch([ReplicaVote(2, True, True), busy]) == 2  # a rank catching up: not yet
    assert decide_epoch([ReplicaVote(3, False, True), idle]) == 3  # the newest epoch given
    assert decide_epoch([idle, None]) is None and decide_epoch([]) is None  # a rank did not vote


def test_what_a_member_sends_is_unpickled_into_plain_types_and_records_only():
    """The replica group's object collectives take objects from the job's own ranks; even so,
    what arrives never names a function or class outside the library to run."""
    from dcp_datastates.format.records import CommittedSave
    from dcp_datastates.replicas import group as replica_group
    sent = (CommittedSave("s", b"m", ("t",), 1), {1}, frozenset({2}), None, 1.5, b"x", [("a", True)])
    assert replica_group._objects(pickle.dumps(sent)) == sent
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        replica_group._objects(pickle.dumps(os.system))
    # nor a function of the library's, or anything reached through one of its modules' names
    for module, name in (("dcp_datastates.tiers.borrowed", "clear_borrowed"),
                         ("dcp_datastates.replicas.group", "os.getpid"),
                         ("dcp_datastates.replicas.group", "ReplicaGroup")):
        calls = (pickle.PROTO + bytes([4]) + pickle.SHORT_BINUNICODE + bytes([len(module)]) + module.encode()
                 + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name.encode() + pickle.STACK_GLOBAL
                 + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP)
        with pytest.raises(pickle.UnpicklingError, match=name):
            replica_group._objects(calls)


@pytest.mark.parametrize("field,bad", [("sent", "entries-are-integers"), ("held", "not-a-map"),
                                       ("confirmed", "not-a-list"), ("replicas", "not-a-number")])
def test_a_malformed_replica_record_is_skipped_and_the_restore_goes_on(tmp_path, caplog, field, bad):
    """A record that is valid msgpack but not a record (issue 69, case 6): skipped with one line
    naming it, on every rank alike, never raised on one rank while the others wait."""
    import msgpack
    base = str(tmp_path)
    _killed(4, base, False)
    path = _record_of(os.path.join(base, "node1", "step-5"), 2)
    rec = msgpack.unpackb(open(path, "rb").read(), raw=False, strict_map_key=False)
    rec[field] = {"sent": {k: 7 for k in rec["sent"]}, "held": [1, 2], "confirmed": {"x": 1},
                  "replicas": "two"}[field]
    with open(path, "wb") as f:
        f.write(msgpack.packb(rec))
    started = time.monotonic()
    run_ranks(4, _restore, base, False, 5, None, 1, _short_timeout)
    assert time.monotonic() - started < 120
    assert read_record(StorageTier(os.path.dirname(path)), 2, rec["save_id"]) is None


def _local(obj, prefix="") -> dict:
    """Each tensor's local part by its dotted key (no collective: ranks may fail apart)."""
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _local(v, f"{prefix}{k}.").items()}
    if isinstance(obj, DTensor):
        return {prefix: obj.to_local().clone()}
    return {prefix: obj.clone() if isinstance(obj, torch.Tensor) else obj}


def _borrowed_range_damaged(rank, world, base):
    """Rank 0 borrows ranges of files its node lacks; every range it is lent arrives with one
    byte flipped (a wrapped reduction of the replica group).  Its load must refuse them: either
    the step comes back bit-exact from elsewhere, or the load fails with the library's error
    naming the file, the same on every rank; never silently wrong."""
    from dcp_datastates.errors import CheckpointError

    model, opt = _model(world)
    ck = Checkpointer([os.path.join(base, f"node{rank}")], node_local=True, replicas=1, node=f"n{rank}",
                      async_mode=None, process_group=dist.new_group(backend="gloo"))
    _train(model, opt, 1)
    want = _local(_state(model, opt))
    ck.save(1, _state(model, opt))
    assert ck.wait_replicated(60)
    _train(model, opt, 2)  # the live state moves on: a load must bring step 1 back
    real = moves._Sinks.write

    def damaged(self, name, data, offset):  # what a rank borrows is stored with a byte flipped
        data = data.clone()
        data[data.numel() // 2] ^= 0x5A
        lent.append(name)
        return real(self, name, data, offset)
    lent: list[str] = []
    moves._Sinks.write = damaged
    sd = _state(model, opt)
    try:
        assert ck.load(sd) == 1
        got = _local(sd)
        bad = [k for k, v in want.items() if not (torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k])]
        assert not bad, f"silently wrong: {bad}"
        outcome = "loaded"
    except CheckpointError as e:
        assert "data-" in str(e) and "\n" not in str(e), e
        outcome = "refused"
    with open(os.path.join(base, f"outcome-{rank}"), "w") as f:
        f.write(f"{outcome} {len(lent)}")
    ck.close()
    os._exit(0)


def test_a_borrowed_range_damaged_on_the_way_is_never_loaded(tmp_path):
    run_ranks(4, _borrowed_range_damaged, str(tmp_path))
    outcomes = [(tmp_path / f"outcome-{r}").read_text().split() for r in range(4)]
    assert sum(int(n) for _o, n in outcomes) > 0, outcomes  # some rank borrowed ranges
