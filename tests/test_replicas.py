"""Peer replicas of node-local checkpoints (issue 36): ``Checkpointer(..., replicas=K)``.

Nodes are simulated on one machine: 2 ranks per node, each node its own node-local directory,
node identity given to the checkpointer.  Every rank's files of a step land on another node;
after a node's directory is lost, the restore rebuilds it from the replicas and resumes from the
newest step, not the older one on the persistent tier (or from nothing else at all)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.format.manifest import decode_manifest, encode_manifest
from dcp_datastates.format.model import Chunk, Extent, Manifest, Span, TensorEntry, small_ranges
from dcp_datastates.format.names import (
    MANIFEST_NAME,
    data_file_name,
    data_file_save_id,
    replica_record_of,
)
from dcp_datastates.replicas.group import ReplicaGroup
from dcp_datastates.replicas.records import read_record
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.local import LocalBackend
from dcp_datastates.tiers.manifests import load_manifest, manifest_head
from tests.dist import run_ranks
from tests.replica_jobs import (
    PER_NODE,
    _assert_restored,
    _count_reads_and_gathers,
    _count_traffic_and_gathers,
    _first,
    _flat,
    _flip_middle,
    _frozen_state,
    _gathers,
    _killed,
    _model,
    _on_reads,
    _restore,
    _state,
    _tiers,
    _train,
)


@pytest.mark.parametrize("nodes,pfs", [pytest.param(2, True, id="2-nodes-with-pfs"),
                                       pytest.param(2, False, id="2-nodes-node-local-only"),
                                       pytest.param(4, False, id="4-nodes-node-local-only", marks=pytest.mark.slow)])
def test_a_lost_node_is_restored_from_its_replicas_at_the_newest_step(tmp_path, nodes, pfs):
    base = str(tmp_path)
    _killed(nodes * PER_NODE, base, pfs)
    shutil.rmtree(os.path.join(base, "node1"))  # the node is gone, its NVMe with it
    run_ranks(nodes * PER_NODE, _restore, base, pfs, 5, None, 1, _count_traffic_and_gathers)  # step 5, not 4
    # the replacement node holds no step: the others' heads of step 5 decide its save, and the
    # replica votes travel with them too
    assert _gathers(base) == [1] * (nodes * PER_NODE), _gathers(base)
    # what a rank receives to plan the repair grows with the step's file list, not with the
    # number of ranks times it: every node's listing (each file on 2 nodes, with its digest)
    # and what each rank reads and lacks come to about 7.5 lists on 4 nodes; each node's
    # leader sending its node's listing and the whole list, as before, came to 15 and grew
    # with every node added
    files = load_manifest(StorageTier(os.path.join(base, "node0", "step-5"))).files
    listed = len(pickle.dumps(files))
    traffic = [int(open(os.path.join(base, n)).read()) for n in os.listdir(base) if n.startswith("traffic-")]
    assert len(traffic) == nodes * PER_NODE and max(traffic) <= 10 * listed, (traffic, listed)
    # the replacement node got back its place, checked against the recorded digests: its own
    # ranks' files and its replicas of node 0's, not the whole step (rank 0's file also holds
    # the tensors DCP's dedup gave it, which every rank reads)
    got = {n for n in os.listdir(os.path.join(base, "node1", "step-5")) if data_file_save_id(n)}
    assert {int(n[6:11]) for n in got} == {0, 1, 2, 3}, got
    if nodes > 2:  # every node's copy still checks out: a node holds all the files of a rank or none
        from tests.clirun import cli
        for n in range(nodes):
            cli("verify", "--node-local", os.path.join(base, f"node{n}", "step-5"))
    if nodes > 2:  # its ranks' records again: a second node lost before the next save is restored too
        assert {replica_record_of(n)[0] for n in os.listdir(os.path.join(base, "node1", "step-5"))
                if replica_record_of(n)} == {2, 3}
        shutil.rmtree(os.path.join(base, "node2"))
        run_ranks((nodes - 1) * PER_NODE, _restore, base, pfs, 5, [n for n in range(nodes) if n != 2])


def test_every_node_lost_restores_the_persisted_step(tmp_path):
    """No node-local copy left anywhere: the repair finds nothing to repair and the restore
    reads the persisted step (4) from the persistent tier."""
    base = str(tmp_path)
    _killed(4, base, True)
    for node in (0, 1):
        shutil.rmtree(os.path.join(base, f"node{node}"))
    want = os.path.join(base, "want.pt")
    os.remove(want)  # step 5's state: step 4 is what comes back, checked by its step value
    run_ranks(4, _restore_persisted, base)


def _restore_persisted(rank, world, base, setup=None):
    node = rank // PER_NODE
    if setup is not None:
        setup(node, base)
    model, opt = _model(world)
    ckpt = Checkpointer(_tiers(base, node, True), node_local=True, persist_every=3, replicas=1,
                        node=f"n{node}", process_group=dist.new_group(backend="gloo"))
    sd = _state(model, opt)
    assert ckpt.load(sd) == 4
    assert sd["extra"]["step"] == 4
    ckpt.close()


def _cannot_store_the_manifest(node: int, base: str) -> None:
    """Node 1's disk fails every commit of a manifest (an I/O error at the storage seam)."""
    if node != 1:
        return
    real = LocalBackend.commit

    def commit(self, root, path, tmp_name, data, *, sync):
        if os.path.basename(path) == MANIFEST_NAME:
            raise OSError(errno.EIO, "Input/output error", path)
        return real(self, root, path, tmp_name, data, sync=sync)
    LocalBackend.commit = commit


