"""Test helper: rewrite a committed manifest's body with a valid checksum (crafted input)."""

from __future__ import annotations

import os
import struct

import msgpack
import xxhash

from dcp_datastates.format.manifest import MAGIC, decode_manifest, encode_manifest


def rewrite_manifest(directory: str, mutate, *, version: int = 2) -> None:
    """Decode ``directory/.metadata``, let ``mutate(body)`` change it, re-encode it validly.

    ``version=2`` (the default) first rewrites the manifest in format version 2, whose body has
    one map per chunk that the mutations below reach by path (``body["tensors"]["w"]...``):
    those cases test the decoder that still reads version 2 checkpoints.  ``version=3`` hands
    ``mutate`` the body as written (the columnar table)."""
    p = os.path.join(directory, ".metadata")
    with open(p, "rb") as f:
        data = f.read()
    if version == 2:
        data = encode_manifest(decode_manifest(data), version=2)
    body = msgpack.unpackb(data[len(MAGIC):-8], raw=False, strict_map_key=False)
    mutate(body)
    payload = msgpack.packb(body, use_bin_type=True)
    with open(p, "wb") as f:
        f.write(MAGIC + payload + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload)))
