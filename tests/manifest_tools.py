"""Test helper: rewrite a committed manifest's body with a valid checksum (crafted input)."""

from __future__ import annotations

import os
import struct

import msgpack
import xxhash

from dcp_datastates.format.manifest import MAGIC


def rewrite_manifest(directory: str, mutate) -> None:
    """Decode ``directory/.metadata``, let ``mutate(body)`` change it, re-encode it validly."""
    p = os.path.join(directory, ".metadata")
    with open(p, "rb") as f:
        data = f.read()
    body = msgpack.unpackb(data[len(MAGIC):-8], raw=False, strict_map_key=False)
    mutate(body)
    payload = msgpack.packb(body, use_bin_type=True)
    with open(p, "wb") as f:
        f.write(MAGIC + payload + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload)))
