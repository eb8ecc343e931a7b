"""`infer_gguf_model`: the diffusers class and configuration a GGUF file was made from, from its header.

GGUF files of diffusion models are published one per quantization and without a ``config.json``
(city96's ``flux1-dev-Q4_K_S.gguf``, the Wan2.x files). diffusers' single-file loader recognises a
checkpoint by a few marker tensors (``infer_diffusers_model_type`` in
``diffusers/loaders/single_file_utils.py``: ``head.modulation`` for Wan,
``double_blocks.0.img_attn.norm.key_norm.scale`` for FLUX) and then downloads the matching hub
configuration; ComfyUI's ``model_detection.py`` reads the widths and depths from tensor shapes
instead. Here, offline, each layout torchferry knows is a set of marker tensors under one naming
(the original repository's, or diffusers') and a pure function from the file's logical shapes to the
configuration: depths from the highest block index, widths from the shapes. What no tensor shows
(Wan's head width, the norms' epsilon, the rotary table's length, FLUX's rotary axes) is the value
every known model of that class has (``torchferry/topology/known``, from the published configs).

The configuration is then checked like a given one (`check_gguf_fits`): the model it builds must
have every tensor of the file at the file's shape.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from torchferry._errors import Flag, PlanError
from torchferry.topology._gguf import GGUFEntry

__all__ = ["GGUF_LAYOUTS", "GGUFLayout", "InferredModel", "infer_gguf_model"]

Shapes = Mapping[str, tuple[int, ...]]
#: The prefix some conversions put before every name (ComfyUI's state dicts); stripped here.
_PREFIX = "model.diffusion_model."

#: What to do when no layout matches: name the configuration, in the API's and the CLI's words.
GIVE_CONFIG = Flag(
    "pass config= (the model's diffusers folder, e.g. transformer/, or its configuration as a dict) and "
    "the model class",
    "put the model's config.json (from its diffusers folder, e.g. transformer/config.json) beside it",
)


@attrs.frozen(kw_only=True)
class InferredModel:
    """What a GGUF file's header says it is: a diffusers class, its configuration (as a
    ``config.json`` holds it) and the layout it was recognised by."""

    class_name: str
    config: dict[str, Any] = attrs.field(hash=False)
    layout: str


@attrs.frozen(kw_only=True)
class GGUFLayout:
    """One way a model's tensors are named in GGUF files: the class, the naming, the tensors that
    mark it (all present), and the configuration read from the file's shapes."""

    class_name: str
    naming: str
    markers: tuple[str, ...]
    infer: Callable[[Shapes], dict[str, Any]]

    @property
    def name(self) -> str:
        return f"{self.class_name} ({self.naming})"