def test_a_node_that_cannot_store_the_manifest_sent_to_it_leaves_no_rank_waiting(tmp_path):
    """Node 1 is replaced and its disk fails the manifest the repair sends it: the node still
    receives the bytes (its sender, and every move after, stays in step), its ranks are sent
    the step's file list instead of reading it from their node, step 5 cannot be read there
    (its manifest is nowhere they can read), and the restore comes from the persisted step 4
    on every rank, without waiting out the group's timeout."""
    base = str(tmp_path)
    _killed(4, base, True)
    shutil.rmtree(os.path.join(base, "node1"))
    os.remove(os.path.join(base, "want.pt"))  # step 5's state: step 4 comes back
    run_ranks(4, _restore_persisted, base, _cannot_store_the_manifest)
    assert not os.path.exists(os.path.join(base, "node1", "step-5", MANIFEST_NAME))


def test_a_restore_with_nothing_lost_reads_each_file_once(tmp_path):
    """Every node holds its files intact: the repair checks them by size and reads none, the
    load reads each byte once and checks it against its block digests (a copy found damaged
    then is repaired and read again: ``test_a_corrupt_copy_is_replaced_by_a_good_replica``)."""
    base = str(tmp_path)
    _killed(4, base, False)
    run_ranks(4, _restore, base, False, 5, None, 1, _count_reads_and_gathers)
    # the steps each rank holds, the save of its newest and its replica group's vote travel in
    # one all-gather when the restore starts (each is a ring over the whole job at scale)
    assert _gathers(base) == [1, 1, 1, 1], _gathers(base)
    # the repair's: every node's listing, what each rank reads; what each node lacks follows
    # from those on every rank (only a check of the copies' digests needs a third)
    assert _gathers(base, "repair") == [2, 2, 2, 2], _gathers(base, "repair")
    for node in (0, 1):
        step = os.path.join(base, f"node{node}", "step-5")
        read: dict[str, int] = {}
        for n in os.listdir(base):
            if n.startswith(f"reads-n{node}-"):
                for name, got in json.load(open(os.path.join(base, n))).items():
                    read[name] = read.get(name, 0) + got
        assert read, node
        for name, got in read.items():
            assert got <= os.path.getsize(os.path.join(step, name)), (node, name, got, read)


