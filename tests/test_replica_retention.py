"""Peer replicas and retention (issue 36): steps go with their replicas, never from under a rank
that replicates them, the newest fully replicated step stays, borrowed ranges go with their
step, and a step saved again replaces the older save on every node."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_datastates import Checkpointer, DataStatesWriter
from dcp_datastates.format.names import (
    data_file_save_id,
    replica_record_of,
)
from dcp_datastates.replicas.helper import SENDER_ENV
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import manifest_head
from tests.dist import run_ranks
from tests.replica_jobs import (
    PER_NODE,
    _model,
    _state,
    _tiers,
    _train,
)


def _kept(rank, world, base):
    """Retention on a node-local tier with replicas: steps beyond ``keep`` go with their replica
    files and records; the steps kept still hold every rank's files and restore after a loss.
    Replicas sent from helper processes, which end with the checkpointer."""
    os.environ[SENDER_ENV] = "process"
    mesh = init_device_mesh("cpu", (world,))
    ckpt = Checkpointer(_tiers(base, rank // PER_NODE, False), node_local=True, replicas=1, keep=2,
                        node=f"n{rank // PER_NODE}", process_group=dist.new_group(backend="gloo"),
                        async_mode=None)
    for step in range(1, 5):
        ckpt.save(step, {"w": distribute_tensor(torch.full((64, 8), float(step)), mesh, [Shard(0)])})
        # replicated before the next save's purge: else that purge keeps one more step, the
        # newest the node fully replicated (test_retention_keeps_the_newest_fully_replicated_step)
        assert ckpt.wait_replicated(60)
    rep = ckpt.node_copies.replicator
    assert rep.in_helper
    ckpt.close()
    assert rep._work._proc.exitcode == 0  # the helper process ended with the checkpointer
    dist.barrier()
    here = os.path.join(base, f"node{rank // PER_NODE}")
    assert sorted(n for n in os.listdir(here) if n.startswith("step-")) == ["step-3", "step-4"], os.listdir(here)
    files = os.listdir(os.path.join(here, "step-4"))
    assert {int(n[6:11]) for n in files if n.startswith("data-r")} == set(range(world)), files
    assert len([n for n in files if replica_record_of(n)]) == PER_NODE, files


def test_retention_removes_old_steps_with_their_replicas(tmp_path):
    run_ranks(4, _kept, str(tmp_path))


def _neighbour_purges(rank, world, base):
    """Rank 1's replication of step 1 is slow (its storage holds the reads of its data file
    until rank 0 says go); meanwhile rank 0, on the same node, saves step 2 and its retention
    (``keep=1``) passes over step 1.  Step 1 stays until rank 1 is done with it, its replicas
    are complete, and a later pass removes it."""
    os.environ[SENDER_ENV] = "thread"  # the wrapped storage below lives in this process
    go = os.path.join(base, "go")
    if rank == 1:
        real = StorageTier.read_into

        def read_into(self, name, offset, buf, **kw):
            if name.startswith("data-r00001-") and self.url.endswith("node0/step-1"):
                deadline = time.monotonic() + 30
                while not os.path.exists(go) and time.monotonic() < deadline:
                    time.sleep(0.02)
            return real(self, name, offset, buf, **kw)
        StorageTier.read_into = read_into
    mesh = init_device_mesh("cpu", (world,))
    ckpt = Checkpointer(_tiers(base, rank // PER_NODE, False), node_local=True, replicas=1, keep=1,
                        node=f"n{rank // PER_NODE}", process_group=dist.new_group(backend="gloo"),
                        async_mode=None)
    for step in (1, 2):
        ckpt.save(step, {"w": distribute_tensor(torch.full((64, 8), float(step)), mesh, [Shard(0)])})
    if rank == 0:
        ckpt.retention.join()  # its pass after step 2 is over
        open(go, "w").close()
    assert ckpt.wait_replicated(60)  # step 1 too: nothing removed it under rank 1's sends
    dist.barrier()
    ckpt.save(3, {"w": distribute_tensor(torch.full((64, 8), 3.0), mesh, [Shard(0)])})
    ckpt.wait_replicated(60)
    ckpt.close()
    dist.barrier()
    here = os.path.join(base, f"node{rank // PER_NODE}")
    assert "step-1" not in os.listdir(here), os.listdir(here)  # a later pass removed it


def test_a_step_a_neighbour_rank_still_replicates_is_not_purged_under_it(tmp_path):
    run_ranks(4, _neighbour_purges, str(tmp_path))


def _newest_replicated_kept(rank, world, base):
    """``keep=1`` on the node-local tier while step 2 is still replicating (its reads slowed):
    step 1, the newest step every rank of the node has fully replicated, stays on the node
    until step 2 is replicated too; a node lost meanwhile still has a step its peers hold."""
    os.environ[SENDER_ENV] = "thread"  # the default; the wrapped storage below lives in this process
    import threading
    import time as _time

    from dcp_datastates.tiers import StorageTier
    slow = threading.Event()
    real = StorageTier.read_into

    def read_into(self, name, offset, buf, *, fd=None):
        if slow.is_set() and threading.current_thread().name == "dcpds-replicas":
            _time.sleep(0.5)
        return real(self, name, offset, buf, fd=fd)
    StorageTier.read_into = read_into
    mesh = init_device_mesh("cpu", (world,))
    ckpt = Checkpointer(_tiers(base, rank // PER_NODE, False), node_local=True, replicas=1, keep=1,
                        node=f"n{rank // PER_NODE}", process_group=dist.new_group(backend="gloo"),
                        async_mode=None)
    ckpt.save(1, {"w": distribute_tensor(torch.full((64, 8), 1.0), mesh, [Shard(0)])})
    assert ckpt.wait_replicated(60)
    dist.barrier()
    slow.set()
    ckpt.save(2, {"w": distribute_tensor(torch.full((64, 8), 2.0), mesh, [Shard(0)])})
    ckpt.wait_persisted(60)  # step 2 committed here, and a retention pass run
    here = os.path.join(base, f"node{rank // PER_NODE}")
    assert 2 in ckpt.node_copies.busy()
    assert os.path.isdir(os.path.join(here, "step-1")), os.listdir(here)
    dist.barrier()
    slow.clear()
    assert ckpt.wait_replicated(60)
    dist.barrier()
    ckpt.wait_persisted(60)  # now step 2 is the newest replicated: step 1 goes
    dist.barrier()
    assert not os.path.exists(os.path.join(here, "step-1")), os.listdir(here)
    ckpt.close()


def test_retention_keeps_the_newest_fully_replicated_step(tmp_path):
    run_ranks(4, _newest_replicated_kept, str(tmp_path))


def _step_then_die(rank, world, base):
    """Step 1 commits and replicates; step 2's coordinator is killed in DCP's ``finish``, after
    every rank wrote its files, and the other ranks die with it."""
    node = rank // PER_NODE
    model, opt = _model(world)
    ckpt = Checkpointer([os.path.join(base, f"node{node}")], node_local=True, replicas=1, node=f"n{node}",
                        async_mode=None)
    _train(model, opt, 1)
    ckpt.save(1, _state(model, opt))
    assert ckpt.wait_replicated(60)
    _train(model, opt, 2)
    if rank == 0:
        DataStatesWriter.finish = lambda *_a, **_k: os.kill(os.getpid(), signal.SIGKILL)  # dies before the commit
    try:
        ckpt.save(2, _state(model, opt))
    except Exception:  # noqa: BLE001 - the coordinator is gone; this rank dies too
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _step_again(rank, world, base):
    node = rank // PER_NODE
    model, opt = _model(world)
    ckpt = Checkpointer([os.path.join(base, f"node{node}")], node_local=True, replicas=1, node=f"n{node}",
                        async_mode=None)
    assert ckpt.load(_state(model, opt)) == 1
    _train(model, opt, 2)
    ckpt.save(2, _state(model, opt))  # the step the dead job did not commit, saved again
    assert ckpt.wait_replicated(60)
    dist.barrier()


def test_a_step_whose_job_died_is_saved_again_and_its_dead_files_go_on_every_node(tmp_path):
    """The restarted job saves the step the dead one did not commit into the same directories:
    on every node, not only the coordinator's, what the dead attempt wrote there is removed."""
    base = str(tmp_path)
    with pytest.raises(AssertionError, match=r"exited with codes"):
        run_ranks(2 * PER_NODE, _step_then_die, base)
    dead = {n: {data_file_save_id(f) for f in os.listdir(os.path.join(base, f"node{n}", "step-2"))} - {None}
            for n in range(2)}
    assert all(len(ids) == 1 for ids in dead.values()) and len(set().union(*dead.values())) == 1, dead
    dead_id = dead[0].pop()
    run_ranks(2 * PER_NODE, _step_again, base)
    for n in range(2):
        names = os.listdir(os.path.join(base, f"node{n}", "step-2"))
        assert not [f for f in names if dead_id in f], (n, names)


