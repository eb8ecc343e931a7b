"""Tiny GGUF files of a diffusers ``WanTransformer3DModel``, written with the ``gguf`` package.

Quant types are mixed as real files mix them (city96's conversions keep norms, biases, embeddings
and the modules the class keeps in float32 as F32/F16 and quantize the Linear weights of the
blocks): each block's ten Linear weights cycle through Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K and
BF16 (Q4_K and Q6_K as seeded random blocks: gguf-py does not quantize them). The file is
written either under Wan's original tensor names (as the Wan repository and city96's files name
them) or under diffusers' names.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn

#: A Wan transformer whose Linear rows hold 256 values (a K-quant block), 0.9 MiB a block in Q-types.
WAN_GGUF: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 128,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 16,
    "ffn_dim": 256,
    "num_layers": 3,
    "rope_max_seq_len": 32,
}

Q = gguf.GGMLQuantizationType
#: The types the blocks' Linear weights cycle through.
CYCLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K, Q.BF16)

#: diffusers' name parts -> Wan's original ones (the inverse of diffusers' rename table for Wan).
_TO_ORIGINAL = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn2", "cross_attn"),
    ("attn1", "self_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"),
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
)


def original_name(name: str) -> str:
    """Wan's original name of the diffusers tensor ``name``."""
    if name == "scale_shift_table":
        return "head.modulation"
    if name.startswith("proj_out."):
        return "head.head." + name.removeprefix("proj_out.")
    if name.endswith(".scale_shift_table"):
        return name.removesuffix("scale_shift_table") + "modulation"
    for new, old in _TO_ORIGINAL:
        name = name.replace(new, old)
    return name


def wan(config: dict[str, Any] | None = None) -> nn.Module:
    """The float32 model the file is written from (seeded)."""
    import diffusers

    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(**(config or WAN_GGUF)).eval()


def quant_type(name: str, tensor: torch.Tensor, index: int) -> gguf.GGMLQuantizationType:
    """The type ``name`` is stored in: a Linear weight with rows of 256 values outside the modules Wan
    keeps in float32 cycles through `CYCLE`; the rest F32, and every other bias F16."""
    kept = ("time_embedder", "norm")
    if (
        name.endswith(".weight")
        and tensor.dim() == 2
        and tensor.shape[1] % 256 == 0
        and not any(k in name for k in kept)
    ):
        return CYCLE[index % len(CYCLE)]
    if name.endswith(".bias") and index % 2:
        return Q.F16
    return Q.F32


#: Where the float16 scales sit in a block of the K-quants gguf-py cannot quantize (byte offsets).
_K_SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def _quantize(
    values: np.ndarray[Any, Any], kind: gguf.GGMLQuantizationType, seed: int
) -> np.ndarray[Any, Any]:
    """``values`` quantized to ``kind`` (gguf-py's quantizer), or for Q4_K and Q6_K, which it does not
    quantize, seeded random blocks whose float16 scales are set to small finite values."""
    if kind not in _K_SCALES:
        return gguf.quants.quantize(values, kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows = values.reshape(-1, values.shape[-1])
    blocks = np.random.default_rng(seed).integers(0, 256, (rows.size // block, size), dtype=np.uint8)
    for at in _K_SCALES[kind]:
        blocks[:, at : at + 2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // block * size)


def write_tensors(
    path: Path, arch: str, tensors: dict[str, torch.Tensor], types: Callable[[str, torch.Tensor, int], Any]
) -> dict[str, Any]:
    """Write ``tensors`` to the GGUF file ``path``, each in the type ``types(name, tensor, index)``
    names (F32 and F16 as plain arrays, the rest quantized); returns each name's type."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    chosen: dict[str, Any] = {}
    for index, (name, tensor) in enumerate(tensors.items()):
        kind = chosen[name] = types(name, tensor, index)
        values = tensor.detach().float().numpy()
        if kind == Q.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif kind == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, _quantize(values, kind, index), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return chosen


def write(
    path: Path, model: nn.Module, *, original: bool, types: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write ``model``'s state dict to the GGUF file ``path`` (Wan's original names if ``original``);
    returns the type of each diffusers name. ``types`` overrides `quant_type` per diffusers name."""
    state = model.state_dict()
    stored = {original_name(n) if original else n: n for n in state}
    tensors = {name: state[diffusers_name] for name, diffusers_name in stored.items()}

    def chosen(name: str, tensor: torch.Tensor, index: int) -> Any:
        return (types or {}).get(stored[name]) or quant_type(stored[name], tensor, index)

    kinds = write_tensors(path, "wan", tensors, chosen)
    return {stored[name]: kind for name, kind in kinds.items()}


def config_folder(
    path: Path, config: dict[str, Any] | None = None, class_name: str = "WanTransformer3DModel"
) -> Path:
    """A folder holding the model's ``config.json`` (what ``from_single_file(config=...)`` reads)."""
    path.mkdir(parents=True, exist_ok=True)
    values = {"_class_name": class_name, **(config or WAN_GGUF)}
    (path / "config.json").write_text(
        json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()})
    )
    return path


def inputs() -> dict[str, torch.Tensor]:
    """The model's inputs (seeded): 1x4x2x8x8 latents, 5 text tokens of 16."""
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
    }


def call(model: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One forward of ``model`` on `inputs` (their floats in ``dtype``)."""
    given = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs().items()}
    with torch.no_grad():
        out: torch.Tensor = model(**given, return_dict=False)[0]
    return out
