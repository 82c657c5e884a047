"""Process-wide state: the one fork handler, and the one question of the process group.

**What a forked child does.**  A process forked from the trainer (a DataLoader worker, forked
again each epoch unless persistent) has none of its parent's threads.  Each module that keeps
process-wide objects (engines, host caches, the upload pool, claims and their renewer, the
replicators, the step barrier's pending snapshots, locks a parent's thread may hold) names what
its child must do in a function it registers here with ``in_child``; ``os.register_at_fork``
is called once, in this module, and runs them in the order they were registered (the order the
modules were imported).  ``registered()`` lists them (``docs/design.md`` shows the list).  A
parent's objects are handed to ``keep`` rather than dropped, because destroying one may run
code that waits for the threads it owned (a pool's workers, gloo's), which the child does not
have; the child's copies cost nothing, their pages are the parent's until written.

**Is there a process group, and which rank am I.**  ``group_up`` is the library's one check of
``torch.distributed`` being initialized; ``rank``, ``world_size`` and ``gather`` answer for a
process without a group as its only rank; ``checkpoint_group`` is the one group of every rank
kept for background saves.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.distributed as dist

_KEPT: list[object] = []
_IN_CHILD: list[tuple[str, Callable[[], None]]] = []


def keep(*objects: object) -> None:
    """Hold ``objects`` for the rest of this (forked) process, never to be destroyed."""
    _KEPT.extend(objects)


def in_child(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` in every child forked from this process, right after the fork (as a
    decorator or a call); returns ``fn``."""
    _IN_CHILD.append((f"{fn.__module__}.{fn.__qualname__}", fn))
    return fn


def registered() -> list[str]:
    """What a forked child runs, in order: each handler as ``module.function``."""
    return [name for name, _ in _IN_CHILD]


def _after_fork_in_child() -> None:
    for _, fn in list(_IN_CHILD):
        fn()


os.register_at_fork(after_in_child=_after_fork_in_child)


def group_up() -> bool:
    """Whether this process is a rank of an initialized ``torch.distributed`` default group."""
    return dist.is_available() and dist.is_initialized()


def rank(pg=None, default: int = 0) -> int:
    """This process's rank in ``pg`` (the default group), or ``default`` without a group."""
    return dist.get_rank(pg) if group_up() else default


def world_size(pg=None) -> int:
    """The ranks of ``pg`` (the default group); 1 without a group."""
    return dist.get_world_size(pg) if group_up() else 1


def gather(obj: object, pg=None) -> list:
    """Every rank's ``obj`` over ``pg``, by rank (an all-gather: a collective); this rank's alone
    without a group."""
    if not group_up():
        return [obj]
    out: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def broadcast(obj: object) -> object:
    """Rank 0's ``obj`` on every rank of the default group (a collective); ``obj`` without a
    group or with one rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_CHECKPOINT_GROUP: list = []  # [the default group, its checkpoint group], once made


def checkpoint_group():
    """The gloo group of every rank that a background save's collectives use, so that they
    never share a communicator with training's: made at the first call (a collective: every
    rank makes its first call at the same point, as at a first save), the same one after, until
    the default group is replaced; None without a group."""
    if not group_up():
        return None
    default = dist.group.WORLD
    if not _CHECKPOINT_GROUP or _CHECKPOINT_GROUP[0] is not default:
        _CHECKPOINT_GROUP[:] = [default, dist.new_group(backend="gloo")]
    return _CHECKPOINT_GROUP[1]


@in_child
def _no_checkpoint_group_in_child() -> None:
    """A forked child is no rank of its parent's groups."""
    keep(*_CHECKPOINT_GROUP)
    _CHECKPOINT_GROUP.clear()
