"""torchferry inside vLLM-Omni, driven through the engine's own functions on the CPU.

Every test calls vLLM-Omni's code, not a copy: its plugin loader, `OmniDiffusionConfig.from_kwargs`,
`get_offload_backend` / `enable_offload_backend`, the diffusers loader that builds a
`DiffusersAdapterPipeline`, the adapter's `forward` on a `DiffusionRequestBatch`, its plan resolver
and its regional compile. The reference is the same engine path with no offload, its weights copied
into fresh storage (diffusers leaves them as views of the mapped files on the CPU, where kernels may
round differently by an ulp; docs/contract.md). Run by tools/vllm_omni_env.sh (docs/testing.md).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchferry
from torchferry.integrations import vllm_omni as tf_vllm

CPU = torch.device("cpu")
#: The worker's device: the CPU here; gpu_check runs these tests with TORCHFERRY_ENGINE_DEVICE=cuda.
DEVICE = torch.device(os.environ.get("TORCHFERRY_ENGINE_DEVICE", "cpu"))
SELECT = {"offload_backend": "torchferry"}
WAN_CALL = {
    "num_inference_steps": 2, "height": 16, "width": 16, "num_frames": 5, "guidance_scale": 2.0,
    "guidance_scale_2": 3.0, "output_type": "latent",
}  # fmt: skip
FLUX_CALL = {
    "num_inference_steps": 2,
    "height": 16,
    "width": 16,
    "guidance_scale": 3.5,
    "output_type": "latent",
}


def od_config(folder: Path, **kwargs: Any) -> Any:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    return OmniDiffusionConfig.from_kwargs(
        model=str(folder), diffusion_load_format="diffusers", dtype=torch.float32, **kwargs
    )


def load(config: Any) -> Any:
    """The pipeline as vLLM-Omni's diffusers loader builds it, on the load device its model runner picks
    (the CPU when an offload option is set, else the worker's device)."""
    from vllm.config import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    loader = DiffusersPipelineLoader(LoadConfig(), od_config=config)
    flags = ("enable_cpu_offload", "enable_layerwise_offload", "enable_distributed_layerwise_offload")
    load_device = "cpu" if any(getattr(config, f, False) for f in flags) else str(DEVICE)  # the runner's rule
    return loader.load_model(load_device=load_device, load_format="diffusers", device=DEVICE)


def enable(config: Any, pipeline: Any) -> tuple[Any, Any]:
    from vllm_omni.diffusion.offloader import enable_offload_backend

    return enable_offload_backend(config, pipeline, device=DEVICE)


def fresh(module: nn.Module) -> None:
    """Copy every weight into fresh storage, as ``.to(device)`` would (no views of mapped files)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.data = tensor.data.clone()


def requests(call: dict[str, Any]) -> list[Any]:
    """Two requests of different prompts and seeds, as the scheduler hands them to a pipeline."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    made = []
    for i, prompt in enumerate(["a red fox running through snow", "a ferry on the river at dawn"]):
        params = OmniDiffusionSamplingParams(seed=i, **call)
        made.append(
            DiffusionRequestBatch(
                [OmniDiffusionRequest(prompt=prompt, sampling_params=params, request_id=f"r{i}")]
            )
        )
    return made


def serve(pipeline: Any, call: dict[str, Any]) -> list[torch.Tensor]:
    return [pipeline.forward(request).output.cpu() for request in requests(call)]


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict(keep_vars=True).items()}


