"""Rings found from structure stream in the order the forward visits their lists, not registration order."""

from __future__ import annotations

import torch
from torch import nn

from torchferry.topology import discover
from torchferry.topology._order import forward_order


def _blocks(n: int) -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(4, 4) for _ in range(n))


class Refined(nn.Module):
    """Registers ``noise`` before ``context`` and runs ``context`` first, through a helper method."""

    def __init__(self) -> None:
        super().__init__()
        self.noise = _blocks(2)
        self.context = _blocks(2)
        self.layers = _blocks(4)

    def _refine(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.context:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._refine(x)
        for block in self.noise:
            x = block(x)
        for block in self.layers:
            x = block(x)
        return x


class Unnamed(nn.Module):
    """Runs its lists through ``getattr``, so its forward never names them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _blocks(2)
        self.second = _blocks(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in ("second", "first"):
            for block in getattr(self, name):
                x = block(x)
        return x


def test_forward_order_follows_the_source_and_the_models_own_methods() -> None:
    """The lists come in the order forward (and a method it calls) first names them."""
    assert forward_order(Refined, ("noise", "context", "layers")) == ("context", "noise", "layers")


def test_forward_order_keeps_the_given_order_when_a_list_is_never_named() -> None:
    """A forward that never names a list leaves the registration order (the runtime then refuses)."""
    assert forward_order(Unnamed, ("first", "second")) == ("first", "second")
    assert forward_order(Refined, ("noise", "absent")) == ("noise", "absent")


def test_discover_rings_a_structural_model_in_forward_order() -> None:
    """An undeclared model's one ring lists its blocks in the order its forward runs them."""
    ring = discover(Refined()).components[0].blocks
    assert [b.path for b in ring] == [
        "context.0",
        "context.1",
        "noise.0",
        "noise.1",
        "layers.0",
        "layers.1",
        "layers.2",
        "layers.3",
    ]
