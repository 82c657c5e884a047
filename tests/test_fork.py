"""A process forked from the trainer (a DataLoader worker: ``fork`` is Linux's default start
method, and workers are forked again at each epoch unless persistent) after or during a save.

* It holds none of the checkpoint's locks: a worker forked while a save's flush held a base
  lock shared kept it for its whole life, and retention skipped that directory meanwhile.
* It can save on its own: the process's engine, caches and pools are the parent's threads,
  which a forked child does not have; its first save waited for them forever.

Each case runs in a process of its own that started from the fork server, so the fork is
that of a trainer, not of the test runner."""

from __future__ import annotations

import errno
import os
import threading

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.base_lock import BaseHold, removing
from tests import crashsim
from tests.dist import run_in_process, run_ranks


def _worker_during_a_flush(root: str) -> None:
    step = StorageTier(os.path.join(root, "step-1"))
    step.makedirs()
    hold = BaseHold()
    assert hold.take(step)  # as a save referencing step-1 holds it while it flushes
    loader = iter(torch.utils.data.DataLoader(range(8), num_workers=1, multiprocessing_context="fork"))
    next(loader)  # an epoch began: its worker, forked now, is alive
    hold.release()  # the flush ended
    with removing(step) as free:  # retention's pass over step-1
        code = 0 if free else 3
    del loader
    os._exit(code)


def test_a_worker_forked_during_a_flush_holds_none_of_its_locks(tmp_path):
    assert run_in_process(_worker_during_a_flush, str(tmp_path)) == 0


def _state(v: float) -> dict:
    return {"w": torch.full((1 << 16,), v), "step": int(v)}


def _loads(path: str, v: float) -> bool:
    got = {"w": torch.zeros(1 << 16), "step": 0}
    dcp.load(got, storage_reader=DataStatesReader(path), no_dist=True)
    return got["step"] == int(v) and bool(torch.all(got["w"] == v))


def _child_saves(root: str) -> None:
    """The trainer saves (sync, THREAD-mode async, and to two tiers through ``Checkpointer``),
    then forks; the child saves the same ways into its own directories and loads them back."""
    def saves(where: str, v: float) -> bool:
        dcp.save(_state(v), storage_writer=DataStatesWriter(f"{where}/sync"), no_dist=True)
        dcp.async_save(_state(v), storage_writer=DataStatesWriter(f"{where}/thread"), no_dist=True,
                       async_checkpointer_type=AsyncCheckpointerType.THREAD).result(timeout=60)
        ck = Checkpointer([f"{where}/fast", f"{where}/slow"])
        ck.save(int(v), _state(v))
        ck.wait()
        ok = ck.wait_persisted(60)
        ck.close()
        return ok and all(_loads(f"{where}/{d}", v) for d in ("sync", "thread", f"slow/step-{int(v)}"))
    assert saves(f"{root}/parent", 1.0)
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)  # as a DataLoader worker does: torch's own pool is not fork-safe
        os._exit(0 if saves(f"{root}/child", 2.0) else 1)
    os._exit({0: 0, None: 4}.get(crashsim._wait(pid, 60), 5))


def test_a_process_forked_after_a_save_saves_on_its_own(tmp_path):
    assert run_in_process(_child_saves, str(tmp_path)) == 0


def _replicated_then_an_epoch(rank, world, root):
    """Two nodes of one rank save with ``replicas=1`` (each process then holds a replica group,
    gloo's threads and all), then an epoch begins: its DataLoader worker, forked now, must
    serve its first batch (a child that destroyed its parent's group waited for threads it
    does not have, forever)."""
    import torch.distributed as dist
    ck = Checkpointer([f"{root}/node{rank}"], node_local=True, replicas=1, node=f"n{rank}", async_mode=None,
                      process_group=dist.new_group(backend="gloo"))
    ck.save(1, {f"w{rank}": _state(1.0)["w"], "step": 1})
    assert ck.wait_replicated(60)
    loader = iter(torch.utils.data.DataLoader(range(8), num_workers=1, multiprocessing_context="fork", timeout=30))
    assert int(next(loader)) == 0
    del loader
    ck.close()
    os._exit(0)


def test_a_worker_forked_after_replicated_saves_starts(tmp_path):
    run_ranks(2, _replicated_then_an_epoch, str(tmp_path))


def _a_later_descriptor_under_a_closed_links_number() -> int | None:
    """One save through the checkpoint process, over; then a new pipe under the number its
    link's reader had.  The number, or None where nothing new could take it this time."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from dcp_datastates.save.progress import SaveSession
    s = SaveSession(lazy=True)
    s.mark_snapshot()
    # the copy in the checkpoint process; its pipe end travels through multiprocessing's
    # resource sharer, as it does when DCP queues the save for that process
    over_there = pickle.loads(ForkingPickler.dumps(s))
    link = s._link
    old = link.r  # the number of the link's read end
    readers = [t for t in threading.enumerate() if t.name == "dcp-datastates-save-link"]
    s.caller_ended()
    del over_there  # that process let go of the save: the link's reader ends and closes its end
    for t in readers:  # joined, not polled: a loaded machine may keep the reader from its close
        t.join(60)  # for longer than any sleep, and the close would then hit the pipe below
    if any(t.is_alive() for t in readers):
        os._exit(6)  # the reader never ended: a different failure from the one tested here
    r, _w = os.pipe()
    try:
        os.dup2(r, old)
    except OSError as e:
        # EBUSY: the resource sharer's thread, back in accept(), reserved the freed number
        # (Linux reserves accept's descriptor before it waits), so no later pipe can have it
        if e.errno != errno.EBUSY:
            raise
        return None
    return old


def _pipe_of_a_later_worker() -> None:
    """A save went through DCP's checkpoint process and is over (its link's reader closed its
    end); a descriptor made afterwards may take that number.  A worker forked then must keep
    its copy: closing the old number in the child closed whatever the number named by then (a
    DataLoader worker's result pipe)."""
    for _ in range(50):  # until a later pipe holds the number (it mostly does at once)
        old = _a_later_descriptor_under_a_closed_links_number()
        if old is not None:
            break
    else:
        os._exit(7)  # the case never arose: the test proved nothing
    pid = os.fork()
    if pid == 0:
        try:
            os.fstat(old)  # the child's copy is still open
            os._exit(0)
        except OSError:
            os._exit(5)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status))


def test_a_worker_forked_after_a_process_mode_save_keeps_its_own_pipes():
    assert run_in_process(_pipe_of_a_later_worker) == 0
