"""Wrapper tensors (tensor subclasses keeping their data in inner tensors) under a session: discovery
names their inner tensors, the wrapper object stays the module's parameter and takes the device its
inner tensors are on (the meta device stands in for a GPU), and the ones that cannot be re-pointed
safely are refused before anything moves (docs/quantized.md)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import torchferry
from torchferry import PlanError, topology
from torchferry.runtime.memory import _wrappers


class Scaled(torch.Tensor):
    """A weight held as int8 ``qdata`` times a float32 ``scale`` per row, dequantized by every op (as
    torchao's weight-only tensors are); ``Scaled`` of ``Scaled`` nests."""

    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor) -> Scaled:
        made = torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32, device=qdata.device)
        made.qdata, made.scale = qdata, scale
        return made

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        pass

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["qdata", "scale"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, Any], context: Any, size: Any, stride: Any) -> Scaled:
        return cls(inner["qdata"], inner["scale"])

    def dequantize(self) -> torch.Tensor:
        q = self.qdata.dequantize() if isinstance(self.qdata, Scaled) else self.qdata
        return q.to(torch.float32) * self.scale

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            (t,) = args
            return cls(t.qdata, t.scale)
        plain = tree_map(lambda a: a.dequantize() if isinstance(a, Scaled) else a, (args, kwargs or {}))
        return func(*plain[0], **plain[1])


def _scaled(rows: int, cols: int, g: torch.Generator) -> Scaled:
    qdata = torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8)
    return Scaled(qdata, torch.rand(rows, 1, generator=g))


class Net(nn.Module):
    """An input projection, four residual linear blocks with ``Scaled`` weights, an output projection."""

    def __init__(self, make: Callable[[int, int, torch.Generator], torch.Tensor] = _scaled) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj_in = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        for block in self.blocks:
            block._parameters["weight"] = make(8, 8, g)
        self.proj_out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = x + block(x)
        return self.proj_out(x)


def _x() -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


def test_discovery_names_the_inner_tensors_and_counts_their_bytes() -> None:
    """A wrapper weight is discovered as its inner tensors, ``<weight>.qdata`` and ``<weight>.scale``,
    in their own dtypes: the block's bytes are the int8 data and the scales."""
    block = topology.discover(Net()).component("").blocks[1]
    assert [(t.name, t.dtype, t.shape) for t in block.tensors] == [
        ("blocks.1.weight.qdata", "int8", (8, 8)),
        ("blocks.1.weight.scale", "float32", (8, 1)),
        ("blocks.1.bias", "float32", (8,)),
    ]
    assert sum(t.nbytes for t in block.tensors) == 64 + 32 + 32


def test_a_wrapper_streams_bit_identically_and_stays_the_same_object() -> None:
    """Under layerwise and model_level on the CPU the model gives its plain output twice and after
    close, and each block's weight is the same ``Scaled`` object with its inner tensors' values."""
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        reference = net(_x())
    weight = net.blocks[1].weight
    values = weight.qdata.clone(), weight.scale.clone()
    for strategy in ("layerwise", "none"):
        with torch.no_grad(), torchferry.offload(net, strategy=strategy, device="cpu"):
            assert torch.equal(net(_x()), reference) and torch.equal(net(_x()), reference)
        assert net.blocks[1].weight is weight and type(weight) is Scaled
        assert torch.equal(weight.qdata, values[0]) and torch.equal(weight.scale, values[1])
        with torch.no_grad():
            assert torch.equal(net(_x()), reference)


