"""User-registered providers for custom types.

A *type provider* turns an object of a user type into metadata plus named
tensors and back.  Register it once per process (in every process that saves
or loads, including PROCESS-mode checkpoint daemons, e.g. at import of the
module that defines the type)::

    class ScaledProvider(TypeProvider):
        name = "myproject.Scaled"
        def flatten(self, obj):
            return {"scale": obj.scale}, {"data": obj.data}
        def unflatten(self, meta, parts):
            return Scaled(parts["data"], meta["scale"])

    register_provider(Scaled, ScaledProvider())

The metadata must be msgpack-able (see ``format/values.py``).  The parts are
stored as raw extents with checksums, exactly like plain tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import MappingProxyType

import torch

from .base import CompositeProvider, StateProvider, TensorProvider


class TypeProvider(ABC):
    name: str = ""

    @abstractmethod
    def flatten(self, obj) -> tuple[object, dict[str, torch.Tensor]]:
        """Return ``(meta, parts)``: msgpack-able metadata and named plain tensors."""

    @abstractmethod
    def unflatten(self, meta: object, parts: dict[str, torch.Tensor]):
        """Rebuild the object from what :meth:`flatten` returned."""


_by_type: dict[type, TypeProvider] = {}
_by_name: dict[str, TypeProvider] = {}
registry = MappingProxyType(_by_name)


def register_provider(cls: type, provider: TypeProvider, *, clobber: bool = False) -> None:
    """Use ``provider`` for objects whose exact type is ``cls``."""
    if not provider.name:
        raise ValueError("a TypeProvider needs a non-empty, stable `name`")
    if not clobber and (cls in _by_type or provider.name in _by_name):
        raise ValueError(f"a provider is already registered for {cls!r} or under "
                         f"{provider.name!r}; pass clobber=True to replace it")
    _by_type[cls] = provider
    _by_name[provider.name] = provider


def unregister_provider(cls: type) -> None:
    p = _by_type.pop(cls, None)
    if p is not None:
        _by_name.pop(p.name, None)


def type_provider_for(obj) -> TypeProvider | None:
    return _by_type.get(type(obj))


def type_provider_named(name: str) -> TypeProvider | None:
    return _by_name.get(name)


class RegisteredTypeProvider(CompositeProvider):
    """Adapts a user :class:`TypeProvider` to the engine: a composite of tensor children."""

    def __init__(self, tp: TypeProvider, obj) -> None:
        meta, parts = tp.flatten(obj)
        super().__init__({k: TensorProvider(v) for k, v in parts.items()}, meta)
        self.name = tp.name
        self.parts = parts


def provider_for(obj) -> StateProvider:
    """Pick the provider for one piece of state."""
    tp = type_provider_for(obj)
    if tp is not None:
        return RegisteredTypeProvider(tp, obj)
    try:
        from torch.distributed.tensor import DTensor
        if isinstance(obj, DTensor):
            from .base import DTensorShardProvider
            return DTensorShardProvider(obj)
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    if isinstance(obj, torch.Tensor):
        return TensorProvider(obj)
    from .objects import ObjectProvider
    return ObjectProvider(obj)
