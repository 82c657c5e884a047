"""The manifest: the one file that says what a checkpoint holds and where.

File layout (``docs/format.md`` is the specification)::

    MAGIC (16 bytes)  msgpack map (the body)  xxh3-64 of the body (8 bytes, LE)

The versions, all still read:

* 1: per-block xxh3-64 digests, each chunk a msgpack map;
* 2: per-block xxh3-128 digests, an extent may be several segments, and a file may live in a
  sibling checkpoint of the run (``homes``: how an incremental save references unchanged bytes);
* 3 (written by ``DataStatesWriter`` without sharding rules, and as each rank's format 4
  part): the tensors as one table of integer columns (``columnar.py``);
* 4 (written where the save planner gave sharding rules): an index of rules and per-rank
  parts (``index.py``), assembled by ``assemble.py``.

This module holds the envelope (magic, body, trailer), the version dispatch and the version
1 and 2 decoders; the formats 3 and 4 have modules of their own.

The magic starts with 0xFF, which is not a pickle opcode, so a tool that
mistakes the file for DCP's pickled ``.metadata`` fails at the first byte.
Decoding validates every field against hard limits before anything uses it:
types, non-negative and bounded sizes, extents inside their files, file names
that cannot leave the checkpoint directory, dtypes from a fixed table.
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import xxhash

from ..errors import ForeignFormatError, ManifestError, UnsupportedFormatVersion
from ..gcpause import paused_gc
from .checksum import DIGEST_BYTES, Digests, DigestTail
from .columnar import decode_table, encode_table
from .dtypes import dtype_from_name
from .index import INDEX_VERSION, IndexTable, PartReader
from .limits import (
    MAX_DIM,
    MAX_ENTRIES,
    MAX_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_TREE_DEPTH,
    MAX_WORLD,
    FormatViolation,
)
from .model import (  # noqa: F401 (the model is re-exported: most layers import it from here)
    FORMAT_VERSION,
    Chunk,
    Extent,
    Manifest,
    Seg,
    TensorEntry,
    ValueEntry,
    check_tiling,
)
from .names import MANIFEST_NAME, RANK_MANIFEST_PREFIX, is_manifest_name  # noqa: F401 (re-exported)
from .paths import paths_from_wire, paths_wire
from .ranked import FileMap, RankFiles, seal_tail
from .values import pack_plain

MAGIC = b"\xffDCP-DATASTATES\n"
FORMAT_NAME = "dcp-datastates"
READABLE_VERSIONS = (1, 2, 3, 4)


_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")


def _chunk_to_wire(c: Chunk) -> dict:
    d: dict[str, object] = {"o": list(c.offsets), "s": list(c.sizes)}
    if c.extent is not None:
        d["x"] = c.extent.to_wire()
    if c.provider is not None:
        d["p"] = c.provider
        d["m"] = c.meta
        d["parts"] = {k: [dt, list(shape), e.to_wire()] for k, (dt, shape, e) in c.parts.items()}
        if c.tree is not None:
            d["t"] = c.tree
    return d


def _value_to_wire(v: ValueEntry) -> list:
    if v.node is not None:
        return [v.encoding, v.data, v.checksum, _chunk_to_wire(v.node)]
    return [v.encoding, v.data, v.checksum]


def encode_manifest(m: Manifest, *, version: int = FORMAT_VERSION) -> bytes:
    """The manifest file of ``m``: format version 3 (the columnar tensor table), or 2 (one map
    per chunk, for tools and tests that need the older layout)."""
    if version not in (2, FORMAT_VERSION):
        raise ValueError(f"cannot write format version {version}")
    with paused_gc():
        return _encode(m, version)


def encode_index(m: Manifest, index: dict) -> bytes:
    """The version 4 index of ``m`` (its header fields, values and files; ``m.tensors`` is not
    used): ``index`` is ``format.index.index_wire``'s map of rules, explicit chunks and parts.
    Packed: everything after the header fields is one zlib stream."""
    with paused_gc():
        return _encode(m, INDEX_VERSION, index, pack=True)


def encode_part(m: Manifest) -> tuple[bytes, bytes]:
    """A format 4 metadata part: the version 3 manifest of ``m``, packed, whose block digests
    are not in its table but follow it in the file (the tail: ``sums_tail`` gives their length
    and xxh3-128; a footer names their save and rank, ``ranked.seal_tail``).  Returns (head,
    tail); the file is head + tail.  A reader that plans a load reads the head; the tail is read
    with the data it checks."""
    with paused_gc():
        tail: list[bytes] = []
        return _encode(m, FORMAT_VERSION, pack=True, tail=tail), seal_tail(tail[0], m.save_id, m.ranks[0])


_HEADER_FIELDS = ("format", "version", "save_id", "created_unix")  # first, and never packed
# zlib's fastest: on a 4.2 MB index (16,384 ranks, before rank files were columns) level 3 saved 1%, 25% slower
PACK_LEVEL = 1


def _encode(m: Manifest, version: int, index: dict | None = None, *, pack: bool = False,
            tail: list | None = None) -> bytes:
    body = {
        "format": FORMAT_NAME,
        "version": version,
        "save_id": m.save_id,
        "created_unix": m.created_unix,
        "torch": m.torch_version,
        "writer": m.writer,
        "world_size": m.world_size,
        "ranks": m.ranks,
        "block_size": m.block_size,
        "checksum": "xxh3-128",
        "homes": m.homes,
        "values": {k: _value_to_wire(v) for k, v in m.values.items()},
        "planner_data": m.planner_data,
        "extra": m.extra,
    }
    if index is not None:  # the index gives its files (those named by rank as columns) and ranks (its parts')
        body["ranks"] = []
        body["paths"], body["planner_data"] = paths_wire(index["tensor_list"]["names"], m.planner_data)
        body.update(index)
    elif version >= 3:
        body["files"] = [[name, size] for name, size in m.files.items()]
        body["table"] = encode_table(m.tensors, {name: i for i, name in enumerate(m.files)}, _chunk_to_wire)
        if tail is not None:
            tail.append(body["table"].pop("sums"))
            body["sums_tail"] = [len(tail[0]), xxhash.xxh3_128_digest(tail[0])]
    else:
        body["files"] = m.files
        body["tensors"] = {k: {"dtype": t.dtype, "size": list(t.size), "chunks": [_chunk_to_wire(c) for c in t.chunks]}
                           for k, t in m.tensors.items()}
    if pack:
        rest = {k: v for k, v in body.items() if k not in _HEADER_FIELDS}
        body = {k: body[k] for k in _HEADER_FIELDS}
        body["packed"] = zlib.compress(pack_plain(rest), PACK_LEVEL)
    payload = pack_plain(body)
    return MAGIC + payload + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload))


# ----------------------------------------------------------------- decoding

def _req(d: dict, key: str, typ) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise FormatViolation(f"missing field {key!r}")
    v = d[key]
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise FormatViolation(f"field {key!r} must be an integer, got {type(v).__name__}")
    if typ is not int and not isinstance(v, typ):
        raise FormatViolation(f"field {key!r} must be {typ}, got {type(v).__name__}")
    return v


def _int(v, what: str, lo: int = 0, hi: int = MAX_FILE_BYTES) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise FormatViolation(f"{what} must be an integer, got {type(v).__name__}")
    if v < lo:
        raise FormatViolation(f"{what} is negative ({v})" if lo == 0 else f"{what}={v} below {lo}")
    if v > hi:
        raise FormatViolation(f"{what}={v} is absurdly large (limit {hi})")
    return v


def _dims(v, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise FormatViolation(f"{what} must be a list of at most {MAX_NDIM} integers")
    return tuple(_int(x, what, 0, MAX_DIM) for x in v)


def check_file_name(name) -> str:
    if not isinstance(name, str) or not _FILE_NAME.match(name) or ".." in name:
        raise FormatViolation(f"file name {name!r} is not a plain name inside the checkpoint directory")
    return name


def _sums(v, want: int, version: int, what: str) -> Sequence:
    if version == 1:
        if not isinstance(v, list) or len(v) != want:
            raise FormatViolation(f"{what}: expected {want} block checksums")
        for s in v:
            _int(s, f"{what} checksum", 0, (1 << 64) - 1)
        return v
    if not isinstance(v, bytes) or len(v) != want * DIGEST_BYTES:
        raise FormatViolation(f"{what}: expected {want} block digests of {DIGEST_BYTES} bytes")
    return Digests(v)


def _seg(v, files: Mapping[str, int], what: str) -> Seg:
    if not isinstance(v, list) or len(v) != 3:
        raise FormatViolation(f"{what}: a segment must be [file, offset, nbytes]")
    name = check_file_name(v[0])
    if name not in files:
        raise FormatViolation(f"{what}: extent refers to file {name!r} not listed in the manifest")
    off = _int(v[1], f"{what} offset")
    n = _int(v[2], f"{what} nbytes")
    if off + n > files[name]:
        raise FormatViolation(f"{what}: extent [{off}, {off + n}) runs past the end of {name} ({files[name]} bytes)")
    return Seg(name, off, n)


def _extent(v, files: Mapping[str, int], block_size: int, what: str, version: int = FORMAT_VERSION) -> Extent:
    if version == 1:
        if not isinstance(v, list) or len(v) != 4:
            raise FormatViolation(f"{what}: extent must be [file, offset, nbytes, sums]")
        seg = _seg(v[:3], files, what)
        return Extent([seg], seg.nbytes, _sums(v[3], max(1, math.ceil(seg.nbytes / block_size)), 1, what))
    if not isinstance(v, list) or len(v) != 3 or not isinstance(v[0], list):
        raise FormatViolation(f"{what}: extent must be [segments, nbytes, digests]")
    n = _int(v[1], f"{what} nbytes")
    if len(v[0]) > MAX_ENTRIES:
        raise FormatViolation(f"{what}: too many segments")
    segs = [_seg(x, files, what) for x in v[0]]
    if sum(s.nbytes for s in segs) != n or (n and not segs):
        raise FormatViolation(f"{what}: segments hold {sum(s.nbytes for s in segs)} bytes, the extent {n}")
    if any(s.nbytes % block_size for s in segs[:-1]):
        raise FormatViolation(f"{what}: a segment other than the last ends inside a checksum block")
    return Extent(segs, n, _sums(v[2], max(1, math.ceil(n / block_size)), version, what))


def decode_manifest(data: bytes, *, source: str = "<memory>",
                    tail: Callable[[int, bytes], DigestTail] | None = None,
                    parts: Sequence[PartReader] = ()) -> Manifest:
    """Parse and validate manifest bytes; raise :class:`ManifestError` naming ``source``.
    ``tail(nbytes, digest)``: the source of block digests kept in the file's tail (a format 4
    part, decoded by its index); a manifest that keeps them there is refused without one.
    ``parts``: where a format 4 index reads its ranks' metadata parts, fastest copy first (an
    index decoded without one refuses to build a record that lives in a part)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(data)} bytes, beyond the {MAX_MANIFEST_BYTES} limit",
                            checkpoint=source)
    if not data.startswith(MAGIC):
        if data[:1] == b"\x80":  # a pickle: DCP's FileSystemWriter writes .metadata so
            raise ForeignFormatError(
                "this is a checkpoint in DCP's own format (FileSystemWriter), not dcp-datastates: "
                "load it with torch.distributed.checkpoint.FileSystemReader, or convert it with "
                "`dcp-datastates convert SRC DST --to datastates --allow-pickle` if you trust it",
                checkpoint=source)
        raise ManifestError("not a dcp-datastates manifest (bad magic bytes); the file is damaged "
                            "or was written by another tool", checkpoint=source)
    if len(data) < len(MAGIC) + 8:
        raise ManifestError("manifest is truncated", checkpoint=source)
    payload, trailer = data[len(MAGIC):-8], data[-8:]
    if struct.unpack("<Q", trailer)[0] != xxhash.xxh3_64_intdigest(payload):
        raise ManifestError("manifest checksum mismatch: the file is truncated or corrupt; "
                            "restore it from another tier or re-save", checkpoint=source)
    with paused_gc():
        return _decode_body(payload, source, tail, parts)


