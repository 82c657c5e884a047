"""A process that saves one state: ``python -m tests.save_child PATH SEED MIB OVERWRITE [GO]``.

Waits for the file GO to exist (so that two children start together), saves a state of about
MIB MiB made from SEED with ``DataStatesWriter(PATH, overwrite=OVERWRITE)``, and prints
``OK`` or ``ERR <exception type>: <message>``.
"""

from __future__ import annotations

import os
import sys
import time

import torch


def state_for(seed: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * 256, 1024, generator=g), "seed": seed}


def main() -> int:
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter
    path, seed, mib, overwrite = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    go = sys.argv[5] if len(sys.argv) > 5 else None
    sd = state_for(seed, mib)
    while go and not os.path.exists(go):
        time.sleep(0.001)
    try:
        dcp.save(sd, storage_writer=DataStatesWriter(path, overwrite=overwrite), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        failures = getattr(e, "failures", None)  # DCP's CheckpointException wraps each rank's
        if failures:
            e = next(iter(failures.values()))
            e = getattr(e, "exc", e)
        print(f"ERR {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        return 0
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
