"""A committed save survives a power cut: its file system calls, traced, keep the rules of
``tests/durability.py`` (data before name, name before removal, durable when reported), through
plain DCP (``dcp.save``, ``dcp.async_save`` in THREAD mode, per-rank saves) and through
``Checkpointer`` with two tiers, retention and incremental steps."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from tests import crashsim
from tests.dist import run_in_process, run_ranks
from tests.durability import Trace, across, trace_spawned


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 16, generator=g), "fixed": torch.arange(1 << 12, dtype=torch.float32),
            "step": step}


def _same(path: str, step: int) -> bool:
    want = _state(step)
    got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in want.items()}
    dcp.load(got, storage_reader=DataStatesReader(path), no_dist=True)
    return got["step"] == step and all(torch.equal(got[k], v) for k, v in want.items() if k != "step")


def _plain_sync(root: str) -> None:
    for step in (1, 2):  # the second replaces the first in the same directory
        dcp.save(_state(step), storage_writer=DataStatesWriter(f"{root}/run/ckpt", overwrite=True), no_dist=True)


def _into_a_dead_saves_directory(root: str) -> None:
    """A save that made its directory died before the directory's name was durable; the next
    save into it (the step saved again after a restart) commits there."""
    os.mkdir(f"{root}/run")
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)  # "run" is durable
    os.close(fd)
    os.mkdir(f"{root}/run/ckpt")  # and nothing made this one durable
    dcp.save(_state(2), storage_writer=DataStatesWriter(f"{root}/run/ckpt"), no_dist=True)


def _plain_thread(root: str) -> None:
    for step in (1, 2):
        dcp.async_save(_state(step), storage_writer=DataStatesWriter(f"{root}/run/step-{step}"), no_dist=True,
                       async_checkpointer_type=AsyncCheckpointerType.THREAD).result(timeout=120)


def _per_rank(root: str) -> None:
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=DataStatesWriter(f"{root}/run/ckpt", overwrite=True),
                 no_dist=True, use_collectives=False)


def _checkpointer(root: str) -> None:
    ck = Checkpointer([f"{root}/fast", f"{root}/slow"], keep=[1, 2], incremental=True)
    for step in (1, 2, 3):
        ck.save(step, _state(step))
        ck.wait()
        assert ck.wait_persisted(120)
    ck.close()


SCENARIOS = {"dcp.save": (_plain_sync, ["run/ckpt"]), "dcp.async_save": (_plain_thread, ["run/step-2"]),
             "after-a-dead-save": (_into_a_dead_saves_directory, ["run/ckpt"]),
             "per-rank": (_per_rank, ["run/ckpt"]), "checkpointer": (_checkpointer, ["fast/step-3", "slow/step-3"])}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_reported_save_survives_a_power_cut(tmp_path, monkeypatch, name):
    run, newest = SCENARIOS[name]
    trace = Trace(str(tmp_path))
    with monkeypatch.context() as mp:
        trace.install(mp)
        run(str(tmp_path))
        broken = trace.broken + trace.not_durable()
    assert not broken, "\n".join(broken)
    for path in newest:  # the trace saw the real saves
        assert _same(str(tmp_path / path), int(path.rpartition("-")[2]) if "step-" in path else 2), path


def _scenario(name: str, work: str, out: str) -> None:
    sc = {**crashsim.SCENARIOS, **crashsim.LONG_SCENARIOS}[name]
    trace = Trace(work)
    trace.install(pytest.MonkeyPatch())
    sc.setup(work)
    sc.act(work)
    with open(out, "w") as f:
        f.write("\n".join(trace.broken + trace.not_durable()))
    os._exit(0)


@pytest.mark.parametrize("name", [*crashsim.SCENARIOS, *crashsim.LONG_SCENARIOS])
def test_every_crash_scenario_keeps_the_rules_of_a_power_cut(tmp_path, name):
    """The crash harness's scenarios (``tests/crashsim.py``), each run whole under the trace in
    a process of its own that started no thread (one forks a second save)."""
    work, out = str(tmp_path / "work"), str(tmp_path / "said")
    os.makedirs(work)
    code = run_in_process(_scenario, name, work, out, timeout=300)
    assert code == 0 and os.path.exists(out), code
    broken = open(out).read()
    assert not broken, broken


@contextlib.contextmanager
def _traced(root: str, dump: str):
    """This rank's calls under ``root``, traced while the block runs, then kept in ``dump``."""
    mp = pytest.MonkeyPatch()
    trace = Trace(root)
    trace.install(mp)
    try:
        yield
    finally:
        mp.undo()
        trace.dump(dump)


def _three_steps(ck: Checkpointer, rank: int, durable) -> None:
    """Steps 1 to 3 of ``rank``'s state, each waited for by ``durable(ck)``."""
    for step in (1, 2, 3):
        ck.save(step, {f"w{rank}": _state(step)["w"] + rank, "step": step})
        assert durable(ck)


def _restores_step_3(ck: Checkpointer, rank: int) -> bool:
    got = {f"w{rank}": torch.zeros(1 << 16), "step": 0}
    return ck.load(got) == 3 and torch.equal(got[f"w{rank}"], _state(3)["w"] + rank)


