"""Composable state providers (see ``base.py`` for the lifecycle)."""

from .base import CompositeProvider, StateProvider, TensorProvider, TensorRegion
from .objects import ObjectProvider
from .registry import (
                       RegisteredTypeProvider,
                       TypeProvider,
                       provider_for,
                       rebuild,
                       register_provider,
                       registry,
                       type_provider_for,
                       type_provider_named,
                       unregister_provider,
)

__all__ = [
    "CompositeProvider", "ObjectProvider", "RegisteredTypeProvider", "StateProvider",
    "TensorProvider", "TensorRegion", "TypeProvider", "provider_for", "rebuild",
    "register_provider", "registry", "type_provider_for", "type_provider_named",
    "unregister_provider",
]
