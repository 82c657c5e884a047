"""Bad input fails with a clear error naming checkpoint, file and tensor; nothing committed is damaged."""

import os
import warnings
import pickle
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.format.manifest import MAGIC
from tests.manifest_tools import rewrite_manifest

W = torch.arange(4096 * 3, dtype=torch.float32).reshape(3, 4096)


def _save(path, sd=None, **kw):
    dcp.save(sd or {"w": W, "v": {"k": 1}}, storage_writer=DataStatesWriter(path, **kw), no_dist=True)


def _load(path, tmpl=None, **kw):
    tmpl = tmpl or {"w": torch.zeros_like(W), "v": {"k": 0}}
    dcp.load(tmpl, storage_reader=DataStatesReader(path, **kw), no_dist=True)
    return tmpl


def _err(fn) -> str:
    with pytest.raises((CheckpointException, Exception)) as ei:
        fn()
    return str(ei.value)


def _data_file(path):
    return os.path.join(path, next(n for n in os.listdir(path) if n.endswith(".dsd")))


@pytest.fixture
def ckpt(tmp_path):
    p = str(tmp_path / "step-1")
    _save(p)
    return p


def test_missing_manifest(ckpt):
    os.remove(os.path.join(ckpt, ".metadata"))
    msg = _err(lambda: _load(ckpt))
    assert "no committed manifest" in msg and ckpt in msg


