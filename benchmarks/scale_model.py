"""Synthetic layouts of a Llama-3-70B-shaped state with Adam for ``bench_scale.py``.

Shapes: 80 layers of dim 8192, 64 heads, 8 KV heads (KV dim 1024), FFN 28672, vocabulary
128256: 723 parameters, each with ``exp_avg`` and ``exp_avg_sq`` (sharded like it) and a
``step`` scalar (replicated).  A layout says, for ``n`` ranks, which box of each tensor every
rank holds and which rank writes it (DCP writes a replicated box once):

* ``fsdp``: every tensor split along dim 0 over all ranks (``Shard(0)``, torch.chunk sizes).
* ``hsdp``: split along dim 0 over 8 ranks, replicated over the ``n / 8`` groups; the writer of
  each box rotates over the replicas, as DCP's dedup balances them.
* ``tp_fsdp``: tensor parallel over 8 ranks inside a node (column-parallel matrices split along
  dim 0, row-parallel ones along dim 1, norms replicated) and FSDP along dim 0 over ``n / 8``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DIM, FFN, KV, VOCAB, LAYERS = 8192, 28672, 1024, 128256, 80
COL, ROW, NORM = "col", "row", "norm"


@dataclass(frozen=True, slots=True)
class Param:
    fqn: str
    shape: tuple[int, ...]
    kind: str  # COL, ROW or NORM (how tensor parallelism splits it)


def params() -> list[Param]:
    out = [Param("tok_embeddings.weight", (VOCAB, DIM), COL)]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [Param(p + "attention.wq.weight", (DIM, DIM), COL),
                Param(p + "attention.wk.weight", (KV, DIM), COL),
                Param(p + "attention.wv.weight", (KV, DIM), COL),
                Param(p + "attention.wo.weight", (DIM, DIM), ROW),
                Param(p + "feed_forward.w1.weight", (FFN, DIM), COL),
                Param(p + "feed_forward.w2.weight", (DIM, FFN), ROW),
                Param(p + "feed_forward.w3.weight", (FFN, DIM), COL),
                Param(p + "attention_norm.weight", (DIM,), NORM),
                Param(p + "ffn_norm.weight", (DIM,), NORM)]
    out += [Param("norm.weight", (DIM,), NORM), Param("output.weight", (VOCAB, DIM), COL)]
    return out


@dataclass(frozen=True, slots=True)
class Tensor:
    fqn: str
    shape: tuple[int, ...]
    kind: str
    dtype: torch.dtype


def tensors() -> list[Tensor]:
    """Model parameters (bf16), Adam moments (fp32) and Adam steps (fp32 scalars)."""
    out = []
    for p in params():
        out.append(Tensor("model." + p.fqn, p.shape, p.kind, torch.bfloat16))
        out.append(Tensor(f"optim.state.{p.fqn}.exp_avg", p.shape, p.kind, torch.float32))
        out.append(Tensor(f"optim.state.{p.fqn}.exp_avg_sq", p.shape, p.kind, torch.float32))
        out.append(Tensor(f"optim.state.{p.fqn}.step", (), "scalar", torch.float32))
    return out


def _split(lo: int, hi: int, parts: int, k: int) -> tuple[int, int]:
    """Piece ``k`` of ``[lo, hi)`` split in ``parts`` as torch.chunk does: (offset, size)."""
    c = math.ceil((hi - lo) / parts) if hi > lo else 0
    off = lo + k * c
    return off, max(0, min(c, hi - off))


def boxes(t: Tensor, ti: int, layout: str, n: int, rank: int) -> list[tuple[tuple, tuple]]:
    """The boxes (offsets, sizes) of ``t`` that ``rank`` holds (empty ones left out)."""
    if not t.shape:
        return [((), ())]
    g = t.shape
    if layout == "fsdp":
        o, s = _split(0, g[0], n, rank)
        return [((o,) + (0,) * (len(g) - 1), (s,) + g[1:])] if s else []
    if layout == "hsdp":
        o, s = _split(0, g[0], 8, rank % 8)
        return [((o,) + (0,) * (len(g) - 1), (s,) + g[1:])] if s else []
    tp, dp, dps = rank % 8, rank // 8, max(1, n // 8)
    if t.kind == COL:
        blo, bhi = _split(0, g[0], 8, tp)
        blo, bhi = blo, blo + bhi
        o, s = _split(blo, bhi, dps, dp)
        return [((o, 0), (s, g[1]))] if s else []
    if t.kind == ROW:
        c1, s1 = _split(0, g[1], 8, tp)
        o, s = _split(0, g[0], dps, dp)
        return [((o, c1), (s, s1))] if s and s1 else []
    o, s = _split(0, g[0], dps, dp)  # a norm: replicated over tensor parallelism
    return [((o,), (s,))] if s else []


def writes(t: Tensor, ti: int, layout: str, n: int, rank: int) -> bool:
    """Whether ``rank`` is the one holder of ``t``'s box that writes it (DCP keeps one copy of a
    replicated box; the writer rotates over the replicas, as DCP's dedup balances them)."""
    if not t.shape:
        return rank == ti % n
    if layout == "hsdp":
        return rank // 8 == ti % max(1, n // 8)
    if layout == "tp_fsdp" and t.kind == NORM:
        return rank % 8 == ti % 8
    return True  # the box is this rank's alone


def written_by(layout: str, n: int, rank: int, ts: list[Tensor]) -> list[tuple[int, tuple, tuple]]:
    """``(tensor index, offsets, sizes)`` of every box ``rank`` writes."""
    return [(ti, offs, sizes) for ti, t in enumerate(ts) if writes(t, ti, layout, n, rank)
            for offs, sizes in boxes(t, ti, layout, n, rank)]
