"""Topologies of known public models, built from their published config values (no download).

The tensor specs under ``known/`` were generated once by ``tools/gen_known_specs.py``, which builds
every component with diffusers / transformers on the meta device in the dtypes
``from_pretrained(torch_dtype=torch.bfloat16)`` really leaves them in: bf16, except the parameters
a diffusers class keeps in fp32 (Wan's ``_keep_in_fp32_modules``), persistent buffers as loaded
(SD3.5's positional table in bf16) and non-persistent buffers as constructed. Reading them needs
neither package. Tensor names are qualified from the pipeline root (``transformer.blocks.0.ffn.net.0
.proj.weight``); a tied weight is one spec whose ``aliases`` name the other bindings.
"""

from __future__ import annotations

import functools
import gzip
import json
from collections.abc import Iterable
from importlib import resources
from typing import Any, Literal

import attrs

from torchferry._errors import PlanError
from torchferry.topology._frozen import FrozenMap
from torchferry.topology._model import (
    Block,
    Component,
    ComponentKind,
    Stack,
    TensorSpec,
    Topology,
    join_path,
)
from torchferry.topology._registry import declaration_for_pipeline

__all__ = [
    "HUB_IDS",
    "KNOWN_ALIASES",
    "KNOWN_MODELS",
    "KnownComponent",
    "KnownModel",
    "Resolution",
    "hub_model_id",
    "known_model",
    "known_topology",
]

_FORMAT_VERSION = 1

#: Known model ids, in the order ``torchferry plan --list`` shows them.
KNOWN_MODELS: tuple[str, ...] = (
    "wan2.1-t2v-14b",
    "wan2.2-t2v-a14b",
    "wan2.1-t2v-1.3b",
    "wan2.2-ti2v-5b",
    "flux.1-dev",
    "qwen-image",
    "hunyuanvideo",
    "sd3.5-large",
    "ltx-video-2b",
    "ltx-video-13b-0.9.7",
)

# alias -> (known id, {component path: variant of that id's shipped data that replaces it})
_ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    "ltx-video-2b-0.9.1": ("ltx-video-2b", {"vae": "vae@0.9.1"}),
    "ltx-video-2b-0.9.5": ("ltx-video-2b", {"vae": "vae@0.9.5"}),
}

#: Alias -> the known id it is a variant of (same DiT and encoders, another VAE release).
KNOWN_ALIASES: FrozenMap[str, str] = FrozenMap({alias: base for alias, (base, _) in _ALIASES.items()})


#: Hugging Face hub repository ids -> the known id whose shipped specs they hold (matched case-insensitively).
HUB_IDS: FrozenMap[str, str] = FrozenMap(
    {
        "Wan-AI/Wan2.1-T2V-14B-Diffusers": "wan2.1-t2v-14b",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers": "wan2.2-t2v-a14b",
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "wan2.1-t2v-1.3b",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": "wan2.2-ti2v-5b",
        "black-forest-labs/FLUX.1-dev": "flux.1-dev",
        "Qwen/Qwen-Image": "qwen-image",
        "hunyuanvideo-community/HunyuanVideo": "hunyuanvideo",
        "stabilityai/stable-diffusion-3.5-large": "sd3.5-large",
        "Lightricks/LTX-Video": "ltx-video-2b",
        "Lightricks/LTX-Video-0.9.1": "ltx-video-2b-0.9.1",
        "Lightricks/LTX-Video-0.9.5": "ltx-video-2b-0.9.5",
        "Lightricks/LTX-Video-0.9.7-dev": "ltx-video-13b-0.9.7",
    }
)
_HUB_LOWER = {repo.lower(): model for repo, model in HUB_IDS.items()}


def hub_model_id(repo_id: str) -> str | None:
    """The known id the hub repository ``repo_id`` holds (case-insensitive), or ``None``."""
    return _HUB_LOWER.get(repo_id.strip().lower())


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value}")


