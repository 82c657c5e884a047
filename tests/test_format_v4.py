"""Format version 4: sharding rules and per-rank metadata parts, on real gloo ranks."""

import itertools
import math
import os
import random
import shutil
import struct
import time
import zlib
from functools import partial

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import Replicate, Shard

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader
from dcp_datastates.errors import CheckpointError, ManifestError
from dcp_datastates.format import manifest as manifest_mod
from dcp_datastates.format.checksum import Digests
from dcp_datastates.format.table import encode_table
from dcp_datastates.format.limits import MAX_WORLD, FormatViolation
from dcp_datastates.format.v4.chunk_lists import HeldColumns, HeldRecord
from dcp_datastates.format.manifest import MAGIC, decode_manifest
from dcp_datastates.format.model import Extent, Seg
from dcp_datastates.format.names import data_file_name, part_file_name
from dcp_datastates.format.v4.planner_paths import paths_from_wire, paths_wire
from dcp_datastates.format.v4.rank_files import (
    FileMap,
    GatheredFiles,
    PartRef,
    RankFileColumns,
    RankFiles,
    open_tail,
    seal_tail,
)
from dcp_datastates.format.records import Gathered, PartRecord, RareRecord
from dcp_datastates.format.v4.rules import Geometry, Mesh, RuleTable, ShardRule, salt
from dcp_datastates.planner import plan_reads
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.manifests import load_manifest
from dcp_datastates.format.assemble import PART_INDEX
from dcp_datastates.format.assemble import index_of as _index_for
from tests import workers
from tests.dist import run_ranks
from tests.manifest_tools import rewrite_manifest
from tests.clirun import cli


def test_rules_give_dtensors_boxes():
    """Every box a rule gives is DTensor's own for that mesh coordinate (uneven and empty
    shards, several mesh dimensions); overlap answers equal a sweep over every box."""
    utils = pytest.importorskip("torch.distributed.tensor._utils")  # private: may move between versions
    rng = random.Random(0)
    for _ in range(400):
        size = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        free = list(range(len(size)))
        dims = []
        for _ in shape:
            d = rng.choice([-1, *free])
            dims.append(d)
            if d >= 0:
                free.remove(d)
        g = Geometry(size, Mesh.of(shape, range(len(list(itertools.product(*map(range, shape)))))),
                     ShardRule(0, tuple(dims)), salt("w"), 4)
        placements = [Shard(d) if d >= 0 else Replicate() for d in dims]
        for coord in itertools.product(*map(range, shape)):
            local, offset = utils._compute_local_shape_and_global_offset(size, shape, list(coord), placements)
            assert g.box(g.chunk_of(coord)) == (tuple(offset), tuple(local)), (size, shape, dims, coord)
            if all(local):  # a non-empty box is found exactly (a same-size restart)
                assert g.exact(tuple(offset), tuple(local)) == g.chunk_of(coord)
        q = [(a, rng.randint(0, s - a)) for s in size for a in [rng.randint(0, max(0, s - 1))]]
        qo, qs = tuple(a for a, _ in q), tuple(b for _, b in q)
        sweep = [i for i in range(g.count()) if all(g.box(i)[1]) and all(qs) and
                 all(o < a + b and a < o + z for o, z, a, b in zip(*g.box(i), qo, qs))] if size else [0]
        assert g.overlapping([(qo, qs)]) == sweep


@pytest.fixture(scope="module")
def ruled(tmp_path_factory):
    ours = str(tmp_path_factory.mktemp("v4") / "ck")
    run_ranks(4, workers.rules_save, ours)
    return ours


def test_rules_save_once_and_reshard(ruled):
    ours = ruled
    m = load_manifest(StorageTier(ours))
    assert m.version == 4 and sorted(m.index.parts) == [0, 1, 2, 3]
    ruled = {t.fqn for t in m.index.tensors if t.rule is not None}
    assert ruled == {"row", "tiny", "col", "rep", "hsdp", "grid", "row_cols", "row_hsdp", "row_again",
                     "row_square", "row_tall"}
    plain = next(i for i, t in enumerate(m.index.tensors) if t.fqn == "plain")
    listed = m.index.listed
    assert listed.owner[listed.rows(plain)].tolist() == [-1]  # a small plain tensor: its record in the index
    # a replicated box is written by one replica only, the first for a small box: "rep" by rank 0,
    # each "hsdp" row block by the rank of the first replica holding it (mesh (2, 2): ranks 0, 1)
    at = {t.fqn: i for i, t in enumerate(m.index.tensors)}
    assert {k for k, i in at.items() if m.index.held.has(i)} == {"rep", "hsdp", "row_hsdp", "row_square"}
    held = [c for k in ("rep", "hsdp") for c in m.tensors[k].chunks]  # from the index: no part read
    assert held and not m.index._loaded
    holders = {k: [r for r in range(4) if k in m.index.part(r).tensors] for k in ("rep", "hsdp")}
    assert holders == {"rep": [0], "hsdp": [0, 1]}, holders
    run_ranks(3, workers.rules_load, ours, True)
    run_ranks(2, workers.rules_load, ours, False)


