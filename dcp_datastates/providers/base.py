"""State providers: the paper's core abstraction.

A provider describes one piece of state as *metadata* plus *byte regions*.
The engine stages regions into the host cache and flushes them; on load the
provider rebuilds the state from the regions.  Providers nest: a large tensor
yields one region per cache-sized piece, and a composite (a user type, a
tensor subclass) holds named child providers.

Lifecycle:

1. (saving rank) ``provider_for(obj)`` picks the provider: a registered type
   (``registry.py``), a tensor, or a Python value.  DCP hands the writer each
   DTensor's local shard as a plain tensor, so shards take the tensor path.
2. The writer asks ``provider.regions()`` for the leaf tensors, by path
   (``"data"``, ``"inner/data"`` for a nested registered type), and places
   each as one extent of the rank's data files.
3. The engine cuts each region into cache-sized pieces, copies them out of
   the live tensors (device regions first), and flushes them.
4. ``provider.meta()`` (msgpack-able) and, for registered types, the nesting
   (``RegisteredTypeProvider.tree()``) go into the manifest.
5. (loading rank) ``registry.rebuild(name, meta, tree, leaves)`` calls each
   provider's ``unflatten``, innermost first, and returns the object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TensorRegion:
    """A leaf tensor seen as ``nbytes`` contiguous bytes.

    ``source`` is the live tensor (any device, any strides); it is made
    contiguous lazily by the engine, which counts that copy against the cache.
    """
    name: str
    source: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.source.numel() * self.source.element_size()


class StateProvider(ABC):
    """One kind of state, described as metadata plus byte regions."""

    #: Name stored in the manifest; the reader finds the provider by it.
    name: str = ""

    @abstractmethod
    def regions(self) -> list[TensorRegion]:
        """Leaf tensors, in a fixed order."""

    def meta(self) -> object:
        """msgpack-able metadata stored next to the regions."""
        return None

    def tree(self) -> dict | None:
        """How the parts nest (``Chunk.tree``); None when every part is a tensor leaf."""
        return None


class TensorProvider(StateProvider):
    """A plain tensor on any device."""

    name = "tensor"

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def regions(self) -> list[TensorRegion]:
        return [TensorRegion("", self.tensor)]


class CompositeProvider(StateProvider):
    """Named children, each a provider; regions are prefixed with the child name."""

    name = "composite"

    def __init__(self, children: dict[str, StateProvider], meta: object = None) -> None:
        self.children = children
        self._meta = meta

    def regions(self) -> list[TensorRegion]:
        out = []
        for cname, child in self.children.items():
            for r in child.regions():
                out.append(TensorRegion(f"{cname}/{r.name}" if r.name else cname, r.source))
        return out

    def meta(self) -> object:
        return self._meta
