"""What a forked child does with its parent's process-wide objects: keeps them, unused.

A process forked from the trainer (a DataLoader worker) has none of its parent's threads.
Each module that keeps process-wide objects (engines, caches, pools, claims, replica groups,
pending snapshots) starts afresh in the child, from its own ``os.register_at_fork`` handler;
the parent's objects are handed here rather than dropped, because destroying one may run code
that waits for the threads it owned (a pool's workers, gloo's), which the child does not have.
The child's copies cost nothing: their pages are the parent's until written.
"""

from __future__ import annotations

_KEPT: list[object] = []


def keep(*objects: object) -> None:
    """Hold ``objects`` for the rest of this (forked) process, never to be destroyed."""
    _KEPT.extend(objects)
