"""What a node-local restore reads when nodes' directories disagree (issue 69, cases 1 and 2):
the save the restore decides on (the newest committed one, or the one named) is the one every
node ends with, its manifest replacing one of another attempt where a node holds that, and
the restore reads it bit-exact from the nodes.

Nodes are simulated on one machine: one rank a node, each with a directory of its own."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.format.names import MANIFEST_NAME
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import manifest_head
from tests.dist import run_ranks


def _state(step: int, attempt: int) -> dict:
    return {"w": torch.full((512, 512), float(step * 10 + attempt)), "attempt": attempt}


def _empty() -> dict:
    return {"w": torch.zeros(512, 512), "attempt": -1}


def _node(base: str, rank: int) -> str:
    return os.path.join(base, f"node{rank}")


def _checkpointer(base: str, rank: int) -> Checkpointer:
    return Checkpointer([_node(base, rank)], node_local=True, replicas=1, node=f"n{rank}", async_mode=None)


def _attempts_of_step_4(rank, world, base):
    ck = _checkpointer(base, rank)
    for step, attempt in ((3, 0), (4, 1)):
        ck.save(step, _state(step, attempt))
        assert ck.wait_replicated(60)
    dist.barrier()
    if rank == 1:  # the backup of node 1 taken now holds attempt 1 of step 4
        shutil.copytree(os.path.join(_node(base, 1), "step-4"), os.path.join(base, "backup-step-4"), symlinks=True)
    dist.barrier()
    ck.save(4, _state(4, 2))  # the job rolled back and saved step 4 again: attempt 2, newer
    assert ck.wait_replicated(60)
    dist.barrier()
    ck.close()


def _restore(rank, world, base, step, attempt):
    ck = _checkpointer(base, rank)
    out = _empty()
    assert ck.load(out) == step
    assert out["attempt"] == attempt and torch.equal(out["w"], _state(step, attempt)["w"]), out["attempt"]
    ck.close()
    dist.barrier()
    heads = {manifest_head(StorageTier(os.path.join(_node(base, n), f"step-{step}"))).save_id for n in range(world)}
    assert len(heads) == 1, heads  # every node ends with that save's manifest


def test_a_fully_replicated_step_is_restored_though_a_node_holds_an_older_attempt(tmp_path):
    """Case 2: node 1's directory comes back from a backup holding attempt 1 of step 4; attempt
    2 was committed and fully replicated.  Before, the restore fell back to step 3."""
    base = str(tmp_path)
    run_ranks(2, _attempts_of_step_4, base)
    shutil.rmtree(os.path.join(_node(base, 1), "step-4"))
    shutil.copytree(os.path.join(base, "backup-step-4"), os.path.join(_node(base, 1), "step-4"), symlinks=True)
    run_ranks(2, _restore, base, 4, 2)


# ------------------------------------------------- case 1: a rollback, killed before node 1 commits

def _rolled_back_then_killed(rank, world, base):
    from dcp_datastates.tiers.local import LocalBackend
    path = os.path.join(_node(base, rank), "step-5")
    w = DataStatesWriter(path, replicas=1, node=f"n{rank}", overwrite=True)
    dcp.save(_state(5, 1), storage_writer=w)  # attempt Y, fully replicated
    assert w.wait_replicated(60)
    dist.barrier()
    if rank == 1:  # node 1's commit of the next save never happens: the job dies first
        orig = LocalBackend.commit

        def held(self, root, p, tmp_name, data, *, sync):
            if p == os.path.join(path, MANIFEST_NAME):
                signal.pause()
            return orig(self, root, p, tmp_name, data, sync=sync)
        LocalBackend.commit = held
    w = DataStatesWriter(path, replicas=1, node=f"n{rank}", overwrite=True)
    dcp.save(_state(5, 2), storage_writer=w)  # attempt X over it: dcp.save returns on both ranks
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _load_plain(rank, world, base, save_id):
    path = os.path.join(_node(base, rank), "step-5")
    out = _empty()
    dcp.load(out, storage_reader=DataStatesReader(path, node_local=True, node=f"n{rank}", save_id=save_id))
    assert out["attempt"] == 2 and torch.equal(out["w"], _state(5, 2)["w"]), out["attempt"]


@pytest.mark.parametrize("named", [False, True], ids=["newest", "save-id-named"])
def test_a_rolled_back_save_killed_before_a_node_committed_it_loads(tmp_path, named):
    """Case 1: attempt X replaced attempt Y of step 5 on node 0; the job died before node 1
    committed X there.  Every file of X is on the nodes: X loads, by the node-local reader and
    with ``save_id=X``, and node 1 ends with X's manifest."""
    base = str(tmp_path)
    with pytest.raises(AssertionError, match=r"exited with codes \[-9, -9\]"):
        run_ranks(2, _rolled_back_then_killed, base)
    x = manifest_head(StorageTier(os.path.join(_node(base, 0), "step-5"))).save_id
    y = manifest_head(StorageTier(os.path.join(_node(base, 1), "step-5"))).save_id
    assert x != y  # node 1 still holds Y's manifest
    run_ranks(2, _load_plain, base, x if named else None)
    assert manifest_head(StorageTier(os.path.join(_node(base, 1), "step-5"))).save_id == x