def _decode_body(payload: bytes, source: str, tail=None, parts: Sequence[PartReader] = ()) -> Manifest:
    try:
        body = _unpack_streaming(payload)
    except FormatViolation as e:
        raise ManifestError(f"invalid manifest: {e}", checkpoint=source) from None
    except Exception as e:  # msgpack raises many types on hostile input
        raise ManifestError(f"manifest body does not decode: {e}", checkpoint=source) from e
    try:
        return _from_body(body, source, tail, parts)
    except UnsupportedFormatVersion as e:
        raise UnsupportedFormatVersion(str(e.args[0]), checkpoint=source) from None
    except (FormatViolation, ValueError, TypeError, KeyError, AttributeError, OverflowError,
            msgpack.UnpackException) as e:
        raise ManifestError(f"invalid manifest: {e}", checkpoint=source) from None


def _inflate(packed) -> bytes:
    """A packed body, inflated to at most ``MAX_MANIFEST_BYTES`` (a crafted stream that would
    inflate further is refused before it does)."""
    if not isinstance(packed, bytes):
        raise FormatViolation("packed must be bytes")
    z = zlib.decompressobj()
    try:
        out = z.decompress(packed, MAX_MANIFEST_BYTES)
    except zlib.error as e:
        raise FormatViolation(f"the packed body does not inflate ({e})") from None
    if z.unconsumed_tail:
        raise FormatViolation(f"the packed body inflates beyond {MAX_MANIFEST_BYTES} bytes")
    if not z.eof or z.unused_data:
        raise FormatViolation("the packed body is truncated or followed by extra bytes")
    return out


