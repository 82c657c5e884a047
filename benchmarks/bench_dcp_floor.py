"""DCP's own per-item cost: ``dcp.save`` / ``dcp.load`` through storage that does nothing.

    python benchmarks/bench_dcp_floor.py [--tensors 20000] [--floats 16] [--reps 3] [--dir /tmp/dcpds-floor]

For a flat state of many small tensors, times ``dcp.save`` with a ``StorageWriter`` that writes
nothing and ``dcp.load`` with a ``StorageReader`` that hands each destination back untouched
(the metadata given to it is our reader's, read once before timing): what any storage backend
pays inside DCP (state-dict traversal, planning, DCP's logging) before its own work.  The same
round also times DCP's FileSystemWriter/Reader and ours, for the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_items import _timed  # noqa: E402
from state import small_tensors_state  # noqa: E402

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesWriter  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


class NullWriter(StorageWriter):
    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner):
        fut: Future = Future()
        fut.set_result([WriteResult(index=i.index, size_in_bytes=0, storage_data=None) for i in plan.items])
        return fut

    def finish(self, metadata, results) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def storage_meta(self):
        return None


class NullReader(StorageReader):
    def __init__(self, metadata) -> None:
        self.metadata = metadata

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs):
        return self.metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        for ri in plan.items:
            planner.commit_tensor(ri, planner.resolve_tensor(ri))
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=20000)
    ap.add_argument("--floats", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dcpds-floor")
    args = ap.parse_args()
    state = small_tensors_state(args.tensors, args.floats)
    ours, theirs = os.path.join(args.dir, "ours"), os.path.join(args.dir, "dcp")
    t: dict[str, list[float]] = {k: [] for k in ("save, null writer", "save, FileSystemWriter", "save, ours",
                                                 "load, null reader", "load, null reader, our planner",
                                                 "load, FileSystemReader", "load, ours, our planner")}
    for _ in range(args.reps):
        for p in (ours, theirs):
            shutil.rmtree(p, ignore_errors=True)
        t["save, null writer"].append(_timed(lambda: dcp.save(state, storage_writer=NullWriter(), no_dist=True)))
        t["save, FileSystemWriter"].append(_timed(lambda: dcp.save(
            state, storage_writer=dcp.FileSystemWriter(theirs), no_dist=True)))
        t["save, ours"].append(_timed(lambda: dcp.save(state, storage_writer=DataStatesWriter(ours), no_dist=True)))
        md = DataStatesReader(ours).read_metadata()

        def load(reader, planner=None):
            out = {k: torch.empty_like(v) for k, v in state.items()}
            return _timed(lambda: dcp.load(out, storage_reader=reader, planner=planner, no_dist=True))
        t["load, null reader"].append(load(NullReader(md)))
        t["load, null reader, our planner"].append(load(NullReader(md), DataStatesLoadPlanner()))
        t["load, FileSystemReader"].append(load(dcp.FileSystemReader(theirs)))
        t["load, ours, our planner"].append(load(DataStatesReader(ours), DataStatesLoadPlanner()))
    print(f"{args.tensors} tensors of {args.floats} fp32, {args.reps} rounds, torch {torch.__version__}; "
          "medians in seconds")
    for k, v in t.items():
        print(f"{k:34s} {statistics.median(v):7.3f}")


if __name__ == "__main__":
    main()
