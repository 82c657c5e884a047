"""Property-based fuzzing of the decoders (issue 17): random and mutated manifests and values
give a ``CheckpointError`` subclass (values: ``ValueError``) or a correct result, never another
exception, a hang or a crash."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_datastates import DataStatesWriter
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.manifest import MAGIC, decode_manifest
from dcp_datastates.format.values import decode_value, encode_value

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def manifest_body(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fuzz") / "c")
    sd = {"w": torch.randn(64, 32), "b": torch.arange(10), "v": {"k": [1, 2.5, "x", (1, 2)]}}
    dcp.save(sd, storage_writer=DataStatesWriter(d), no_dist=True)
    data = open(f"{d}/.metadata", "rb").read()
    return msgpack.unpackb(data[len(MAGIC):-8], raw=False, strict_map_key=False)


def _frame(payload: bytes) -> bytes:
    return MAGIC + payload + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload))


def _decode_ok_or_error(data: bytes) -> None:
    try:
        decode_manifest(data, source="fuzz")
    except CheckpointError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                  st.text(max_size=12), st.binary(max_size=40))
_any = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=5),
                                               st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-2**63, 2**64 - 1)), c, max_size=5)),
                    max_leaves=30)


@SETTINGS
@given(st.binary(max_size=400))
def test_random_bytes(data):
    _decode_ok_or_error(data)
    _decode_ok_or_error(MAGIC + data)
    _decode_ok_or_error(_frame(data))


@SETTINGS
@given(_any)
def test_random_bodies(body):
    _decode_ok_or_error(_frame(msgpack.packb(body, use_bin_type=True)))


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@SETTINGS
@given(st.data())
def test_mutated_manifests(manifest_body, data):
    import copy
    body = copy.deepcopy(manifest_body)
    paths = [p for p in _paths(body) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = body
        try:
            for k in path[:-1]:
                parent = parent[k]
            if data.draw(st.booleans()):
                parent[path[-1]] = data.draw(_any)
            elif isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = data.draw(_leaf)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed the path
    _decode_ok_or_error(_frame(msgpack.packb(body, use_bin_type=True)))


@SETTINGS
@given(st.binary(max_size=300))
def test_values_random_bytes(data):
    try:
        decode_value(data)
    except ValueError:
        pass


_value = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.tuples(c, c),
                                                 st.dictionaries(st.text(max_size=5), c, max_size=4)),
                      max_leaves=20)


@SETTINGS
@given(_value, st.data())
def test_values_round_trip_and_mutations(value, data):
    enc = encode_value(value)
    back = decode_value(enc)
    assert msgpack.packb(back, default=repr) == msgpack.packb(value, default=repr) or back != back
    if enc:
        i = data.draw(st.integers(0, len(enc) - 1))
        bad = enc[:i] + bytes([data.draw(st.integers(0, 255))]) + enc[i + 1:]
        try:
            decode_value(bad)
        except ValueError:
            pass


_COLUMNS = ["size", "nchunks", "offsets", "sizes", "nsegs", "seg_file", "seg_offset", "seg_nbytes"]


@SETTINGS
@given(st.data())
def test_mutated_table_columns(manifest_body, data):
    """Format version 3: any int64 of any column set to any value is refused or decodes into
    records that pass the same checks, never another exception."""
    import copy
    body = copy.deepcopy(manifest_body)
    assert body["version"] == 3
    key = data.draw(st.sampled_from(_COLUMNS))
    col = bytearray(body["table"][key])
    if col:
        i = data.draw(st.integers(0, len(col) // 8 - 1))
        struct.pack_into("<q", col, 8 * i, data.draw(st.integers(-2**63, 2**63 - 1)))
    else:
        col += struct.pack("<q", data.draw(st.integers(-2**63, 2**63 - 1)))
    body["table"][key] = bytes(col)
    _decode_ok_or_error(_frame(msgpack.packb(body, use_bin_type=True)))
