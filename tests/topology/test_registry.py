"""The registry of known diffusers / transformers classes and pipeline declarations."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from torch import nn

from torchferry.topology._model import Declaration
from torchferry.topology._registry import (
    DIT_BLOCK_ATTRS,
    ENCODER_BLOCK_LAYOUTS,
    PIPELINES,
    block_attrs_for,
    declaration_for_pipeline,
    encoder_block_attrs_for,
    encoder_block_layouts_for,
    pipeline_components,
)

# Tiny configs of each registered DiT class and the block count of each registered attribute.
TINY_DITS: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "WanTransformer3DModel": (
        dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32,
        ),
        (3,),
    ),
    "FluxTransformer2DModel": (
        dict(
            patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6),
        ),
        (2, 3),
    ),
    "QwenImageTransformer2DModel": (
        dict(
            patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6),
        ),
        (3,),
    ),
    "HunyuanVideoTransformer3DModel": (
        dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
            num_single_layers=3, num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16,
            pooled_projection_dim=8, rope_axes_dim=(4, 6, 6),
        ),
        (2, 3),
    ),
    "SD3Transformer2DModel": (
        dict(
            sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
            pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16,
        ),
        (3,),
    ),
    "LTXVideoTransformer3DModel": (
        dict(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, num_layers=4, caption_channels=16,
        ),
        (4,),
    ),
}


def _tiny_encoders(transformers: Any) -> dict[str, Callable[[], nn.Module]]:
    """Builders of a two-layer model of every registered text-encoder class."""
    t5 = dict(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4, decoder_start_token_id=0)
    clip = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, projection_dim=8, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    llama = dict(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, bos_token_id=0, eos_token_id=1,
    )
    text = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, bos_token_id=0, eos_token_id=1,
        rope_scaling={"type": "default", "rope_type": "default", "mrope_section": [2, 1, 1]},
    )
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16)

    def qwen() -> Any:
        return transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, image_token_id=60, video_token_id=61
        )

    return {
        "T5EncoderModel": lambda: transformers.T5EncoderModel(transformers.T5Config(**t5)),
        "UMT5EncoderModel": lambda: transformers.UMT5EncoderModel(transformers.UMT5Config(**t5)),
        "CLIPTextModel": lambda: transformers.CLIPTextModel(transformers.CLIPTextConfig(**clip)),
        "CLIPTextModelWithProjection": lambda: transformers.CLIPTextModelWithProjection(
            transformers.CLIPTextConfig(**clip)
        ),
        "LlamaModel": lambda: transformers.LlamaModel(transformers.LlamaConfig(**llama)),
        "Qwen2_5_VLForConditionalGeneration": lambda: transformers.Qwen2_5_VLForConditionalGeneration(qwen()),
        "Qwen2_5_VLModel": lambda: transformers.Qwen2_5_VLModel(qwen()),
    }


def test_tiny_configs_are_registered_classes() -> None:
    """The tiny models below are registered classes (every registered one runs in tests/integration)."""
    assert set(TINY_DITS) <= set(DIT_BLOCK_ATTRS)


def test_registry_matches_subclasses_and_class_names() -> None:
    """A subclass of a registered class inherits its entry; a class name matches only exactly."""

    class WanTransformer3DModel(nn.Module):
        pass

    class MyWan(WanTransformer3DModel):
        pass

    assert block_attrs_for(MyWan) == ("blocks",)
    assert block_attrs_for("MyWan") is None
    assert block_attrs_for(nn.Module) is None
    assert block_attrs_for("UNet2DConditionModel") == ("down_blocks", "mid_block", "up_blocks")


@pytest.mark.parametrize("class_name", sorted(TINY_DITS))
def test_dit_block_attrs_are_module_lists(class_name: str) -> None:
    """A tiny diffusers model's registered block attributes are ModuleLists of the configured length."""
    diffusers = pytest.importorskip("diffusers")
    config, counts = TINY_DITS[class_name]
    model = getattr(diffusers, class_name).from_config(config)
    assert type(model).__name__ == class_name
    attrs_ = block_attrs_for(class_name)
    assert attrs_ is not None
    got = []
    for attr in attrs_:
        blocks = model.get_submodule(attr)
        assert isinstance(blocks, nn.ModuleList)
        got.append(len(blocks))
    assert tuple(got) == counts