_REFERENCE: dict[str, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = {}


def reference(folder: Path, call: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The engine's own path with no offload: outputs of the two requests, and every weight."""
    key = str(folder)
    if key not in _REFERENCE:
        config = od_config(folder)
        pipeline = load(config)
        pipeline, backend = enable(config, pipeline)
        assert backend is None
        for component in pipeline._pipeline.components.values():
            if isinstance(component, nn.Module):
                fresh(component)
        _REFERENCE[key] = (serve(pipeline, call), _pipeline_weights(pipeline))
    return _REFERENCE[key]


def _pipeline_weights(adapter: Any) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{k}": v
        for name, component in adapter._pipeline.components.items()
        if isinstance(component, nn.Module)
        for k, v in weights(component).items()
    }


def test_the_plugin_loader_installs_torchferry_once() -> None:
    """vLLM-Omni's plugin loader ran `register`: its offloader and adapter hand over to torchferry,
    and registering again changes nothing."""
    from vllm_omni.diffusion import offloader
    from vllm_omni.diffusion.models.diffusers_adapter.pipeline_diffusers_adapter import (
        DiffusersAdapterPipeline,
    )

    assert offloader.get_offload_backend is tf_vllm.get_offload_backend
    stock = tf_vllm.get_offload_backend.__wrapped__  # type: ignore[attr-defined]
    assert stock.__module__ == "vllm_omni.diffusion.offloader"
    patched = DiffusersAdapterPipeline.load_weights
    tf_vllm.register()
    assert offloader.get_offload_backend is tf_vllm.get_offload_backend
    assert tf_vllm.get_offload_backend.__wrapped__ is stock  # type: ignore[attr-defined]
    assert DiffusersAdapterPipeline.load_weights is patched


def test_another_plugins_wrapper_over_torchferrys_is_kept(wan22: Path) -> None:
    """A plugin that wraps vLLM-Omni's function after torchferry (functools.wraps) stays in place when
    register runs again, and a stock config still reaches vLLM-Omni's own function through both."""
    import functools

    from vllm_omni.diffusion import offloader

    ours = offloader.get_offload_backend
    calls = []

    @functools.wraps(ours)
    def theirs(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return ours(*args, **kwargs)

    offloader.get_offload_backend = theirs
    try:
        tf_vllm.register()
        assert offloader.get_offload_backend is theirs
        with pytest.raises(NotImplementedError):  # vLLM-Omni's own function on a CPU, as stock
            offloader.get_offload_backend(od_config(wan22, enable_layerwise_offload=True), device=CPU)
        assert calls == [1]
    finally:
        offloader.get_offload_backend = ours


def test_a_stock_configuration_gets_the_stock_offloader(wan22: Path) -> None:
    """Without the selection vLLM-Omni's own function runs: on a CPU (no platform, no device) it fails
    as it does without torchferry installed, and the adapter loads with diffusers."""
    from vllm_omni.diffusion import offloader

    config = od_config(wan22, enable_layerwise_offload=True)
    stock = tf_vllm.get_offload_backend.__wrapped__  # type: ignore[attr-defined]
    for function in (stock, offloader.get_offload_backend):
        with pytest.raises(NotImplementedError):  # vLLM-Omni 0.30 words its warning with no device name
            function(config, device=CPU)
    pipeline = load(od_config(wan22))
    assert not hasattr(pipeline, "_torchferry_open")
    assert all(p.device == CPU for p in pipeline._pipeline.transformer.parameters())


@pytest.mark.parametrize(
    "options",
    [
        {"enable_layerwise_offload": True},
        {"enable_cpu_offload": True},
        {"enable_layerwise_offload": True, "additional_config": {"torchferry": {"prefetch_depth": 2}}},
        {"enable_layerwise_offload": True, "additional_config": {"torchferry": {"strategy": "auto"}}},
    ],
    ids=["layerwise", "model_level", "depth2", "auto"],
)
def test_the_diffusers_backend_serves_wan22_bit_exact(wan22: Path, options: dict[str, Any]) -> None:
    """A Wan 2.2 folder (two experts) served by vLLM-Omni's diffusers backend with torchferry: two
    requests give the no-offload engine's outputs bit for bit, and disable() gives every weight back."""
    expected, expected_weights = reference(wan22, WAN_CALL)
    extra = options.get("additional_config", {})
    config = od_config(wan22, **{**options, "additional_config": {**SELECT, **extra}})
    pipeline, backend = enable(config, load(config))
    assert isinstance(backend, tf_vllm.TorchferryBackend) and backend.is_enabled()
    assert backend.session is not None and torchferry.session_of(pipeline._pipeline) is backend.session
    got = serve(pipeline, WAN_CALL)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    backend.disable()
    assert not backend.is_enabled() and backend.session is None
    after = _pipeline_weights(pipeline)
    assert after.keys() == expected_weights.keys()
    assert all(v.device == CPU and torch.equal(v, expected_weights[k]) for k, v in after.items())


def test_a_host_budget_leaves_packs_in_the_folder_and_stays_exact(wan22: Path) -> None:
    """additional_config["torchferry"]["host_memory"] below the model: the session reads some packs
    from the folder's files on demand (the file tier), and the outputs are still the engine's."""
    expected, _ = reference(wan22, WAN_CALL)
    options = {"host_memory": "300KiB"}
    config = od_config(
        wan22, enable_layerwise_offload=True, additional_config={**SELECT, "torchferry": options}
    )
    pipeline, backend = enable(config, load(config))
    report = backend.session.report()
    assert report.file_packs > 0, report
    got = serve(pipeline, WAN_CALL)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    backend.shutdown()
    assert backend.session is None


def test_the_diffusers_backend_serves_flux_bit_exact(flux: Path) -> None:
    """A FLUX.1 folder served by the diffusers backend with torchferry layerwise: the no-offload
    engine's outputs over two requests, bit for bit."""
    expected, _ = reference(flux, FLUX_CALL)
    config = od_config(flux, enable_layerwise_offload=True, additional_config=SELECT)
    pipeline, backend = enable(config, load(config))
    got = serve(pipeline, FLUX_CALL)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    backend.shutdown()


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (
            {"additional_config": {**SELECT, "torchferry": {"prefetch_depht": 2}}},
            "unknown key(s) 'prefetch_depht'",
        ),
        (
            {"additional_config": {**SELECT, "torchferry": {"prefetch_depth": "2"}}},
            "[\"prefetch_depth\"]='2'",
        ),
        (
            {"additional_config": {**SELECT, "torchferry": {"components": ["dit"]}}},
            'diffusion_offload_config["components"]',
        ),
        (
            {"additional_config": {**SELECT, "torchferry": {"strategy": "model_level"}}},
            "enable_layerwise_offload=True",
        ),
        (
            {"additional_config": {**SELECT, "torchferry": {"host_memory": "lots"}}},
            "[\"host_memory\"]='lots'",
        ),
        ({"additional_config": {**SELECT, "torchferry": "fast"}}, "must be a mapping"),
    ],
    ids=["unknown", "type", "engine_name", "strategy", "size", "not_a_mapping"],
)
def test_misconfiguration_is_refused_when_the_backend_is_built(
    wan22: Path, options: dict[str, Any], words: str
) -> None:
    """A request torchferry cannot serve is a PlanError in the engine's words, from vLLM-Omni's loader
    (before the pipeline is built) and from its enable_offload_backend (before any weight moves)."""
    config = od_config(wan22, enable_layerwise_offload=True, **options)
    with pytest.raises(torchferry.PlanError) as caught:
        load(config)
    assert words in str(caught.value)
    pipeline = _native(wan22)
    before = weights(pipeline)
    with pytest.raises(torchferry.PlanError) as caught:
        enable(config, pipeline)
    assert words in str(caught.value)
    assert torchferry.session_of(pipeline) is None
    assert all(torch.equal(v, before[k]) for k, v in weights(pipeline).items())


