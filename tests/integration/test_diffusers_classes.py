"""Every diffusers transformer and UNet class streams with no declaration at all, bit for bit.

One tiny model per class installed (configs in `diffusers_zoo`), offloaded as a bare model under
layerwise depth 1 and 2 and model_level with nothing declared: its ring comes from the registry or
from structure. Layerwise must really offload (the step's peak device bytes below the model's).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from typing import Any

import diffusers_zoo as zoo
import pytest
import torch
from torch import nn

import torchferry
from torchferry import OffloadWarning, topology
from torchferry.topology._registry import DIT_BLOCK_ATTRS

diffusers = pytest.importorskip("diffusers")

# The models' own warnings on CPU (not torchferry's, which stay errors).
pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported"),
    pytest.mark.filterwarnings("ignore:.* is deprecated and will be removed:FutureWarning"),
]

#: Classes whose three runs take more than a few seconds on two cores.
SLOW = frozenset(
    {
        "AnyFlowFARTransformer3DModel",
        "AuraFlowTransformer2DModel",
        "MotifVideoTransformer3DModel",
        "UNetMotionModel",
        "UNetSpatioTemporalConditionModel",
    }
)


def _installed() -> list[str]:
    """Every transformer or UNet model class the installed diffusers exports at its top level."""
    found = set()
    for package in (diffusers.models.transformers, diffusers.models.unets):
        for name in dir(package):
            value = getattr(package, name, None)
            module = getattr(value, "__module__", "")
            if (
                inspect.isclass(value)
                and issubclass(value, nn.Module)
                and module.startswith(package.__name__)
                and hasattr(diffusers, name)
            ):
                found.add(name)
    return sorted(found)


def _first(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return _first(output[0])
    return _first(output.sample)


def _bytes(model: nn.Module) -> int:
    """The bytes the model would hold on the device whole: its packs, 256-byte aligned like a slot's."""
    return topology.discover(model).nbytes


def _run(model: nn.Module, spec: dict[str, Any]) -> torch.Tensor:
    # Fresh inputs each call: some forwards modify their inputs in place.
    with torch.no_grad():
        return _first(model(**zoo.make(spec, torch.Generator().manual_seed(0))))


def test_every_installed_class_has_a_tiny_config_or_a_reason() -> None:
    """Each transformer or UNet class of the installed diffusers is exercised below or left out on record."""
    missing = sorted(set(_installed()) - set(zoo.ZOO) - set(zoo.LEFT_OUT))
    assert missing == []
    assert len(zoo.ZOO) >= 60


def test_every_registered_class_runs_here() -> None:
    """Each class of the DiT registry has a tiny model in this test (adding one needs a test)."""
    assert set(DIT_BLOCK_ATTRS) <= set(zoo.ZOO)


def _params() -> list[Any]:
    return [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW else pytest.param(name)
        for name in sorted(zoo.ZOO)
        if hasattr(diffusers, name)
    ]


@pytest.mark.parametrize("name", _params())
def test_undeclared_diffusers_class_streams_bit_identical(name: str) -> None:
    """A bare model with nothing declared streams its blocks (peak below its bytes) to the plain output."""
    init, spec = zoo.ZOO[name]
    torch.manual_seed(0)
    model = getattr(diffusers, name)(**init).eval()
    reference = _run(model, spec)
    assert torch.isfinite(reference).all()
    total = _bytes(model)
    assert topology.discover(model).components[0].blocks, "no ring was found"
    for depth in (1, 2):
        with torchferry.offload(model, strategy="layerwise", prefetch_depth=depth, device="cpu") as session:
            streamed = _run(model, spec)
            peak = session.peak_device_bytes
        assert torch.equal(streamed, reference), f"layerwise depth {depth}"
        assert 0 < peak < total, f"layerwise depth {depth}: peak {peak} of {total} bytes"
    with (
        pytest.warns(OffloadWarning, match=re.escape("has no encoder component")),
        torchferry.offload(model, strategy="model_level", device="cpu") as session,
    ):
        streamed = _run(model, spec)
        assert session.peak_device_bytes > 0
    assert torch.equal(streamed, reference), "model_level"


