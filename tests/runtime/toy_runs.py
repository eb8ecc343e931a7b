"""Forwards of the toy transformer that hostile tests compare between a served and a plain pipeline."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from torchferry import OffloadWarning
from torchferry.testing import toy

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