def test_selecting_torchferry_without_an_offload_option_is_refused(wan22: Path) -> None:
    """The selection alone would leave the loader putting every weight on the device: refused, naming
    the flags that keep the weights on the CPU."""
    from vllm_omni.diffusion import offloader

    with pytest.raises(torchferry.PlanError, match="none of vLLM-Omni's offload options is set"):
        offloader.get_offload_backend(od_config(wan22, additional_config=SELECT), device=CPU)


def test_a_cache_backend_is_refused_at_startup(wan22: Path) -> None:
    """TeaCache skips transformer blocks: with torchferry selected it is refused when the backend is built."""
    from vllm_omni.diffusion import offloader
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    config = OmniDiffusionConfig.from_kwargs(
        model=str(wan22), dtype=torch.float32, enable_layerwise_offload=True, cache_backend="tea_cache",
        additional_config=SELECT,
    )  # fmt: skip
    with pytest.raises(torchferry.PlanError, match="cache_backend='tea_cache'"):
        offloader.get_offload_backend(config, device=CPU)


# -------------------------------------------------------------------------------------------------
# A native pipeline: a plain nn.Module with vLLM-Omni's declarations and its own OffloadPlan


def _native(folder: Path) -> nn.Module:
    import diffusers
    import transformers
    from vllm_omni.diffusion.offloader import OffloadPlan

    class NativeWan22(nn.Module):
        """A native vLLM-Omni pipeline's shape: components as attributes, declared in class lists."""

        _dit_modules = ("transformer", "transformer_2")
        _encoder_modules = ("text_encoder",)
        _vae_modules = ("vae",)
        _offload_plan = OffloadPlan(
            block_attrs={"transformer": ("blocks",), "transformer_2": ("blocks",)},
            encoder_block_attrs={"text_encoder": ("encoder.block",)},
        )

        def __init__(self) -> None:
            super().__init__()
            self.text_encoder = transformers.UMT5EncoderModel.from_pretrained(folder / "text_encoder")
            self.transformer = diffusers.WanTransformer3DModel.from_pretrained(folder / "transformer")
            self.transformer_2 = diffusers.WanTransformer3DModel.from_pretrained(folder / "transformer_2")
            self.vae = diffusers.AutoencoderKLWan.from_pretrained(folder / "vae")

        def forward(self, ids: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            embeds = self.text_encoder(ids).last_hidden_state
            t = torch.tensor([900.0])
            latents = latents - 0.5 * self.transformer(latents, t, embeds, return_dict=False)[0]
            t = torch.tensor([300.0])
            latents = latents - 0.5 * self.transformer_2(latents, t, embeds, return_dict=False)[0]
            decoded: torch.Tensor = self.vae.decode(latents, return_dict=False)[0]
            return decoded

    pipeline = NativeWan22().eval()
    fresh(pipeline)
    return pipeline


IDS = torch.tensor([[3, 7, 1, 9, 2, 5, 0, 0]])
LATENTS = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("flag", ["enable_layerwise_offload", "enable_cpu_offload"])
def test_a_native_pipeline_is_served_bit_exact(wan22: Path, flag: str) -> None:
    """A pipeline declaring _dit_modules/_encoder_modules/_vae_modules and an OffloadPlan, enabled
    through vLLM-Omni's enable_offload_backend: its forward equals the plain run, twice, and disable()
    gives back every weight as it was."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    pipeline = _native(wan22)
    plain = copy.deepcopy(pipeline)
    with torch.no_grad():
        expected = plain(IDS, LATENTS)
    before = weights(pipeline)
    config = OmniDiffusionConfig.from_kwargs(
        model=str(wan22), dtype=torch.float32, additional_config=SELECT, **{flag: True}
    )
    pipeline, backend = enable(config, pipeline)
    with torch.no_grad():
        assert torch.equal(pipeline(IDS, LATENTS), expected)
        assert torch.equal(pipeline(IDS, LATENTS), expected)
    backend.disable()
    after = weights(pipeline)
    assert all(v.device == CPU and torch.equal(v, before[k]) for k, v in after.items())


def test_the_discovered_plan_is_vllm_omnis_own(wan22: Path) -> None:
    """torchferry's discovery of the native pipeline streams exactly the block stacks vLLM-Omni's own
    plan resolver makes of it, with the same DiTs, encoders and VAEs."""
    from vllm_omni.diffusion.offloader import OffloadConfig, resolve_offload_plan
    from vllm_omni.diffusion.offloader.config import OffloadStrategy

    pipeline = _native(wan22)
    theirs = resolve_offload_plan(pipeline, OffloadConfig(strategy=OffloadStrategy.LAYER_WISE))
    names = {id(m): n for n, m in pipeline.named_modules()}
    their_stacks = {
        component.path: [[names[id(b)] for b in stack.blocks] for stack in component.stacks]
        for component in (*theirs.dits, *theirs.encoders)
        if component.stacks
    }
    from torchferry.integrations.vllm_omni._backend import declaration_of

    ours = torchferry.topology.discover(pipeline, declaration_of(pipeline))
    our_stacks = {
        component.path: [[block.path for block in stack.blocks] for stack in component.stacks]
        for component in ours.components
        if component.stacks
    }
    assert our_stacks == their_stacks
    kinds = {c.path: c.kind for c in ours.components}
    assert {p for p, k in kinds.items() if k == "dit"} == {c.path for c in theirs.dits}
    assert {p for p, k in kinds.items() if k == "encoder"} == {c.path for c in theirs.encoders}
    assert {p for p, k in kinds.items() if k == "vae"} == {c.path for c in theirs.vaes}


def test_the_runners_regional_compile_composes(wan22: Path) -> None:
    """vLLM-Omni's runner compiles after enabling offload: regionally_compile on the served DiTs runs,
    and equals the same compile of the plain pipeline bit for bit."""
    from vllm_omni.diffusion.compile import regionally_compile
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    pipeline = _native(wan22)
    plain = copy.deepcopy(pipeline)
    for name in ("transformer", "transformer_2"):
        setattr(plain, name, regionally_compile(getattr(plain, name), backend="aot_eager"))
    with torch.no_grad():
        expected = plain(IDS, LATENTS)
    config = OmniDiffusionConfig.from_kwargs(
        model=str(wan22), dtype=torch.float32, additional_config=SELECT, enable_layerwise_offload=True
    )
    pipeline, backend = enable(config, pipeline)
    for name in ("transformer", "transformer_2"):
        setattr(pipeline, name, regionally_compile(getattr(pipeline, name), backend="aot_eager"))
    with torch.no_grad():
        assert torch.equal(pipeline(IDS, LATENTS), expected)
    backend.shutdown()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a whole Omni engine needs vLLM-Omni's CUDA platform")
def test_one_generation_through_the_engine(wan22: Path) -> None:
    """One generation through a real Omni(...) engine (its worker processes, loader, runner) with
    torchferry selected gives the latents of the same engine with no offload."""
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    outputs = []
    for options in ({}, {"enable_layerwise_offload": True, "additional_config": SELECT}):
        omni = Omni(model=str(wan22), diffusion_load_format="diffusers", dtype=torch.float32, **options)
        try:
            params = OmniDiffusionSamplingParams(seed=0, **WAN_CALL)
            made = omni.generate("a red fox running through snow", params)
            outputs.append(made[0].latents if made[0].latents is not None else made[0].images)
        finally:
            omni.close()
    assert outputs[0] is not None
    if isinstance(outputs[0], torch.Tensor):
        assert torch.equal(outputs[0].cpu(), outputs[1].cpu())
    else:
        assert [list(i.getdata()) for i in outputs[0]] == [list(i.getdata()) for i in outputs[1]]


def _distributed_rank(rank: int, port: int, folder: str, out: str) -> None:
    """One rank of vLLM-Omni's DP group of 2 (gloo), serving the native pipeline distributed."""
    import json

    import torch.distributed as dist
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()
    # vLLM-Omni sets a device per rank after making the world group, and has no CPU platform: the world
    # group is made here first, then vLLM-Omni builds its own groups over it as its workers do.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo")
    initialize_model_parallel(data_parallel_size=2, backend="gloo")
    pipeline = _native(Path(folder))
    plain = copy.deepcopy(pipeline)
    with torch.no_grad():
        expected = plain(IDS, LATENTS)
    config = OmniDiffusionConfig.from_kwargs(
        model=folder, dtype=torch.float32, enable_distributed_layerwise_offload=True,
        parallel_config={"data_parallel_size": 2}, additional_config=SELECT,
    )  # fmt: skip
    groups = len(dist.distributed_c10d._world.pg_map)
    pipeline, backend = enable(config, pipeline)
    made = len(dist.distributed_c10d._world.pg_map) - groups
    with torch.no_grad():
        same = [torch.equal(pipeline(IDS, LATENTS), expected) for _ in range(2)]
    policy = backend.session.running_policy
    backend.session.close(gather=True)  # a collective: every rank gets full weights back
    backend.disable()
    pairs = zip(pipeline.state_dict().values(), plain.state_dict().values(), strict=True)
    weights_back = all(torch.equal(a, b) for a, b in pairs)
    Path(out, f"{rank}.json").write_text(json.dumps({"same": same, "policy": policy, "groups_made": made,
                                                      "weights_back": weights_back}))  # fmt: skip
    dist.destroy_process_group()


def test_distributed_layerwise_shards_over_the_engines_dp_group(wan22: Path, tmp_path: Path) -> None:
    """enable_distributed_layerwise_offload under vLLM-Omni's DP group of 2 (gloo): each rank's forward
    equals the plain run twice, the session makes no process group of its own, and a gathering close
    gives every rank its full weights back."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_distributed_rank, args=(port, str(wan22), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got == {"same": [True, True], "policy": "distributed_layerwise(depth=1)", "groups_made": 0,
                       "weights_back": True}  # fmt: skip


def test_a_pipeline_that_owns_its_model_level_lifecycle_is_delegated_to(wan22: Path) -> None:
    """Under enable_cpu_offload, a pipeline with enable_omni_model_cpu_offload owns its lifecycle, as
    vLLM-Omni's model-level backend treats it: enabled with the engine's device, pinning, HSDP and
    selection, disabled by disable(), and no torchferry session opened."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.offloader import SupportsModelCpuOffload

    calls: list[tuple[str, dict[str, Any]]] = []

    class Owning(nn.Module):
        _dit_modules = ("transformer",)

        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.Linear(4, 4)

        def enable_omni_model_cpu_offload(self, **options: Any) -> None:
            calls.append(("enable", options))

        def disable_omni_model_cpu_offload(self) -> None:
            calls.append(("disable", {}))

    pipeline = Owning()
    assert isinstance(pipeline, SupportsModelCpuOffload)
    config = OmniDiffusionConfig.from_kwargs(
        model=str(wan22), dtype=torch.float32, enable_cpu_offload=True, pin_cpu_memory=False,
        additional_config=SELECT,
    )  # fmt: skip
    pipeline, backend = enable(config, pipeline)
    assert backend.is_enabled() and backend.session is None and torchferry.session_of(pipeline) is None
    backend.disable()
    assert calls == [("enable", {"device": DEVICE, "pin_memory": False, "use_hsdp": False}), ("disable", {})]
    calls.clear()
    options = {**SELECT, "torchferry": {"host_memory": "8GiB"}}
    config = OmniDiffusionConfig.from_kwargs(
        model=str(wan22), dtype=torch.float32, enable_cpu_offload=True, additional_config=options
    )
    with pytest.raises(torchferry.PlanError, match=re.escape("torchferry serves none of")):
        enable(config, pipeline)
    assert calls == []
