"""Transformer-shaped state dicts for the benchmarks (shared with `dcp-datastates bench`)."""

from dcp_datastates.bench import nbytes, transformer_state

__all__ = ["nbytes", "transformer_state"]
