"""Run at the start of every Python process whose ``PYTHONPATH`` holds this directory.

A test puts it there, with ``DCPDS_CRASHSIM_ARM`` naming a plan file, in the environment of a
rank whose library starts a process of its own (a replica helper): that process's local tiers
then go through ``tests/crash_seam.py``'s storage wrapper, and it takes the plan once the test
writes it (``crashsim.arm``).  The library has no branch for it."""

import os

if os.environ.get("DCPDS_CRASHSIM_ARM"):
    from tests import crashsim

    crashsim.install_armed(os.environ["DCPDS_CRASHSIM_ARM"])
