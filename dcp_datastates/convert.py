"""Conversions to and from DCP's FileSystemWriter format and to HuggingFace safetensors.

Each conversion streams: tensors are read a batch at a time (``ConvertOptions.batch_bytes``,
256 MiB by default, or one tensor when it is larger) and written before the next batch is
read, so memory holds one batch and the small non-tensor values, never the whole state.

* ``to_dcp``: dcp-datastates -> DCP ``FileSystemWriter`` (readable by any DCP).
* ``from_dcp``: DCP ``FileSystemWriter`` -> dcp-datastates.  DCP's ``.metadata`` is a pickle and
  its non-tensor values are ``torch.save`` blobs: convert only checkpoints you trust.
* ``to_safetensors``: tensors, as one file (``dst`` named ``*.safetensors``) or a directory
  holding ``model.safetensors`` or shards of at most ``max_shard_bytes`` with a
  ``model.safetensors.index.json``.  Keys are DCP's flattened names (``keys`` picks some,
  ``strip_prefix`` shortens them); non-tensor values are written to ``values.json`` beside.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import json
import logging
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from .errors import CoverageError, ManifestError, PickleNotAllowedError
from .format.layout import align_up
from .format.limits import MAX_FILE_BYTES, FormatViolation
from .format.model import BareBox, check_tiling
from .format.names import MANIFEST_NAME
from .load.reader import DataStatesReader
from .save.writer import DataStatesWriter

log = logging.getLogger(__name__)

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
for _n, _c in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _n):
        _ST_DTYPES[getattr(torch, _n)] = _c


@dataclass
class ConvertOptions:
    """How a conversion runs.  ``batch_bytes``: the most tensor bytes read into memory at
    once (a tensor larger than that is read alone); ``progress(done, total, label)``: called
    as tensor bytes are written."""
    batch_bytes: int = 256 << 20
    progress: Callable[[int, int, str], None] | None = None


def _tensor_md(md: object) -> TensorStorageMetadata:
    """``md`` as a tensor's metadata (callers pass the keys ``_tensor_keys`` chose)."""
    if not isinstance(md, TensorStorageMetadata):
        raise TypeError(f"expected a tensor's metadata, got {type(md).__name__}")
    return md


def _nbytes(md: object) -> int:
    t = _tensor_md(md)
    return math.prod(t.size) * t.properties.dtype.itemsize


class _Batches:
    """Tensors of a checkpoint, read a batch at a time (``batch_bytes`` at most, in the order
    given) through DCP's public ``load`` into tensors allocated here: memory holds one batch,
    never the whole state."""

    def __init__(self, reader, metadata: Metadata, order: list[str], opts: ConvertOptions, label: str):
        self.reader, self.md, self.opts, self.label = reader, metadata.state_dict_metadata, opts, label
        self.order = order
        self.next = 0
        self.ready: dict[str, torch.Tensor] = {}
        self.total = sum(_nbytes(self.md[k]) for k in order)
        self.done = 0

    def take(self, fqn: str) -> torch.Tensor:
        if fqn not in self.ready:
            self._read_from(fqn)
        t = self.ready.pop(fqn)
        self.done += t.numel() * t.element_size()
        if self.opts.progress:
            self.opts.progress(self.done, self.total, self.label)
        return t

    def _read_from(self, fqn: str) -> None:
        if self.order[self.next:self.next + 1] != [fqn]:
            self.next = self.order.index(fqn)  # asked out of order: go on from there
        pending = (k for k in itertools.islice(self.order, self.next, None) if k not in self.ready)
        group = next(_groups(pending, self.md, self.opts.batch_bytes))
        self.next = self.order.index(group[-1], self.next) + 1
        batch = {k: torch.empty(m.size, dtype=m.properties.dtype) for k in group if (m := _tensor_md(self.md[k]))}
        dcp.load(batch, storage_reader=self.reader, no_dist=True)
        self.ready.update(batch)


