"""Every crash point and every fault point of a rank's replication (issue 36), across ranks
and nodes: the multi-rank counterpart of ``tests/crashsim.py``, whose storage wrapper it uses.

Two nodes of two gloo ranks, each node its own directory, ``Checkpointer(node_local=True,
replicas=1)``.  Step 1 is saved and fully replicated; step 2 is saved and, while it replicates,
rank 2 (on node 1: it sends its files to rank 0 and receives rank 0's) dies right after its
replication thread's k-th storage operation (a crash point), or that operation fails with EIO
(a fault point), or takes effect and then reports EIO (mode "after", at the operations that
can: ``crashsim.AMBIGUOUS``), or every rank is killed there with the processes it started (the whole job,
as its launcher ends it), or node 1's two ranks are (the node lost, while node 0's ranks go
on with their save and its replication), for every k the thread makes.  Then fresh jobs restore: with both
nodes, with node 1's directory lost and with node 0's.  The invariants, at every point:

* with nothing lost, step 2 comes back bit-exactly (it committed on both nodes before it
  replicated);
* with a node lost, a step comes back bit-exactly, never one older than step 1 (fully
  replicated before), and never nothing;
* a step whose replication the point cut short is not reported fully replicated (with the
  whole job or a node killed, a step is taken as reported only where every rank reported it)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.errors import first_line
from dcp_datastates.replicas.helper import SENDER_ENV
from dcp_datastates.replicas.replicator import TIMEOUT_ENV
from tests import crashsim
from tests.dist import run_ranks

PER_NODE, WORLD, TARGET = 2, 4, 2
THREAD = "dcpds-replicas"


def _state(rank: int, step: int) -> dict:
    """Rank ``rank``'s state at ``step``: 6 MiB in two tensors (its replica is sent as two
    messages), a tensor that never changes (an incremental step references its first copy),
    and a value."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"w{rank}": torch.randn(1 << 20, generator=g), f"v{rank}": torch.randn(1 << 19, generator=g),
            f"c{rank}": torch.arange(1 << 14, dtype=torch.float32) + rank, "step": step}


def _template(rank: int) -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in _state(rank, 0).items()}


def _ckpt(base: str, node: int, incremental: bool = False) -> Checkpointer:
    """``incremental``: each step after the first references the unchanged tensor's bytes in
    step 1's directory, which ``keep=1`` purges into a husk kept for them."""
    more = {"incremental": True, "keep": 1} if incremental else {}
    return Checkpointer([os.path.join(base, f"node{node}")], node_local=True, replicas=1, node=f"n{node}",
                        async_mode=None, process_group=dist.new_group(backend="gloo"), **more)


class _Plain:
    """The same through plain DCP: ``dcp.save`` with ``DataStatesWriter(replicas=1)`` into each
    step's directory, whose manifest the replication thread commits on node 1, and ``dcp.load``
    with ``DataStatesReader(node_local=True)``, of step 2, else of step 1."""

    def __init__(self, base: str, node: int) -> None:
        self.base, self.node, self.writers = base, node, []

    def _dir(self, step: int) -> str:
        return os.path.join(self.base, f"node{self.node}", f"step-{step}")

    def save(self, step: int, state: dict) -> None:
        w = DataStatesWriter(self._dir(step), replicas=1, node=f"n{self.node}")
        self.writers.append(w)
        dcp.save(state, storage_writer=w)

    def wait_replicated(self, timeout: float) -> bool:
        return all([w.wait_replicated(timeout) for w in self.writers])

    def load(self, state: dict) -> int | None:
        for step in (2, 1):
            try:
                dcp.load(state, storage_reader=DataStatesReader(self._dir(step), node_local=True, node=f"n{self.node}"))
                return step
            except CheckpointException as e:  # every rank fails alike: the older step then
                logging.getLogger(__name__).warning("step %d: %s", step, first_line(e, 300))
        return None


def _job(kind: str, base: str, node: int):
    return _Plain(base, node) if kind == "plain" else _ckpt(base, node, kind == "incremental")


