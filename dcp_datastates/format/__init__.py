"""On-disk format: layout of data files, block checksums, the msgpack manifest.

See ``docs/format.md`` for the specification this package implements.
"""

from .checksum import BLOCK_SIZE, block_checksums, verify_blocks
from .dtypes import dtype_from_name, dtype_name
from .layout import ALIGNMENT, align_up
from .manifest import decode_manifest, encode_manifest
from .model import FORMAT_VERSION, Manifest
from .names import MANIFEST_NAME

__all__ = [
    "ALIGNMENT",
    "BLOCK_SIZE",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "align_up",
    "block_checksums",
    "decode_manifest",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
    "verify_blocks",
]
