"""Every crash point and every fault point of one rank in a collective save, across ranks: the
multi-rank counterpart of ``tests/crashsim.py``, whose storage wrapper it uses.

Two gloo ranks save into one shared directory (a parallel file system's, as both ranks see it).
A first save is committed; then, while every rank saves again, one rank (the coordinator, rank
0, which also commits the manifest and runs retention, or rank 1) dies right after its k-th
storage operation (any of its threads: a crash point), or that operation fails with EIO (a
fault point), or takes effect and then reports EIO (a commit's rename done, a directory made
or a file removed: ``crashsim.AMBIGUOUS``), or the whole job is killed there (every rank and every process they started, by
SIGKILL, as a launcher ends a job when a node fails: no rank cleans up after its save), for
every k it makes.  Then a fresh 2-rank job checks:

* every directory with a committed manifest loads bit-exactly as a state saved there;
* the newest loadable state is never older than the one committed before, and is the new one
  wherever every rank's save returned;
* a ``Checkpointer`` restores a step at least that new (step 3 after a fault point),
  bit-exactly;
* once the fresh job saved again (and, with a ``Checkpointer``, ran a retention pass once that
  save is durable everywhere: until then a node keeps its files of the newest durable step,
  committed there or not, for that step's restore), nothing of the dead or failed attempt is
  left (a data file or part no manifest references, a temp file, a claim).

``checkpointer``: ``Checkpointer([run], keep=1, async_mode=None)`` saves step 2 after step 1
(retention removes step 1 once step 2 committed); the fresh job saves step 4.  ``async``: the
same with ``async_mode="thread"``.  ``two-tier``: each rank's node its own node-local
directory, then the shared run (``Checkpointer([node, run], node_local=True, keep=[1, 1])``).
``overwrite``:
plain ``dcp.save`` with ``DataStatesWriter(path, overwrite=True)`` and DCP's default planner
replaces a committed checkpoint in place; the fresh job overwrites it once more.  ``process``:
the ``Checkpointer`` with ``async_mode="process"``, where the plan is the target's checkpoint
process's (DCP's PROCESS mode), started with ``tests/crashsim_site`` on its path.

At a fault point the job first goes on: its next save (step 3) must commit on every rank.

Two ranks at two chosen points (``test_every_crash_point_of_a_rank_in_a_save_the_other_rank_fails...``,
every kind of save): the other rank's j-th operation fails with EIO, for every j, and in
each such save this rank dies after its k-th, for every k it makes there (with ``process``,
both in the ranks' checkpoint processes); the same checks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.workers import crash_same as _same
from tests.workers import crash_state as _state
from tests.workers import crash_template as _template
from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.errors import first_line
from tests import crashsim
from tests.dist import run_ranks

WORLD = 2
# "fault": the operation fails with EIO; "after": it takes effect, then its caller is told EIO
FAULTS = ("fault", "after")
log = logging.getLogger(__name__)
# once a rank died at its point, how long the other has to end before, if it waits in a
# collective for the dead one (DCP's own, in the save), it is killed as a launcher would kill
# it (a coordinator waits 20 s for a dead rank's upload)
AFTER_DEATH_S = 60.0








class _Job:
    """One kind of save: ``save(seed)`` makes the next save, ``allowed(name)`` the seeds a
    committed directory of the shared run may hold, ``load`` a ``Checkpointer``'s restore."""

    def __init__(self, kind: str, run: str) -> None:
        self.kind, self.run = kind, run
        rank = torch.distributed.get_rank()
        if kind == "overwrite":
            self.ckpt = None
        elif kind == "two-tier":  # each rank its own node's directory, then the shared run
            self.ckpt = Checkpointer([_node_dir(run, rank), run], node_local=True, node=f"n{rank}",
                                     keep=[1, 1], async_mode=None)
        else:
            mode = {"async": "thread", "process": "process"}.get(kind)
            self.ckpt = Checkpointer([run], keep=1, async_mode=mode)

    def save(self, seed: int, timeout: float = 60) -> None:
        rank = torch.distributed.get_rank()
        if self.ckpt is not None:
            failed: BaseException | None = None
            try:
                self.ckpt.save(seed, _state(rank, seed))
                assert self.ckpt.wait_persisted(timeout)  # and its retention pass
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - raised below
                failed = e
            # every rank's pass once the step is durable everywhere: a rank other than the
            # coordinator may have run its first before, which keeps the newest durable step
            # (the count of operations is the same in every run)
            try:
                torch.distributed.barrier()
                self.ckpt.wait_persisted(timeout)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - a peer died: no pass
                log.info("no second pass: %s", first_line(e, 200))
            if failed is not None:
                raise failed
        else:
            dcp.save(_state(rank, seed), storage_writer=DataStatesWriter(os.path.join(self.run, "step-1"),
                                                                         overwrite=True))

    def allowed(self, name: str) -> set[int]:
        step = int(name.split("-")[1])
        return {1, 2, 3, 4} if self.kind == "overwrite" else {step}

    def load(self) -> str | int:
        """The step a ``Checkpointer`` restores (bit-exactly), else what went wrong."""
        assert self.ckpt is not None
        rank = torch.distributed.get_rank()
        sd = _template(rank)
        step = self.ckpt.load(sd)
        if step is None or not _same(rank, sd, step):
            return f"Checkpointer.load restored step {step}, not bit-exactly"
        return step


