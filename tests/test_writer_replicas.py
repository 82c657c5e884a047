"""Peer replicas through plain DCP (issue 36): ``dcp.save`` / ``dcp.async_save`` with
``DataStatesWriter(path, replicas=1)`` and ``dcp.load`` with ``DataStatesReader(path,
node_local=True)``, no ``Checkpointer``.

Two nodes of two ranks are simulated on one machine: each node its own directory, the node
given to the writer.  Every rank's files land on the other node too; the manifest is committed
on both; a node's lost or rotted directory is made whole from the other before the load."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_datastates import DataStatesReader, DataStatesSavePlanner, DataStatesWriter
from dcp_datastates.format.names import MANIFEST_NAME, TEMP_INFIX, data_file_save_id, replica_record_of
from dcp_datastates.replicas.records import ReplicaRecord
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import manifest_head
from dcp_datastates.replicas.group import ReplicaVote
from dcp_datastates.replicas.helper import SENDER_ENV
from dcp_datastates.replicas.records import read_record
from dcp_datastates.format.records import CommittedSave
from dcp_datastates.replicas.work import commit_on_node
from dcp_datastates.replicas.replicator import TIMEOUT_ENV
from tests import crashsim
from tests.dist import run_ranks
from tests.replica_jobs import (
    GROUP_TIMEOUT_S,
    HUNG_S,
    PER_NODE,
    _flat,
    _flip_middle,
    _hang_replication_once,
    _model,
    _state,
    _train,
)


def _dir(base: str, node: int) -> str:
    return os.path.join(base, f"node{node}", "ckpt")


def _records(path: str) -> set[int]:
    return {got[0] for n in os.listdir(path) if (got := replica_record_of(n))}


def _save(rank, world, base, mode, damage):
    node = rank // PER_NODE
    model, opt = _model(world)
    pg = dist.new_group(backend="gloo")  # DCP's async saves: a group apart from training's
    writers = []
    for step in (1, 2):  # the second save replaces the first on every node
        _train(model, opt, step)
        w = DataStatesWriter(_dir(base, node), replicas=1, node=f"n{node}", overwrite=True)
        writers.append(w)
        sd = _state(model, opt)
        sd["extra"]["step"] = step
        if mode == "sync":
            dcp.save(sd, storage_writer=w, process_group=pg)
        else:
            kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
            dcp.async_save(sd, storage_writer=w, process_group=pg, async_checkpointer_type=kind).result()
    mine = _dir(base, node)
    if mode == "process":  # replicated from DCP's checkpoint process: only the disk shows it
        last = manifest_head(StorageTier(_dir(base, 0))).save_id  # committed before result() returned
        want_records = {(node * PER_NODE + i, last) for i in range(PER_NODE)}
        deadline = time.monotonic() + 120
        while {got for n in os.listdir(mine) if (got := replica_record_of(n))} != want_records:
            assert time.monotonic() < deadline, os.listdir(mine)
            time.sleep(0.05)
    else:
        assert writers[-1].wait_replicated(120)
    want = _flat(_state(model, opt))
    dist.barrier()
    here = os.listdir(mine)
    assert MANIFEST_NAME in here  # committed on every node, not only the coordinator's
    assert _records(mine) == {node * PER_NODE + i for i in range(PER_NODE)}, here
    assert {int(n[6:11]) for n in here if n.startswith("data-r")} == set(range(world)), here  # own + replicas
    # the first save's files and records are gone from every node once the second replaced it
    saves = {data_file_save_id(n) for n in here if data_file_save_id(n)}
    assert len(saves) == 1 and {got[1] for n in here if (got := replica_record_of(n))} == saves, here
    if mode != "process":  # there the writer that saved is DCP's checkpoint process's copy
        assert saves == {writers[-1].save_id}, here
    dist.barrier()  # every node checked its directory before one is damaged
    if rank == 0:
        if damage == "delete":
            shutil.rmtree(_dir(base, 1))  # the node is gone, its NVMe with it
        else:  # node 1's own file of rank 2 rots; node 0 holds the good replica
            _flip_middle(os.path.join(_dir(base, 1), sorted(n for n in os.listdir(_dir(base, 1))
                                                     if n.startswith("data-r00002"))[0]))
    dist.barrier()
    _train(model, opt, 3)  # the state moves on; the load must bring step 2 back
    sd = _state(model, opt)
    dcp.load(sd, storage_reader=DataStatesReader(_dir(base, node), node_local=True, node=f"n{node}"),
             process_group=pg)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    have = _flat(_state(model, opt))
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(have[k], v), k
    assert sd["extra"]["step"] == 2


@pytest.mark.parametrize("mode,damage", [("sync", "delete"), ("thread", "corrupt"), ("process", "delete")])
def test_plain_dcp_saves_replicate_and_a_lost_node_loads_bit_exact(tmp_path, mode, damage):
    run_ranks(2 * PER_NODE, _save, str(tmp_path), mode, damage)
    assert sorted(os.listdir(_dir(str(tmp_path), 1)))  # made whole again before the load


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _late(rank, world, base, sender):
    os.environ[SENDER_ENV] = sender
    kept, logger = _Kept(), logging.getLogger("dcp_datastates")
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)  # the job logs at INFO: the helper's debug records stay unseen
    node = rank // PER_NODE
    model, opt = _model(world)
    w1 = DataStatesWriter(_dir(base, node), replicas=1, node=f"n{node}")
    assert w1.replication.replicator.in_helper == (sender == "process")
    held = threading.Event()
    w1.replication.replicator.order.queue(held.wait)  # the replicator is busy until both saves committed
    _train(model, opt, 1)
    dcp.save(_state(model, opt), storage_writer=w1)
    w2 = DataStatesWriter(_dir(base, node), replicas=1, node=f"n{node}", overwrite=True)
    _train(model, opt, 2)
    dcp.save(_state(model, opt), storage_writer=w2)
    held.set()  # save 1 replicates now, after save 2 committed on the coordinator's node
    assert w2.wait_replicated(60)
    dist.barrier()
    here = os.listdir(_dir(base, node))
    assert manifest_head(StorageTier(_dir(base, node))).save_id == w2.save_id, here
    assert {n for n in here if n.startswith("data-r")} == {
        n for r in range(world) for n in os.listdir(_dir(base, r // PER_NODE))
        if n.startswith(f"data-r{r:05d}-{w2.save_id}")}, here
    assert {int(n[6:11]) for n in here if n.startswith("data-r")} == set(range(world)), here
    # what replication logged reached this process's loggers, at the levels they show
    assert any("replicated to ranks" in r.getMessage() for r in kept.records), kept.records
    assert all(r.levelno >= logging.INFO for r in kept.records), [r.getMessage() for r in kept.records]


@pytest.mark.parametrize("sender", ["thread", "process"])
def test_a_save_replicated_late_never_replaces_a_newer_one(tmp_path, sender):
    """The replication of a save that runs after the next save committed (replication lags
    training) leaves the newer save's manifest and files in place on every node."""
    run_ranks(2 * PER_NODE, _late, str(tmp_path), sender)


