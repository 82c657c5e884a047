"""Replica records are input (issue 69, case 6): any bytes either decode to a record whose
every field has its type, or fail with ValueError (or msgpack's own error), which
``read_record`` turns into one warning naming the file; nothing else escapes."""

from __future__ import annotations

import logging

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_datastates.format.names import replica_record_name
from dcp_datastates.replicas.records import ReplicaRecord, read_record
from dcp_datastates.tiers import StorageTier

GOOD = ReplicaRecord(2, "abc", 1, {"data-r00002-abc-00.dsd": [4096, "ff00"]}, [0],
                     {0: {"data-r00000-abc-00.dsd": [8192, ""]}})

ints = st.integers(min_value=-2**63, max_value=2**64 - 1)  # what msgpack can hold
plain = st.recursive(st.none() | st.booleans() | ints | st.floats() | st.text(max_size=8)
                     | st.binary(max_size=8),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4) | ints,
                                                                               kids, max_size=3), max_leaves=10)


def test_a_record_round_trips():
    assert ReplicaRecord.from_bytes(GOOD.to_bytes()) == GOOD


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["rank", "save_id", "replicas", "sent", "confirmed", "held"]), value=plain)
def test_a_field_of_any_other_shape_is_refused_as_a_value_error(field, value):
    d = msgpack.unpackb(GOOD.to_bytes(), raw=False, strict_map_key=False)
    d[field] = value
    try:
        rec = ReplicaRecord.from_bytes(msgpack.packb(d))
    except (ValueError, msgpack.UnpackException):
        return
    # what is accepted has the shapes every reader of a record relies on
    assert isinstance(rec.rank, int) and isinstance(rec.save_id, str) and isinstance(rec.replicas, int)
    for files in (rec.sent, *rec.held.values()):
        assert all(isinstance(v[0], int) and isinstance(v[1], str) for v in files.values())
    assert all(isinstance(r, int) for r in [*rec.confirmed, *rec.held])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_are_a_record_or_a_value_error(data):
    try:
        ReplicaRecord.from_bytes(data)
    except (ValueError, msgpack.UnpackException):
        pass


@pytest.mark.parametrize("data", [msgpack.packb({"rank": 2}), b"\xc1", msgpack.packb([1, 2]),
                                  ReplicaRecord(3, "abc", 1, {}, [], {}).to_bytes()])
def test_read_record_skips_a_bad_record_with_one_line_naming_it(tmp_path, caplog, data):
    name = replica_record_name(2, "abc")
    (tmp_path / name).write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="dcp_datastates.replicas.records"):
        assert read_record(StorageTier(str(tmp_path)), 2, "abc") is None
    assert len(caplog.records) == 1 and name in caplog.text and "\n" not in caplog.records[0].getMessage()


def test_read_record_of_a_missing_file_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert read_record(StorageTier(str(tmp_path)), 2, "abc") is None
    assert not caplog.records
