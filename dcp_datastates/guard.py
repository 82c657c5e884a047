"""Helpers that make the lazy barrier hard to forget."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp


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


def async_save(state_dict, *, storage_writer, **kwargs):
    """``dcp.async_save`` that also tells ``storage_writer`` about the returned future,
    so ``wait_snapshot()`` raises instead of waiting forever when the save fails early."""
    kind = kwargs.get("async_checkpointer_type")
    if getattr(storage_writer, "async_mode", "") is None and kind is not None:
        # the writer must know before stage() whether the save crosses processes
        storage_writer.async_mode = "process" if getattr(kind, "name", str(kind)).upper().endswith(
            "PROCESS") else "thread"
    fut = dcp.async_save(state_dict, storage_writer=storage_writer, **kwargs)
    upload = getattr(fut, "upload_completion", fut)
    storage_writer.attach(upload)
    return fut
