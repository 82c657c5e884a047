"""Storage tiers: where bytes land and how a tier commits."""

from .storage import StorageTier

__all__ = ["StorageTier"]
