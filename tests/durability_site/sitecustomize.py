"""Run at the start of every Python process whose ``PYTHONPATH`` holds this directory.

A test puts it there (``tests/durability.trace_spawned``) in the environment of a rank whose
library starts a process of its own (DCP's checkpoint process, a replica helper): that
process's file system calls under the test's directory are then traced too.  The library has
no branch for it."""

import os

if os.environ.get("DCPDS_DURABILITY_ROOT"):
    from tests import durability

    durability.install_from_env()
