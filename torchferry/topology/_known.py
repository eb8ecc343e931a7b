"""Topologies of known public models, built from their published config values (no download)."""

from __future__ import annotations

from torchferry.topology._model import Topology

__all__ = ["KNOWN_MODELS", "known_topology"]

#: Known model ids (filled in from the shipped tensor specs).
KNOWN_MODELS: tuple[str, ...] = ()


def known_topology(model_id: str) -> Topology:
    """The exact topology of the known public model ``model_id`` (tensor shapes and dtypes as loaded)."""
    raise NotImplementedError(model_id)
