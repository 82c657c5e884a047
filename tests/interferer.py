"""A process that changes a run while a save in the test process is paused at one of its
storage calls: ``python -m tests.interferer``, then one command per line on stdin.

``resave DIR SEED [AT]``: save :func:`state_for` ``SEED`` into DIR with ``overwrite=True`` (its
commit tidies what the save it replaced owned); ``purge RUN STEP [AT]``: a retention pass that
drops RUN/STEP (``-``: none, it only sweeps what earlier passes left).  Each answers one line: ``done N`` (N: the calls it made into the storage
interface), or ``err <type>: <message>``.  With AT, it first stops before its AT-th storage
call, answers ``paused`` and waits for a line on stdin before it goes on.

Another process on purpose: nothing a save registers in its own process (the steps it is
flushing, its claims) is visible here, as on another node or in another job.

With ``NO_LOCKS_ENV`` set, the local filesystem is taken for one that keeps no locks (an
object store): its lock calls raise ``LockUnsupported``, as the default ``Backend``'s do, so
claims are leases and no base lock is held (``keep_no_locks``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading

import torch

SEAM = ("makedirs", "exists", "size", "entries", "is_real_dir", "listdir", "open_sink", "read_file",
        "read_into", "commit", "sync_dir", "remove", "remove_dir", "copy_local", "try_lock", "lock_held",
        "create_exclusive")


NO_LOCKS_ENV = "DCPDS_TEST_NO_LOCKS"


def keep_no_locks(setattr_=setattr) -> None:
    """The local filesystem keeps no locks from now on in this process (before the storage
    calls are wrapped, so that the lock calls still count)."""
    from dcp_datastates.tiers.backend import LockUnsupported
    from dcp_datastates.tiers.local import LocalBackend

    def refuse(self, *a, **kw):
        raise LockUnsupported("this filesystem keeps no locks (the test's stand-in for an object store)")
    setattr_(LocalBackend, "try_lock", refuse)
    setattr_(LocalBackend, "lock_held", refuse)


def state_for(seed: int, tensors: int = 6, numel: int = 1 << 14) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(numel, generator=g) for i in range(tensors)}


def main() -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_datastates import DataStatesWriter
    from dcp_datastates.errors import first_line
    from dcp_datastates.tiers import StorageTier
    from dcp_datastates.tiers.retention import purge_steps
    if os.environ.get(NO_LOCKS_ENV):
        keep_no_locks()
    seam = _Seam()
    for line in sys.stdin:
        cmd, *args = line.split()
        seam.calls, seam.at = 0, int(args[2]) if len(args) > 2 else -1
        try:
            if cmd == "resave":
                dcp.save(state_for(int(args[1])), storage_writer=DataStatesWriter(args[0], overwrite=True),
                         no_dist=True)
            elif cmd == "purge":
                purge_steps(StorageTier(args[0]), [] if args[1] == "-" else [args[1]])
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported to the test, which fails on it
            print(f"err {type(e).__name__}: {first_line(e, 300)}", flush=True)
            continue
        print(f"done {seam.calls}", flush=True)
    return 0


class _Seam:
    """Counts calls into the storage interface (wrapping it); pauses before call ``at``."""

    def __init__(self) -> None:
        from dcp_datastates.tiers.local import LocalBackend
        self.calls, self.at = 0, -1
        self._lock = threading.Lock()
        for name in SEAM:
            setattr(LocalBackend, name, self._wrap(getattr(LocalBackend, name)))

    def _wrap(self, orig):
        @functools.wraps(orig)
        def call(backend, *a, **kw):
            with self._lock:
                n, self.calls = self.calls, self.calls + 1
            if n == self.at:
                print("paused", flush=True)
                sys.stdin.readline()
            return orig(backend, *a, **kw)
        return call


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------ the test's side
def _env(locks: bool) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    return env if locks else dict(env, **{NO_LOCKS_ENV: "1"})


class Interferer:
    def __init__(self, locks: bool = True) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.p = subprocess.Popen([sys.executable, "-m", "tests.interferer"], env=_env(locks), cwd=root, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, line: str) -> str:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        answer = self.p.stdout.readline().strip()
        assert answer == "paused" or answer.startswith("done "), f"{line}: {answer or 'the interferer died'}"
        return answer

    def __call__(self, line: str) -> int:
        """Run ``line`` to its end; the storage calls it made."""
        return int(self.send(line).split()[1])

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait(60)
