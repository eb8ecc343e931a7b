"""Known diffusers / transformers classes: where their repeated blocks live, and pipeline declarations.

Pure data keyed by class name, so nothing here imports diffusers or transformers: `discover` looks a
model's class name up when the model declares nothing itself, and a known diffusers pipeline gets a
`Declaration` like the ones vLLM-Omni's pipelines carry (encoder types, encoder stacks, encoder weight
replication, the DiTs allowed to keep resident blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

import attrs

from torchferry.topology._frozen import FrozenMap
from torchferry.topology._model import ComponentKind, Declaration

__all__ = [
    "DIT_BLOCK_ATTRS",
    "ENCODER_BLOCK_LAYOUTS",
    "PIPELINES",
    "PipelineEntry",
    "block_attrs_for",
    "declaration_for_pipeline",
    "encoder_block_attrs_for",
    "encoder_block_layouts_for",
    "pipeline_components",
]

_UNET = ("down_blocks", "mid_block", "up_blocks")

#: diffusers DiT class -> its block ``ModuleList`` attributes, concatenated in order into ONE ring.
DIT_BLOCK_ATTRS: FrozenMap[str, tuple[str, ...]] = FrozenMap(
    {
        "WanTransformer3DModel": ("blocks",),
        "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
        "QwenImageTransformer2DModel": ("transformer_blocks",),
        "HunyuanVideoTransformer3DModel": ("transformer_blocks", "single_transformer_blocks"),
        "SD3Transformer2DModel": ("transformer_blocks",),
        "LTXVideoTransformer3DModel": ("transformer_blocks",),
        # The VACE hint blocks run before the main blocks (registered after them).
        "WanVACETransformer3DModel": ("vace_blocks", "blocks"),
        # Forwards that interleave a second list with the main one: the main ring streams, the
        # interleaved list (temporal blocks, face adapters) stays with the resident remainder.
        "LatteTransformer3DModel": ("transformer_blocks",),
        "WanAnimateTransformer3DModel": ("blocks",),
        # UNets: down, mid (one module), up; registration order puts ``up_blocks`` before ``mid_block``.
        "UNet2DConditionModel": _UNET,
        "UNet2DModel": _UNET,
        "UNet1DModel": _UNET,
        "UNet3DConditionModel": _UNET,
        "UNetMotionModel": _UNET,
        "UNetSpatioTemporalConditionModel": _UNET,
    }
)

#: transformers text-encoder class -> its known block layouts, newest transformers first. A layout is
#: a tuple of dotted ``ModuleList`` paths, each its own ring. transformers 5.x dropped the
#: ``text_model`` wrapper of ``CLIPTextModel`` and moved Qwen2.5-VL's towers under ``model``.
ENCODER_BLOCK_LAYOUTS: FrozenMap[str, tuple[tuple[str, ...], ...]] = FrozenMap(
    {
        "T5EncoderModel": (("encoder.block",),),
        "UMT5EncoderModel": (("encoder.block",),),
        "CLIPTextModel": (("encoder.layers",), ("text_model.encoder.layers",)),
        "CLIPTextModelWithProjection": (("text_model.encoder.layers",),),
        "Qwen2_5_VLForConditionalGeneration": (
            ("model.language_model.layers", "model.visual.blocks"),
            ("model.layers", "visual.blocks"),
        ),
        "Qwen2_5_VLModel": (("language_model.layers", "visual.blocks"),),
        "LlamaModel": (("layers",),),
    }
)


_T = TypeVar("_T")


def _entries(value: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple((str(p), str(c)) for p, c in value)


@attrs.frozen(kw_only=True)
class PipelineEntry:
    """The components a diffusers pipeline class holds: ``(attribute path, default class name)``."""

    dits: tuple[tuple[str, str], ...] = attrs.field(converter=_entries)
    encoders: tuple[tuple[str, str], ...] = attrs.field(converter=_entries)
    vaes: tuple[tuple[str, str], ...] = attrs.field(converter=_entries)


_WAN = PipelineEntry(
    dits=(("transformer", "WanTransformer3DModel"), ("transformer_2", "WanTransformer3DModel")),
    encoders=(("text_encoder", "UMT5EncoderModel"),),
    vaes=(("vae", "AutoencoderKLWan"),),
)
_WAN_V2V = PipelineEntry(dits=_WAN.dits[:1], encoders=_WAN.encoders, vaes=_WAN.vaes)


def _single(dit: str, vae: str, *encoders: str) -> PipelineEntry:
    """A pipeline of one DiT at ``transformer``, one VAE at ``vae``, and its text encoders at
    ``text_encoder``, ``text_encoder_2``, ... in that order (diffusers' naming)."""
    paths = ["text_encoder", *(f"text_encoder_{i}" for i in range(2, len(encoders) + 1))]
    return PipelineEntry(
        dits=(("transformer", dit),), encoders=tuple(zip(paths, encoders, strict=True)), vaes=(("vae", vae),)
    )


_FLUX = _single("FluxTransformer2DModel", "AutoencoderKL", "CLIPTextModel", "T5EncoderModel")
_QWEN = _single("QwenImageTransformer2DModel", "AutoencoderKLQwenImage", "Qwen2_5_VLForConditionalGeneration")
_HUNYUAN = _single(
    "HunyuanVideoTransformer3DModel", "AutoencoderKLHunyuanVideo", "LlamaModel", "CLIPTextModel"
)
_SD3 = _single(
    "SD3Transformer2DModel",
    "AutoencoderKL",
    "CLIPTextModelWithProjection",
    "CLIPTextModelWithProjection",
    "T5EncoderModel",
)
_LTX = _single("LTXVideoTransformer3DModel", "AutoencoderKLLTXVideo", "T5EncoderModel")

#: diffusers pipeline class -> the components it holds (checked against diffusers 0.42.1 ``__init__``s).
PIPELINES: FrozenMap[str, PipelineEntry] = FrozenMap(
    {
        "WanPipeline": _WAN,
        "WanImageToVideoPipeline": _WAN,
        "WanVideoToVideoPipeline": _WAN_V2V,
        "FluxPipeline": _FLUX,
        "FluxImg2ImgPipeline": _FLUX,
        "FluxInpaintPipeline": _FLUX,
        "QwenImagePipeline": _QWEN,
        "QwenImageImg2ImgPipeline": _QWEN,
        "QwenImageInpaintPipeline": _QWEN,
        "HunyuanVideoPipeline": _HUNYUAN,
        "StableDiffusion3Pipeline": _SD3,
        "StableDiffusion3Img2ImgPipeline": _SD3,
        "StableDiffusion3InpaintPipeline": _SD3,
        "LTXPipeline": _LTX,
        "LTXImageToVideoPipeline": _LTX,
        "LTXConditionPipeline": _LTX,
    }
)


def _lookup(table: Mapping[str, _T], key: str | type) -> _T | None:
    """``table``'s entry for a class name, or for a class: its own name, else its nearest base's."""
    if isinstance(key, str):
        return table.get(key)
    for base in key.__mro__:
        found = table.get(base.__name__)
        if found is not None:
            return found
    return None


def block_attrs_for(model_class: str | type) -> tuple[str, ...] | None:
    """The block attributes of a known diffusers DiT class (one ring), or None.

    ``model_class`` is a class name (exact match) or a class: then a subclass of a known class (a
    variant defined by a user or a pipeline) inherits its base's entry.
    """
    return _lookup(DIT_BLOCK_ATTRS, model_class)


def encoder_block_layouts_for(class_name: str | type) -> tuple[tuple[str, ...], ...]:
    """Every known block layout of the text-encoder class ``class_name``, newest first (may be empty).

    Only the first (newest) layout is declared for a known pipeline (`encoder_block_attrs_for`); on
    an older transformers layout its paths are not found and `resolve` reports the encoder's
    problems (errors when strict, warnings otherwise).
    """
    return _lookup(ENCODER_BLOCK_LAYOUTS, class_name) or ()


def encoder_block_attrs_for(class_name: str | type) -> tuple[str, ...] | None:
    """The block paths (each its own ring) of ``class_name`` under transformers 5.x, or None."""
    layouts = encoder_block_layouts_for(class_name)
    return layouts[0] if layouts else None


def pipeline_components(pipeline_class: str | type) -> tuple[tuple[str, ComponentKind], ...] | None:
    """``(path, kind)`` of every DiT, encoder and VAE the pipeline class holds, in pipeline order.

    ``pipeline_class`` is a class name, or a class (a subclass of a known pipeline matches it).
    """
    entry = _lookup(PIPELINES, pipeline_class)
    if entry is None:
        return None
    dits: tuple[tuple[str, ComponentKind], ...] = tuple((p, "dit") for p, _ in entry.dits)
    encoders: tuple[tuple[str, ComponentKind], ...] = tuple((p, "encoder") for p, _ in entry.encoders)
    vaes: tuple[tuple[str, ComponentKind], ...] = tuple((p, "vae") for p, _ in entry.vaes)
    return dits + encoders + vaes


def declaration_for_pipeline(
    pipeline_class: str | type, component_paths: Iterable[str] | Mapping[str, str]
) -> Declaration | None:
    """The `Declaration` of a known diffusers pipeline class, or None for an unknown class.

    ``component_paths`` are the components the pipeline object actually holds (a Wan2.1 pipeline has
    no ``transformer_2``), either as paths or as a mapping path -> class name of the module found
    there; a class name overrides the pipeline's default class when looking up block attributes.
    Every present DiT may keep resident blocks; every present text encoder is a ``text_encoder``
    selector, streams its known block paths, and is declared replicated (diffusers loads each encoder
    whole on every rank, so its weights are identical across the shard group).
    """
    entry = _lookup(PIPELINES, pipeline_class)
    if entry is None:
        return None
    if isinstance(component_paths, Mapping):
        found: dict[str, str] = {str(p): str(c) for p, c in component_paths.items()}
    else:
        found = {str(p): "" for p in component_paths}
    block_attrs: dict[str, tuple[str, ...]] = {}
    resident: list[str] = []
    for path, default in entry.dits:
        if path not in found:
            continue
        resident.append(path)
        attrs_ = block_attrs_for(found[path] or default)
        if attrs_ is not None:
            block_attrs[path] = attrs_
    types: dict[str, str] = {}
    encoder_blocks: dict[str, tuple[str, ...]] = {}
    for path, default in entry.encoders:
        if path not in found:
            continue
        types[path] = "text_encoder"
        paths = encoder_block_attrs_for(found[path] or default)
        if paths is not None:
            encoder_blocks[path] = paths
    return Declaration(
        block_attrs=block_attrs,
        resident_dit_paths=resident,
        encoder_component_types=types,
        encoder_block_attrs=encoder_blocks,
        encoder_dlo_weight_replication=tuple(types),
    )
