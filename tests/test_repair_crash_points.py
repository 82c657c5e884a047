"""Every crash point and every fault point of a node-local restore's repair where ranks borrow
byte ranges and where the world shrank (issue 36), with ``tests/crashsim.py``'s storage wrapper.

Three nodes of one gloo rank, each node its own directory, ``Checkpointer(node_local=True,
replicas=1)``: node ``i`` keeps rank ``i``'s files and its replica of rank ``i - 1``'s.  The
state is a tensor sharded over the ranks (DTensor), a small tensor every rank holds (DCP's
dedup has rank 0 write it, and every rank reads it) and a value.  Steps 1 and 2 are saved and
fully replicated, then node 1's directory is lost, and a fresh job restores:

* ``replaced``: on three nodes again, node 1 replaced by an empty one.  Rank 1's repair is
  given back its files and its replica of rank 0's; rank 2, whose node lacks rank 0's file and
  keeps no place for it, clears what an earlier load borrowed and borrows the small tensor's
  bytes into its borrowed directory again.
* ``fewer``: on the two nodes left, two ranks (resharding): node 0 is given rank 1's file (it
  reads part of it) from node 2, and rank 1, on node 2, borrows the small tensor's bytes.

During that restore one rank (``target``) dies right after its k-th storage operation (a crash
point), or that operation fails with EIO (a fault point), or takes effect and then reports EIO
(mode "after", where it can: ``crashsim.AMBIGUOUS``), or every rank is killed there (the whole
job), for every k.  The invariant at every point: a fresh job of the same shape then
restores step 2 bit-exactly, from what the point left (node 0 and node 2 hold all of it)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_datastates import Checkpointer
from dcp_datastates.errors import first_line
from tests import crashsim
from tests.dist import run_ranks

SAVED_NODES = 3
NODES = {"replaced": [0, 1, 2], "fewer": [0, 2]}  # each shape's node of each rank
BORROWS = {("replaced", 2), ("fewer", 1)}  # the rank whose node lacks rank 0's file
ROWS = 6 * 4096  # rows of the sharded tensor: whole shards on 3 ranks and on 2


def _full(step: int) -> torch.Tensor:
    return torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(step))


def _state(step: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(_full(step), mesh, [Shard(0)]), "count": torch.full((8,), float(step)),
            "step": step}


def _template(world: int) -> dict:
    sd = _state(0, world)
    sd["w"].to_local().zero_()
    sd["count"].zero_()
    sd["step"] = -1
    return sd


def _ckpt(base: str, node: int) -> Checkpointer:
    return Checkpointer([os.path.join(base, f"node{node}")], node_local=True, replicas=1, node=f"n{node}",
                        async_mode=None, process_group=dist.new_group(backend="gloo"))


def _saved_twice(rank, world, base):
    """Steps 1 and 2, fully replicated; then a restore with nothing lost, which leaves rank 2's
    borrowed ranges of step 2 on node 2 (the next load there clears them first)."""
    ck = _ckpt(base, rank)
    for step in (1, 2):
        ck.save(step, _state(step, world))
        assert ck.wait_replicated(60), f"step {step} must replicate in full"
    assert ck.load(_template(world)) == 2
    dist.barrier()
    os._exit(0)  # the replica group's threads: no teardown collectives


def _restored(rank: int, world: int, base: str, shape: str) -> str | None:
    """A restore of ``base`` on ``shape``'s nodes: what is wrong with it (None: step 2, bit-exact)."""
    ck = _ckpt(base, NODES[shape][rank])
    sd = _template(world)
    got = ck.load(sd)
    full = sd["w"].full_tensor()  # a collective: every rank gets here
    if got != 2:
        return f"restored step {got}, wanted step 2"
    if sd["step"] != 2 or not torch.equal(full, _full(2)) or not torch.equal(sd["count"], torch.full((8,), 2.0)):
        return "step 2 restored, but not bit-exact"
    return None


