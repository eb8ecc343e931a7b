"""What users bring, discovered with no declaration: compiled models, odd tensors, odd block attributes.

Each test runs real torch on the CPU: the model is offloaded as it is, and either streams to the
plain output bit for bit or is refused with a whole, located message before anything changes.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, ClassVar

import pytest
import torch
from tiny import Block, Model
from torch import nn
from torch.nn import functional as F

import torchferry
from torchferry import ExecutionError, OffloadWarning, PlanError
from torchferry.topology import Declaration, discover


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _streams_bit_identical(model: nn.Module, call: nn.Module | None = None, **options: Any) -> None:
    """``model`` (called through ``call``) streams layerwise to its plain output and comes back as it was."""
    call = model if call is None else call
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = call(x)
    before = _weights(model)
    with torch.no_grad(), torchferry.offload(call, strategy="layerwise", device="cpu", **options) as session:
        streamed = call(x)
        # The whole model as the device would hold it: its packs, each tensor 256-byte aligned.
        assert 0 < session.peak_device_bytes < session.plan.topology.nbytes
    assert torch.equal(streamed, reference)
    after = _weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_model_is_unwrapped_and_streams() -> None:
    """A ``torch.compile``d model is offloaded through its original module; the hooks fire under it."""
    torch.manual_seed(0)
    model = Model().eval()
    compiled = torch.compile(model, backend="eager")
    _streams_bit_identical(model, compiled)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_model_compiled_and_called_before_opening_streams() -> None:
    """A model compiled (``aot_eager``) and called before the session opens still streams bit-identically."""
    torch.manual_seed(0)
    model = Model().eval()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        compiled(torch.randn(2, 8))
    _streams_bit_identical(model, compiled)


class _Wrapped(torch.Tensor):
    """A wrapper subclass keeping its data in an inner tensor (as torchao's quantized tensors do)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapped:
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        made.inner = inner
        return made

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        unwrap = [a.inner if isinstance(a, _Wrapped) else a for a in args]
        return func(*unwrap, **(kwargs or {}))


def test_wrapper_subclass_without_the_flatten_protocol_is_refused_with_its_type() -> None:
    """A weight that is a wrapper tensor subclass naming no inner tensors (no ``__tensor_flatten__``) is
    a PlanError naming the type and why, and nothing is changed."""
    model = Model()
    model.blocks[1].linear._parameters["weight"] = _Wrapped(torch.randn(8, 8))
    with pytest.raises(PlanError) as caught:
        torchferry.offload(model, strategy="layerwise", device="cpu")
    assert str(caught.value) == (
        f"Tensor 'blocks.1.linear.weight' is a {__name__}._Wrapped, a tensor subclass that keeps its "
        "data in inner tensors, and torchferry cannot re-point them safely: it does not name them (it has "
        "no __tensor_flatten__ / __tensor_unflatten__, torch's protocol for a wrapper's inner tensors); "
        "dequantize it (for a DTensor, full_tensor()) before offloading, or leave its component out of "
        "the offload (docs/quantized.md lists the forms that stream)"
    )
    assert type(model.blocks[1].linear.weight) is _Wrapped


class _Tagged(nn.Parameter):
    """A parameter subclass with storage of its own that only overrides ``__torch_function__`` (as GGUF's)."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_parameter_subclass_with_storage_streams() -> None:
    """A GGUF-like ``Parameter`` subclass (``__torch_function__`` only) streams bit-identically."""
    torch.manual_seed(0)
    model = Model().eval()
    for block in model.blocks:
        block.linear.weight = _Tagged(block.linear.weight.detach().clone(), requires_grad=False)
    _streams_bit_identical(model)


class Fp8Block(nn.Module):
    """A block storing its weight in float8 and computing in float32 (layerwise casting)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8).to(torch.float8_e4m3fn), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(x, self.weight.to(x.dtype))