def _act(rank, world, base, kind, mode, k, err):
    """``kind`` "helper": every rank's replicas are sent from a helper process
    (``DCP_DATASTATES_REPLICA_SENDER=process``), and rank 2's helper, started with the plan's
    hook, is the one that dies or fails; rank 2 itself goes on."""
    node = rank // PER_NODE
    helper = kind == "helper"
    if mode == "node":  # node 0 goes on: a peer killed while a message is on its way is seen
        os.environ[TIMEOUT_ENV] = "20"  # only when the group's timeout ends
    folder = _join(base, mode)
    kill = "job" if mode == "node" else mode  # the node's processes alone are in the folder
    if helper:
        os.environ[SENDER_ENV] = "process"
        if rank == TARGET:  # the helper it starts takes the plan from the file written below
            crashsim.wrap_spawned(os.path.join(base, "plan.json"))
    elif rank == TARGET:
        crashsim.install()  # every local tier made from now on is counted
    job = _job(kind, base, node)
    job.save(1, _state(rank, 1))
    assert job.wait_replicated(60), "step 1 must replicate in full"
    dist.barrier()
    if rank == TARGET and helper:
        crashsim.arm(os.path.join(base, "plan.json"), kill, k, os.path.join(base, "helper-ops"), err, job=folder)
    elif rank == TARGET:
        crashsim.PLAN.log.clear()
        crashsim.PLAN.mode, crashsim.PLAN.k, crashsim.PLAN.err, crashsim.PLAN.thread = kill, k, err, THREAD
        crashsim.PLAN.job = folder
    try:
        job.save(2, _state(rank, 2))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - rank 2 may die before DCP's
        # last broadcast of the save reached every rank (its replication starts at the commit):
        # dcp.save then raises here although the step committed; the restores tell
        logging.getLogger(__name__).warning("step 2's save raised on rank %d: %s", rank, first_line(e, 200))
    ok = job.wait_replicated(120)
    report = os.path.join(base, f"replicated-{rank}")
    with open(report + ".tmp", "w") as f:  # whole or not at all: the job may be killed meanwhile
        f.write(json.dumps(ok))
    os.rename(report + ".tmp", report)
    if rank == TARGET and mode == "record":
        with open(os.path.join(base, "ops.json"), "w") as f:
            json.dump(_helper_ops(base) if helper else crashsim.PLAN.log, f)
    os._exit(0)  # rank 2 may be dead: no teardown collectives


def _join(base: str, mode: str) -> str | None:
    """Mode "job": the folder of the job's pids (``crashsim.kill_job``), this rank's written
    into it before any rank's point can come (every rank's first save is collective).  Mode
    "node": each node's folder of its ranks' pids; the target's node's is the one killed (a
    node lost: its ranks and the processes they started, while the other node goes on)."""
    if mode == "job":
        crashsim.join_job(folder := os.path.join(base, "job"))
    elif mode == "node":
        crashsim.join_job(os.path.join(base, f"job-node{dist.get_rank() // PER_NODE}"))
        folder = os.path.join(base, f"job-node{TARGET // PER_NODE}")
    else:
        return None
    dist.barrier()
    return folder


def _helper_ops(base: str) -> list[str]:
    """The storage operations rank 2's helper made under its plan (to the one it died after)."""
    path = os.path.join(base, "helper-ops")
    return open(path).read().splitlines() if os.path.exists(path) else []


def _restore(rank, world, base, kind, lowest):
    """A fresh job's restore of ``base``: a step at least ``lowest``, bit-exact."""
    assert _restored(rank, base, kind, lowest) is None
    os._exit(0)


