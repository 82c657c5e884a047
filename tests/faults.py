"""Fault injection from outside the library, for the crash harness.

A child process calls :func:`install` first.  When ``DCP_DATASTATES_FAULT`` names a phase, the
storage interface (and, for ``copy``, the engine's host cache) is wrapped so that the N-th time
the process reaches that phase (``phase:N``, default the first) it writes the file named by
``DCP_DATASTATES_FAULT_READY`` and sleeps until the harness SIGKILLs it.  The library has no
branch for any of this, as DCP's own tests wrap a writer rather than patch DCP.

Phases: ``plan`` (the save prepares its directory), ``copy`` (the stager asks the host cache for
room: earlier pieces are copied, later ones not), ``write`` (a data-file write returned),
``manifest`` (the manifest's temp file is durable, its rename not done), ``persist`` (an upload
to a slower tier starts), ``purge`` (retention removed a file).
"""

from __future__ import annotations

import functools
import os
import threading
import time

_lock = threading.Lock()
_hits = [0]


def _phase() -> tuple[str | None, int]:
    phase, _, nth = (os.environ.get("DCP_DATASTATES_FAULT") or "").partition(":")
    return phase or None, int(nth or 1)


def _hit(phase: str) -> None:
    want, nth = _phase()
    if phase != want:
        return
    with _lock:
        _hits[0] += 1
        if _hits[0] != nth:
            return
    ready = os.environ.get("DCP_DATASTATES_FAULT_READY")
    if ready:
        with open(ready, "w") as f:
            f.write(f"{phase} {os.getpid()}\n")
    while True:  # wait for SIGKILL
        time.sleep(1)


def _after(cls, name: str, phase: str) -> None:
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def wrapped(*args, **kwargs):
        out = orig(*args, **kwargs)
        _hit(phase)
        return out
    setattr(cls, name, wrapped)


def _before(owner, name: str, phase: str) -> None:
    orig = getattr(owner, name)

    @functools.wraps(orig)
    def wrapped(*args, **kwargs):
        _hit(phase)
        return orig(*args, **kwargs)
    setattr(owner, name, wrapped)


def install() -> None:
    """Wrap the interface of the phase named in the environment (nothing when none is)."""
    phase, _ = _phase()
    if phase is None:
        return
    from dcp_datastates.engine.host_cache import HostCache
    from dcp_datastates.tiers import persist
    from dcp_datastates.tiers.local import LocalBackend, LocalSink
    from dcp_datastates.tiers.storage import StorageTier
    if phase == "plan":
        _before(StorageTier, "makedirs", "plan")
    elif phase == "copy":
        _before(HostCache, "alloc", "copy")
    elif phase == "write":
        _after(LocalSink, "pwrite", "write")
    elif phase == "persist":
        _before(persist, "copy_file", "persist")
    elif phase == "purge":
        _after(StorageTier, "remove", "purge")
    elif phase == "manifest":  # at the seam: every manifest is committed through it (tiers/commit.py)
        orig = LocalBackend.commit

        @functools.wraps(orig)
        def commit(self, root, path, tmp_name, data, *, sync):
            if os.path.basename(path) == ".metadata":
                # the state a crash between the temp file's fsync and the rename leaves
                with open(os.path.join(root, ".metadata.tmp-fault000"), "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                _hit("manifest")
            return orig(self, root, path, tmp_name, data, sync=sync)
        LocalBackend.commit = commit
    else:
        raise ValueError(f"unknown fault phase {phase!r}")
