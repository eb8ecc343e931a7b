"""Tiny whole diffusers pipelines for the pipeline zoo: how to build each one and how to call it.

Each `Case` builds one pipeline class from fixed seeds with tiny components (the transformers from
`diffusers_zoo`'s configs, VAEs and transformers encoders from small configs written here; no
download) and calls it: the text encoders run on fixed token ids (the tests build no tokenizer, so
every pipeline is called with the embeddings its encoders gave), then the pipeline runs two steps to
its latents. The call returns every tensor it produced, compared bit for bit across the six steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import diffusers_zoo
import torch
from torch import nn

from torchferry.testing import toy

IDS = torch.tensor([[3, 7, 1, 9, 2, 5, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])


@attrs.frozen
class Case:
    """One pipeline class: its builder, its call, and what its folder steps are expected to do."""

    build: Callable[[], Any]
    call: Callable[[Any], tuple[torch.Tensor, ...]]
    #: Run only with the full zoo (TORCHFERRY_ZOO_FULL=1).
    full: bool = False


def _diffusers() -> Any:
    import diffusers

    return diffusers


def _transformers() -> Any:
    import transformers

    return transformers


def _dit(name: str, **changes: Any) -> nn.Module:
    cls = getattr(_diffusers(), name)
    return cls(**{**diffusers_zoo.ZOO[name][0], **changes}).eval()


def _kl(latent: int = 4) -> nn.Module:
    return (
        _diffusers()
        .AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),
            latent_channels=latent,
            norm_num_groups=4,
            layers_per_block=1,
        )
        .eval()
    )


def _t5(d_model: int = 32) -> nn.Module:
    t = _transformers()
    return t.T5EncoderModel(
        t.T5Config(vocab_size=32, d_model=d_model, d_kv=4, d_ff=32, num_layers=2, num_heads=4)
    ).eval()


def _clip(hidden: int = 16, projection: bool = False) -> nn.Module:
    t = _transformers()
    config = t.CLIPTextConfig(
        vocab_size=32,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=hidden,
        max_position_embeddings=16,
    )
    cls = t.CLIPTextModelWithProjection if projection else t.CLIPTextModel
    return cls(config).eval()


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ---------------------------------------------------------------------------------------------


def _wan() -> Any:
    return toy.wan_pipeline()


def _run_wan(pipe: Any) -> tuple[torch.Tensor, ...]:
    return toy.run_wan(pipe)


def _wan_i2v() -> Any:
    d, t = _diffusers(), _transformers()
    base = toy.wan_pipeline()
    torch.manual_seed(1)
    transformer = d.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=36,
        out_channels=16,
        text_dim=32,
        freq_dim=16,
        ffn_dim=32,
        num_layers=4,
        rope_max_seq_len=32,
        image_dim=16,
    ).eval()
    image_encoder = t.CLIPVisionModelWithProjection(
        t.CLIPVisionConfig(
            hidden_size=16,
            projection_dim=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            intermediate_size=16,
            patch_size=8,
        )
    ).eval()
    return d.WanImageToVideoPipeline(
        tokenizer=None,
        text_encoder=base.text_encoder,
        vae=base.vae,
        transformer=transformer,
        scheduler=base.scheduler,
        image_processor=t.CLIPImageProcessorPil(crop_size=32, size=32),
        image_encoder=image_encoder,
    )


def _run_wan_i2v(pipe: Any) -> tuple[torch.Tensor, ...]:
    """The image goes through the pipeline's own image encoder (no image_embeds given)."""
    image = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    embeds = pipe.text_encoder(IDS).last_hidden_state
    frames = pipe(
        image=image,
        prompt_embeds=embeds,
        negative_prompt_embeds=embeds.flip(1),
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=2,
        generator=_generator(),
        output_type="latent",
    ).frames
    return embeds, frames


def _flux() -> Any:
    d = _diffusers()
    return d.FluxPipeline(
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
        vae=_kl(),
        text_encoder=_clip(),
        tokenizer=None,
        text_encoder_2=_t5(),
        tokenizer_2=None,
        transformer=d.FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=3,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            axes_dims_rope=(4, 6, 6),
        ).eval(),
    )


def _run_flux(pipe: Any) -> tuple[torch.Tensor, ...]:
    pooled = pipe.text_encoder(IDS[:, :6]).pooler_output
    embeds = pipe.text_encoder_2(IDS).last_hidden_state
    images = pipe(
        prompt_embeds=embeds,
        pooled_prompt_embeds=pooled,
        height=16,
        width=16,
        num_inference_steps=2,
        generator=_generator(),
        output_type="latent",
    ).images
    return pooled, embeds, images


def _sd3() -> Any:
    d = _diffusers()
    return d.StableDiffusion3Pipeline(
        transformer=_dit("SD3Transformer2DModel"),
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
        vae=_kl(),
        text_encoder=_clip(32, projection=True),
        tokenizer=None,
        text_encoder_2=_clip(32, projection=True),
        tokenizer_2=None,
        text_encoder_3=_t5(32),
        tokenizer_3=None,
    )