def _unpacker(data) -> msgpack.Unpacker:
    up = msgpack.Unpacker(raw=False, strict_map_key=False, use_list=True, max_buffer_size=len(data) + 1,
                          max_array_len=MAX_ENTRIES, max_map_len=MAX_ENTRIES, max_ext_len=0)
    up.feed(data)
    return up


class _ChunkStream:
    """The chunk list of one tensor, decoded one chunk at a time: a manifest never exists
    as a tree of Python objects, only as the validated records it decodes into."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __iter__(self):
        up = _unpacker(self.data)
        try:
            n = up.read_array_header()
        except (ValueError, msgpack.UnpackException) as e:
            raise FormatViolation(f"chunks must be a list ({e})") from None
        for _ in range(n):
            yield up.unpack()


def _skip_span(up: msgpack.Unpacker) -> tuple[int, int]:
    a = up.tell()
    up.skip()
    return a, up.tell()


def _map_header(up: msgpack.Unpacker, what: str) -> int:
    """The entry count of the map ``up`` is at, or ``FormatViolation(what)``."""
    try:
        return up.read_map_header()
    except (ValueError, msgpack.UnpackException):
        raise FormatViolation(what) from None


def _unpack_streaming(payload: bytes, outer: bool = True) -> dict:
    """The body as a dict whose tensors' ``chunks`` are ``_ChunkStream`` objects; a packed
    body's fields inflated into it (``outer``: packing is allowed at this level only)."""
    up = _unpacker(payload)
    n = _map_header(up, "the body does not decode as a map")
    body: dict = {}
    span = None
    for _ in range(n):
        key = up.unpack()
        if key == "tensors":
            span = _skip_span(up)
        else:
            body[key] = up.unpack()
    if up.tell() != len(payload):
        raise FormatViolation("extra bytes after the body")
    if "packed" in body:
        if not outer:
            raise FormatViolation("a packed body packs another")
        inner = _unpack_streaming(_inflate(body.pop("packed")), outer=False)
        if any(k in body for k in inner):
            raise FormatViolation("the packed body repeats a field of the header")
        body.update(inner)
    if span is None:
        return body
    section = payload[span[0]:span[1]]
    tup = _unpacker(section)
    nt = _map_header(tup, "tensors must be a map")
    tensors: dict = {}
    for _ in range(nt):
        fqn = tup.unpack()
        if not isinstance(fqn, str) or fqn in tensors:
            raise FormatViolation("tensor keys must be distinct strings")
        nk = _map_header(tup, f"tensor {fqn!r} must be a map")
        t: dict = {}
        for _ in range(nk):
            k = tup.unpack()
            if k == "chunks":
                a, b = _skip_span(tup)
                t[k] = _ChunkStream(section[a:b])
            else:
                t[k] = tup.unpack()
        tensors[fqn] = t
    body["tensors"] = tensors
    return body