def _count(shapes: Shapes, prefix: str) -> int:
    """Blocks in the numbered list ``prefix``: its highest index plus one, every index below it
    present (a gap, or a hostile index such as ``blocks.99999999``, would build blocks the file
    does not hold)."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    found = {int(m.group(1)) for name in shapes if (m := pattern.match(name))}
    if not found:
        raise ValueError(f"it has no tensor under {prefix}.0.")
    if len(found) != max(found) + 1:
        lacking = next(i for i in itertools.count() if i not in found)
        raise ValueError(
            f"its {prefix} run to index {max(found)} but {prefix}.{lacking} is not there "
            f"({len(found)} blocks in all)"
        )
    return len(found)


#: What each rank of tensor read by a layout is, for the words of a refusal.
_RANKS = {1: "a vector", 2: "a linear layer's weight", 3: "a table", 5: "a 3-d convolution's weight"}


def _shape(shapes: Shapes, name: str, rank: int) -> tuple[int, ...]:
    """The shape of tensor ``name``, which must have ``rank`` dimensions; else a ``ValueError`` naming
    the tensor, its shape and what was expected (an index out of range here would say neither)."""
    shape = tuple(shapes[name])
    if len(shape) != rank:
        raise ValueError(
            f"tensor {name!r} has shape {list(shape)}, and {rank} dimension{'s' if rank > 1 else ''} "
            f"were expected ({_RANKS[rank]})"
        )
    return shape


def _positive(config: dict[str, Any]) -> dict[str, Any]:
    """``config``, once every width and count read from a shape is positive (a zero dimension reads as
    an empty model that fails at its first forward, not here)."""
    for key, value in config.items():
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, int) and not isinstance(v, bool) and v <= 0 for v in values):
            raise ValueError(f"its tensors give {key}={value!r}, and a width or count must be positive")
    return config


def _divide(total: int, part: int, what: str) -> int:
    if part <= 0 or total <= 0 or total % part:
        raise ValueError(f"{what}: {total} is not a positive multiple of {part}")
    return total // part


#: Wan's head width and the values no tensor shows, as every known Wan model has them
#: (wan2.1-t2v-1.3b/14b, wan2.2-ti2v-5b, wan2.2-t2v-a14b).
_WAN_HEAD_DIM = 128
_WAN_FIXED: dict[str, Any] = {"eps": 1e-06, "rope_max_seq_len": 1024}


def _wan(names: Mapping[str, str]) -> Callable[[Shapes], dict[str, Any]]:
    """The Wan configuration from shapes, the roles named as ``names`` gives them."""

    def infer(shapes: Shapes) -> dict[str, Any]:
        inner, in_channels, *patch = _shape(shapes, "patch_embedding.weight", 5)
        cells = 1
        for p in patch:
            cells *= p
        image = _shape(shapes, names["image"], 1) if names["image"] in shapes else None
        added = _shape(shapes, names["added_k"], 2) if names["added_k"] in shapes else None
        position = _shape(shapes, names["position"], 3) if names["position"] in shapes else None
        return {
            "patch_size": tuple(patch),
            "num_attention_heads": _divide(inner, _WAN_HEAD_DIM, "the width over Wan's head width"),
            "attention_head_dim": _WAN_HEAD_DIM,
            "in_channels": in_channels,
            "out_channels": _divide(
                _shape(shapes, names["out"], 2)[0], cells, "the head's rows over the patch"
            ),
            "text_dim": _shape(shapes, names["text"], 2)[1],
            "freq_dim": _shape(shapes, names["time"], 2)[1],
            "ffn_dim": _shape(shapes, names["ffn"], 2)[0],
            "num_layers": _count(shapes, "blocks"),
            "cross_attn_norm": names["cross_norm"] in shapes,
            "qk_norm": "rms_norm_across_heads" if names["qk_norm"] in shapes else None,
            "image_dim": None if image is None else image[0],
            "added_kv_proj_dim": None if added is None else added[1],
            "pos_embed_seq_len": None if position is None else position[1],
            **_WAN_FIXED,
        }

    return infer


#: FLUX's rotary axes for its head width, as FLUX.1 has them (the only known head width).
_FLUX_AXES = {128: (16, 56, 56)}


def _flux(names: Mapping[str, str]) -> Callable[[Shapes], dict[str, Any]]:
    """The FLUX configuration from shapes, the roles named as ``names`` gives them."""

    def infer(shapes: Shapes) -> dict[str, Any]:
        inner, in_channels = _shape(shapes, names["image_in"], 2)
        (head,) = _shape(shapes, names["query_norm"], 1)
        if head not in _FLUX_AXES:
            raise ValueError(f"a head width of {head}, for which no known FLUX model has rotary axes")
        out = _shape(shapes, names["out"], 2)[0]
        return {
            "patch_size": 1,
            "in_channels": in_channels,
            "out_channels": None if out == in_channels else out,
            "num_layers": _count(shapes, names["double"]),
            "num_single_layers": _count(shapes, names["single"]),
            "attention_head_dim": head,
            "num_attention_heads": _divide(inner, head, "the width over the head width"),
            "joint_attention_dim": _shape(shapes, names["text_in"], 2)[1],
            "pooled_projection_dim": _shape(shapes, names["pooled_in"], 2)[1],
            "guidance_embeds": names["guidance"] in shapes,
            "axes_dims_rope": _FLUX_AXES[head],
        }

    return infer


_WAN_ORIGINAL = {
    "out": "head.head.weight",
    "text": "text_embedding.0.weight",
    "time": "time_embedding.0.weight",
    "ffn": "blocks.0.ffn.0.weight",
    "cross_norm": "blocks.0.norm3.weight",
    "qk_norm": "blocks.0.self_attn.norm_q.weight",
    "image": "img_emb.proj.0.weight",
    "added_k": "blocks.0.cross_attn.k_img.weight",
    "position": "img_emb.emb_pos",
}
_WAN_DIFFUSERS = {
    "out": "proj_out.weight",
    "text": "condition_embedder.text_embedder.linear_1.weight",
    "time": "condition_embedder.time_embedder.linear_1.weight",
    "ffn": "blocks.0.ffn.net.0.proj.weight",
    "cross_norm": "blocks.0.norm2.weight",
    "qk_norm": "blocks.0.attn1.norm_q.weight",
    "image": "condition_embedder.image_embedder.norm1.weight",
    "added_k": "blocks.0.attn2.add_k_proj.weight",
    "position": "condition_embedder.image_embedder.pos_embed",
}
_FLUX_ORIGINAL = {
    "image_in": "img_in.weight",
    "text_in": "txt_in.weight",
    "pooled_in": "vector_in.in_layer.weight",
    "guidance": "guidance_in.in_layer.weight",
    "query_norm": "double_blocks.0.img_attn.norm.query_norm.scale",
    "out": "final_layer.linear.weight",
    "double": "double_blocks",
    "single": "single_blocks",
}
_FLUX_DIFFUSERS = {
    "image_in": "x_embedder.weight",
    "text_in": "context_embedder.weight",
    "pooled_in": "time_text_embed.text_embedder.linear_1.weight",
    "guidance": "time_text_embed.guidance_embedder.linear_1.weight",
    "query_norm": "transformer_blocks.0.attn.norm_q.weight",
    "out": "proj_out.weight",
    "double": "transformer_blocks",
    "single": "single_transformer_blocks",
}

#: The layouts tried, in order.
GGUF_LAYOUTS: tuple[GGUFLayout, ...] = (
    GGUFLayout(
        class_name="WanTransformer3DModel",
        naming="Wan's original names",
        markers=("head.modulation", "patch_embedding.weight", "blocks.0.self_attn.q.weight"),
        infer=_wan(_WAN_ORIGINAL),
    ),
    GGUFLayout(
        class_name="WanTransformer3DModel",
        naming="diffusers' names",
        markers=("scale_shift_table", "patch_embedding.weight", "blocks.0.attn1.to_q.weight"),
        infer=_wan(_WAN_DIFFUSERS),
    ),
    GGUFLayout(
        class_name="FluxTransformer2DModel",
        naming="BFL's names",
        markers=(
            "double_blocks.0.img_attn.norm.key_norm.scale",
            "img_in.weight",
            "single_blocks.0.linear1.weight",
        ),
        infer=_flux(_FLUX_ORIGINAL),
    ),
    GGUFLayout(
        class_name="FluxTransformer2DModel",
        naming="diffusers' names",
        markers=(
            "x_embedder.weight",
            "transformer_blocks.0.attn.norm_added_k.weight",
            "single_transformer_blocks.0.proj_mlp.weight",
        ),
        infer=_flux(_FLUX_DIFFUSERS),
    ),
)


def infer_gguf_model(
    file: str, entries: Iterable[GGUFEntry], layouts: Iterable[GGUFLayout] = GGUF_LAYOUTS
) -> InferredModel:
    """The class and configuration of the model the GGUF ``file`` (its header ``entries``) fills.

    The first of ``layouts`` whose markers are all in the file names the class; its configuration is
    read from the logical shapes (see the module's notes). A file no layout matches, or whose shapes
    a matching layout cannot read, is a `PlanError` naming the layouts and markers looked for.
    """
    shapes = {e.name: e.logical_shape for e in entries}
    if shapes and all(n.startswith(_PREFIX) for n in shapes):
        shapes = {n.removeprefix(_PREFIX): s for n, s in shapes.items()}
    tried = tuple(layouts)
    for layout in tried:
        if not all(m in shapes for m in layout.markers):
            continue
        try:
            config = _positive(layout.infer(shapes))
        except (KeyError, ValueError, IndexError) as exc:
            why = f"it has no tensor {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
            raise PlanError.worded(
                f"{file}: its tensors are named as {layout.name} files are, but its configuration "
                f"cannot be read from them ({why}); ",
                GIVE_CONFIG,
            ) from None
        return InferredModel(class_name=layout.class_name, config=config, layout=layout.name)
    looked = "; ".join(f"{t.name}: {', '.join(t.markers)}" for t in tried)
    theirs = ", ".join(repr(n) for n in list(shapes)[:3]) or "none"
    raise PlanError.worded(
        f"{file}: a GGUF file does not say which model it fills, and its tensors (named like {theirs}) "
        f"match none of the layouts torchferry infers one from ({looked}); ",
        GIVE_CONFIG,
    )
