"""Quantized weights stream as their quantized bytes (docs/quantized.md): torchao int8 and float8
weight-only, optimum-quanto qint8, diffusers' layerwise casting, torchferry's own ``storage_dtype=``
and ``DTensor`` parameters, each on a tiny diffusers ``WanTransformer3DModel``, bit-identical to the
same quantized model run without torchferry, twice in a row and after close."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import WAN_TRANSFORMER, fresh_storage
from torch import nn

import torchferry
from torchferry import policies, topology
from torchferry.testing import cuda_path, run_ranks, toy

diffusers = pytest.importorskip("diffusers")
torchao_quantization = pytest.importorskip("torchao.quantization")
quanto = pytest.importorskip("optimum.quanto")

#: The tiny Wan transformer with three blocks (quanto's CPU matmul is slow; three blocks still make a
#: ring of depth two turn over).
WAN = {**WAN_TRANSFORMER, "num_layers": 3}

#: The session requests each form runs under: layerwise depth 1 and 2, model_level, and auto.
REQUESTS: dict[str, dict[str, Any]] = {
    "layerwise-d1": {"strategy": "layerwise", "prefetch_depth": 1},
    "layerwise-d2": {"strategy": "layerwise", "prefetch_depth": 2},
    "model_level": {"strategy": "model_level"},
    "auto": {},
}


def _wan() -> nn.Module:
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(**WAN).eval()


def _int8() -> nn.Module:
    model = _wan()
    torchao_quantization.quantize_(model, torchao_quantization.Int8WeightOnlyConfig())
    return model


def _float8() -> nn.Module:
    model = _wan()
    torchao_quantization.quantize_(model, torchao_quantization.Float8WeightOnlyConfig())
    return model


def _quanto() -> nn.Module:
    model = _wan()
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    return model


def _cast() -> nn.Module:
    model = _wan()
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return model


#: Each form: how to build the quantized model, and the class its blocks' Linear weights have.
FORMS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "torchao-int8": (_int8, "Int8Tensor"),
    "torchao-float8": (_float8, "Float8Tensor"),
    "quanto-qint8": (_quanto, "WeightQBytesTensor"),
    "layerwise-casting": (_cast, "Parameter"),
}


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
    }


def _call(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(**_inputs(), return_dict=False)[0]
    return out


def _weight(model: nn.Module) -> torch.Tensor:
    weight: torch.Tensor = model.blocks[1].attn1.to_q.weight
    return weight


def _runs_as_without(model: nn.Module, reference: torch.Tensor, **request: Any) -> torchferry.Session:
    """``model`` under a session gives ``reference`` twice in a row and after close; its Linear weights
    stay the objects the module held. Returns the closed session."""
    weight = _weight(model)
    with torchferry.offload(model, device="cpu", **request) as session:
        first, second = _call(model), _call(model)
        assert _weight(model) is weight
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert torch.equal(_call(model), reference)
    assert _weight(model) is weight
    return session


#: A bare transformer under model_level is staged whole, with a warning saying so.
_STAGED_WHOLE = pytest.mark.filterwarnings("ignore:model_level offload swaps DiTs:torchferry.OffloadWarning")
PARAMS = [
    pytest.param(r, id=k, marks=[_STAGED_WHOLE] if k == "model_level" else []) for k, r in REQUESTS.items()
]


@pytest.mark.parametrize("request_", PARAMS)
@pytest.mark.parametrize("form", FORMS, ids=FORMS.keys())
def test_a_quantized_transformer_runs_as_without_a_session(form: str, request_: dict[str, Any]) -> None:
    """Each quantized form gives bit for bit what the same quantized model gives without torchferry,
    under layerwise depth 1 and 2, model_level and auto, twice in a row and after close."""
    build, cls = FORMS[form]
    model = build()
    assert type(_weight(model)).__name__ == cls
    reference = _call(model)
    _runs_as_without(model, reference, **request_)


def _quantized_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s tensors as they are held: a wrapper's inner tensors, recursively."""

    def held(t: torch.Tensor) -> int:
        if topology.is_wrapper(t):
            names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
            return sum(held(getattr(t, n)) for n in names if isinstance(getattr(t, n), torch.Tensor))
        return t.numel() * t.element_size()

    return sum(held(t) for t in (*module.parameters(), *module.buffers()))


