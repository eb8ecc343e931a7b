"""Tiny whole pipelines of the pipeline zoo for Kandinsky 5, HunyuanVideo 1.5, Sana-Video and Wan
Animate: `pipeline_zoo` holds the harness and the helpers used here (read at call time, so the two
modules may import each other).

The sizes follow each pipeline's own fast test in the diffusers test suite, with the transformers
given at least four blocks per ring, and the text encoders built from small transformers configs.
Unlike the first cases, these calls decode their latents (``output_type="pt"``), so every step also
runs the VAE where the session put it.
"""

from __future__ import annotations

from typing import Any

import pipeline_zoo as base
import torch
from torch import nn


def _kandinsky5_transformer(latent: int, text: int, pooled: int, visual_cond: bool = False) -> Any:
    return (
        base._diffusers()
        .Kandinsky5Transformer3DModel(
            in_visual_dim=latent,
            in_text_dim=text,
            in_text_dim2=pooled,
            time_dim=16,
            out_visual_dim=latent,
            patch_size=(1, 2, 2),
            model_dim=32,
            ff_dim=64,
            num_text_blocks=1,
            num_visual_blocks=4,
            axes_dims=(4, 6, 6),
            visual_cond=visual_cond,
        )
        .eval()
    )


def _hunyuan_video_vae() -> Any:
    return (
        base._diffusers()
        .AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
            latent_channels=4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
        )
        .eval()
    )


def _kandinsky5(pipeline: str, transformer: nn.Module, vae: nn.Module) -> Any:
    """A Kandinsky 5 pipeline of class ``pipeline``: its two encoders (Qwen2.5-VL and CLIP, built after
    ``transformer`` and ``vae``) and its scheduler, as every Kandinsky 5 pipeline takes them."""
    d = base._diffusers()
    return getattr(d, pipeline)(
        transformer=transformer,
        vae=vae,
        text_encoder=base._qwen_encoder(),
        tokenizer=None,
        text_encoder_2=base._clip(16),
        tokenizer_2=None,
        scheduler=d.FlowMatchEulerDiscreteScheduler(shift=7.0),
    )


def kandinsky5_t2v() -> Any:
    return _kandinsky5("Kandinsky5T2VPipeline", _kandinsky5_transformer(4, 16, 16), _hunyuan_video_vae())


def kandinsky5_t2i() -> Any:
    return _kandinsky5("Kandinsky5T2IPipeline", _kandinsky5_transformer(16, 16, 16), base._kl(16))


def _kandinsky5_embeds(pipe: Any) -> dict[str, torch.Tensor]:
    """Both encoders as the pipeline runs them: Qwen2.5-VL's last hidden states over the kept tokens
    with their cumulative lengths, and CLIP's pooled output; the negative prompt is the flipped one."""
    states = pipe.text_encoder(input_ids=base.IDS[:, :6], output_hidden_states=True).hidden_states[-1]
    pooled = pipe.text_encoder_2(base.IDS).pooler_output
    lengths = torch.tensor([0, states.shape[1]], dtype=torch.int32)
    return {
        "prompt_embeds_qwen": states,
        "prompt_embeds_clip": pooled,
        "prompt_cu_seqlens": lengths,
        "negative_prompt_embeds_qwen": states.flip(1),
        "negative_prompt_embeds_clip": pooled.flip(1),
        "negative_prompt_cu_seqlens": lengths,
    }


def run_kandinsky5_t2v(pipe: Any) -> tuple[torch.Tensor, ...]:
    embeds = _kandinsky5_embeds(pipe)
    frames = pipe(
        **embeds,
        guidance_scale=5.0,
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
    ).frames
    return embeds["prompt_embeds_qwen"], embeds["prompt_embeds_clip"], frames


def run_kandinsky5_t2i(pipe: Any) -> tuple[torch.Tensor, ...]:
    # The pipeline snaps any other size to its published resolutions (1024 pixels and more).
    pipe.resolutions = [(64, 64)]
    embeds = _kandinsky5_embeds(pipe)
    image = pipe(
        **embeds,
        guidance_scale=4.0,
        height=64,
        width=64,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
    ).image
    return embeds["prompt_embeds_qwen"], embeds["prompt_embeds_clip"], image