def test_a_held_record_in_an_earlier_saves_file(tmp_path):
    """An incremental save whose replicated box is unchanged: the box's record travels by name
    (``RareRecord.held``), and the index's record names the earlier save's file; both saves
    load on both ranks."""
    run_ranks(2, workers.held_incremental, str(tmp_path))
    first, second = (load_manifest(StorageTier(str(tmp_path / f"step-{i}"))) for i in range(2))
    rep = [next(i for i, t in enumerate(m.index.tensors) if t.fqn == "rep") for m in (first, second)]
    assert all(m.index.held.has(i) for m, i in zip((first, second), rep))
    files = [{g.file for c in m.tensors["rep"].chunks for g in c.extent.segs} for m in (first, second)]
    assert files[0] and files[1] == files[0] and all(first.save_id in f for f in files[1])
    assert {g.file for c in second.tensors["row"].chunks for g in c.extent.segs}.isdisjoint(files[0])


def test_a_box_that_is_one_listed_chunk_is_found_directly(ruled):
    """A rank whose box is exactly one listed chunk (a same-size restart of a tensor without a
    rule) gets that chunk alone, as the sweep over every chunk finds it; other boxes are swept."""
    index = load_manifest(StorageTier(ruled)).index
    t = next(i for i, x in enumerate(index.tensors) if x.fqn == "twice")
    assert index.tensors[t].rule is None and index.listed.count(t) == 4
    for i in range(4):
        o, z = index.box_at(t, i)
        assert index.exact(t, (o, z)) == i
        assert index.overlapping(t, [(o, z)]) == index.listed.overlapping(t, [(o, z)]) == [i]
        wide = (o, (z[0] * 2, z[1]))  # starts at a chunk, but spans the next one too
        assert index.overlapping(t, [wide]) == index.listed.overlapping(t, [wide]) == ([i, i + 1] if i < 3 else [i])


def test_a_tensor_the_size_of_one_chunk_is_a_size_mismatch(ruled):
    """A tensor whose shape is one saved chunk's box (the first rows of a sharded tensor) is
    refused as DCP's planner refuses it, not filled from that chunk."""
    out = {"row": torch.zeros(3, 6)}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(out, storage_reader=DataStatesReader(ruled), planner=DataStatesLoadPlanner(), no_dist=True)
    assert "Size mismatch" in str(ei.value.failures[0]) and "row" in str(ei.value.failures[0])
    assert not out["row"].any()


def test_planned_reads_are_dcps(ruled):
    """Our plan of any boxes (one or several, across chunks, of rules and listed tensors) reads
    what DCP's resharding reads over every chunk, item for item."""
    md = DataStatesReader(ruled).read_metadata()
    rng = random.Random(3)

    def key(ri):
        return (ri.dest_index.offset, ri.dest_index.index, ri.dest_offsets, ri.storage_index.offset,
                ri.storage_offsets, ri.lengths)

    for fqn, tmd in md.state_dict_metadata.items():
        if not hasattr(tmd, "chunks"):
            continue
        size = tuple(tmd.size)
        for _ in range(60):
            boxes = []
            for _ in range(rng.randint(1, 3)):
                lo = [rng.randint(0, s - 1) for s in size]
                boxes.append((tuple(lo), tuple(rng.randint(1, s - a) for s, a in zip(size, lo))))
            local = [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in boxes]
            want = sorted(create_read_items_for_chunk_list(fqn, tmd, local), key=key)
            got = sorted(plan_reads(fqn, tmd, boxes), key=key)
            assert [key(x) for x in got] == [key(x) for x in want], (fqn, boxes)
            for ri in got:  # the chunk number each names is the saved chunk at its offsets
                assert tuple(tmd.chunks[ri.storage_index.index].offsets) == tuple(ri.storage_index.offset)
        for i, c in enumerate(tmd.chunks):  # a box that is one saved chunk (a same-size restart)
            box = (tuple(c.offsets), tuple(c.sizes))
            if all(box[1]):
                local = [ChunkStorageMetadata(c.offsets, c.sizes)]
                want = create_read_items_for_chunk_list(fqn, tmd, local)
                got = plan_reads(fqn, tmd, [box])
                assert [key(x) for x in got] == [key(x) for x in want] and got[0].storage_index.index == i, (fqn, box)
    _planned_with_one_memo_are_dcps(md, rng, key)
    m = load_manifest(StorageTier(ruled))
    for r in range(4):  # a part's records (a version 3 table): the exact box found, a shifted one not
        for fqn, entry in m.index.part(r).tensors.items():
            for i, (o, z) in enumerate(entry.boxes()):
                assert entry.exact((o, z)) == i, (r, fqn, o, z)
                if o:
                    assert entry.exact(((o[0] + 1, *o[1:]), z)) is None


