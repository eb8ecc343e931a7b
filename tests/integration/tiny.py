"""Tiny models and pipelines several integration tests build alike (fixed seeds, CPU-sized)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchferry import topology


class Block(nn.Module):
    """A residual linear block."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x)

class Model(nn.Module):
    """An undeclared model: an input projection, four blocks, an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.proj_out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)

#: A 6-block WanTransformer3DModel small enough for CPU tests (inputs: 1x4x2x8x8 latents, 5x16 text).
WAN_TRANSFORMER: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 6,
    "rope_max_seq_len": 32,
}


def fresh_storage(model: Any) -> Any:
    """``model`` (a module, or a pipeline's every module component) with each parameter and buffer in
    memory of its own, values unchanged, as ``.to(device)`` leaves them: the reference torchferry's
    output equals bit for bit. diffusers' and transformers' ``from_pretrained`` leave CPU tensors as
    views into the memory-mapped safetensors file, some at unaligned offsets, where CPU kernels may
    round differently (docs/contract.md, "What bit-identical compares")."""
    parts = model.components.values() if hasattr(model, "components") else [model]
    for part in parts:
        if isinstance(part, nn.Module):
            for tensor in [*part.parameters(), *part.buffers()]:
                if topology.is_wrapper(tensor):  # a quantized weight: its inner tensors
                    for name in tensor.__tensor_flatten__()[0]:  # type: ignore[attr-defined]
                        setattr(tensor, name, getattr(tensor, name).clone())
                else:
                    tensor.data = tensor.data.clone()
    return model
