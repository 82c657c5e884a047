"""Composable state providers (see ``base.py`` for the lifecycle)."""

from .base import (CompositeProvider, DTensorShardProvider, StateProvider, TensorProvider,
                   TensorRegion)
from .objects import ObjectProvider
from .registry import (TypeProvider, provider_for, register_provider, registry,
                       type_provider_named, unregister_provider)

__all__ = [
    "CompositeProvider", "DTensorShardProvider", "ObjectProvider", "StateProvider",
    "TensorProvider", "TensorRegion", "TypeProvider", "provider_for", "register_provider",
    "registry", "type_provider_named", "unregister_provider",
]
