"""CUDA layer of dcp-datastates (placeholder until the runtime module lands)."""


def available() -> bool:
    return False