def check_tensors(metadata: Metadata, keys: list[str], checkpoint: str) -> None:
    """Every tensor of ``keys`` declares a size a file can hold, and its saved chunks lie inside
    it, do not overlap and cover it whole: checked over the chunks the metadata lists, before
    anything is allocated or written (a lost chunk would otherwise convert as zeros)."""
    for k in keys:
        t = _tensor_md(metadata.state_dict_metadata[k])
        size = tuple(int(s) for s in t.size)
        if any(s < 0 for s in size):
            raise ManifestError(f"declares the size {list(size)}", checkpoint=checkpoint, key=k)
        numel = math.prod(size)
        if numel * t.properties.dtype.itemsize > MAX_FILE_BYTES:
            raise ManifestError(f"declares {numel} elements of {t.properties.dtype}, more than any file "
                                "holds; the metadata is damaged", checkpoint=checkpoint, key=k)
        covered, boxes = 0, []
        for c in t.chunks:
            o, z = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
            if len(o) != len(size) or len(z) != len(size) or any(
                    a < 0 or n < 0 or a + n > s for a, n, s in zip(o, z, size)):
                raise ManifestError(f"a chunk at {list(o)} of size {list(z)} lies outside the tensor's "
                                    f"size {list(size)}", checkpoint=checkpoint, key=k)
            covered += math.prod(z)
            boxes.append(BareBox(o, z))
        try:
            check_tiling(k, boxes)
        except FormatViolation as e:
            raise ManifestError(str(e), checkpoint=checkpoint, key=k) from None
        if covered != numel:
            raise CoverageError(f"its chunks cover {covered} of the {numel} elements it declares: a chunk "
                                "is missing, so nothing was converted", checkpoint=checkpoint, key=k)


def _tensor_keys(metadata: Metadata) -> list[str]:
    return [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]


def _values(reader, metadata: Metadata) -> dict:
    """The non-tensor values of a checkpoint (small), by flattened name."""
    keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    if not keys:
        return {}
    values: dict = dict.fromkeys(keys)  # by their flattened names; this process alone, whatever group is up
    dcp.load(values, storage_reader=reader, no_dist=True)
    return values


class _StreamingSavePlanner(DefaultSavePlanner):
    """Saves a state dict whose tensors are placeholders on the meta device: each tensor is
    read from the source when the writer asks for its bytes (``resolve_data``)."""

    def __init__(self, batches: _Batches):
        super().__init__()
        self.batches = batches

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        # the writer asks for the tensors in its plan's order: read them in that order
        self.batches.order = [i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO]
        return plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self.batches.take(write_item.index.fqn)


def _placeholders(metadata: Metadata, values: dict) -> dict:
    flat = dict(values)
    for k in _tensor_keys(metadata):
        md = _tensor_md(metadata.state_dict_metadata[k])
        flat[k] = torch.empty(md.size, dtype=md.properties.dtype, device="meta")
    return _nested(flat, metadata)


def to_dcp(src: str, dst: str, *, storage_options: dict | None = None,
           options: ConvertOptions | None = None) -> None:
    """Write checkpoint ``src`` in DCP's ``FileSystemWriter`` format, tensor batch by batch."""
    opts = options or ConvertOptions()
    reader = DataStatesReader(src, storage_options=storage_options)
    md = reader.read_metadata()
    batches = _Batches(reader, md, _tensor_keys(md), opts, "convert")
    state = _placeholders(md, _values(reader, md))
    # one file per item: FileSystemWriter keeps every tensor of a file until the file is closed
    dcp.save(state, storage_writer=dcp.FileSystemWriter(dst, single_file_per_rank=False, thread_count=1),
             planner=_StreamingSavePlanner(batches), no_dist=True)