def test_float8_weights_stream() -> None:
    """Blocks whose weights are stored as float8 stream bit-identically."""
    torch.manual_seed(0)
    model = Model().eval()
    model.blocks = nn.ModuleList(Fp8Block() for _ in range(4))
    _streams_bit_identical(model)


@pytest.mark.parametrize("strategy", ["none", "layerwise", "model_level"])
def test_a_model_built_under_inference_mode_is_served(strategy: str) -> None:
    """A model built under inference mode (as serving frameworks build them) streams to its plain output,
    called in and out of inference mode; its parameters stay the same objects, ties included, and come
    back as ordinary tensors with the same values."""
    torch.manual_seed(0)
    with torch.inference_mode():
        model = Model().eval()
        model.proj_out.weight = model.proj_in.weight  # tied
    named = dict(model.named_parameters(remove_duplicate=False))
    before = {k: v.detach().clone() for k, v in named.items()}
    x = torch.randn(2, 8)
    with torch.inference_mode():
        expected = model(x)
    warn = pytest.warns(OffloadWarning) if strategy == "model_level" else contextlib.nullcontext()
    with warn, torchferry.offload(model, strategy=strategy, device="cpu"):
        with torch.inference_mode():
            assert torch.equal(model(x), expected)
        with torch.no_grad():
            assert torch.equal(model(x), expected)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[k] is v for k, v in named.items())
    assert model.proj_out.weight is model.proj_in.weight
    assert not any(t.is_inference() for t in after.values())
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert type(after["blocks.0.linear.weight"]) is nn.Parameter


def test_an_inference_tensor_held_elsewhere_is_refused_with_the_fix() -> None:
    """An inference tensor something else holds (a weak reference) cannot be swapped in place: a PlanError
    with the fix, before anything changes."""
    import weakref

    torch.manual_seed(0)
    with torch.inference_mode():
        model = Model().eval()
    held = weakref.ref(model.proj_in.weight)
    refused = "were made under torch.inference_mode() and something else holds them"
    with pytest.raises(PlanError, match=re.escape(refused)):
        torchferry.offload(model, strategy="none", device="cpu")
    assert model.proj_in.weight.is_inference() and held() is model.proj_in.weight
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    _streams_bit_identical(model)


