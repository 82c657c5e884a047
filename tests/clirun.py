"""Run the CLI as a user does, or in this process.

``cli_process`` runs ``python -m dcp_datastates``: the entry point, exit codes and what a pipe
sees, at the cost of importing torch again (2 to 3 s a call on two cores).  ``cli`` runs the
same ``main`` in the test's process with standard output and error captured, and reports what
a process would have: its exit code (argparse's ``SystemExit`` included), its output, and the
library's warnings on standard error, as Python's last-resort handler prints them in a process
that configured no logging."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from dataclasses import dataclass

from dcp_datastates.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def cli_process(*args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def cli(*args: str, check: bool = False) -> Ran:
    out, err = io.StringIO(), io.StringIO()
    said = logging.StreamHandler(err)  # what the last-resort handler would print
    said.setLevel(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(said)
    levels = {name: logging.getLogger(name).level for name in ("dcp_datastates", "dcp_datastates.convert")}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse: usage errors, --help, --version
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        root.removeHandler(said)
        for name, level in levels.items():  # a command may quiet a logger for its own run
            logging.getLogger(name).setLevel(level)
    r = Ran(code, out.getvalue(), err.getvalue())
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r
