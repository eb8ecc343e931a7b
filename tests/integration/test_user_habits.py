"""What users do around a session: LoRA adapters, other offloaders, nested sessions, odd storage.

Each test runs real torch (and real diffusers, accelerate and peft) on the CPU: the habit either
gives the plain output bit for bit, or is refused with a whole message before anything changes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import diffusers_zoo as zoo
import pytest
import torch
from tiny import Model
from torch import nn

import torchferry
from torchferry import ExecutionError, OffloadError, PlanError, topology
from torchferry.testing import toy

diffusers = pytest.importorskip("diffusers")

pytestmark = [pytest.mark.filterwarnings("ignore:.* is deprecated and will be removed:FutureWarning")]


# ------------------------------------------------------------------------------------ fixtures
class Pipeline:
    """A pipeline object holding one transformer, declared as its DiT."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []

    def __init__(self, transformer: nn.Module) -> None:
        self.transformer = transformer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.transformer(x)
        return out


def _x() -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def _flux() -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(0)
    init, spec = zoo.ZOO["FluxTransformer2DModel"]
    return diffusers.FluxTransformer2DModel(**init).eval(), spec


def _run(model: nn.Module, spec: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(**zoo.make(spec, torch.Generator().manual_seed(0))).sample
    return out


def _lora() -> Any:
    peft = pytest.importorskip("peft")
    targets = ["to_q", "to_k", "to_v"]
    return peft.LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------- LoRA
def test_lora_added_before_opening_streams_with_its_blocks() -> None:
    """A diffusers ``add_adapter`` LoRA streams with its blocks: adapter weights are planned, output exact."""
    model, spec = _flux()
    torch.manual_seed(1)
    model.add_adapter(_lora())
    reference = _run(model, spec)
    blocks = topology.discover(model).components[0].blocks
    assert any("lora_A" in t.name for b in blocks for t in b.tensors)
    for depth in (1, 2):
        with torchferry.offload(model, strategy="layerwise", prefetch_depth=depth, device="cpu") as session:
            assert torch.equal(_run(model, spec), reference)
            assert torch.equal(_run(model, spec), reference)
            assert 0 < session.peak_device_bytes < session.host_bytes
    assert torch.equal(_run(model, spec), reference)


def test_lora_loaded_from_a_state_dict_streams_bit_identical() -> None:
    """``load_lora_adapter`` with a peft LoRA state dict streams to the output of the model it came from."""
    pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict

    source, spec = _flux()
    torch.manual_seed(1)
    source.add_adapter(_lora())
    reference = _run(source, spec)
    model, _ = _flux()
    model.load_lora_adapter(get_peft_model_state_dict(source), prefix=None, adapter_name="default")
    with torchferry.offload(model, strategy="layerwise", device="cpu"):
        assert torch.equal(_run(model, spec), reference)


def test_peft_injected_adapter_streams_bit_identical() -> None:
    """peft's ``inject_adapter_in_model`` on a plain torch model streams to the plain output."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = Model().eval()
    config = peft.LoraConfig(r=2, target_modules=["linear"], init_lora_weights=False)
    peft.inject_adapter_in_model(config, model)
    with torch.no_grad():
        reference = model(_x())
    with torch.no_grad(), torchferry.offload(model, strategy="layerwise", device="cpu"):
        assert torch.equal(model(_x()), reference)


def test_lora_added_after_opening_runs_on_the_session_device() -> None:
    """An adapter added to a served model on the session's device runs where it is, to the plain output."""
    model, spec = _flux()
    twin, _ = _flux()
    torch.manual_seed(1)
    twin.add_adapter(_lora())
    with torchferry.offload(model, strategy="layerwise", device="cpu"):
        _run(model, spec)
        torch.manual_seed(1)
        model.add_adapter(_lora())
        assert torch.equal(_run(model, spec), _run(twin, spec))
    assert torch.equal(_run(model, spec), _run(twin, spec))


def test_tensor_added_on_another_device_after_opening_is_refused() -> None:
    """A tensor added after opening on another device than the session's is an ExecutionError when it runs."""
    torch.manual_seed(0)
    pipe = Pipeline(Model().eval())
    with torchferry.offload(pipe, strategy="layerwise", device="cpu"), torch.no_grad():
        pipe(_x())
        added = nn.Parameter(torch.ones(8, device="meta"))
        pipe.transformer.blocks[2].linear.register_parameter("scale", added)
        with pytest.raises(ExecutionError) as caught:
            pipe(_x())
    assert str(caught.value) == (
        "1 tensor(s) of 'transformer' were added after the torchferry session opened and are on another "
        "device than its cpu ('transformer.blocks.2.linear.scale'; a LoRA adapter loaded into a served "
        "model?): the session moves only the tensors it planned; close() the session, add the adapters, "
        "then open a new one (adapters loaded before opening stream with their blocks)"
    )


def _fuse(model: Any) -> None:
    model.fuse_lora()


def _merge(model: Any) -> None:
    peft = pytest.importorskip("peft")
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()


@pytest.mark.parametrize("edit", [_fuse, _merge], ids=["fuse_lora", "peft_merge"])
def test_fusing_a_lora_after_the_first_call_is_right_or_an_error(edit: Any) -> None:
    """Fusing or merging a LoRA in a session gives the plain fused output, during and after, or an error."""
    model, spec = _flux()
    plain, _ = _flux()
    for m in (model, plain):
        torch.manual_seed(1)
        m.add_adapter(_lora())
    edit(plain)
    fused = _run(plain, spec)
    try:
        with torchferry.offload(model, strategy="layerwise", device="cpu"):
            _run(model, spec)
            edit(model)
            during = _run(model, spec)
        after = _run(model, spec)
    except OffloadError:
        return
    assert torch.equal(during, fused)
    assert torch.equal(after, fused)


# ------------------------------------------------------------------------- other offloaders
FOREIGN = (
    "torchferry.offload cannot serve a pipeline that another offloader also moves or re-casts "
    "(torchferry moves every weight itself):\n  "
)
ACCELERATE_FIX = (
    "pipe.remove_all_hooks() undoes enable_model_cpu_offload() and enable_sequential_cpu_offload(), "
    "accelerate.hooks.remove_hook_from_module(module, recurse=True) any other accelerate hook "
    "(and load without device_map=)"
)
DIFFUSERS_FIX = "build the model without diffusers' group offloading (torchferry streams the blocks itself)"


def _pixart_sigma() -> Any:
    """A tiny PixArtSigmaPipeline with a T5 encoder and a VAE."""
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
    )
    return diffusers.PixArtSigmaPipeline(
        tokenizer=None,
        text_encoder=encoder,
        vae=vae.eval(),
        transformer=diffusers.PixArtTransformer2DModel(**init).eval(),
        scheduler=diffusers.DPMSolverMultistepScheduler(),
    )


