"""Tiny whole pipelines of the pipeline zoo whose text encoders are Hub-only multimodal models: FLUX.2 [dev]
(Mistral 3), LTX-2 (Gemma 3, with its pipeline-local connectors and vocoder and its audio VAE) and
HunyuanImage 2.1 (Qwen2.5-VL and ByT5). The sizes follow each pipeline's tests in the diffusers test suite
(``get_dummy_components``), with the transformer rings raised to four blocks where they had fewer, the
vocabularies cut to the fixed token ids of `pipeline_zoo`, and HunyuanImage's VAE at 32 channels (its
group norms take 32 groups). LTX-2 runs to decoded frames and audio, so
its video VAE, audio VAE and vocoder run too; FLUX.2 and HunyuanImage decode their images."""

from __future__ import annotations

from typing import Any

import pipeline_zoo as base
import torch


def _mistral3() -> Any:
    t = base._transformers()
    config = t.Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 37,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 4,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 37,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": 30,
            "patch_size": 6,
        },
        image_seq_length=4,
        vision_feature_layer=-1,
        image_token_index=1,
    )
    return t.Mistral3ForConditionalGeneration(config).eval()


def flux2() -> Any:
    d = base._diffusers()
    vae = d.AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=4,
    ).eval()
    return d.Flux2Pipeline(
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=_mistral3(),
        tokenizer=None,
        transformer=base._dit("Flux2Transformer2DModel", joint_attention_dim=48),
    )


def run_flux2(pipe: Any) -> tuple[torch.Tensor, ...]:
    """The Mistral 3 hidden states of layers 1 to 3, stacked on the channels as the pipeline stacks them."""
    output = pipe.text_encoder(
        input_ids=base.IDS, attention_mask=base.MASK, output_hidden_states=True, use_cache=False
    )
    states = torch.stack([output.hidden_states[k] for k in (1, 2, 3)], dim=1)
    embeds = states.permute(0, 2, 1, 3).reshape(1, base.IDS.shape[1], -1)
    images = pipe(
        prompt_embeds=embeds,
        height=16,
        width=16,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
    ).images
    return embeds, images


def _gemma3() -> Any:
    t = base._transformers()
    config = t.Gemma3Config(
        text_config={**base.TINY_TEXT, "head_dim": 8},
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 4,
        },
        mm_tokens_per_image=4,
    )
    return t.Gemma3ForConditionalGeneration(config).eval()


def ltx2() -> Any:
    d = base._diffusers()
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    encoder = _gemma3()
    hidden, layers = 16, 2
    torch.manual_seed(1)
    transformer = d.LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=4,
        caption_channels=hidden,
        rope_double_precision=False,
        rope_type="split",
    ).eval()
    connectors = LTX2TextConnectors(
        caption_channels=hidden,
        text_proj_in_factor=layers + 1,
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=4,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=4,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    ).eval()
    vae = d.AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    audio_vae = d.AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        mid_block_add_attention=False,
        mel_bins=8,
    ).eval()
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    ).eval()
    return d.LTX2Pipeline(
        scheduler=d.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=encoder,
        tokenizer=None,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )


def run_ltx2(pipe: Any) -> tuple[torch.Tensor, ...]:
    """Every Gemma 3 hidden state, stacked on the channels as the pipeline stacks them; the call runs
    with classifier-free guidance to decoded frames and audio."""
    output = pipe.text_encoder(input_ids=base.IDS, attention_mask=base.MASK, output_hidden_states=True)
    embeds = torch.stack(output.hidden_states, dim=-1).flatten(2, 3)
    result = pipe(
        prompt_embeds=embeds,
        prompt_attention_mask=base.MASK,
        negative_prompt_embeds=embeds.flip(1),
        negative_prompt_attention_mask=base.MASK,
        guidance_scale=2.0,
        stg_scale=0.0,
        modality_scale=1.0,
        audio_guidance_scale=2.0,
        audio_stg_scale=0.0,
        audio_modality_scale=1.0,
        use_cross_timestep=False,
        height=32,
        width=32,
        num_frames=5,
        frame_rate=25.0,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
    )
    return embeds, result.frames, result.audio


def hunyuan_image() -> Any:
    d, t = base._diffusers(), base._transformers()
    encoder = base._qwen_encoder()
    byt5 = t.T5EncoderModel(
        t.T5Config(
            vocab_size=32,
            d_model=32,
            d_kv=4,
            d_ff=16,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            dense_act_fn="gelu_new",
            is_encoder_decoder=False,
            use_cache=False,
            tie_word_embeddings=False,
        )
    ).eval()
    torch.manual_seed(1)
    transformer = d.HunyuanImageTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=4,
        attention_head_dim=8,
        num_layers=4,
        num_single_layers=4,
        num_refiner_layers=1,
        patch_size=(1, 1),
        text_embed_dim=16,
        text_embed_2_dim=32,
        rope_axes_dim=(4, 4),
    ).eval()
    vae = d.AutoencoderKLHunyuanImage(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(32, 32, 32, 32),
        layers_per_block=1,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        sample_size=128,
    ).eval()
    return d.HunyuanImagePipeline(
        scheduler=d.FlowMatchEulerDiscreteScheduler(shift=7.0),
        vae=vae,
        text_encoder=encoder,
        tokenizer=None,
        text_encoder_2=byt5,
        tokenizer_2=None,
        transformer=transformer,
        guider=d.AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=1),
        ocr_guider=d.AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=1),
    )


def run_hunyuan_image(pipe: Any) -> tuple[torch.Tensor, ...]:
    """Qwen2.5-VL's third hidden state from the end (the pipeline's skip of two layers) and ByT5's last;
    the ByT5 embeddings are not all zero, so the OCR guider runs, with a negative prompt."""
    states = pipe.text_encoder(input_ids=base.IDS, attention_mask=base.MASK, output_hidden_states=True)
    embeds = states.hidden_states[-3]
    byt5 = pipe.text_encoder_2(input_ids=base.IDS, attention_mask=base.MASK).last_hidden_state
    images = pipe(
        prompt_embeds=embeds,
        prompt_embeds_mask=base.MASK,
        negative_prompt_embeds=embeds.flip(1),
        negative_prompt_embeds_mask=base.MASK,
        prompt_embeds_2=byt5,
        prompt_embeds_mask_2=base.MASK,
        negative_prompt_embeds_2=byt5.flip(1),
        negative_prompt_embeds_mask_2=base.MASK,
        height=16,
        width=16,
        num_inference_steps=2,
        generator=base._generator(),
        output_type="pt",
    ).images
    return embeds, byt5, images