def _check_tree(tree, parts: dict, fqn: str, prefix: str = "", depth: int = 0) -> None:
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
        _check_tree(sub["t"], parts, fqn, path + "/", depth + 1)


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, sub in tree.items():
        out.extend([f"{prefix}{k}"] if sub is None else _leaves(sub["t"], f"{prefix}{k}/"))
    return out


def _provider_fields(chunk: Chunk, c: dict, files, block_size: int, version: int, fqn: str) -> None:
    chunk.provider = _req(c, "p", str)
    chunk.meta = c.get("m")
    for pname, pv in _req(c, "parts", dict).items():
        if not isinstance(pname, str) or not isinstance(pv, list) or len(pv) != 3 \
                or not isinstance(pv[0], str):
            raise FormatViolation(f"{fqn}: provider part {pname!r} is malformed")
        pdt = dtype_from_name(pv[0])
        pshape = _dims(pv[1], f"{fqn}.{pname} shape")
        pext = _extent(pv[2], files, block_size, f"{fqn}.{pname}", version)
        if pext.nbytes != math.prod(pshape) * pdt.itemsize:
            raise FormatViolation(f"{fqn}.{pname}: extent size does not match its shape")
        chunk.parts[pname] = (pv[0], pshape, pext)
    if "t" in c:
        _check_tree(c["t"], chunk.parts, fqn)
        if sorted(_leaves(c["t"])) != sorted(chunk.parts):
            raise FormatViolation(f"{fqn}: provider tree and stored parts differ")
        chunk.tree = c["t"]