@pytest.mark.parametrize("form", FORMS, ids=FORMS.keys())
def test_the_discovered_bytes_of_a_block_are_its_quantized_bytes(form: str) -> None:
    """A block's tensors, as discovery lists them, hold exactly the block's quantized bytes (inner
    tensors named ``<weight>.<attribute>``), fewer than the unquantized block's."""
    model = FORMS[form][0]()
    block = topology.discover(model).component("").blocks[1]
    assert sum(t.nbytes for t in block.tensors) == _quantized_bytes(model.blocks[1])
    plain = topology.discover(_wan()).component("").blocks[1]
    assert block.nbytes < plain.nbytes
    if form != "layerwise-casting":
        names = {t.name for t in block.tensors}
        assert "blocks.1.attn1.to_q.weight" not in names
        inner = [n for n in names if n.startswith("blocks.1.attn1.to_q.weight.")]
        flat, _ = _weight(model).__tensor_flatten__()  # type: ignore[attr-defined]
        assert sorted(inner) == sorted(f"blocks.1.attn1.to_q.weight.{n}" for n in flat)


@pytest.mark.parametrize("form", ["torchao-int8", "quanto-qint8"])
def test_the_ledger_and_the_simulator_count_the_quantized_bytes(form: str) -> None:
    """Each step's measured device peak equals the simulated peak of its schedule, and both are the
    quantized bytes: below the same schedule over the unquantized model."""
    model = FORMS[form][0]()
    with torchferry.offload(model, device="cpu", strategy="layerwise") as session:
        _call(model)
        assert session.step_peaks
        for step, peak in session.step_peaks.items():
            assert peak == policies.simulate(session.schedules[step]).peak_device_bytes
        assert session.host_bytes < topology.discover(_wan()).nbytes
    plain_plan = topology.resolve(topology.discover(_wan()), topology.OffloadConfig(strategy="layerwise"))
    plain = policies.layerwise(depth=1)(plain_plan, policies.Step(component=""))
    assert max(session.step_peaks.values()) < policies.simulate(plain).peak_device_bytes


@pytest.mark.parametrize("request_", PARAMS)
def test_storage_dtype_gives_what_diffusers_layerwise_casting_gives(request_: dict[str, Any]) -> None:
    """``offload(storage_dtype=float8_e4m3fn)`` of a float32 model gives bit for bit what the same
    model gives under diffusers' ``enable_layerwise_casting(float8_e4m3fn, float32)`` without a
    session, twice in a row; after close the model (float32 again, holding the float8 values) gives it
    too."""
    reference = _call(_cast())
    _runs_as_without(_wan(), reference, storage_dtype=torch.float8_e4m3fn, **request_)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_from_pretrained_with_storage_dtype_gives_what_diffusers_casting_gives(tmp_path: Path) -> None:
    """``from_pretrained(..., storage_dtype=float8_e4m3fn)`` reads a float32 Wan pipeline folder into
    float8 host buffers (converting each tensor as it is read) and the pipeline gives bit for bit
    what diffusers' own load with layerwise casting of its transformer gives."""
    folder = tmp_path / "wan"
    toy.wan_pipeline().save_pretrained(str(folder))
    plain = diffusers.WanPipeline.from_pretrained(str(folder), tokenizer=None, transformer_2=None)
    fresh_storage(plain)  # memory of its own, as torchferry's host copies are
    plain.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    cast = topology.discover(plain.transformer).component("")
    expected = toy.run_wan(plain)
    with torchferry.from_pretrained(
        diffusers.WanPipeline, folder, storage_dtype=torch.float8_e4m3fn, strategy="layerwise", device="cpu"
    ) as session:
        stored = session.plan.topology.component("transformer")
        assert [b.nbytes for b in stored.blocks] == [b.nbytes for b in cast.blocks]
        got = toy.run_wan(session.pipeline)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_storage_dtype_stores_and_moves_the_tensors_diffusers_casts() -> None:
    """The plan of a ``storage_dtype`` request holds each block in the dtypes diffusers' layerwise
    casting stores it in (its Linear weights and biases float8, norms and tables float32), the host
    store holds those bytes, and inside the session the weights sit in float8 between forwards."""
    cast = topology.discover(_cast()).component("")
    model = _wan()
    with torchferry.offload(model, device="cpu", strategy="layerwise", storage_dtype="float8_e4m3fn") as s:
        stored = s.plan.topology.component("")
        for ours, theirs in zip(stored.blocks, cast.blocks, strict=True):
            assert [(t.name, t.dtype) for t in ours.tensors] == [(t.name, t.dtype) for t in theirs.tensors]
        assert stored.nbytes == cast.nbytes
        assert _weight(model).dtype == torch.float8_e4m3fn
        assert model.blocks[1].norm2.weight.dtype == torch.float32
        assert s.plan.topology.component("").blocks[1].tensors[1].compute_dtype == "float32"
    assert _weight(model).dtype == torch.float32


