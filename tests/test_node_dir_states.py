"""The states a node's directory can be in, enumerated (issue 69): for two nodes (three in
``make test-long``), each combination of what a node holds of the newest step, restored on the
same world size, then saved again.  Checked for every combination:

* the newest save of the step fully present on some set of nodes is the one loaded, bit-exact
  (else the older step, which every node holds);
* nothing committed of another step is removed, and every node ends with the loaded save's
  manifest of the step, or none;
* the next save commits.

A node's directory of step 2 holds one of: nothing; attempt A (committed, older); attempt B
(committed, the newest of this run); B with the files of a newer attempt C that never
committed; B with malformed replica records; B with a byte of its own rank's data file flipped
(the other node's copy of that file is whole); a step of another run (D, committed after B).
With one replica each node holds every file of the saves it committed, so a save is fully
present wherever its manifest is.  Restarts on one node fewer (2 of 2, 2 of 3) read what the
survivors hold.  Nodes are simulated: one rank a node, a directory each."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import msgpack
import pytest
import torch
import torch.distributed as dist

from dcp_datastates import Checkpointer
from dcp_datastates.format.names import MANIFEST_NAME, rank_file_of, replica_record_of
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import manifest_head
from tests.disk import flip_byte
from tests.dist import run_ranks

STATES = ["none", "A", "B", "B+C", "B-bad-records", "B-bad-data", "D"]
AS_B = {"B+C": "B", "B-bad-records": "B", "B-bad-data": "B"}
NEWEST = ["D", "B", "A"]  # the saves of step 2, newest first (by commit time)


def _state(label: str, world: int, rank: int) -> dict:
    seed = sum(map(ord, label)) * 7 + rank
    g = torch.Generator().manual_seed(seed)
    return {f"w{rank}": torch.randn(128, 128, generator=g), "label": label}  # each rank's own tensor


def _ck(base: str, rank: int) -> Checkpointer:
    return Checkpointer([os.path.join(base, f"node{rank}")], node_local=True, replicas=1, node=f"n{rank}",
                        async_mode=None)


def _build(rank, world, lib):
    """Saves S1 (step 1), A and B (step 2) of one run and D (step 2) of another; copies of each
    node's step directories after each into ``lib``."""
    run, other = os.path.join(lib, "run"), os.path.join(lib, "other")
    ck = _ck(run, rank)
    saves = {}
    for step, label in ((1, "S1"), (2, "A"), (2, "B")):
        ck.save(step, _state(label, world, rank))
        assert ck.wait_replicated(60)
        dist.barrier()
        here = os.path.join(run, f"node{rank}", f"step-{step}")
        shutil.copytree(here, os.path.join(lib, label, f"node{rank}"))
        saves[label] = manifest_head(StorageTier(here)).save_id
    ck.close()
    ck = _ck(other, rank)
    ck.save(2, _state("D", world, rank))
    assert ck.wait_replicated(60)
    dist.barrier()
    here = os.path.join(other, f"node{rank}", "step-2")
    shutil.copytree(here, os.path.join(lib, "D", f"node{rank}"))
    saves["D"] = manifest_head(StorageTier(here)).save_id
    ck.close()
    if rank == 0:
        with open(os.path.join(lib, "saves.json"), "w") as f:
            json.dump(saves, f)


@pytest.fixture(scope="module")
def library(tmp_path_factory, request):
    libs = {}

    def get(nodes: int) -> str:
        if nodes not in libs:
            lib = str(tmp_path_factory.mktemp(f"library{nodes}"))
            run_ranks(nodes, _build, lib)
            libs[nodes] = lib
        return libs[nodes]
    return get


