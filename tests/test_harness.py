"""The multi-rank harness itself (``tests/dist.py``): how it ends a job one of whose ranks died.

A crash test kills one rank at a point; a rank left waiting for it in a collective (gloo may
never notice a peer that died in the middle of one) is killed as a launcher would, and counts as
killed.  A rank alive for any other reason is still a hang, and fails the test."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from tests.dist import run_ranks

DIED = 3


def _die_leaving_the_connection_open(rank, world, then):
    """Rank 1 dies while a child it forked keeps its gloo sockets open: rank 0's collective
    waits for it with nothing to tell it that it died.  Rank 0 then does ``then``."""
    if rank == 1:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        os._exit(DIED)
    if then == "collective":
        dist.barrier()
    else:
        time.sleep(120)


def test_a_rank_waiting_in_a_collective_for_a_dead_rank_counts_as_killed():
    with pytest.raises(AssertionError) as e:
        run_ranks(2, _die_leaving_the_connection_open, "collective", timeout=90, after_death=3)
    assert str(e.value) == f"ranks exited with codes {[-signal.SIGKILL, DIED]}", e.value


def test_a_rank_alive_for_another_reason_after_a_death_is_a_hang():
    with pytest.raises(AssertionError, match=r"1 ranks hung past 90s \(ranks \[0\]"):
        run_ranks(2, _die_leaving_the_connection_open, "sleep", timeout=90, after_death=3)
