"""Single-process round trips: dtypes, edge-case shapes, values, providers, streaming."""

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import (DataStatesLoadPlanner, DataStatesReader, DataStatesSavePlanner,
                            DataStatesWriter, TypeProvider, async_save, register_provider, unregister_provider)
from dcp_datastates.tiers.manifests import load_manifest
from dcp_datastates.tiers import StorageTier

PLANNERS = [(None, None), (DataStatesSavePlanner, DataStatesLoadPlanner)]


def _save_load(path, sd, template, planners=(None, None), **wkw):
    sp, lp = planners
    dcp.save(sd, storage_writer=DataStatesWriter(path, **wkw), no_dist=True,
             planner=sp() if sp else None)
    dcp.load(template, storage_reader=DataStatesReader(path), no_dist=True,
             planner=lp() if lp else None)
    return template


@pytest.mark.parametrize("planners", PLANNERS, ids=["dcp-planners", "our-planners"])
def test_dtypes_and_shapes(tmp_path, planners):
    torch.manual_seed(0)
    base = torch.randn(6, 8)
    sd = {
        "f32": torch.randn(33, 17), "bf16": torch.randn(5, 7).bfloat16(), "f16": torch.randn(4).half(),
        "i64": torch.arange(-5, 5), "i8": torch.randint(-128, 127, (9,), dtype=torch.int8),
        "bool": torch.rand(13) > 0.5, "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3),
        "noncontig": base.t(), "strided": base[::2, 1::3],
        "share_a": base[:3], "share_b": base[3:],  # two tensors sharing one storage
        "c64": torch.randn(5, dtype=torch.complex64), "odd": torch.arange(3, dtype=torch.int16),
        "param": torch.nn.Parameter(torch.randn(3)), "mid": torch.randn(64)[37:41],
        # lazy views whose memory holds other values than the tensor: a conjugate, a negative
        "conj": torch.randn(5, dtype=torch.complex64).conj(), "neg": torch.randn(4, dtype=torch.complex64).conj().imag,
    }
    tmpl = {k: torch.zeros_like(v.detach().resolve_conj().resolve_neg()) if v.dim() else torch.tensor(0.0)
            for k, v in sd.items()}
    out = _save_load(str(tmp_path / "c"), sd, tmpl, planners)
    for k in sd:
        assert out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k]), k


@pytest.mark.parametrize("planners", PLANNERS, ids=["dcp-planners", "our-planners"])
def test_nested_values(tmp_path, planners):
    sd = {"cfg": {"lr": 3e-4, "betas": (0.9, 0.95), "name": "run", "tags": ["a", None, 3],
                  "deep": {"x": [1, {"y": b"raw"}]}}, "n": None, "flag": True,
          "buf": io.BytesIO(b"\x00\x01binary"), "dt": torch.bfloat16}
    tmpl = {"cfg": {"lr": 0.0, "betas": None, "name": "", "tags": [], "deep": {"x": [0, {"y": b""}]}}, "n": 1,
            "flag": False, "buf": io.BytesIO(), "dt": None}
    out = _save_load(str(tmp_path / "c"), sd, tmpl, planners)
    assert out["cfg"] == sd["cfg"]
    assert out["n"] is None and out["flag"] is True and out["dt"] is torch.bfloat16
    assert out["buf"].getvalue() == b"\x00\x01binary"


def test_large_tensor_streams_through_small_cache(tmp_path):
    # 8 MiB tensor through a 1 MiB cache: nested chunking plus back-pressure
    t = torch.randn(2 << 20)
    path = str(tmp_path / "c")
    w = DataStatesWriter(path, host_cache_bytes=1 << 20)
    fut = async_save({"t": t}, storage_writer=w, no_dist=True)  # the lazy (copying) path
    getattr(fut, "upload_completion", fut).result(timeout=120)
    out = {"t": torch.zeros_like(t)}
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    assert torch.equal(out["t"], t)


def test_checkpoint_id_and_reset(tmp_path):
    sd = {"x": torch.arange(10.0)}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    w = DataStatesWriter()
    dcp.save(sd, checkpoint_id=a, storage_writer=w, no_dist=True)
    dcp.save(sd, checkpoint_id=b, storage_writer=w, no_dist=True)
    r = DataStatesReader()
    for p in (a, b):
        out = {"x": torch.zeros(10)}
        dcp.load(out, checkpoint_id=p, storage_reader=r, no_dist=True)
        assert torch.equal(out["x"], sd["x"])


