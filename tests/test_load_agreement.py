"""One decision of what a load reads (issue 69, case 4): every rank of a ``dcp.load`` reads the
same checkpoint; ranks that name different ones fail at once, on every rank, with one line
naming both, and nothing is committed anywhere on the way (a node-local load's repair
included)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_datastates import CheckpointError, DataStatesReader, DataStatesWriter
from dcp_datastates.format.names import MANIFEST_NAME
from tests.dist import run_ranks


def _state(step: int) -> dict:
    return {"w": torch.full((256, 256), float(step)), "step": step}


def _node_dir(base: str, rank: int, step: int) -> str:
    return os.path.join(base, f"node{rank}", f"step-{step}")


def _names_differ(rank, world, base, node_local):
    where = (lambda s: _node_dir(base, rank, s)) if node_local else (lambda s: os.path.join(base, f"step-{s}"))
    extra = {"replicas": 1, "node": f"n{rank}"} if node_local else {}
    for step in (2, 3):
        w = DataStatesWriter(where(step), **extra)
        dcp.save(_state(step), storage_writer=w)
        if node_local:
            assert w.wait_replicated(120)
    dist.barrier()
    named = 3 if rank == 0 else (4 if node_local else 2)  # node-local: step 4 is on no node
    out = {"w": torch.zeros(256, 256), "step": 0}
    reader = DataStatesReader(where(named), node_local=True, node=f"n{rank}") if node_local \
        else DataStatesReader(where(named))
    with pytest.raises(BaseException) as ei:
        dcp.load(out, storage_reader=reader)
    text = str(ei.value)
    failures = getattr(ei.value, "failures", None)
    if failures:
        text += " ".join(str(getattr(f, "exc", f)) for f in failures.values())
    other = 4 if node_local else 2
    assert "step-3" in text and f"step-{other}" in text, text
    assert "different checkpoints" in text, text
    assert torch.equal(out["w"], torch.zeros(256, 256)), "a rank read a checkpoint it did not name"
    dist.barrier()
    if node_local:  # no node was given a manifest for a checkpoint no rank's load agreed on
        assert not os.path.exists(os.path.join(_node_dir(base, rank, 4), MANIFEST_NAME))


@pytest.mark.parametrize("node_local", [False, True], ids=["shared-directory", "node-local-replicas"])
def test_ranks_that_name_different_checkpoints_fail_naming_both(tmp_path, node_local):
    run_ranks(2, _names_differ, str(tmp_path), node_local)


def _node_not_given(rank, world, base):
    path = _node_dir(base, rank, 1)
    w = DataStatesWriter(path, replicas=1, node=f"n{rank}")
    dcp.save(_state(1), storage_writer=w)
    assert w.wait_replicated(120)
    dist.barrier()
    out = {"w": torch.zeros(256, 256), "step": 0}
    with pytest.raises(BaseException) as ei:  # the host name: both ranks seem to share one node
        dcp.load(out, storage_reader=DataStatesReader(path, node_local=True))
    text = str(ei.value) + " ".join(str(getattr(f, "exc", f)) for f in (getattr(ei.value, "failures", None) or {}).values())
    assert "pass DataStatesReader(node=...)" in text and "KeyError" not in text, text


def test_a_node_local_reader_whose_node_differs_from_the_writers_says_so(tmp_path):
    """Saved with ``node="n0"``/``"n1"``, loaded without ``node=``: both ranks take the host name,
    so two directories seem to be one node's.  Before: a raw ``KeyError: '.metadata'``."""
    run_ranks(2, _node_not_given, str(tmp_path))
