"""What DCP is told of a manifest: its ``Metadata``."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..format.dtypes import dtype_from_name
from ..format.model import ChunkMetadataView, Manifest


def manifest_to_metadata(m: Manifest, checkpoint_id: str | None) -> Metadata:
    """DCP's ``Metadata`` of manifest ``m``: each tensor's chunks in the manifest's order (a
    ``ReadItem``'s ``storage_index.index`` is then the chunk's place in ``m``).  No
    ``storage_data``: this reader finds chunks in the manifest, not through DCP.  A lazily
    decoded tensor's chunks are a ``ChunkMetadataView``, listed only when DCP's planner walks
    them."""
    sdm: dict[str, STORAGE_TYPES] = {}
    csm, size = ChunkStorageMetadata, torch.Size
    props: dict[str, TensorProperties] = {}
    for fqn, t in m.tensors.items():
        p = props.get(t.dtype)
        if p is None:
            p = props[t.dtype] = TensorProperties(dtype=dtype_from_name(t.dtype))
        chunks = ChunkMetadataView(t) if t.lazy else [csm(size(c.offsets), size(c.sizes)) for c in t.chunks]
        sdm[fqn] = TensorStorageMetadata(properties=p, size=size(t.size), chunks=chunks)  # pyright: ignore[reportArgumentType] (a Sequence DCP indexes and walks)
    for fqn in m.values:
        sdm[fqn] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=sdm,
                    planner_data={k: tuple(v) for k, v in m.planner_data.items()},
                    storage_data={},
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=m.save_id))