def test_a_corrupt_copy_is_replaced_by_a_good_replica(tmp_path):
    """Node 0's own copy of rank 0's data file rots; node 1's replica of it matches the digest
    recorded at replication, so the restore copies it over the bad one and loads step 5."""
    base = str(tmp_path)
    _killed(4, base, False)
    step = os.path.join(base, "node0", "step-5")
    bad = next(n for n in sorted(os.listdir(step)) if n.startswith("data-r00000-"))
    _flip_middle(os.path.join(step, bad))
    run_ranks(4, _restore, base, False, 5)
    with open(os.path.join(step, bad), "rb") as a, open(os.path.join(base, "node1", "step-5", bad), "rb") as b:
        assert a.read() == b.read()


def _unreadable_until_replaced(node: int, base: str) -> None:
    """Node 0's copy of rank 0's data file of step 5 fails every read with EIO (a bad sector)
    until another file is put in its place."""
    if node != 0:
        return
    step = os.path.join(base, "node0", "step-5")
    path = os.path.join(step, next(n for n in sorted(os.listdir(step)) if n.startswith("data-r00000-")))
    bad = os.stat(path).st_ino

    def seen(p: str, nbytes: int) -> None:
        if p == path and os.stat(path).st_ino == bad:
            raise OSError(errno.EIO, "Input/output error", path)
    _on_reads(seen)


def test_a_copy_that_cannot_be_read_is_replaced_by_a_good_replica(tmp_path):
    """Node 0's own copy of rank 0's data file fails its reads: the load's first reads fail, every
    node checks what its ranks read, the unreadable copy is replaced by node 1's replica and
    step 5 loads bit-exactly, in the same call."""
    base = str(tmp_path)
    _killed(4, base, False)
    step = os.path.join(base, "node0", "step-5")
    name = next(n for n in sorted(os.listdir(step)) if n.startswith("data-r00000-"))
    before = os.stat(os.path.join(step, name)).st_ino
    run_ranks(4, _restore, base, False, 5, None, 1, _unreadable_until_replaced)
    assert os.stat(os.path.join(step, name)).st_ino != before


def _restore_step_4(rank, world, base):
    """Restore step 4, which the persistent tier holds too, with node 0's copy of rank 0's data
    file of it rotted (done by the test before)."""
    node = rank // PER_NODE
    model, opt = _model(world)
    ckpt = Checkpointer(_tiers(base, node, True), node_local=True, persist_every=3, replicas=1,
                        node=f"n{node}", process_group=dist.new_group(backend="gloo"))
    sd = _state(model, opt)
    assert ckpt.load(sd, step=4) == 4
    assert sd["extra"]["step"] == 4
    ckpt.close()


def test_a_damaged_copy_read_from_the_persistent_tier_is_repaired_on_its_node(tmp_path):
    """Node 0's copy of a file of step 4 rots; the persistent tier holds step 4, so the load
    reads that file from there and succeeds; the node's copy is still replaced by the good
    replica, so that the next restore reads it from the node again."""
    base = str(tmp_path)
    _killed(4, base, True)
    step = os.path.join(base, "node0", "step-4")
    bad = next(n for n in sorted(os.listdir(step)) if n.startswith("data-r00000-"))
    _flip_middle(os.path.join(step, bad))
    run_ranks(4, _restore_step_4, base)
    with open(os.path.join(step, bad), "rb") as a, open(os.path.join(base, "node1", "step-4", bad), "rb") as b:
        assert a.read() == b.read()


def _reads_damaged(node: int, base: str) -> None:
    """Storage on nodes 0 and 2 whose copy of rank 2's data file of step 5 reads back damaged
    (a failing device; its size still right) in the first of their processes to read it."""
    if node not in (0, 2):
        return
    real, mine = StorageTier.read_into, []

    def read_into(self, name, offset, buf, **kw):
        got = real(self, name, offset, buf, **kw)
        if (name.startswith("data-r00002-") and self.url.endswith("step-5") and got
                and (mine or _first(os.path.join(base, "damaged")))):
            mine.append(name)
            buf[0] ^= 0xFF
        return got

    StorageTier.read_into = read_into


