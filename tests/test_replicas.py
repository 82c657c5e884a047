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
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.format.manifest import decode_manifest, encode_manifest
from dcp_datastates.format.model import Chunk, Extent, Manifest, Span, TensorEntry, small_ranges
from dcp_datastates.format.names import (
    MANIFEST_NAME,
    TEMP_INFIX,
    data_file_name,
    data_file_save_id,
    rank_file_of,
    replica_record_of,
)
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import load_manifest, manifest_head
from dcp_datastates.replicas.group import ReplicaGroup, ReplicaVote
from dcp_datastates.replicas.helper import SENDER_ENV
from dcp_datastates.replicas.records import read_record
from dcp_datastates.replicas.replicator import TIMEOUT_ENV
from tests.dist import run_ranks

PER_NODE = 2


def _model(world: int):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model, opt, step: int) -> None:
    torch.manual_seed(100 + step)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step": 0}}


def _flat(obj, out=None, prefix=""):
    out = {} if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flat(v, out, f"{prefix}{k}.")
    elif isinstance(obj, DTensor):
        out[prefix] = obj.full_tensor().clone()
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj.clone()
    else:
        out[prefix] = obj
    return out


def _tiers(base: str, node: int, pfs: bool) -> list[str]:
    here = os.path.join(base, f"node{node}")
    return [here, os.path.join(base, "pfs")] if pfs else [here]


