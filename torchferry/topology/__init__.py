"""What a pipeline is made of and what the user asked for: immutable data and pure builders."""

from __future__ import annotations

from torchferry.topology._checkpoint import from_checkpoint
from torchferry.topology._config import (
    COMPONENT_NAMES,
    STRATEGIES,
    OffloadConfig,
    ParallelLayout,
    SelectableComponent,
    Strategy,
    Transfer,
)
from torchferry.topology._discover import discover
from torchferry.topology._frozen import FrozenMap
from torchferry.topology._known import KNOWN_MODELS, known_topology
from torchferry.topology._model import (
    DTYPE_SIZES,
    Block,
    Component,
    ComponentKind,
    Declaration,
    Stack,
    TensorSpec,
    Topology,
    dtype_size,
    join_path,
)
from torchferry.topology._plan import Plan, canonical
from torchferry.topology._resolve import resolve

__all__ = [
    "COMPONENT_NAMES",
    "DTYPE_SIZES",
    "KNOWN_MODELS",
    "STRATEGIES",
    "Block",
    "Component",
    "ComponentKind",
    "Declaration",
    "FrozenMap",
    "OffloadConfig",
    "ParallelLayout",
    "Plan",
    "SelectableComponent",
    "Stack",
    "Strategy",
    "TensorSpec",
    "Topology",
    "Transfer",
    "canonical",
    "discover",
    "dtype_size",
    "from_checkpoint",
    "join_path",
    "known_topology",
    "resolve",
]
