"""Hugging Face accelerate (and the ``transformers`` ``Trainer``) with dcp-datastates as the
storage of their sharded checkpoints.  Switch with one line, before the first save::

    from dcp_datastates.integrations.accelerate import use_datastates
    use_datastates()                      # or use_datastates(host_cache_bytes=4 << 30, ...)

accelerate saves and loads FSDP sharded state (``SHARDED_STATE_DICT``, FSDP1 and FSDP2) with
``dcp.save``/``dcp.load`` and a ``FileSystemWriter``/``FileSystemReader`` it builds itself, in
``accelerate.utils.fsdp_utils`` (``save_fsdp_model``, ``save_fsdp_optimizer`` and their loads,
which ``Accelerator.save_state``/``load_state`` and the ``Trainer`` call); it offers no option
to pass a storage.  ``use_datastates`` wraps those four functions, wherever they were imported
by name, so that while one runs DCP's ``FileSystemWriter`` and ``FileSystemReader`` are ours:
the save writes our format (``DataStatesWriter``), the load reads it (``DataStatesReader``),
and a checkpoint accelerate wrote before the switch (DCP's own format) is still read by DCP's
``FileSystemReader``, as before.  Nothing else of accelerate changes.

What differs from accelerate's default storage: a save into a directory that holds a
checkpoint replaces it only once the new one is committed (``overwrite=True`` here, as
``FileSystemWriter`` overwrites), every block is checksummed and checked on load, and values
are never pickled.  Saves stay synchronous, as accelerate makes them.

Only the accelerate versions this was tested with are patched (``TESTED``); another raises a
one-line ``RuntimeError`` saying which are known to work.  ``stop_using_datastates`` switches
back.
"""

from __future__ import annotations

import functools
import logging
import sys

import accelerate.accelerator  # noqa: F401  # pyright: ignore[reportMissingImports] (optional: its own venv)
import accelerate.utils.fsdp_utils as fsdp_utils  # pyright: ignore[reportMissingImports] (optional: its own venv)

from ..save.writer import checked_writer_options
from . import routing
from .routing import bound, ours_while

log = logging.getLogger(__name__)

TESTED = ("1.15",)  # accelerate major.minor versions the wrapping was tested with
FUNCTIONS = ("save_fsdp_model", "save_fsdp_optimizer", "load_fsdp_model", "load_fsdp_optimizer")

_installed: dict[str, object] = {}  # function name -> accelerate's own


def check_version(version: str | None = None) -> str:
    """The installed accelerate's version, where it is one of ``TESTED``; else ``RuntimeError``."""
    return routing.check_version("accelerate", TESTED, "keep accelerate's own storage (do not call use_datastates)",
                                 version)


def use_datastates(**writer_options) -> None:
    """Make accelerate's sharded checkpoints go through ``DataStatesWriter(path,
    **writer_options)`` and ``DataStatesReader``; call once per process, before the first save
    or load (again: the options are replaced)."""
    check_version()
    options = checked_writer_options({"overwrite": True, **writer_options}, "use_datastates")
    for name in FUNCTIONS:
        own = _installed.get(name) or getattr(fsdp_utils, name)
        _rebind(own, _routed(own, options))
        _installed[name] = own
    log.info("accelerate %s: sharded checkpoints through dcp-datastates", check_version())


def stop_using_datastates() -> None:
    """Give accelerate its own storage back."""
    for name, own in list(_installed.items()):
        for module in list(sys.modules.values()):
            if getattr(bound(module, name), "__wrapped__", None) is own:
                setattr(module, name, own)
        del _installed[name]


def _rebind(own, wrapped) -> None:
    """``wrapped`` in every loaded module that holds ``own`` (or an earlier wrapping of it)
    under its name: accelerate's own modules and those that imported it by name."""
    for module in list(sys.modules.values()):
        current = bound(module, own.__name__)
        if current is own or (current is not None and getattr(current, "__wrapped__", None) is own):
            setattr(module, own.__name__, wrapped)


def _routed(own, options: dict):
    @functools.wraps(own)
    def call(*args, **kwargs):
        with ours_while(options):
            return own(*args, **kwargs)
    return call


__all__ = ["TESTED", "check_version", "stop_using_datastates", "use_datastates"]
