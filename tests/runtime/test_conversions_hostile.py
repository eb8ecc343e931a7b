"""Conversions of served modules (``.to()``, ``.cpu()``, ``.half()``, ...) under hostile use.

Rule 3 of [Note: the session contract] in `torchferry.runtime.guard._guard`: a conversion that would change
no tensor returns the module, as in plain torch; any other is refused before anything is converted.
Each test runs the same call on a served module and on an identical plain one and compares what
comes back, every tensor's object, data pointer, dtype, device and strides, later outputs bit for
bit, the weights after ``close()``, and that after close conversions work and leave nothing in the
module's ``__dict__``. Tests marked ``xfail(strict=True)`` pin a divergence still there.
"""

from __future__ import annotations

import copy
import functools
import inspect
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from toy_runs import inputs, run, same_state

import torchferry
from torchferry import ExecutionError, OffloadWarning
from torchferry.testing import toy
from torchferry.topology import find_attr

Call = Callable[[Any], Any]
#: What a tensor is, for "nothing changed": object id, data pointer, dtype, device, strides.
Fingerprint = list[tuple[str, int, int, torch.dtype, torch.device, tuple[int, ...]]]

REFUSED = re.escape("(a conversion through nn.Module._apply) while a torchferry session serves it")


def refusal(where: str) -> str:
    """The whole message of a refused conversion of the module at ``where`` ("" for the pipeline)."""
    at = f"{where!r}" if where else "the pipeline"
    return re.escape(
        f".to()/.half()/.float()/.cuda()/.to('meta') of {at} (a conversion through nn.Module._apply) "
        "while a torchferry session serves it would replace weights the session holds; close() the "
        "session first, then move or convert the pipeline"
    )


def extras() -> nn.ModuleDict:
    """Modules the toy lacks (seeded): 1x1 and 3x3 convolutions, one already channels_last, integer,
    complex and mixed buffers, an empty module, and float16, bfloat16 and float64 linears."""
    torch.manual_seed(5)
    mods = nn.ModuleDict(
        {
            "conv1": nn.Conv2d(4, 4, 1),
            "conv3": nn.Conv2d(4, 4, 3),
            "conv_cl": nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last),
            "ints": nn.Module(),
            "cplx": nn.Module(),
            "mixed": nn.Linear(4, 4),
            "empty": nn.Module(),
            "f16": nn.Linear(4, 4).half(),
            "bf16": nn.Linear(4, 4).bfloat16(),
            "f64": nn.Linear(4, 4).double(),
        }
    )
    mods["ints"].register_buffer("i", torch.arange(6).reshape(2, 3))
    mods["cplx"].register_buffer("c", torch.randn(3, dtype=torch.complex64))
    mods["mixed"].register_buffer("steps", torch.tensor([3]))
    return mods


def build() -> toy.ToyPipeline:
    """The seed-0 toy pipeline with `extras` under ``transformer.extras`` (unused by its forward)."""
    p = toy.build(0)
    p.transformer.extras = extras()
    return p


def fingerprint(module: nn.Module) -> Fingerprint:
    """Each parameter and buffer of ``module`` (duplicates kept): id, pointer, dtype, device, strides."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [(n, id(t), t.data_ptr(), t.dtype, t.device, t.stride()) for n, t in named]


def keeps(module: nn.Module, before: Fingerprint) -> bool:
    """Whether every tensor of ``module`` is the object, memory, dtype, device and strides it was."""
    return fingerprint(module) == before


def leftovers(p: nn.Module) -> set[str]:
    """Names the session set on any module's ``__dict__`` that are still there."""
    names = {"to", "cpu", "float", "double", "half", "bfloat16", "_apply", "__deepcopy__", "__reduce_ex__"}
    return {f"{path}.{n}" for path, m in p.named_modules() for n in names & set(vars(m))}