def _node_dir(run: str, node: int) -> str:
    return os.path.join(os.path.dirname(run), f"node{node}")


def _setup(rank, world, run, kind):
    _Job(_before(kind), run).save(1)
    os._exit(0)


def _before(kind: str) -> str:
    """The kind of the saves before and after the one under the plan."""
    return "checkpointer" if kind == "process" else kind


def _act(rank, world, run, kind, target, mode, k, other=None):
    """``kind`` "process": the storage operations are those of the target's checkpoint process
    (DCP's PROCESS mode), which DCP starts at the save with the plan's hook; the rank goes on.
    ``other``: (rank, mode, k), a second rank's plan in the same save (its operation ``k``
    fails, say, while the target dies at its own)."""
    base = os.path.dirname(run)
    folder = os.path.join(base, "job") if mode == "job" else None
    if folder is not None:  # every rank (and what it starts) dies at the target's point
        crashsim.join_job(folder)
        torch.distributed.barrier()
    plan, err = crashsim.plan_for(mode)
    if rank == target and kind == "process":
        crashsim.wrap_spawned(os.path.join(base, "plan.json"))
        crashsim.arm(os.path.join(base, "plan.json"), plan, k, os.path.join(base, "process-ops"), err=err,
                     job=folder)
    elif rank == target:
        crashsim.install()  # every local tier made from now on is counted
        crashsim.PLAN.mode, crashsim.PLAN.k, crashsim.PLAN.err, crashsim.PLAN.job = plan, k, err, folder
    elif other is not None and rank == other[0] and kind == "process":  # in its checkpoint process
        crashsim.wrap_spawned(os.path.join(base, "plan-other.json"))
        plan, err = crashsim.plan_for(other[1])
        crashsim.arm(os.path.join(base, "plan-other.json"), plan, other[2], os.path.join(base, "other-process-ops"),
                     err=err)
    elif other is not None and rank == other[0]:
        crashsim.install()
        (crashsim.PLAN.mode, crashsim.PLAN.err), crashsim.PLAN.k = crashsim.plan_for(other[1]), other[2]
    job = _Job(kind, run)
    try:
        job.save(2, timeout=20)  # the coordinator waits that long for a dead rank's upload
        said = "returned"
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - an outcome: the checks decide
        said = f"raised: {first_line(e, 200)}"
    with open(os.path.join(os.path.dirname(run), f"said-{rank}"), "w") as f:
        f.write(said)
    if mode in FAULTS:  # the job goes on: its next save must work
        if rank == target and kind == "process":
            crashsim.arm(os.path.join(base, "plan.json"), "off", 0, os.path.join(base, "process-ops"))
        elif rank == target:
            crashsim.PLAN.mode = "off"
        try:
            job.save(3)
            again = "returned"
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported
            again = f"raised: {first_line(e, 200)}"
        with open(os.path.join(os.path.dirname(run), f"again-{rank}"), "w") as f:
            f.write(again)
    if rank == target and mode == "record":
        with open(os.path.join(os.path.dirname(run), "ops.json"), "w") as f:
            json.dump(_process_ops(run) if kind == "process" else crashsim.PLAN.log, f)
    crashsim.end_children()
    os._exit(0)  # the target may be dead: no teardown collectives