def from_dcp(src: str, dst: str, *, allow_pickle: bool = False, options: ConvertOptions | None = None) -> None:
    """DCP's ``.metadata`` is a pickle and its values are ``torch.save`` blobs: reading them
    runs code from the checkpoint, so this needs ``allow_pickle=True`` (a trusted source).

    DCP's files hold each tensor as a ``torch.save`` blob that only its reader decodes, so the
    tensors are read a batch at a time into a scratch file mapped in memory beside ``dst``
    (as large as the tensors; removed at the end), which the save then reads from: host memory
    stays bounded, the page cache holds what the kernel lets it."""
    if not allow_pickle:
        raise PickleNotAllowedError(
            "DCP's .metadata is a pickle and reading it would run code from the file; pass "
            "--allow-pickle (allow_pickle=True) only if you trust this checkpoint",
            checkpoint=src, file=MANIFEST_NAME)
    opts = options or ConvertOptions()
    reader = dcp.FileSystemReader(src)
    md = reader.read_metadata()
    keys = _tensor_keys(md)
    check_tensors(md, keys, src)
    offsets, pos = {}, 0
    for k in keys:
        offsets[k] = pos
        pos = align_up(pos + _nbytes(md.state_dict_metadata[k]), 64)
    total = sum(_nbytes(md.state_dict_metadata[k]) for k in keys)
    scratch = f"{dst.rstrip('/')}.convert-scratch"
    try:
        arena = torch.from_file(scratch, shared=True, size=max(pos, 1), dtype=torch.uint8)
        views = {}
        for k in keys:
            m = _tensor_md(md.state_dict_metadata[k])
            views[k] = arena[offsets[k]:offsets[k] + _nbytes(m)].view(m.properties.dtype).view(m.size)
        done = 0
        for group in _groups(keys, md.state_dict_metadata, opts.batch_bytes):
            dcp.load({k: views[k] for k in group}, storage_reader=reader, no_dist=True)
            done += sum(_nbytes(md.state_dict_metadata[k]) for k in group)
            if opts.progress:
                opts.progress(done, total, "convert")
        state = _nested({**_values(reader, md), **views}, md)
        dcp.save(state, storage_writer=DataStatesWriter(dst, allow_pickle=allow_pickle, host_cache_bytes=opts.batch_bytes),
                 no_dist=True)
    finally:
        if os.path.exists(scratch):
            os.remove(scratch)


def _groups(keys, sdm: dict, batch_bytes: int):
    """``keys`` in order, in runs of at most ``batch_bytes`` of tensor (or one larger tensor);
    ``sdm``: the checkpoint's ``state_dict_metadata``."""
    group, size = [], 0
    for k in keys:
        n = _nbytes(sdm[k])
        if group and size + n > batch_bytes:
            yield group
            group, size = [], 0
        group.append(k)
        size += n
    if group:
        yield group


def _nested(flat: dict, md: Metadata) -> dict:
    """``flat`` in the checkpoint's own nesting (``planner_data``), so that the converted
    checkpoint has the same keys."""
    mapping = md.planner_data if isinstance(md.planner_data, dict) else {}
    if flat and all(k in mapping for k in flat):
        return unflatten_state_dict(flat, {k: mapping[k] for k in flat})
    return flat