def hunyuan_video15() -> Any:
    d, t = base._diffusers(), base._transformers()
    qwen = t.Qwen2_5_VLTextModel(
        t.Qwen2_5_VLTextConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2], "rope_type": "default"},
        )
    ).eval()
    vae = d.AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    ).eval()
    from diffusers.guiders import ClassifierFreeGuidance

    return d.HunyuanVideo15Pipeline(
        # Latents, the condition latents and their mask go in together: 4 + 4 + 1 channels.
        transformer=base._dit("HunyuanVideo15Transformer3DModel", in_channels=9),
        vae=vae,
        scheduler=d.FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=qwen,
        tokenizer=None,
        text_encoder_2=base._t5(8),
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


def run_hunyuan_video15(pipe: Any, **image: Any) -> tuple[torch.Tensor, ...]:
    """Qwen2.5-VL's third-last hidden states (the pipeline skips two layers) and ByT5's (here T5's)
    last ones, each with its mask; the negative prompt is the flipped one."""
    mask = base.MASK
    output = pipe.text_encoder(input_ids=base.IDS, attention_mask=mask, output_hidden_states=True)
    embeds = output.hidden_states[-3]
    glyphs = pipe.text_encoder_2(input_ids=base.IDS[:, :4], attention_mask=mask[:, :4].float())[0]
    glyph_mask = mask[:, :4]
    frames = pipe(
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
        negative_prompt_embeds=embeds.flip(1),
        negative_prompt_embeds_mask=mask,
        prompt_embeds_2=glyphs,
        prompt_embeds_mask_2=glyph_mask,
        negative_prompt_embeds_2=glyphs.flip(1),
        negative_prompt_embeds_mask_2=glyph_mask,
        # Image-to-video takes its size from the image.
        **(image or {"height": 16, "width": 16}),
        num_frames=9,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
    ).frames
    return embeds, glyphs, frames


def sana_video() -> Any:
    d, t = base._diffusers(), base._transformers()
    encoder = t.Gemma2Model(
        t.Gemma2Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    ).eval()
    vae = d.AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    return d.SanaVideoPipeline(
        tokenizer=None,
        text_encoder=encoder,
        vae=vae,
        transformer=base._dit("SanaVideoTransformer3DModel"),
        # Sana-Video's published scheduler: DPM-Solver++ over flow sigmas.
        scheduler=d.DPMSolverMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0
        ),
    )


def run_sana_video(pipe: Any, **image: Any) -> tuple[torch.Tensor, ...]:
    embeds = pipe.text_encoder(base.IDS, attention_mask=base.MASK).last_hidden_state
    frames = pipe(
        **image,
        prompt_embeds=embeds,
        prompt_attention_mask=base.MASK,
        negative_prompt=None,
        negative_prompt_embeds=embeds.flip(1),
        negative_prompt_attention_mask=base.MASK,
        height=32,
        width=32,
        frames=9,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
        use_resolution_binning=False,
    ).frames
    return embeds, frames


def wan_animate() -> Any:
    d = base._diffusers()
    i2v = base._wan_i2v()
    torch.manual_seed(1)
    # The latents, the reference latents and their 4-channel mask go in together: 16 + 16 + 4.
    transformer = base._dit(
        "WanAnimateTransformer3DModel", in_channels=36, latent_channels=16, out_channels=16, text_dim=32
    )
    return d.WanAnimatePipeline(
        tokenizer=None,
        text_encoder=i2v.text_encoder,
        vae=i2v.vae,
        scheduler=i2v.scheduler,
        image_processor=i2v.image_processor,
        image_encoder=i2v.image_encoder,
        transformer=transformer,
    )


