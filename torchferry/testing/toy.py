"""A tiny DiT-style pipeline that ships with torchferry for the demo, the tests and the benchmarks.

It has the shape of a real text-to-image pipeline at a size that runs in milliseconds on a CPU: a
text encoder with a block list, one DiT (or two experts that hand over mid-way, as Wan 2.2 does) and a
VAE-like decoder. It declares its topology the way real pipelines do (component class lists, an
``_offload_plan`` and the DiT's ``_layerwise_offload_blocks_attrs``) and carries the awkward cases
offloading must get right: tied weights, a transposed (non-contiguous) weight, a half-precision
tensor next to single-precision ones, a non-persistent buffer, and blocks the model skips on some
steps. Weights are a deterministic function of a seed.

`wan_pipeline` builds a real (tiny) diffusers ``WanPipeline`` instead, for tests and checks that
need diffusers' own classes; it imports diffusers and transformers when called.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file
from torch import nn

from torchferry.runtime import CheckpointReader
from torchferry.topology import Declaration

__all__ = [
    "ToyDecoder",
    "ToyDiT",
    "ToyMoEPipeline",
    "ToyPipeline",
    "ToyTextEncoder",
    "build",
    "build_empty",
    "load_checkpoint",
    "save_checkpoint",
    "tokenize",
]

VOCAB = 64
TEXT_LEN = 8
LATENT_CHANNELS = 16
LATENT_TOKENS = 16
PIXELS = 16


def tokenize(prompt: str) -> torch.Tensor:
    """Token ids of ``prompt``: its UTF-8 bytes modulo the vocabulary, padded or cut to a fixed length."""
    ids = [b % VOCAB for b in prompt.encode()][:TEXT_LEN]
    ids += [0] * (TEXT_LEN - len(ids))
    return torch.tensor([ids], dtype=torch.long)


class ToyTextEncoderBlock(nn.Module):
    """A pre-norm MLP block of the text encoder."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))
        return out


class ToyTextEncoder(nn.Module):
    """Embedding, a block list and a projection whose output weight is tied to its input weight."""

    def __init__(self, hidden: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(ToyTextEncoderBlock(hidden) for _ in range(blocks))
        self.in_proj = nn.Linear(hidden, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)
        self.out_proj.weight = self.in_proj.weight  # tied
        self.norm = nn.LayerNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(self.embed(ids))
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.out_proj(self.norm(h))
        return out


class ToyDiTBlock(nn.Module):
    """Cross-attention and an MLP, modulated by the timestep embedding.

    ``norm_k`` shares its weight with ``norm_q`` (tied), ``out.weight`` is stored transposed (a
    non-contiguous view), and ``gate`` is half precision.
    """

    scale: torch.Tensor

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm_q = nn.LayerNorm(hidden)
        self.norm_k = nn.LayerNorm(hidden)
        self.norm_k.weight = self.norm_q.weight  # tied
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.out.weight = nn.Parameter(torch.empty(hidden, hidden).t())  # transposed storage
        self.gate = nn.Parameter(torch.ones(hidden, dtype=torch.float16))
        self.mod = nn.Linear(hidden, 2 * hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)
        self.register_buffer("scale", torch.ones(hidden))

    def forward(self, h: torch.Tensor, temb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        q = self.q(self.norm_q(h))
        kv = self.norm_k(context)
        k, v = self.k(kv), self.v(kv)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v
        h = h + self.gate.float() * self.out(attn)
        shift, scale = self.mod(temb).unsqueeze(1).chunk(2, dim=-1)
        x = self.norm_q(h) * (1 + scale) + shift
        out: torch.Tensor = h + self.scale * self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return out


class ToyDiT(nn.Module):
    """A diffusion transformer: patch projection, timestep MLP, a block list, output projection."""

    _layerwise_offload_blocks_attrs: ClassVar[tuple[str, ...]] = ("blocks",)
    freqs: torch.Tensor

    def __init__(self, hidden: int, blocks: int) -> None:
        super().__init__()
        self.patch_in = nn.Linear(LATENT_CHANNELS, hidden)
        self.context_proj = nn.Linear(hidden, hidden)
        self.time_in = nn.Linear(hidden, hidden)
        self.time_out = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(ToyDiTBlock(hidden) for _ in range(blocks))
        self.norm_out = nn.LayerNorm(hidden)
        self.proj_out = nn.Linear(hidden, LATENT_CHANNELS)
        half = hidden // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(
        self, latents: torch.Tensor, t: torch.Tensor, context: torch.Tensor, skip: Collection[int] = ()
    ) -> torch.Tensor:
        angles = t.float()[:, None] * 1000.0 * self.freqs[None]
        temb = self.time_out(
            torch.nn.functional.silu(self.time_in(torch.cat([angles.sin(), angles.cos()], -1)))
        )
        h = self.patch_in(latents)
        ctx = self.context_proj(context)
        for i, block in enumerate(self.blocks):
            if i in skip:
                continue
            h = block(h, temb, ctx)
        out: torch.Tensor = self.proj_out(self.norm_out(h))
        return out


class ToyDecoder(nn.Module):
    """A VAE-like decoder from latent tokens to pixels; it can own its residency on demand."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(LATENT_CHANNELS, hidden)
        self.fc2 = nn.Linear(hidden, PIXELS)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(torch.nn.functional.silu(self.fc1(latents))))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decode(latents)

    def load_to_device(self, device: torch.device | str = "cpu") -> None:
        """Move the decoder's weights to ``device`` (the pipeline's own lifecycle hook)."""
        self.to(device)

    def offload_to_cpu(self) -> None:
        """Move the decoder's weights back to host memory."""
        self.to("cpu")


