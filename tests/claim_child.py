"""A process that claims a checkpoint directory, for the claim tests.

``python -m tests.claim_child hold DIR SAVE_ID READY``: claim DIR, write READY, sleep until
killed.

``python -m tests.claim_child contend DIR READY_DIR GATE_DIR N``: once N contenders have
imported everything (each marks ``GATE_DIR``), try to claim DIR; write ``READY_DIR/tried-<pid>`` (``owner`` or ``busy``), and while it owns the
claim, hold it until N contenders have tried.  Every read of a claim file pauses 50 ms after
it returns (wrapping the storage interface), which opens any window between reading a stale
claim and taking it over.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time


def _slow_claim_reads() -> None:
    from dcp_datastates.tiers.local import LocalBackend
    orig = LocalBackend.read_file

    @functools.wraps(orig)
    def read_file(self, path, *a, **kw):
        out = orig(self, path, *a, **kw)
        if ".claim" in os.path.basename(path):
            time.sleep(0.05)
        return out
    LocalBackend.read_file = read_file


def main() -> int:
    from dcp_datastates.errors import CheckpointBusyError
    from dcp_datastates.format.names import CLAIM_NAME
    from dcp_datastates.tiers import StorageTier
    from dcp_datastates.tiers.claim import acquire
    mode, path = sys.argv[1], sys.argv[2]
    tier = StorageTier(path)
    if mode == "hold":
        acquire(tier, CLAIM_NAME, sys.argv[3])
        open(sys.argv[4], "w").write("held")
        while True:
            time.sleep(1)
    ready_dir, gate, n = sys.argv[3], sys.argv[4], int(sys.argv[5])
    _slow_claim_reads()
    open(os.path.join(gate, f"arrived-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(gate)) < n:  # every contender starts within a few ms of the others
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.002)
    try:
        claim = acquire(tier, CLAIM_NAME, f"{os.getpid():012x}"[-12:])
    except CheckpointBusyError:
        claim = None
    with open(os.path.join(ready_dir, f"tried-{os.getpid()}"), "w") as f:
        f.write("owner" if claim is not None else "busy")
    if claim is not None:
        deadline = time.monotonic() + 60
        while len([x for x in os.listdir(ready_dir) if x.startswith("tried-")]) < n:
            if time.monotonic() > deadline:
                return 1
            time.sleep(0.01)
        claim.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------ the test's side
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_file(path: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the child exited ({proc.returncode}) before {path}: {out[-3000:]}")
        assert time.monotonic() < deadline, f"no {path} within {timeout} s"
        time.sleep(0.05)


def hold_claim(path: str, save_id: str, ready: str) -> subprocess.Popen:
    """A live process holding ``path``'s claim for save ``save_id``, once it returns."""
    p = subprocess.Popen([sys.executable, "-m", "tests.claim_child", "hold", path, save_id, ready],
                         env=dict(os.environ, PYTHONPATH=_ROOT), cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_file(ready, p)
    except BaseException:
        p.kill()
        p.wait()
        raise
    return p