def _process_ops(run: str) -> list[str]:
    """The storage operations the target's checkpoint process made (to the one it died after)."""
    path = os.path.join(os.path.dirname(run), "process-ops")
    return open(path).read().splitlines() if os.path.exists(path) else []


def _check(rank, world, run, kind, newest_at_least):
    """Every committed directory loads as a state saved there; the newest is new enough; then
    the next save.  What went wrong is written beside the run, one file a rank."""
    bad = []
    job = _Job(_before(kind), run)
    newest = 0
    for name in sorted(os.listdir(run)):
        path = os.path.join(run, name)
        if not crashsim._committed(path):
            continue
        sd = _template(rank)
        try:
            dcp.load(sd, storage_reader=DataStatesReader(path))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported
            bad.append(f"{name}: committed but does not load: {first_line(e, 300)}")
            continue
        if not any(_same(rank, sd, s) for s in job.allowed(name)):
            bad.append(f"{name}: loads a state never saved there (seed {sd['seed']})")
            continue
        newest = max(newest, sd["seed"])
    if newest < newest_at_least and kind != "two-tier":  # there: the node's copy may be newer
        bad.append(f"the newest loadable state is save {newest}, wanted at least save {newest_at_least}")
    if job.ckpt is not None:
        got = job.load()
        if isinstance(got, str) or got < newest_at_least:
            bad.append(f"Checkpointer.load: {got}, wanted at least step {newest_at_least}")
    said = logging.FileHandler(os.path.join(os.path.dirname(run), crashsim.NEXT_LOG))  # why a file stayed
    said.setFormatter(logging.Formatter(f"rank {rank}: %(levelname)s %(message)s"))
    lib = logging.getLogger("dcp_datastates")
    lib.setLevel(logging.INFO)
    lib.addHandler(said)
    try:
        job.save(4)  # with a pass once step 4 is durable everywhere: until then a node's files
        # of the newest durable step before it serve that step's restore
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported
        bad.append(f"the next save failed: {first_line(e, 300)}")
    said.close()
    if bad:
        with open(os.path.join(os.path.dirname(run), f"violation-{rank}"), "w") as f:
            f.write("; ".join(bad))
    os._exit(0)


def _run(fn, *args) -> bool:
    """Whether a rank died at its crash point (exit code ``crashsim.CRASHED``), or was killed
    with the job at one (SIGKILL; a rank left waiting in a collective for it is killed too)."""
    try:
        run_ranks(WORLD, fn, *args, timeout=180, after_death=AFTER_DEATH_S)
    except AssertionError as e:
        said = str(e).strip().splitlines()[-1]
        if not said.startswith("ranks exited with codes") or not (
                str(crashsim.CRASHED) in said or str(-signal.SIGKILL) in said):
            raise
        return True
    return False


