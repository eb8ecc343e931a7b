"""A tiny diffusers ``FluxTransformer2DModel`` written as a GGUF file under FLUX's original (BFL) names,
as city96's FLUX files name them: the attention's q, k and v fused into one ``qkv`` weight (and
``linear1`` holding q, k, v and the MLP's input in a single block), the final modulation's halves
in BFL's (shift, scale) order. diffusers' single-file conversion splits them back by rows.

diffusers' FLUX conversion hard-codes FLUX.1's width (3072) where it splits a single block's
``linear1``; `scaled_conversion` runs it with those split sizes scaled to the tiny model's width (the
only change), for diffusers' load and torchferry's alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import gguf_files
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: Width 256 (2 heads of 128), so Linear rows hold whole K-quant blocks; 2 double and 2 single blocks.
FLUX_GGUF: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 128,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}

Q = gguf.GGMLQuantizationType
CYCLE = (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q4_0, Q.BF16)


def flux(config: dict[str, Any] | None = None) -> nn.Module:
    """The float32 model the file is written from (seeded)."""
    import diffusers

    torch.manual_seed(0)
    model: nn.Module = diffusers.FluxTransformer2DModel(**(config or FLUX_GGUF)).eval()
    return model


def _swap(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first])


def original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (diffusers' names) under BFL's names: the inverse of diffusers' FLUX conversion."""
    s = dict(state)
    out: dict[str, torch.Tensor] = {}

    def move(new: str, old: str) -> None:
        for leaf in ("weight", "bias"):
            if f"{new}.{leaf}" in s:
                out[f"{old}.{leaf}"] = s.pop(f"{new}.{leaf}")

    for new, old in (
        ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
        ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
        ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
        ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
        ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
        ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
        ("context_embedder", "txt_in"),
        ("x_embedder", "img_in"),
        ("proj_out", "final_layer.linear"),
    ):
        move(new, old)
    for leaf in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{leaf}"] = _swap(s.pop(f"norm_out.linear.{leaf}"))
    double = {k.split(".")[1] for k in s if k.startswith("transformer_blocks.")}
    for i in sorted(double, key=int):
        p, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        move(p + "norm1.linear", o + "img_mod.lin")
        move(p + "norm1_context.linear", o + "txt_mod.lin")
        for leaf in ("weight", "bias"):
            out[f"{o}img_attn.qkv.{leaf}"] = torch.cat([s.pop(f"{p}attn.to_{x}.{leaf}") for x in "qkv"])
            out[f"{o}txt_attn.qkv.{leaf}"] = torch.cat([s.pop(f"{p}attn.add_{x}_proj.{leaf}") for x in "qkv"])
        for new, old in (
            ("norm_q", "img_attn.norm.query_norm"),
            ("norm_k", "img_attn.norm.key_norm"),
            ("norm_added_q", "txt_attn.norm.query_norm"),
            ("norm_added_k", "txt_attn.norm.key_norm"),
        ):
            out[f"{o}{old}.scale"] = s.pop(f"{p}attn.{new}.weight")
        move(p + "ff.net.0.proj", o + "img_mlp.0")
        move(p + "ff.net.2", o + "img_mlp.2")
        move(p + "ff_context.net.0.proj", o + "txt_mlp.0")
        move(p + "ff_context.net.2", o + "txt_mlp.2")
        move(p + "attn.to_out.0", o + "img_attn.proj")
        move(p + "attn.to_add_out", o + "txt_attn.proj")
    single = {k.split(".")[1] for k in s if k.startswith("single_transformer_blocks.")}
    for i in sorted(single, key=int):
        p, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        move(p + "norm.linear", o + "modulation.lin")
        for leaf in ("weight", "bias"):
            parts = [s.pop(f"{p}attn.to_{x}.{leaf}") for x in "qkv"] + [s.pop(f"{p}proj_mlp.{leaf}")]
            out[f"{o}linear1.{leaf}"] = torch.cat(parts)
        out[f"{o}norm.query_norm.scale"] = s.pop(f"{p}attn.norm_q.weight")
        out[f"{o}norm.key_norm.scale"] = s.pop(f"{p}attn.norm_k.weight")
        move(p + "proj_out", o + "linear2")
    assert not s, sorted(s)
    return out


def quant_type(name: str, tensor: torch.Tensor, index: int) -> Any:
    """A 2-d weight with rows of whole K-quant blocks cycles through `CYCLE`; the rest F32."""
    if name.endswith(".weight") and tensor.dim() == 2 and tensor.shape[1] % 256 == 0:
        return CYCLE[index % len(CYCLE)]
    return Q.F32


def write(path: Path, model: nn.Module) -> dict[str, Any]:
    """``model`` as a GGUF file under BFL's names; returns each stored name's type."""
    return gguf_files.write_tensors(path, "flux", original(model.state_dict()), quant_type)


def config_folder(path: Path, config: dict[str, Any] | None = None) -> Path:
    """A folder holding the model's ``config.json``."""
    return gguf_files.config_folder(path, config or FLUX_GGUF, class_name="FluxTransformer2DModel")


class _Scaled(TorchFunctionMode):
    """``torch.split`` of a single block's ``linear1`` at FLUX.1's sizes, at the tensor's own width."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.split and len(args) > 1 and tuple(args[1]) == (3072, 3072, 3072, 12288):
            width = args[0].shape[0] // 7
            args = (args[0], (width, width, width, 4 * width), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def scaled_conversion() -> Iterator[None]:
    """diffusers' FLUX conversion with its single-block split scaled (see the module notes)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"]
    convert = entry["checkpoint_mapping_fn"]

    def scaled(*args: Any, **kwargs: Any) -> Any:
        with _Scaled():
            return convert(*args, **kwargs)

    entry["checkpoint_mapping_fn"] = scaled
    try:
        yield
    finally:
        entry["checkpoint_mapping_fn"] = convert


def inputs() -> dict[str, torch.Tensor]:
    """The model's inputs (seeded): a 4x4 latent of 16 channels, 3 text tokens."""
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, 3, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(3, 3),
    }


def call(model: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One forward of ``model`` on `inputs`."""
    given = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs().items()}
    with torch.no_grad():
        out: torch.Tensor = model(**given, return_dict=False)[0]
    return out