def _special_chunk(fqn: str, offsets: tuple, sizes: tuple, wire, files, block_size: int, version: int) -> Chunk:
    """A provider chunk of a version 3 table (stored as the version 2 chunk map)."""
    if not isinstance(wire, dict) or "p" not in wire or "x" in wire:
        raise FormatViolation(f"{fqn}: a special chunk must be a provider's")
    chunk = Chunk(offsets, sizes, None)
    _provider_fields(chunk, wire, files, block_size, version, fqn)
    return chunk


def _tensors_v2(body, files: dict[str, int], block_size: int, version: int) -> dict[str, TensorEntry]:
    """Versions 1 and 2: one msgpack map per chunk, decoded chunk by chunk."""
    tensors: dict[str, TensorEntry] = {}
    n_chunks = 0
    for fqn, t in _req(body, "tensors", dict).items():
        if not isinstance(fqn, str):
            raise FormatViolation("tensor keys must be strings")
        dtype = _req(t, "dtype", str)
        item = dtype_from_name(dtype).itemsize
        size = _dims(_req(t, "size", list), f"{fqn} size")
        chunks = []
        has_empty = False
        for c in _req(t, "chunks", (list, _ChunkStream)):
            offs = _dims(_req(c, "o", list), f"{fqn} chunk offsets")
            sizes = _dims(_req(c, "s", list), f"{fqn} chunk sizes")
            if len(offs) != len(size) or len(sizes) != len(size):
                raise FormatViolation(f"{fqn}: chunk rank does not match tensor rank {len(size)}")
            for o, s, g in zip(offs, sizes, size):
                if o + s > g:
                    raise FormatViolation(f"{fqn}: chunk at {list(offs)} of size {list(sizes)} leaves the tensor {list(size)}")
            ext = None
            if "x" in c:
                ext = _extent(c["x"], files, block_size, fqn, version)
                if ext.nbytes != math.prod(sizes) * item:
                    raise FormatViolation(f"{fqn}: extent holds {ext.nbytes} bytes, chunk needs {math.prod(sizes) * item}")
            chunk = Chunk(offs, sizes, ext)
            if "p" in c:
                _provider_fields(chunk, c, files, block_size, version, fqn)
            elif ext is None:
                raise FormatViolation(f"{fqn}: chunk has neither an extent nor a provider")
            n_chunks += 1
            if n_chunks > MAX_ENTRIES:
                raise FormatViolation(f"more than {MAX_ENTRIES} chunks")
            if not math.prod(sizes):
                if has_empty:  # holds no byte and covers nothing: one represents them all
                    continue
                has_empty = True
            chunks.append(chunk)
        check_tiling(fqn, chunks)
        tensors[fqn] = TensorEntry(dtype, size, chunks)
    return tensors