def _planned_with_one_memo_are_dcps(md, rng, key) -> None:
    """The same boxes planned for every tensor of one size with one memo, as a rank's plan
    shares it (tensors of that size under other rules, and under the same rule), read what
    DCP's resharding reads, item for item."""
    by_size: dict[tuple, list[str]] = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if hasattr(tmd, "chunks") and tmd.size:
            by_size.setdefault(tuple(tmd.size), []).append(fqn)
    assert max(len(v) for v in by_size.values()) >= 6  # "row" and its five namesakes
    memo: dict = {}
    for size, names in by_size.items():
        for _ in range(40):
            lo = [rng.randint(0, s - 1) for s in size]
            boxes = [(tuple(lo), tuple(rng.randint(1, s - a) for s, a in zip(size, lo)))]
            if rng.random() < 0.3:  # a box that is one saved chunk of the first tensor
                boxes = [tuple(map(tuple, rng.choice([(c.offsets, c.sizes)
                                                      for c in md.state_dict_metadata[names[0]].chunks])))]
            local = [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in boxes]
            for fqn in names:
                tmd = md.state_dict_metadata[fqn]
                want = sorted(create_read_items_for_chunk_list(fqn, tmd, local), key=key)
                got = sorted(plan_reads(fqn, tmd, boxes, memo), key=key)
                assert [key(x) for x in got] == [key(x) for x in want], (fqn, boxes)
                for ri in got:  # the chunk number each names is the saved chunk at its offsets
                    assert tuple(tmd.chunks[ri.storage_index.index].offsets) == tuple(ri.storage_index.offset)
    assert memo  # the rules' tensors shared it


@pytest.mark.parametrize("save_world,load_world", [(3, 2), (2, 3)])
def test_fsdp2_with_rules_reshards(tmp_path, save_world, load_world):
    ours, ref = str(tmp_path / "ours"), str(tmp_path / "ref")
    run_ranks(save_world, workers.save_fsdp, ours, ref, True, True)
    assert load_manifest(StorageTier(ours)).version == 4
    run_ranks(load_world, workers.load_fsdp_and_compare, ours, ref, True)


def _part_name(ck: str, rank: int) -> str:
    return next(f for f in os.listdir(ck) if f.startswith(f"part-r{rank:05d}-"))


def _records(ck: str) -> None:
    """Every chunk record of every tensor (reads every part)."""
    m = DataStatesReader(ck)
    m.read_metadata()
    for t in m.manifest.tensors.values():
        t.chunks


def _part_rows(body) -> np.ndarray:
    return np.nonzero(np.frombuffer(body["rank_files"]["stripe"], "<i8") == -1)[0]


def _ranks(body) -> np.ndarray:
    return np.cumsum(np.frombuffer(body["rank_files"]["rank"], "<i8"))  # stored as steps


def _bump(cols: dict, key: str, row: int, by: int) -> None:
    a = np.frombuffer(cols[key], "<i8").copy()
    a[row] += by
    cols[key] = a.tobytes()


def _ranked_name(body, row: int) -> str:
    rank, stripe = int(_ranks(body)[row]), int(np.frombuffer(body["rank_files"]["stripe"], "<i8")[row])
    return part_file_name(rank, body["save_id"]) if stripe < 0 else data_file_name(rank, body["save_id"], stripe)


@pytest.mark.parametrize("case", ["mesh-rank", "rule-dim", "part-size", "save-id", "rank-file-twice",
                                  "file-by-both", "index-ranks", "rank-step-out", "owner", "two-rules",
                                  "inline-missing", "inline-outside", "listed-overlap", "part-head-long", "ruled-size",
                                  "part-head-short", "held-twice", "held-missing", "held-past-file", "held-bytes"])
