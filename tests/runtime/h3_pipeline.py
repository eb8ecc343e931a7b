"""A pipeline of MiniMax-H3's shape: an on-demand text encoder whose ``vision.blocks`` and
``text_model.layers`` stream in rings, while the pipeline moves the rest with the encoder's own
``load_to_device()`` / ``offload_to_cpu()`` around the encode (as the seed offloader serves it)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from torchferry.testing import toy
from torchferry.topology import Declaration

HIDDEN = 32


class Vision(nn.Module):
    """A patch projection, a block list and a merger, as a vision tower."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(HIDDEN, HIDDEN)
        self.blocks = nn.ModuleList(toy.ToyTextEncoderBlock(HIDDEN) for _ in range(3))
        self.merge = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.merge(x)
        return out


class TextModel(nn.Module):
    """Embeddings, a layer list and a norm, reading the vision tower's output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(toy.VOCAB, HIDDEN)
        self.layers = nn.ModuleList(toy.ToyTextEncoderBlock(HIDDEN) for _ in range(4))
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + image.mean(1, keepdim=True)
        for layer in self.layers:
            h = layer(h)
        out: torch.Tensor = self.norm(h)
        return out


class Encoder(nn.Module):
    """A Qwen3-VL-like encoder with its own lifecycle: each call gives every tensor new memory, as a
    move between devices does (``.to(device)`` on one CPU would change nothing), and is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = Vision()
        self.text_model = TextModel()
        self.moves: list[str] = []

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.text_model(ids, self.vision(pixels))
        return out

    def load_to_device(self, device: torch.device | str = "cpu") -> None:
        """Move the encoder to ``device`` (its blocks stay where the session keeps them)."""
        self.moves.append("load")
        self._apply(lambda t: t.to(device, copy=True))

    def offload_to_cpu(self) -> None:
        """Move the encoder back to host memory."""
        self.moves.append("offload")
        self._apply(lambda t: t.to("cpu", copy=True))


class H3Pipeline(nn.Module):
    """The encoder (on demand, two block stacks) and a toy DiT; the pipeline moves the encoder itself."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = []
    _offload_plan: ClassVar[Declaration] = Declaration(
        resident_dit_paths={"transformer"},
        encoder_block_attrs={"text_encoder": ("vision.blocks", "text_model.layers")},
        on_demand_component_paths={"text_encoder"},
        encoder_dlo_weight_replication={"text_encoder"},
    )

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = Encoder()
        self.transformer = toy.ToyDiT(HIDDEN, 6)

    def forward(self, prompt: str, steps: int = 3) -> torch.Tensor:
        with torch.no_grad():
            self.text_encoder.load_to_device("cpu")
            generator = torch.Generator().manual_seed(0)
            pixels = torch.randn(1, 5, HIDDEN, generator=generator)
            context = self.text_encoder(toy.tokenize(prompt), pixels)
            self.text_encoder.offload_to_cpu()
            latents = torch.randn(1, toy.LATENT_TOKENS, toy.LATENT_CHANNELS, generator=generator)
            for i in range(steps):
                t = torch.tensor([1.0 - i / steps])
                latents = latents - self.transformer(latents, t, context) / steps
        return latents


def build(seed: int = 0) -> H3Pipeline:
    """The pipeline with every weight a function of ``seed``."""
    pipe = H3Pipeline()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in pipe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / 8)
    return pipe.eval()
