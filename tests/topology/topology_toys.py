"""Small modules and pipelines shared by the topology tests (tiny, CPU or meta, built in microseconds)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from torchferry.topology import Declaration


class Block(nn.Module):
    """One tiny transformer-like block."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)


class DiT(nn.Module):
    """A DiT declaring one block attribute."""

    _layerwise_offload_blocks_attrs = ("blocks",)

    def __init__(self, blocks: int = 3, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.register_buffer("freqs", torch.zeros(width), persistent=False)


class DualDiT(nn.Module):
    """A DiT whose ring spans two attributes (double then single blocks)."""

    _layerwise_offload_blocks_attrs = ("double", "single")

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.double = nn.ModuleList(Block() for _ in range(2))
        self.single = nn.ModuleList(Block() for _ in range(3))


class Encoder(nn.Module):
    """A T5-like encoder: a shared embedding tied into ``encoder.embed``, blocks at ``encoder.block``."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.shared = nn.Embedding(8, 4)
        self.encoder = nn.Module()
        self.encoder.embed = self.shared
        self.encoder.block = nn.ModuleList(Block() for _ in range(blocks))
        self.final = nn.LayerNorm(4)


class LifecycleEncoder(Encoder):
    """An encoder whose residency the pipeline owns."""

    def load_to_device(self) -> None:
        """Stage onto the device (never called by topology code)."""

    def offload_to_cpu(self) -> None:
        """Stage back to the host (never called by topology code)."""


class StubEncoder(nn.Module):
    """An encoder declared on this rank but not loaded."""

    is_loaded = False


class Vae(nn.Module):
    """A VAE stand-in."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)


class LifecycleVae(Vae):
    """A VAE whose residency the pipeline owns."""

    def load_to_device(self) -> None:
        """Stage onto the device (never called by topology code)."""

    def offload_to_cpu(self) -> None:
        """Stage back to the host (never called by topology code)."""


class Pipeline:
    """A plain (non-module) pipeline declaring its components, like a diffusers pipeline."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = ["vae"]

    def __init__(
        self,
        *,
        blocks: int = 3,
        encoder: nn.Module | None = None,
        vae: nn.Module | None = None,
        plan: Declaration | None = None,
    ) -> None:
        self.transformer = DiT(blocks)
        self.text_encoder = Encoder() if encoder is None else encoder
        self.vae = Vae() if vae is None else vae
        if plan is not None:
            self._offload_plan = plan


class LegacyPipeline:
    """A pipeline that declares nothing: components come from the deprecated attribute scan."""

    def __init__(self) -> None:
        self.transformer = DiT()
        self.text_encoder = Encoder()
        self.image_encoder = Encoder()
        self.vae = Vae()


def names(tensors: object) -> list[str]:
    """The names of an iterable of tensor specs."""
    return [t.name for t in tensors]  # type: ignore[attr-defined]
