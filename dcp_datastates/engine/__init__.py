"""The engine: copies state into the bounded host cache and streams it to storage."""

from .host_cache import HostCache, default_host_cache_bytes
from .snapshot import CopyItem, SaveJob, SnapshotEngine, get_engine

__all__ = ["CopyItem", "HostCache", "SaveJob", "SnapshotEngine", "default_host_cache_bytes",
           "get_engine"]