def _devices_seen(net: Net) -> list[tuple[str, str, bool]]:
    """Run ``net`` under a layerwise session on meta; per block forward: its weight's device, its
    ``qdata``'s device, and whether it is still the object the block held."""
    held = [b.weight for b in net.blocks]
    seen: list[tuple[str, str, bool]] = []

    def probe(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            w = module.weight
            seen.append((w.device.type, w.qdata.device.type, w is held[i]))

        return hook

    with torchferry.offload(net, strategy="layerwise", device="meta"):
        assert {b.weight.device.type for b in net.blocks} == {"cpu"}  # between steps: at host memory
        # Registered after the session's own hooks, so each runs once the block's weights are in place.
        handles = [b.register_forward_pre_hook(probe(i)) for i, b in enumerate(net.blocks)]
        with torch.no_grad():
            net(_x().to("meta"))
    for handle in handles:
        handle.remove()
    return seen


def test_a_wrapper_takes_the_device_its_inner_tensors_are_on() -> None:
    """On a session device (meta standing in for a GPU) each block's wrapper weight says it is on that
    device while its block runs, as its inner tensors are, is the object the block held, and is back
    on the CPU, bit-identical, after close."""
    net = Net()
    before = {n: t.clone() for n, t in net.blocks[2].weight.__dict__.items() if isinstance(t, torch.Tensor)}
    assert _devices_seen(net) == [("meta", "meta", True)] * 4
    after = net.blocks[2].weight
    assert after.device.type == "cpu" and all(torch.equal(getattr(after, n), t) for n, t in before.items())


def test_without_the_impl_exchange_a_wrapper_reports_the_host_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mismatch the impl exchange fixes is real: re-pointing only the inner tensors leaves the
    wrapper saying ``cpu`` while its bytes are on the session device."""
    monkeypatch.setattr(_wrappers.Wrapper, "follow", lambda self, device: None)
    assert _devices_seen(Net()) == [("cpu", "meta", True)] * 4


def test_wrappers_of_wrappers_follow_inner_ones_first() -> None:
    """A ``Scaled`` whose ``qdata`` is itself a ``Scaled`` is discovered down to its plain tensors,
    streams bit-identically, and both wrappers take the session device inside the forward."""

    def nested(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
        return Scaled(_scaled(rows, cols, g), torch.rand(rows, 1, generator=g))

    net = Net(nested)
    names = [t.name for t in topology.discover(net).component("").blocks[0].tensors]
    assert names[:3] == [f"blocks.0.weight.{n}" for n in ("qdata.qdata", "qdata.scale", "scale")]
    with torch.no_grad():
        reference = net(_x())
    with torch.no_grad(), torchferry.offload(net, strategy="layerwise", device="cpu"):
        assert torch.equal(net(_x()), reference)
    seen: list[tuple[str, str]] = []
    with torchferry.offload(net, strategy="layerwise", device="meta"), torch.no_grad():
        net.blocks[0].register_forward_pre_hook(
            lambda m, a: seen.append((m.weight.device.type, m.weight.qdata.device.type))
        )
        net(_x().to("meta"))
    assert seen == [("meta", "meta")]


def test_a_tied_wrapper_keeps_its_tie_and_its_attributes_on_a_device() -> None:
    """One ``Scaled`` weight tied into the input and output projections is one tensor with an alias;
    on a session device both projections read the same object, which says it is on the device and
    keeps an attribute set on it, and after close it is still shared and bit-identical."""

    class Tied(Net):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(2)
            self.proj_in._parameters["weight"] = self.proj_out._parameters["weight"] = _scaled(8, 8, g)

    net = Tied()
    weight = net.proj_in.weight
    weight.tag = "kept"  # type: ignore[attr-defined]
    qdata = weight.qdata.clone()
    specs = [t for t in topology.discover(net).component("").tensors if t.name.startswith("proj_in.weight")]
    assert [(t.name, t.aliases) for t in specs] == [
        ("proj_in.weight.qdata", ("proj_out.weight.qdata",)),
        ("proj_in.weight.scale", ("proj_out.weight.scale",)),
    ]
    seen: list[tuple[bool, str, str]] = []
    with torchferry.offload(net, strategy="layerwise", device="meta"), torch.no_grad():
        for layer in (net.proj_in, net.proj_out):
            layer.register_forward_pre_hook(
                lambda m, a: seen.append((m.weight is weight, m.weight.device.type, m.weight.tag))
            )
        net(_x().to("meta"))
    assert seen == [(True, "meta", "kept")] * 2
    assert net.proj_out.weight is weight and weight.device.type == "cpu" and torch.equal(weight.qdata, qdata)


def test_state_dict_returns_standalone_wrappers() -> None:
    """``state_dict()`` during a session gives each wrapper weight as a new wrapper of its class over
    copies of its inner tensors (the live one points into the session's buffers)."""
    net = Net()
    with torchferry.offload(net, strategy="layerwise", device="cpu"):
        copy = net.state_dict()["blocks.1.weight"]
        live = net.blocks[1].weight
        assert type(copy) is Scaled and copy is not live
        assert torch.equal(copy.qdata, live.qdata) and copy.qdata.data_ptr() != live.qdata.data_ptr()


# ---------------------------------------------------------------------------------------- refusals
class Copying(Scaled):
    """A wrapper whose ``__tensor_unflatten__`` copies the inner tensors it is given."""

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, Any], context: Any, size: Any, stride: Any) -> Scaled:
        return cls(inner["qdata"].clone(), inner["scale"].clone())


