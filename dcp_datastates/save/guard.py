"""Helpers that make the lazy barrier hard to forget."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, wait
from typing import cast

import torch.distributed.checkpoint as dcp

from .. import process_state
from ..errors import CheckpointError

log = logging.getLogger(__name__)


class SnapshotGuard:
    """Block an optimizer's ``step()`` until the writer's snapshot is complete.

    ``SnapshotGuard(optimizer, writer)`` registers a step pre-hook that calls
    ``writer.wait_snapshot()``: training runs forward and backward while the
    state is copied out, and only the first in-place update waits.  Call
    :meth:`remove` (or use it as a context manager) to unhook it.
    """

    def __init__(self, optimizer, writer) -> None:
        self.writer = writer
        self.waits = 0
        self._handle = optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer, args, kwargs):
        self.waits += 1
        self.writer.wait_snapshot()
        return None

    def remove(self) -> None:
        """Unhook the step pre-hook; later steps no longer wait."""
        self._handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


# DCP makes an executor per ``async_save`` call, and in PROCESS mode every one of them talks to
# the one checkpoint process over one pipe, without a lock: two saves in flight garble it.
_process_lock = threading.Lock()
_process_save: list[Future] = []  # the newest PROCESS-mode save of this process, while it runs


@process_state.in_child
def _no_process_save_in_child() -> None:
    global _process_lock
    _process_lock = threading.Lock()
    _process_save.clear()


def async_save(state_dict, *, storage_writer, **kwargs):
    """``dcp.async_save`` that also tells ``storage_writer`` about the returned future,
    so ``wait_snapshot()`` raises instead of waiting forever when the save fails early.  A
    PROCESS-mode save starts once the previous one of this process has ended (DCP's checkpoint
    process takes one save at a time)."""
    kind = kwargs.get("async_checkpointer_type")
    process = kind is not None and getattr(kind, "name", str(kind)).upper().endswith("PROCESS")
    if getattr(storage_writer, "async_mode", "") is None and kind is not None:
        # the writer must know before stage() whether the save crosses processes
        storage_writer.async_mode = "process" if process else "thread"
    if not process:
        return _started(dcp.async_save(state_dict, storage_writer=storage_writer, **kwargs), storage_writer)
    with _process_lock:
        if _process_save and not _process_save[0].done():
            log.info("waiting for the previous PROCESS-mode save to end: DCP's checkpoint process takes one "
                     "at a time")
            wait(_process_save)  # its outcome is its own future's to report
        fut = _started(dcp.async_save(state_dict, storage_writer=storage_writer, **kwargs), storage_writer)
        _process_save[:] = [cast(Future, getattr(fut, "upload_completion", fut))]
    return fut


def _started(fut, storage_writer):
    upload = getattr(fut, "upload_completion", fut)
    storage_writer.attach(upload)
    if upload is fut and isinstance(fut, Future):
        return _explained(fut, getattr(storage_writer, "path", None))
    return fut


_DEAD = (BrokenPipeError, EOFError, ConnectionResetError)


def _explained(fut: Future, path) -> Future:
    """``fut``, with the raw pipe error DCP gives once its checkpoint process has died (SIGKILL,
    the OOM killer) turned into a ``CheckpointError`` that says what happened and what to do."""
    out: Future = Future()

    def done(f: Future) -> None:
        e = f.exception()
        if e is None:
            out.set_result(f.result())
        elif isinstance(e, _DEAD) or "background process is dead" in str(e):
            err = CheckpointError(
                f"DCP's checkpoint process has died ({type(e).__name__}: {e}); DCP does not start "
                "another one in this trainer, so every later PROCESS-mode save fails too: restart "
                "the trainer, or save in THREAD mode", checkpoint=path)
            err.__cause__ = e
            out.set_exception(err)
        else:
            out.set_exception(e)
    fut.add_done_callback(done)
    return out