def test_every_registered_encoder_layout_holds_module_lists() -> None:
    """Each registered text encoder's current layout names ModuleLists of its configured layer count."""
    transformers = pytest.importorskip("transformers")
    builders = _tiny_encoders(transformers)
    assert set(builders) == set(ENCODER_BLOCK_LAYOUTS)
    for class_name, build in builders.items():
        model = build()
        paths = encoder_block_attrs_for(class_name)
        assert paths is not None
        for path in paths:
            blocks = model.get_submodule(path)
            assert isinstance(blocks, nn.ModuleList), (class_name, path)
            assert len(blocks) == 2, (class_name, path)


def test_registered_pipeline_components_match_diffusers() -> None:
    """Every registered pipeline's component paths are arguments of its diffusers __init__ with that class."""
    diffusers = pytest.importorskip("diffusers")
    for name, entry in PIPELINES.items():
        params = inspect.signature(getattr(diffusers, name).__init__).parameters
        for path, class_name in entry.dits + entry.encoders + entry.vaes:
            text = str(params[path].annotation)
            assert class_name in text, (name, path, text)


def test_unknown_classes_have_no_entry() -> None:
    """Unknown model, encoder and pipeline classes answer None or nothing, never a guess."""
    assert block_attrs_for("UNet2DConditionModelX") is None
    assert encoder_block_attrs_for("BertModel") is None
    assert encoder_block_layouts_for("BertModel") == ()
    assert declaration_for_pipeline("StableDiffusionXLPipeline", ["unet"]) is None
    assert pipeline_components("StableDiffusionXLPipeline") is None


def test_clip_text_model_lists_both_transformers_layouts() -> None:
    """CLIPTextModel's transformers 5.x layout comes first, the 4.x text_model wrapper second."""
    assert encoder_block_layouts_for("CLIPTextModel") == (("encoder.layers",), ("text_model.encoder.layers",))
    assert encoder_block_attrs_for("CLIPTextModel") == ("encoder.layers",)


def test_flux_declaration() -> None:
    """A Flux pipeline declares its DiT ring, both text encoders' stacks, and their replication."""
    paths = ["transformer", "text_encoder", "text_encoder_2", "vae"]
    assert declaration_for_pipeline("FluxPipeline", paths) == Declaration(
        block_attrs={"transformer": ("transformer_blocks", "single_transformer_blocks")},
        resident_dit_paths=["transformer"],
        encoder_component_types={"text_encoder": "text_encoder", "text_encoder_2": "text_encoder"},
        encoder_block_attrs={"text_encoder": ("encoder.layers",), "text_encoder_2": ("encoder.block",)},
        encoder_dlo_weight_replication=["text_encoder", "text_encoder_2"],
    )


def test_wan21_pipeline_without_second_expert() -> None:
    """A WanPipeline holding no transformer_2 declares only what it holds."""
    decl = declaration_for_pipeline("WanPipeline", ["transformer", "text_encoder", "vae"])
    assert decl == Declaration(
        block_attrs={"transformer": ("blocks",)},
        resident_dit_paths=["transformer"],
        encoder_component_types={"text_encoder": "text_encoder"},
        encoder_block_attrs={"text_encoder": ("encoder.block",)},
        encoder_dlo_weight_replication=["text_encoder"],
    )


def test_found_class_overrides_the_pipeline_default() -> None:
    """A class found at a path wins over the pipeline's default; an unknown class gets no stack."""
    decl = declaration_for_pipeline(
        "StableDiffusion3Pipeline",
        {"transformer": "SD3Transformer2DModel", "text_encoder": "CLIPTextModel", "text_encoder_3": "MyT5"},
    )
    assert decl is not None
    assert dict(decl.encoder_block_attrs) == {"text_encoder": ("encoder.layers",)}
    assert dict(decl.encoder_component_types) == {
        "text_encoder": "text_encoder",
        "text_encoder_3": "text_encoder",
    }


def test_pipeline_components_in_pipeline_order() -> None:
    """A known pipeline lists its DiTs, then encoders, then VAEs with their kinds."""
    assert pipeline_components("WanPipeline") == (
        ("transformer", "dit"),
        ("transformer_2", "dit"),
        ("text_encoder", "encoder"),
        ("vae", "vae"),
    )
    assert pipeline_components("WanVideoToVideoPipeline") == (
        ("transformer", "dit"),
        ("text_encoder", "encoder"),
        ("vae", "vae"),
    )


def test_pipeline_registry_matches_subclasses() -> None:
    """A subclass of a registered pipeline class gets its components and its declaration."""

    class FluxPipeline:
        pass

    class MyFlux(FluxPipeline):
        pass

    assert pipeline_components(MyFlux) == pipeline_components("FluxPipeline")
    assert declaration_for_pipeline(MyFlux, ["transformer"]) == declaration_for_pipeline(
        "FluxPipeline", ["transformer"]
    )
    assert pipeline_components("MyFlux") is None