def test_truncated_manifest(ckpt):
    m = os.path.join(ckpt, ".metadata")
    data = open(m, "rb").read()
    open(m, "wb").write(data[: len(data) // 2])
    msg = _err(lambda: _load(ckpt))
    assert "truncated or corrupt" in msg and ".metadata" in msg


def test_corrupt_manifest_byte(ckpt):
    m = os.path.join(ckpt, ".metadata")
    data = bytearray(open(m, "rb").read())
    data[40] ^= 0xFF
    open(m, "wb").write(data)
    assert "checksum mismatch" in _err(lambda: _load(ckpt))


_rewrite_body = rewrite_manifest


def test_unknown_format_version(ckpt):
    _rewrite_body(ckpt, lambda b: b.update(version=99))
    msg = _err(lambda: _load(ckpt))
    assert "format version 99" in msg and "upgrade" in msg


def test_checksum_mismatch_names_file_and_tensor(ckpt):
    f = _data_file(ckpt)
    data = bytearray(open(f, "rb").read())
    data[5000] ^= 0x01
    open(f, "wb").write(data)
    msg = _err(lambda: _load(ckpt))
    assert "checksum mismatch" in msg and os.path.basename(f) in msg and "tensor=w" in msg


def test_truncated_data_file(ckpt):
    f = _data_file(ckpt)
    os.truncate(f, 1000)
    msg = _err(lambda: _load(ckpt))
    assert "truncated" in msg and os.path.basename(f) in msg and "tensor=w" in msg


def test_missing_data_file(ckpt):
    f = _data_file(ckpt)
    os.remove(f)
    msg = _err(lambda: _load(ckpt))
    assert "missing" in msg and os.path.basename(f) in msg


def test_missing_key(ckpt):
    msg = _err(lambda: _load(ckpt, {"w": torch.zeros_like(W), "nope": torch.zeros(2), "v": {"k": 0}}))
    assert "nope" in msg


def test_existing_checkpoint_is_not_overwritten(ckpt):
    before = _load(ckpt)["w"].clone()
    msg = _err(lambda: _save(ckpt, {"w": W * 0, "v": {"k": 2}}))
    assert "already exists" in msg and "overwrite=True" in msg and ckpt in msg
    assert "Checkpoint already exists" in msg  # DCP's FileSystemWriter's phrase, which scripts match
    assert torch.equal(_load(ckpt)["w"], before)  # untouched


def test_explicit_overwrite_replaces_and_cleans_old_files(ckpt):
    old = _data_file(ckpt)
    _save(ckpt, {"w": W * 2, "v": {"k": 2}}, overwrite=True)
    assert torch.equal(_load(ckpt)["w"], W * 2)
    assert not os.path.exists(old)


class Opaque:
    def __init__(self):
        self.x = 1


def test_non_msgpack_value_needs_opt_in(tmp_path):
    p = str(tmp_path / "c")
    msg = _err(lambda: _save(p, {"w": W, "o": Opaque()}))
    assert "cannot be stored without pickle" in msg and "tensor=o" in msg and "allow_pickle" in msg
    assert not os.path.exists(os.path.join(p, ".metadata"))
    _save(p, {"w": W, "o": Opaque()}, allow_pickle=True)
    tmpl = {"w": torch.zeros_like(W), "o": None}
    msg = _err(lambda: _load(p, tmpl))
    assert "allow_pickle=True" in msg
    out = _load(p, {"w": torch.zeros_like(W), "o": None}, allow_pickle=True)
    assert isinstance(out["o"], Opaque)


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dcpds-pwned",))


def test_pickle_payload_in_value_never_runs(ckpt):
    if os.path.exists("/tmp/dcpds-pwned"):
        os.remove("/tmp/dcpds-pwned")
    evil = pickle.dumps(Boom())

    def inject(b):
        b["values"]["v.k"] = ["pickle", evil, xxhash.xxh3_64_intdigest(evil)]
    _rewrite_body(ckpt, inject)
    assert "allow_pickle" in _err(lambda: _load(ckpt))
    # even as "msgpack" the bytes only decode as data
    def inject2(b):
        b["values"]["v.k"] = ["msgpack", evil, xxhash.xxh3_64_intdigest(evil)]
    _rewrite_body(ckpt, inject2)
    try:
        _load(ckpt)
    except BaseException:
        pass
    assert not os.path.exists("/tmp/dcpds-pwned")


@pytest.mark.parametrize("mutate,needle", [
    (lambda b: b["tensors"]["w"]["chunks"][0]["x"][0][0].__setitem__(1, 1 << 60), "absurdly large"),
    (lambda b: b["tensors"]["w"]["chunks"][0]["x"][0][0].__setitem__(2, -5), "negative"),
    (lambda b: b["tensors"]["w"]["chunks"][0]["x"].__setitem__(1, 7), "segments hold"),
    (lambda b: b["tensors"]["w"]["chunks"][0]["x"].__setitem__(2, b"\0" * 8), "block digests"),
    (lambda b: b.__setitem__("homes", {next(iter(b["files"])): "../elsewhere"}), "not a plain name"),
    (lambda b: b.__setitem__("homes", {"data-unlisted.dsd": "step-1"}), "does not list"),
    (lambda b: (b["files"].__setitem__("id_rsa", 10), b.__setitem__("homes", {"id_rsa": "home"})),
     "not a data file"),
    (lambda b: b["tensors"]["w"].__setitem__("dtype", "evil"), "unknown dtype"),
    (lambda b: b["files"].__setitem__("../../etc/passwd", 10), "not a plain name"),
    (lambda b: b["files"].__setitem__("/abs/path", 10), "not a plain name"),
    (lambda b: b["tensors"]["w"]["chunks"][0]["x"][0][0].__setitem__(0, "../x.dsd"), "not a plain name"),
    (lambda b: b["tensors"]["w"].__setitem__("size", [1] * 100), "at most 64"),
])
def test_hostile_manifest_fields_refused(ckpt, mutate, needle):
    _rewrite_body(ckpt, mutate)
    msg = _err(lambda: _load(ckpt))
    assert needle in msg and ckpt in msg


def test_msgpack_bomb_refused(ckpt):
    m = os.path.join(ckpt, ".metadata")
    deep = b"\x91" * 100000 + b"\xc0"  # 100k nested arrays
    open(m, "wb").write(MAGIC + deep + struct.pack("<Q", xxhash.xxh3_64_intdigest(deep)))
    assert "does not decode" in _err(lambda: _load(ckpt))


# ------------------------------------------------ format version 3: the columnar table
def _set(b, key, i, v):
    col = bytearray(b["table"][key])
    struct.pack_into("<q", col, 8 * i, v)
    b["table"][key] = bytes(col)


def _v3(mutate):
    return lambda d: rewrite_manifest(d, mutate, version=3)


@pytest.mark.parametrize("mutate,needle", [
    (lambda b: _set(b, "seg_offset", 0, 1 << 60), "outside"),
    (lambda b: _set(b, "seg_nbytes", 0, -5), "negative"),
    (lambda b: _set(b, "seg_nbytes", 0, 7), "segments hold"),
    (lambda b: _set(b, "seg_offset", 0, b["files"][0][1]), "runs past the end"),
    (lambda b: _set(b, "seg_file", 0, 99), "outside"),
    (lambda b: _set(b, "nchunks", 0, 1 << 20), "expected"),
    (lambda b: _set(b, "offsets", 0, 1 << 40), "leaves the tensor"),
    (lambda b: _set(b, "nsegs", 0, -1), "expected"),
    (lambda b: _set(b, "size", 0, -3), "negative"),
    (lambda b: b["table"].__setitem__("sums", b["table"]["sums"][:-1]), "block digests"),
    (lambda b: b["table"].__setitem__("ndim", bytes([100])), "at most 64"),
    (lambda b: b["table"].__setitem__("dtypes", ["evil"]), "unknown dtype"),
    (lambda b: b["table"].__setitem__("names", b["table"]["names"] * 2), "distinct"),
    (lambda b: b["table"].__setitem__("size", [10]), "must be bytes"),
    (lambda b: b["table"].__setitem__("special", {"0": {"p": "x"}}), "special"),
    (lambda b: b["files"].append(["../../etc/passwd", 10]), "not a plain name"),
    (lambda b: b["files"].append(list(b["files"][0])), "listed twice"),
    (lambda b: b.__setitem__("files", {b["files"][0][0]: b["files"][0][1]}), "list"),
])
def test_hostile_table_fields_refused(ckpt, mutate, needle):
    """Version 3's columns, each crafted wrong with a valid body checksum."""
    _v3(mutate)(ckpt)
    msg = _err(lambda: _load(ckpt))
    assert needle in msg and ckpt in msg, msg


def test_table_with_a_million_empty_chunks_is_bounded(tmp_path):
    """A crafted count cannot make the reader allocate more than the file holds, and a
    million empty chunks fold into one record."""
    d = str(tmp_path / "c")
    _save(d, {"w": torch.arange(16.0)})

    def mutate(b):
        t = b["table"]
        t["names"].append("e")
        t["dtypes"] = t["dtypes"] + ["float32"] if "float32" not in t["dtypes"] else t["dtypes"]
        t["dtype"] += bytes([t["dtypes"].index("float32")])
        t["ndim"] += bytes([2])
        t["size"] += struct.pack("<2q", 0, 1 << 20)
        n = 1_000_000
        t["nchunks"] += struct.pack("<q", n)
        t["offsets"] += b"".join(struct.pack("<2q", 0, i) for i in range(n))
        t["sizes"] += bytes(16 * n)
        t["nsegs"] += bytes(8 * n)
        t["sums"] += bytes(16 * n)
    rewrite_manifest(d, mutate, version=3)
    from dcp_datastates.tiers import StorageTier
    from dcp_datastates.tiers.manifests import load_manifest
    m = load_manifest(StorageTier(d))
    assert len(m.tensors["e"].chunks) == 1 and m.tensors["e"].size == (0, 1 << 20)
    out = _load(d, {"w": torch.zeros(16)})
    assert torch.equal(out["w"], torch.arange(16.0))


def test_overlapping_chunks_in_a_table_are_refused_before_use(tmp_path):
    """Version 3 checks a tensor's boxes when it is first used (over the columns, or by the
    full sweep when they do not settle it): a crafted table whose chunks overlap fails the
    load naming the tensor, through DCP's planner and through ours."""
    from dcp_datastates import DataStatesLoadPlanner
    d = str(tmp_path / "c")
    _save(d, {"w": torch.arange(16.0)})

    def mutate(b):
        t = b["table"]
        t["nchunks"] = struct.pack("<q", 2)
        t["offsets"] = struct.pack("<q", 0) + struct.pack("<q", 4)   # [0, 16) and [4, 16)
        t["sizes"] = struct.pack("<q", 16) + struct.pack("<q", 12)
        t["nsegs"] += t["nsegs"]
        t["seg_file"] += t["seg_file"]
        t["seg_offset"] += t["seg_offset"]
        t["seg_nbytes"] += struct.pack("<q", 48)
        t["sums"] += t["sums"]
    rewrite_manifest(d, mutate, version=3)
    for kw in ({}, {"planner": DataStatesLoadPlanner()}):
        msg = _err(lambda: dcp.load({"w": torch.zeros(16)}, storage_reader=DataStatesReader(d), no_dist=True, **kw))
        assert "overlap" in msg and d in msg, msg


def test_two_chunks_of_a_scalar_are_refused(tmp_path):
    """A 0-d tensor has one place: a crafted table giving it two chunks fails the load, naming
    it (the bulk check over the table's columns leaves 0-d tensors to the exact one)."""
    from dcp_datastates import DataStatesLoadPlanner
    d = str(tmp_path / "c")
    _save(d, {"s": torch.tensor(3.0)})

    def mutate(b):
        t = b["table"]
        t["nchunks"] = struct.pack("<q", 2)
        for k in ("nsegs", "seg_file", "seg_offset", "seg_nbytes", "sums"):
            t[k] += t[k]
    rewrite_manifest(d, mutate, version=3)
    for kw in ({}, {"planner": DataStatesLoadPlanner()}):
        msg = _err(lambda: dcp.load({"s": torch.zeros(())}, storage_reader=DataStatesReader(d), no_dist=True, **kw))
        assert "two chunks" in msg and d in msg, msg


def test_overlap_among_many_chunks_is_refused(tmp_path):
    """40 one-element chunks, one of them widened over its neighbour: the bulk check over the
    columns does not pass the tensor, and the exact check names the overlap."""
    from dcp_datastates import DataStatesLoadPlanner
    d = str(tmp_path / "c")
    _save(d, {"w": torch.arange(40.0)})

    def mutate(b):
        t = b["table"]
        n = 40
        base = struct.unpack("<q", t["seg_offset"][:8])[0]
        t["nchunks"] = struct.pack("<q", n)
        t["offsets"] = b"".join(struct.pack("<q", i if i != 20 else 19) for i in range(n))
        t["sizes"] = b"".join(struct.pack("<q", 1 if i != 20 else 2) for i in range(n))
        t["nsegs"] = t["nsegs"] * n
        t["seg_file"] = t["seg_file"] * n
        t["seg_offset"] = b"".join(struct.pack("<q", base + 4 * i) for i in range(n))
        t["seg_nbytes"] = b"".join(struct.pack("<q", 4 if i != 20 else 8) for i in range(n))
        t["sums"] = t["sums"] * n
    rewrite_manifest(d, mutate, version=3)
    for kw in ({}, {"planner": DataStatesLoadPlanner()}):
        msg = _err(lambda: dcp.load({"w": torch.zeros(40)}, storage_reader=DataStatesReader(d), no_dist=True, **kw))
        assert "overlap" in msg and d in msg, msg


def test_a_dtype_the_format_cannot_name_is_refused_naming_tensor(tmp_path):
    """A quantized tensor has no stable dtype name: the save fails before any byte is written,
    naming the tensor and the checkpoint, and nothing is committed."""
    d = str(tmp_path / "c")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated (torch 2.13)
        try:
            q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
        except (AttributeError, RuntimeError):
            pytest.skip("this torch has no quantized tensors")
    msg = _err(lambda: _save(d, {"w": W, "q": q}))
    line = next(x for x in msg.splitlines() if x.startswith("dcp_datastates.errors."))
    assert "qint8" in line and "tensor=q" in line and d in line, msg
    assert not os.path.exists(os.path.join(d, ".metadata"))


@pytest.mark.parametrize("name", ["float8_e8m0fnu", "float4_e2m1fn_x2", "complex32"])
def test_newer_dtypes_round_trip(tmp_path, name):
    if not hasattr(torch, name):
        pytest.skip(f"torch {torch.__version__} has no {name}")
    dt = getattr(torch, name)
    k = torch.empty(0, dtype=dt).element_size()
    raw = torch.randint(0, 255, (64 * k,), dtype=torch.uint8)
    d = str(tmp_path / "c")
    _save(d, {"t": raw.view(dt), "v": raw.view(dt)[3:40:2]})
    out = {"t": torch.zeros(64 * k, dtype=torch.uint8).view(dt), "v": torch.zeros(19 * k, dtype=torch.uint8).view(dt)}
    dcp.load(out, storage_reader=DataStatesReader(d), no_dist=True)
    assert out["t"].view(torch.uint8).equal(raw) and out["v"].view(torch.uint8).equal(raw.view(dt)[3:40:2].contiguous().view(torch.uint8))


def test_an_error_quoted_in_one_line_is_its_first_line_or_its_type():
    from dcp_datastates.errors import first_line
    assert first_line(ValueError("bad shape\nmore detail")) == "bad shape"
    assert first_line(RuntimeError()) == "RuntimeError"  # nothing to quote: never an IndexError
    assert first_line(OSError("x" * 500), 300) == "x" * 300


def test_dcps_error_of_many_ranks_is_quoted_by_its_first_ranks_cause():
    """DCP wraps each rank's failure in a ``CheckpointException`` whose text is only the ranks
    that failed ("CheckpointException ranks:dict_keys([2, 3])"): a log line quoting it must
    give the cause, naming the file and tensor."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_datastates.errors import DataFileError, first_line
    cause = DataFileError("data file is missing", checkpoint="/ck/step-5", file="data-r00002-x-00.dsd",
                          key="extra.frozen")
    e = CheckpointException("read_data", {3: (cause, traceback.extract_stack()),
                                          2: (cause, traceback.extract_stack())})
    text = first_line(e)
    assert text.startswith("rank 2: data file is missing [checkpoint=/ck/step-5, file=data-r00002-x-00.dsd"), text
    assert text.endswith("(and 1 other rank)"), text
