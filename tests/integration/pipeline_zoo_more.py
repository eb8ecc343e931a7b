"""More tiny whole pipelines of the pipeline zoo: `pipeline_zoo` holds the harness, the first cases and
the helpers used here (read at call time, so the two modules may import each other)."""

from __future__ import annotations

from typing import Any

import diffusers_zoo
import pipeline_zoo as base
import torch

from torchferry.testing import toy


def zimage() -> Any:
    d, t = base._diffusers(), base._transformers()
    encoder = t.Qwen3Model(
        t.Qwen3Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    ).eval()
    return d.ZImagePipeline(
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
        vae=base._kl(16),
        text_encoder=encoder,
        tokenizer=None,
        transformer=base._dit("ZImageTransformer2DModel"),
    )


def run_zimage(pipe: Any) -> tuple[torch.Tensor, ...]:
    output = pipe.text_encoder(base.IDS, attention_mask=base.MASK, output_hidden_states=True)
    embeds = output.hidden_states[-2][0]
    images = pipe(
        prompt_embeds=[embeds[:6]],
        negative_prompt_embeds=[embeds[:6].flip(0)],
        height=32,
        width=32,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="latent",
    ).images
    return embeds, images


def pixart() -> Any:
    d = base._diffusers()
    return d.PixArtSigmaPipeline(
        tokenizer=None,
        text_encoder=base._t5(8),
        vae=base._kl(),
        transformer=base._dit("PixArtTransformer2DModel"),
        scheduler=d.DDIMScheduler(steps_offset=1, clip_sample=False),
    )


def run_pixart(pipe: Any) -> tuple[torch.Tensor, ...]:
    embeds = pipe.text_encoder(base.IDS, attention_mask=base.MASK).last_hidden_state
    images = pipe(
        prompt_embeds=embeds,
        prompt_attention_mask=base.MASK,
        negative_prompt=None,
        negative_prompt_embeds=embeds.flip(1),
        negative_prompt_attention_mask=base.MASK,
        height=16,
        width=16,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="latent",
        use_resolution_binning=False,
    ).images
    return embeds, images


def vace() -> Any:
    d = base._diffusers()
    wan = toy.wan_pipeline()
    torch.manual_seed(1)
    return d.WanVACEPipeline(
        tokenizer=None,
        text_encoder=wan.text_encoder,
        vae=wan.vae,
        scheduler=wan.scheduler,
        transformer=base._dit("WanVACETransformer3DModel", freq_dim=16, vace_in_channels=96),
    )


def run_vace(pipe: Any) -> tuple[torch.Tensor, ...]:
    embeds = pipe.text_encoder(base.IDS).last_hidden_state
    from PIL import Image

    seeded = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (5, 16, 16, 3), generator=seeded, dtype=torch.uint8)
    video = [Image.fromarray(frame.numpy()) for frame in pixels]
    frames = pipe(
        video=video,
        prompt_embeds=embeds,
        negative_prompt_embeds=embeds.flip(1),
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="latent",
    ).frames
    return embeds, frames


def chronoedit() -> Any:
    d = base._diffusers()
    i2v = base._wan_i2v()
    torch.manual_seed(1)
    return d.ChronoEditPipeline(
        tokenizer=None,
        text_encoder=i2v.text_encoder,
        image_encoder=i2v.image_encoder,
        image_processor=i2v.image_processor,
        transformer=d.ChronoEditTransformer3DModel(
            **{**diffusers_zoo.ZOO["ChronoEditTransformer3DModel"][0], "in_channels": 36, "image_dim": 16}
        ).eval(),
        vae=i2v.vae,
        scheduler=i2v.scheduler,
    )


def flux2_klein() -> Any:
    d, t = base._diffusers(), base._transformers()
    encoder = t.Qwen3ForCausalLM(
        t.Qwen3Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    ).eval()
    vae = d.AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=4,
    ).eval()
    return d.Flux2KleinPipeline(
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=encoder,
        tokenizer=None,
        transformer=base._dit("Flux2Transformer2DModel", joint_attention_dim=48),
    )


def run_flux2_klein(pipe: Any) -> tuple[torch.Tensor, ...]:
    states = pipe.text_encoder(base.IDS, attention_mask=base.MASK, output_hidden_states=True).hidden_states
    embeds = torch.cat([states[1], states[2], states[2]], dim=-1)
    images = pipe(
        prompt_embeds=embeds,
        negative_prompt_embeds=embeds.flip(1),
        height=16,
        width=16,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="latent",
    ).images
    return embeds, images


def ltx() -> Any:
    d = base._diffusers()
    vae = d.AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()
    return d.LTXPipeline(
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=base._t5(16),
        tokenizer=None,
        transformer=d.LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            num_layers=4,
            caption_channels=16,
        ).eval(),
    )


def run_ltx(pipe: Any) -> tuple[torch.Tensor, ...]:
    embeds = pipe.text_encoder(base.IDS, attention_mask=base.MASK).last_hidden_state
    frames = pipe(
        prompt_embeds=embeds,
        prompt_attention_mask=base.MASK,
        negative_prompt_embeds=embeds.flip(1),
        negative_prompt_attention_mask=base.MASK,
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="latent",
    ).frames
    return embeds, frames


def cogvideox() -> Any:
    d = base._diffusers()
    vae = d.AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    ).eval()
    return d.CogVideoXPipeline(
        tokenizer=None,
        text_encoder=base._t5(8),
        vae=vae,
        transformer=base._dit("CogVideoXTransformer3DModel"),
        scheduler=d.CogVideoXDDIMScheduler(),
    )


def run_cogvideox(pipe: Any) -> tuple[torch.Tensor, ...]:
    embeds = pipe.text_encoder(base.IDS).last_hidden_state
    frames = pipe(
        prompt_embeds=embeds,
        negative_prompt_embeds=embeds.flip(1),
        height=16,
        width=16,
        num_frames=8,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="latent",
    ).frames
    return embeds, frames


def auraflow() -> Any:
    d, t = base._diffusers(), base._transformers()
    encoder = t.UMT5EncoderModel(
        t.UMT5Config(vocab_size=32, d_model=32, d_kv=4, d_ff=32, num_layers=2, num_heads=4)
    ).eval()
    return d.AuraFlowPipeline(
        tokenizer=None,
        text_encoder=encoder,
        vae=base._kl(),
        transformer=base._dit("AuraFlowTransformer2DModel"),
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
    )


def run_auraflow(pipe: Any) -> tuple[torch.Tensor, ...]:
    embeds = pipe.text_encoder(base.IDS, attention_mask=base.MASK).last_hidden_state
    images = pipe(
        prompt_embeds=embeds,
        prompt_attention_mask=base.MASK,
        negative_prompt_embeds=embeds.flip(1),
        negative_prompt_attention_mask=base.MASK,
        height=32,
        width=32,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="latent",
    ).images
    return embeds, images