def _point(golden: str, base: str, kind: str, target: int, mode: str, k: int, reachable: int,
           other: tuple[int, str, int] | None = None, reached: list[bool] | None = None) -> list[str]:
    """One point; the invariants it broke.  A point past ``reachable`` may not be reached.
    ``other``: a second rank's plan in the same save (``_act``); the run is checked whether the
    target's point was reached or not (which rank makes the step's directory decides which
    operation the other rank's plan strikes, and so the path the target takes), and
    ``reached`` is told which."""
    shutil.copytree(golden, base)
    run = os.path.join(base, "run")
    where = f"{mode} of rank {target} at operation {k}"
    if other is not None:
        where += f", with a {other[1]} of rank {other[0]} at its operation {other[2]}"
    try:
        crashed = _run(_act, run, kind, target, mode, k, other)
    except AssertionError as e:  # a rank failed or hung under the plan, not at its point
        return [f"{where}: the save under it: {str(e).strip().splitlines()[-1][:300]}"]
    if kind == "process":  # the checkpoint process died, not its rank
        crashed = len(_process_ops(run)) >= k
    if reached is not None:
        reached.append(crashed)
    if mode in ("crash", "job") and not crashed and other is None:
        return [] if k > reachable else [f"{where}: never reached"]
    said = {r: open(p).read() for r in range(WORLD) if os.path.exists(p := os.path.join(base, f"said-{r}"))}
    bad = []
    if mode in FAULTS and len(said) < WORLD:
        bad.append(f"{where}: ranks {sorted(set(range(WORLD)) - set(said))} never finished the save")
    returned = len(said) == WORLD and all(v == "returned" for v in said.values())
    newest = 2 if returned else 1
    if mode in FAULTS:
        again = {r: open(p).read() for r in range(WORLD) if os.path.exists(p := os.path.join(base, f"again-{r}"))}
        if len(again) == WORLD and all(v == "returned" for v in again.values()):
            newest = 3
        else:
            bad.append(f"{where} (the save: {said}): the job's next save failed: {again}")
    try:
        run_ranks(WORLD, _check, run, kind, newest, timeout=180)
    except AssertionError as e:
        bad.append(f"{where}: the checks did not end: {str(e).strip().splitlines()[-1][:300]}")
    for r in range(WORLD):
        if os.path.exists(v := os.path.join(base, f"violation-{r}")):
            bad.append(f"{where} (the save: {said}), rank {r}: {open(v).read()}")
    dirs = [run] + [_node_dir(run, n) for n in range(WORLD) if kind == "two-tier"]
    bad += [f"{where} (the save: {said}): {x}" for d in dirs for x in crashsim._leftovers(d, os.path.basename(d))]
    return bad


# every kind, the ranks targeted in it, every mode.  CI runs the coordinator's crash points
# with two tiers, in place (plain DCP) and in DCP's checkpoint process; the whole job killed at
# the coordinator's points of the one-tier, async, and in-place saves and at rank 1's with two
# tiers; the in-place save's fault points; and the one-tier coordinator's ``after`` points.
# The rest run in ``make test-long``
ROWS = [(kind, target, mode) for kind, targets in (("checkpointer", (0, 1)), ("overwrite", (0, 1)), ("async", (0,)),
                                                   ("two-tier", (0, 1)), ("process", (0, 1)))
        for target in targets for mode in ("crash", *FAULTS, "job")]
IN_CI = {("two-tier", 0, "crash"), ("overwrite", 0, "crash"), ("process", 0, "crash"), ("checkpointer", 0, "job"),
         ("async", 0, "job"), ("overwrite", 0, "job"), ("two-tier", 1, "job"), ("overwrite", 0, "fault"),
         ("checkpointer", 0, "after")}


@pytest.mark.parametrize("kind,target,mode", [r if r in IN_CI else pytest.param(*r, marks=pytest.mark.slow)
                                              for r in ROWS])
