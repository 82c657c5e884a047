"""Run torchtitan 0.3.0's trainer on CPU/gloo: a test utility, not part of the library.

    torchrun --nproc_per_node=2 tests/torchtitan/cpu_train.py <torchtitan train arguments>

torchtitan 0.3.0 assumes an accelerator.  Before importing it, this launcher patches:
1. device discovery: the device type is "cpu", with a device module that answers the few
   CUDA-style calls torchtitan makes (so gloo is chosen as the backend);
2. FlexAttention (no backward on CPU): an eager masked-softmax attention that evaluates the
   block mask's mask_mod densely (exact math; fine for the debug model's short sequences);
3. FSDP gradient division 1.0 uses PREMUL_SUM, which gloo lacks: force a SUM reduction
   instead (the same gradients);
4. ``torch.distributed.set_timeout`` (missing in torch 2.13): the private equivalent.
Then it runs ``torchtitan.train.main()`` with the command-line arguments unchanged.
"""

from __future__ import annotations

import math
import os
import sys
import types

import torch




def patch_device() -> None:
    import torch._utils as tu
    mod = types.ModuleType("cpu_device_shim")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    class _Props:
        name = "cpu"
        total_memory = total

    mod.get_device_name = lambda *a, **k: "cpu"
    mod.get_device_properties = lambda *a, **k: _Props()
    mod.reset_peak_memory_stats = lambda *a, **k: None
    mod.empty_cache = lambda *a, **k: None
    mod.memory_stats = lambda *a, **k: {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                                        "num_alloc_retries": 0, "num_ooms": 0}
    mod.current_device = lambda: 0
    mod.set_device = lambda *a, **k: None
    mod.synchronize = lambda *a, **k: None
    mod.device_count = lambda: 1
    orig = tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type="cpu": mod if device_type == "cpu" else orig(device_type)


def dense_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                         return_aux=None, kernel_options=None):
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    b, h, lq, d = q.shape
    if enable_gqa and k.shape[1] != h:
        rep = h // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(d))
    if score_mod is not None:
        raise NotImplementedError("score_mod is not supported by the CPU test launcher")
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, b, h, lq, k.shape[-2], device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v
    want_lse = return_aux is not None and getattr(return_aux, "lse", False)
    return out, AuxOutput(lse=lse if want_lse else None)


def patch_torchtitan() -> None:
    from torchtitan.models.common import attention
    attention.FlexAttention._compiled_flex_attn = staticmethod(dense_flex_attention)

    import torchtitan.distributed.fsdp as tfsdp
    from torch.distributed.fsdp import FSDPModule
    orig = tfsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model):
        orig(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    tfsdp.disable_fsdp_gradient_division = disable_division_with_sum

    import torch.distributed as dist
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout
        dist.set_timeout = _set_pg_timeout


def main() -> None:
    patch_device()
    patch_torchtitan()
    import torchtitan.train
    sys.argv[0] = "torchtitan.train"
    torchtitan.train.main()


if __name__ == "__main__":
    main()