def _train_and_save(rank, world, base, pfs, replicas=1):
    """Train 5 steps with an async save after each; once step 5 is replicated, SIGKILL."""
    node, n_nodes = rank // PER_NODE, world // PER_NODE
    model, opt = _model(world)
    pg = dist.new_group(backend="gloo")  # async saves: a group of their own, apart from training's
    ckpt = Checkpointer(_tiers(base, node, pfs), node_local=True, persist_every=3, replicas=replicas,
                        node=f"n{node}", process_group=pg)
    ckpt.register_step_pre_hook(opt)
    for step in range(1, 6):
        _train(model, opt, step)
        sd = _state(model, opt)
        sd["extra"]["step"] = step
        fut = ckpt.save(step, sd)
    fut.result()  # the last step commits: its replication starts then, not at the next save
    mine = os.path.join(_tiers(base, node, pfs)[0], "step-5")
    deadline = time.monotonic() + 60
    while not any((got := replica_record_of(n)) and got[0] == rank for n in os.listdir(mine)):
        assert time.monotonic() < deadline, os.listdir(mine)
        time.sleep(0.05)
    assert ckpt.wait_replicated(120)
    ckpt.wait_persisted(120)
    want = _flat(_state(model, opt))
    if rank == 0:
        torch.save(want, os.path.join(base, "want.pt"))
    dist.barrier()
    # every rank's files of step 5 are on its own node and on the next one
    here = os.listdir(mine)
    records = {replica_record_of(n)[0] for n in here if replica_record_of(n)}
    assert records == {node * PER_NODE + i for i in range(PER_NODE)}, here
    writers = {int(n[6:11]) for n in here if n.startswith("data-r")}
    assert writers == {r for r in range(world)
                       if r // PER_NODE in {(node - k) % n_nodes for k in range(replicas + 1)}}, here
    if rank == 0 and n_nodes == 2:  # inspect says where the copies are (with more nodes, a node's
        # directory lacks other ranks' parts, which inspect of a format 4 step reads)
        from tests.test_cli import cli
        last = (n_nodes - 1) * PER_NODE
        info = json.loads(cli("inspect", mine, "--json").stdout)
        assert {r["rank"]: (r["confirmed_by"], r["complete"], r["holds_files_of"]) for r in info["replicas"]} \
            == {0: ([2], True, [last]), 1: ([3], True, [last + 1])}, info["replicas"]
        assert "replicas: rank 0's files on rank(s) [2] (complete" in cli("inspect", mine).stdout
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # the job dies: no close, no teardown


def _killed(world: int, base: str, pfs: bool, replicas: int = 1, fn=None) -> None:
    with pytest.raises(AssertionError, match=r"exited with codes \[" + ", ".join(["-9"] * world) + r"\]"):
        if fn is None:
            run_ranks(world, _train_and_save, base, pfs, replicas)
        else:
            run_ranks(world, fn, base)


def _restore(rank, world, base, pfs, expect, nodes=None, replicas=1, setup=None):
    """Restart on ``world`` ranks, rank ``r`` on node ``nodes[r // 2]`` (default: ``r // 2``);
    ``setup(node, base)`` first, in the rank's process."""
    node = (nodes or list(range(world // PER_NODE)))[rank // PER_NODE]
    if setup is not None:
        setup(node, base)
    model, opt = _model(world)
    ckpt = Checkpointer(_tiers(base, node, pfs), node_local=True, persist_every=3, replicas=replicas,
                        node=f"n{node}", process_group=dist.new_group(backend="gloo"))
    sd = _state(model, opt)
    got = ckpt.load(sd)
    assert got == expect, got
    _assert_restored(model, opt, sd, base)
    assert sd["extra"]["step"] == expect
    ckpt.close()


def _count_traffic_and_gathers(node: int, base: str) -> None:
    _count_repair_traffic(node, base)
    _count_gathers(node, base, repair=False)  # the traffic's own count wraps the repair's gathers


def _assert_restored(model, opt, sd: dict, base: str) -> None:
    """The loaded ``sd`` put into the model and optimizer equals the state saved in base/want.pt."""
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    want = torch.load(os.path.join(base, "want.pt"), weights_only=True)
    have = _flat(_state(model, opt))
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(have[k], v), k


def _count_repair_traffic(node: int, base: str) -> None:
    """Tally the bytes this rank receives through the repair's object collectives (an
    all-gather brings every rank's object, each padded to the largest), into base/traffic-PID."""
    real_gather, real_bcast = ReplicaGroup.all_gather_object, ReplicaGroup.broadcast_object
    total = [0]
    path = os.path.join(base, f"traffic-{os.getpid()}")

    def from_repair() -> bool:
        return sys._getframe(2).f_globals.get("__name__", "").endswith(".replicas.repair")

    def note(n: int) -> None:
        total[0] += n
        with open(path, "w") as f:
            f.write(str(total[0]))

    def gather(self, obj):
        out = real_gather(self, obj)
        if from_repair():
            note(len(out) * max(len(pickle.dumps(x)) for x in out))
        return out

    def bcast(self, obj, src):
        out = real_bcast(self, obj, src)
        if from_repair():
            note(len(pickle.dumps(out)))
        return out
    ReplicaGroup.all_gather_object, ReplicaGroup.broadcast_object = gather, bcast


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
        from tests.test_cli import cli
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
    """Node 1's disk fails every write of a manifest sent to it (an I/O error)."""
    if node != 1:
        return
    real = StorageTier.open_sink

    def open_sink(self, name, *args, **kw):
        if name.startswith(MANIFEST_NAME + TEMP_INFIX):
            raise OSError(errno.EIO, "Input/output error", name)
        return real(self, name, *args, **kw)
    StorageTier.open_sink = open_sink


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


def _on_reads(seen) -> None:
    """Call ``seen(path, nbytes)`` before every read this process makes from a stored file:
    through the storage seam (``StorageTier.read_into``: the repair's hashing and sending, the
    reader's batched small reads) and through the reader's open descriptors (``read_range``)."""
    from dcp_datastates.load import files as loading_files
    real_into, real_range = StorageTier.read_into, loading_files.read_range

    def read_into(self, name, offset, buf, **kw):
        seen(os.path.join(self.url, name), memoryview(buf).nbytes)
        return real_into(self, name, offset, buf, **kw)

    def read_range(fd, offset, mv, *args, **kw):
        seen(os.readlink(f"/proc/self/fd/{fd}"), mv.nbytes)
        return real_range(fd, offset, mv, *args, **kw)

    StorageTier.read_into, loading_files.read_range = read_into, read_range


def _count_reads(node: int, base: str) -> None:
    """Tally the bytes this rank asks of its node's copy of step 5's data files, per file, into
    base/reads-n<node>-<pid> (JSON)."""
    tally: dict[str, int] = {}
    out, step = os.path.join(base, f"reads-n{node}-{os.getpid()}"), os.path.join(base, f"node{node}", "step-5")

    def seen(path: str, nbytes: int) -> None:
        if os.path.dirname(path) == step and os.path.basename(path).startswith("data-"):
            tally[os.path.basename(path)] = tally.get(os.path.basename(path), 0) + nbytes
            with open(out, "w") as f:
                json.dump(tally, f)
    _on_reads(seen)


def _count_gathers(node: int, base: str, repair: bool = True) -> None:
    """Note each all-gather of objects a restore makes to find its step, its save and its
    replica votes over the load's group (``run.steps``, ``replicas.replicator``: "steps") and for
    its repair over the replica group (``replicas.repair``: "repair"), a line per call, into
    base/gathers-PID."""
    real, real_group = dist.all_gather_object, ReplicaGroup.all_gather_object
    path = os.path.join(base, f"gathers-{os.getpid()}")

    def note(what: str) -> None:
        with open(path, "a") as f:
            f.write(what + "\n")

    def called_from(*modules: str) -> bool:  # the caller, or the caller of process_state's helper
        caller = sys._getframe(2)  # 0: here, 1: the wrapper below, 2: its caller
        if caller.f_globals.get("__name__", "").endswith(".process_state") and caller.f_back is not None:
            caller = caller.f_back
        first = caller.f_globals.get("__name__", "")
        return first.endswith(modules)

    def gather(*args, **kwargs):
        if called_from(".run.steps", ".replicas.replicator"):
            note("steps")
        return real(*args, **kwargs)

    def group_gather(self, obj):
        if called_from(".replicas.repair"):
            note("repair")
        return real_group(self, obj)
    dist.all_gather_object = gather
    if repair:
        ReplicaGroup.all_gather_object = group_gather


def _gathers(base: str, what: str = "steps") -> list[int]:
    return sorted(open(os.path.join(base, n)).read().split().count(what)
                  for n in os.listdir(base) if n.startswith("gathers-"))


def _count_reads_and_gathers(node: int, base: str) -> None:
    _count_reads(node, base)
    _count_gathers(node, base)


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


def _flip_middle(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


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


def _first(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


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


def _frozen_state(model, opt, world: int, step: int) -> dict:
    """The state with a tensor that never changes (a frozen embedding, sharded over the ranks):
    every incremental step after the first references step 1's copy of it."""
    sd = _state(model, opt)
    torch.manual_seed(7)
    sd["extra"] = {"step": step, "frozen": distribute_tensor(torch.randn(24576, 8),
                                                             init_device_mesh("cpu", (world,)), [Shard(0)])}
    return sd


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


HUNG_S, GROUP_TIMEOUT_S = 8, 4  # a peer hangs twice as long as the replica group waits


def _hang_replication_once(sender: str, rank: int, seconds: float = HUNG_S) -> None:
    """Rank 2's replication thread stops for ``seconds`` at its first read of a data file to
    send (a stuck disk), then goes on."""
    import threading

    if rank != 2 or sender != "thread":
        return
    real, hung = StorageTier.read_into, []

    def read_into(self, name, offset, buf, *, fd=None):
        if threading.current_thread().name == "dcpds-replicas" and name.startswith("data-") and not hung:
            hung.append(name)
            time.sleep(seconds)
        return real(self, name, offset, buf, fd=fd)
    StorageTier.read_into = read_into


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


def _lose_own_files(base: str, rank: int, step: int) -> None:
    """Remove ``rank``'s own files of ``step`` from its node's directory."""
    d = os.path.join(_tiers(base, rank // PER_NODE, False)[0], f"step-{step}")
    for n in os.listdir(d):
        if (got := rank_file_of(n)) is not None and got[0] == rank:
            os.remove(os.path.join(d, n))


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
    from tests.test_cli import cli
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
    from dcp_datastates.replicas import group as replica_group
    from dcp_datastates.format.records import CommittedSave
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


def _record_of(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, next(n for n in os.listdir(step_dir)
                                       if (got := replica_record_of(n)) and got[0] == rank))


def _short_timeout(node: int, base: str) -> None:
    os.environ[TIMEOUT_ENV] = "20"  # a rank left waiting fails the test in seconds, not minutes


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
