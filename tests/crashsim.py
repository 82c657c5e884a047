"""Every crash point and every fault point of a set of save scenarios (issue 35).

    python -m tests.crashsim [SCENARIO ...] [--size small|large] [--jobs N] [--json OUT]

For each scenario the runner first records the storage operations it makes, through a wrapper
of the storage seam (``tiers/backend.Backend``, and the ``Sink`` and ``HeldLock`` objects it
hands out): create a directory, create a data file, write, close (fsync), abort, commit a file
(temp file, fsync, rename), sync a directory, remove a file or a directory, take or write or
let go a claim, copy a file to a slower tier.  Then, for every operation k:

* **crash**: a fresh process runs the scenario and dies (``os._exit``) right after operation
  k; for a commit also between its durable temp file and its rename;
* **job** (``test_save_crash_points.py``, ``test_replica_crash_points.py``): every process of
  a multi-rank job, and every process they started, is killed by SIGKILL right after one
  rank's operation k (``kill_job``), as a launcher ends a job;
* **fault**: operation k fails with EIO (writes and commits also with ENOSPC, and with a short
  write: half the bytes, then ENOSPC; and each operation that can take effect and still report
  a failure, ``AMBIGUOUS``, also with EIO after it took effect, as a network file system's
  retried rename reports), and the scenario goes on as the library decides.

``persist-s3-keep1`` (run only when named) puts the slower tier on a real S3 server (moto, started
by the runner as a process): the wrapper then also records the object store's operations
(``RecFsspecBackend``: an object's upload, each PUT, a removal, the lease claim's conditional
create), each marked ``@s3`` in the log.

``--jitter-ms`` makes each operation first sleep a seeded random while, so that the library's
threads interleave their operations in other orders than the recording's (a point then fails
whichever operation comes k-th in its run).

After each, a checker verifies the invariants: every step directory with a committed manifest
loads bit-exactly as one of the states saved there; the steps that must survive (committed
before the scenario and not retired by it, or the newest committed one) load; nothing outside
the run changed; and once the scenario's save is run again without faults, no file of the dead
or failed attempt is left (a data file, part, marker or temp file no manifest references, or a
claim).  Every process is forked from a runner that has started no thread, so each one runs
the real engine from scratch, and a crash is a real process death (the kernel drops its locks).
The library has no branch for any of this.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.errors import CheckpointError, first_line
from dcp_datastates.format.names import (
    CLAIM_NAME,
    DATA_FILE,
    PART_FILE,
    RANK_CLAIM_PREFIX,
    TEMP_INFIX,
    is_manifest_name,
)
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.tidy import run_references
from tests.crash_seam import (  # the seam, and the names the crash tests reach through this module
    AMBIGUOUS,
    CRASHED,
    PLAN,
    REMOTE_MARK,
    WRITES,
    Plan,
    _rng,
    arm,
    end_children,
    install,
    install_armed,
    is_point,
    join_job,
    kill_job,
    plan_for,
    ranks_at_point,
    wrap_spawned,
)
from tests.s3server import S3Server

# ----------------------------------------------------------------------- scenarios
SIZES = {"small": (64, 1024), "large": (1024, 1024)}
SIZE = ["small"]
KEEP = [False]
# A scenario's tier "s3:NAME" lives on a real S3 server (moto) the runner starts, under a prefix
# named after the work directory, so each point has its own copy; every fork inherits this.
REMOTE = "s3:"
BUCKET = "crashsim"
S3: dict = {}


def _remote(tier: str) -> bool:
    return tier.startswith(REMOTE)


def _url(work: str, tier: str) -> str:
    """Where scenario tier ``tier`` of work directory ``work`` lives."""
    if _remote(tier):
        return f"s3://{BUCKET}{os.path.abspath(work)}/{tier[len(REMOTE):]}"
    return os.path.join(work, tier)


def _beside(tier: str) -> str:
    """The prefix of the sentinel object beside remote tier ``tier``: its name and more, so that
    a listing of the run by prefix alone (without its closing slash) would take it in."""
    return f"{tier}-outside"


def _options(tier: str) -> dict | None:
    return S3["options"] if _remote(tier) else None


def _tier(work: str, tier: str) -> StorageTier:
    return StorageTier(_url(work, tier), _options(tier))


def _s3_fs():
    """An S3 filesystem on the runner's server (in a forked child: it starts a thread)."""
    import s3fs
    return s3fs.S3FileSystem(**S3["options"])


