"""Read tasks: one per DCP ``ReadItem``, knowing which byte ranges to read, into what, and how
to finish (cut the box out, cast, upload to a GPU, or rebuild a registered type).

Life of a task: the reader makes it (its ``ranges`` and ``needed`` bytes are fixed then);
reader threads fill its ``buffer()`` range by range (``files.Fetcher``), any range on any
thread; once every range landed, ``finalize()`` runs once, on one thread; then the reader hands
``dest`` (or ``rebuilt``) to DCP's planner.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from ..engine.upload import DeviceUpload, HostUpload
from ..errors import ProviderError
from ..format.dtypes import dtype_from_name
from ..format.model import Chunk, Extent
from ..providers import rebuild
from .ranges import COALESCE_PIECE, ByteRange, block_ranges, box_runs, strides_of


def is_whole(chunk: Chunk, tensor_size: tuple[int, ...] | None) -> bool:
    """Whether ``chunk`` is its whole tensor (of global size ``tensor_size``; None: a value)."""
    return tensor_size is not None and tuple(chunk.sizes) == tuple(tensor_size) and not any(chunk.offsets)


def small_whole(ri, dest: torch.Tensor, dtype: str, chunk: Chunk) -> bool:
    """Whether ``ri`` reads small ``chunk`` whole, from one segment, straight into ``dest``: a
    contiguous CPU tensor of its dtype (most of a state's many small tensors, which then take
    a :class:`SmallTask`)."""
    ext = chunk.extent
    return ext is not None and len(ext.segs) == 1 and 0 < ext.nbytes <= COALESCE_PIECE and not ext.packed \
        and not any(ri.storage_offsets) and tuple(ri.lengths) == tuple(chunk.sizes) \
        and dest.device.type == "cpu" and dest.dtype == dtype_from_name(dtype) and dest.is_contiguous() \
        and dest.numel() * dest.element_size() == ext.nbytes


class SmallTask:
    """A :class:`ReadTask` for the case :func:`small_whole` accepts: one range, read in place."""

    __slots__ = ("ri", "dest", "block_size", "ranges", "buf_size", "needed", "_buf", "whole_tensor")
    streamed = False
    rebuilt = None

    def __init__(self, ri, dest: torch.Tensor, ext: Extent, block_size: int, *, whole_tensor: bool = False) -> None:
        seg = ext.segs[0]
        self.ri, self.dest, self.block_size = ri, dest, block_size
        self.whole_tensor = whole_tensor
        self.buf_size = self.needed = ext.nbytes
        self.ranges = [ByteRange(seg.file, seg.offset, ext.nbytes, 0, 0, ext)]
        self._buf: tuple[np.ndarray, int] | None = None

    def buffer(self) -> tuple[np.ndarray, int]:
        if self._buf is None:  # one range: one thread asks
            flat = self.dest.reshape(-1).view(torch.uint8)
            self._buf = (flat.numpy(), flat.data_ptr())
        return self._buf

    def attach_upload(self, up: DeviceUpload | HostUpload | None) -> None:
        """Nothing: a small task is read in place."""

    def finalize(self) -> None:
        """Nothing: the bytes were read in place."""


class ReadTask:
    """One ReadItem: which byte ranges to fetch, into what, and how to finish.

    ``dest`` is None for a registered type stored as a value (its rebuilt object is the
    result); ``tensor_size`` is the saved tensor's global size (None for a value), which tells
    whether a rebuilt object is the whole tensor."""

    def __init__(self, ri, dest: torch.Tensor | None, dtype_name: str, chunk: Chunk, block_size: int, *,
                 checkpoint: str | None = None, tensor_size: tuple[int, ...] | None = None) -> None:
        self.ri, self.dest, self.block_size = ri, dest, block_size
        self.dtype = dtype_from_name(dtype_name)
        self.chunk = chunk
        self.checkpoint, self.tensor_size = checkpoint, tensor_size
        self.whole_tensor = is_whole(chunk, tensor_size)
        self.rebuilt = None  # the object a registered provider rebuilt, when it replaces dest
        self.ranges: list[ByteRange] = []
        self.needed = 0  # bytes of stored chunks this item needs (what it reads, less block rounding)
        self.base = 0  # chunk byte offset of buffer position 0
        self._buf: tuple[np.ndarray, int] | None = None
        self._tensor: torch.Tensor | None = None  # the scratch buffer, when not reading in place
        self._direct = False  # read straight into the destination
        self.streamed = False  # whole chunk into a GPU tensor: piece by piece through pinned slabs
        self._whole = False  # the whole chunk into a contiguous destination of its dtype
        self.up: DeviceUpload | HostUpload | None = None  # the load's uploads to this destination
        self._buf_lock = threading.Lock()
        self.parts_layout: dict[str, tuple[str, tuple, int, int]] = {}
        if chunk.extent is None:  # provider chunk: read every part whole, rebuild, then narrow
            pos = 0
            for pname, (pdt, pshape, ext) in chunk.parts.items():
                self.parts_layout[pname] = (pdt, pshape, pos, ext.nbytes)
                self.ranges += block_ranges(ext, 0, ext.nbytes, pos, block_size)
                pos += ext.nbytes
            self.buf_size = self.needed = pos
            return
        assert dest is not None, "a tensor chunk is read into a tensor"
        ext = chunk.extent
        item = self.dtype.itemsize
        sizes = chunk.sizes
        offs, lens = tuple(ri.storage_offsets), tuple(ri.lengths)
        n_needed = self.needed = math.prod(lens) * item
        if n_needed == 0:
            self.buf_size = 0
            return
        whole = n_needed == ext.nbytes and dest.dtype == self.dtype and dest.is_contiguous() \
            and dest.numel() * item == ext.nbytes
        self._direct = whole and dest.device.type == "cpu"
        self._whole = whole
        if n_needed == ext.nbytes:  # the whole chunk (a box of its size can only start at 0)
            self.buf_size = ext.nbytes
            self.ranges += block_ranges(ext, 0, ext.nbytes, 0, block_size)
            return
        strides = strides_of(sizes)
        first = sum(o * s for o, s in zip(offs, strides)) * item
        last = (sum((o + n - 1) * s for o, n, s in zip(offs, lens, strides)) + 1) * item
        r0 = first // block_size * block_size
        r1 = min(-(-last // block_size) * block_size, ext.nbytes)
        self.base = r0
        self.buf_size = r1 - r0
        # the box as contiguous runs: read only the blocks they touch
        runs = box_runs(offs, lens, sizes, item)
        if len(runs) > 1 and self.buf_size > 1.25 * n_needed:
            spans: list[list[int]] = []
            for a, b in runs:
                a0 = a // block_size * block_size
                b1 = min(-(-b // block_size) * block_size, ext.nbytes)
                if spans and a0 <= spans[-1][1]:
                    spans[-1][1] = max(spans[-1][1], b1)
                else:
                    spans.append([a0, b1])
            for a0, b1 in spans:
                self.ranges += block_ranges(ext, a0, b1 - a0, a0 - r0, block_size)
        else:
            self.ranges += block_ranges(ext, r0, r1 - r0, 0, block_size)

    def attach_upload(self, up: DeviceUpload | HostUpload | None) -> None:
        """The load's uploads to this task's device; a whole chunk then streams through the
        load's slabs (``engine/upload.py``), and a box is cut out by the uploads."""
        self.up = up
        self.streamed = up is not None and self._whole
        if self.streamed:
            self._direct = False

    def buffer(self) -> tuple[np.ndarray, int]:
        """The bytes to read into (a numpy view) and their memory address."""
        with self._buf_lock:
            if self._buf is None:
                if self._direct:
                    assert self.dest is not None, "only a tensor is read in place"
                    flat = self.dest.reshape(-1).view(torch.uint8)
                else:
                    flat = self._tensor = torch.empty(self.buf_size, dtype=torch.uint8)
                self._buf = (flat.numpy(), flat.data_ptr())
            return self._buf

    def dest_bytes(self) -> torch.Tensor:
        assert self.dest is not None, "a streamed task has a destination"
        return self.dest.reshape(-1).view(torch.uint8)

    def scratch(self) -> torch.Tensor:
        """The buffer the ranges were read into, when not the destination itself."""
        self.buffer()
        assert self._tensor is not None, "read in place: there is no scratch buffer"
        return self._tensor

    def finalize(self) -> None:
        if self.chunk.extent is None:
            self._finalize_provider()
            return
        dest = self.dest
        assert dest is not None, "a tensor chunk is read into a tensor"
        if self._direct or self.streamed or dest.numel() == 0 or self.buf_size == 0:
            return
        raw_all = self.scratch()
        item = self.dtype.itemsize
        strides = strides_of(self.chunk.sizes)
        offs, lens = tuple(self.ri.storage_offsets), tuple(self.ri.lengths)
        first = sum(o * s for o, s in zip(offs, strides)) * item
        if self.up is not None:  # a box of the chunk into a GPU tensor: cut out on the device
            self.up.box(dest, raw_all, self.dtype, lens, strides, (first - self.base) // item)
            return
        raw = raw_all[first - self.base:]
        usable = raw.numel() // item * item
        typed = raw[:usable].view(self.dtype)
        src = typed.as_strided(lens, strides) if lens else typed[:1].reshape(())
        dest.copy_(src)

    def _finalize_provider(self) -> None:
        t = self.scratch()
        leaves = {}
        for pname, (pdt, pshape, pos, n) in self.parts_layout.items():
            dt = dtype_from_name(pdt)
            leaves[pname] = t[pos:pos + n].view(dt).reshape(pshape) if n else torch.empty(pshape, dtype=dt)
        key = self.ri.storage_index.fqn
        provider = self.chunk.provider
        assert provider is not None, "a chunk without an extent is a provider's"
        try:
            obj = rebuild(provider, self.chunk.meta, self.chunk.tree, leaves)
        except ProviderError as e:
            raise ProviderError(str(e), checkpoint=self.checkpoint, key=key) from e.__cause__
        if self.dest is None:  # a registered type stored as a value
            self.rebuilt = obj
            return
        if not isinstance(obj, torch.Tensor):
            raise ProviderError(f"provider {provider!r} rebuilt a {type(obj).__name__} for a tensor chunk",
                                checkpoint=self.checkpoint, key=key)
        src = obj
        whole = True
        for dim, (o, ln) in enumerate(zip(self.ri.storage_offsets, self.ri.lengths)):
            if ln != self.chunk.sizes[dim]:
                src = src.narrow(dim, o, ln)
                whole = False
        self.dest.copy_(src)
        if whole and tuple(self.dest.shape) == tuple(obj.shape) and self._whole_tensor():
            self.rebuilt = obj  # the loaded state holds the rebuilt object, tag and all
        elif type(self.dest) is type(obj) and hasattr(obj, "__dict__"):
            vars(self.dest).update(vars(obj))  # a resharded piece: its attributes

    def _whole_tensor(self) -> bool:
        return self.tensor_size is not None and tuple(self.chunk.sizes) == tuple(self.tensor_size) \
            and not any(self.chunk.offsets) and not any(self.ri.dest_offsets)
