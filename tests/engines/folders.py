"""Tiny pipeline folders as vLLM-Omni's diffusers backend loads them: saved with save_pretrained, each
with a word-level tokenizer written here (no download), so a request's text prompt runs end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WORDS = [
    "a",
    "red",
    "fox",
    "running",
    "through",
    "snow",
    "at",
    "dawn",
    "ferry",
    "on",
    "the",
    "river",
    "blue",
    "sky",
]


def tokenizer(max_length: int = 8) -> Any:
    """A fast tokenizer over `WORDS` (one id a word, padding to ``max_length``), built offline."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=model,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="[EOS]",
        model_max_length=max_length,
    )


def wan22_folder(folder: Path) -> Path:
    """A tiny Wan 2.2 text-to-video folder: two 4-block experts switching at boundary_ratio 0.5."""
    import diffusers

    from torchferry.testing import toy

    pipe = toy.wan_pipeline()
    torch.manual_seed(1)
    second = toy.wan_pipeline().transformer
    wan = diffusers.WanPipeline(
        tokenizer=tokenizer(),
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        transformer=pipe.transformer,
        transformer_2=second,
        scheduler=pipe.scheduler,
        boundary_ratio=0.5,
    )
    wan.save_pretrained(str(folder))
    return folder


def flux_folder(folder: Path) -> Path:
    """A tiny FLUX.1 folder: a 2+3-block transformer, CLIP and T5 encoders, a KL VAE."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    clip = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            projection_dim=16, max_position_embeddings=16,
        )
    ).eval()  # fmt: skip
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=32, d_model=32, d_kv=4, d_ff=32, num_layers=2, num_heads=4)
    ).eval()
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
        norm_num_groups=4, layers_per_block=1,
    ).eval()  # fmt: skip
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip
    diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=tokenizer(16),
        text_encoder_2=t5,
        tokenizer_2=tokenizer(16),
        transformer=transformer,
    ).save_pretrained(str(folder))
    return folder
