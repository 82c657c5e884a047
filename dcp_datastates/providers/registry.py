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
tensors, stored as raw extents with checksums exactly like plain tensors, or objects of
other registered types (providers nest).  A registered type works wherever it sits in the
state: as a tensor (a tensor subclass) or as a plain value (any class).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import MappingProxyType

import torch

from ..errors import ProviderError
from .base import CompositeProvider, StateProvider, TensorProvider
from .objects import ObjectProvider


class TypeProvider(ABC):
    """How a user's type is saved: ``flatten`` into metadata and named tensors (the tensors may
    themselves be of registered types: providers nest), ``unflatten`` back.  ``name`` is stored
    in the checkpoint and finds the provider again at load, so it must stay stable."""

    name: str = ""

    @abstractmethod
    def flatten(self, obj) -> tuple[object, dict[str, torch.Tensor]]:
        """Return ``(meta, parts)``: msgpack-able metadata and named plain tensors."""

    @abstractmethod
    def unflatten(self, meta: object, parts: dict[str, torch.Tensor]):
        """Rebuild the object from what :meth:`flatten` returned."""


# The registry of the process (``register_provider``), like fsspec's of filesystems: a type is
# registered once and every writer and reader of the process finds it.
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
    """Forget the provider registered for ``cls`` (nothing happens if there is none)."""
    p = _by_type.pop(cls, None)
    if p is not None:
        _by_name.pop(p.name, None)


def type_provider_for(obj) -> TypeProvider | None:
    """The provider registered for ``obj``'s exact type, or None."""
    return _by_type.get(type(obj))


def type_provider_named(name: str) -> TypeProvider | None:
    """The provider registered under ``name`` (as stored in a manifest), or None."""
    return _by_name.get(name)


MAX_DEPTH = 32  # providers nesting deeper than this are refused (the manifest checks it too)


class RegisteredTypeProvider(CompositeProvider):
    """Adapts a user :class:`TypeProvider` to the engine: a composite whose children are the
    parts ``flatten`` returned, each a tensor or, nested, another registered type."""

    def __init__(self, tp: TypeProvider, obj, *, depth: int = 0) -> None:
        if depth > MAX_DEPTH:
            raise ProviderError(f"registered types nest deeper than {MAX_DEPTH} levels")
        try:
            meta, parts = tp.flatten(obj)
        except Exception as e:  # a user's code: re-raised with what failed
            raise ProviderError(f"provider {tp.name!r} failed to flatten a {type(obj).__name__}: "
                                f"{type(e).__name__}: {e}") from e
        if not isinstance(parts, dict):
            raise ProviderError(f"provider {tp.name!r}: flatten must return (meta, dict of parts)")
        children: dict[str, StateProvider] = {}
        for k, v in parts.items():
            if not isinstance(k, str) or not k or "/" in k:
                raise ProviderError(f"provider {tp.name!r}: part name {k!r} must be a non-empty "
                                    "string without '/'")
            sub = type_provider_for(v)
            if sub is not None:
                children[k] = RegisteredTypeProvider(sub, v, depth=depth + 1)
            elif isinstance(v, torch.Tensor):
                children[k] = TensorProvider(v)
            else:
                raise ProviderError(f"provider {tp.name!r}: part {k!r} is a {type(v).__name__}, "
                                    "neither a tensor nor a registered type")
        super().__init__(children, meta)
        self.name = tp.name

    def tree(self) -> dict:
        """How the parts nest (``Chunk.tree`` of the manifest)."""
        return {k: ({"p": c.name, "m": c.meta(), "t": c.tree()} if isinstance(c, RegisteredTypeProvider)
                    else None) for k, c in self.children.items()}


def rebuild(name: str, meta, tree: dict | None, leaves: dict[str, torch.Tensor], prefix: str = ""):
    """The object provider ``name`` makes of ``meta`` and its parts (nested providers first).
    ``leaves`` maps part paths to tensors; ``tree`` is None for a flat provider."""
    tp = type_provider_named(name)
    if tp is None:
        raise ProviderError(f"the checkpoint needs provider {name!r}, which is not registered in "
                            "this process; import the module that registers it")
    if tree is None:
        parts = {k[len(prefix):]: v for k, v in leaves.items() if k.startswith(prefix)}
    else:
        parts = {}
        for k, sub in tree.items():
            path = f"{prefix}{k}"
            parts[k] = leaves[path] if sub is None else rebuild(sub["p"], sub["m"], sub["t"], leaves,
                                                                 path + "/")
    try:
        return tp.unflatten(meta, parts)
    except Exception as e:  # a user's code: re-raised with what failed
        raise ProviderError(f"provider {name!r} failed to unflatten: {type(e).__name__}: {e}") from e


def provider_for(obj) -> StateProvider:
    """Pick the provider for one piece of state: a registered type, a tensor (DCP hands the
    writer each DTensor's local shard as a plain tensor), or a Python value."""
    tp = type_provider_for(obj)
    if tp is not None:
        return RegisteredTypeProvider(tp, obj)
    if isinstance(obj, torch.Tensor):
        return TensorProvider(obj)
    return ObjectProvider(obj)