def test_a_replica_that_arrives_damaged_is_fetched_again_from_another_node(tmp_path):
    """3 nodes, 2 replicas: node 1 is lost, and the first node asked for rank 2's data file
    (which it keeps for others, so checks by size alone) sends it damaged; the replacement
    drops that copy and asks the other holder, then loads step 5 bit-exact."""
    base = str(tmp_path)
    _killed(3 * PER_NODE, base, False, replicas=2)
    shutil.rmtree(os.path.join(base, "node1"))
    run_ranks(3 * PER_NODE, _restore, base, False, 5, None, 2, _reads_damaged)
    assert os.path.exists(os.path.join(base, "damaged"))  # a damaged copy was sent
    step = os.path.join(base, "node1", "step-5")
    name = next(n for n in os.listdir(step) if n.startswith("data-r00002-"))
    with open(os.path.join(step, name), "rb") as a, open(os.path.join(base, "node2", "step-5", name), "rb") as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("nodes", [2, 4])
def test_one_node_fewer_restores_from_the_survivors_replicas(tmp_path, nodes):
    """The lost node is not replaced: the job restarts on the surviving nodes, which hold their
    own files and the replicas of the lost node's, and reshards onto the smaller world."""
    base = str(tmp_path)
    _killed(nodes * PER_NODE, base, False)
    shutil.rmtree(os.path.join(base, "node1"))
    survivors = [n for n in range(nodes) if n != 1]
    run_ranks(len(survivors) * PER_NODE, _restore, base, False, 5, survivors)


def _incremental_then_die(rank, world, base):
    node = rank // PER_NODE
    model, opt = _model(world)
    ckpt = Checkpointer(_tiers(base, node, False), node_local=True, incremental=True, keep=2, replicas=1,
                        node=f"n{node}", process_group=dist.new_group(backend="gloo"))
    ckpt.register_step_pre_hook(opt)
    for step in range(1, 6):
        _train(model, opt, step)
        fut = ckpt.save(step, _frozen_state(model, opt, world, step))
    fut.result()
    assert ckpt.wait_replicated(120)
    want = _flat(_frozen_state(model, opt, world, 5))  # collectives: every rank
    if rank == 0:
        torch.save(want, os.path.join(base, "want.pt"))
        referenced = load_manifest(StorageTier(os.path.join(base, "node0", "step-5"))).homes
        assert set(referenced.values()) == {"step-1"}, referenced  # the frozen shards, kept there
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _restore_incremental(rank, world, base, nodes):
    node = nodes[rank // PER_NODE]
    model, opt = _model(world)
    ckpt = Checkpointer(_tiers(base, node, False), node_local=True, incremental=True, keep=2, replicas=1,
                        node=f"n{node}", process_group=dist.new_group(backend="gloo"))
    sd = _frozen_state(model, opt, world, 0)
    sd["extra"]["frozen"] = torch.zeros_like(sd["extra"]["frozen"])
    assert ckpt.load(sd) == 5
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    have = _flat(sd)
    for k, v in torch.load(os.path.join(base, "want.pt"), weights_only=True).items():
        assert torch.equal(have[k], v) if isinstance(v, torch.Tensor) else have[k] == v, k
    ckpt.close()


@pytest.mark.parametrize("nodes,survivors", [(2, [0, 1]), (3, [0, 2])], ids=["replaced", "one-node-fewer"])
def test_a_lost_node_restores_an_incremental_step_with_the_files_it_references(tmp_path, nodes, survivors):
    """An incremental step reads the tensors it did not rewrite from an earlier step's files:
    the repair gives the lost node those too, not only the step's own, and the newest step
    comes back (before, every step after the first failed on the missing base files and the
    restore walked back to step 1)."""
    base = str(tmp_path)
    _killed(nodes * PER_NODE, base, False, fn=_incremental_then_die)
    shutil.rmtree(os.path.join(base, "node1"))
    run_ranks(len(survivors) * PER_NODE, _restore_incremental, base, survivors)
    if survivors == [0, 1]:  # the new node holds its place of step 1's referenced files again:
        # its ranks' and its copies of node 0's, each checked against a replica record that
        # retention kept with them when it purged step 1
        husk = os.listdir(os.path.join(base, "node1", "step-1"))
        assert {int(n[6:11]) for n in husk if data_file_save_id(n)} == {0, 1, 2, 3}, husk
        # and vouched for there by its ranks' records: node 0 lost next, node 1's copies serve
        assert {replica_record_of(n)[0] for n in husk if replica_record_of(n)} == {2, 3}, husk
        shutil.rmtree(os.path.join(base, "node0"))
        run_ranks(len(survivors) * PER_NODE, _restore_incremental, base, survivors)


def _one_rank_nodes(rank, world, base):
    """Four nodes of one rank each, one replica: node ``i`` holds rank ``i``'s files and rank
    ``i - 1``'s replica, and neither of the other two ranks' files."""
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.randn(world * 256, 64), mesh, [Shard(0)]), "step": 7}
    ckpt = Checkpointer(_tiers(base, rank, False), node_local=True, replicas=1, node=f"n{rank}",
                        process_group=dist.new_group(backend="gloo"), async_mode=None)
    ckpt.save(1, sd)
    assert ckpt.wait_replicated(60)
    ckpt.close()