class UNetLike(nn.Module):
    """Down blocks, one mid block (a single module), up blocks in a ModuleDict."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList(Block() for _ in range(2))
        self.mid = Block()
        self.up = nn.ModuleDict({"a": Block(), "b": Block()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.down:
            x = block(x)
        x = self.mid(x)
        for block in self.up.values():
            x = block(x)
        return x


def test_single_module_and_module_dict_blocks_stream() -> None:
    """A single module and a ModuleDict declared as block attributes are blocks that stream."""
    torch.manual_seed(0)
    model = UNetLike().eval()
    _streams_bit_identical(model, declaration=Declaration(block_attrs={"": ("down", "mid", "up")}))


class Hinted(nn.Module):
    """Hint blocks registered after the main blocks but run before them (as WanVACE's)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.hints = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in (*self.hints, *self.blocks):
            x = block(x)
        return x


class Hidden(Hinted):
    """Hinted, with a forward whose source never names its lists (it looks them up by name)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for name in ("hints", "blocks"):
            for block in getattr(self, name):
                x = block(x)
        return x


def test_a_ring_follows_the_order_the_forward_source_names_its_lists() -> None:
    """Lists registered in one order and run in another stream in the forward's order, nothing declared."""
    torch.manual_seed(0)
    _streams_bit_identical(Hinted().eval())


def test_forward_order_that_differs_is_reported_with_the_declaration() -> None:
    """A guessed ring the forward does not follow fails naming both orders and the Declaration to use."""
    torch.manual_seed(0)
    model = Hidden().eval()
    with (
        pytest.raises(ExecutionError) as caught,
        torch.no_grad(),
        torchferry.offload(model, strategy="layerwise", device="cpu"),
    ):
        model(torch.randn(2, 8))
    assert str(caught.value) == (
        "block blocks.0 was reached out of its ring's order in step (pipeline)#0: declared order "
        "blocks.0-2, hints.0-1, forward ran hints.0-1, blocks.0; declare "
        "Declaration(block_attrs={'': ('hints', 'blocks')}) so the ring follows the forward"
    )
    _streams_bit_identical(model, declaration=Declaration(block_attrs={"": ("hints", "blocks")}))


def test_interleaved_forward_is_reported_block_by_block() -> None:
    """Lists the forward interleaves are reported as the block-by-block ring that follows it."""

    class Zipped(Hinted):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.proj_in(x)
            for block, hint in zip(self.blocks, self.hints, strict=False):
                x = hint(block(x))
            return self.blocks[2](x)

    torch.manual_seed(0)
    model = Zipped().eval()
    with (
        pytest.raises(ExecutionError, match=re.escape("forward ran blocks.0, hints.0, blocks.1; declare")),
        torch.no_grad(),
        torchferry.offload(model, strategy="layerwise", device="cpu"),
    ):
        model(torch.randn(2, 8))
    order = ("blocks.0", "hints.0", "blocks.1", "hints.1", "blocks.2")
    _streams_bit_identical(model, declaration=Declaration(block_attrs={"": order}))


class _Pipeline:
    """A pipeline object that only lists its components (as every diffusers pipeline does)."""

    _optional_components: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.transformer = Model().eval()
        self.scheduler = object()

    @property
    def components(self) -> dict[str, Any]:
        return {"transformer": self.transformer, "scheduler": self.scheduler}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(x)


def test_pipeline_found_from_its_components_streams() -> None:
    """A pipeline class nobody registered is served through its ``components`` mapping."""
    torch.manual_seed(0)
    pipe = _Pipeline()
    x = torch.randn(2, 8)
    with torch.no_grad():
        reference = pipe(x)
    assert [c.path for c in discover(pipe).components] == ["transformer"]
    with torch.no_grad(), torchferry.offload(pipe, strategy="layerwise", device="cpu") as session:
        assert torch.equal(pipe(x), reference)
        assert session.peak_device_bytes > 0


class _LifecycleEncoder(Model):
    """An encoder whose pipeline can move it whole (``load_to_device``/``offload_to_cpu``)."""

    def load_to_device(self) -> None:
        """Stage onto the device (the pipeline's own lifecycle; never called here)."""

    def offload_to_cpu(self) -> None:
        """Stage back to the host."""


def test_on_demand_encoder_with_block_stacks_streams_its_blocks() -> None:
    """An encoder declared both on-demand and with block stacks (MiniMax-H3's shape) streams its blocks
    in a ring, its own lifecycle around each forward, to the plain output."""

    class Pipe:
        _dit_modules: ClassVar[list[str]] = ["transformer"]
        _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
        _vae_modules: ClassVar[list[str]] = []
        _offload_plan = Declaration(
            on_demand_component_paths={"text_encoder"}, encoder_block_attrs={"text_encoder": ("blocks",)}
        )

        def __init__(self) -> None:
            self.transformer = Model()
            self.text_encoder = _LifecycleEncoder()

    torch.manual_seed(0)
    pipe = Pipe()
    before = _weights(pipe.text_encoder)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = pipe.text_encoder(x)
    with torchferry.offload(pipe, strategy="layerwise", device="cpu") as session:
        encoder = session.plan.component("text_encoder")
        assert encoder.on_demand and len(encoder.blocks) == 4
        with torch.no_grad():
            assert torch.equal(pipe.text_encoder(x), expected)
        steps = [s for step, s in session.schedules.items() if step.component == "text_encoder"]
        kinds = {op.kind for s in steps for op in s.ops}
        assert {"acquire", "load", "wait", "release"} <= kinds
    assert all(torch.equal(v, _weights(pipe.text_encoder)[k]) for k, v in before.items())
