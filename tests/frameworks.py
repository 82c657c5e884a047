"""What the framework integrations' tests share (``test_accelerate.py``, ``test_lightning.py``,
``test_megatron.py``): one deterministic training step, and a model's state made whole."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def train_step(model, opt, step: int, backward=None) -> float:
    """One step of MSE on batch ``step`` (16 x 32 -> 8, the same on every rank); ``backward``:
    the framework's (``fabric.backward``), else ``loss.backward()``.  Returns the loss."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    (backward or torch.Tensor.backward)(loss)
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def whole(t: torch.Tensor) -> list:
    """``t`` (a DTensor: gathered whole) as a flat list, compared bit for bit."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).flatten().tolist()


def adam_moments(opt) -> dict[str, list]:
    """Adam's moments of each parameter of ``opt``'s first group, whole, by position."""
    return {f"adam.{i}.{k}": whole(opt.state[p][k]) for i, p in enumerate(opt.param_groups[0]["params"])
            for k in ("exp_avg", "exp_avg_sq")}
