"""State dicts for the benchmarks: transformer-shaped (shared with `dcp-datastates bench`), and
many small tensors (the per-item benchmarks)."""

import torch

from dcp_datastates.bench import nbytes, transformer_state

__all__ = ["nbytes", "small_tensors_state", "transformer_state"]


def small_tensors_state(count: int, floats: int) -> dict:
    """``count`` tensors of ``floats`` fp32 values each, eight to a layer, seeded."""
    torch.manual_seed(0)
    return {f"layers.{i // 8}.p{i % 8}": torch.randn(floats) for i in range(count)}