def _restored(rank: int, base: str, kind: str, lowest: int) -> str | None:
    job = _job(kind, base, rank // PER_NODE)
    sd = _template(rank)
    got = job.load(sd)
    if got is None or got < lowest:
        return f"restored step {got}, wanted at least step {lowest}"
    want = _state(rank, got)
    if sd["step"] != got or not all(torch.equal(sd[k], v) for k, v in want.items() if k != "step"):
        return f"step {got} restored, but not bit-exact"
    return None


def _restores(rank, world, runs):
    """Several restores, one after the other in the same ranks (``runs``: base, kind, lowest);
    what went wrong in each is written beside it."""
    for base, kind, lowest in runs:
        try:
            why = _restored(rank, base, kind, lowest)
        except Exception as e:  # noqa: BLE001 - the violation is reported, the next restore runs
            why = first_line(e, 300)
        if why is not None:
            with open(os.path.join(base, f"violation-{rank}"), "w") as f:
                f.write(why)
    os._exit(0)


def _point(base: str, kind: str, mode: str, k: int, reachable: int, err: str = "EIO") -> list[str]:
    """One crash or fault point, then the restores; the invariants it broke.  A point past
    ``reachable`` may not be reached."""
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    codes = crashsim.ranks_at_point(WORLD, _act, base, kind, mode, k, err)
    where = f"{mode} at operation {k}"
    # a helper's death ends the helper, not its rank: the helper's own count tells
    reached = len(_helper_ops(base)) >= k if kind == "helper" else crashsim.CRASHED in codes
    if mode in ("crash", "job", "node") and not reached:
        return [] if k > reachable else [f"{where}: rank {TARGET} never reached it"]
    reports = {r: json.load(open(path)) for r in range(WORLD)
               if os.path.exists(path := os.path.join(base, f"replicated-{r}"))}
    bad = []
    if mode == "fault" and len(reports) < WORLD:
        bad.append(f"{where}: ranks {sorted(set(range(WORLD)) - set(reports))} never finished the step")
    # a step every living rank reports fully replicated survives the loss of any one node
    # (with the whole job or a node killed, only one every rank reported: each reports its own files)
    full = all(reports.values()) and (mode not in ("job", "node") or len(reports) == WORLD)
    saved = os.path.join(base, "saved")
    os.makedirs(saved)
    for n in (0, 1):
        shutil.move(os.path.join(base, f"node{n}"), os.path.join(saved, f"node{n}"))
    runs = []
    for lost, lowest in ((None, 2), (1, 2 if full else 1), (0, 2 if full else 1)):
        there = os.path.join(base, f"lost-{lost}")
        for n in (0, 1):
            if n != lost:
                shutil.copytree(os.path.join(saved, f"node{n}"), os.path.join(there, f"node{n}"))
        runs.append((there, kind, lowest))
    try:
        run_ranks(WORLD, _restores, runs, timeout=180)
    except AssertionError as e:
        bad.append(f"{where}: the restores did not end: {str(e).strip().splitlines()[-1][:300]}")
    for there, _kind, _lowest in runs:
        for r in range(WORLD):
            if os.path.exists(v := os.path.join(there, f"violation-{r}")):
                bad.append(f"{where} (replicated: {reports}), {os.path.basename(there)}, rank {r}: {open(v).read()}")
    return bad


def _operations(base: str, kind: str) -> list[str]:
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    crashsim.ranks_at_point(WORLD, _act, base, kind, "record", 0, "EIO")
    return json.load(open(os.path.join(base, "ops.json")))


# the Checkpointer's crash points, its whole job killed and its node lost at each, and plain
# DCP's crash points run in CI, the rest in ``make test-long``
@pytest.mark.parametrize("kind,mode", [("checkpointer", "crash"),
                                       pytest.param("checkpointer", "fault", marks=pytest.mark.slow),
                                       ("plain", "crash"),
                                       pytest.param("plain", "fault", marks=pytest.mark.slow),
                                       pytest.param("helper", "crash", marks=pytest.mark.slow),
                                       pytest.param("helper", "fault", marks=pytest.mark.slow),
                                       ("checkpointer", "job"),
                                       pytest.param("plain", "job", marks=pytest.mark.slow),
                                       pytest.param("helper", "job", marks=pytest.mark.slow),
                                       ("checkpointer", "node"),
                                       pytest.param("plain", "node", marks=pytest.mark.slow),
                                       pytest.param("helper", "node", marks=pytest.mark.slow),
                                       pytest.param("checkpointer", "after", marks=pytest.mark.slow),
                                       pytest.param("plain", "after", marks=pytest.mark.slow),
                                       pytest.param("helper", "after", marks=pytest.mark.slow)])
def test_every_crash_and_fault_point_of_a_replication_keeps_the_newest_whole_step(tmp_path, kind, mode):
    ops = _operations(str(tmp_path / "record"), kind)
    assert len(ops) >= 6, ops  # receive, keep and publish rank 0's files, and the record
    # each received file is put in place through the storage seam, so its rename is a point
    assert sum(op.startswith("rename data-r00000-") for op in ops) == 1, ops
    # a plain writer's manifest is committed on node 1 by whichever of its ranks comes first
    # (``replicas.commit_on_node``): rank 2's count may be one short of the recording's
    reachable = len(ops) - sum(op == "commit .metadata" for op in ops)
    plan, err = crashsim.plan_for(mode)
    bad = []
    for k in range(1, len(ops) + 1):
        if not crashsim.is_point(mode, ops[k - 1]):
            continue
        found = _point(base := str(tmp_path / f"{mode}-{k}"), kind, plan, k, reachable, err)
        bad += found
        if not found:  # tens of MB a point: only those that broke something are kept
            shutil.rmtree(base)
    assert not bad, "\n".join([f"{len(ops)} operations: {ops}", *bad])


def _saved_twice(rank, world, base, kind):
    job = _job(kind, base, rank // PER_NODE)
    for step in (1, 2):
        job.save(step, _state(rank, step))
        assert job.wait_replicated(60), f"step {step} must replicate in full"
    dist.barrier()
    os._exit(0)


def _repair(rank, world, base, kind, mode, k, err):
    """A restart on a replaced node 1: rank 2's repair of it (the storage operations of the
    replicator's thread, where a repair runs: the manifest received, its ranks' files and its
    replicas of node 0's, the records) under the plan.  This restore may fail at a fault point; the next one may not."""
    if rank == TARGET:
        crashsim.install()
    if mode == "node":  # node 1 lost again during its repair, node 0 going on (``_act``)
        os.environ[TIMEOUT_ENV] = "20"
    folder = _join(base, mode)
    job = _job(kind, base, rank // PER_NODE)
    if rank == TARGET:
        crashsim.PLAN.log.clear()
        crashsim.PLAN.mode, crashsim.PLAN.k, crashsim.PLAN.err = "job" if mode == "node" else mode, k, err
        crashsim.PLAN.thread, crashsim.PLAN.job = "dcpds-replicas", folder
    try:
        job.load(_template(rank))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - allowed at a fault point: the
        # check is the next restore
        logging.getLogger(__name__).warning("the restore under the plan failed: %s", first_line(e, 300))
    if rank == TARGET and mode == "record":
        crashsim.PLAN.mode = "off"
        with open(os.path.join(base, "ops.json"), "w") as f:
            json.dump(crashsim.PLAN.log, f)
    os._exit(0)


# the incremental repair's operations are the other's and then those of the directory it
# references: its crash points run in CI, with the whole job killed at the Checkpointer's
# repair's points and plain DCP's crash points; the rest in ``make test-long``
@pytest.mark.parametrize("kind,mode", [pytest.param("checkpointer", "crash", marks=pytest.mark.slow),
                                       pytest.param("checkpointer", "fault", marks=pytest.mark.slow),
                                       ("incremental", "crash"),
                                       pytest.param("incremental", "fault", marks=pytest.mark.slow),
                                       ("checkpointer", "job"),
                                       pytest.param("incremental", "job", marks=pytest.mark.slow),
                                       ("plain", "crash"),
                                       pytest.param("plain", "fault", marks=pytest.mark.slow),
                                       pytest.param("checkpointer", "node", marks=pytest.mark.slow),
                                       pytest.param("plain", "node", marks=pytest.mark.slow),
                                       pytest.param("checkpointer", "after", marks=pytest.mark.slow),
                                       pytest.param("incremental", "after", marks=pytest.mark.slow),
                                       pytest.param("plain", "after", marks=pytest.mark.slow)])
def test_every_crash_and_fault_point_of_a_repair_leaves_the_step_restorable(tmp_path, kind, mode):
    """Node 1 is replaced; its repair dies (or fails, or node 1 is lost again: mode "node") at
    each of rank 2's storage operations;
    a fresh job then restores step 2 bit-exactly from what is left (node 0 holds it all).
    ``incremental``: step 2 reads its unchanged tensor from step 1's directory, which the
    repair fills too."""
    golden = str(tmp_path / "golden")
    os.makedirs(golden)
    crashsim.ranks_at_point(WORLD, _saved_twice, golden, kind)
    shutil.rmtree(os.path.join(golden, "node1"))
    record = str(tmp_path / "record")
    shutil.copytree(golden, record)
    crashsim.ranks_at_point(WORLD, _repair, record, kind, "record", 0, "EIO")
    ops = json.load(open(os.path.join(record, "ops.json")))
    assert len(ops) >= 8, ops  # the manifest, node 1's ranks' files and node 0's, the records
    plan, err = crashsim.plan_for(mode)
    bad = []
    for k in range(1, len(ops) + 1):
        if not crashsim.is_point(mode, ops[k - 1]):
            continue
        base = str(tmp_path / f"{mode}-{k}")
        shutil.copytree(golden, base)
        try:
            codes = crashsim.ranks_at_point(WORLD, _repair, base, kind, plan, k, err)
        except AssertionError as e:  # a rank that failed or hung under the plan, not at its point
            bad.append(f"{mode} at operation {k} ({ops[k - 1]}): the restore under it: "
                       f"{str(e).strip().splitlines()[-1][:300]}")
            continue
        if mode in ("crash", "job", "node") and crashsim.CRASHED not in codes:
            # a directory both ranks of node 1 write into is made by whichever comes first: the
            # count may be one short of the recording's, every operation still a point
            if k <= len(ops) - sum(op.startswith("mkdir ") for op in ops):
                bad.append(f"{mode} at operation {k}: rank {TARGET} never reached it")
            continue
        try:
            run_ranks(WORLD, _restore, base, kind, 2, timeout=180)
        except AssertionError as e:
            bad.append(f"{mode} at operation {k} ({ops[k - 1]}): {str(e).strip().splitlines()[-1][:300]}")
            continue
        shutil.rmtree(base)  # tens of MB a point: only those that broke something are kept
    assert not bad, "\n".join([f"{len(ops)} operations: {ops}", *bad])