def _same_step_twice(rank, world, base):
    node = rank // PER_NODE
    model, opt = _model(world)
    ckpt = Checkpointer([os.path.join(base, f"node{node}")], node_local=True, replicas=1, node=f"n{node}",
                        async_mode=None)
    for step in (1, 2):
        _train(model, opt, step)
        ckpt.save(1, _state(model, opt))  # a job that rolled back saves step 1 again
        assert ckpt.wait_replicated(60)
    dist.barrier()
    heads = {n: manifest_head(StorageTier(os.path.join(base, f"node{n}", "step-1"))).save_id for n in range(2)}
    assert len(set(heads.values())) == 1, heads  # every node holds the newer save, not a mix
    names = os.listdir(os.path.join(base, f"node{node}", "step-1"))
    assert {data_file_save_id(f) for f in names} - {None} == {heads[0]}, names


def test_a_step_saved_again_replaces_the_older_save_on_every_node(tmp_path):
    run_ranks(2 * PER_NODE, _same_step_twice, str(tmp_path))


def _borrowed_then_purged(rank, world, base):
    model, opt = _model(world)
    ck = Checkpointer([os.path.join(base, f"node{rank}")], node_local=True, replicas=1, node=f"n{rank}", keep=1,
                      async_mode=None, process_group=dist.new_group(backend="gloo"))
    _train(model, opt, 1)
    ck.save(1, _state(model, opt))
    assert ck.wait_replicated(60)
    assert ck.load(_state(model, opt)) == 1
    dist.barrier()
    borrowed = [n for r in range(world) for n in os.listdir(os.path.join(base, f"node{r}", "step-1"))
                if n.startswith(".borrowed")]
    assert borrowed  # some rank read another node's small tensors as ranges
    for step in (2, 3):
        _train(model, opt, step)
        ck.save(step, _state(model, opt))
        assert ck.wait_replicated(60)
    ck.close()
    dist.barrier()
    # step 1 went whole (step 2 may stay: the newest fully replicated when step 3's save purged)
    assert "step-1" not in os.listdir(os.path.join(base, f"node{rank}")), os.listdir(os.path.join(base, f"node{rank}"))
    os._exit(0)


def test_retention_removes_the_ranges_a_load_borrowed_with_their_step(tmp_path):
    run_ranks(4, _borrowed_then_purged, str(tmp_path))
