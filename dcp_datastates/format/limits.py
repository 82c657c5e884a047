"""Every bound the format's decoders enforce, the int64 column type, and the error they raise.

A decoder checks each declared size, count and range against these bounds before it uses it
(and before it allocates anything for it), so a crafted or damaged manifest costs work
linear in its own bytes.  A field that breaks the format raises :class:`FormatViolation`; the
decoder's entry point turns it into ``ManifestError`` naming the checkpoint and file.
"""

from __future__ import annotations

import numpy as np

MAX_MANIFEST_BYTES = 1 << 31  # a manifest, an index or a part's head
MAX_PART_BYTES = 1 << 31  # a format 4 metadata part, head and tail
MAX_FILE_BYTES = 1 << 50  # a data file, and so any offset or length into one
MAX_NDIM = 64  # dimensions of a tensor
MAX_DIM = 1 << 48  # elements along one dimension
MAX_ENTRIES = 1 << 24  # chunks, files or values of one manifest
MAX_WORLD = 1 << 22  # ranks of a save
MAX_RULES = 1 << 20  # sharding rules of a format 4 index
MAX_MESH_DIMS = 8  # dimensions of a device mesh
MAX_STRIPE = 99  # data files of one rank (names hold two digits of stripe)
MAX_TREE_DEPTH = 32  # nesting of registered providers in one chunk
MAX_VALUE_BYTES = 1 << 30  # one encoded value
MAX_CONTAINER_LEN = 1 << 24  # elements of one list or map inside a value
MAX_EXT_DEPTH = 32  # nesting of extension types inside a value
# a chunk of a tensor without a sharding rule at most this large is held whole in the index
SMALL_ITEM_BYTES = 64 << 10

INT64 = np.dtype("<i8")  # every integer column of versions 3 and 4, little-endian on disk
NO_INTS = np.zeros(0, dtype=INT64)  # an empty int64 column, shared: never written to
NO_INTS.flags.writeable = False


class FormatViolation(Exception):
    """A manifest field breaks the format.  Raised deep inside decoding, where the file is not
    known; the entry point (``decode_manifest``, an index reading a part) re-raises it as
    ``ManifestError`` naming the checkpoint, the file and, where known, the tensor."""
