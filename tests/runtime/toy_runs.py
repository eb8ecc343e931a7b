"""Forwards of the toy transformer that hostile tests compare between a served and a plain pipeline."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import torchferry
from torchferry import OffloadWarning
from torchferry.testing import toy

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: A change made to each of the two pipelines a test compares (its result is ignored).
Change = Callable[[toy.ToyPipeline], object]


def inputs() -> Inputs:
    """Latents, a timestep and a context for one forward of the toy transformer."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)


def run(p: toy.ToyPipeline, args: Inputs, mode: str = "no_grad") -> torch.Tensor:
    """One transformer forward in ``mode`` (``no_grad``, ``inference_mode`` or ``grad``)."""
    if mode == "grad":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)
            out: torch.Tensor = p.transformer(*args).detach()
            return out
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        out = p.transformer(*args).clone()
    return out


def same_state(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules hold equal state dicts (same keys, bit-equal tensors)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def pair(change: Change | None = None) -> tuple[toy.ToyPipeline, toy.ToyPipeline]:
    """Two identical toy pipelines (seed 0), each changed by ``change``: one to serve, one plain."""
    out = toy.build(0), toy.build(0)
    if change is not None:
        for p in out:
            change(p)
    return out


def block(p: toy.ToyPipeline, i: int) -> Any:
    """Block ``i`` of the DiT (typed loosely: tests reach into its submodules)."""
    return p.transformer.blocks[i]


class Counter(nn.Linear):
    """A linear layer that counts its calls in a buffer updated in place and adds the count."""

    count: torch.Tensor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return super().forward(x) + self.count


class Failing(nn.Linear):
    """A linear layer that raises ``fail`` while it is set."""

    fail: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail is not None:
            raise self.fail
        return super().forward(x)


class Interrupt(BaseException):
    """A BaseException that is not an Exception (as KeyboardInterrupt is)."""


def interrupt_once() -> Callable[[nn.Module, Any], None]:
    """A forward pre hook that raises `Interrupt` at its first call, as a KeyboardInterrupt cuts a step
    short, and lets every later call through."""
    armed = [True]

    def interrupt(module: nn.Module, args: Any) -> None:
        if armed:
            armed.clear()
            raise Interrupt()

    return interrupt


def layerwise_peak() -> int:
    """The device peak of two calls of a fresh hidden-64 toy under layerwise depth 1 (DiT only)."""
    p = toy.build(0, hidden=64)
    with torchferry.offload(p, strategy="layerwise", device="cpu", components={"dit"}) as s:
        p("a cat", steps=3)
        p("a cat", steps=3)
        return s.peak_device_bytes
