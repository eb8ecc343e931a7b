"""`discover`: the only code that reads an ``nn.Module``."""

from __future__ import annotations

from typing import Any

from torchferry.topology._model import Declaration, Topology

__all__ = ["discover"]


def discover(pipeline: Any, declaration: Declaration | None = None) -> Topology:
    """Describe ``pipeline`` (a pipeline object or a bare model) as a `Topology`."""
    raise NotImplementedError