@attrs.frozen(kw_only=True)
class Resolution:
    """An output size: ``height`` x ``width`` pixels and ``frames`` (1 for an image model)."""

    height: int = attrs.field(validator=_positive)
    width: int = attrs.field(validator=_positive)
    frames: int = attrs.field(default=1, validator=_positive)

    def __str__(self) -> str:
        size = f"{self.width}x{self.height}"
        return size if self.frames == 1 else f"{size}x{self.frames}f"


@attrs.frozen(kw_only=True)
class KnownComponent:
    """One component of a known pipeline: its attribute path, kind and class."""

    path: str
    kind: ComponentKind
    class_name: str
    library: str


def _components(value: Iterable[KnownComponent]) -> tuple[KnownComponent, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class KnownModel:
    """The facts about a known model that planning and step-time estimates need.

    The DiT's blocks come in two families, which fixes the FLOPs formula of `block_flops`:
    ``"cross"`` (Wan, LTX: self-attention over the latent tokens, cross-attention to the text,
    feed-forward on the latent tokens) and ``"joint"`` (Flux, Qwen-Image, HunyuanVideo, SD3: one
    attention over latent and text tokens together, projections and feed-forward on both).
    ``forwards_per_step`` is how many DiT forwards one denoising step makes at the pipeline's
    defaults (sequential classifier-free guidance makes two, each streaming the ring again);
    ``batch_per_forward`` is the batch of each forward (batched guidance doubles it).
    For a two-expert model (Wan2.2 A14B) ``high_noise_dit`` runs while the timestep is at or above
    ``boundary_ratio`` x 1000 and ``low_noise_dit`` below it.
    """

    id: str
    pipeline_class: str
    hf_repo: str
    components: tuple[KnownComponent, ...] = attrs.field(converter=_components)
    family: Literal["cross", "joint"]
    hidden_size: int
    num_heads: int
    head_dim: int
    ffn_dim: int
    num_blocks: int
    text_tokens: int
    resolution: Resolution
    vae_compression: tuple[int, int]
    patch_size: tuple[int, int, int]
    forwards_per_step: int = 1
    batch_per_forward: int = 1
    last_block_context_pre_only: bool = False
    boundary_ratio: float | None = None
    high_noise_dit: str | None = None
    low_noise_dit: str | None = None

    @property
    def dit_paths(self) -> tuple[str, ...]:
        return tuple(c.path for c in self.components if c.kind == "dit")

    def tokens(self, resolution: Resolution | None = None) -> int:
        """Latent tokens one DiT forward attends over at ``resolution`` (default: `resolution`)."""
        res = resolution or self.resolution
        t_vae, s_vae = self.vae_compression
        p_t, p_h, p_w = self.patch_size
        latent_frames = (res.frames - 1) // t_vae + 1
        return (latent_frames // p_t) * (res.height // s_vae // p_h) * (res.width // s_vae // p_w)

    def block_flops(
        self, resolution: Resolution | None = None, *, text_tokens: int | None = None
    ) -> tuple[int, ...]:
        """Forward FLOPs (2 per multiply-add) of each DiT block, in ring order, for a batch of one.

        Counts the matrix products of projections, feed-forward and attention; elementwise work and
        the per-sample modulation projections are left out. At the default `resolution` and
        `text_tokens` unless ``resolution`` or ``text_tokens`` is given.
        """
        n = self.tokens(resolution)
        text = self.text_tokens if text_tokens is None else text_tokens
        d = self.hidden_size
        f = self.ffn_dim
        if self.family == "cross":
            one = 2 * n * (6 * d * d + 2 * d * f) + 4 * text * d * d + 4 * n * n * d + 4 * n * text * d
            return (one,) * self.num_blocks
        joint = n + text
        one = 2 * joint * (4 * d * d + 2 * d * f) + 4 * joint * joint * d
        flops = [one] * self.num_blocks
        if self.last_block_context_pre_only:
            flops[-1] = 2 * n * (4 * d * d + 2 * d * f) + 2 * text * 3 * d * d + 4 * joint * joint * d
        return tuple(flops)

    def step_flops(self, resolution: Resolution | None = None) -> int:
        """DiT block FLOPs of one denoising step: all forwards, whole batch."""
        return sum(self.block_flops(resolution)) * self.batch_per_forward * self.forwards_per_step

    def dit_for_timestep(self, timestep: float, num_train_timesteps: int = 1000) -> str:
        """The DiT that denoises at ``timestep`` (the high-noise expert at or above the boundary)."""
        if self.boundary_ratio is None or self.high_noise_dit is None or self.low_noise_dit is None:
            return self.dit_paths[0]
        if timestep >= self.boundary_ratio * num_train_timesteps:
            return self.high_noise_dit
        return self.low_noise_dit


# Published architecture facts (the config values in the shipped data) and each pipeline's defaults
# in diffusers 0.42.1: its call's height/width/num_frames, max_sequence_length, guidance mode.
_WAN_14B: dict[str, Any] = dict(
    family="cross", hidden_size=5120, num_heads=40, head_dim=128, ffn_dim=13824, num_blocks=40,
    text_tokens=512, resolution=Resolution(height=720, width=1280, frames=81),
    vae_compression=(4, 8), patch_size=(1, 2, 2), forwards_per_step=2,
)
_JOINT_3072: dict[str, Any] = dict(
    family="joint", hidden_size=3072, num_heads=24, head_dim=128, ffn_dim=12288,
    vae_compression=(1, 8), patch_size=(1, 2, 2),
)
_FACTS: dict[str, dict[str, Any]] = {
    "wan2.1-t2v-14b": _WAN_14B,
    "wan2.2-t2v-a14b": dict(
        _WAN_14B, boundary_ratio=0.875, high_noise_dit="transformer", low_noise_dit="transformer_2"
    ),
    "wan2.1-t2v-1.3b": dict(
        _WAN_14B, hidden_size=1536, num_heads=12, ffn_dim=8960, num_blocks=30,
        resolution=Resolution(height=480, width=832, frames=81),
    ),
    "wan2.2-ti2v-5b": dict(
        _WAN_14B, hidden_size=3072, num_heads=24, ffn_dim=14336, num_blocks=30,
        resolution=Resolution(height=704, width=1280, frames=121), vae_compression=(4, 16),
    ),
    "flux.1-dev": dict(
        _JOINT_3072, num_blocks=57, text_tokens=512, resolution=Resolution(height=1024, width=1024)
    ),
    "qwen-image": dict(
        _JOINT_3072, num_blocks=60, text_tokens=512, resolution=Resolution(height=1024, width=1024)
    ),
    "hunyuanvideo": dict(
        _JOINT_3072, num_blocks=60, text_tokens=256, vae_compression=(4, 8),
        resolution=Resolution(height=720, width=1280, frames=129),
    ),
    "sd3.5-large": dict(
        family="joint", hidden_size=2432, num_heads=38, head_dim=64, ffn_dim=9728, num_blocks=38,
        text_tokens=77 + 256, resolution=Resolution(height=1024, width=1024), vae_compression=(1, 8),
        patch_size=(1, 2, 2), batch_per_forward=2, last_block_context_pre_only=True,
    ),
    "ltx-video-2b": dict(
        family="cross", hidden_size=2048, num_heads=32, head_dim=64, ffn_dim=8192, num_blocks=28,
        text_tokens=128, resolution=Resolution(height=512, width=704, frames=161), vae_compression=(8, 32),
        patch_size=(1, 1, 1), batch_per_forward=2,
    ),
    "ltx-video-13b-0.9.7": dict(
        family="cross", hidden_size=4096, num_heads=32, head_dim=128, ffn_dim=16384, num_blocks=48,
        text_tokens=256, resolution=Resolution(height=512, width=704, frames=161), vae_compression=(8, 32),
        patch_size=(1, 1, 1), batch_per_forward=2,
    ),
}


def _resolve_id(model_id: str) -> tuple[str, str, dict[str, str]]:
    """``(id as asked, known id, variant overrides)``; an unknown id is a `PlanError`."""
    key = model_id.strip().lower()
    key = _HUB_LOWER.get(key, key)
    if key in KNOWN_MODELS:
        return key, key, {}
    if key in _ALIASES:
        base, variants = _ALIASES[key]
        return key, base, variants
    aliases = ", ".join(f"{a} ({b})" for a, b in KNOWN_ALIASES.items())
    raise PlanError(
        f"unknown model id {model_id!r}: torchferry knows {', '.join(KNOWN_MODELS)}; "
        f"aliases: {aliases}. Pass one of these ids or their hub ids (black-forest-labs/FLUX.1-dev; "
        "torchferry plan --list shows them), a diffusers pipeline folder, or a safetensors file, folder or "
        "*.index.json."
    )


@functools.cache
def _document(model_id: str) -> dict[str, Any]:
    folder = resources.files("torchferry.topology").joinpath("known")
    data = folder.joinpath(f"{model_id}.json.gz").read_bytes()
    doc: dict[str, Any] = json.loads(gzip.decompress(data))
    if doc.get("format") != _FORMAT_VERSION or doc.get("id") != model_id:
        raise PlanError(
            f"shipped tensor specs of {model_id!r} have format {doc.get('format')!r} for id "
            f"{doc.get('id')!r}, expected format {_FORMAT_VERSION}; reinstall torchferry"
        )
    return doc


def _component_docs(model_id: str) -> list[dict[str, Any]]:
    _, base, variants = _resolve_id(model_id)
    doc = _document(base)
    out = []
    for comp in doc["components"]:
        variant = variants.get(comp["path"])
        out.append(doc["variants"][variant] if variant else comp)
    return out


def _spec(prefix: str, raw: list[Any]) -> TensorSpec:
    name, shape, dtype, flag, aliases = raw
    return TensorSpec(
        name=join_path(prefix, name),
        shape=shape,
        dtype=dtype,
        buffer=flag != 0,
        persistent=flag != 2,
        aliases=tuple(join_path(prefix, a) for a in aliases),
    )


def _component(comp: dict[str, Any]) -> Component:
    path: str = comp["path"]
    templates: list[list[list[Any]]] = comp["templates"]
    stacks = []
    for stack in comp["stacks"]:
        blocks = []
        for attr, index, template in stack["blocks"]:
            block_path = join_path(path, f"{attr}.{index}")
            blocks.append(Block(path=block_path, tensors=[_spec(block_path, t) for t in templates[template]]))
        stacks.append(Stack(attrs=tuple(stack["attrs"]), blocks=blocks))
    return Component(
        path=path,
        kind=comp["kind"],
        class_name=comp["class"],
        tensors=[_spec(path, t) for t in comp["rest"]],
        stacks=stacks,
    )


@functools.cache
def _topology(key: str) -> Topology:
    _, base, _ = _resolve_id(key)
    comps = _component_docs(key)
    pipeline_class: str = _document(base)["pipeline_class"]
    declaration = declaration_for_pipeline(pipeline_class, {c["path"]: c["class"] for c in comps})
    return Topology(
        pipeline_class=pipeline_class,
        components=[_component(c) for c in comps],
        declaration=declaration,
        declares_components=True,
        source=f"known:{key}",
    )


def known_topology(model_id: str) -> Topology:
    """The exact topology of the known public model ``model_id`` (tensor shapes and dtypes as loaded).

    ``model_id`` is one of `KNOWN_MODELS`, `KNOWN_ALIASES` or `HUB_IDS` (case-insensitive); anything
    else is a `PlanError` that lists them.
    """
    key, _, _ = _resolve_id(model_id)
    return _topology(key)


@functools.cache
def _model(key: str) -> KnownModel:
    _, base, _ = _resolve_id(key)
    doc = _document(base)
    components = tuple(
        KnownComponent(path=c["path"], kind=c["kind"], class_name=c["class"], library=c["library"])
        for c in _component_docs(key)
    )
    return KnownModel(
        id=key,
        pipeline_class=doc["pipeline_class"],
        hf_repo=doc["hf_repo"],
        components=components,
        **_FACTS[base],
    )


def known_model(model_id: str) -> KnownModel:
    """The planning facts of the known public model ``model_id`` (see `known_topology` for ids)."""
    key, _, _ = _resolve_id(model_id)
    return _model(key)