def _values(body, files: Mapping[str, int], block_size: int, version: int) -> dict[str, ValueEntry]:
    values: dict[str, ValueEntry] = {}
    for fqn, v in _req(body, "values", dict).items():
        if not isinstance(fqn, str):
            raise FormatViolation("value keys must be strings")
        if isinstance(v, list) and len(v) == 4 and v[0] == "provider" and isinstance(v[3], dict) \
                and "p" in v[3]:
            node = Chunk((), (), None)
            _provider_fields(node, v[3], files, block_size, version, fqn)
            values[fqn] = ValueEntry("provider", b"", 0, node)
            continue
        if not isinstance(v, list) or len(v) != 3 or v[0] not in ("msgpack", "pickle", "torch") \
                or not isinstance(v[1], bytes):
            raise FormatViolation(f"value {fqn!r} is malformed")
        values[fqn] = ValueEntry(v[0], v[1], _int(v[2], f"{fqn} checksum", 0, (1 << 64) - 1))
    return values


def _tail_of(body: dict, tail) -> DigestTail | None:
    """The digest tail a format 4 part announces (``sums_tail``: length and xxh3-128)."""
    if "sums_tail" not in body:
        return None
    w = body["sums_tail"]
    if not (isinstance(w, list) and len(w) == 2 and isinstance(w[1], bytes) and len(w[1]) == DIGEST_BYTES):
        raise FormatViolation("sums_tail must be [length, xxh3-128 digest]")
    n = _int(w[0], "sums_tail length", 0, MAX_MANIFEST_BYTES)
    if tail is None:
        raise FormatViolation("its block digests are in the file's tail: read it through the index that names it")
    return tail(n, w[1])


