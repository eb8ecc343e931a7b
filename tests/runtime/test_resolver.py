"""Paths resolve to registered children first: a child named like a module method is still the child."""

from __future__ import annotations

import contextlib
import re
from typing import ClassVar

import pytest
import torch
from module_checks import hook_count
from torch import nn

import torchferry
from torchferry import OffloadWarning, topology


class _DiT(nn.Module):
    """Blocks in a list named ``double`` and a head named ``half``: both shadow ``nn.Module`` methods."""

    _layerwise_offload_blocks_attrs: ClassVar[tuple[str, ...]] = ("double",)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.double = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.half = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self._modules["double"]:  # type: ignore[union-attr]
            x = torch.tanh(block(x))
        head = self._modules["half"]
        assert head is not None
        return head(x)


class _Pipeline:
    """A plain pipeline declaring one DiT and nothing else."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.transformer = _DiT()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.transformer(self.transformer(x))


def test_resolver_prefers_registered_children() -> None:
    """``find_attr`` returns the child module named ``half``, not the bound ``nn.Module.half`` method."""
    dit = _DiT()
    assert topology.find_attr(dit, "half") is dit._modules["half"]
    blocks = dit._modules["double"]
    assert isinstance(blocks, nn.ModuleList)
    assert topology.find_attr(dit, "double.1.weight") is blocks[1].weight
    with pytest.raises(AttributeError):
        topology.find_attr(dit, "double.nothing")


@pytest.mark.parametrize("strategy", ["model_level", "layerwise"])
def test_offload_a_model_with_children_named_like_methods(strategy: str) -> None:
    """A DiT whose block list is ``double`` and head is ``half`` streams bit-identically and closes clean."""
    pipe, ref = _Pipeline(), _Pipeline()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    expected = ref(x)
    warns = (
        pytest.warns(OffloadWarning, match=re.escape("has no encoder component"))
        if strategy == "model_level"
        else contextlib.nullcontext()
    )
    with warns, torchferry.offload(pipe, strategy=strategy, device="cpu") as session:
        assert torch.equal(pipe(x), expected)
        assert torch.equal(pipe(x), expected)
        assert session.hook_count > 0
    assert hook_count(pipe.transformer) == 0
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            pipe.transformer.state_dict().values(), ref.transformer.state_dict().values(), strict=True
        )
    )