def test_layerwise_casting_keeps_the_stored_bytes_in_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under diffusers' layerwise casting the session holds and moves the float8 bytes (its plan's
    blocks are the float8 blocks), the weights sit in float8 between forwards, and every Linear
    computes with float32 weights, as without a session."""
    model = _cast()
    seen: list[torch.dtype] = []
    linear = torch.nn.functional.linear

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(weight.dtype)
        return linear(x, weight, bias)

    with torchferry.offload(model, device="cpu", strategy="layerwise") as session:
        block = session.plan.topology.component("").blocks[1]
        assert block.nbytes == topology.discover(_cast()).component("").blocks[1].nbytes
        assert "float8_e4m3fn" in block.dtypes
        monkeypatch.setattr(torch.nn.functional, "linear", spy)
        _call(model)
        monkeypatch.undo()
        assert _weight(model).dtype == torch.float8_e4m3fn
    assert seen and set(seen) == {torch.float32}


@_STAGED_WHOLE
def test_state_dict_during_a_session_gives_standalone_quantized_tensors() -> None:
    """``state_dict()`` of a served quantized model returns wrapper tensors of the same class over
    fresh copies of the inner tensors, equal to the weights, sharing no bytes with the session."""
    model = _int8()
    with torchferry.offload(model, device="cpu", strategy="model_level"):
        _call(model)
        state = model.state_dict()
        copy = state["blocks.1.attn1.to_q.weight"]
        live = _weight(model)
        assert type(copy) is type(live) and copy is not live
        assert torch.equal(copy.qdata, live.qdata) and torch.equal(copy.scale, live.scale)
        assert copy.qdata.data_ptr() != live.qdata.data_ptr()


# ------------------------------------------------------------------------------------- DTensor
def _dtensor_runs(rank: int, world: int) -> dict[str, bool]:
    """On one gloo rank: the tiny transformer with every block Linear's parameters as replicated
    ``DTensor``s (inputs and outputs converted by ``distribute_module``), under each request."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def replicate(name: str, module: nn.Module, mesh: Any) -> None:
        for key, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                key, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()]), requires_grad=False)
            )

    def inputs(module: nn.Module, args: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(a, mesh, [Replicate()]) if isinstance(a, torch.Tensor) else a for a in args
        )

    def outputs(module: nn.Module, out: Any, mesh: Any) -> Any:
        return out.to_local()

    import warnings

    warnings.filterwarnings("ignore", "model_level offload swaps DiTs", torchferry.OffloadWarning)
    model = _wan()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("blocks."):
            distribute_module(module, mesh, replicate, inputs, outputs)
    assert type(_weight(model)) is DTensor
    block = topology.discover(model).component("").blocks[1]
    results = {"bytes": sum(t.nbytes for t in block.tensors) == _quantized_bytes(model.blocks[1])}
    reference = _call(model)
    for name, request in REQUESTS.items():
        try:
            _runs_as_without(model, reference, **request)
            results[name] = True
        except AssertionError:
            results[name] = False
    return results


@pytest.mark.dist
def test_dtensor_parameters_on_one_rank_run_as_without_a_session() -> None:
    """``DTensor`` parameters on a one-rank gloo group stream as their local shards and give bit for bit
    what the model gives without torchferry, under every request, twice and after close."""
    (results,) = run_ranks(_dtensor_runs, 1, timeout=600)
    assert results == {"bytes": True, **dict.fromkeys(REQUESTS, True)}


def test_every_form_is_in_the_docs() -> None:
    """docs/quantized.md names every form these tests run (it is the page users read)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "quantized.md").read_text()
    forms = ("Int8WeightOnlyConfig", "Float8WeightOnlyConfig", "qint8", "enable_layerwise_casting", "DTensor")
    for name in (*forms, "storage_dtype"):
        assert name in page


@pytest.mark.parametrize("re_pointed", [False, True], ids=["docked", "re-pointed"])
def test_a_forward_that_raised_inside_a_diffusers_cast_layer_leaves_it_stored(
    re_pointed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """diffusers' layerwise-casting hook casts a layer back to its storage dtype only after a forward
    that returned, so one that raised inside the layer leaves it in the compute dtype. Under a session
    the failed step's clean-up casts it back: between calls the weight holds its storage dtype again,
    the next calls are exact, and close gives it back as stored (re-pointed is how a GPU session
    moves it: `torchferry.testing.cuda_path`)."""
    model = _cast()
    reference = _call(_cast())
    target = _weight(model)
    armed = [False]
    linear = torch.nn.functional.linear

    def failing(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if armed and armed[0] and weight is target:
            armed.clear()
            raise RuntimeError("a failure inside the cast layer")
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", failing)
    with cuda_path() if re_pointed else contextlib.nullcontext():
        session = torchferry.offload(model, strategy="layerwise", device="cpu")
    with session:
        assert torch.equal(_call(model), reference)
        armed[0] = True
        with pytest.raises(RuntimeError, match="a failure inside the cast layer"):
            _call(model)
        assert not armed and target.dtype == torch.float8_e4m3fn
        assert torch.equal(_call(model), reference) and torch.equal(_call(model), reference)
    assert target.dtype == torch.float8_e4m3fn
    assert torch.equal(_call(model), reference)