class ToyPipeline(nn.Module):
    """Text encoder -> ``steps`` DiT steps (flow-matching Euler) -> decoder, on one fixed-size image."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = ["vae"]
    _offload_plan: ClassVar[Declaration] = Declaration(
        resident_dit_paths={"transformer"},
        encoder_block_attrs={"text_encoder": ("blocks",)},
        encoder_dlo_weight_replication={"text_encoder"},
    )

    def __init__(self, *, hidden: int = 32, blocks: int = 8, encoder_blocks: int = 2) -> None:
        super().__init__()
        self.text_encoder = ToyTextEncoder(hidden, encoder_blocks)
        self.transformer = ToyDiT(hidden, blocks)
        self.vae = ToyDecoder(hidden)

    def expert(self, step: int, steps: int) -> ToyDiT:
        """The DiT that denoises ``step`` of ``steps`` (always ``transformer`` here)."""
        return self.transformer

    def forward(
        self,
        prompt: str,
        steps: int = 4,
        *,
        seed: int = 0,
        skip: Mapping[int, Collection[int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Generate a ``(1, LATENT_TOKENS, PIXELS)`` "image" on ``device`` (where the inputs are made).

        ``skip`` maps a step index to the DiT blocks that step skips (conditional execution).
        """
        with torch.no_grad():
            context = self.text_encoder(tokenize(prompt).to(device))
            generator = torch.Generator().manual_seed(seed)
            latents = torch.randn(1, LATENT_TOKENS, LATENT_CHANNELS, generator=generator).to(device)
            for i in range(steps):
                t = torch.tensor([1.0 - i / steps], device=device)
                velocity = self.expert(i, steps)(latents, t, context, skip=(skip or {}).get(i, ()))
                latents = latents - velocity / steps
            image: torch.Tensor = self.vae(latents)
        return image


class ToyMoEPipeline(ToyPipeline):
    """Two expert DiTs: ``transformer`` for the high-noise steps, ``transformer_2`` after the boundary."""

    _dit_modules: ClassVar[list[str]] = ["transformer", "transformer_2"]
    _offload_plan: ClassVar[Declaration] = Declaration(
        resident_dit_paths={"transformer", "transformer_2"},
        encoder_block_attrs={"text_encoder": ("blocks",)},
        encoder_dlo_weight_replication={"text_encoder"},
    )

    def __init__(
        self, *, hidden: int = 32, blocks: int = 8, encoder_blocks: int = 2, boundary: float = 0.5
    ) -> None:
        super().__init__(hidden=hidden, blocks=blocks, encoder_blocks=encoder_blocks)
        self.transformer_2 = ToyDiT(hidden, blocks)
        self.boundary = boundary

    def expert(self, step: int, steps: int) -> ToyDiT:
        return self.transformer if step < self.boundary * steps else self.transformer_2