def _s3_copy(src: str, dst: str) -> None:
    """Every object under work directory ``src``'s prefix, copied under ``dst``'s."""
    fs = _s3_fs()
    a, b = f"{BUCKET}{os.path.abspath(src)}", f"{BUCKET}{os.path.abspath(dst)}"
    for key in fs.find(a):
        fs.copy(key, b + key[len(a):])


def state_for(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows, cols = SIZES[SIZE[0]]
    return {"w": torch.randn(rows, cols, generator=g), "b": torch.randn(1000, generator=g).bfloat16(),
            "s": {str(i): torch.randn(16, generator=g) for i in range(4)}, "step": seed}


def _template() -> dict:
    t = state_for(0)
    return {"w": torch.zeros_like(t["w"]), "b": torch.zeros_like(t["b"]),
            "s": {k: torch.zeros_like(v) for k, v in t["s"].items()}, "step": -1}


def _same(a: dict, b: dict) -> bool:
    return (a["step"] == b["step"] and torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
            and all(torch.equal(a["s"][k], b["s"][k]) for k in b["s"]))


def _save(path: str, seed: int, **kw) -> None:
    kw.setdefault("overwrite", True)
    coll = kw.pop("use_collectives", True)
    dcp.save(state_for(seed), storage_writer=DataStatesWriter(path, host_cache_bytes=8 << 20, **kw),
             no_dist=True, use_collectives=coll)


def _ckpt(tiers: list[str], **kw) -> Checkpointer:
    return Checkpointer(tiers, async_mode=None, host_cache_bytes=8 << 20, **kw)


@dataclasses.dataclass
class Scenario:
    name: str
    tiers: list[str]  # run directories, relative to the work directory
    setup: Callable[[str], None]
    act: Callable[[str], None]
    allowed: dict[int, set[int]]  # step -> the seeds a committed copy of it may hold
    floor: int  # the newest loadable step of the first tier's run is at least this (0: none)
    floor_last: int = 0  # the same for the last tier
    # the next save after a point (``verify``; None: ``act`` again): alone, where ``act`` races
    # a second save, which may take the claim first and rightly refuse it as busy
    again: Callable[[str], None] | None = None


def _p(work: str, tier: str, step: int) -> str:
    return os.path.join(work, tier, f"step-{step}")


def _async_mutation(work: str) -> None:
    sd = state_for(2)
    w = DataStatesWriter(_p(work, "run", 1), host_cache_bytes=1 << 20, overwrite=True)
    fut = dcp.async_save(sd, storage_writer=w, no_dist=True)
    w.wait_snapshot()
    sd["w"].add_(1)  # after the snapshot: never in the checkpoint
    fut.result()


def _concurrent(work: str) -> None:
    pid = os.fork()
    if pid == 0:  # the other save, not under the plan
        PLAN.mode = "off"
        code = 0
        try:
            _save(_p(work, "run", 1), 3)
        except BaseException:  # noqa: BLE001 - busy, most often: the point is what is left
            code = 1
        os._exit(code)
    try:
        _save(_p(work, "run", 1), 2)
    finally:
        os.waitpid(pid, 0)


SCENARIOS = {s.name: s for s in [
    Scenario("save", ["run"], lambda w: None, lambda w: _save(_p(w, "run", 1), 1), {1: {1}}, 0),
    Scenario("overwrite", ["run"], lambda w: _save(_p(w, "run", 1), 1),
             lambda w: _save(_p(w, "run", 1), 2), {1: {1, 2}}, 1),
    Scenario("async-mutation", ["run"], lambda w: _save(_p(w, "run", 1), 1), _async_mutation, {1: {1, 2}}, 1),
    Scenario("incremental-keep1", ["run"], lambda w: [_incremental(w, s) for s in (1, 2)],
             lambda w: _incremental(w, 3),
             {1: {1}, 2: {2}, 3: {3}}, 2),
    Scenario("per-rank", ["run"], lambda w: _save(_p(w, "run", 1), 1, use_collectives=False),
             lambda w: _save(_p(w, "run", 1), 2, use_collectives=False), {1: {1, 2}}, 1),
    Scenario("persist-keep1", ["t1", "t2"],
             lambda w: [_persisted(w, s) for s in (1, 2)], lambda w: _persisted(w, 3),
             {1: {1}, 2: {2}, 3: {3}}, 2, 2),
    Scenario("concurrent", ["run"], lambda w: _save(_p(w, "run", 1), 1), _concurrent, {1: {1, 2, 3}}, 1,
             again=lambda w: _save(_p(w, "run", 1), 2)),
    Scenario("other-kind", ["run"], lambda w: _save(_p(w, "run", 1), 1),
             lambda w: _save(_p(w, "run", 1), 2, use_collectives=False), {1: {1, 2}}, 1),
]}


def _incremental_persisted(work: str, step: int) -> None:
    c = _ckpt([os.path.join(work, "t1"), os.path.join(work, "t2")], keep=[1, 2], incremental=True)
    c.save(step, state_for(step))
    c.wait_persisted(120)
    c.close()


# on an object store (a moto server): run only when named (``make test-long`` does), as each
# point takes seconds of S3 requests
REMOTE_SCENARIOS = {s.name: s for s in [
    Scenario("persist-s3-keep1", ["t1", "s3:t2"],
             lambda w: [_persisted_s3(w, s) for s in (1, 2)], lambda w: _persisted_s3(w, 3),
             {1: {1}, 2: {2}, 3: {3}}, 2, 2),
]}

# run with --size large (make test-long) besides the others
LONG_SCENARIOS = {s.name: s for s in [
    Scenario("incremental-persist", ["t1", "t2"], lambda w: [_incremental_persisted(w, s) for s in (1, 2)],
             lambda w: _incremental_persisted(w, 3), {1: {1}, 2: {2}, 3: {3}}, 2, 2),
]}


def _persisted(work: str, step: int, tiers: tuple[str, str] = ("t1", "t2")) -> None:
    c = _ckpt([_url(work, t) for t in tiers], keep=[1, 1], storage_options=[_options(t) for t in tiers])
    c.save(step, state_for(step))
    c.wait_persisted(120)
    c.close()


def _persisted_s3(work: str, step: int) -> None:
    _persisted(work, step, ("t1", "s3:t2"))


def _incremental(work: str, step: int) -> None:
    c = _ckpt([os.path.join(work, "run")], incremental=True, keep=1)
    c.save(step, state_for(step))
    c.wait_persisted(120)  # and its retention pass
    c.close()


# ----------------------------------------------------------------------- the checks
def _loads(path: str, options: dict | None = None) -> dict | str:
    out = _template()
    try:
        dcp.load(out, storage_reader=DataStatesReader(path, storage_options=options), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - reported as a violation
        return f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _committed(path: str) -> bool:
    return any(is_manifest_name(n) for n in (os.listdir(path) if os.path.isdir(path) else []))


def check(sc: Scenario, work: str, sentinel: bytes, *, leftovers: bool) -> list[str]:
    bad: list[str] = []
    try:
        if open(os.path.join(work, "outside", "keep.bin"), "rb").read() != sentinel:
            bad.append("a file outside the run changed")
    except OSError as e:
        bad.append(f"a file outside the run is gone ({e})")
    for t in filter(_remote, sc.tiers):
        try:
            if _tier(work, _beside(t)).read_bytes("keep.bin") != sentinel:
                bad.append(f"an object outside the run changed ({_beside(t)})")
        except (OSError, CheckpointError) as e:
            bad.append(f"an object outside the run is gone ({e})")
    for i, tier in enumerate(sc.tiers):
        run = _tier(work, tier)
        newest = 0
        for d in sorted(n for n, kind in run.entries() if kind == "dir"):
            step = int(d.split("-")[1])
            if not any(is_manifest_name(n) for n in run.child(d).listdir()):
                continue
            got = _loads(run.child(d).url, _options(tier))
            if isinstance(got, str):
                bad.append(f"{tier}/{d}: committed but does not load: {got}")
                continue
            if not any(_same(got, state_for(s)) for s in sc.allowed[step]):
                bad.append(f"{tier}/{d}: loads a state never saved there (step field {got['step']})")
                continue
            newest = max(newest, step)
        floor = sc.floor if i == 0 else sc.floor_last
        if newest < floor:
            bad.append(f"{tier}: the newest loadable step is {newest}, under {floor}: a committed step was lost")
        if leftovers:
            bad += _left_in(run, tier, work)
    return bad


def _leftovers(run: str, tier: str) -> list[str]:
    """What the dead or failed attempts left in the local run directory ``run``."""
    return _left_in(StorageTier(run), tier, os.path.dirname(run))


def _left_in(run: StorageTier, tier: str, work: str) -> list[str]:
    refs = run_references(run)
    bad = []
    for d in sorted(n for n, kind in run.entries() if kind == "dir"):
        keep = refs.get(d, set())
        names = run.child(d).listdir()
        for n in names:
            dead = (TEMP_INFIX in n or n.endswith(".part") or n == CLAIM_NAME or n.startswith(RANK_CLAIM_PREFIX)
                    or ((DATA_FILE.match(n) or PART_FILE.match(n)) and n not in keep and "*" not in keep))
            if dead:
                bad.append(f"{tier}/{d}/{n}: left over after the next save (the directory: "
                           f"{sorted(names)}){_said_about(work, tier, d)}")
    return bad


NEXT_LOG = "next.log"  # what the library logged during the next save (INFO and up)


def _said_about(work: str, tier: str, d: str) -> str:
    """The next save's log lines about ``tier/d``, to tell why a file stayed there."""
    tier = tier.removeprefix(REMOTE)
    try:
        with open(os.path.join(work, NEXT_LOG)) as f:
            lines = [ln.strip() for ln in f if f"{tier}/{d}" in ln]
    except OSError:
        return ""
    return "; the next save logged: " + " | ".join(lines[-8:]) if lines else "; the next save logged nothing about it"


# ----------------------------------------------------------------------- the runner
def _child(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001 - a failed save is an outcome, not a harness error
            code = 1
            if KEEP[0]:  # one point under study: say why
                import traceback
                traceback.print_exc()
        os._exit(code)
    return pid


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def _subreaper() -> None:
    """Make this process the reaper of its descendants' orphans (Linux's PR_SET_CHILD_SUBREAPER)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def _reap_orphans() -> None:
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def _checked(sc: Scenario, work: str, sentinel: bytes, *, leftovers: bool) -> list[str]:
    """``check`` in a child process; its findings come back through a file."""
    out = os.path.join(work, "check.json")

    def run():
        with open(out, "w") as f:
            json.dump(check(sc, work, sentinel, leftovers=leftovers), f)
    code = _wait(_child(run), 180)
    if code != 0:
        return [f"the check itself failed (exit {code})"]
    with open(out) as f:
        found = json.load(f)
    os.unlink(out)
    return found


def verify(sc: Scenario, work: str, sentinel: bytes) -> list[str]:
    """What a restart finds in ``work`` after the act stopped: ``check``, then the next save of
    the same step without faults (``Scenario.again``), then ``check`` with its leftovers.  Each
    in a child process."""
    bad = _checked(sc, work, sentinel, leftovers=False)
    if bad:
        return bad
    err = os.path.join(work, "next.err")

    def next_save():
        handler = logging.FileHandler(os.path.join(work, NEXT_LOG))
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter("%(relativeCreated)d %(threadName)s %(levelname)s %(message)s"))
        lib = logging.getLogger("dcp_datastates")
        lib.addHandler(handler)
        lib.setLevel(logging.INFO)
        try:
            (sc.again or sc.act)(work)
        except BaseException as e:
            with open(err, "w") as f:  # DCP's CheckpointException: the cause on the lowest rank
                f.write(f"{type(e).__name__}: {first_line(e, 600)}")
            raise
    again = _wait(_child(next_save), 180)
    why = open(err).read() if os.path.exists(err) else ""
    return ([] if again == 0 else [f"the next save failed (exit {again}): {why}"]) + \
        _checked(sc, work, sentinel, leftovers=True)


def point(sc: Scenario, golden: str, work: str, plan: Plan, out: str) -> None:
    """One crash or fault point, in a process of its own: copy the golden state, run the act
    under the plan in a child, then check."""
    _subreaper()
    shutil.copytree(golden, work)
    if any(_remote(t) for t in sc.tiers) and _wait(_child(lambda: _s3_copy(golden, work)), 120) != 0:
        raise SystemExit(f"{sc.name}: the golden objects could not be copied")
    sentinel = open(os.path.join(work, "outside", "keep.bin"), "rb").read()
    logf = os.path.join(work, "oplog.json")

    def act():
        PLAN.mode, PLAN.k, PLAN.err, PLAN.jitter = plan.mode, plan.k, plan.err, plan.jitter
        _rng.seed(f"{plan.seed} {plan.mode} {plan.k} {plan.err}")
        install()
        try:
            sc.act(work)
        finally:
            with open(logf, "w") as f:
                json.dump(PLAN.log, f)
    code = _wait(_child(act), 180)
    _reap_orphans()  # a scenario's other process (``concurrent``) outlives a crashed act
    res = {"code": code, "violations": []}
    if plan.mode == "record":
        res["log"] = json.load(open(logf))
    else:  # each step in a child: this process stays free of threads, so its forks are sound
        res["violations"] = verify(sc, work, sentinel)
    if not KEEP[0] and not res["violations"]:  # a point that failed keeps its directory
        shutil.rmtree(work, ignore_errors=True)
    with open(out, "w") as f:
        json.dump(res, f)


def make_golden(sc: Scenario, base: str) -> str:
    """``base/NAME/golden``: a sentinel outside the run, the run's tiers, and the scenario's
    setup run there (in a child)."""
    golden = os.path.join(base, sc.name, "golden")
    shutil.rmtree(os.path.join(base, sc.name), ignore_errors=True)
    os.makedirs(os.path.join(golden, "outside"))
    with open(os.path.join(golden, "outside", "keep.bin"), "wb") as f:
        f.write(os.urandom(4096))
    for t in sc.tiers:
        if not _remote(t):
            os.makedirs(os.path.join(golden, t), exist_ok=True)
    sentinel = open(os.path.join(golden, "outside", "keep.bin"), "rb").read()
    for t in filter(_remote, sc.tiers):  # and a sentinel object beside the run's objects
        if _wait(_child(lambda t=t: _tier(golden, _beside(t)).commit_bytes("keep.bin", sentinel)), 60) != 0:
            raise SystemExit(f"{sc.name}: the sentinel object could not be written")
    if _wait(_child(lambda: sc.setup(golden)), 300) != 0:
        raise SystemExit(f"{sc.name}: the setup failed")
    return golden


def run_scenario(name: str, base: str, jobs: int, faults: bool = True, only: str | None = None,
                 keep: bool = False, jitter: float = 0.0, seed: int = 0) -> dict:
    sc = {**SCENARIOS, **LONG_SCENARIOS, **REMOTE_SCENARIOS}[name]
    golden = make_golden(sc, base)
    results = os.path.join(base, name, "results")
    os.makedirs(results)

    def go(tag: str, plan: Plan) -> int:
        plan.jitter, plan.seed = jitter, seed
        return _child(lambda: point(sc, golden, os.path.join(base, name, tag), plan, os.path.join(results, tag)))
    if _wait(go("record", Plan("record")), 300) is None:
        raise SystemExit(f"{name}: the recording run hung")
    rec = json.load(open(os.path.join(results, "record")))
    if rec["code"] != 0:
        raise SystemExit(f"{name}: the scenario fails without any fault (exit {rec['code']}): {rec['log']}")
    ops = rec["log"]
    plans = [(f"crash-{k}", Plan("crash", k)) for k in range(1, len(ops) + 1)]
    plans += [(f"crash-mid-{k}", Plan("crash-mid", k)) for k, op in enumerate(ops, 1)
              if op.startswith("commit") and not op.endswith(REMOTE_MARK)]  # a PUT has no middle
    if faults:
        plans += [(f"fault-EIO-{k}", Plan("fault", k, "EIO")) for k in range(1, len(ops) + 1)]
        for err in ("ENOSPC", "short"):
            plans += [(f"fault-{err}-{k}", Plan("fault", k, err)) for k, op in enumerate(ops, 1)
                      if op.split()[0] in WRITES]
        plans += [(f"fault-after-{k}", Plan("fault", k, "after")) for k, op in enumerate(ops, 1)
                  if is_point("after", op)]
    if only is not None:
        plans = [(t, p) for t, p in plans if t == only]
    running: dict[int, str] = {}
    hung: list[str] = []
    for tag, plan in plans:
        while len(running) >= jobs:
            pid, _ = os.wait()
            running.pop(pid, None)
        running[go(tag, plan)] = tag
    for pid, tag in list(running.items()):
        if _wait(pid, 600) is None:
            hung.append(tag)
    out = {"scenario": name, "operations": len(ops), "crash_points": 0, "fault_points": 0,
           "violations": [], "ops": ops}
    for tag, _ in plans:
        try:
            res = json.load(open(os.path.join(results, tag)))
        except (OSError, ValueError):
            out["violations"].append(f"{tag}: no result (the point process died)")
            continue
        out["crash_points" if tag.startswith("crash") else "fault_points"] += 1
        if res["code"] is None:
            out["violations"].append(f"{tag}: the save hung")
        out["violations"] += [f"{tag}: {v}" for v in res["violations"]]
    out["violations"] += [f"{t}: hung" for t in hung]
    if not keep:
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenarios", nargs="*", help="default: all (with --size large, the long ones too)")
    ap.add_argument("--size", choices=list(SIZES), default="small")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--dir", default="/tmp/dcpds-crashsim")
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--only", help="one point (e.g. crash-6), its work directory kept")
    ap.add_argument("--jitter-ms", type=float, default=0.0,
                    help="each operation first sleeps up to this long (other interleavings of threads)")
    ap.add_argument("--seed", type=int, default=0, help="of the jitter's draws")
    args = ap.parse_args(argv)
    os.environ.setdefault("DCP_DATASTATES_HOST_CACHE_BYTES", str(8 << 20))  # the forks' default
    SIZE[0] = args.size
    KEEP[0] = args.only is not None
    if not args.scenarios:
        args.scenarios = list(SCENARIOS) + (list(LONG_SCENARIOS) if args.size == "large" else [])
    assert threading.active_count() == 1, "the runner must start no thread: it forks"
    every = {**SCENARIOS, **LONG_SCENARIOS, **REMOTE_SCENARIOS}
    server = None
    if any(_remote(t) for name in args.scenarios for t in every[name].tiers):
        server = S3Server().start()  # a process, not a thread
        S3["options"] = server.options()
    try:
        if server is not None and _wait(_child(lambda: server.make_bucket(BUCKET)), 60) != 0:
            raise SystemExit("the S3 server's bucket could not be made")
        return report_runs(args.scenarios, lambda name: run_scenario(
            name, args.dir, args.jobs, faults=not args.no_faults, only=args.only, keep=args.only is not None,
            jitter=args.jitter_ms / 1000, seed=args.seed),
            lambda r: f"{r['operations']} operations, {r['crash_points']} crash points, "
                      f"{r['fault_points']} fault points", args.json)
    finally:
        if server is not None:
            server.stop()


def report_runs(names: list[str], run, said, json_path: str | None) -> int:
    """``run(name)`` for each scenario, a line for each (``said(result)``, then its violations),
    the results in ``json_path``; the exit code."""
    report = []
    for name in names:
        t = time.monotonic()
        r = run(name)
        r["seconds"] = round(time.monotonic() - t, 1)
        report.append(r)
        print(f"{name}: {said(r)}, {len(r['violations'])} violations ({r['seconds']} s)", flush=True)
        for v in r["violations"][:20]:
            print(f"  {v}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(r["violations"] for r in report) else 0


if __name__ == "__main__":
    sys.exit(main())


# reached as ``crashsim.X`` by the crash tests (the seam is ``crash_seam.py``)
__all__ = ["AMBIGUOUS", "CRASHED", "PLAN", "Plan", "REMOTE_MARK", "WRITES", "arm", "end_children", "install", "install_armed", "is_point", "join_job", "kill_job", "plan_for", "ranks_at_point", "wrap_spawned"]