def test_every_crash_and_fault_point_of_a_rank_in_a_collective_save_keeps_what_committed(
        tmp_path, kind, target, mode):
    golden = _golden(tmp_path, kind)
    ops = _record(golden, str(tmp_path / "record"), kind, target)
    assert len(ops) >= 3, ops  # its data file: create, write, close
    reachable = _reachable(ops)
    bad = []
    for k in range(1, len(ops) + 1):
        if not crashsim.is_point(mode, ops[k - 1]):
            continue
        found = _point(golden, base := str(tmp_path / f"{mode}-{k}"), kind, target, mode, k, reachable)
        bad += found
        if not found:
            shutil.rmtree(base)
    assert not bad, "\n".join([f"{len(ops)} operations of rank {target}: {ops}", *bad])


def _golden(tmp_path, kind: str) -> str:
    """The run as the first save left it, copied for every point."""
    golden = str(tmp_path / "golden")
    os.makedirs(golden)
    run_ranks(WORLD, _setup, os.path.join(golden, "run"), kind, timeout=180)
    return golden


def _record(golden: str, record: str, kind: str, target: int, other: tuple[int, str, int] | None = None) -> list[str]:
    """The storage operations rank ``target`` makes in the save (``other``: with that plan on
    the other rank)."""
    shutil.copytree(golden, record)
    _run(_act, os.path.join(record, "run"), kind, target, "record", 0, other)
    path = os.path.join(record, "ops.json")
    return json.load(open(path)) if os.path.exists(path) else []


def _reachable(ops: list[str]) -> int:
    """The points a run surely reaches: the step's directory is made by whichever rank comes
    first, so the count may be short by the directories made."""
    return len(ops) - sum(op.startswith("mkdir ") for op in ops)


# (kind, the rank that dies): every fault point of the other rank, and at each every crash
# point of this one in the save that fault fails.  CI runs the coordinator's deaths in the
# in-place save (its part of a save rank 1 failed, cut at every point); the rest run in
# ``make test-long`` (the two-tier rows are about 770 pairs each)
PAIRS = [(kind, crasher) for kind in ("checkpointer", "async", "overwrite", "two-tier", "process")
         for crasher in (0, 1)]


@pytest.mark.parametrize("kind,crasher", [p if p == ("overwrite", 0) else pytest.param(*p, marks=pytest.mark.slow)
                                          for p in PAIRS])
def test_every_crash_point_of_a_rank_in_a_save_the_other_rank_fails_keeps_what_committed(tmp_path, kind, crasher):
    """Two ranks failing at two chosen points: the other rank's j-th storage operation fails
    with EIO (every j), and, in that save, this rank dies after its k-th (every k it makes in
    that save): what it does once the other rank failed (its writes, its abort, its claim let go
    with the record kept, retention) is cut at every point.  The same checks as one rank's
    points."""
    other = 1 - crasher
    golden = _golden(tmp_path, kind)
    faults = _record(golden, str(tmp_path / "record"), kind, other)
    bad: list[str] = []
    reached: list[bool] = []
    for j in range(1, len(faults) + 1):
        plan = (other, "fault", j)
        ops = _record(golden, str(tmp_path / f"record-{j}"), kind, crasher, plan)
        for k in range(1, len(ops) + 1):
            for attempt in (1, 2):  # a point not reached is tried once more (the threads' order varies)
                found = _point(golden, base := str(tmp_path / f"pair-{j}-{k}-{attempt}"), kind, crasher, "crash",
                               k, _reachable(ops), plan, reached)
                bad += found
                if not found:
                    shutil.rmtree(base)
                if reached[-1] or attempt == 2:
                    break
                reached.pop()  # the second try counts
    log.warning("%s, rank %d dies: %d fault points of rank %d, %d pairs, %d of them reached", kind, crasher,
                len(faults), other, len(reached), sum(reached))
    assert not bad, "\n".join([f"{len(faults)} operations of rank {other}: {faults}", *bad])
    # most pairs strike where they were recorded (where they do not, the run is checked all the same)
    assert faults and sum(reached) >= max(len(faults), 0.8 * len(reached)), (faults, len(reached), sum(reached))