def _replicated(rank, world, root, phase, per_node):
    """Two nodes of ``per_node`` ranks, ``Checkpointer(node_local=True, replicas=1, keep=1)``:
    three steps saved and replicated (``save``), then, node 1's directory lost, a restore that
    repairs it from node 0's copies (``repair``); what each rank's trace found is written beside."""
    import torch.distributed as dist
    node = rank // per_node
    with _traced(root, f"{root}/trace-{phase}-{rank}"):
        ck = Checkpointer([f"{root}/node{node}"], node_local=True, replicas=1, node=f"n{node}", keep=1,
                          async_mode=None, process_group=dist.new_group(backend="gloo"))
        if phase == "save":
            _three_steps(ck, rank, lambda c: c.wait_replicated(60))
        else:
            assert _restores_step_3(ck, rank)
        ck.close()
    os._exit(0)


@pytest.mark.parametrize("per_node", [1, 2])
def test_replicas_and_their_repair_survive_a_power_cut(tmp_path, per_node):
    """With two ranks a node, the node's directory is shared: a name one rank made is durable
    once any rank of the node fsynced the directory after it."""
    import shutil
    run_ranks(2 * per_node, _replicated, str(tmp_path), "save", per_node)
    shutil.rmtree(tmp_path / "node1")
    run_ranks(2 * per_node, _replicated, str(tmp_path), "repair", per_node)
    for phase in ("save", "repair"):
        dumps = sorted(str(p) for p in tmp_path.glob(f"trace-{phase}-*"))
        assert len(dumps) == 2 * per_node, dumps
        broken = across(dumps)
        assert not broken, "\n".join(broken)


def _collective(rank, world, root):
    """Two ranks' collective ``dcp.save`` into one shared directory, twice, the second over the
    first: every rank's own names are durable when its save returns (the coordinator's commit
    may follow a rank's data by no more than a broadcast)."""
    with _traced(root, f"{root}/trace-{rank}"):
        for step in (1, 2):
            dcp.save({f"w{rank}": _state(step)["w"] + rank, "step": step},
                     storage_writer=DataStatesWriter(f"{root}/run/ckpt", overwrite=True))
    os._exit(0)


def test_a_collective_save_survives_a_power_cut_on_every_rank(tmp_path):
    run_ranks(2, _collective, str(tmp_path))
    dumps = sorted(str(p) for p in tmp_path.glob("trace-*"))
    assert len(dumps) == 2, dumps
    broken = across(dumps)
    assert not broken, "\n".join(broken)


def _save_as_nobody(parent: str) -> None:
    if os.geteuid() == 0:  # root reads any directory: save as a user who cannot read ``parent``
        os.setgid(65534)
        os.setuid(65534)
    dcp.save(_state(2), storage_writer=DataStatesWriter(f"{parent}/run/ckpt"), no_dist=True)
    os._exit(0 if _same(f"{parent}/run/ckpt", 2) else 1)


def test_a_save_under_a_directory_it_may_write_but_not_read(tmp_path):
    """A directory that grants writing and passing through but not reading (mode 333, a shared
    drop directory) cannot be opened to be fsynced: the save's own directories are made durable,
    that one is left as it is, and the save goes on."""
    import shutil
    import tempfile
    base = tempfile.mkdtemp(prefix="dcpds-perm-")  # reachable by another user, unlike tmp_path
    try:
        os.chmod(base, 0o755)
        os.mkdir(parent := os.path.join(base, "drop"))
        os.chmod(parent, 0o333)
        assert run_in_process(_save_as_nobody, parent) == 0
    finally:
        os.chmod(os.path.join(base, "drop"), 0o755)
        shutil.rmtree(base)


def _process_mode(rank, world, root):
    """``Checkpointer(async_mode="process")``: DCP's checkpoint process writes, traced through
    ``tests/durability_site``; two tiers, retention, three steps."""
    import torch.distributed as dist
    trace_spawned(f"{root}/data", f"{root}/traces")
    with _traced(f"{root}/data", f"{root}/traces/trace-rank-{rank}"):
        ck = Checkpointer([f"{root}/data/fast", f"{root}/data/slow"], keep=[1, 1], async_mode="process",
                          process_group=dist.new_group(backend="gloo"))
        _three_steps(ck, rank, lambda c: c.wait() or c.wait_persisted(120))
        assert _restores_step_3(ck, rank)
        ck.close()
    os._exit(0)


def test_a_save_in_dcps_checkpoint_process_survives_a_power_cut(tmp_path):
    os.makedirs(tmp_path / "traces")
    run_ranks(2, _process_mode, str(tmp_path))
    dumps = sorted(str(p) for p in (tmp_path / "traces").glob("trace-*") if not p.name.endswith(".new"))
    spawned = [d for d in dumps if "spawned" in d]
    assert len(dumps) - len(spawned) == 2 and spawned, dumps  # the checkpoint process's calls were traced
    broken = across(dumps)
    assert not broken, "\n".join(broken)
