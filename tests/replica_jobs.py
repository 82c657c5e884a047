"""What the replica tests share (a support module, not a test): the simulated nodes (2 ranks a
node, a directory each), the model and its state, a job that trains and saves then dies, a
restore that checks what it loaded, and counters of what a restore reads and gathers."""

from __future__ import annotations

import json
import os
import pickle
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

from dcp_datastates import Checkpointer
from dcp_datastates.format.names import (
    rank_file_of,
    replica_record_of,
)
from dcp_datastates.replicas.group import ReplicaGroup
from dcp_datastates.replicas.replicator import TIMEOUT_ENV
from dcp_datastates.tiers import StorageTier
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
        from tests.clirun import cli
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


def _flip_middle(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def _first(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _frozen_state(model, opt, world: int, step: int) -> dict:
    """The state with a tensor that never changes (a frozen embedding, sharded over the ranks):
    every incremental step after the first references step 1's copy of it."""
    sd = _state(model, opt)
    torch.manual_seed(7)
    sd["extra"] = {"step": step, "frozen": distribute_tensor(torch.randn(24576, 8),
                                                             init_device_mesh("cpu", (world,)), [Shard(0)])}
    return sd


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


def _lose_own_files(base: str, rank: int, step: int) -> None:
    """Remove ``rank``'s own files of ``step`` from its node's directory."""
    d = os.path.join(_tiers(base, rank // PER_NODE, False)[0], f"step-{step}")
    for n in os.listdir(d):
        if (got := rank_file_of(n)) is not None and got[0] == rank:
            os.remove(os.path.join(d, n))


def _record_of(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, next(n for n in os.listdir(step_dir)
                                       if (got := replica_record_of(n)) and got[0] == rank))


def _short_timeout(node: int, base: str) -> None:
    os.environ[TIMEOUT_ENV] = "20"  # a rank left waiting fails the test in seconds, not minutes