def _lay_out(lib: str, base: str, states: tuple[str, ...]) -> None:
    saves = json.load(open(os.path.join(lib, "saves.json")))
    for n, st in enumerate(states):
        node = os.path.join(base, f"node{n}")
        shutil.copytree(os.path.join(lib, "S1", f"node{n}"), os.path.join(node, "step-1"))
        if st == "none":
            continue
        src = {"A": "A", "D": "D"}.get(st, "B")
        step2 = os.path.join(node, "step-2")
        shutil.copytree(os.path.join(lib, src, f"node{n}"), step2)
        if st == "B+C":  # a newer attempt's data files, never committed
            for f in os.listdir(step2):
                if f.startswith("data-"):
                    shutil.copy(os.path.join(step2, f), os.path.join(step2, f.replace(saves["B"], "c0ffee00c0de")))
        elif st == "B-bad-records":
            for f in os.listdir(step2):
                if replica_record_of(f):
                    rec = msgpack.unpackb(open(os.path.join(step2, f), "rb").read(), raw=False, strict_map_key=False)
                    rec["sent"] = {k: 7 for k in rec["sent"]}
                    with open(os.path.join(step2, f), "wb") as out:
                        out.write(msgpack.packb(rec))
        elif st == "B-bad-data":  # the node's own rank's file: its one replica is on the next node
            for f in os.listdir(step2):
                if (rank_file_of(f) or (None,))[0] == n:
                    flip_byte(os.path.join(step2, f), os.path.getsize(os.path.join(step2, f)) // 2)


def _expected(states: tuple[str, ...], alive: int | None = None) -> str:
    """The newest save of step 2 of which some node holds a good copy of every file: with one
    replica, node ``n`` holds the files of ranks ``n`` and ``n - 1`` of each save it committed
    (in "B-bad-data", its copy of rank ``n``'s is damaged).  With ``alive``, only the first
    ``alive`` nodes are left (the others are lost)."""
    nodes = len(states)
    for save in NEWEST:
        good = {r for n, s in enumerate(states[:alive]) if AS_B.get(s, s) == save
                for r in (n, (n - 1) % nodes) if not (s == "B-bad-data" and r == n)}
        if good == set(range(nodes)):
            return save
    return "S1"


def _restore_then_save(rank, world, base, lib, want):
    """Restore on ``world`` ranks, one a node (nodes beyond ``world`` are lost), check, save again."""
    saves = json.load(open(os.path.join(lib, "saves.json")))
    s1 = manifest_head(StorageTier(os.path.join(base, f"node{rank}", "step-1")))
    ck = _ck(base, rank)
    out = {f"w{rank}": torch.zeros(128, 128), "label": ""}
    got = ck.load(out)
    assert got == (1 if want == "S1" else 2), (got, want)
    assert out["label"] == want and torch.equal(out[f"w{rank}"], _state(want, world, rank)[f"w{rank}"]), \
        (out["label"], want)
    dist.barrier()
    for n in range(world):  # every node: the loaded save's manifest of the step, or none
        head = manifest_head(StorageTier(os.path.join(base, f"node{n}", "step-2")))
        if want != "S1":
            assert head is not None and head.save_id == saves[want], (n, head, want)
        head1 = manifest_head(StorageTier(os.path.join(base, f"node{n}", "step-1")))
        assert head1 is not None and head1.save_id == saves["S1"], n  # step 1 untouched
    assert s1 is not None and s1.save_id == saves["S1"]
    ck.save(3, _state("S3", world, rank))  # and the run saves again
    assert ck.wait_replicated(60)
    assert os.path.exists(os.path.join(base, f"node{rank}", "step-3", MANIFEST_NAME))
    ck.close()


COMBOS_2 = list(itertools.product(STATES, repeat=2))


@pytest.mark.parametrize("states", COMBOS_2, ids=["-".join(c) for c in COMBOS_2])
def test_two_nodes_restore_the_newest_save_fully_present(tmp_path, library, states):
    lib = library(2)
    _lay_out(lib, str(tmp_path), states)
    run_ranks(2, _restore_then_save, str(tmp_path), lib, _expected(states))


COMBOS_3 = [c for c in itertools.product(STATES, repeat=3) if c[0] <= c[1] <= c[2]]  # up to node order


@pytest.mark.slow
@pytest.mark.parametrize("states", COMBOS_3, ids=["-".join(c) for c in COMBOS_3])
def test_three_nodes_restore_the_newest_save_fully_present(tmp_path, library, states):
    lib = library(3)
    _lay_out(lib, str(tmp_path), states)
    run_ranks(3, _restore_then_save, str(tmp_path), lib, _expected(states))


COMBOS_3_ON_2 = list(itertools.product(STATES, repeat=2))


@pytest.mark.slow
@pytest.mark.parametrize("states", COMBOS_3_ON_2, ids=["-".join(c) for c in COMBOS_3_ON_2])
def test_three_nodes_restarted_on_two_restore_the_newest_save_the_two_hold(tmp_path, library, states):
    """Three nodes saved; node 2 is lost and the job restarts on nodes 0 and 1, which hold
    between them every file of each save both committed (node 0 its rank's and rank 2's)."""
    run_three_on_two(tmp_path, library, states)


@pytest.mark.parametrize("states", [("B", "B"), ("B-bad-data", "B-bad-records"), ("A", "B+C")],
                         ids=["B-B", "bad-data-bad-records", "A-B+C"])
def test_three_nodes_restarted_on_two_in_ci(tmp_path, library, states):
    run_three_on_two(tmp_path, library, states)


def run_three_on_two(tmp_path, library, states) -> None:
    lib = library(3)
    _lay_out(lib, str(tmp_path), (*states, "none"))
    shutil.rmtree(os.path.join(str(tmp_path), "node2"))
    run_ranks(2, _restore_on_fewer, str(tmp_path), lib, _expected((*states, "none"), alive=2), 3)


def _restore_on_fewer(rank, world, base, lib, want, saved_world):
    """Restore ``saved_world`` ranks' tensors on ``world`` ranks (every rank reads them all)."""
    saves = json.load(open(os.path.join(lib, "saves.json")))
    ck = _ck(base, rank)
    out = {**{f"w{r}": torch.zeros(128, 128) for r in range(saved_world)}, "label": ""}
    got = ck.load(out)
    assert got == (1 if want == "S1" else 2), (got, want)
    for r in range(saved_world):
        assert torch.equal(out[f"w{r}"], _state(want, saved_world, r)[f"w{r}"]), (r, out["label"], want)
    assert out["label"] == want
    dist.barrier()
    for n in range(world):
        head = manifest_head(StorageTier(os.path.join(base, f"node{n}", "step-2")))
        if want != "S1":
            assert head is not None and head.save_id == saves[want], (n, head, want)
    ck.save(3, {**{k: v for k, v in out.items() if k != "label"}, "label": "S3"})
    assert world == 1 or ck.wait_replicated(60)  # one node: nowhere to replicate to
    assert os.path.exists(os.path.join(base, f"node{rank}", "step-3", MANIFEST_NAME))
    ck.close()


@pytest.mark.parametrize("state", STATES)
def test_one_node_fewer_restores_the_newest_save_its_survivor_holds(tmp_path, library, state):
    """Two nodes saved; node 1 is lost and the job restarts on node 0 alone (one replica: node
    0 holds both ranks' files of every save it committed, and reads them resharded)."""
    lib = library(2)
    _lay_out(lib, str(tmp_path), (state, "none"))
    shutil.rmtree(os.path.join(str(tmp_path), "node1"))
    run_ranks(1, _restore_on_fewer, str(tmp_path), lib, _expected((state, "none"), alive=1), 2)