def test_model_cpu_offload_is_refused_until_its_hooks_are_removed() -> None:
    """After ``enable_model_cpu_offload()`` a PlanError names each hooked component; unhooked, it opens."""
    pipe = _pixart_sigma()
    pipe.enable_model_cpu_offload(device="cpu")
    with pytest.raises(PlanError) as caught:
        torchferry.offload(pipe, strategy="layerwise", device="cpu")
    assert str(caught.value) == (
        FOREIGN + "'transformer': an accelerate hook (CpuOffload)\n  'text_encoder': an accelerate hook "
        "(CpuOffload)\n  'vae': an accelerate hook (CpuOffload)\nRemove them first: " + ACCELERATE_FIX
    )
    pipe.remove_all_hooks()
    with torchferry.offload(pipe, strategy="layerwise", device="cpu") as session:
        assert session.hook_count > 0


def test_accelerate_hook_on_a_model_is_refused() -> None:
    """A model carrying an accelerate ``AlignDevicesHook`` is a PlanError before anything changes."""
    hooks = pytest.importorskip("accelerate.hooks")
    torch.manual_seed(0)
    model = Model().eval()
    hooks.add_hook_to_module(model.blocks[1], hooks.AlignDevicesHook(execution_device="cpu"))
    before = _weights(model)
    with pytest.raises(PlanError) as caught:
        torchferry.offload(model, strategy="layerwise", device="cpu")
    assert str(caught.value) == (
        FOREIGN + "'blocks.1': an accelerate hook (AlignDevicesHook)\nRemove them first: " + ACCELERATE_FIX
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_group_offloading_on_a_model_is_refused() -> None:
    """A model with diffusers group offloading (``enable_group_offload``) is a PlanError naming the hooks."""
    model, _ = _flux()
    model.enable_group_offload(
        onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1
    )
    with pytest.raises(PlanError) as caught:
        torchferry.offload(model, strategy="layerwise", device="cpu")
    message = str(caught.value)
    assert message.startswith(
        FOREIGN
        + "the model: diffusers group offloading (enable_group_offload / apply_group_offloading) hooks\n  "
    )
    assert message.endswith("\nRemove them first: " + DIFFUSERS_FIX)


def test_group_offloading_on_a_component_is_refused() -> None:
    """``apply_group_offloading`` on a pipeline's transformer is a PlanError at opening the pipeline."""
    from diffusers.hooks import apply_group_offloading

    pipe = _pixart_sigma()
    apply_group_offloading(
        pipe.transformer, onload_device=torch.device("cpu"), offload_type="leaf_level"
    )
    with pytest.raises(PlanError) as caught:
        torchferry.offload(pipe, strategy="layerwise", device="cpu")
    assert str(caught.value).startswith(
        FOREIGN + "'transformer': diffusers group offloading (enable_group_offload / apply_group_offloading) "
        "hooks\n  'transformer.pos_embed': diffusers group offloading"
    )


def test_layerwise_casting_whose_cast_back_loses_bits_is_refused() -> None:
    """diffusers layerwise casting stored in float16 and computed in bfloat16 rewrites the stored weights
    at every forward (the round trip loses bits), so it is a PlanError naming the layer and the fix;
    a widening pair runs (tests/integration/test_quantized.py)."""
    model, _ = _flux()
    model.enable_layerwise_casting(storage_dtype=torch.float16, compute_dtype=torch.bfloat16)
    found = (
        "'time_text_embed.timestep_embedder.linear_1': diffusers layerwise casting from float16 to "
        "bfloat16, whose cast back rewrites the stored weights at each forward"
    )
    with pytest.raises(PlanError, match=re.escape(found)) as caught:
        torchferry.offload(model, strategy="layerwise", device="cpu")
    assert str(caught.value).endswith(
        "Remove them first: cast layerwise to a compute dtype that holds every stored value (float8 to "
        "bfloat16, float16 or float32; bfloat16 or float16 to float32), or pass storage_dtype= to "
        "torchferry.offload instead"
    )


def _enable(pipe: Any, offloader: str) -> None:
    if offloader == "model":
        pipe.enable_model_cpu_offload(device="cpu")
    elif offloader == "sequential":
        pipe.enable_sequential_cpu_offload(device="cpu")
    else:
        pipe.enable_group_offload(
            onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1
        )


#: offloader enabled during a session -> how the refusal names it, and its fix.
ENABLED = {
    "model": (
        "diffusers' model CPU offload (pipe.enable_model_cpu_offload())",
        "pipe.remove_all_hooks() removes diffusers' model CPU offload, and the session goes on",
    ),
    "sequential": (
        "diffusers' sequential CPU offload (pipe.enable_sequential_cpu_offload()) or another accelerate "
        "device-alignment hook",
        "sequential CPU offload has also swapped the weights it moves: close() the session (its host "
        "copies give every weight back), call pipe.remove_all_hooks(), then open a new one",
    ),
    "group": (
        "diffusers group offloading (enable_group_offload / apply_group_offloading)",
        "close() the session (diffusers has no call that removes group offloading) and use one of the two",
    ),
}


@pytest.mark.parametrize("offloader", sorted(ENABLED))
def test_an_offloader_enabled_during_a_session_is_named_at_the_next_step(offloader: str) -> None:
    """enable_model_cpu_offload, enable_sequential_cpu_offload or enable_group_offload on a served
    pipeline is refused when a served component's forward begins, naming that offloader and what to
    do; after the fix the pipeline runs (model offload) or closes (all three) with its own weights."""
    ref = toy.wan_pipeline()
    expected = toy.run_wan(ref)
    pipe = toy.wan_pipeline()
    session = torchferry.offload(pipe, strategy="layerwise", device="cpu")
    _enable(pipe, offloader)
    with pytest.raises(ExecutionError) as caught:
        toy.run_wan(pipe)
    what, fix = ENABLED[offloader]
    assert str(caught.value) == (
        f"'text_encoder' has hooks of {what}, enabled after the torchferry session opened: two "
        f"offloaders would move the same weights, so this step was refused; {fix}"
    )
    if offloader == "model":
        pipe.remove_all_hooks()
        assert torch.equal(toy.run_wan(pipe)[1], expected[1])
    session.close()
    if offloader == "sequential":
        pipe.remove_all_hooks()
    for name in ("transformer", "text_encoder", "vae"):
        mine, theirs = getattr(pipe, name).state_dict(), getattr(ref, name).state_dict()
        assert all(torch.equal(v, mine[k]) for k, v in theirs.items()), name


def test_second_session_on_a_served_component_is_refused() -> None:
    """A session on ``pipe.transformer`` while ``pipe`` is served is an ExecutionError, and the reverse."""
    torch.manual_seed(0)
    pipe = Pipeline(Model().eval())
    with (
        torchferry.offload(pipe, strategy="layerwise", device="cpu"),
        pytest.raises(ExecutionError) as caught,
    ):
        torchferry.offload(pipe.transformer, strategy="layerwise", device="cpu")
    assert str(caught.value) == (
        "tensor 'proj_in.weight' of this Model is already served by the open torchferry session on a "
        "Pipeline: a module can be served by one session at a time; close() that session first, or "
        "offload the whole pipeline in one session"
    )
    reverse = "tensor 'transformer.proj_in.weight' of this Pipeline is already served"
    with (
        torchferry.offload(pipe.transformer, strategy="layerwise", device="cpu"),
        pytest.raises(ExecutionError, match=re.escape(reverse)),
    ):
        torchferry.offload(pipe, strategy="layerwise", device="cpu")
    with torchferry.offload(pipe, strategy="layerwise", device="cpu"), torch.no_grad():
        pipe(_x())  # both closed: the pipeline opens again


# ----------------------------------------------------------------- calls outside the forward
class CallsABlock:
    """A pipeline that runs its transformer, then one of its blocks directly (outside its forward)."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.transformer = Model().eval()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.transformer(x)
        out: torch.Tensor = self.transformer.blocks[0](x)
        return out


def test_block_called_outside_its_component_is_an_error() -> None:
    """A block the pipeline calls outside its component's forward raises instead of running unmanaged."""
    torch.manual_seed(0)
    pipe = CallsABlock()
    with (
        torch.no_grad(),
        torchferry.offload(pipe, strategy="layerwise", device="cpu"),
        pytest.raises(ExecutionError) as caught,
    ):
        pipe(_x())
    assert str(caught.value) == (
        "block transformer.blocks.0 ran outside the forward of its component 'transformer' while its "
        "weights were still in flight (loaded but never waited for): torchferry loads the blocks of "
        "'transformer' only while its forward runs, and this block was called directly (by the pipeline's "
        "own code?); call it from inside the forward of 'transformer', or keep 'transformer' on the device "
        "(leave it out with components=[...], or use strategy='none')"
    )


def test_block_called_outside_its_component_runs_when_resident() -> None:
    """Under strategy none the block stays on the device, so the outside call gives the plain output."""
    torch.manual_seed(0)
    pipe = CallsABlock()
    with torch.no_grad():
        reference = pipe(_x())
    with torch.no_grad(), torchferry.offload(pipe, strategy="none", device="cpu"):
        assert torch.equal(pipe(_x()), reference)


# ------------------------------------------------------------------- storage given back as it was
class Aliased(nn.Module):
    """A block with two Parameter objects over one storage (the second made from the first's data)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.again = nn.Parameter(self.weight.data)
        self.seen: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.weight.data_ptr(), self.again.data_ptr()))
        return x + x @ self.weight + x @ self.again


def test_second_parameter_object_on_one_storage_moves_with_its_owner() -> None:
    """An alias Parameter object moves with its owner in the session and shares its storage after close."""
    torch.manual_seed(0)
    model = Model().eval()
    model.blocks[1] = Aliased()  # type: ignore[assignment]
    block = model.blocks[1]
    assert isinstance(block, Aliased)
    spec = next(t for b in topology.discover(model).components[0].blocks for t in b.tensors if t.aliases)
    assert (spec.name, spec.aliases) == ("blocks.1.weight", ("blocks.1.again",))
    original = block.weight.data_ptr()
    with torch.no_grad():
        reference = model(_x())
    with torch.no_grad(), torchferry.offload(model, strategy="layerwise", device="cpu"):
        assert torch.equal(model(_x()), reference)
    weight, again = block.seen[-1]
    assert weight == again != original
    assert block.weight.data_ptr() == block.again.data_ptr()
    assert block.weight is not block.again


class AliasedModel(Model):
    """`Model` whose blocks each hold two Parameter objects over one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Aliased() for _ in range(4))


