"""Non-tensor Python values: msgpack by default, pickle only by opt-in."""

from __future__ import annotations

import pickle

import xxhash

from ..errors import UnsupportedValueError
from ..format.values import NotEncodable, encode_value
from .base import StateProvider, TensorRegion


class ObjectProvider(StateProvider):
    """A Python value stored inline in the manifest (no byte regions)."""

    name = "object"

    def __init__(self, value) -> None:
        self.value = value

    def regions(self) -> list[TensorRegion]:
        return []

    def encode(self, *, key: str, checkpoint: str, allow_pickle: bool) -> tuple[str, bytes, int]:
        """Return ``(encoding, data, checksum)`` for the manifest."""
        try:
            data = encode_value(self.value)
            enc = "msgpack"
        except NotEncodable as e:
            if not allow_pickle:
                raise UnsupportedValueError(
                    f"value of type {type(self.value).__name__} cannot be stored without pickle ({e}); "
                    "convert it to plain types, register a provider for it, or pass "
                    "allow_pickle=True to the writer (the reader will need it too)",
                    checkpoint=checkpoint, key=key) from None
            data = pickle.dumps(self.value, protocol=pickle.HIGHEST_PROTOCOL)
            enc = "pickle"
        return enc, data, xxhash.xxh3_64_intdigest(data)
