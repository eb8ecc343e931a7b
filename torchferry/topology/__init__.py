"""What a pipeline is made of and what the user asked for: immutable data and pure builders."""

from __future__ import annotations

# Imports written ``name as name`` are for the layers above, which enter only through this file
# (tests/test_layering.py); they are not public and not in ``__all__``.
from torchferry.topology._checkpoint import from_checkpoint
from torchferry.topology._config import RUNTIME_OPTIONS, OffloadConfig
from torchferry.topology._discover import check_stranded as check_stranded
from torchferry.topology._discover import discover
from torchferry.topology._fields import (
    COMPONENT_NAMES,
    MAX_PREFETCH_DEPTH,
    STRATEGIES,
    SelectableComponent,
    Strategy,
    Transfer,
)
from torchferry.topology._folder import (
    FolderComponent,
    PipelineFolder,
    from_pipeline_folder,
    hub_cache_dir,
    hub_snapshot,
    is_pipeline_folder,
    read_pipeline_folder,
)
from torchferry.topology._folder import guess_block_attrs as guess_block_attrs
from torchferry.topology._folder import is_hub_id as is_hub_id
from torchferry.topology._folder import known_match as known_match
from torchferry.topology._folder import library_module as library_module
from torchferry.topology._folder import pipeline_sources as pipeline_sources
from torchferry.topology._frozen import FrozenMap
from torchferry.topology._gguf import GGUF_TYPES as GGUF_TYPES
from torchferry.topology._gguf import GGUFEntry as GGUFEntry
from torchferry.topology._gguf import is_gguf as is_gguf
from torchferry.topology._gguf import parse_gguf as parse_gguf
from torchferry.topology._gguf import read_gguf as read_gguf
from torchferry.topology._gguf_fit import GGUF_CONFIG_FIX as GGUF_CONFIG_FIX
from torchferry.topology._gguf_fit import check_gguf_counts as check_gguf_counts
from torchferry.topology._gguf_fit import check_gguf_fits as check_gguf_fits
from torchferry.topology._gguf_layouts import GGUF_LAYOUTS as GGUF_LAYOUTS
from torchferry.topology._gguf_layouts import GIVE_CONFIG as GIVE_CONFIG
from torchferry.topology._gguf_layouts import InferredModel as InferredModel
from torchferry.topology._gguf_layouts import infer_gguf_model as infer_gguf_model
from torchferry.topology._json import load_json as load_json
from torchferry.topology._json import read_json_object as read_json_object
from torchferry.topology._keep_fp32 import kept_modules as kept_modules
from torchferry.topology._keep_fp32 import under_kept as under_kept
from torchferry.topology._keymap import Conversion as Conversion
from torchferry.topology._keymap import KeyMap as KeyMap
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
from torchferry.topology._library_keys import checkpoint_key_map as checkpoint_key_map
from torchferry.topology._library_keys import library_key_map as library_key_map
from torchferry.topology._locate import locate as locate
from torchferry.topology._model import (
    DTYPE_SIZES,
    PACK_ALIGN,
    Block,
    Component,
    ComponentKind,
    Declaration,
    Dequantized,
    Stack,
    TensorSpec,
    Topology,
    dtype_size,
    join_path,
    pack,
    packed_nbytes,
)
from torchferry.topology._model import find_attr as find_attr
from torchferry.topology._order import order_mismatch as order_mismatch
from torchferry.topology._parallel import ParallelLayout
from torchferry.topology._plan import Plan, StoreFacts, canonical
from torchferry.topology._plan import interned as interned
from torchferry.topology._protocol import SupportsComponentDiscovery
from torchferry.topology._quantized import flattened_names as flattened_names
from torchferry.topology._quantized import header_metadata as header_metadata
from torchferry.topology._quantized import quantized_names as quantized_names
from torchferry.topology._resolve import encoder_type, resolve
from torchferry.topology._resolve import own_weights as own_weights
from torchferry.topology._safetensors import SAFETENSORS_DTYPES as SAFETENSORS_DTYPES
from torchferry.topology._safetensors import HeaderEntry as HeaderEntry
from torchferry.topology._safetensors import open_regular as open_regular
from torchferry.topology._safetensors import parse_header as parse_header
from torchferry.topology._safetensors import read_header as read_header
from torchferry.topology._safetensors import show as show
from torchferry.topology._storage import STORAGE_DTYPES as STORAGE_DTYPES
from torchferry.topology._storage import exact_cast as exact_cast
from torchferry.topology._storage import stored_as as stored_as
from torchferry.topology._units import memory_bytes, parse_bytes, parse_rate
from torchferry.topology._wrapped import is_wrapper as is_wrapper

__all__ = [
    "COMPONENT_NAMES",
    "DTYPE_SIZES",
    "HUB_IDS",
    "KNOWN_ALIASES",
    "KNOWN_MODELS",
    "MAX_PREFETCH_DEPTH",
    "PACK_ALIGN",
    "RUNTIME_OPTIONS",
    "STRATEGIES",
    "Block",
    "Component",
    "ComponentKind",
    "Declaration",
    "Dequantized",
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
    "StoreFacts",
    "Strategy",
    "SupportsComponentDiscovery",
    "TensorSpec",
    "Topology",
    "Transfer",
    "canonical",
    "discover",
    "dtype_size",
    "encoder_type",
    "from_checkpoint",
    "from_pipeline_folder",
    "hub_cache_dir",
    "hub_model_id",
    "hub_snapshot",
    "is_pipeline_folder",
    "join_path",
    "known_model",
    "known_topology",
    "memory_bytes",
    "pack",
    "packed_nbytes",
    "parse_bytes",
    "parse_rate",
    "read_pipeline_folder",
    "resolve",
]