def test_hostile_index_is_refused(ruled, tmp_path, case):
    ck = str(tmp_path / "ck")
    shutil.copytree(ruled, ck)

    def mutate(body):
        if case == "mesh-rank":
            body["meshes"][0][1] = ["list", 0, 1, 2, 99]
        elif case == "rule-dim":
            rule = body["tensor_list"]["rules"][0]
            rule[1] = [5] * len(rule[1])
        elif case == "part-size":  # the part's row in rank_files: a size its head's tail length contradicts
            _bump(body["rank_files"], "size", _part_rows(body)[0], 1)
        elif case == "save-id":  # names are made from the save id: one that is not a plain id names nothing
            body["save_id"] = "../../etc/x"
        elif case == "rank-file-twice":
            rf = body["rank_files"]
            for k in rf:
                rf[k] += rf[k][:8]
        elif case == "file-by-both":  # a file named by rank also listed by name
            body["files"].append([_ranked_name(body, 0), 1])
        elif case == "rank-step-out":  # steps that each lie in range but add up outside the world
            rf = body["rank_files"]
            rf["rank"] = np.full(len(rf["rank"]) // 8, 3, "<i8").tobytes()
        elif case == "index-ranks":
            body["ranks"] = [0]
        elif case == "held-twice":  # two records of one replicated box
            h = body["held"]
            for k in ("tensor", "chunk", "tail_at", "nsegs", "seg_file", "seg_offset", "seg_nbytes"):
                h[k] = h[k][:8] + h[k]
        elif case == "held-missing":  # a replicated box without its record (its tensor keeps others)
            h = body["held"]
            t, nsegs = np.frombuffer(h["tensor"], "<i8"), np.frombuffer(h["nsegs"], "<i8")
            j = next(i for i in range(len(t)) if (t == t[i]).sum() > 1)
            a, k = int(nsegs[:j].sum()), int(nsegs[j])
            for key in ("tensor", "chunk", "tail_at", "nsegs"):
                h[key] = h[key][:8 * j] + h[key][8 * (j + 1):]
            for key in ("seg_file", "seg_offset", "seg_nbytes"):
                h[key] = h[key][:8 * a] + h[key][8 * (a + k):]
        elif case == "held-past-file":
            body["held"]["seg_offset"] = np.full(len(body["held"]["seg_offset"]) // 8, 1 << 40, "<i8").tobytes()
        elif case == "held-bytes":  # a record that holds fewer bytes than its box
            n = np.frombuffer(body["held"]["seg_nbytes"], "<i8")
            body["held"]["seg_nbytes"] = np.maximum(n - 4, 0).astype("<i8").tobytes()
        elif case == "part-head-long":  # a head that would run past the part
            size = int(np.frombuffer(body["rank_files"]["size"], "<i8")[_part_rows(body)[0]])
            _bump(body["parts"], "head", 0, size + 1 - int(np.frombuffer(body["parts"]["head"], "<i8")[0]))
        elif case == "part-head-short":  # a head cut short: its digest cannot match
            _bump(body["parts"], "head", 0, -1)
        elif case == "owner":
            body["explicit"]["owner"] = np.full(len(body["explicit"]["owner"]) // 8, 7, "<i8").tobytes()
        elif case == "listed-overlap":  # "plain" listed twice over the same box (inline and in part 0)
            ex = body["explicit"]
            ex["tensor"], ex["owner"] = ex["tensor"] * 2, ex["owner"] + np.zeros(1, "<i8").tobytes()
            ex["offsets"], ex["sizes"] = ex["offsets"] * 2, ex["sizes"] * 2
        elif case == "ruled-size":  # a ruled tensor one wider: its rule's boxes are not those its parts hold
            tl = body["tensor_list"]
            t = next(i for i, r in enumerate(np.frombuffer(tl["rule"], "<i8")) if r >= 0)
            at = int(np.frombuffer(tl["ndim"], "u1")[:t + 1].sum()) - 1  # the last dimension of tensor t
            _bump(tl, "size", at, 1)
        elif case == "inline-missing":
            body["inline"] = encode_table({}, {}, None)
        elif case == "inline-outside":  # the inline chunk's bytes past the end of its file
            body["inline"]["seg_offset"] = np.full(1, 1 << 40, "<i8").tobytes()
        else:
            names = body["tensor_list"]["names"]
            names[1] = names[0]
    rewrite_manifest(ck, mutate, version=4)
    with pytest.raises(ManifestError) as e:
        _records(ck)
    assert "checkpoint=" in str(e.value)
    assert _REFUSED.get(case, "") in str(e.value)


_REFUSED = {"save-id": "cannot name files", "rank-file-twice": "lists a rank's file twice",
            "file-by-both": "also listed by name", "index-ranks": "its parts give them",
            "rank-step-out": "names a rank outside", "held-twice": "each once", "held-missing": "no held chunk",
            "part-head-long": "head is longer than the part", "ruled-size": "has no chunk of size"}


def test_damaged_or_foreign_part_is_refused_and_a_good_copy_used(ruled, tmp_path):
    ck, backup = str(tmp_path / "ck"), str(tmp_path / "backup")
    shutil.copytree(ruled, ck)
    shutil.copytree(ruled, backup)
    name = _part_name(ck, 1)
    with open(os.path.join(ck, name), "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ManifestError, match="metadata part") as e:
        _records(ck)
    assert name in str(e.value)
    r = DataStatesReader(ck)  # a part that failed is not read again by the same reader
    r.read_metadata()
    with pytest.raises(ManifestError, match="metadata part"):
        r.manifest.index.part(1)
    r.manifest.index.loaders = []  # nothing left to read with: the kept failure is what answers
    with pytest.raises(ManifestError, match="refused: manifest checksum mismatch"):
        r.manifest.index.part(1)
    r = DataStatesReader(ck, fallback=[backup])
    r.read_metadata()
    for t in r.manifest.tensors.values():
        t.chunks  # rank 1's part comes from the backup tier, pinned by the index's digest
    # another rank's part under this rank's name, the index giving its sizes: refused, it names its rank
    shutil.copy(os.path.join(ck, _part_name(ck, 2)), os.path.join(ck, name))

    def as_rank_2(body):
        rows = _part_rows(body)
        ranks = _ranks(body)
        for k, cols, pos in (("size", body["rank_files"], rows), ("head", body["parts"], range(len(rows)))):
            a = np.frombuffer(cols[k], "<i8").copy()
            at = {int(ranks[r]): i for i, r in zip(pos, rows)}
            a[at[1]] = a[at[2]]
            cols[k] = a.tobytes()
    rewrite_manifest(ck, as_rank_2, version=4)
    with pytest.raises(ManifestError, match="metadata part .*not rank 1 of save"):
        _records(ck)


def test_held_records_are_sorted_and_each_box_once():
    """The coordinator writes held records in (tensor, chunk) order, each record's segments with
    it, and refuses two records of one box instead of committing an index no rank can read."""
    seg = lambda off, n: Seg("f", off, n)  # noqa: E731
    ext = lambda *segs: Extent(list(segs), sum(g.nbytes for g in segs), Digests(bytes(16)))  # noqa: E731
    rank0 = (HeldRecord.of("b", 0, ext(seg(0, 8)), 0),)  # two ranks' records, gathered as the coordinator does
    rank1 = (HeldRecord.of("a", 2, ext(seg(8, 4096), seg(4104, 8)), 32), HeldRecord.of("a", 1, ext(seg(5000, 8)), 16))
    w = HeldColumns.of([*rank0, *rank1], {"a": 0, "b": 1}, {"f": 0}).to_wire()
    col = lambda k: np.frombuffer(w[k], "<i8").tolist()  # noqa: E731
    assert (col("tensor"), col("chunk"), col("nsegs"), col("tail_at")) == ([0, 0, 1], [1, 2, 0], [1, 2, 1], [16, 32, 0])
    assert col("seg_offset") == [5000, 8, 4104, 0] and col("seg_nbytes") == [8, 4096, 8, 8]
    again = HeldRecord.of("a", 1, ext(seg(0, 8)), 0)
    with pytest.raises(FormatViolation, match="two ranks"):
        HeldColumns.of([*rank0, *rank1, again], {"a": 0, "b": 1}, {"f": 0}).to_wire()


def test_packed_records_gather_as_named_ones():
    """The coordinator reads every rank's packed rows at once: own files and parts become the
    rank-file columns, held records in own files their columns, the same as the records made
    by name; a record in another save's file travels by name.  Rows that do not add up, a
    segment in a file its rank did not write, or a part of another save are refused."""
    sid, other = "0123456789ab", "ba9876543210"
    old = data_file_name(1, other, 0)  # an earlier save's file, which an incremental save refers to
    seg = lambda f, off, n: Seg(f, off, n)  # noqa: E731
    ext = lambda *segs: Extent(list(segs), sum(g.nbytes for g in segs), Digests(bytes(16)))  # noqa: E731
    d = partial(data_file_name, save_id=sid)
    ranks = {  # rank: own files (stripe, size), held records
        5: ([(0, 900), (1, 40)], [HeldRecord.of("a", 3, ext(seg(d(5, stripe=1), 0, 8)), 0),
                                  HeldRecord.of("b", 0, ext(seg(d(5, stripe=0), 8, 4096), seg(d(5, stripe=1), 8, 8)), 32)]),
        2: ([(0, 500)], []),
        7: ([(0, 64)], [HeldRecord.of("a", 1, ext(seg(old, 64, 8)), 16), HeldRecord.of("a", 0, ext(seg(d(7, stripe=0), 0, 8)), 0)]),
    }
    recs = []
    for r, (own, held) in ranks.items():
        ref = PartRef(r, part_file_name(r, sid), 1000 + r, 100 + r)
        rare = RareRecord(files={old: 72} if r == 7 else {})
        recs.append(PartRecord.of(r, sid, ref, sum(z for _, z in own), [(s, z, d(r, stripe=s)) for s, z in own], held, rare))
    assert [rec.rare is None for rec in recs] == [True, True, False] and recs[2].held_keys == ("a",)
    g = Gathered.of(recs, sid)
    assert g.ranks.tolist() == [5, 2, 7] and g.owned == 1504 and g.rows_of([2, 0]) == [3, 0, 1]
    files = GatheredFiles({old: 72}, g.files)
    want = [old, d(5, stripe=0), d(5, stripe=1), d(2, stripe=0), d(7, stripe=0)] + [part_file_name(r, sid) for r in (5, 2, 7)]
    assert list(files) == want and list(files.values()) == [72, 900, 40, 500, 64, 1005, 1002, 1007]
    assert g.files.part_head.tolist() == [105, 102, 107]
    at, fidx = {"a": 0, "b": 1}, files.positions()
    got = HeldColumns.join(g.held(at, 1), HeldColumns.of(list(recs[2].rare.held), at, fidx)).to_wire()
    assert got == HeldColumns.of([h for _, held in ranks.values() for h in held], at, fidx).to_wire()
    assert np.frombuffer(got["seg_file"], "<i8").tolist() == [4, 0, 2, 1, 2]  # a0, a1, a3, b0 (two segments)
    with pytest.raises(FormatViolation, match="not this save's"):
        Gathered.of(recs, other)
    bad = PartRecord(recs[0].rows[:-8], recs[0].held_keys)
    with pytest.raises(FormatViolation, match="does not add up"):
        Gathered.of([bad], sid)
    rows = np.frombuffer(recs[0].rows, "<i8").copy()
    rows[-3] = 2  # rank 5's last segment in its third own file, which it has not
    with pytest.raises(FormatViolation, match="did not write"):
        Gathered.of([PartRecord(rows.tobytes(), recs[0].held_keys)], sid)
    with pytest.raises(FormatViolation, match="keys do not add up"):
        Gathered.of([PartRecord(recs[0].rows, ("a",))], sid)
    with pytest.raises(FormatViolation, match="which the save has not"):
        g.held({"a": 0}, 1)


def test_file_map_names_rank_files_only_when_asked():
    """An index's files by name: rank files found by reading the name (one spelling only, this
    save only), named files as given; walking it gives every name and size in order."""
    sid, other = "0123456789ab", "ba9876543210"
    col = partial(np.array, dtype=np.int64)  # own files of ranks 3, 0, 7 (two), then parts of 0, 3, 7
    cols = RankFileColumns(sid, col([3, 0, 7, 7]), col([0, 0, 0, 2]), col([103, 100, 107, 50]),
                           col([0, 3, 7]), col([4000, 4003, 4007]), col([100, 100, 100]))
    ranked = RankFiles(cols.to_wire()["rank_files"], 8, sid)
    old = data_file_name(1, other, 0)  # an earlier save's file, which an incremental save refers to
    files = FileMap({old: 9}, ranked)
    want = {old: 9, **dict(zip(cols.file_names(), cols.file_sizes()))}
    assert dict(files.items()) == want and list(files) == list(want) and len(files) == 8 and files == want
    assert files[data_file_name(7, sid, 2)] == 50 and files[part_file_name(3, sid)] == 4003 and files[old] == 9
    for absent in (data_file_name(7, sid, 1), data_file_name(7, other, 0), part_file_name(5, sid),
                   "part-r000003-" + sid + ".dsm", part_file_name(3, sid) + ".part", "x", data_file_name(2, sid, 0)):
        assert absent not in files and files.get(absent) is None, absent
    positions = files.positions()
    assert [positions[i] for i in range(len(positions))] == list(want.items())
    assert positions.sizes().tolist() == list(want.values())
    with pytest.raises(FormatViolation, match="also listed by name"):
        FileMap({part_file_name(0, sid): 4000}, ranked)
    written = GatheredFiles({old: 9}, cols)  # the coordinator's side: the same files in the same order
    assert list(written) == list(want) and dict(written.items()) == want and written == files and len(written) == 8
    assert written.positions() == {name: i for i, name in enumerate(want)}
    assert written[part_file_name(7, sid)] == 4007 and written[data_file_name(7, sid, 2)] == 50
    assert data_file_name(2, sid, 0) not in written and sum(written.values()) == sum(want.values())
    every = {name: i for i, name in enumerate(want)}
    near = written.positions_near([1, 3])  # the rows of rank 0's file and rank 7's second
    assert dict(near) == {old: 0, data_file_name(0, sid, 0): 2, data_file_name(7, sid, 2): 4}
    assert near[data_file_name(3, sid, 0)] == 1 and dict(near) == every  # a miss: from the full map
    with pytest.raises(KeyError):
        GatheredFiles({old: 9}, cols).positions_near([])[data_file_name(2, sid, 0)]


def test_coordinator_refuses_a_part_of_another_save():
    """A rank's part record naming another save's part (a rank left over from an earlier save)
    fails the commit: the index would name this save's part of that rank, which is not there."""
    ref = PartRef(0, part_file_name(0, "aaaaaaaaaaaa"), 100, 50)
    rec = PartRecord.of(0, "aaaaaaaaaaaa", ref, 0, [], [], RareRecord())
    results = [[WriteResult(index=PART_INDEX, size_in_bytes=100, storage_data=rec)]]
    with pytest.raises(CheckpointError, match="not this save's"):
        _index_for(Metadata(state_dict_metadata={}), results, "bbbbbbbbbbbb", RuleTable.of([], {}), "/ck")
    _index_for(Metadata(state_dict_metadata={}), results, "aaaaaaaaaaaa", RuleTable.of([], {}), "/ck")


def test_part_tail_names_its_save_and_rank():
    """A part's tail is used only for the save and rank its footer names, and only whole."""
    digests = os.urandom(64)
    tail = seal_tail(digests, "0123456789ab", 2)
    assert open_tail(tail, "0123456789ab", 2) == digests
    for sid, rank, data, why in [("0123456789ab", 1, tail, "save 0123456789ab rank 2"),
                                 ("ba9876543210", 2, tail, "save 0123456789ab rank 2"),
                                 ("0123456789ab", 2, bytes([tail[0] ^ 1]) + tail[1:], "do not match their footer"),
                                 ("0123456789ab", 2, tail[-10:], "shorter than its footer")]:
        with pytest.raises(FormatViolation, match=why):
            open_tail(data, sid, rank)


def test_owner_is_the_rank_at_the_writers_coordinate():
    """``Geometry.owner`` (by strides where all boxes are alike) names the mesh rank at
    ``writer``'s coordinate for every chunk, over random meshes, rules and sizes."""
    rng = random.Random(7)
    for _ in range(300):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        ranks = rng.sample(range(200), math.prod(shape))
        ndim = rng.randint(1, 3)
        free = list(range(ndim))
        rng.shuffle(free)
        dims = tuple(free.pop() if free and rng.random() < 0.6 else -1 for _ in shape)
        size = tuple(rng.choice([0, 1, 3, 8, 64, 1 << 14]) for _ in range(ndim))
        g = Geometry(size, Mesh.of(shape, ranks), ShardRule(0, dims), rng.randrange(1 << 32), rng.choice([1, 4]))
        for i in range(g.count()):
            flat = 0
            for n, c in zip(shape, g.writer(i)):
                flat = flat * n + c
            assert g.owner(i) == ranks[flat], (shape, dims, size, i)


def test_replica_that_writes_a_box():
    """A small replicated box is written by the first replica; large ones spread over the
    replicas, each keeping its shard coordinate."""
    mesh = Mesh.of((4, 2), range(8))  # 4 replicas x 2 shards
    small = Geometry((64, 4), mesh, ShardRule(0, (-1, 0)), salt("s"), 4)
    assert [small.writer(i) for i in range(2)] == [(0, 0), (0, 1)]
    big = Geometry((1 << 16, 4), mesh, ShardRule(0, (-1, 0)), salt("b"), 4)  # 512 KiB a box
    writers = [big.writer(i) for i in range(2)]
    assert [w[1] for w in writers] == [0, 1] and writers[1][0] == (writers[0][0] + 1) % 4
    assert [big.owner(i) for i in range(2)] == [w[0] * 2 + w[1] for w in writers]


def test_tools_read_every_part(ruled, tmp_path):
    """`verify` checks every chunk of a format 4 checkpoint (all parts), and names a damaged one."""
    ck = str(tmp_path / "ck")
    shutil.copytree(ruled, ck)
    r = cli("verify", ck)
    assert "ok" in (r.stdout + r.stderr).lower()
    data = next(f for f in sorted(os.listdir(ck)) if f.startswith("data-r00002-"))
    with open(os.path.join(ck, data), "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    r = cli("verify", ck, check=False)
    assert r.returncode != 0 and data in (r.stdout + r.stderr), r.stdout + r.stderr
    part = _part_name(ck, 1)  # and a damaged part head: both reported, the part once
    with open(os.path.join(ck, part), "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 1]))
    r = cli("verify", ck, check=False)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and data in out and out.count(part) == 1, out


def test_part_digests_are_read_with_the_data(ruled, tmp_path):
    """A part's block digests (its tail) are not read to plan a load, only with the data they
    check; a damaged tail is refused naming the part, and a good copy on another tier is used."""
    ck, backup = str(tmp_path / "ck"), str(tmp_path / "backup")
    shutil.copytree(ruled, ck)
    shutil.copytree(ruled, backup)
    name = _part_name(ck, 1)
    with open(os.path.join(ck, name), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    reads = []

    class Counted(StorageTier):  # the storage interface, wrapped: which byte ranges of which parts are read
        def read_into(self, fname, offset, buf):
            if fname.startswith("part-"):
                reads.append((fname, offset, offset + len(buf)))
            return super().read_into(fname, offset, buf)
    m = load_manifest(Counted(ck))
    index = m.index
    chunks = [c for t in m.tensors.values() for c in t.chunks]  # every record: the heads only
    assert reads and all(start == 0 and end == index.parts[int(f[6:11])].head for f, start, end in reads)
    ref = index.parts[1]
    mine = [c for c in index.part(1).tensors.values() for c in c.chunks]
    with pytest.raises(ManifestError, match="block digests of metadata part") as e:
        mine[0].extent.sums[0]
    assert name in str(e.value) and reads[-1] == (name, ref.head, ref.size)
    tried = len(reads)  # the same bad tail behind every other chunk of the part: not read again
    for c in mine[1:]:
        with pytest.raises(ManifestError, match="block digests of metadata part"):
            c.extent.sums[0]
    assert len(mine) > 1 and len(reads) == tried
    assert len(chunks) >= len(mine)
    r = DataStatesReader(ck, fallback=[backup])  # the tail comes from the backup, pinned by the head's digest
    r.read_metadata()
    assert all(len(c.extent.sums[0]) == 16 for c in r.manifest.index.part(1).tensors["row"].chunks)
    with open(os.path.join(ck, name), "rb") as f:  # a part alone is not a manifest a reader accepts
        head = f.read(ref.head)
    with pytest.raises(ManifestError, match="read it through the index"):
        decode_manifest(head)


def test_packed_body_is_bounded(monkeypatch):
    """The packed fields of an index inflate only within the manifest limit, whole, once, and
    never over the header's fields."""
    def craft(packed):
        payload = msgpack.packb({"format": "dcp-datastates", "version": 4, "save_id": "x", "created_unix": 0,
                                 "packed": packed}, use_bin_type=True)
        return MAGIC + payload + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload))

    inner = zlib.compress(msgpack.packb({"world_size": 1, "pad": b"\0" * 10000}, use_bin_type=True))
    with pytest.raises(ManifestError, match="truncated"):
        decode_manifest(craft(inner[:-4]))
    with pytest.raises(ManifestError, match="repeats a field"):
        decode_manifest(craft(zlib.compress(msgpack.packb({"version": 3}))))
    with pytest.raises(ManifestError, match="packs another"):  # no chain of inflations
        decode_manifest(craft(zlib.compress(msgpack.packb({"packed": inner}, use_bin_type=True))))
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 4096)
    with pytest.raises(ManifestError, match="inflates beyond 4096"):
        decode_manifest(craft(inner))


def test_flattening_paths_round_trip_by_pattern():
    """DCP's flattening paths are stored as a few patterns cutting the names at dots; any path
    that is not its name cut at dots is kept as it is; a pattern that does not fit is refused."""
    pd = {"model.layers.0.w": ["model", "layers.0.w"], "optim.state.layers.0.w.exp_avg":
          ["optim", "state", "layers.0.w", "exp_avg"], "opt.param_groups.0.lr": ["opt", "param_groups", 0, "lr"],
          "x.y": ["x.y"], "a.b.c": ["a", "b", "c"], "odd": ["o", "dd"], "v": ["v"], "n.007": ["n", "007"]}
    names = [k for k in pd if k != "v"]
    wire, rest = paths_wire(names, pd)
    assert rest == {"odd": ["o", "dd"], "v": ["v"]}
    assert {**paths_from_wire(wire, names), **rest} == pd
    assert all(type(x) is int for x in paths_from_wire(wire, names)["opt.param_groups.0.lr"][2:3])
    for bad in ([[5], []], [None, [0]]):  # a cut past the name's dots; a word made an index
        with pytest.raises(FormatViolation):
            paths_from_wire({"patterns": [bad], "of": np.zeros(1, "<i8").tobytes()}, ["model.w"])


@pytest.mark.parametrize("ranks", ["full", "stepped", "distinct"])
def test_meshes_are_checked_without_walking_their_ranks(ruled, tmp_path, ranks):
    """Issue 35, case 7: an index whose world size is at its limit and whose meshes each span
    millions of ranks (copies of one, stepped ones, or many distinct ones; checksums valid) is
    refused without walking each mesh's ranks: the work is bounded by the index's own size.
    Walking them took about 0.24 s a mesh, so 200 such meshes took about 50 s; the bound below
    is 20x the 0.5 s the refusal takes, a check of the complexity, not a timing goal."""
    ck = str(tmp_path / "ck")
    shutil.copytree(ruled, ck)

    def mutate(body):
        body["world_size"] = MAX_WORLD
        if ranks == "full":
            body["meshes"] = [[[MAX_WORLD], [0, MAX_WORLD, 1]]] * 200
        elif ranks == "stepped":
            body["meshes"] = [[[MAX_WORLD // 2], [0, MAX_WORLD, 2]]] * 200
        else:
            n = MAX_WORLD // 2 - 100
            body["meshes"] = [[[n], [k, k + 2 * n, 2]] for k in range(200)]
    rewrite_manifest(ck, mutate, version=4)
    t0 = time.perf_counter()
    with pytest.raises(ManifestError, match="metadata part|more ranks"):
        DataStatesReader(ck).read_metadata()
    assert time.perf_counter() - t0 < 10
