"""The base lock across ranks and nodes: an incremental save's references to its base stay
protected on every node from each rank's read of the base until the manifest naming them is
committed in that node's directory, not only until the rank's part of the save is over.

Each test holds the coordinator's commit back until another process (``tests/interferer.py``,
as another job on the node would) has saved step-1 again in full on the node under test,
after a rank there finished its part of step-2; the re-save's commit tidies what the replaced
step-1 owned.  Step-2 must then load bit-exact from that node's directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.base_lock import removing
from dcp_datastates.tiers.manifests import load_manifest
from tests.dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMEL = 1 << 12


def _state(rank: int) -> dict:
    return {f"r{rank}": torch.arange(NUMEL, dtype=torch.float32) + 1000 * rank}


def _wait_for(path: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _signal(path: str) -> None:
    with open(path, "w"):
        pass


def _resave(step1: str, go: str) -> None:
    """Save ``step1`` again in full from another process, then let the coordinator commit."""
    out = subprocess.run([sys.executable, "-m", "tests.interferer"], input=f"resave {step1} 7\n", text=True,
                         capture_output=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    with open(go + ".answer", "w") as f:
        f.write(out.stdout.strip() or out.stderr.strip()[-500:])
    _signal(go)


def _hold_back_commit(writer, go: str) -> None:
    """The coordinator's ``finish`` (its commit) waits for ``go``."""
    real = writer.finish

    def finish(*a, **k):
        _wait_for(go)
        return real(*a, **k)
    writer.finish = finish


def _change_once_written(writer, step1: str, go: str) -> None:
    """Once this rank's part of the save is over (DCP has its write results), re-save ``step1``."""
    real = writer.write_data

    def write_data(*a, **k):
        fut = real(*a, **k)
        fut.add_done_callback(lambda _f: threading.Thread(target=_resave, args=(step1, go)).start())
        return fut
    writer.write_data = write_data


def _check(run: str, rank: int, go: str) -> None:
    with open(go + ".answer") as f:
        assert f.read().startswith("done "), "the re-save of step-1 failed"
    got = {f"r{rank}": torch.zeros(NUMEL)}
    dcp.load(got, storage_reader=DataStatesReader(os.path.join(run, "step-2")), no_dist=True)
    assert torch.equal(got[f"r{rank}"], _state(rank)[f"r{rank}"])


def _replicas(rank, world, base, mode):
    """Two nodes of one rank, a plain writer with replicas: node 1 commits step-2 after the
    coordinator did, from its replicator."""
    run = os.path.join(base, f"node{rank}", "run")
    go = os.path.join(base, "go")
    w1 = DataStatesWriter(os.path.join(run, "step-1"), replicas=1, node=f"n{rank}")
    dcp.save(_state(rank), storage_writer=w1)
    assert w1.wait_replicated(60)
    w2 = DataStatesWriter(os.path.join(run, "step-2"), replicas=1, node=f"n{rank}", incremental_base="step-1")
    if rank == 0:
        _hold_back_commit(w2, go)
    else:
        _change_once_written(w2, os.path.join(run, "step-1"), go)
    if mode == "sync":
        dcp.save(_state(rank), storage_writer=w2)
    else:
        dcp.async_save(_state(rank), storage_writer=w2, async_checkpointer_type=AsyncCheckpointerType.THREAD).result()
    w2.wait_replicated(60)
    dist.barrier()
    if rank == 1:
        _check(run, rank, go)


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_a_node_that_commits_after_the_coordinator_keeps_the_base_its_ranks_reference(tmp_path, mode):
    run_ranks(2, _replicas, str(tmp_path), mode)


def _coordinator_writes_in_full(rank, world, base):
    """One shared directory; the coordinator finds step-1 being changed when it plans (and
    writes step-2 in full), rank 1 finds it free a moment later: it writes in full too."""
    run = os.path.join(base, "run")
    go, held, planned = (os.path.join(base, n) for n in ("go", "held", "planned"))
    w1 = DataStatesWriter(os.path.join(run, "step-1"))
    dcp.save(_state(rank), storage_writer=w1)
    w2 = DataStatesWriter(os.path.join(run, "step-2"), incremental_base="step-1")
    real_plan = w2.prepare_local_plan
    if rank == 0:
        _hold_back_commit(w2, go)

        def plan(*a, **k):
            _wait_for(held)
            try:
                return real_plan(*a, **k)
            finally:
                _signal(planned)
    else:
        _change_once_written(w2, os.path.join(run, "step-1"), go)

        def plan(*a, **k):
            with removing(StorageTier(os.path.join(run, "step-1"))) as free:
                assert free
                _signal(held)
                _wait_for(planned)
            return real_plan(*a, **k)
    w2.prepare_local_plan = plan
    dcp.save(_state(rank), storage_writer=w2)
    dist.barrier()
    if rank == 1:
        # rank 1 references only the base the coordinator read and holds: here none
        assert load_manifest(StorageTier(os.path.join(run, "step-2"))).homes == {}
        _check(run, rank, go)


def test_a_rank_never_references_a_base_the_coordinator_could_not_hold(tmp_path):
    run_ranks(2, _coordinator_writes_in_full, str(tmp_path))


def _checkpointer(rank, world, base, mode):
    """Two nodes of one rank, ``Checkpointer(node_local=True, incremental=True)``: each rank's
    Checkpointer commits the step on its node once DCP's save returns."""
    run = os.path.join(base, f"node{rank}", "run")
    go = os.path.join(base, "go")
    ckpt = Checkpointer([run], node_local=True, incremental=True, async_mode=mode, node=f"n{rank}",
                        process_group=dist.new_group(backend="gloo"))
    ckpt.save(1, _state(rank))
    ckpt.wait()
    hooks = {"finish": _hold_back_commit} if rank == 0 else {"write_data": _change_once_written}
    name, hook = next(iter(hooks.items()))
    real_init = DataStatesWriter.__init__

    def init(self, *a, **k):  # step-2's writer, wrapped as DCP's tests wrap one
        real_init(self, *a, **k)
        if self.path.endswith("step-2"):
            hook(self, go) if name == "finish" else hook(self, os.path.join(run, "step-1"), go)
    DataStatesWriter.__init__ = init
    ckpt.save(2, _state(rank))
    ckpt.wait()
    DataStatesWriter.__init__ = real_init
    dist.barrier()
    if rank == 1:
        assert load_manifest(StorageTier(os.path.join(run, "step-2"))).homes, "step-2 references nothing"
        _check(run, rank, go)
    ckpt.close()


@pytest.mark.parametrize("mode", [pytest.param(None, id="sync"), "thread"])
def test_a_checkpointer_node_keeps_the_base_its_rank_references_until_it_commits(tmp_path, mode):
    run_ranks(2, _checkpointer, str(tmp_path), mode)
