"""diffusers models and pipelines run under torchferry with outputs bit-identical to the plain run.

The models are tiny ones built locally from small configs (no download). diffusers is an optional
extra: these tests are skipped where it is absent, and CI installs it so they run there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny import WAN_TRANSFORMER
from torch import nn

import torchferry
from torchferry import OffloadWarning, topology
from torchferry.testing import toy

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

Inputs = Callable[[], dict[str, Any]]


def _wan() -> tuple[nn.Module, Inputs]:
    model = diffusers.WanTransformer3DModel(**WAN_TRANSFORMER)
    return model, lambda: {
        "hidden_states": torch.randn(1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 5, 16),
    }


def _flux() -> tuple[nn.Module, Inputs]:
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    return model, lambda: {
        "hidden_states": torch.randn(1, 16, 4),
        "encoder_hidden_states": torch.randn(1, 6, 32),
        "pooled_projections": torch.randn(1, 16),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(6, 3),
    }


def _sd3() -> tuple[nn.Module, Inputs]:
    model = diffusers.SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        out_channels=4,
        pos_embed_max_size=16,
    )
    return model, lambda: {
        "hidden_states": torch.randn(1, 4, 8, 8),
        "encoder_hidden_states": torch.randn(1, 6, 16),
        "pooled_projections": torch.randn(1, 8),
        "timestep": torch.tensor([500]),
    }


def _ltx() -> tuple[nn.Module, Inputs]:
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=4,
        caption_channels=16,
    )
    return model, lambda: {
        "hidden_states": torch.randn(1, 8, 8),
        "encoder_hidden_states": torch.randn(1, 5, 16),
        "timestep": torch.tensor([500]),
        "encoder_attention_mask": torch.ones(1, 5),
        "num_frames": 2,
        "height": 2,
        "width": 2,
    }


def _qwen() -> tuple[nn.Module, Inputs]:
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    return model, lambda: {
        "hidden_states": torch.randn(1, 16, 16),
        "encoder_hidden_states": torch.randn(1, 5, 16),
        "encoder_hidden_states_mask": torch.ones(1, 5),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [(1, 4, 4)],
    }


def _hunyuan() -> tuple[nn.Module, Inputs]:
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=3,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6),
        guidance_embeds=True,
    )
    return model, lambda: {
        "hidden_states": torch.randn(1, 4, 2, 4, 4),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 5, 16),
        "encoder_attention_mask": torch.ones(1, 5),
        "pooled_projections": torch.randn(1, 8),
        "guidance": torch.tensor([3000.0]),
    }


MODELS: dict[str, Callable[[], tuple[nn.Module, Inputs]]] = {
    "QwenImageTransformer2DModel": _qwen,
    "HunyuanVideoTransformer3DModel": _hunyuan,
    "WanTransformer3DModel": _wan,
    "FluxTransformer2DModel": _flux,
    "SD3Transformer2DModel": _sd3,
    "LTXVideoTransformer3DModel": _ltx,
}


def _first(output: Any) -> torch.Tensor:
    tensor = output[0] if isinstance(output, tuple) else output.sample
    assert isinstance(tensor, torch.Tensor)
    return tensor


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    ("strategy", "options"),
    [("layerwise", {"prefetch_depth": 1}), ("layerwise", {"prefetch_depth": 2}), ("model_level", {})],
)
def test_bare_diffusers_transformer_is_bit_identical(
    name: str, strategy: str, options: dict[str, Any]
) -> None:
    """A bare diffusers transformer, found through the class registry, streams to a bit-identical output."""
    torch.manual_seed(0)
    model, make_inputs = MODELS[name]()
    model.eval()
    inputs = make_inputs()
    before = _state(model)
    with torch.no_grad():
        reference = _first(model(**inputs))
        with contextlib.ExitStack() as stack:
            if strategy == "model_level":  # a bare model has no encoder to swap against: rule 12 warns
                stack.enter_context(pytest.warns(OffloadWarning, match="has no encoder component"))
            session = stack.enter_context(
                torchferry.offload(model, strategy=strategy, device="cpu", **options)
            )
            first = _first(model(**inputs))
            second = _first(model(**inputs))
            assert session.peak_device_bytes > 0
    assert torch.equal(first, reference)
    assert torch.equal(second, reference)
    after = _state(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)



def test_wan_pipeline_object_is_discovered_from_the_registry() -> None:
    """An undeclared WanPipeline (not an nn.Module) yields its DiT, encoder and VAE with their rings."""
    topo = topology.discover(toy.wan_pipeline())
    assert [(c.path, c.kind, len(c.blocks)) for c in topo.components] == [
        ("transformer", "dit", 4),
        ("text_encoder", "encoder", 3),
        ("vae", "vae", 0),
    ]
    assert topo.declaration is not None
    assert topo.declaration.encoder_block_attrs["text_encoder"] == ("encoder.block",)


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("layerwise", {"prefetch_depth": 1}),
        ("layerwise", {"prefetch_depth": 2, "components": ["dit", "text_encoder"]}),
        ("model_level", {}),
    ],
)
def test_wan_pipeline_runs_bit_identical(strategy: str, options: dict[str, Any]) -> None:
    """A whole WanPipeline call (encoder, guided steps, VAE decode) matches the plain run bit for bit."""
    pipe = toy.wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    reference = toy.run_wan(pipe, steps=3)
    with torchferry.offload(pipe, strategy=strategy, device="cpu", **options):
        streamed = toy.run_wan(pipe, steps=3)
    assert torch.equal(streamed[0], reference[0])
    assert torch.equal(streamed[1], reference[1])
    assert torch.equal(toy.run_wan(pipe, steps=3)[1], reference[1])


# ------------------------------------------------- defect 1: a pipeline's inputs on the session device
class _HostScheduler(diffusers.FlowMatchEulerDiscreteScheduler):  # type: ignore[misc]
    """Keeps its timesteps and sigmas on the CPU whatever device it is given.

    A session on the ``meta`` device stands for a GPU here (test only: its tensors have no values),
    and a scheduler on meta could not read its own sigmas (``float(sigma)``) to step.
    """

    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: Any = None,
        sigmas: list[float] | None = None,
        mu: float | None = None,
        timesteps: list[float] | None = None,
    ) -> None:
        super().set_timesteps(num_inference_steps, None, sigmas=sigmas, mu=mu, timesteps=timesteps)


def _flux_pipeline() -> Any:
    torch.manual_seed(0)
    transformer, _ = _flux()
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        latent_channels=1,
        norm_num_groups=4,
        layers_per_block=1,
    )
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=vae.eval(),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer.eval(),
    )


def _call(pipe: Any) -> torch.Tensor:
    """A whole pipeline call that stops at the latents (the VAE's decode is not part of the proof)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if isinstance(pipe, diffusers.WanPipeline):
            embeds = torch.randn(1, 8, 32, generator=generator)
            out: torch.Tensor = pipe(
                prompt_embeds=embeds,
                negative_prompt_embeds=embeds.flip(1),
                height=16,
                width=16,
                num_frames=5,
                num_inference_steps=2,
                generator=generator,
                output_type="latent",
            ).frames
            return out
        out = pipe(
            prompt_embeds=torch.randn(1, 6, 32, generator=generator),
            pooled_prompt_embeds=torch.randn(1, 16, generator=generator),
            height=16,
            width=16,
            num_inference_steps=2,
            generator=generator,
            output_type="latent",
        ).images
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _probed_meta_call(pipe: Any, off: list[str], calls: dict[str, int]) -> tuple[torch.Tensor, Any]:
    """Call ``pipe`` under a session on ``meta``; ``off`` gets each tensor reaching a managed module off
    meta, ``calls`` counts each module's forwards. Returns the output and the execution device."""
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = _HostScheduler.from_config(pipe.scheduler.config)

    def probe(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[path] = calls.get(path, 0) + 1
            off.extend(f"{path}: {t.device}" for t in _tensors((args, kwargs)) if t.device.type != "meta")

        return hook

    with torchferry.offload(pipe, strategy="layerwise", device="meta") as session:
        handles = [
            topology.find_attr(pipe, path).register_forward_pre_hook(probe(path), with_kwargs=True)
            for top in session.plan.components
            for c in top.walk()
            for path in (c.path, *(b.path for b in c.blocks))
        ]
        device = pipe._execution_device
        try:
            out = _call(pipe)
        finally:
            for handle in handles:
                handle.remove()
    return out, device


@pytest.mark.parametrize("build", [toy.wan_pipeline, _flux_pipeline], ids=["wan", "flux"])
def test_a_pipeline_call_feeds_every_managed_module_on_the_session_device(build: Callable[[], Any]) -> None:
    """Under a session on a device that is not the CPU, every tensor reaching a component or block is
    on that device, and the pipeline reports it as its execution device (issue 10, defect 1)."""
    pipe = build()
    cls = type(pipe)
    off: list[str] = []
    calls: dict[str, int] = {}
    out, device = _probed_meta_call(pipe, off, calls)
    assert off == []
    assert device == torch.device("meta") and out.device.type == "meta"
    blocks = [b.path for b in topology.discover(pipe).component("transformer").blocks]
    assert all(calls.get(path, 0) >= 2 for path in ["transformer", *blocks])  # two steps ran
    assert type(pipe) is cls and pipe._execution_device == torch.device("cpu")  # given back at close


# On meta (a test device) the failed step's abort cannot swap the weights back while the failing
# frames still hold them, which torch reports as a warning; the call's own RuntimeError is what is checked.
@pytest.mark.filterwarnings("ignore:module forward hook with ``always_call=True`` raised:UserWarning")
def test_without_the_input_hooks_the_probe_sees_host_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe is a real check: with the session's input handling removed, CPU tensors reach the DiT."""

    class Nothing:
        count = 0

        def __init__(self, *args: Any) -> None: ...

        def remove(self) -> None: ...

    monkeypatch.setattr(torchferry.session._session, "Inputs", Nothing)
    off: list[str] = []
    with pytest.raises(RuntimeError):  # some op then meets a meta weight with a CPU input and refuses
        _probed_meta_call(toy.wan_pipeline(), off, {})
    assert "transformer: cpu" in off  # the latents, timestep and embeddings the pipeline made
    pipe = toy.wan_pipeline()
    with torchferry.offload(pipe, strategy="layerwise", device="meta"):
        assert pipe._execution_device == torch.device("cpu")  # where diffusers would build its inputs