def _pixart_sigma() -> Any:
    """A tiny PixArtSigmaPipeline: a class the pipeline registry does not list."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    init, _ = zoo.ZOO["PixArtTransformer2DModel"]
    encoder = transformers.T5EncoderModel(
        transformers.T5Config(
            vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=3, num_heads=2, decoder_start_token_id=0
        )
    ).eval()
    vae = diffusers.AutoencoderKL(
        block_out_channels=(4,), norm_num_groups=2, latent_channels=4, sample_size=8
    ).eval()
    return diffusers.PixArtSigmaPipeline(
        tokenizer=None,
        text_encoder=encoder,
        vae=vae,
        transformer=diffusers.PixArtTransformer2DModel(**init).eval(),
        scheduler=diffusers.DPMSolverMultistepScheduler(),
    )


def test_unregistered_pipeline_is_served_from_its_components() -> None:
    """A PixArtSigmaPipeline is read from its ``components``: its DiT and T5 stream, bit-identically."""
    pipe = _pixart_sigma()
    topo = topology.discover(pipe)
    assert [(c.path, c.kind, len(c.blocks)) for c in topo.components] == [
        ("transformer", "dit", 4),
        ("text_encoder", "encoder", 3),
        ("vae", "vae", 0),
    ]
    _, spec = zoo.ZOO["PixArtTransformer2DModel"]
    ids = torch.tensor([[3, 7, 1, 9, 2]])
    with torch.no_grad():
        embeds = pipe.text_encoder(ids).last_hidden_state
    reference = _run(pipe.transformer, spec)
    with torchferry.offload(
        pipe, strategy="layerwise", components=["dit", "text_encoder"], device="cpu"
    ) as session:
        with torch.no_grad():
            assert torch.equal(pipe.text_encoder(ids).last_hidden_state, embeds)
        assert torch.equal(_run(pipe.transformer, spec), reference)
        whole = sum(_bytes(m) for m in (pipe.transformer, pipe.text_encoder, pipe.vae))
        assert 0 < session.peak_device_bytes < whole


def _call_pixart(pipe: Any) -> torch.Tensor:
    embeds = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 5)
    with torch.no_grad():
        images = pipe(
            prompt_embeds=embeds,
            prompt_attention_mask=mask,
            negative_prompt=None,
            negative_prompt_embeds=embeds.flip(1),
            negative_prompt_attention_mask=mask,
            height=16,
            width=16,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
            use_resolution_binning=False,
        ).images
    assert isinstance(images, torch.Tensor)
    return images


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn.t accept a copy:DeprecationWarning")
@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
def test_unregistered_pipeline_call_is_bit_identical(strategy: str) -> None:
    """A whole PixArtSigmaPipeline call, found from its components, matches the plain call bit for bit."""
    pipe = _pixart_sigma()
    pipe.set_progress_bar_config(disable=True)
    reference = _call_pixart(pipe)
    with torchferry.offload(pipe, strategy=strategy, device="cpu") as session:
        assert torch.equal(_call_pixart(pipe), reference)
        assert session.peak_device_bytes > 0
    assert torch.equal(_call_pixart(pipe), reference)


@pytest.mark.parametrize("strategy", ["layerwise", "model_level", "none"])
def test_omnigen_whose_rotary_reassigns_inv_freq_runs_a_denoising_loop(strategy: str) -> None:
    """OmniGen's rotary embedding assigns a new ``self.inv_freq`` on every forward: repeated forwards (a
    denoising loop) run under every strategy, each equal to the plain one's."""
    init, spec = zoo.ZOO["OmniGenTransformer2DModel"]
    torch.manual_seed(0)
    model = diffusers.OmniGenTransformer2DModel(**init).eval()
    reference = _run(model, spec)
    alone = (
        pytest.warns(OffloadWarning, match=re.escape("has no encoder component"))
        if strategy == "model_level"
        else contextlib.nullcontext()
    )
    with alone, torchferry.offload(model, strategy=strategy, device="cpu"):
        assert all(torch.equal(_run(model, spec), reference) for _ in range(3))
    assert torch.equal(_run(model, spec), reference)
