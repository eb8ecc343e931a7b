"""`from_checkpoint`: a topology from safetensors headers alone."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from torchferry.topology._model import Topology

__all__ = ["from_checkpoint"]


def from_checkpoint(
    path: str | os.PathLike[str],
    block_attrs: Sequence[str] | Mapping[str, Sequence[str]] = ("blocks",),
) -> Topology:
    """Describe a safetensors checkpoint (file, shard folder or ``*.index.json``) without reading data."""
    raise NotImplementedError