def _from_body(body, source: str = "<memory>", tail=None, parts: Sequence[PartReader] = ()) -> Manifest:
    if not isinstance(body, dict):
        raise FormatViolation("body must be a map")
    if body.get("format") != FORMAT_NAME:
        raise FormatViolation(f"format is {body.get('format')!r}, expected {FORMAT_NAME!r}")
    version = _req(body, "version", int)
    if version not in READABLE_VERSIONS:
        raise UnsupportedFormatVersion(
            f"format version {version} is not supported by this dcp-datastates "
            f"(reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade dcp-datastates")
    block_size = _int(_req(body, "block_size", int), "block_size", 4096, 1 << 34)
    world = _int(_req(body, "world_size", int), "world_size", 1, MAX_WORLD)
    ranks = [_int(r, "rank", 0, world - 1) for r in _req(body, "ranks", list)]
    named: dict[str, int] = {}
    if version >= 3:  # a list, so that the tensor table can refer to files by position
        for pair in _req(body, "files", list):
            if not isinstance(pair, list) or len(pair) != 2:
                raise FormatViolation("files must be a list of [name, size] pairs")
            if check_file_name(pair[0]) in named:
                raise FormatViolation(f"file {pair[0]!r} is listed twice")
            named[pair[0]] = _int(pair[1], f"size of {pair[0]}")
    else:
        for name, size in _req(body, "files", dict).items():
            named[check_file_name(name)] = _int(size, f"size of {name}")
    ranked = file_map = None
    files: Mapping[str, int] = named
    if version >= INDEX_VERSION:  # after those listed by name, each rank's own files (ranked.py)
        ranked = RankFiles(body.get("rank_files"), world, _save_id(body))
        files = file_map = FileMap(named, ranked)
    homes: dict[str, str] = {}
    raw_homes = (body.get("homes") or {}) if version >= 2 else {}
    if not isinstance(raw_homes, dict):
        raise FormatViolation("homes must be a map")
    for name, home in raw_homes.items():
        if check_file_name(name) not in files:
            raise FormatViolation(f"home given for file {name!r}, which the manifest does not list")
        if not name.endswith(".dsd"):  # only data files are ever read from a sibling directory
            raise FormatViolation(f"file {name!r} in another directory is not a data file (*.dsd)")
        homes[name] = check_file_name(home)
    index = None
    if ranked is not None and file_map is not None:
        index = IndexTable(body, files=file_map, ranked=ranked, homes=homes, world=world, save_id=_save_id(body),
                           source=source, block_size=block_size, parts=parts,
                           decode=lambda data, where, tail: decode_manifest(data, source=where, tail=tail))
        tensors = {t.fqn: TensorEntry(t.dtype, t.size, table=index, row=i) for i, t in enumerate(index.tensors)}  # dtypes checked
        if ranks:
            raise FormatViolation("an index lists no ranks: its parts give them")
        ranks = index.parts.ranks()
    elif version >= 3:
        tensors = decode_table(_req(body, "table", dict), list(files.items()), block_size,
                               lambda fqn, o, z, w: _special_chunk(fqn, o, z, w, files, block_size, version),
                               source, _tail_of(body, tail))
    else:
        tensors = _tensors_v2(body, named, block_size, version)
    values = _values(body, files, block_size, version)
    planner_data = _req(body, "planner_data", dict)
    for k, path in planner_data.items():
        if not isinstance(k, str) or not isinstance(path, list) or not all(isinstance(p, (str, int)) for p in path):
            raise FormatViolation(f"planner_data for {k!r} must be a list of str/int")
    if index is not None:  # the tensors' paths, cut from their names by pattern
        planner_data = {**paths_from_wire(body.get("paths"), [t.fqn for t in index.tensors]), **planner_data}
    save_id = _save_id(body)
    for key, typ in (("created_unix", (int, float)), ("torch", str), ("writer", str)):
        if key in body and body[key] is not None and not isinstance(body[key], typ):
            raise FormatViolation(f"field {key!r} has the wrong type ({type(body[key]).__name__})")
    return Manifest(
        save_id=save_id, world_size=world, ranks=ranks, files=files,
        tensors=tensors, values=values, planner_data=planner_data, homes=homes, version=version,
        block_size=block_size,
        created_unix=float(body.get("created_unix", 0.0) or 0.0),
        torch_version=str(body.get("torch", "")), writer=str(body.get("writer", "")),
        extra=extra if isinstance(extra := body.get("extra"), dict) else {},
        index=index,
    )


def _save_id(body: dict) -> str:
    save_id = body.get("save_id", "")
    if not isinstance(save_id, str):
        raise FormatViolation("save_id must be a string")
    return save_id


