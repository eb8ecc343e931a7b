"""Gradients through offloaded weights: streamed blocks fail loudly, staged components stay correct."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable

import pytest
import torch

import torchferry
from torchferry import OffloadWarning
from torchferry.testing import toy

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: Autograd's message when a tensor a backward needs was changed after the forward saved it.
MODIFIED = "modified by an inplace operation"


def warning(unit: str = "transformer.blocks.0", slot: str = "s0") -> str:
    """The warning a session gives the first time a streamed unit runs with grad enabled."""
    return (
        f"torchferry: {unit} ran with gradients enabled while its weights stream through a shared device "
        f"slot ({slot}); gradients through streamed weights are not supported, and a backward through "
        "this forward will raise (the slot is reused for the blocks that follow). Run the pipeline under "
        "torch.no_grad() or torch.inference_mode(), or use strategy='none' or 'model_level' if you need "
        "gradients"
    )


def inputs() -> Inputs:
    """Latents, a timestep and a context for one forward of the toy transformer."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)


def loss(pipeline: toy.ToyPipeline, args: Inputs) -> torch.Tensor:
    return pipeline.transformer(*args).square().sum()


def grads(pipeline: toy.ToyPipeline) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in pipeline.named_parameters()}


def same_grads(a: toy.ToyPipeline, b: toy.ToyPipeline) -> bool:
    """Whether both pipelines hold the same gradients, bit for bit (``None`` where the other has none)."""
    ga, gb = grads(a), grads(b)
    return ga.keys() == gb.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((ga[k], gb[k]) for k in ga)
    )


def test_backward_through_streamed_blocks_raises() -> None:
    """A layerwise forward with grad warns, and its backward raises instead of giving wrong gradients."""
    p, ref = toy.build(0, blocks=4), toy.build(0, blocks=4)
    args = inputs()
    loss(ref, args).backward()
    with torchferry.offload(p, strategy="layerwise", device="cpu"):
        with pytest.warns(OffloadWarning, match=re.escape(warning())):
            out = loss(p, args)
        with pytest.raises(RuntimeError, match=MODIFIED):
            out.backward()


def test_backward_after_close_raises() -> None:
    """A backward after the session closed still raises: leaving the slots invalidates what was saved."""
    p = toy.build(0, blocks=4)
    args = inputs()
    with (
        torchferry.offload(p, strategy="layerwise", device="cpu"),
        pytest.warns(OffloadWarning, match=re.escape(warning())),
    ):
        out = loss(p, args)
    with pytest.raises(RuntimeError, match=MODIFIED):
        out.backward()


