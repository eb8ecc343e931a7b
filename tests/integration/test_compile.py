"""torch.compile under a session: the engine's hooks stay out of Dynamo, so a compiled block is one graph."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny import WAN_TRANSFORMER

import torchferry
from torchferry.testing import toy

diffusers = pytest.importorskip("diffusers")
dynamo = pytest.importorskip("torch._dynamo")

Backend = Callable[[torch.fx.GraphModule, list[torch.Tensor]], Callable[..., Any]]


def _wan() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny 6-block WanTransformer3DModel and one forward's inputs, both from fixed seeds."""
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**WAN_TRANSFORMER)
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
    }
    return model.eval(), inputs


def _counting(kind: str, graphs: list[torch.fx.GraphModule]) -> Backend:
    """A backend that records every graph Dynamo hands it, then compiles it with ``kind``."""

    def backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        if kind == "eager":
            return gm.forward
        from torch._dynamo.backends.debugging import aot_eager

        compiled: Callable[..., Any] = aot_eager(gm, example)
        return compiled

    return backend


def _run(kind: str, *, regional: bool, session: bool) -> tuple[int, list[torch.Tensor]]:
    """Graphs compiled and outputs of three compiled forwards, plain or under a layerwise session."""
    dynamo.reset()
    model, inputs = _wan()
    graphs: list[torch.fx.GraphModule] = []
    backend = _counting(kind, graphs)
    opened = torchferry.offload(model, strategy="layerwise", device="cpu") if session else None
    try:
        with torch.no_grad():
            if regional:
                for block in model.blocks:
                    block.compile(backend=backend)
                forward: Callable[..., Any] = model
            else:
                forward = torch.compile(model, backend=backend)
            outputs = [forward(**inputs, return_dict=False)[0] for _ in range(3)]
    finally:
        if opened is not None:
            opened.close()
    return len(graphs), outputs


@pytest.mark.parametrize("kind", ["eager", "aot_eager"])
def test_compiled_blocks_are_one_graph_under_a_session(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """Each block compiled under a session: the plain graph count, bit-identical outputs, no recompiles."""
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        plain, expected = _run(kind, regional=True, session=False)
        streamed, got = _run(kind, regional=True, session=True)
    assert streamed == plain == 1
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert "recompile_limit" not in caplog.text


@pytest.mark.parametrize("kind", ["eager", "aot_eager"])
def test_whole_model_compile_under_a_session(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """The whole model compiled under a session is bit-identical and compiles nothing after two calls."""
    _, expected = _run(kind, regional=False, session=False)
    dynamo.reset()
    model, inputs = _wan()
    graphs: list[torch.fx.GraphModule] = []
    with (
        caplog.at_level(logging.WARNING, logger="torch._dynamo"),
        torchferry.offload(model, strategy="layerwise", device="cpu"),
        torch.no_grad(),
    ):
        forward = torch.compile(model, backend=_counting(kind, graphs))
        got = [forward(**inputs, return_dict=False)[0] for _ in range(2)]
        compiled = len(graphs)
        got.append(forward(**inputs, return_dict=False)[0])
    assert len(graphs) == compiled
    assert "recompile_limit" not in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_auto_over_a_transformer_compiled_and_called_before_opening() -> None:
    """A transformer compiled and called once before opening under auto runs every call exactly, though
    the tracer times none of its blocks (the compiled forward's)."""
    p, ref = toy.build(0), toy.build(0)
    p.transformer = torch.compile(p.transformer, backend="eager")  # type: ignore[assignment]
    expected = ref("a cat", steps=6)
    assert torch.equal(p("a cat", steps=6), expected)
    with torchferry.offload(p, device="cpu"):
        for _ in range(3):
            assert torch.equal(p("a cat", steps=6), expected)