class _Unsaveable:
    """A value msgpack cannot store (and pickle is not allowed): the save fails on its rank."""


def _failed_then_ok(rank, world, base):
    node = rank // PER_NODE
    model, opt = _model(world)
    _train(model, opt, 1)
    sd = _state(model, opt)
    if rank == 3:
        sd["extra"]["bad"] = _Unsaveable()
    w = DataStatesWriter(_dir(base, node), replicas=1, node=f"n{node}")
    with pytest.raises(CheckpointException, match=r"ranks:dict_keys\(\[3\]\)"):
        dcp.save(sd, storage_writer=w)
    assert not w.wait_replicated(60)  # nothing committed: nothing replicated, nobody waits
    failed = w.save_id
    dist.barrier()
    # nothing of it is left on any node, not even a rank's own files (it never committed)
    assert not any(failed in n for n in os.listdir(_dir(base, node))), os.listdir(_dir(base, node))
    # the next save through the same replicators is not wedged by the failed one
    w2 = DataStatesWriter(_dir(base, node), replicas=1, node=f"n{node}", overwrite=True)
    dcp.save(_state(model, opt), storage_writer=w2)
    assert w2.wait_replicated(60)
    dist.barrier()  # the node's other rank too
    assert _records(_dir(base, node)) >= {node * PER_NODE + i for i in range(PER_NODE)}


