"""Registered types for tests/test_providers.py.  Importing this module registers them, so a
PROCESS-mode checkpoint daemon that unpickles these objects registers them too."""

from __future__ import annotations

import torch

from dcp_datastates import TypeProvider, register_provider


class Scaled:
    """A plain class: two tensors and a float."""

    def __init__(self, data: torch.Tensor, bias: torch.Tensor, scale: float) -> None:
        self.data, self.bias, self.scale = data, bias, scale


class Pair:
    """A plain class whose part is another registered type (providers nest)."""

    def __init__(self, inner: Scaled, extra: torch.Tensor, label: str) -> None:
        self.inner, self.extra, self.label = inner, extra, label


class TaggedTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, data, tag):
        t = torch.Tensor._make_subclass(cls, data)
        t.tag = tag
        return t


class Broken:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class ScaledProvider(TypeProvider):
    name = "tests.provider_types.Scaled"

    def flatten(self, obj):
        return {"scale": obj.scale}, {"data": obj.data, "bias": obj.bias}

    def unflatten(self, meta, parts):
        return Scaled(parts["data"], parts["bias"], meta["scale"])


class PairProvider(TypeProvider):
    name = "tests.provider_types.Pair"

    def flatten(self, obj):
        return {"label": obj.label}, {"inner": obj.inner, "extra": obj.extra}

    def unflatten(self, meta, parts):
        return Pair(parts["inner"], parts["extra"], meta["label"])


class TaggedTensorProvider(TypeProvider):
    name = "tests.provider_types.TaggedTensor"

    def flatten(self, obj):
        return {"tag": obj.tag}, {"data": obj.as_subclass(torch.Tensor)}

    def unflatten(self, meta, parts):
        return TaggedTensor(parts["data"], meta["tag"])


class BrokenProvider(TypeProvider):
    name = "tests.provider_types.Broken"

    def flatten(self, obj):
        raise RuntimeError("flatten exploded")

    def unflatten(self, meta, parts):  # pragma: no cover - never saved
        raise AssertionError


for cls, prov in ((Scaled, ScaledProvider()), (Pair, PairProvider()),
                  (TaggedTensor, TaggedTensorProvider()), (Broken, BrokenProvider())):
    register_provider(cls, prov, clobber=True)


def sample_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g),
            "scaled": Scaled(torch.randn(16, 8, generator=g), torch.randn(8, generator=g), 0.25),
            "tagged": TaggedTensor(torch.randn(4, 5, generator=g), "embedding"),
            "pair": Pair(Scaled(torch.randn(3, generator=g), torch.randn(2, generator=g), 1.5),
                         torch.randn(6, generator=g), "outer")}


def placeholders(instances: bool) -> dict:
    """Load destinations: placeholder instances of the types, or plain stand-ins."""
    if instances:
        return {"w": torch.zeros(64, 32),
                "scaled": Scaled(torch.zeros(16, 8), torch.zeros(8), 0.0),
                "tagged": TaggedTensor(torch.zeros(4, 5), "?"),
                "pair": Pair(Scaled(torch.zeros(3), torch.zeros(2), 0.0), torch.zeros(6), "?")}
    return {"w": torch.zeros(64, 32), "scaled": None, "tagged": torch.zeros(4, 5), "pair": None}


def check_state(out: dict, seed: int = 0) -> None:
    ref = sample_state(seed)
    assert torch.equal(out["w"], ref["w"])
    s = out["scaled"]
    assert type(s) is Scaled and s.scale == 0.25
    assert torch.equal(s.data, ref["scaled"].data) and torch.equal(s.bias, ref["scaled"].bias)
    t = out["tagged"]
    assert type(t) is TaggedTensor and t.tag == "embedding", (type(t), getattr(t, "tag", None))
    assert torch.equal(t.as_subclass(torch.Tensor), ref["tagged"].as_subclass(torch.Tensor))
    p = out["pair"]
    assert type(p) is Pair and p.label == "outer" and type(p.inner) is Scaled and p.inner.scale == 1.5
    assert torch.equal(p.inner.data, ref["pair"].inner.data) and torch.equal(p.extra, ref["pair"].extra)
