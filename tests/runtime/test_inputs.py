"""A session moves a component's tensor arguments to its device, nested, and copies nothing needlessly."""

from __future__ import annotations

from typing import NamedTuple

import torch

import torchferry
from torchferry.runtime.interop._inputs import to_device
from torchferry.testing import toy


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


def test_every_nested_tensor_moves_and_the_rest_is_kept() -> None:
    """Tensors in tuples, lists, dicts and named tuples move; other values and containers' types stay."""
    meta = torch.device("meta")
    value = (torch.ones(2), [torch.ones(1), 3], {"x": torch.zeros(1), "y": "s"}, Pair(torch.ones(1), 4))
    moved = to_device(value, meta)
    assert type(moved) is tuple and type(moved[1]) is list and type(moved[3]) is Pair
    assert [t.device for t in (moved[0], moved[1][0], moved[2]["x"], moved[3].a)] == [meta] * 4
    assert moved[1][1] == 3 and moved[2]["y"] == "s" and moved[3].b == 4


def test_arguments_already_on_the_device_are_the_same_objects() -> None:
    """Nothing is rebuilt when every tensor is already on the device (a steady call costs a walk)."""
    value = ((torch.ones(2),), {"k": [torch.ones(1)]})
    assert to_device(value, torch.device("cpu")) is value


def test_a_session_adds_one_input_hook_per_component_and_removes_it() -> None:
    """Each top-level component gets one pre hook, counted by the session and gone after close."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        tops = [c.path for c in session.plan.components]
        assert session.hook_count == session.engine.hook_count + len(tops)
        assert torch.equal(p("a cat", steps=1), toy.build(0)("a cat", steps=1))
    assert all(not getattr(p, t)._forward_pre_hooks for t in tops)