def test_verify_and_inspect_a_nodes_copy_of_a_step(tmp_path):
    """``verify --node-local`` checks what a node holds (its rank's files and the replica it
    keeps) and names the ranks whose files are on other nodes; plain ``verify`` calls those
    missing and points to the flag.  Damage to a file the node holds, or a replica its record
    says it keeps gone, is still damage."""
    from tests.clirun import cli
    run_ranks(4, _one_rank_nodes, str(tmp_path))
    step = str(tmp_path / "node0" / "step-1")
    plain = cli("verify", step, check=False)
    assert plain.returncode == 1 and "--node-local" in plain.stdout, plain.stdout
    ok = cli("verify", "--node-local", step, check=False)
    assert ok.returncode == 0 and "rank(s) 1-2 are on other nodes" in ok.stdout, ok.stdout + ok.stderr
    got = json.loads(cli("verify", "--node-local", "--json", step).stdout)
    assert got["ok"] and got["ranks_elsewhere"] == [1, 2], got
    run = cli("verify", "--node-local", str(tmp_path / "node0"), check=False)  # the node's run directory
    assert run.returncode == 0, run.stdout
    hint = cli("inspect", step, check=False)
    assert hint.returncode != 0 and "pass --node-local" in hint.stderr, hint.stderr
    shown = cli("inspect", "--node-local", step, check=False)
    assert shown.returncode == 0 and "replicas: rank 0's files on rank(s) [1]" in shown.stdout, \
        shown.stdout + shown.stderr
    names = os.listdir(step)
    own = next(n for n in names if n.startswith("data-r00000-") and n.endswith(".dsd"))
    _flip_middle(os.path.join(step, own))  # this node's own data rots
    bad = cli("verify", "--node-local", step, check=False)
    assert bad.returncode == 1 and "checksum mismatch" in bad.stdout, bad.stdout
    _flip_middle(os.path.join(step, own))
    kept = next(n for n in names if n.startswith("data-r00003-") and n.endswith(".dsd"))
    os.remove(os.path.join(step, kept))  # the replica of rank 3 this node's record says it holds
    gone = cli("verify", "--node-local", step, check=False)
    assert gone.returncode == 1 and f"file {kept}: missing (rank 3 is on this node)" in gone.stdout, gone.stdout


def _small_items_save(rank, world, base, plain):
    """Four nodes of one rank, an FSDP2 model and Adam: each parameter's ``step`` counter is a
    plain tensor every rank holds, which DCP's dedup gives to one rank (DCP's planner spreads
    them over the ranks, ours gives them to the lowest); every rank reads every one."""
    model, opt = _model(world)
    _train(model, opt, 1)
    sd = _state(model, opt)
    if plain:
        import torch.distributed.checkpoint as dcp
        w = DataStatesWriter(os.path.join(base, f"node{rank}", "step-1"), replicas=1, node=f"n{rank}")
        dcp.save(sd, storage_writer=w)
        assert w.wait_replicated(60)
    else:
        ck = Checkpointer([os.path.join(base, f"node{rank}")], node_local=True, replicas=1, node=f"n{rank}",
                          async_mode=None, process_group=dist.new_group(backend="gloo"))
        ck.save(1, sd)
        assert ck.wait_replicated(60)
        ck.close()
    want = _flat(_state(model, opt))  # a collective: on every rank
    if rank == 0:
        torch.save(want, os.path.join(base, "want.pt"))
    os._exit(0)  # the replica group's threads: no teardown


