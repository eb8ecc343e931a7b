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
from torchferry.topology._folder import (
    FolderComponent,
    PipelineFolder,
    from_pipeline_folder,
    hub_cache_dir,
    hub_snapshot,
    is_pipeline_folder,
    read_pipeline_folder,
)
from torchferry.topology._frozen import FrozenMap
from torchferry.topology._known import (
    HUB_IDS,
    KNOWN_ALIASES,
    KNOWN_MODELS,
    KnownComponent,
    KnownModel,
    Resolution,
    hub_model_id,
    known_model,
    known_topology,
)
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
    pack,
)
from torchferry.topology._plan import Plan, canonical
from torchferry.topology._protocol import SupportsComponentDiscovery
from torchferry.topology._registry import (
    block_attrs_for,
    declaration_for_pipeline,
    encoder_block_attrs_for,
    encoder_block_layouts_for,
    pipeline_components,
)
from torchferry.topology._resolve import resolve

__all__ = [
    "COMPONENT_NAMES",
    "DTYPE_SIZES",
    "HUB_IDS",
    "KNOWN_ALIASES",
    "KNOWN_MODELS",
    "STRATEGIES",
    "Block",
    "Component",
    "ComponentKind",
    "Declaration",
    "FolderComponent",
    "FrozenMap",
    "KnownComponent",
    "KnownModel",
    "OffloadConfig",
    "ParallelLayout",
    "PipelineFolder",
    "Plan",
    "Resolution",
    "SelectableComponent",
    "Stack",
    "Strategy",
    "SupportsComponentDiscovery",
    "TensorSpec",
    "Topology",
    "Transfer",
    "block_attrs_for",
    "canonical",
    "declaration_for_pipeline",
    "discover",
    "dtype_size",
    "encoder_block_attrs_for",
    "encoder_block_layouts_for",
    "from_checkpoint",
    "from_pipeline_folder",
    "hub_cache_dir",
    "hub_model_id",
    "hub_snapshot",
    "is_pipeline_folder",
    "join_path",
    "known_model",
    "known_topology",
    "pack",
    "pipeline_components",
    "read_pipeline_folder",
    "resolve",
]
