"""``WriterOptions``: what a ``DataStatesWriter`` was asked to do, validated once.

The writer's keyword arguments stay its public face (``docs/configuration.md`` documents
each); they are gathered here into one frozen record that checks itself, so the layers below
are handed options that are already valid, and a bad one fails at construction naming the
argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..format.checksum import BLOCK_SIZE
from ..format.codec import check_available
from ..tiers.storage import url_tuple

DEFAULT_DEDUP_UNIT = 4 << 20


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """The options of a ``DataStatesWriter`` (the fields are its keyword arguments)."""

    overwrite: bool = False
    """Replace a committed checkpoint at the path (it stays loadable until the new one commits)."""
    thread_count: int = 4
    """Flush threads per rank."""
    host_cache_bytes: int | None = None
    """The bounded staging cache of this process (None: the process default)."""
    device_cache_bytes: int = 0
    """A first cache level on the GPU for async saves (0: off)."""
    allow_pickle: bool = False
    """Store values msgpack cannot express with pickle (the reader must opt in too)."""
    sync_files: bool = True
    """fsync data files and the manifest."""
    storage_options: dict | None = field(default=None, hash=False)
    """fsspec options for the path."""
    async_mode: str | None = None
    """``"process"`` when the save runs in DCP's checkpoint process, ``"thread"``, or None."""
    persist_to: tuple[str, ...] = ()
    """Slower tiers each checkpoint is flushed to in the background."""
    persist: bool = True
    """Flush to ``persist_to`` (False: keep them, but do not flush this save)."""
    persist_options: dict | None = field(default=None, hash=False)
    """fsspec options for the ``persist_to`` tiers."""
    o_direct: bool = True
    """Write local data files with O_DIRECT from the aligned host cache."""
    incremental_base: str | None = None
    """A committed sibling checkpoint whose unchanged bytes are referenced."""
    incremental_base_save_id: str | None = None
    """Reference ``incremental_base`` only while it holds this save (None: whichever is
    committed there); another save there is not referenced, the checkpoint is written in full.
    ``Checkpointer`` passes the save whose directories it holds."""
    dedup_unit_bytes: int = DEFAULT_DEDUP_UNIT
    """The unit of an incremental save's dedup (a multiple of the 1 MiB block)."""
    step_barrier_s: float = 600.0
    """How long optimizers' ``step()`` waits for an async save's snapshot (0: not at all)."""
    eager_copy_bytes: int = 64 << 20
    """An async save copies tensors of at most 64 KiB at the call, up to this many bytes."""
    compression: str | None = None
    """``"zstd"``: each 1 MiB block of a tensor of 64 KiB or more stored compressed on its own
    (floats byte-shuffled first); None: stored as they are (docs/configuration.md)."""
    replicas: int = 0
    """Copies of each rank's files on the node-local directories of as many other nodes (the
    path is then node-local: each node has its own)."""
    node: str | None = None
    """This rank's node for ``replicas`` (None: ``DCP_DATASTATES_NODE``, ``GROUP_RANK`` or the host name)."""
    snapshot: str = "lazy"
    """``"lazy"``: copied while training runs (in-place changes through autograd-visible
    tensors fail the save); ``"at_call"``: copied before ``async_save`` returns, into as much as
    the first cache level's size allows (see docs/configuration.md)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "persist_to", url_tuple(self.persist_to))
        if self.incremental_base is not None:
            object.__setattr__(self, "incremental_base", str(self.incremental_base))
        if self.eager_copy_bytes < 0:
            raise ValueError(f"eager_copy_bytes must be 0 (off) or more, got {self.eager_copy_bytes}")
        if self.device_cache_bytes and self.device_cache_bytes < BLOCK_SIZE:
            raise ValueError(f"device_cache_bytes must be 0 (off) or at least {BLOCK_SIZE} (one checksum "
                             f"block), got {self.device_cache_bytes}")
        if self.thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {self.thread_count}")
        if self.host_cache_bytes is not None and self.host_cache_bytes < BLOCK_SIZE:
            raise ValueError(f"host_cache_bytes must be at least {BLOCK_SIZE} (one checksum block), "
                             f"got {self.host_cache_bytes}")
        if self.snapshot not in ("lazy", "at_call"):
            raise ValueError(f"snapshot must be 'lazy' or 'at_call', got {self.snapshot!r}")
        if self.async_mode not in (None, "thread", "process"):
            raise ValueError(f"async_mode must be None, 'thread' or 'process', got {self.async_mode!r}")
        check_available(self.compression)
        if self.replicas < 0:
            raise ValueError(f"replicas must be 0 (off) or more, got {self.replicas}")
        if self.dedup_unit_bytes <= 0 or self.dedup_unit_bytes % BLOCK_SIZE:
            raise ValueError(f"dedup_unit_bytes must be a positive multiple of {BLOCK_SIZE}, "
                             f"got {self.dedup_unit_bytes}")

    def at_call_room(self) -> dict[str, int] | None:
        """``snapshot="at_call"``: the bytes copied at the call per device type (the first cache
        level's size); None for a lazy snapshot."""
        if self.snapshot != "at_call":
            return None
        return {"cpu": self.host_cache_bytes or 0, "cuda": self.device_cache_bytes}

    @property
    def flushing(self) -> bool:
        """Whether saves flush to slower tiers."""
        return bool(self.persist_to and self.persist)


@dataclass(frozen=True, kw_only=True)
class FileSystemWriterArgs:
    """``FileSystemWriter``'s keyword arguments that name choices of DCP's own file format, so
    that code written for it runs unchanged.  Each is accepted where dropping it cannot change
    what is saved or loaded, and refused, in one line saying what to use, where it could
    (``docs/faq.md``, "Switching from FileSystemWriter")."""

    single_file_per_rank: bool = True
    """DCP: one file per rank, or one per tensor.  Ours: ``thread_count`` stripe files per rank."""
    per_thread_copy_ahead: int = 10_000_000
    """DCP: bytes each thread copies ahead to the host.  Ours: bounded by ``host_cache_bytes``."""
    cache_staged_state_dict: bool = False
    """DCP: keep the staged copy between async saves.  Ours: the host cache is kept anyway."""
    serialization_format: object = None
    """DCP: ``torch.save`` or safetensors item encoding.  Ours: raw tensor bytes, msgpack values."""
    extensions: tuple = ()
    """DCP's stream transforms (``_extensions``)."""

    def __post_init__(self) -> None:
        if self.per_thread_copy_ahead < 0:
            raise ValueError(f"per_thread_copy_ahead must be 0 or more, got {self.per_thread_copy_ahead}")
        fmt = str(getattr(self.serialization_format, "value", self.serialization_format) or "torch_save").lower()
        if fmt != "torch_save":
            raise ValueError(
                f"serialization_format={fmt}: DataStatesWriter writes its own format; export safetensors "
                "after the save with `dcp-datastates convert --to safetensors`, or save with DCP's FileSystemWriter")
        for ext in self.extensions:
            name = _extension_name(ext)
            if name != "stream.zstd":
                raise ValueError(
                    f"_extensions: {name} is a stream transform DataStatesWriter cannot apply to its ranged, "
                    "checksummed blocks, and dropping it would change what is stored; leave it out, or save "
                    "with DCP's FileSystemWriter")

    @property
    def compression(self) -> str | None:
        """The compression the extensions ask for (DCP's ``ZStandard()``: ``"zstd"``)."""
        return "zstd" if self.extensions else None


def _extension_name(ext: object) -> str:
    try:
        return str(ext.registry_name())  # pyright: ignore[reportAttributeAccessIssue]
    except AttributeError:
        return type(ext).__name__