def _small_items_load(rank, world, base, plain, cooperative="auto"):
    model, opt = _model(world)
    sd = _state(model, opt)
    if plain:
        import torch.distributed.checkpoint as dcp
        dcp.load(sd, storage_reader=DataStatesReader(os.path.join(base, f"node{rank}", "step-1"),
                                                     node_local=True, node=f"n{rank}", cooperative=cooperative))
    else:
        ck = Checkpointer([os.path.join(base, f"node{rank}")], node_local=True, replicas=1, node=f"n{rank}",
                          async_mode=None, process_group=dist.new_group(backend="gloo"))
        assert ck.load(sd) == 1
        ck.close()
    _assert_restored(model, opt, sd, base)
    os._exit(0)


def _data_writers(base: str, node: int) -> set[int]:
    return {int(n[6:11]) for n in os.listdir(os.path.join(base, f"node{node}", "step-1")) if n.startswith("data-r")}


@pytest.mark.parametrize("plain", [pytest.param(True, id="dcp.save-dcp.load"),
                                   pytest.param(False, id="Checkpointer")])
def test_a_node_is_never_given_whole_files_for_the_small_tensors_its_ranks_read(tmp_path, plain):
    """A node keeps its own ranks' files and its replicas of the previous node's, and nothing
    more: the small replicated tensors its ranks read from other ranks' files (an optimizer's
    step counters, which DCP's dedup writes on one rank each) come as those bytes alone, not
    as the whole files around them (at scale, every node would receive most of the step)."""
    base = str(tmp_path)
    run_ranks(4, _small_items_save, base, plain)
    places = {n: {n, (n - 1) % 4} for n in range(4)}
    assert {n: _data_writers(base, n) for n in range(4)} == places
    run_ranks(4, _small_items_load, base, plain)  # nothing lost
    assert {n: _data_writers(base, n) for n in range(4)} == places
    shutil.rmtree(os.path.join(base, "node2"))  # a node lost: it gets its places back, no more
    run_ranks(4, _small_items_load, base, plain)  # a plain reader takes the replicas from the save's records
    assert {n: _data_writers(base, n) for n in range(4)} == places
    node2 = StorageTier(os.path.join(base, "node2", "step-1"))
    rec = read_record(node2, 2, manifest_head(node2).save_id)  # written again, and true again
    assert rec is not None and rec.complete and rec.confirmed == [3] and set(rec.held) == {1}, rec


def _count_messages(base: str) -> None:
    """Tally this rank's point-to-point messages (sends and receives) and the bytes its
    all-reductions carry, during the load, into base/messages-RANK."""
    real = {n: getattr(ReplicaGroup, n) for n in ("send", "recv", "exchange", "all_reduce_max")
            if hasattr(ReplicaGroup, n)}
    path = os.path.join(base, f"messages-{dist.get_rank()}")
    seen = {"p2p": 0, "reduced": 0}

    def note() -> None:
        with open(path, "w") as f:
            json.dump(seen, f)

    def wrap(name, fn):
        def call(self, t, *args, **kw):
            if name == "all_reduce_max":
                seen["reduced"] += t.numel() * t.element_size()
            else:
                seen["p2p"] += 1
            note()
            return fn(self, t, *args, **kw)
        return call
    for name, fn in real.items():
        setattr(ReplicaGroup, name, wrap(name, fn))
    note()


def _small_items_counted_load(rank, world, base, plain):
    _count_messages(base)
    _small_items_load(rank, world, base, plain)


@pytest.mark.parametrize("plain", [pytest.param(True, id="dcp.save-dcp.load"),
                                   pytest.param(False, id="Checkpointer")])