def test_deeper_prefetch_raises_too() -> None:
    """With more slots (prefetch depth 3) every block still leaves its slot, so backward raises."""
    p = toy.build(0, blocks=6)
    args = inputs()
    with torchferry.offload(p, strategy="layerwise", device="cpu", prefetch_depth=3):
        with pytest.warns(OffloadWarning, match=re.escape(warning())):
            out = loss(p, args)
        with pytest.raises(RuntimeError, match=MODIFIED):
            out.backward()


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_without_grad_nothing_changes(mode: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    """Under no_grad or inference mode nothing warns, no version counter moves, outputs are bit-identical."""
    p, ref = toy.build(0, blocks=4), toy.build(0, blocks=4)
    args = inputs()
    with mode():
        expected = [ref.transformer(*args) for _ in range(3)]
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        versions = [t._version for t in p.parameters()]
        with warnings.catch_warnings(record=True) as caught, mode():
            warnings.simplefilter("always")
            got = [p.transformer(*args) for _ in range(3)]
        assert [t._version for t in p.parameters()] == versions
        assert not session.engine.guard.graded
    assert [str(w.message) for w in caught] == []
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("strategy", ["none", "model_level"])
def test_staged_strategies_give_reference_gradients(strategy: str) -> None:
    """Strategies that stage whole components (no shared slots) warn nothing and match the plain gradients."""
    p, ref = toy.build(0, blocks=4), toy.build(0, blocks=4)
    args = inputs()
    loss(ref, args).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torchferry.offload(p, strategy=strategy, device="cpu"):
            loss(p, args).backward()
    assert [str(w.message) for w in caught] == []
    assert same_grads(p, ref)
    assert all(g is not None for name, g in grads(p).items() if name.startswith("transformer."))


def test_model_level_backward_after_unstage() -> None:
    """A backward after model_level unstaged the component (the next step staged another) is still right."""
    p, ref = toy.build(0, blocks=4), toy.build(0, blocks=4)
    args = inputs()
    loss(ref, args).backward()
    with torchferry.offload(p, strategy="model_level", device="cpu") as session:
        out = loss(p, args)
        with torch.no_grad():
            p.text_encoder(toy.tokenize("a cat"))
        assert "transformer" not in {placement.unit for placement in session.residency}
        out.backward()
    assert same_grads(p, ref)


def test_layerwise_resident_blocks_alone_give_reference_gradients() -> None:
    """Resident (staged) blocks own their memory: with every block resident, layerwise gradients are right."""
    p, ref = toy.build(0, blocks=4), toy.build(0, blocks=4)
    args = inputs()
    loss(ref, args).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torchferry.offload(p, strategy="layerwise", device="cpu", resident_layers=4):
            loss(p, args).backward()
    assert [str(w.message) for w in caught] == []
    assert same_grads(p, ref)


def test_warns_once_per_session() -> None:
    """The warning comes once per session however many forwards run with grad, and again in a new one."""
    p = toy.build(0, blocks=4)
    args = inputs()
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torchferry.offload(p, strategy="layerwise", device="cpu"):
                for _ in range(3):
                    loss(p, args)
        assert [str(w.message) for w in caught] == [warning()]
        assert all(w.category is OffloadWarning for w in caught)


def test_frozen_model_gradient_to_the_input_raises() -> None:
    """With every weight frozen, a backward to the input through streamed blocks raises (no wrong grad)."""
    p = toy.build(0, blocks=4).requires_grad_(False)
    latents, t, context = inputs()
    latents.requires_grad_(True)
    with torchferry.offload(p, strategy="layerwise", device="cpu"):
        with pytest.warns(OffloadWarning, match=re.escape(warning())):
            out = p.transformer(latents, t, context).square().sum()
        with pytest.raises(RuntimeError, match=MODIFIED):
            out.backward()
    assert latents.grad is None


def test_trainable_patch_in_with_frozen_blocks_raises() -> None:
    """A trainable patch_in behind frozen streamed blocks: backward raises, and patch_in gets no grad."""
    p = toy.build(0, blocks=4).requires_grad_(False)
    p.transformer.patch_in.requires_grad_(True)
    with torchferry.offload(p, strategy="layerwise", device="cpu"):
        with pytest.warns(OffloadWarning, match=re.escape(warning())):
            out = loss(p, inputs())
        with pytest.raises(RuntimeError, match=MODIFIED):
            out.backward()
    assert p.transformer.patch_in.weight.grad is None


def test_frozen_model_with_resident_blocks_gives_reference_input_gradient() -> None:
    """Frozen weights in staged (resident) blocks stay valid: the input's gradient equals the plain run's."""
    p, ref = toy.build(0, blocks=4).requires_grad_(False), toy.build(0, blocks=4).requires_grad_(False)
    latents, t, context = inputs()
    mine, theirs = latents.clone().requires_grad_(True), latents.clone().requires_grad_(True)
    ref.transformer(theirs, t, context).square().sum().backward()
    with torchferry.offload(p, strategy="layerwise", device="cpu", resident_layers=4):
        p.transformer(mine, t, context).square().sum().backward()
    assert mine.grad is not None and theirs.grad is not None
    assert torch.equal(mine.grad, theirs.grad)