def session(p: Any, **options: Any) -> torchferry.Session:
    """A CPU session of ``p`` (layerwise unless told), warnings of a strategy's fit ignored."""
    options = {"strategy": "layerwise", "device": "cpu", **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        return torchferry.offload(p, **options)


def closes_clean(p: toy.ToyPipeline, ref: toy.ToyPipeline) -> None:
    """After close: weights equal ``ref``'s, no session attribute left, and a conversion converts."""
    assert same_state(p, ref)
    assert leftovers(p) == set()
    assert p.half() is p
    assert {t.dtype for t in p.transformer.blocks.parameters()} == {torch.float16}


# ------------------------------------------------------------------------------ no-op conversions
_F32 = torch.zeros(1)
NO_OPS: dict[str, tuple[str, Call]] = {
    "q.to(float32)": ("blocks.3.q", lambda m: m.to(torch.float32)),
    "q.to(device=, dtype=)": ("blocks.3.q", lambda m: m.to(device="cpu", dtype=torch.float32)),
    "q.to(torch.device)": ("blocks.3.q", lambda m: m.to(torch.device("cpu"))),
    "q.to(cpu, non_blocking)": ("blocks.3.q", lambda m: m.to("cpu", non_blocking=True)),
    "q.to(tensor)": ("blocks.3.q", lambda m: m.to(_F32)),
    "q.to(None)": ("blocks.3.q", lambda m: m.to(None)),
    "q.float()": ("blocks.3.q", lambda m: m.float()),
    "q.cpu()": ("blocks.3.q", lambda m: m.cpu()),
    "q.to(preserve_format)": ("blocks.3.q", lambda m: m.to(memory_format=torch.preserve_format)),
    "q.to(float32, non_blocking, channels_last)": (
        "blocks.3.q",
        lambda m: m.to(torch.float32, non_blocking=True, memory_format=torch.channels_last),
    ),
    "block.to(channels_last)": ("blocks.3", lambda m: m.to(memory_format=torch.channels_last)),
    "block.to(cpu)": ("blocks.3", lambda m: m.to("cpu")),
    "conv3.to(contiguous_format)": ("extras.conv3", lambda m: m.to(memory_format=torch.contiguous_format)),
    "conv3.to(preserve_format)": ("extras.conv3", lambda m: m.to(memory_format=torch.preserve_format)),
    "conv_cl.to(channels_last)": ("extras.conv_cl", lambda m: m.to(memory_format=torch.channels_last)),
    "ints.half()": ("extras.ints", lambda m: m.half()),
    "ints.to(float64)": ("extras.ints", lambda m: m.to(torch.float64)),
    "ints.bfloat16()": ("extras.ints", lambda m: m.bfloat16()),
    "cplx.half()": ("extras.cplx", lambda m: m.half()),
    "cplx.double()": ("extras.cplx", lambda m: m.double()),
    "mixed.to(float32)": ("extras.mixed", lambda m: m.to(torch.float32)),
    "empty.to(float16)": ("extras.empty", lambda m: m.to(torch.float16)),
    "empty.double()": ("extras.empty", lambda m: m.double()),
    "f16.half()": ("extras.f16", lambda m: m.half()),
    "bf16.bfloat16()": ("extras.bf16", lambda m: m.bfloat16()),
    "f64.double()": ("extras.f64", lambda m: m.double()),
    "f64.to(cpu, float64)": ("extras.f64", lambda m: m.to("cpu", torch.float64)),
}


@pytest.mark.parametrize("case", list(NO_OPS))
def test_a_conversion_plain_torch_keeps_every_tensor_of_returns_the_module(case: str) -> None:
    """A conversion that leaves every tensor of the plain module as it was returns the served module
    and leaves every tensor as it was too; later outputs and the weights after close are exact."""
    where, call = NO_OPS[case]
    p, plain, ref = build(), build(), build()
    args = inputs()
    plain_module = plain.transformer.get_submodule(where)
    before = fingerprint(plain_module)
    assert call(plain_module) is plain_module
    assert keeps(plain_module, before)  # the case is a no-op in plain torch
    with session(p):
        run(p, args)
        module = p.transformer.get_submodule(where)
        before = fingerprint(module)
        assert call(module) is module
        assert keeps(module, before)
        assert torch.equal(run(p, args), run(ref, args))
    closes_clean(p, ref)


# ------------------------------------------------------------------------------ refused conversions
CHANGES: dict[str, tuple[str, Call]] = {
    "conv1.to(channels_last)": (
        "transformer.extras.conv1",
        lambda m: m.to(memory_format=torch.channels_last),
    ),
    "conv3.to(channels_last)": (
        "transformer.extras.conv3",
        lambda m: m.to(memory_format=torch.channels_last),
    ),
    "conv_cl.to(contiguous)": (
        "transformer.extras.conv_cl",
        lambda m: m.to(memory_format=torch.contiguous_format),
    ),
    "q.half()": ("transformer.blocks.3.q", lambda m: m.half()),
    "q.double()": ("transformer.blocks.3.q", lambda m: m.double()),
    "q.bfloat16()": ("transformer.blocks.0.q", lambda m: m.bfloat16()),
    "q.to(f16 tensor)": ("transformer.blocks.3.q", lambda m: m.to(torch.zeros(1, dtype=torch.float16))),
    "q.to(meta)": ("transformer.blocks.3.q", lambda m: m.to("meta")),
    "q.to('cpu:0') (Tensor.to copies)": ("transformer.blocks.3.q", lambda m: m.to("cpu:0")),
    "q.to(device=meta, dtype=float32)": (
        "transformer.blocks.3.q",
        lambda m: m.to(device="meta", dtype=torch.float32),
    ),
    "block.float() (a float16 gate)": ("transformer.blocks.3", lambda m: m.float()),
    "cplx.to(float32)": ("transformer.extras.cplx", lambda m: m.to(torch.float32)),
    "f16.float()": ("transformer.extras.f16", lambda m: m.float()),
    "extras.to(float32) (a float64 child)": ("transformer.extras", lambda m: m.to(torch.float32)),
    "transformer.to(float16)": ("transformer", lambda m: m.to(torch.float16)),
    "pipeline.half()": ("", lambda m: m.half()),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_conversion_that_changes_a_tensor_is_refused_before_anything_changes(case: str) -> None:
    """A conversion that changes some tensor of the plain module raises the whole refusal on the served
    one, every tensor of the pipeline unchanged; later outputs and the weights after close are exact."""
    where, call = CHANGES[case]
    p, plain, ref = build(), build(), build()
    args = inputs()
    plain_module = find_attr(plain, where)
    before = fingerprint(plain_module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # complex to real discards the imaginary part
        call(plain_module)
    assert not keeps(plain_module, before)  # the case changes a tensor in plain torch
    with session(p):
        run(p, args)
        before = fingerprint(p)
        with pytest.raises(ExecutionError, match=refusal(where)):
            call(find_attr(p, where))
        assert keeps(p, before)
        assert torch.equal(run(p, args), run(ref, args))
    closes_clean(p, ref)


# ------------------------------------------------------------------------------ torch's own errors
ERRORS: dict[str, tuple[str, Call]] = {
    "empty.to(int64)": ("extras.empty", lambda m: m.to(torch.int64)),
    "ints.to(int64)": ("extras.ints", lambda m: m.to(torch.int64)),
    "ints.to(int tensor)": ("extras.ints", lambda m: m.to(torch.arange(2))),
    "q.to(bool)": ("blocks.3.q", lambda m: m.to(dtype=torch.bool)),
    "f16.half(argument)": ("extras.f16", lambda m: m.half(torch.float16)),
    "q.cpu(argument)": ("blocks.3.q", lambda m: m.cpu(0)),
    "q.float(keyword)": ("blocks.3.q", lambda m: m.float(dtype=torch.float32)),
    "q.to(bad device)": ("blocks.3.q", lambda m: m.to("not a device")),
    "q.to(two dtypes)": ("blocks.3.q", lambda m: m.to(torch.float32, torch.float32)),
    "q.to(copy=True)": ("blocks.3.q", lambda m: m.to(torch.float32, copy=True)),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_arguments_plain_torch_rejects_raise_its_own_error(case: str) -> None:
    """Arguments the plain conversion rejects (an integer dtype, an argument ``.half()`` takes none
    of) raise the plain error and message on the served module, even where no tensor would change."""
    where, call = ERRORS[case]
    p, plain, ref = build(), build(), build()
    with pytest.raises((TypeError, RuntimeError)) as expected:
        call(plain.transformer.get_submodule(where))
    with session(p):
        module = p.transformer.get_submodule(where)
        before = fingerprint(p)
        with pytest.raises(expected.type, match=re.escape(str(expected.value))):
            call(module)
        assert keeps(p, before)
    closes_clean(p, ref)


@pytest.mark.xfail(
    strict=True,
    reason="a no-op .to(complex dtype) returns the module silently; plain nn.Module.to warns "
    "'Complex modules are a new feature...' (UserWarning) first",
)
def test_a_no_op_complex_conversion_warns_as_plain_torch() -> None:
    """``.to(torch.complex64)`` of a module with no floating tensor warns as plain torch does."""
    p = build()
    with session(p), pytest.warns(UserWarning, match="Complex modules are a new feature"):
        assert p.transformer.extras.ints.to(torch.complex64) is p.transformer.extras.ints


@pytest.mark.xfail(
    strict=True,
    reason="a memory format of another rank than a 4-d weight (channels_last_3d) raises the session's "
    "ExecutionError; plain torch raises RuntimeError 'required rank 5 tensor to use channels_last_3d "
    "format' (nothing is converted either way)",
)
def test_a_memory_format_of_another_rank_keeps_its_own_error() -> None:
    """``.to(memory_format=torch.channels_last_3d)`` of a Conv2d raises plain torch's RuntimeError."""
    p = build()
    with session(p), pytest.raises(RuntimeError, match="required rank 5 tensor"):
        p.transformer.extras.conv3.to(memory_format=torch.channels_last_3d)


# ------------------------------------------------------------------------------ inside a step
CONFIGS: dict[str, dict[str, Any]] = {
    "layerwise": {"strategy": "layerwise"},
    "resident2": {"strategy": "layerwise", "resident_layers": 2},
    "model_level": {"strategy": "model_level"},
    "none": {"strategy": "none"},
    "auto": {"strategy": "auto"},
}


@pytest.mark.parametrize("i", [0, 5])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_conversion_from_a_forward_hook_is_answered_on_the_units_being_served(config: str, i: int) -> None:
    """From a pre-hook of block ``i`` during a step (a staged, resident, ring or streamed unit), a no-op
    conversion of its ``q`` returns it with its device tensors as they were, and a changing one of the
    block is refused with nothing changed; every call's outputs equal the plain run's."""
    p, ref = build(), build()
    args = inputs()
    seen: list[bool] = []

    def served(m: nn.Module, _: Any) -> None:
        before = fingerprint(m)
        seen.append(m.q.to(torch.float32) is m.q and m.q.cpu() is m.q and m.float is not None)
        with pytest.raises(ExecutionError, match=refusal(f"transformer.blocks.{i}")):
            m.float()
        seen.append(keeps(m, before))

    def plain(m: nn.Module, _: Any) -> None:
        assert m.q.to(torch.float32) is m.q and m.q.cpu() is m.q

    p.transformer.blocks[i].register_forward_pre_hook(served)
    ref.transformer.blocks[i].register_forward_pre_hook(plain)
    with session(p, **CONFIGS[config]):
        for _ in range(2):
            assert torch.equal(run(p, args), run(ref, args))
        assert torch.equal(p("a cat"), ref("a cat"))
    assert seen and all(seen)
    closes_clean(p, ref)


# ------------------------------------------------------------------------------ the meta device
META_REFUSED: dict[str, Call] = {
    "cpu()": lambda m: m.cpu(),
    "to('cpu')": lambda m: m.to("cpu"),
    "to(torch.device('cpu'))": lambda m: m.to(torch.device("cpu")),
    "to(cpu tensor)": lambda m: m.to(_F32),
    "to(device=cpu, dtype=float32)": lambda m: m.to(device="cpu", dtype=torch.float32),
    "to('meta')": lambda m: m.to("meta"),  # its tensors are at host memory between steps
    "half()": lambda m: m.half(),
}


@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
@pytest.mark.parametrize("move", list(META_REFUSED))
def test_on_the_meta_device_a_move_of_a_module_at_host_memory_is_refused(move: str, strategy: str) -> None:
    """On a meta session a move of a block or encoder to the host (where its tensors are between steps)
    or to meta is refused, nothing changed, while a dtype no-op returns it; close gives the weights back."""
    p, ref = build(), build()
    s = session(p, strategy=strategy, device="meta")
    for where in ("transformer.blocks.3.q", "text_encoder"):
        module = find_attr(p, where)
        before = fingerprint(p)
        with pytest.raises(ExecutionError, match=refusal(where)):
            META_REFUSED[move](module)
        assert keeps(p, before)
        assert module.to(torch.float32) is module
    s.close()
    closes_clean(p, ref)


# ------------------------------------------------------------------------------ the pipeline level
def test_the_toy_pipeline_answers_its_own_no_ops_and_refuses_the_rest() -> None:
    """The toy pipeline (an nn.Module): ``.to('cpu')``, ``.to(None)``, ``.cpu()`` return it; ``.to(float32)``
    (its float16 gates), ``.double()`` and ``.to('meta')`` are refused with nothing changed."""
    p, ref = build(), build()
    with session(p):
        p("a cat")
        assert p.to("cpu") is p and p.to(None) is p and p.cpu() is p and p.to() is p
        before = fingerprint(p)
        for call in (lambda m: m.to(torch.float32), lambda m: m.double(), lambda m: m.to("meta")):
            with pytest.raises(ExecutionError, match=refusal("")):
                call(p)
        assert keeps(p, before)
        assert torch.equal(p("a cat"), ref("a cat"))
    closes_clean(p, ref)


def _from_pipe_torch_dtype(diffusers: Any, pipe: Any, dtype: torch.dtype) -> Any:
    """``WanPipeline.from_pipe(pipe, torch_dtype=dtype)``, the older spelling (its FutureWarning ignored)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return diffusers.WanPipeline.from_pipe(pipe, torch_dtype=dtype)


def _wan_fingerprint(pipe: Any) -> dict[str, Fingerprint]:
    return {k: fingerprint(v) for k, v in pipe.components.items() if isinstance(v, nn.Module)}


def _wan_same(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize(
    "call",
    [
        lambda pipe: pipe.to(torch.float32),
        lambda pipe: pipe.to(None),
        lambda pipe: pipe.to("cpu"),
        lambda pipe: pipe.to("cpu", torch.float32),
        lambda pipe: pipe.to(dtype=torch.float32),
    ],
    ids=["to(float32)", "to(None)", "to(cpu)", "to(cpu, float32)", "to(dtype=float32)"],
)
def test_a_diffusers_pipeline_to_that_changes_nothing_returns_it(call: Call) -> None:
    """``WanPipeline.to`` that changes no tensor (its components are float32 on the CPU) returns the
    pipeline during a session, every tensor as it was; the run after it equals the plain run."""
    plain = toy.wan_pipeline()
    expected = toy.run_wan(plain)
    assert call(plain) is plain
    pipe = toy.wan_pipeline()
    with session(pipe):
        before = _wan_fingerprint(pipe)
        assert call(pipe) is pipe
        assert _wan_fingerprint(pipe) == before
        assert _wan_same(toy.run_wan(pipe), expected)
    assert all(leftovers(v) == set() for v in pipe.components.values() if isinstance(v, nn.Module))


def test_a_diffusers_pipeline_conversion_is_refused_with_every_component_unchanged() -> None:
    """``pipe.to(torch.bfloat16)``, ``from_pipe`` to float16 (``dtype=``, ``torch_dtype=``) and a
    channels_last_3d VAE (its 5-d convolutions) are refused, no component's tensor changed; after
    close they convert."""
    plain = toy.wan_pipeline()
    expected = toy.run_wan(plain)
    pipe = toy.wan_pipeline()
    diffusers: Any = pytest.importorskip("diffusers")
    with session(pipe):
        before = _wan_fingerprint(pipe)
        for call in (
            lambda: pipe.to(torch.bfloat16),
            lambda: diffusers.WanPipeline.from_pipe(pipe, dtype=torch.float16),
            lambda: _from_pipe_torch_dtype(diffusers, pipe, torch.float16),
            lambda: pipe.vae.to(memory_format=torch.channels_last_3d),
        ):
            with pytest.raises(ExecutionError, match=REFUSED):
                call()
            assert _wan_fingerprint(pipe) == before
        assert _wan_same(toy.run_wan(pipe), expected)
    pipe.to(torch.bfloat16)
    assert {t.dtype for t in pipe.transformer.parameters()} == {torch.bfloat16}


def test_from_pipe_of_a_bfloat16_pipeline_converts_only_as_asked() -> None:
    """On a pipeline made bfloat16 before opening, ``pipe.to(bfloat16)`` and ``from_pipe`` to bfloat16
    (``dtype=``, ``torch_dtype=``) return pipelines that run as the plain bfloat16 one; ``from_pipe(pipe)``
    (float32 by default) and ``pipe.to(None, float32)`` are refused, nothing converted."""
    diffusers: Any = pytest.importorskip("diffusers")
    plain = toy.wan_pipeline().to(torch.bfloat16)
    expected = toy.run_wan(plain, steps=1)
    pipe = toy.wan_pipeline().to(torch.bfloat16)
    with session(pipe):
        assert pipe.to(torch.bfloat16) is pipe
        for other in (
            diffusers.WanPipeline.from_pipe(pipe, dtype=torch.bfloat16),
            _from_pipe_torch_dtype(diffusers, pipe, torch.bfloat16),
        ):
            assert other.transformer is pipe.transformer
            assert _wan_same(toy.run_wan(other, steps=1), expected)
        before = _wan_fingerprint(pipe)
        for call in (lambda: diffusers.WanPipeline.from_pipe(pipe), lambda: pipe.to(None, torch.float32)):
            with pytest.raises(ExecutionError, match=REFUSED):
                call()
            assert _wan_fingerprint(pipe) == before
        assert _wan_same(toy.run_wan(pipe, steps=1), expected)
    assert {t.dtype for t in pipe.transformer.parameters()} == {torch.bfloat16}


def test_a_pipeline_from_components_converts_as_its_source() -> None:
    """A pipeline built from ``pipe.components`` during a session shares the served modules: its no-op
    ``.to(float32)`` returns it and its ``.half()`` of the transformer is refused, nothing changed."""
    diffusers: Any = pytest.importorskip("diffusers")
    plain = toy.wan_pipeline()
    expected = toy.run_wan(plain)
    pipe = toy.wan_pipeline()
    with session(pipe):
        other = diffusers.WanPipeline(**pipe.components)
        assert other.to(torch.float32) is other
        before = _wan_fingerprint(pipe)
        with pytest.raises(ExecutionError, match=refusal("transformer")):
            other.transformer.half()
        assert _wan_fingerprint(pipe) == before
        assert _wan_same(toy.run_wan(other), expected)


WAN_COMPONENTS: dict[str, tuple[str, Call, bool]] = {
    "transformer.float()": ("transformer", lambda m: m.float(), True),
    "text_encoder.float()": ("text_encoder", lambda m: m.float(), True),
    "vae.to(float32)": ("vae", lambda m: m.to(torch.float32), True),
    "transformer.half()": ("transformer", lambda m: m.half(), False),
    "text_encoder.half()": ("text_encoder", lambda m: m.half(), False),
    "vae.bfloat16()": ("vae", lambda m: m.bfloat16(), False),
}


@pytest.mark.parametrize("case", list(WAN_COMPONENTS))
def test_a_diffusers_or_transformers_model_answers_through_its_own_base(case: str) -> None:
    """The Wan components' conversions (diffusers' ModelMixin, transformers' PreTrainedModel, whose
    ``to``/``half``/``float`` check quantization first): a no-op returns the component, a change is
    refused naming it, every tensor as it was; the run after it equals the plain run."""
    name, call, no_op = WAN_COMPONENTS[case]
    plain = toy.wan_pipeline()
    expected = toy.run_wan(plain, steps=1)
    pipe = toy.wan_pipeline()
    with session(pipe):
        toy.run_wan(pipe, steps=1)
        module = getattr(pipe, name)
        before = _wan_fingerprint(pipe)
        if no_op:
            assert call(module) is module
        else:
            with pytest.raises(ExecutionError, match=refusal(name)):
                call(module)
        assert _wan_fingerprint(pipe) == before
        assert _wan_same(toy.run_wan(pipe, steps=1), expected)
    assert leftovers(module) == set()


def test_the_wan_vae_answers_memory_format_no_ops() -> None:
    """The Wan VAE (5-d convolution weights): ``.to(memory_format=contiguous_format)`` and
    ``preserve_format`` return it, as in plain torch, with every tensor as it was."""
    plain, pipe = toy.wan_pipeline(), toy.wan_pipeline()
    with session(pipe):
        for fmt in (torch.contiguous_format, torch.preserve_format):
            before, plain_before = fingerprint(pipe.vae), fingerprint(plain.vae)
            assert plain.vae.to(memory_format=fmt) is plain.vae and keeps(plain.vae, plain_before)
            assert pipe.vae.to(memory_format=fmt) is pipe.vae and keeps(pipe.vae, before)


# ------------------------------------------------------------------------------ attribute hazards
def test_copying_and_pickling_are_still_refused_with_their_messages() -> None:
    """With the conversion methods in its ``__dict__``, a served module still refuses pickling,
    copy.copy and copy.deepcopy with their own messages; after close all three work."""
    p = build()
    q = p.transformer.blocks[3].q
    with session(p):
        with pytest.raises(ExecutionError, match=re.escape("pickling or copying 'transformer.blocks.3.q'")):
            pickle.dumps(q)
        with pytest.raises(ExecutionError, match=re.escape("pickling or copying 'transformer.blocks.3.q'")):
            copy.copy(q)
        with pytest.raises(ExecutionError, match=re.escape("copy.deepcopy of 'transformer.blocks.3.q'")):
            copy.deepcopy(q)
    clone = pickle.loads(pickle.dumps(q))
    assert torch.equal(clone.weight, q.weight) and "to" not in vars(clone)
    assert copy.deepcopy(q).to(torch.float64).weight.dtype == torch.float64


def test_the_conversion_attributes_introspect_and_partial_as_methods() -> None:
    """``inspect.signature`` of each conversion, its ``__name__`` and ``__self__`` are plain torch's, and
    ``functools.partial(module.to, ...)``
    returns the module for a no-op and is refused for a change."""
    p, plain = build(), build()
    q, plain_q = p.transformer.blocks[3].q, plain.transformer.blocks[3].q
    with session(p):
        for name in ("to", "cpu", "float", "double", "half", "bfloat16"):
            served, own = getattr(q, name), getattr(plain_q, name)
            assert inspect.signature(served) == inspect.signature(own)
            assert (served.__name__, served.__self__) == (own.__name__, q)
        assert functools.partial(q.to, torch.float32)() is q
        before = fingerprint(q)
        with pytest.raises(ExecutionError, match=refusal("transformer.blocks.3.q")):
            functools.partial(q.to, dtype=torch.float16)()
        assert keeps(q, before)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: type(m).to(m, torch.float32),
        lambda m: nn.Module.to(m, "cpu"),
        nn.Module.half,
        nn.Module.cpu,
        nn.Module.float,
    ],
    ids=["type(m).to(m, float32)", "Module.to(m, cpu)", "Module.half(m)", "Module.cpu(m)", "Module.float(m)"],
)
def test_a_class_method_called_directly_is_refused_by_apply(call: Call) -> None:
    """Calling the class's conversion directly bypasses the instance's answer: it reaches the refused
    ``_apply``, even for a call that would change nothing, and nothing changes."""
    p, ref = build(), build()
    q = p.transformer.blocks[3].q
    with session(p):
        before = fingerprint(p)
        with pytest.raises(ExecutionError, match=refusal("transformer.blocks.3.q")):
            call(q)
        assert keeps(p, before)
    closes_clean(p, ref)


def test_a_module_added_after_opening_converts_as_plain_and_its_parent_is_refused() -> None:
    """A float64 linear attached to a served block after opening converts as plain torch (it is not
    served); the block's ``.to(float32)`` is refused with the new child unconverted."""
    p, ref = build(), build()
    torch.manual_seed(3)
    new = nn.Linear(4, 4).double()
    with session(p):
        block = p.transformer.blocks[3]
        block.late = new
        before = fingerprint(block)
        with pytest.raises(ExecutionError, match=refusal("transformer.blocks.3")):
            block.to(torch.float32)
        assert keeps(block, before)
        assert new.to(torch.float32) is new and new.weight.dtype == torch.float32
        del block.late
    assert "to" not in vars(new)
    closes_clean(p, ref)


def test_a_module_shared_by_two_parents_is_answered_once() -> None:
    """A linear reachable at two paths of the DiT gets one conversion answer: a no-op from either path
    returns it, a change is refused naming its first path; close removes it once."""
    p, ref = build(), build()
    for q in (p, ref):
        q.transformer.extras["alias"] = q.transformer.extras["mixed"]
    with session(p):
        mixed = p.transformer.extras.mixed
        assert p.transformer.extras.alias.to(torch.float32) is mixed
        before = fingerprint(p)
        with pytest.raises(ExecutionError, match=refusal("transformer.extras.mixed")):
            p.transformer.extras.alias.half()
        assert keeps(p, before)
        assert torch.equal(p("a cat"), ref("a cat"))
    closes_clean(p, ref)


def test_two_sessions_answer_each_for_its_own_pipeline() -> None:
    """With two pipelines served at once (the CPU and the meta device), each module's answer uses its
    own session's device, and closing one leaves the other's refusals in place."""
    a, b, ref = build(), build(), build()
    sa = session(a)
    sb = session(b, device="meta")
    assert a.transformer.blocks[3].q.cpu() is a.transformer.blocks[3].q
    with pytest.raises(ExecutionError, match=refusal("transformer.blocks.3.q")):
        b.transformer.blocks[3].q.cpu()
    sa.close()
    assert leftovers(a) == set()
    with pytest.raises(ExecutionError, match=refusal("transformer.blocks.3.q")):
        b.transformer.blocks[3].q.cpu()
    assert b.transformer.blocks[3].q.to(torch.float32) is b.transformer.blocks[3].q
    sb.close()
    closes_clean(a, ref)
    closes_clean(b, build())


def test_a_wrapper_kept_past_close_converts_as_plain_torch() -> None:
    """``f = module.to`` taken during a session and called after close converts as plain torch (a real
    float64 conversion), and ``g = block.half`` likewise; neither writes anything back onto the module."""
    p = build()
    q, block = p.transformer.blocks[3].q, p.transformer.blocks[5]
    with session(p):
        to, half, cpu = q.to, block.half, q.cpu
    assert to(torch.float64) is q and q.weight.dtype == torch.float64
    assert half() is block and {t.dtype for t in block.parameters()} == {torch.float16}
    assert cpu() is q
    assert leftovers(p) == set()


def test_a_wrapper_kept_into_a_new_session_obeys_the_new_one() -> None:
    """An old session's ``module.to`` called during a later session on the same pipeline returns the
    module for a no-op and is refused by the new session for a change, nothing changed."""
    p, ref = build(), build()
    q = p.transformer.blocks[3].q
    with session(p):
        old = q.to
    with session(p):
        assert old(torch.float32) is q
        before = fingerprint(p)
        with pytest.raises(ExecutionError, match=refusal("transformer.blocks.3.q")):
            old(torch.float16)
        assert keeps(p, before)
        assert torch.equal(p("a cat"), ref("a cat"))
    closes_clean(p, ref)


def test_a_session_that_fails_mid_step_still_answers_and_closes_clean() -> None:
    """After a step aborted by an error, a no-op conversion still returns the module and a change is
    still refused; the next step and the weights after close are exact."""
    p, ref = build(), build()
    args = inputs()
    block = p.transformer.blocks[4]
    handle = block.register_forward_pre_hook(lambda m, a: m.float())  # refused inside the step
    with session(p):
        with pytest.raises(ExecutionError, match=refusal("transformer.blocks.4")):
            run(p, args)
        handle.remove()
        assert block.q.to(torch.float32) is block.q
        with pytest.raises(ExecutionError, match=refusal("transformer.blocks.4")):
            block.half()
        assert torch.equal(run(p, args), run(ref, args))
    closes_clean(p, ref)