def run_wan_animate(pipe: Any) -> tuple[torch.Tensor, ...]:
    """Two segments of five frames (the second conditioned on the last frame of the first), in
    replace mode: a character image through the pipeline's own image encoder, pose, face, background
    and mask videos (all random pixels) through the VAE and the motion encoder, and each segment
    decoded by the VAE inside the loop."""
    from PIL import Image

    seeded = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (37, 16, 16, 3), generator=seeded, dtype=torch.uint8)
    image, *frames = [Image.fromarray(frame.numpy()) for frame in pixels]
    masks = [Image.fromarray(frame[..., 0].gt(127).to(torch.uint8).mul(255).numpy()) for frame in pixels[28:]]
    embeds = pipe.text_encoder(base.IDS).last_hidden_state
    video = pipe(
        image=image,
        pose_video=frames[:9],
        face_video=frames[9:18],
        background_video=frames[18:27],
        mask_video=masks,
        mode="replace",
        prompt_embeds=embeds,
        negative_prompt_embeds=embeds.flip(1),
        guidance_scale=2.0,
        height=16,
        width=16,
        segment_frame_length=5,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
    ).frames
    return embeds, video


def _image(size: int) -> Any:
    """A ``size`` x ``size`` image of random pixels from a fixed seed."""
    from PIL import Image

    seeded = torch.Generator().manual_seed(2)
    pixels = torch.randint(0, 256, (size, size, 3), generator=seeded, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def kandinsky5_i2v() -> Any:
    transformer = _kandinsky5_transformer(4, 16, 16, visual_cond=True)
    return _kandinsky5("Kandinsky5I2VPipeline", transformer, _hunyuan_video_vae())


def run_kandinsky5_i2v(pipe: Any) -> tuple[torch.Tensor, ...]:
    """The first frame comes from the image, through the VAE's encoder."""
    embeds = _kandinsky5_embeds(pipe)
    frames = pipe(
        image=_image(32),
        **embeds,
        guidance_scale=5.0,
        height=32,
        width=32,
        num_frames=17,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
    ).frames
    return embeds["prompt_embeds_qwen"], embeds["prompt_embeds_clip"], frames


def kandinsky5_i2i() -> Any:
    d = base._diffusers()
    # The pipeline takes its VAE to scale by 8: four blocks.
    vae = d.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=16,
        norm_num_groups=4,
        layers_per_block=1,
    ).eval()
    return _kandinsky5("Kandinsky5I2IPipeline", _kandinsky5_transformer(16, 16, 16, visual_cond=True), vae)


def run_kandinsky5_i2i(pipe: Any) -> tuple[torch.Tensor, ...]:
    pipe.resolutions = [(64, 64)]
    embeds = _kandinsky5_embeds(pipe)
    image = pipe(
        image=_image(64),
        **embeds,
        guidance_scale=4.0,
        height=64,
        width=64,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
    ).image
    return embeds["prompt_embeds_qwen"], embeds["prompt_embeds_clip"], image


def hunyuan_video15_i2v() -> Any:
    d, t = base._diffusers(), base._transformers()
    t2v = hunyuan_video15()
    torch.manual_seed(1)
    image_encoder = t.SiglipVisionModel(
        t.SiglipVisionConfig(
            hidden_size=12,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
        )
    ).eval()
    return d.HunyuanVideo15ImageToVideoPipeline(
        transformer=base._dit("HunyuanVideo15Transformer3DModel", in_channels=9, task_type="i2v"),
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        text_encoder=t2v.text_encoder,
        tokenizer=None,
        text_encoder_2=t2v.text_encoder_2,
        tokenizer_2=None,
        guider=t2v.guider,
        image_encoder=image_encoder,
        feature_extractor=t.SiglipImageProcessorPil(size={"height": 16, "width": 16}),
    )


def run_hunyuan_video15_i2v(pipe: Any) -> tuple[torch.Tensor, ...]:
    """The image goes through the pipeline's own SigLIP image encoder and the VAE's encoder."""
    return run_hunyuan_video15(pipe, image=_image(16))


def sana_video_i2v() -> Any:
    d = base._diffusers()
    t2v = sana_video()
    return d.SanaImageToVideoPipeline(
        tokenizer=None,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        transformer=t2v.transformer,
        scheduler=d.FlowMatchEulerDiscreteScheduler(shift=8.0),
    )


def run_sana_video_i2v(pipe: Any) -> tuple[torch.Tensor, ...]:
    """The first frame comes from the image, through the VAE's encoder."""
    return run_sana_video(pipe, image=_image(32))