def test_the_small_tensors_every_rank_reads_travel_in_collectives_not_per_rank_and_file(tmp_path, plain):
    """DCP's planner spreads the small replicated tensors (each parameter's Adam step) over the
    ranks, so at scale every rank reads such bytes from hundreds of files its node lacks (ours
    gives them to rank 0, whose file then every other node lacks).  A restore where no node
    lost anything sends them in all-reductions of the bytes some rank lacks (once, whatever
    the number of ranks), never in a message per rank and file: no rank sends or receives
    anything point-to-point, and what the reductions carry stays within a few times the small
    tensors' own bytes."""
    base = str(tmp_path)
    run_ranks(4, _small_items_save, base, plain)
    run_ranks(4, _small_items_counted_load, base, plain)
    seen = [json.load(open(os.path.join(base, f"messages-{r}"))) for r in range(4)]
    assert all(s["p2p"] == 0 for s in seen), seen
    m = load_manifest(StorageTier(os.path.join(base, "node0", "step-1")))
    small = sum(x.nbytes for x in small_ranges(m))
    assert 0 < small and all(0 < s["reduced"] <= 4 * small + 4096 for s in seen), (seen, small)
    assert {n: _data_writers(base, n) for n in range(4)} == {n: {n, (n - 1) % 4} for n in range(4)}


def test_the_small_ranges_a_repair_lends_are_whole_small_tensors_found_without_building_every_record():
    """The ranges every rank agrees on in the survey (``small_ranges``) are those of small
    tensors stored whole (a replicated step counter), never the shards of a sharded tensor,
    however small: a version 3 manifest of N ranks lists tensors x N chunks, and neither the
    survey's list nor the records built to find it may grow with all of them."""
    world = 4096
    files = {data_file_name(r, "0123456789ab", 0): 1 << 20 for r in range(world)}
    names = sorted(files)
    shards = [Chunk((4 * r,), (4,), Extent.contiguous(names[r], 0, 16, [bytes(16)])) for r in range(world)]
    step = Chunk((), (), Extent.contiguous(names[7], 64, 4, [bytes(16)]))
    m = Manifest("0123456789ab", world, list(range(world)), files,
                 {"w": TensorEntry("float32", (4 * world,), shards), "opt.step": TensorEntry("float32", (), [step])},
                 {}, {})
    m = decode_manifest(encode_manifest(m))  # as a load reads it: records built when asked for
    assert small_ranges(m) == (Span(names[7], 64, 4),)
    assert m.tensors["w"].lazy  # none of the shards' records was built


def _small_items_load_alone(rank, world, base):
    """Each rank reads for itself (``cooperative=False``): a cooperative load may have another
    rank read a block from its node's good copy and send it, and no rank meet the damage."""
    _small_items_load(rank, world, base, True, cooperative=False)


def test_small_tensor_bytes_lent_from_a_damaged_copy_are_refused_and_read_again_from_a_good_one(tmp_path):
    """Node 0's copy of rank 0's file, the first holder of the small tensors every rank reads
    (``Checkpointer``'s planner gives them to rank 0), has a flipped byte in one of them: the
    nodes that lack the file are lent the damaged bytes, their loads (plain ``dcp.load``)
    refuse them by the blocks' digests, and the same load replaces node 0's copy and gives
    the others the file whole, checked, from node 1's good copy; every rank restores the
    saved state."""
    base = str(tmp_path)
    run_ranks(4, _small_items_save, base, False)
    step = os.path.join(base, "node0", "step-1")
    spans = small_ranges(load_manifest(StorageTier(step)))
    assert spans and all(x.file.startswith("data-r00000-") for x in spans), spans
    with open(os.path.join(step, spans[0].file), "r+b") as f:
        f.seek(spans[0].offset)
        byte = f.read(1)
        f.seek(spans[0].offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())  # on the disk, where the load's direct reads take it from
    run_ranks(4, _small_items_load_alone, base)
    with open(os.path.join(step, spans[0].file), "rb") as f:
        f.seek(spans[0].offset)
        assert f.read(1) == byte  # node 0's copy was replaced by a good one
    # the nodes that read ranges of it took it whole in the checked fetch, from node 1
    assert {n: _data_writers(base, n) for n in range(4)} == {0: {0, 3}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 2, 3}}
