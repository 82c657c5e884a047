"""Test helper: rewrite a committed manifest's body with a valid checksum (crafted input)."""

from __future__ import annotations

import os
import struct
import zlib

import msgpack
import xxhash

from dcp_datastates.format.manifest import _HEADER_FIELDS, MAGIC, decode_manifest, encode_manifest


def rewrite_manifest(directory: str, mutate, *, version: int = 2) -> None:
    """Decode ``directory/.metadata``, let ``mutate(body)`` change it, re-encode it validly.

    ``version=2`` (the default) first rewrites the manifest in format version 2, whose body has
    one map per chunk that the mutations below reach by path (``body["tensors"]["w"]...``):
    those cases test the decoder that still reads version 2 checkpoints.  ``version=3`` hands
    ``mutate`` the body as written (the columnar table; a format 4 index unpacked, and packed
    again after)."""
    p = os.path.join(directory, ".metadata")
    with open(p, "rb") as f:
        data = f.read()
    if version == 2:
        data = encode_manifest(decode_manifest(data), version=2)
    body = msgpack.unpackb(data[len(MAGIC):-8], raw=False, strict_map_key=False)
    packed = "packed" in body  # format 4: the fields after the header are one zlib stream
    if packed:
        body.update(msgpack.unpackb(zlib.decompress(body.pop("packed")), raw=False, strict_map_key=False))
    mutate(body)
    if packed:
        rest = {k: body.pop(k) for k in list(body) if k not in _HEADER_FIELDS}
        body["packed"] = zlib.compress(msgpack.packb(rest, use_bin_type=True))
    payload = msgpack.packb(body, use_bin_type=True)
    with open(p, "wb") as f:
        f.write(MAGIC + payload + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload)))
