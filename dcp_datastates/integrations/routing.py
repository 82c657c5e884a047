"""What the framework integrations share: while a framework's own checkpoint code runs, DCP's
storage is ours.

A framework that builds ``FileSystemWriter(path)``/``FileSystemReader(path)`` itself, or calls
a helper of its own that does (``dcp.save(state, checkpoint_id=path)``), is given ours for the
length of one call: :func:`ours_while` binds ``torch.distributed.checkpoint``'s two classes to
factories of ``DataStatesWriter``/``DataStatesReader`` and, where asked, a framework's own
helpers (by identity, in every module that imported them by name) to ours, and puts everything
back after.  A checkpoint in DCP's own format (saved before the switch) is still read by DCP's
``FileSystemReader``.  One call at a time runs so (a lock).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import sys
import threading
from collections.abc import Callable, Iterator

import torch.distributed.checkpoint as dcp

from .. import process_state
from ..load.reader import DataStatesReader
from ..save.writer import DataStatesWriter
from ..tiers import StorageTier
from ..tiers.manifests import manifest_is_ours

_lock = threading.RLock()
DCP_READER = dcp.FileSystemReader  # DCP's own, whatever ``ours_while`` binds in its place


@process_state.in_child
def _new_lock_in_child() -> None:
    """A forked child gets a lock no parent's thread holds."""
    global _lock
    _lock = threading.RLock()


def check_version(package: str, tested: tuple[str, ...], otherwise: str, version: str | None = None) -> str:
    """The installed ``package``'s version (or ``version``), where its major.minor is one of
    ``tested``; else a one-line ``RuntimeError`` saying which are known to work and, in
    ``otherwise``, what to do instead."""
    version = version or importlib.metadata.version(package)
    if ".".join(version.split(".")[:2]) not in tested:
        raise RuntimeError(f"{package} {version} is not a version dcp-datastates was tested with "
                           f"({', '.join(v + '.*' for v in tested)}); install one of those, or {otherwise}")
    return version


def writer_for(path, options: dict) -> DataStatesWriter:
    return DataStatesWriter(str(path), **options)


def reader_for(path):
    """Ours, or DCP's ``FileSystemReader`` for a checkpoint in DCP's own format."""
    if manifest_is_ours(StorageTier(str(path))) is False:
        return DCP_READER(path)
    return DataStatesReader(str(path))


def bound(module, name: str):
    """What ``module`` binds to ``name`` itself (never through a lazy module's ``__getattr__``,
    which may import)."""
    return getattr(module, "__dict__", {}).get(name)


def rebind(own: Callable, replacement: Callable) -> list[tuple[object, str]]:
    """``replacement`` wherever a loaded module binds ``own`` under its name; the places."""
    places = []
    for module in list(sys.modules.values()):
        if bound(module, own.__name__) is own:
            setattr(module, own.__name__, replacement)
            places.append((module, own.__name__))
    return places


@contextlib.contextmanager
def ours_while(options: dict, helpers: dict[Callable, Callable] | None = None) -> Iterator[None]:
    """For the block: DCP's ``FileSystemWriter``/``FileSystemReader`` build ours (``options``
    for the writer), and each framework helper in ``helpers`` is replaced by its value."""
    with _lock:
        writer, reader = dcp.FileSystemWriter, dcp.FileSystemReader
        dcp.FileSystemWriter = lambda path, *a, **k: writer_for(path, options)  # type: ignore[assignment,misc]
        dcp.FileSystemReader = lambda path, *a, **k: reader_for(path)  # type: ignore[assignment,misc]
        undo = [(place, own) for own, new in (helpers or {}).items() for place in rebind(own, new)]
        try:
            yield
        finally:
            for (module, name), own in undo:
                setattr(module, name, own)
            dcp.FileSystemWriter, dcp.FileSystemReader = writer, reader  # type: ignore[misc]


__all__ = ["bound", "check_version", "ours_while", "reader_for", "rebind", "writer_for"]