class Computed(Scaled):
    """A wrapper whose ``scale`` is a property building a new tensor at each read."""

    @property  # type: ignore[override]
    def scale(self) -> torch.Tensor:
        return self.__dict__["_scale"] * 1

    @scale.setter
    def scale(self, value: torch.Tensor) -> None:
        self.__dict__["_scale"] = value


class Pinned(Scaled):
    """A wrapper that always says it is on the CPU, whatever device its inner tensors are on."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor) -> Pinned:
        made = torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32, device="cpu")
        made.qdata, made.scale = qdata, scale
        return made


def _as(cls: type[Scaled], s: Scaled) -> Scaled:
    return cls(s.qdata, s.scale)


REFUSED = {
    "copying": (
        Copying,
        "its __tensor_unflatten__ does not rebuild it over the very inner tensors it is given (it copies or "
        "converts them), which is how torchferry gives the wrapper the device its bytes are on",
    ),
    "computed": (
        Computed,
        "its inner tensor 'scale' is a new object at each read (a property), so pointing it at other bytes "
        "would not reach the wrapper",
    ),
}


@pytest.mark.parametrize("kind", REFUSED, ids=REFUSED.keys())
def test_a_wrapper_that_cannot_be_repointed_is_refused_naming_its_class(kind: str) -> None:
    """A wrapper whose unflatten copies, or whose inner tensor is a property, is a PlanError naming the
    tensor, its class and why, and nothing is changed."""
    cls, why = REFUSED[kind]
    net = Net(lambda r, c, g: _as(cls, _scaled(r, c, g)))
    weight = net.blocks[0].weight
    qdata = weight.qdata
    with pytest.raises(PlanError) as caught:
        torchferry.offload(net, strategy="layerwise", device="cpu")
    assert str(caught.value) == (
        f"Tensor 'blocks.0.weight' is a {__name__}.{cls.__qualname__}, a tensor subclass that keeps its data "
        f"in inner tensors, and torchferry cannot re-point them safely: {why}; dequantize it (for a "
        "DTensor, full_tensor()) before offloading, or leave its component out of the offload "
        "(docs/quantized.md lists the forms that stream)"
    )
    assert net.blocks[0].weight is weight and weight.qdata is qdata


def test_a_wrapper_whose_class_fixes_its_device_is_refused_before_anything_moves() -> None:
    """A wrapper class that does not take its device from its inner tensors is refused when the session
    opens (tried over meta copies), naming the class; the weights are untouched."""
    net = Net(lambda r, c, g: _as(Pinned, _scaled(r, c, g)))
    data = net.blocks[0].weight.qdata.data_ptr()
    message = (
        f"a {__name__}.Pinned wrapper tensor of pack blocks.0, rebuilt by its __tensor_unflatten__ over "
        "inner tensors on the meta device, is on cpu: its class does not take its device from its inner "
        "tensors"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        torchferry.offload(net, strategy="layerwise", device="cpu")
    assert net.blocks[0].weight.qdata.data_ptr() == data