def _run_sd3(pipe: Any) -> tuple[torch.Tensor, ...]:
    one = pipe.text_encoder(IDS, output_hidden_states=True)
    two = pipe.text_encoder_2(IDS, output_hidden_states=True)
    three = pipe.text_encoder_3(IDS).last_hidden_state
    pooled = torch.cat([one.text_embeds, two.text_embeds], dim=-1)
    embeds = torch.cat([one.hidden_states[-2], two.hidden_states[-2], three], dim=1)
    images = pipe(
        prompt_embeds=embeds,
        pooled_prompt_embeds=pooled,
        negative_prompt_embeds=embeds.flip(1),
        negative_pooled_prompt_embeds=pooled.flip(1),
        height=16,
        width=16,
        num_inference_steps=2,
        generator=_generator(),
        output_type="latent",
    ).images
    return pooled, embeds, images


def _sd() -> Any:
    d = _diffusers()
    return d.StableDiffusionPipeline(
        vae=_kl(),
        text_encoder=_clip(8),
        tokenizer=None,
        unet=_dit("UNet2DConditionModel"),
        scheduler=d.DDIMScheduler(steps_offset=1, clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _run_sd(pipe: Any) -> tuple[torch.Tensor, ...]:
    embeds = pipe.text_encoder(IDS).last_hidden_state
    images = pipe(
        prompt_embeds=embeds,
        negative_prompt_embeds=embeds.flip(1),
        height=32,
        width=32,
        num_inference_steps=2,
        generator=_generator(),
        output_type="latent",
    ).images
    return embeds, images


def _lumina2() -> Any:
    d, t = _diffusers(), _transformers()
    encoder = t.Gemma2Model(
        t.Gemma2Config(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    ).eval()
    return d.Lumina2Pipeline(
        transformer=_dit("Lumina2Transformer2DModel"),
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
        vae=_kl(),
        text_encoder=encoder,
        tokenizer=None,
    )


def _run_lumina2(pipe: Any) -> tuple[torch.Tensor, ...]:
    embeds = pipe.text_encoder(IDS, attention_mask=MASK, output_hidden_states=True).hidden_states[-2]
    images = pipe(
        prompt_embeds=embeds,
        prompt_attention_mask=MASK,
        negative_prompt_embeds=embeds.flip(1),
        negative_prompt_attention_mask=MASK,
        height=16,
        width=16,
        num_inference_steps=2,
        generator=_generator(),
        output_type="latent",
    ).images
    return embeds, images


#: The text model of every tiny decoder-only encoder (Qwen2.5-VL, Gemma 3): 2 layers of width 16.
TINY_TEXT: dict[str, Any] = {
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def _qwen_encoder() -> nn.Module:
    t = _transformers()
    config = t.Qwen2_5_VLConfig(
        text_config={
            **TINY_TEXT,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2], "rope_type": "default"},
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": 16,
            "fullatt_block_indexes": [1],
        },
        vocab_size=32,
    )
    return t.Qwen2_5_VLForConditionalGeneration(config).eval()


def _qwen() -> Any:
    d = _diffusers()
    return d.QwenImagePipeline(
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
        vae=d.AutoencoderKLQwenImage(
            base_dim=4, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True]
        ).eval(),
        text_encoder=_qwen_encoder(),
        tokenizer=None,
        transformer=_dit("QwenImageTransformer2DModel"),
    )


def _run_qwen(pipe: Any) -> tuple[torch.Tensor, ...]:
    output = pipe.text_encoder(input_ids=IDS, attention_mask=MASK, output_hidden_states=True)
    embeds = output.hidden_states[-1]
    images = pipe(
        prompt_embeds=embeds,
        prompt_embeds_mask=MASK,
        true_cfg_scale=1.0,
        height=32,
        width=32,
        num_inference_steps=2,
        generator=_generator(),
        output_type="latent",
    ).images
    return embeds, images


def _sana() -> Any:
    d, t = _diffusers(), _transformers()
    encoder = t.Gemma2Model(
        t.Gemma2Config(
            vocab_size=32,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
        )
    ).eval()
    return d.SanaPipeline(
        tokenizer=None,
        text_encoder=encoder,
        vae=d.AutoencoderDC(
            in_channels=3,
            latent_channels=4,
            attention_head_dim=2,
            encoder_block_types=("ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8),
            decoder_block_out_channels=(8, 8),
            encoder_qkv_multiscales=((), (5,)),
            decoder_qkv_multiscales=((), (5,)),
            encoder_layers_per_block=(1, 1),
            decoder_layers_per_block=[1, 1],
            downsample_block_type="conv",
            upsample_block_type="interpolate",
            decoder_norm_types="rms_norm",
            decoder_act_fns="silu",
            scaling_factor=0.41407,
        ).eval(),
        transformer=_dit("SanaTransformer2DModel"),
        scheduler=d.FlowMatchEulerDiscreteScheduler(shift=7.0),
    )


def _run_sana(pipe: Any) -> tuple[torch.Tensor, ...]:
    embeds = pipe.text_encoder(IDS, attention_mask=MASK).last_hidden_state
    images = pipe(
        prompt_embeds=embeds,
        prompt_attention_mask=MASK,
        negative_prompt=None,
        negative_prompt_embeds=embeds.flip(1),
        negative_prompt_attention_mask=MASK,
        height=32,
        width=32,
        num_inference_steps=2,
        generator=_generator(),
        output_type="latent",
        use_resolution_binning=False,
    ).images
    return embeds, images


import pipeline_zoo_more as more  # noqa: E402  (its builders use the helpers above)
import pipeline_zoo_new_a as new_a  # noqa: E402
import pipeline_zoo_new_b as new_b  # noqa: E402  (likewise)

#: pipeline class name -> its case.
CASES: dict[str, Case] = {
    "WanPipeline": Case(build=_wan, call=_run_wan, full=True),
    "WanImageToVideoPipeline": Case(build=_wan_i2v, call=_run_wan_i2v),
    "FluxPipeline": Case(build=_flux, call=_run_flux),
    "StableDiffusion3Pipeline": Case(build=_sd3, call=_run_sd3, full=True),
    "StableDiffusionPipeline": Case(build=_sd, call=_run_sd, full=True),
    "Lumina2Pipeline": Case(build=_lumina2, call=_run_lumina2),
    "QwenImagePipeline": Case(build=_qwen, call=_run_qwen),
    "SanaPipeline": Case(build=_sana, call=_run_sana, full=True),
    "ZImagePipeline": Case(build=more.zimage, call=more.run_zimage, full=True),
    "Flux2KleinPipeline": Case(build=more.flux2_klein, call=more.run_flux2_klein, full=True),
    "LTXPipeline": Case(build=more.ltx, call=more.run_ltx, full=True),
    "CogVideoXPipeline": Case(build=more.cogvideox, call=more.run_cogvideox, full=True),
    "AuraFlowPipeline": Case(build=more.auraflow, call=more.run_auraflow, full=True),
    "PixArtSigmaPipeline": Case(build=more.pixart, call=more.run_pixart, full=True),
    "WanVACEPipeline": Case(build=more.vace, call=more.run_vace, full=True),
    "ChronoEditPipeline": Case(build=more.chronoedit, call=_run_wan_i2v, full=True),
    "Flux2Pipeline": Case(build=new_a.flux2, call=new_a.run_flux2),
    "LTX2Pipeline": Case(build=new_a.ltx2, call=new_a.run_ltx2, full=True),
    "HunyuanImagePipeline": Case(build=new_a.hunyuan_image, call=new_a.run_hunyuan_image, full=True),
    "Kandinsky5T2VPipeline": Case(build=new_b.kandinsky5_t2v, call=new_b.run_kandinsky5_t2v),
    "Kandinsky5T2IPipeline": Case(build=new_b.kandinsky5_t2i, call=new_b.run_kandinsky5_t2i, full=True),
    "HunyuanVideo15Pipeline": Case(build=new_b.hunyuan_video15, call=new_b.run_hunyuan_video15, full=True),
    "SanaVideoPipeline": Case(build=new_b.sana_video, call=new_b.run_sana_video, full=True),
    "WanAnimatePipeline": Case(build=new_b.wan_animate, call=new_b.run_wan_animate, full=True),
    "Kandinsky5I2VPipeline": Case(build=new_b.kandinsky5_i2v, call=new_b.run_kandinsky5_i2v, full=True),
    "Kandinsky5I2IPipeline": Case(build=new_b.kandinsky5_i2i, call=new_b.run_kandinsky5_i2i, full=True),
    "HunyuanVideo15ImageToVideoPipeline": Case(
        build=new_b.hunyuan_video15_i2v, call=new_b.run_hunyuan_video15_i2v, full=True
    ),
    "SanaImageToVideoPipeline": Case(build=new_b.sana_video_i2v, call=new_b.run_sana_video_i2v, full=True),
}


def built(name: str) -> Any:
    """The tiny pipeline of case ``name``, from fixed seeds, with its progress bar off."""
    torch.manual_seed(0)
    pipe = CASES[name].build()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call(name: str, pipe: Any) -> tuple[torch.Tensor, ...]:
    """Every tensor one call of case ``name`` produces on ``pipe`` (no gradients)."""
    with torch.no_grad():
        return tuple(t.detach().clone() for t in CASES[name].call(pipe))


def weights(pipe: Any) -> dict[str, torch.Tensor]:
    """A copy of every tensor of every module component, named from the pipeline."""
    out: dict[str, torch.Tensor] = {}
    for name, value in pipe.components.items():
        if isinstance(value, nn.Module):
            for key, tensor in value.state_dict(keep_vars=True).items():
                out[f"{name}.{key}"] = tensor.detach().clone()
    return out
