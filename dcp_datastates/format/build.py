"""The manifest, built from the typed records every rank sent (``records.py``)."""

from __future__ import annotations

import time

from .checksum import BLOCK_SIZE
from .model import Chunk, Manifest, TensorEntry, ValueEntry
from .records import ItemRecord


def build_manifest(*, shapes: dict[str, tuple[str, tuple[int, ...]]],
                   results: list[list[tuple[str, tuple[int, ...] | None, ItemRecord]]],
                   planner_data: dict[str, list], save_id: str, world_size: int,
                   torch_version: str, writer: str) -> Manifest:
    """``shapes``: dtype and global size of every tensor of the save; ``results``: per rank,
    ``(key, chunk offsets or None, record)`` for each item it wrote."""
    files: dict[str, int] = {}
    homes: dict[str, str] = {}
    ranks: list[int] = []
    tensors = {fqn: TensorEntry(dt, tuple(size), []) for fqn, (dt, size) in shapes.items()}
    values: dict[str, ValueEntry] = {}
    seen: set[tuple] = set()
    seen_add = seen.add
    for rank_results in results:
        for fqn, offsets, rec in rank_results:
            if rec.rank is not None:
                files.update(rec.rank.files)
                homes.update(rec.rank.homes)
                ranks.append(rec.rank.rank)
            if rec.kind == "value":
                assert rec.value is not None, "a value record carries its value"
                values[fqn] = rec.value
                continue
            if rec.kind == "provider-value":
                values[fqn] = ValueEntry("provider", b"", 0, Chunk((), (), None, rec.provider, rec.meta,
                                                                   dict(rec.parts), rec.tree))
                continue
            offs = tuple(offsets) if offsets else ()
            key = (fqn, offs)
            if key in seen:  # a replicated item written by several ranks: keep one
                continue
            seen_add(key)
            if rec.kind == "tensor":
                tensors[fqn].chunks.append(Chunk(offs, rec.sizes, rec.extent))
            else:
                tensors[fqn].chunks.append(Chunk(key[1], tuple(rec.sizes), None, rec.provider,
                                                 rec.meta, dict(rec.parts), rec.tree))
    return Manifest(save_id=save_id, world_size=max(world_size, len(results)),
                    ranks=sorted(set(ranks)) or list(range(len(results))), files=files, homes=homes,
                    tensors=tensors, values=values, planner_data=planner_data, block_size=BLOCK_SIZE,
                    created_unix=time.time(), torch_version=torch_version, writer=writer)
