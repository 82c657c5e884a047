"""Decoding one field of a manifest body: every value checked for its type and its bounds
(``limits.py``) before anything uses it.  Shared by every version's decoder."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .checksum import DIGEST_BYTES, Digests
from .dtypes import dtype_from_name
from .limits import MAX_DIM, MAX_ENTRIES, MAX_FILE_BYTES, MAX_NDIM, MAX_TREE_DEPTH, FormatViolation
from .model import FORMAT_VERSION, Chunk, Extent, Seg, ValueEntry, segs_problem

_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")


def field(d: dict, key: str, typ) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise FormatViolation(f"missing field {key!r}")
    v = d[key]
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise FormatViolation(f"field {key!r} must be an integer, got {type(v).__name__}")
    if typ is not int and not isinstance(v, typ):
        raise FormatViolation(f"field {key!r} must be {typ}, got {type(v).__name__}")
    return v


def int_field(v, what: str, lo: int = 0, hi: int = MAX_FILE_BYTES) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise FormatViolation(f"{what} must be an integer, got {type(v).__name__}")
    if v < lo:
        raise FormatViolation(f"{what} is negative ({v})" if lo == 0 else f"{what}={v} below {lo}")
    if v > hi:
        raise FormatViolation(f"{what}={v} is absurdly large (limit {hi})")
    return v


def dims_field(v, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise FormatViolation(f"{what} must be a list of at most {MAX_NDIM} integers")
    return tuple(int_field(x, what, 0, MAX_DIM) for x in v)


def check_file_name(name) -> str:
    if not isinstance(name, str) or not _FILE_NAME.match(name) or ".." in name:
        raise FormatViolation(f"file name {name!r} is not a plain name inside the checkpoint directory")
    return name


def sums_field(v, want: int, version: int, what: str) -> Sequence:
    if version == 1:
        if not isinstance(v, list) or len(v) != want:
            raise FormatViolation(f"{what}: expected {want} block checksums")
        for s in v:
            int_field(s, f"{what} checksum", 0, (1 << 64) - 1)
        return v
    if not isinstance(v, bytes) or len(v) != want * DIGEST_BYTES:
        raise FormatViolation(f"{what}: expected {want} block digests of {DIGEST_BYTES} bytes")
    return Digests(v)


def seg_field(v, files: Mapping[str, int], what: str) -> Seg:
    if not isinstance(v, list) or len(v) != 3:
        raise FormatViolation(f"{what}: a segment must be [file, offset, nbytes]")
    name = check_file_name(v[0])
    if name not in files:
        raise FormatViolation(f"{what}: extent refers to file {name!r} not listed in the manifest")
    off = int_field(v[1], f"{what} offset")
    n = int_field(v[2], f"{what} nbytes")
    if off + n > files[name]:
        raise FormatViolation(f"{what}: extent [{off}, {off + n}) runs past the end of {name} ({files[name]} bytes)")
    return Seg(name, off, n)


def extent_field(v, files: Mapping[str, int], block_size: int, what: str, version: int = FORMAT_VERSION) -> Extent:
    if version == 1:
        if not isinstance(v, list) or len(v) != 4:
            raise FormatViolation(f"{what}: extent must be [file, offset, nbytes, sums]")
        seg = seg_field(v[:3], files, what)
        return Extent([seg], seg.nbytes, sums_field(v[3], max(1, math.ceil(seg.nbytes / block_size)), 1, what))
    if not isinstance(v, list) or len(v) != 3 or not isinstance(v[0], list):
        raise FormatViolation(f"{what}: extent must be [segments, nbytes, digests]")
    n = int_field(v[1], f"{what} nbytes")
    if len(v[0]) > MAX_ENTRIES:
        raise FormatViolation(f"{what}: too many segments")
    segs = [seg_field(x, files, what) for x in v[0]]
    problem = segs_problem(segs, n, block_size)
    if problem is not None:
        raise FormatViolation(f"{what}: {problem}")
    return Extent(segs, n, sums_field(v[2], max(1, math.ceil(n / block_size)), version, what))


def check_tree(tree, parts: dict, fqn: str, prefix: str = "", depth: int = 0) -> None:
    """A provider tree must name each leaf part exactly once, nest at most
    ``MAX_TREE_DEPTH`` levels, and hold only provider names and maps."""
    if depth > MAX_TREE_DEPTH:
        raise FormatViolation(f"{fqn}: providers nest deeper than {MAX_TREE_DEPTH} levels")
    if not isinstance(tree, dict):
        raise FormatViolation(f"{fqn}: provider tree must be a map")
    for k, sub in tree.items():
        if not isinstance(k, str) or not k or "/" in k:
            raise FormatViolation(f"{fqn}: provider part name {k!r} is not a plain name")
        path = f"{prefix}{k}"
        if sub is None:
            if path not in parts:
                raise FormatViolation(f"{fqn}: provider tree names part {path!r}, which is not stored")
            continue
        if not isinstance(sub, dict) or not isinstance(sub.get("p"), str) or "t" not in sub:
            raise FormatViolation(f"{fqn}: nested provider at {path!r} is malformed")
        check_tree(sub["t"], parts, fqn, path + "/", depth + 1)


def tree_leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, sub in tree.items():
        out.extend([f"{prefix}{k}"] if sub is None else tree_leaves(sub["t"], f"{prefix}{k}/"))
    return out


def provider_fields(chunk: Chunk, c: dict, files, block_size: int, version: int, fqn: str) -> None:
    chunk.provider = field(c, "p", str)
    chunk.meta = c.get("m")
    for pname, pv in field(c, "parts", dict).items():
        if not isinstance(pname, str) or not isinstance(pv, list) or len(pv) != 3 \
                or not isinstance(pv[0], str):
            raise FormatViolation(f"{fqn}: provider part {pname!r} is malformed")
        pdt = dtype_from_name(pv[0])
        pshape = dims_field(pv[1], f"{fqn}.{pname} shape")
        pext = extent_field(pv[2], files, block_size, f"{fqn}.{pname}", version)
        if pext.nbytes != math.prod(pshape) * pdt.itemsize:
            raise FormatViolation(f"{fqn}.{pname}: extent size does not match its shape")
        chunk.parts[pname] = (pv[0], pshape, pext)
    if "t" in c:
        check_tree(c["t"], chunk.parts, fqn)
        if sorted(tree_leaves(c["t"])) != sorted(chunk.parts):
            raise FormatViolation(f"{fqn}: provider tree and stored parts differ")
        chunk.tree = c["t"]


def special_chunk(fqn: str, offsets: tuple, sizes: tuple, wire, files, block_size: int, version: int) -> Chunk:
    """A provider chunk of a version 3 table (stored as the version 2 chunk map)."""
    if not isinstance(wire, dict) or "p" not in wire or "x" in wire:
        raise FormatViolation(f"{fqn}: a special chunk must be a provider's")
    chunk = Chunk(offsets, sizes, None)
    provider_fields(chunk, wire, files, block_size, version, fqn)
    return chunk


def values_of(body, files: Mapping[str, int], block_size: int, version: int) -> dict[str, ValueEntry]:
    values: dict[str, ValueEntry] = {}
    for fqn, v in field(body, "values", dict).items():
        if not isinstance(fqn, str):
            raise FormatViolation("value keys must be strings")
        if isinstance(v, list) and len(v) == 4 and v[0] == "provider" and isinstance(v[3], dict) \
                and "p" in v[3]:
            node = Chunk((), (), None)
            provider_fields(node, v[3], files, block_size, version, fqn)
            values[fqn] = ValueEntry("provider", b"", 0, node)
            continue
        if not isinstance(v, list) or len(v) != 3 or v[0] not in ("msgpack", "pickle", "torch") \
                or not isinstance(v[1], bytes):
            raise FormatViolation(f"value {fqn!r} is malformed")
        values[fqn] = ValueEntry(v[0], v[1], int_field(v[2], f"{fqn} checksum", 0, (1 << 64) - 1))
    return values
