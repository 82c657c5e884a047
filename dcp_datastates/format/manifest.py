"""The manifest: the one file that says what a checkpoint holds and where.

File layout (``docs/format.md`` is the specification)::

    MAGIC (16 bytes)  msgpack map (the body)  xxh3-64 of the body (8 bytes, LE)

The versions, all still read:

* 1: per-block xxh3-64 digests, each chunk a msgpack map;
* 2: per-block xxh3-128 digests, an extent may be several segments, and a file may live in a
  sibling checkpoint of the run (``homes``: how an incremental save references unchanged bytes);
* 3 (written by ``DataStatesWriter`` without sharding rules, and as each rank's format 4
  part): the tensors as one table of integer columns (``table.py``);
* 4 (written where the save planner gave sharding rules): an index of rules and per-rank
  parts (``v4/index.py``), assembled by ``assemble.py``.

This module holds the envelope (magic, body, trailer), the version dispatch and the version
1 and 2 decoders; the formats 3 and 4 have modules of their own.

The magic starts with 0xFF, which is not a pickle opcode, so a tool that
mistakes the file for DCP's pickled ``.metadata`` fails at the first byte.
Decoding validates every field against hard limits before anything uses it:
types, non-negative and bounded sizes, extents inside their files, file names
that cannot leave the checkpoint directory, dtypes from a fixed table.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Mapping, Sequence

import msgpack
import xxhash

from ..errors import ForeignFormatError, ManifestError, UnsupportedFormatVersion
from ..gcpause import paused_gc
from .checksum import DIGEST_BYTES, DigestTail
from .fields import check_file_name, field, int_field, special_chunk, values_of
from .legacy import ChunkStream, tensors_v2, unpacker
from .limits import (
    MAX_MANIFEST_BYTES,
    MAX_WORLD,
    FormatViolation,
)
from .model import (
    FORMAT_VERSION,
    Chunk,
    Manifest,
    TensorEntry,
    ValueEntry,
)
from .table import decode_table, encode_table
from .v4.index import INDEX_VERSION, IndexTable, PartReader
from .v4.planner_paths import paths_from_wire, paths_wire
from .v4.rank_files import FileMap, RankFiles, seal_tail
from .values import pack_plain

MAGIC = b"\xffDCP-DATASTATES\n"
FORMAT_NAME = "dcp-datastates"
READABLE_VERSIONS = (1, 2, 3, 4)




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
    used): ``index`` is ``format.v4.index.index_wire``'s map of rules, explicit chunks and parts.
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
    """The body as a dict whose tensors' ``chunks`` are ``ChunkStream`` objects; a packed
    body's fields inflated into it (``outer``: packing is allowed at this level only)."""
    up = unpacker(payload)
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
    tup = unpacker(section)
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
                t[k] = ChunkStream(section[a:b])
            else:
                t[k] = tup.unpack()
        tensors[fqn] = t
    body["tensors"] = tensors
    return body




def _tail_of(body: dict, tail) -> DigestTail | None:
    """The digest tail a format 4 part announces (``sums_tail``: length and xxh3-128)."""
    if "sums_tail" not in body:
        return None
    w = body["sums_tail"]
    if not (isinstance(w, list) and len(w) == 2 and isinstance(w[1], bytes) and len(w[1]) == DIGEST_BYTES):
        raise FormatViolation("sums_tail must be [length, xxh3-128 digest]")
    n = int_field(w[0], "sums_tail length", 0, MAX_MANIFEST_BYTES)
    if tail is None:
        raise FormatViolation("its block digests are in the file's tail: read it through the index that names it")
    return tail(n, w[1])


def _from_body(body, source: str = "<memory>", tail=None, parts: Sequence[PartReader] = ()) -> Manifest:
    if not isinstance(body, dict):
        raise FormatViolation("body must be a map")
    if body.get("format") != FORMAT_NAME:
        raise FormatViolation(f"format is {body.get('format')!r}, expected {FORMAT_NAME!r}")
    version = field(body, "version", int)
    if version not in READABLE_VERSIONS:
        raise UnsupportedFormatVersion(
            f"format version {version} is not supported by this dcp-datastates "
            f"(reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade dcp-datastates")
    block_size = int_field(field(body, "block_size", int), "block_size", 4096, 1 << 34)
    world = int_field(field(body, "world_size", int), "world_size", 1, MAX_WORLD)
    ranks = [int_field(r, "rank", 0, world - 1) for r in field(body, "ranks", list)]
    named: dict[str, int] = {}
    if version >= 3:  # a list, so that the tensor table can refer to files by position
        for pair in field(body, "files", list):
            if not isinstance(pair, list) or len(pair) != 2:
                raise FormatViolation("files must be a list of [name, size] pairs")
            if check_file_name(pair[0]) in named:
                raise FormatViolation(f"file {pair[0]!r} is listed twice")
            named[pair[0]] = int_field(pair[1], f"size of {pair[0]}")
    else:
        for name, size in field(body, "files", dict).items():
            named[check_file_name(name)] = int_field(size, f"size of {name}")
    ranked = file_map = None
    files: Mapping[str, int] = named
    if version >= INDEX_VERSION:  # after those listed by name, each rank's own files (v4/rank_files.py)
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
        tensors = decode_table(field(body, "table", dict), list(files.items()), block_size,
                               lambda fqn, o, z, w: special_chunk(fqn, o, z, w, files, block_size, version),
                               source, _tail_of(body, tail))
    else:
        tensors = tensors_v2(body, named, block_size, version)
    values = values_of(body, files, block_size, version)
    planner_data = field(body, "planner_data", dict)
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


