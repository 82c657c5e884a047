"""Transformer-shaped state dicts for the benchmarks."""

import torch


def transformer_state(total_gb: float = 1.5, hidden: int = 2048, vocab: int = 32000) -> dict:
    """A few large tensors and hundreds of small ones, fp32 and bf16, about ``total_gb`` GB."""
    g = torch.Generator().manual_seed(0)
    sd = {"embed.weight": torch.randn(vocab, hidden, generator=g)}  # fp32, 262 MB
    layer_bytes = (4 * hidden * hidden + 3 * hidden * 4 * hidden) * 2  # bf16 attn + mlp
    n_layers = max(1, int((total_gb * 1e9 - sd["embed.weight"].nbytes) // (layer_bytes + 12 * hidden * 4)))
    for i in range(n_layers):
        p = f"layers.{i}."
        sd[p + "attn.qkv"] = torch.randn(3 * hidden, hidden, generator=g).bfloat16()
        sd[p + "attn.out"] = torch.randn(hidden, hidden, generator=g).bfloat16()
        sd[p + "mlp.up"] = torch.randn(4 * hidden, hidden, generator=g).bfloat16()
        sd[p + "mlp.gate"] = torch.randn(4 * hidden, hidden, generator=g).bfloat16()
        sd[p + "mlp.down"] = torch.randn(hidden, 4 * hidden, generator=g).bfloat16()
        for n in ("ln1.w", "ln1.b", "ln2.w", "ln2.b", "q_norm", "k_norm", "attn.bias",
                  "out.bias", "mlp.b1", "mlp.b2", "mlp.b3", "scale"):
            sd[p + n] = torch.randn(hidden, generator=g)
    return sd


def nbytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())