def build(
    seed: int = 0, *, two_experts: bool = False, blocks: int = 8, encoder_blocks: int = 2, hidden: int = 32
) -> ToyPipeline:
    """A toy pipeline on the CPU whose every weight is a deterministic function of ``seed``."""
    cls = ToyMoEPipeline if two_experts else ToyPipeline
    pipeline = cls(hidden=hidden, blocks=blocks, encoder_blocks=encoder_blocks)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in pipeline.named_parameters():
            if name.endswith("gate"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.ndim == 1 and "norm" in name:
                param.copy_(1 + 0.05 * torch.randn(param.shape, generator=generator))
            else:
                fan_in = param.shape[-1] if param.ndim > 1 else param.shape[0]
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
    return pipeline.eval()


def without_block_buffers(pipeline: ToyPipeline) -> ToyPipeline:
    """``pipeline`` with each DiT block's buffer made a frozen parameter of the same values: its blocks
    have no buffer, as most diffusers transformers' blocks have none (a replayed step moves such a
    block by C calls alone, [Note: replay])."""
    dits = [pipeline.transformer, getattr(pipeline, "transformer_2", None)]
    for dit in dits:
        for block in [] if dit is None else dit.blocks:
            scale = block._buffers.pop("scale")
            assert scale is not None
            block.scale = nn.Parameter(scale, requires_grad=False)
    return pipeline


def build_empty(
    *, two_experts: bool = False, blocks: int = 8, encoder_blocks: int = 2, hidden: int = 32
) -> ToyPipeline:
    """A toy pipeline whose parameters are on the meta device (buffers real), for a checkpoint to fill.

    ``torchferry.offload(pipeline, checkpoint=...)`` reads its weights straight into host buffers.
    """
    from torchferry.runtime import meta_parameters

    with meta_parameters():
        return build(0, two_experts=two_experts, blocks=blocks, encoder_blocks=encoder_blocks, hidden=hidden)


def save_checkpoint(pipeline: nn.Module, path: str | Path) -> None:
    """Write every parameter and persistent buffer (tied weights once) to a safetensors file."""
    tensors = {name: t.detach().contiguous() for name, t in pipeline.state_dict(keep_vars=True).items()}
    seen: dict[int, str] = {}
    for name, param in pipeline.named_parameters(remove_duplicate=False):
        first = seen.setdefault(id(param), name)
        if first != name:
            del tensors[name]
    save_file(tensors, str(path))


def load_checkpoint(pipeline: nn.Module, path: str | Path) -> nn.Module:
    """Fill ``pipeline`` from a file written by `save_checkpoint` (strides and ties are kept)."""
    with CheckpointReader(path) as reader, torch.no_grad():
        for name, t in pipeline.state_dict(keep_vars=True).items():
            if name in reader.entries:
                t.copy_(reader.read_tensor(name))
    return pipeline


def wan_pipeline(*, layers: int = 4, heads: int = 2, head_dim: int = 12, ffn_dim: int = 32) -> Any:
    """A tiny diffusers ``WanPipeline`` (a ``layers``-block transformer, UMT5 encoder, Wan VAE) from
    fixed seeds, on the CPU; needs diffusers and transformers. ``layers=8, heads=4, head_dim=64,
    ffn_dim=1024`` gives blocks of 4.2 MiB (about 35 MiB in all), large enough for a file tier to pay."""
    diffusers: Any = importlib.import_module("diffusers")
    transformers: Any = importlib.import_module("transformers")
    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=16,
        ffn_dim=ffn_dim,
        num_layers=layers,
        rope_max_seq_len=32,
    ).eval()
    vae = diffusers.AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    encoder = transformers.UMT5EncoderModel(
        transformers.UMT5Config(
            vocab_size=32, d_model=32, d_kv=4, d_ff=32, num_layers=3, num_heads=4, decoder_start_token_id=0
        )
    ).eval()
    return diffusers.WanPipeline(
        tokenizer=None,
        text_encoder=encoder,
        vae=vae,
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def run_wan(pipe: Any, *, steps: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of a `wan_pipeline` (16 x 16, 5 frames, ``steps`` steps, a fixed generator; the
    prompt embeddings from fixed token ids, the negative ones flipped): the embeddings and frames."""
    pipe.set_progress_bar_config(disable=True)
    ids = torch.tensor([[3, 7, 1, 9, 2, 5, 0, 0]])
    with torch.no_grad():
        embeds: torch.Tensor = pipe.text_encoder(ids).last_hidden_state
        frames: torch.Tensor = pipe(
            prompt_embeds=embeds,
            negative_prompt_embeds=embeds.flip(1),
            height=16,
            width=16,
            num_frames=5,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).frames
    return embeds, frames