def test_a_failed_save_replicates_nothing_and_the_next_one_replicates(tmp_path):
    run_ranks(2 * PER_NODE, _failed_then_ok, str(tmp_path))


class _DiesBeforeCommit(DataStatesWriter):
    """The coordinator's process is killed after every rank wrote its files, before the commit."""

    def finish(self, metadata, results):
        os.kill(os.getpid(), signal.SIGKILL)


def _own_record(base: str, node: int, rank: int) -> ReplicaRecord:
    """This rank's replica record of the last save, once its replication ended (DCP's PROCESS
    mode: only the disk shows it).  The save is the one committed on the coordinator's node
    before ``result()`` returned; on the other nodes the replicator commits it later."""
    tier, save_id = StorageTier(_dir(base, node)), manifest_head(StorageTier(_dir(base, 0))).save_id
    deadline = time.monotonic() + 60
    while (rec := read_record(tier, rank, save_id)) is None:
        assert time.monotonic() < deadline, os.listdir(_dir(base, node))
        time.sleep(0.05)
    return rec


def _plain_peer_hangs(rank, world, base, mode):
    """Plain ``dcp.save`` / ``dcp.async_save`` with ``DataStatesWriter(replicas=1)``: rank 2's
    replication hangs past the replica group's timeout in the first save's exchange, then goes
    on.  That save is degraded on ranks 0 and 2; the next one, planned once every rank's
    replication is idle, makes the group again and is fully replicated on every rank.  In
    PROCESS mode the replicas are sent from DCP's checkpoint process, whose storage on rank 2
    hangs as the first replica of rank 0's file arrives (the wrapper ``tests/crashsim_site``
    installs there), and only the disk shows the outcome."""
    os.environ[TIMEOUT_ENV] = str(GROUP_TIMEOUT_S)
    if mode != "process":
        _hang_replication_once("thread", rank)
    elif rank == 2:
        plan = os.path.join(base, "plan")
        crashsim.wrap_spawned(plan)
        crashsim.arm(plan, "hang", 1, os.path.join(base, "ops"), match="create data-r00000-", hang_s=HUNG_S)
    node = rank // PER_NODE
    model, opt = _model(world)
    pg = dist.new_group(backend="gloo")
    outcome = []
    for step in (1, 2, 3):
        _train(model, opt, step)
        w = DataStatesWriter(_dir(base, node), replicas=1, node=f"n{node}", overwrite=True)
        if mode == "sync":
            dcp.save(_state(model, opt), storage_writer=w, process_group=pg)
        elif mode == "sync-cached":  # DCP's plan cache: the second and third saves replay the first's plan
            dcp.save(_state(model, opt), storage_writer=w, process_group=pg,
                     planner=DataStatesSavePlanner(enable_plan_caching=True))
        else:
            kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
            dcp.async_save(_state(model, opt), storage_writer=w, process_group=pg,
                           async_checkpointer_type=kind).result()
        outcome.append(_own_record(base, node, rank).complete if mode == "process" else w.wait_replicated(120))
        dist.barrier()  # every rank's replication is idle before the next save is planned
    assert outcome == [rank in (1, 3), True, True], (rank, outcome)
    assert _records(_dir(base, node)) == {node * PER_NODE + i for i in range(PER_NODE)}
    if mode == "process":
        crashsim.end_children()
    else:
        assert w.replication.replicator.vote() == ReplicaVote(1, False, True)


@pytest.mark.parametrize("mode", ["sync", "sync-cached", pytest.param("thread", marks=pytest.mark.slow), "process"])
def test_plain_saves_replicate_again_after_a_peer_hung(tmp_path, mode):
    run_ranks(4, _plain_peer_hangs, str(tmp_path), mode)