def _write_safetensors(path: str, entries: list[tuple[str, str]], md: Metadata, batches: _Batches) -> None:
    """One safetensors file of ``entries`` (name in the file, checkpoint key): the header comes
    from the checkpoint's metadata, the tensors are read a batch at a time as they are written."""
    header: dict = {}
    pos = 0
    for name, key in entries:
        m = _tensor_md(md.state_dict_metadata[key])
        n = _nbytes(m)
        header[name] = {"dtype": _ST_DTYPES[m.properties.dtype], "shape": list(m.size),
                        "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    # pad the header with spaces so the data starts 4 KiB-aligned (the format allows it)
    hlen = align_up(8 + len(raw)) - 8
    raw = raw + b" " * (hlen - len(raw))
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", hlen))
            f.write(raw)
            for _, key in entries:
                t = batches.take(key)
                if t.numel():
                    f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
                del t
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.remove(path)  # never leave a file whose header promises tensors it does not hold
        raise


@dataclass
class SafetensorsExport:
    """What ``to_safetensors`` wrote: the safetensors files, and the non-tensor values left
    out (safetensors holds tensors only), written as JSON beside them when there are any."""
    files: list[str]
    left_out: list[str] = field(default_factory=list)
    values_file: str | None = None

    def __bool__(self) -> bool:
        return bool(self.files)

    def __len__(self) -> int:
        return len(self.files)


def to_safetensors(src: str, dst: str, *, max_shard_bytes: int | None = None,
                   storage_options: dict | None = None, keys: list[str] | None = None,
                   strip_prefix: str | None = None, options: ConvertOptions | None = None) -> SafetensorsExport:
    """Export the tensors of checkpoint ``src``.

    ``dst`` named ``*.safetensors`` is one file; anything else is a directory that receives
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` and
    ``model.safetensors.index.json`` (HuggingFace's layout).  ``keys``: glob patterns of the
    flattened names to export (default all); ``strip_prefix``: removed from the names that
    start with it (``"model."`` for a HuggingFace model).  Non-tensor values go to
    ``values.json`` beside the tensors (``<file>.values.json`` for a single file)."""
    opts = options or ConvertOptions()
    reader = DataStatesReader(src, storage_options=storage_options)
    md = reader.read_metadata()

    def picked(k: str) -> bool:
        return not keys or any(fnmatch.fnmatchcase(k, p) for p in keys)

    def renamed(k: str) -> str:
        return k[len(strip_prefix):] if strip_prefix and k.startswith(strip_prefix) else k
    tensors = [(renamed(k), k) for k in _tensor_keys(md) if picked(k)]
    check_tensors(md, [k for _, k in tensors], src)
    bad = sorted(k for _, k in tensors if _tensor_md(md.state_dict_metadata[k]).properties.dtype not in _ST_DTYPES)
    if bad:
        raise ValueError(f"dtypes of {bad[:5]} have no safetensors code")
    single_file = dst.endswith(".safetensors")
    if single_file and max_shard_bytes:
        raise ValueError(f"{dst} names one file; give a directory to shard into")
    values = {renamed(k): v for k, v in _values(reader, md).items() if picked(k)}
    if not single_file:
        os.makedirs(dst, exist_ok=True)
    out = SafetensorsExport([])
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for name, k in tensors:
        n = _nbytes(md.state_dict_metadata[k])
        if max_shard_bytes and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, k))
        size += n
    batches = _Batches(reader, md, [k for shard in shards for _, k in shard], opts, "convert")
    written: list[str] = []  # whole or nothing: a check failing half-way leaves no file behind
    try:
        if not max_shard_bytes:
            path = dst if single_file else os.path.join(dst, "model.safetensors")
            written.append(path)
            _write_safetensors(path, shards[0], md, batches)
            out.files = [path]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            weight_map = {}
            for name, shard in zip(names, shards):
                written.append(os.path.join(dst, name))
                _write_safetensors(written[-1], shard, md, batches)
                weight_map.update({n: name for n, _ in shard})
            written.append(os.path.join(dst, "model.safetensors.index.json"))
            with open(written[-1], "w") as f:
                json.dump({"metadata": {"total_size": batches.total}, "weight_map": weight_map}, f, indent=1)
            out.files = [os.path.join(dst, n) for n in names]
        if values:  # last: once every tensor was read and checked
            out.left_out = sorted(values)
            out.values_file = f"{dst}.values.json" if single_file else os.path.join(dst, "values.json")
            written.append(out.values_file)
            with open(out.values_file, "w") as f:
                json.dump(values, f, indent=1, sort_keys=True, default=repr)
            log.warning("safetensors holds tensors only: %d values written to %s instead (%s)",
                        len(values), out.values_file, ", ".join(out.left_out[:10]))
    except BaseException:
        for path in written:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        raise
    return out
