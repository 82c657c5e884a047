"""Fault points for the crash-consistency harness (tests/test_crash.py).

Off unless ``DCP_DATASTATES_FAULT`` names a phase when the process starts: then the
first thread to reach that phase writes ``DCP_DATASTATES_FAULT_READY`` (a file path) and
sleeps until the harness SIGKILLs the process.  ``phase:N`` stops at the N-th time instead
of the first.  Phases: plan, copy, write, manifest, persist, purge.
In normal runs a point costs one comparison with None.
"""

from __future__ import annotations

import os
import time

_PHASE, _, _NTH = (os.environ.get("DCP_DATASTATES_FAULT") or "").partition(":")
_PHASE = _PHASE or None
_NTH = int(_NTH or 1)
_READY = os.environ.get("DCP_DATASTATES_FAULT_READY")
_hits = [0]


def point(phase: str) -> None:
    if _PHASE is None or phase != _PHASE:
        return
    _hits[0] += 1
    if _hits[0] < _NTH:
        return
    if _READY:
        with open(_READY, "w") as f:
            f.write(f"{phase} {os.getpid()}\n")
    while True:  # wait for SIGKILL
        time.sleep(1)