def test_alias_objects_built_on_meta_are_filled_from_a_checkpoint(tmp_path: Path) -> None:
    """Aliases made under ``meta_parameters`` get their owner's checkpoint bytes and stay tied after close."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = AliasedModel().eval()
    with torch.no_grad():
        reference = source(_x())
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items() if not k.endswith(".again")}, path)
    with torchferry.meta_parameters():
        model = AliasedModel().eval()
    with torch.no_grad(), torchferry.offload(model, strategy="layerwise", device="cpu", checkpoint=str(path)):
        assert torch.equal(model(_x()), reference)
    for block in model.blocks:
        assert isinstance(block, Aliased)
        assert not block.again.is_meta
        assert block.again.data_ptr() == block.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(_x()), reference)


def test_close_gives_back_strides_offsets_and_shared_storage() -> None:
    """Gapped strides, a transposed weight and disjoint views of one storage come back as they were."""
    torch.manual_seed(0)
    model = Model().eval()
    wide = torch.randn(8, 16)
    base = torch.randn(160)
    blocks = [b.linear for b in model.blocks]  # type: ignore[union-attr]
    blocks[0].bias = nn.Parameter(wide[0, ::2])  # gapped: stored densely while the session runs
    blocks[1].weight = nn.Parameter(base[:64].view(8, 8))
    blocks[2].weight = nn.Parameter(base[80:144].view(8, 8))
    blocks[3].weight = nn.Parameter(torch.randn(8, 8).t())
    # The tensors the parameters were made from would share their memory from outside the session
    # (refused at open, see the contract): only the parameters keep the storages now.
    del wide, base

    def layout() -> list[tuple[tuple[int, ...], int, int]]:
        tensors = [blocks[0].bias, *(b.weight for b in blocks[1:])]
        return [(t.stride(), t.storage_offset(), t.untyped_storage().nbytes()) for t in tensors]

    before, values = layout(), _weights(model)
    with torch.no_grad():
        reference = model(_x())
    with torch.no_grad(), torchferry.offload(model, strategy="layerwise", device="cpu"):
        assert torch.equal(model(_x()), reference)
    assert layout() == before == [((2,), 0, 512), ((8, 1), 0, 640), ((8, 1), 80, 640), ((1, 8), 0, 256)]
    assert blocks[1].weight.untyped_storage().data_ptr() == blocks[2].weight.untyped_storage().data_ptr()
    assert all(torch.equal(v, values[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(_x()), reference)


def _cuda(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, dict):
        return {k: _cuda(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cuda(v) for v in value)
    return value


@pytest.mark.gpu
def test_lora_added_after_opening_on_cuda_is_refused() -> None:
    """On CUDA, adapter weights made on the host after opening are an ExecutionError, not a device clash."""
    model, spec = _flux()

    def run() -> None:
        with torch.no_grad():
            model(**_cuda(zoo.make(spec, torch.Generator().manual_seed(0))))

    with torchferry.offload(model, strategy="layerwise", device="cuda"):
        run()
        torch.manual_seed(1)
        model.add_adapter(_lora())
        with pytest.raises(ExecutionError, match=re.escape("were added after the torchferry session opened")):
            run()


def test_a_pipeline_made_from_a_served_one_shares_its_session() -> None:
    """``WanPipeline.from_pipe`` and a pipeline built from ``pipe.components`` during a session run
    bit-identical on the served components (``from_pipe``'s float32 ``.to()`` changes nothing here); a
    ``from_pipe`` that would convert them (``torch_dtype=float16``) is refused, nothing converted."""
    plain = toy.wan_pipeline()
    expected = toy.run_wan(plain)
    pipe = toy.wan_pipeline()
    with torchferry.offload(pipe, strategy="layerwise", device="cpu"):
        toy.run_wan(pipe)
        for other in (diffusers.WanPipeline.from_pipe(pipe), diffusers.WanPipeline(**pipe.components)):
            got = toy.run_wan(other)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        with pytest.raises(ExecutionError, match=re.escape("(a conversion through nn.Module._apply)")):
            diffusers.WanPipeline.from_pipe(pipe, torch_dtype=torch.float16)
        assert all(torch.equal(a, b) for a, b in zip(toy.run_wan(pipe), expected, strict=True))
    assert {t.dtype for t in pipe.transformer.parameters()} == {torch.float32}
    state, reference = pipe.transformer.state_dict(), plain.transformer.state_dict()
    assert all(torch.equal(state[k], reference[k]) for k in reference)