def _repair(rank, world, base, shape, target, mode, k, err="EIO"):
    """The restore of a job of ``shape`` under the plan: rank ``target``'s k-th storage
    operation is its point.  It may fail at a fault point; the next restore may not."""
    if rank == target:
        crashsim.install()
    folder = None
    if mode == "job":
        crashsim.join_job(folder := os.path.join(base, "job"))
        dist.barrier()
    if rank == target:
        crashsim.PLAN.log.clear()
        crashsim.PLAN.mode, crashsim.PLAN.k, crashsim.PLAN.err, crashsim.PLAN.job = mode, k, err, folder
    try:
        why = _restored(rank, world, base, shape)
    except Exception as e:  # noqa: BLE001 - allowed at a fault point: the check is the next restore
        why = first_line(e, 300)
    if rank == target and mode == "record":
        crashsim.PLAN.mode = "off"
        with open(os.path.join(base, "ops.json"), "w") as f:
            json.dump(crashsim.PLAN.log, f)
        assert why is None, why
    if why is not None:
        logging.getLogger(__name__).warning("the restore under the plan: %s", why)
    os._exit(0)


def _restore(rank, world, base, shape):
    why = _restored(rank, world, base, shape)
    assert why is None, why
    os._exit(0)


def _borrowed(base: str) -> list[str]:
    return [f"node{n}/{d}" for n in range(SAVED_NODES) if os.path.isdir(s := os.path.join(base, f"node{n}", "step-2"))
            for d in os.listdir(s) if d.startswith(".borrowed")]


# the crash points of the borrowing ranks and of node 0's, given a file when the world shrank,
# run in CI (4 to 8 operations each), and the whole job killed at the replaced node's
# borrowing rank's; the rest in ``make test-long``
@pytest.mark.parametrize("shape,target,mode", [
    ("replaced", 2, "crash"),
    pytest.param("replaced", 2, "fault", marks=pytest.mark.slow),
    ("replaced", 2, "job"),
    pytest.param("replaced", 1, "crash", marks=pytest.mark.slow),
    pytest.param("replaced", 1, "fault", marks=pytest.mark.slow),
    ("fewer", 0, "crash"),
    pytest.param("fewer", 0, "fault", marks=pytest.mark.slow),
    ("fewer", 1, "crash"),
    pytest.param("fewer", 1, "job", marks=pytest.mark.slow),
    pytest.param("replaced", 2, "after", marks=pytest.mark.slow),
    pytest.param("replaced", 1, "after", marks=pytest.mark.slow),
    pytest.param("fewer", 0, "after", marks=pytest.mark.slow)])
def test_every_crash_and_fault_point_of_a_repair_with_borrows_leaves_the_step_restorable(tmp_path, shape, target,
                                                                                         mode):
    world = len(NODES[shape])
    golden = str(tmp_path / "golden")
    os.makedirs(golden)
    run_ranks(SAVED_NODES, _saved_twice, golden, timeout=180)
    shutil.rmtree(os.path.join(golden, "node1"))
    if shape == "fewer":
        os.makedirs(os.path.join(golden, "node1"))  # not used by the job: it stays empty
    record = str(tmp_path / "record")
    shutil.copytree(golden, record)
    crashsim.ranks_at_point(world, _repair, record, shape, target, "record", 0)
    ops = json.load(open(os.path.join(record, "ops.json")))
    assert _borrowed(record), "a rank borrowed the small tensor's bytes"
    if (shape, target) in BORROWS:  # its points are those of the ranges it stores
        assert f"mkdir .borrowed.rank-{target:05d}" in ops, ops
    else:  # those of the whole files its node is given
        assert any(op.startswith("rename data-") for op in ops), ops
    plan, err = crashsim.plan_for(mode)
    bad = []
    for k in range(1, len(ops) + 1):
        if not crashsim.is_point(mode, ops[k - 1]):
            continue
        base = str(tmp_path / f"{mode}-{k}")
        shutil.copytree(golden, base)
        try:
            codes = crashsim.ranks_at_point(world, _repair, base, shape, target, plan, k, err)
        except AssertionError as e:  # a rank that failed or hung under the plan, not at its point
            bad.append(f"{mode} at operation {k} ({ops[k - 1]}): the restore under it: "
                       f"{str(e).strip().splitlines()[-1][:300]}")
            continue
        if mode in ("crash", "job") and crashsim.CRASHED not in codes:
            bad.append(f"{mode} at operation {k}: rank {target} never reached it")
            continue
        try:
            run_ranks(world, _restore, base, shape, timeout=180)
        except AssertionError as e:
            bad.append(f"{mode} at operation {k} ({ops[k - 1]}): {str(e).strip().splitlines()[-1][:300]}")
            continue
        shutil.rmtree(base)  # only the points that broke something are kept
    assert not bad, "\n".join([f"{len(ops)} operations: {ops}", *bad])