def _save_then_die(rank, world, base):
    node = rank // PER_NODE
    model, opt = _model(world)
    _train(model, opt, 1)
    w = DataStatesWriter(_dir(base, node), replicas=1, node=f"n{node}", overwrite=True)
    dcp.save(_state(model, opt), storage_writer=w)
    assert w.wait_replicated(60)
    _train(model, opt, 2)
    w = _DiesBeforeCommit(_dir(base, node), replicas=1, node=f"n{node}", overwrite=True)
    try:
        dcp.save(_state(model, opt), storage_writer=w)
    except Exception:  # noqa: BLE001 - the coordinator is gone; this rank dies too
        pass
    with open(os.path.join(base, f"dead-{rank}"), "w") as f:
        f.write(w.save_id)
    os.kill(os.getpid(), signal.SIGKILL)  # the whole job dies: no close, no teardown


def _save_after_death(rank, world, base):
    node = rank // PER_NODE
    model, opt = _model(world)
    _train(model, opt, 3)
    w = DataStatesWriter(_dir(base, node), replicas=1, node=f"n{node}", overwrite=True)
    dcp.save(_state(model, opt), storage_writer=w)
    assert w.wait_replicated(60)
    dist.barrier()  # every node committed and replicated the new save


def test_a_save_whose_job_died_is_removed_from_every_node_by_the_next(tmp_path):
    """A save whose every process died after writing (no replicator left to agree on its fate)
    leaves its files on each node; the next save's coordinator takes over its claim, and every
    node, not only the coordinator's, removes what that dead attempt wrote there."""
    base = str(tmp_path)
    with pytest.raises(AssertionError, match=r"exited with codes"):
        run_ranks(2 * PER_NODE, _save_then_die, base)
    dead = {open(os.path.join(base, f"dead-{r}")).read() for r in range(1, 2 * PER_NODE)}  # rank 0 died first
    assert len(dead) == 1, dead
    dead_id = dead.pop()
    for node in range(2):  # the dead attempt wrote on both nodes
        assert any(data_file_save_id(n) == dead_id for n in os.listdir(_dir(base, node))), node
    run_ranks(2 * PER_NODE, _save_after_death, base)
    head = manifest_head(StorageTier(_dir(base, 0)))
    for node in range(2):
        names = os.listdir(_dir(base, node))
        assert manifest_head(StorageTier(_dir(base, node))).save_id == head.save_id
        assert not [n for n in names if dead_id in n], (node, names)
        assert {data_file_save_id(n) for n in names} - {None} == {head.save_id}, (node, names)


def _save_four(rank, world, base):
    node = rank // PER_NODE
    model, opt = _model(world)
    _train(model, opt, 1)
    w = DataStatesWriter(_dir(base, node), replicas=1, node=f"n{node}")
    dcp.save(_state(model, opt), storage_writer=w)
    assert w.wait_replicated(60)
    want = _flat(_state(model, opt))
    if rank == 0:
        torch.save(want, os.path.join(base, "want.pt"))


def _load_on_one_node(rank, world, base):
    model, opt = _model(world)  # 2 ranks, both on node 0; node 1 is gone
    sd = _state(model, opt)
    dcp.load(sd, storage_reader=DataStatesReader(_dir(base, 0), node_local=True, node="n0"))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    have = _flat(_state(model, opt))
    for k, v in torch.load(os.path.join(base, "want.pt"), weights_only=True).items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(have[k], v), k


def test_one_node_fewer_loads_resharded_from_the_survivors_replicas(tmp_path):
    base = str(tmp_path)
    run_ranks(2 * PER_NODE, _save_four, base)
    shutil.rmtree(os.path.join(base, "node1"))
    run_ranks(PER_NODE, _load_on_one_node, base)  # 4 ranks' state onto 2, from node 0's copy alone