def test_resharded_read_is_ranged(tmp_path):
    """A half-tensor load reads about half the bytes, not the whole chunk."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    t = torch.randn(1024, 1024)  # 4 MiB
    path = str(tmp_path / "c")
    dcp.save({"t": t}, storage_writer=DataStatesWriter(path), no_dist=True)
    r = DataStatesReader(path)
    md = r.read_metadata()
    r.set_up_storage_reader(md, True)

    class Half(DefaultLoadPlanner):
        def resolve_tensor(self, ri):
            return dest

    for lo, cols in ((512, False), (0, True)):
        dest = torch.zeros(512, 1024) if not cols else torch.zeros(1024, 512)
        offs = (lo, 0) if not cols else (0, 512)
        lens = (512, 1024) if not cols else (1024, 512)
        ri = ReadItem(LoadItemType.TENSOR, MetadataIndex("t", (0, 0)), torch.Size((0, 0)),
                      MetadataIndex("t", (0, 0)), torch.Size(offs), torch.Size(lens))
        p = Half()
        p.state_dict = {}
        r.read_data(LoadPlan([ri]), p).wait()
        want = t[lo:lo + 512] if not cols else t[:, 512:]
        assert torch.equal(dest, want)
        if not cols:
            assert r.bytes_read <= 1.25 * r.bytes_needed, (r.bytes_read, r.bytes_needed)


class Tagged(torch.Tensor):
    """A tensor subclass that carries a string tag."""

    @staticmethod
    def __new__(cls, data, tag):
        t = torch.Tensor._make_subclass(cls, data)
        t.tag = tag
        return t


class TaggedProvider(TypeProvider):
    name = "tests.Tagged"

    def flatten(self, obj):
        return {"tag": obj.tag}, {"data": obj.as_subclass(torch.Tensor)}

    def unflatten(self, meta, parts):
        return Tagged(parts["data"], meta["tag"])


class Pair:
    def __init__(self, a, b, label):
        self.a, self.b, self.label = a, b, label


class PairProvider(TypeProvider):
    name = "tests.Pair"

    def flatten(self, obj):
        return {"label": obj.label}, {"a": obj.a, "b": obj.b}

    def unflatten(self, meta, parts):
        return Pair(parts["a"], parts["b"], meta["label"])


def test_user_provider_for_tensor_subclass(tmp_path):
    register_provider(Tagged, TaggedProvider())
    try:
        src = Tagged(torch.randn(4, 5), "weights")
        path = str(tmp_path / "c")
        dcp.save({"w": src}, storage_writer=DataStatesWriter(path), no_dist=True)
        from dcp_datastates.tiers.manifests import load_manifest
        from dcp_datastates.tiers import StorageTier
        chunk = load_manifest(StorageTier(path)).tensors["w"].chunks[0]
        assert chunk.provider == "tests.Tagged" and chunk.meta == {"tag": "weights"}
        out = {"w": torch.zeros(4, 5)}
        dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
        assert torch.equal(out["w"], src.as_subclass(torch.Tensor))
    finally:
        unregister_provider(Tagged)


def test_composite_provider_nests_tensors(tmp_path):
    """A registered composite (user type holding tensors) is stored as raw extents, no pickle."""
    from dcp_datastates.providers import provider_for
    register_provider(Pair, PairProvider())
    try:
        p = provider_for(Pair(torch.ones(3), torch.zeros(2, 2), "x"))
        regions = p.regions()
        assert [r.name for r in regions] == ["a", "b"] and p.meta() == {"label": "x"}
    finally:
        unregister_provider(Pair)


def test_data_file_is_raw_bytes_not_torch_save(tmp_path):
    t = torch.arange(1024, dtype=torch.float32)
    path = str(tmp_path / "c")
    dcp.save({"t": t}, storage_writer=DataStatesWriter(path), no_dist=True)
    data = [n for n in os.listdir(path) if n.endswith(".dsd")]
    raw = open(os.path.join(path, data[0]), "rb").read()
    assert raw[:4096] == t.numpy().tobytes()  # first extent at offset 0, no zip header


def test_async_timings_guard_and_bounded_cache(tmp_path):
    """THREAD async_save: guard waits before step, stage timings are ordered, cache never overflows."""
    import torch.distributed as dist

    from dcp_datastates import SnapshotGuard, async_save
    from dcp_datastates.engine.host_cache import shared_host_cache
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    cache_bytes = 1 << 20  # 1 MiB cache, 4 MiB of state: four times larger
    w = DataStatesWriter(str(tmp_path / "c"), host_cache_bytes=cache_bytes)
    guard = SnapshotGuard(opt, w)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fut = async_save({"m": model.state_dict()}, storage_writer=w, no_dist=True)
    opt.step()  # the guard blocks here until the snapshot is complete, then params change
    guard.remove()
    fut.result()
    assert guard.waits == 1
    t = w.timings()
    assert 0 <= t["snapshot_done_s"] <= t["data_written_s"] <= t["committed_s"], t
    cache = shared_host_cache(cache_bytes, False)
    assert cache.peak_used <= cache.capacity and cache.used == 0
    out = {"m": {k: torch.zeros_like(v) for k, v in before.items()}}
    dcp.load(out, storage_reader=DataStatesReader(str(tmp_path / "c")), no_dist=True)
    assert all(torch.equal(out["m"][k], before[k]) for k in before)
    assert not dist.is_initialized()


def test_format_v2_checkpoints_still_load(tmp_path):
    """Checkpoints written before the columnar table (format version 2) load bit-exactly,
    nested keys, several chunks and values included."""
    from dcp_datastates.format.manifest import decode_manifest, encode_manifest
    d = tmp_path / "v2"
    sd = {"model": {"w": torch.randn(33, 7), "e": torch.empty(0)}, "step": 9, "b": torch.arange(5)}
    dcp.save(sd, storage_writer=DataStatesWriter(str(d)), no_dist=True)
    p = d / ".metadata"
    p.write_bytes(encode_manifest(decode_manifest(p.read_bytes()), version=2))
    assert decode_manifest(p.read_bytes()).version == 2
    out = {"model": {"w": torch.zeros(33, 7), "e": torch.empty(0)}, "step": 0, "b": torch.zeros(5, dtype=torch.long)}
    dcp.load(out, storage_reader=DataStatesReader(str(d)), no_dist=True)
    assert torch.equal(out["model"]["w"], sd["model"]["w"]) and out["step"] == 9 and torch.equal(out["b"], sd["b"])


class _Doubling(DataStatesSavePlanner):
    """A planner that changes what is saved (DCP's ``transform_object`` extension point)."""

    def transform_object(self, write_item, object):
        object = super().transform_object(write_item, object)
        return object * 2 if isinstance(object, torch.Tensor) else object


class _Looking(DataStatesSavePlanner):
    """A planner that finds objects its own way (DCP's ``lookup_object`` extension point)."""

    def lookup_object(self, index):
        return torch.full((3,), 7.0) if index.fqn == "a" else super().lookup_object(index)


def _tripling_object() -> DataStatesSavePlanner:
    """A planner object whose ``transform_object`` is replaced on the object itself."""
    p = DataStatesSavePlanner()
    plain = p.transform_object
    p.transform_object = lambda item, obj: plain(item, obj) * 3
    return p


@pytest.mark.parametrize("planner, want", [(_Doubling, {"a": 2.0, "b": 4.0}), (_Looking, {"a": 7.0, "b": 2.0}),
                                           (_tripling_object, {"a": 3.0, "b": 6.0})],
                         ids=["transform_object", "lookup_object", "on-the-object"])
def test_save_planner_that_changes_objects_is_asked_for_each(tmp_path, planner, want):
    """The writer takes a plain tensor straight from the state dict only for a planner that
    finds and transforms objects as DCP's default does; a subclass's own way is kept."""
    path = str(tmp_path / "c")
    dcp.save({"a": torch.ones(3), "b": torch.full((3,), 2.0)}, storage_writer=DataStatesWriter(path),
             planner=planner(), no_dist=True)
    out = {"a": torch.zeros(3), "b": torch.zeros(3)}
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    assert {k: v.tolist() for k, v in out.items()} == {k: [x] * 3 for k, x in want.items()}


class _Halved(TypeProvider):
    """Stores a parameter as its halves (a provider registered for a plain tensor type)."""

    name = "tests.Halved"

    def flatten(self, obj):
        return {"n": obj.numel()}, {"lo": obj.detach()[: obj.numel() // 2], "hi": obj.detach()[obj.numel() // 2:]}

    def unflatten(self, meta, parts):
        return torch.nn.Parameter(torch.cat([parts["lo"], parts["hi"]]))


def test_provider_registered_for_parameter_is_used(tmp_path):
    """A provider registered for ``torch.nn.Parameter`` itself takes every parameter of the
    state, with DCP's planner and ours."""
    register_provider(torch.nn.Parameter, _Halved())
    try:
        for i, planner in enumerate((None, DataStatesSavePlanner())):
            path = str(tmp_path / f"c{i}")
            src = torch.nn.Parameter(torch.arange(6.0))
            dcp.save({"w": src, "t": torch.ones(2)}, storage_writer=DataStatesWriter(path), planner=planner,
                     no_dist=True)
            chunk = load_manifest(StorageTier(path)).tensors["w"].chunks[0]
            assert chunk.provider == "tests.Halved" and sorted(chunk.parts) == ["hi", "lo"], planner
            assert load_manifest(StorageTier(path)).tensors["t"].chunks[0].provider is None
            out = {"w": torch.zeros(6), "t": torch.zeros(2)}
            dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
            assert out["w"].tolist() == list(range(6)) and out["t"].tolist() == [1.0, 1.0]
    finally:
        unregister_provider(torch.nn.Parameter)
