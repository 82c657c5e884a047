"""Run at the start of every Python process whose ``PYTHONPATH`` holds this directory.

A test puts it there (``tests/durability.trace_spawned``, ``tests/powercut_ranks.journal_spawned``) in the environment of a rank whose
library starts a process of its own (DCP's checkpoint process, a replica helper): that
process's file system calls under the test's directory are then traced (or journaled) too.  The library has
no branch for it."""

import os

if os.environ.get("DCPDS_DURABILITY_ROOT"):
    from tests import durability

    durability.install_from_env()
if os.environ.get("DCPDS_POWERCUT_ROOT"):
    from tests import powercut_ranks

    powercut_ranks.install_from_env()