def _load_where_a_node_cannot_store(rank, world, base):
    """Node 1's directory is a plain file: its repair cannot store the manifest it is sent, so
    its ranks find no manifest.  DCP then asks their readers for rank-local metadata, on those
    ranks alone; a reader that surveyed the nodes again there (a collective) hung the job."""
    node = rank // PER_NODE
    model, opt = _model(world)
    t = time.monotonic()
    with pytest.raises(CheckpointException) as got:
        dcp.load(_state(model, opt), storage_reader=DataStatesReader(_dir(base, node), node_local=True,
                                                                     node=f"n{node}"))
    assert time.monotonic() - t < 60
    if node == 1:
        assert "does not exist" in str(got.value) or "not a directory" in str(got.value).lower(), got.value


def test_a_node_that_cannot_store_the_manifest_fails_the_load_on_every_rank(tmp_path):
    base = str(tmp_path)
    run_ranks(2 * PER_NODE, _save_four, base)
    shutil.rmtree(os.path.join(base, "node1"))
    with open(os.path.join(base, "node1"), "w") as f:
        f.write("not a directory")
    run_ranks(2 * PER_NODE, _load_where_a_node_cannot_store, base, timeout=120)


def test_a_nodes_commit_never_removes_another_ranks_manifest_in_progress(tmp_path):
    """Every rank of a node commits the step's manifest there (``Checkpointer``), possibly at
    the same moment: one's tidy-up of the replaced save must not take the other's temporary
    manifest for a leftover (the other's rename then failed, its replication never started,
    and its peer waited out the group's timeout)."""
    here, other = tmp_path / "run" / "node", tmp_path / "run" / "b"
    sd = {"w": torch.arange(4096, dtype=torch.float32)}
    dcp.save(sd, storage_writer=DataStatesWriter(str(here)), no_dist=True)
    old = manifest_head(StorageTier(str(here))).save_id
    dcp.save(sd, storage_writer=DataStatesWriter(str(other)), no_dist=True)
    new = manifest_head(StorageTier(str(other)))
    body = (other / MANIFEST_NAME).read_bytes()
    in_progress = here / f"{MANIFEST_NAME}{TEMP_INFIX}0123abcd"  # a neighbour rank's commit, not renamed yet
    in_progress.write_bytes(body)
    commit_on_node(StorageTier(str(here)), CommittedSave(new.save_id, body))
    assert manifest_head(StorageTier(str(here))).save_id == new.save_id
    assert in_progress.exists()
    assert not [n for n in os.listdir(here) if data_file_save_id(n) == old]  # the replaced save's files went


def _incremental_plain(rank, world, base):
    from tests.replica_jobs import _frozen_state
    node = rank // PER_NODE
    model, opt = _model(world)
    run = os.path.join(base, f"node{node}")
    for step in (1, 2):  # step 2 is incremental on step 1: it references step 1's frozen shards
        _train(model, opt, step)
        w = DataStatesWriter(os.path.join(run, f"step-{step}"), replicas=1, node=f"n{node}",
                             incremental_base="step-1" if step == 2 else None)
        dcp.save(_frozen_state(model, opt, world, step), storage_writer=w)
        assert w.wait_replicated(120)
    want = _flat(_frozen_state(model, opt, world, 2))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(base, "node1"))  # the node is gone, its NVMe with it
    dist.barrier()
    _train(model, opt, 3)
    sd = _frozen_state(model, opt, world, 0)
    sd["extra"]["frozen"] = torch.zeros_like(sd["extra"]["frozen"])
    dcp.load(sd, storage_reader=DataStatesReader(os.path.join(run, "step-2"), node_local=True, node=f"n{node}"))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    have = _flat(sd)
    for k, v in want.items():
        assert torch.equal(have[k], v) if isinstance(v, torch.Tensor) else have[k] == v, k


def test_plain_dcp_incremental_save_loads_after_its_node_is_lost(tmp_path):
    """``dcp.save`` with ``DataStatesWriter(incremental_base=...)``: the lost node is given the
    step's files and those it references in its base's directory, and ``dcp.load`` with
    ``DataStatesReader(node_local=True)`` is bit-exact."""
    run_ranks(2 * PER_NODE, _incremental_plain, str(tmp_path))
