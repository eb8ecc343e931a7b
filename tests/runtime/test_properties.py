"""Randomised end-to-end properties of sessions on toy pipelines of random shape, under random strategies.

Each example builds a toy pipeline (one or two experts, random DiT and encoder block counts), opens a
session under a random request (none, model_level, layerwise with a random depth and resident head,
or a random resident set through ``policies.layerwise(depth, resident=...)``), runs a few pipeline
calls with random step counts and random per-step block skips, and checks what users rely on:
outputs equal the plain run bit for bit, each step's measured peak equals the simulator's, faults
leave the pipeline usable, and ``close()`` gives every tensor back exactly as it was.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from module_checks import hook_count

import torchferry
from torchferry import OffloadWarning, policies, topology
from torchferry.session._session import Session
from torchferry.testing import toy
from torchferry.topology import Plan

#: Few, varied, reproducible examples: the same ones on every run (CI stays stable).
PROPERTY = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: The toy's declaration with the VAE on demand, so layerwise requests may select it.
ON_DEMAND_VAE = topology.Declaration(
    resident_dit_paths={"transformer", "transformer_2"},
    encoder_block_attrs={"text_encoder": ("blocks",)},
    encoder_dlo_weight_replication={"text_encoder"},
    on_demand_component_paths={"vae"},
)


# ------------------------------------------------------------------------------------- cases
@attrs.frozen
class Shape:
    """A toy pipeline's structure and weight seed."""

    two_experts: bool
    blocks: int
    encoder_blocks: int
    hidden: int
    seed: int

    def build(self) -> toy.ToyPipeline:
        return toy.build(
            self.seed,
            two_experts=self.two_experts,
            blocks=self.blocks,
            encoder_blocks=self.encoder_blocks,
            hidden=self.hidden,
        )

    def build_empty(self) -> toy.ToyPipeline:
        return toy.build_empty(
            two_experts=self.two_experts,
            blocks=self.blocks,
            encoder_blocks=self.encoder_blocks,
            hidden=self.hidden,
        )

    @property
    def dits(self) -> tuple[str, ...]:
        return ("transformer", "transformer_2") if self.two_experts else ("transformer",)

    @property
    def block_paths(self) -> tuple[str, ...]:
        dit = tuple(f"{d}.blocks.{i}" for d in self.dits for i in range(self.blocks))
        return (*dit, *(f"text_encoder.blocks.{i}" for i in range(self.encoder_blocks)))


@attrs.frozen
class Request:
    """What a session is opened with; ``resident`` set means ``policies.layerwise(depth, resident)``."""

    strategy: str
    depth: int = 1
    resident_layers: int = 0
    components: frozenset[str] | None = None
    on_demand_vae: bool = False
    resident: tuple[str, ...] | None = None
    wrapped: bool = False
    budget: float | None = None

    def policy(self, pipeline: toy.ToyPipeline) -> policies.Policy | None:
        """The policy passed as ``policy=``, or ``None`` for the strategy's built-in one.

        ``budget`` (a fraction of the pipeline's bytes) asks `policies.auto`; ``wrapped`` hides the
        policy behind a plain function, so the session asks it for every forward index.
        """
        chosen: policies.Policy | None = None
        if self.budget is not None:
            chosen = policies.auto(_budget(pipeline, self.budget))
        elif self.resident is not None:
            chosen = policies.layerwise(self.depth, resident=self.resident)
        if not self.wrapped:
            return chosen
        inner = chosen if chosen is not None else _BUILTIN[self.strategy](self.depth)

        def wrapper(plan: Plan, step: policies.Step, /) -> policies.Schedule:
            return inner(plan, step)

        return wrapper

    def open(self, pipeline: toy.ToyPipeline, **extra: Any) -> Session:
        """The session; legacy selections may warn (`OffloadWarning` only) about what stays resident."""
        options: dict[str, Any] = dict(extra)
        policy = self.policy(pipeline)
        if self.strategy == "layerwise":
            options.update(resident_layers=self.resident_layers)
            if policy is None:  # a policy given takes its depth from its factory, not from here
                options.update(prefetch_depth=self.depth)
        if self.components is not None:
            options["components"] = set(self.components)
        if self.on_demand_vae:
            options["declaration"] = ON_DEMAND_VAE
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session = torchferry.offload(
                pipeline, strategy=self.strategy, device="cpu", policy=policy, **options
            )
        assert all(issubclass(w.category, OffloadWarning) for w in caught), [str(w.message) for w in caught]
        if caught:
            assert self.components is None, [str(w.message) for w in caught]
        return session


_BUILTIN: dict[str, Callable[[int], policies.Policy]] = {
    "none": lambda depth: policies.none(),
    "model_level": lambda depth: policies.model_level(),
    "layerwise": policies.layerwise,
}


@attrs.frozen
class Call:
    """One pipeline call: prompt, step count, the DiT blocks each step skips, and whether it runs
    under ``torch.inference_mode()`` (the toy itself runs under ``torch.no_grad()``)."""

    prompt: str
    steps: int
    skip: tuple[tuple[int, frozenset[int]], ...] = ()
    inference: bool = False

    def __call__(self, pipeline: toy.ToyPipeline) -> torch.Tensor:
        with torch.inference_mode() if self.inference else contextlib.nullcontext():
            out: torch.Tensor = pipeline(self.prompt, steps=self.steps, skip=dict(self.skip), seed=self.steps)
        return out


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    return Shape(
        two_experts=draw(st.booleans()),
        blocks=draw(st.integers(1, 7)),
        encoder_blocks=draw(st.integers(1, 4)),
        hidden=draw(st.sampled_from([8, 16])),
        seed=draw(st.integers(0, 3)),
    )


@st.composite
def requests(draw: st.DrawFn, shape: Shape) -> Request:
    """A request this shape can serve: explicit selections only where `resolve` accepts them."""
    strategy = draw(st.sampled_from(["none", "model_level", "layerwise", "layerwise"]))
    on_demand = draw(st.booleans())
    explicit = draw(st.booleans())
    components: frozenset[str] | None = None
    if explicit:
        names = ["dit", "text_encoder", "vae"]
        if strategy == "layerwise" and not on_demand:
            names.remove("vae")
        components = frozenset(draw(st.lists(st.sampled_from(names), min_size=1, unique=True)))
    if strategy != "layerwise":
        return Request(
            strategy=strategy, components=components, on_demand_vae=on_demand, wrapped=draw(st.booleans())
        )
    depth = draw(st.integers(1, 3))
    resident_layers = draw(st.integers(0, 3))
    if components is not None:
        # An explicit selection turns the single-streaming-block warnings into errors.
        if "text_encoder" in components and shape.encoder_blocks < 2:
            components -= {"text_encoder"}
        if "dit" in components and shape.blocks - min(resident_layers, shape.blocks) == 1:
            resident_layers = 0 if shape.blocks > 1 else 1
        if not components:
            components = (
                frozenset({"dit"}) if shape.blocks - min(resident_layers, shape.blocks) != 1 else None
            )
        if components is not None and "dit" not in components:
            resident_layers = 0  # resident layers of a DiT left out is refused (rule 2)
    resident = budget = None
    policy = draw(st.sampled_from(["built-in", "resident", "auto"]))
    if policy == "resident":
        resident = tuple(draw(st.lists(st.sampled_from(shape.block_paths), unique=True, max_size=6)))
    elif policy == "auto":
        budget = draw(st.sampled_from([0.3, 0.5, 0.8, 1.5]))
    request = Request(
        strategy=strategy,
        depth=depth,
        resident_layers=resident_layers,
        components=components,
        on_demand_vae=on_demand,
        resident=resident,
        budget=budget,
        wrapped=draw(st.booleans()),
    )
    if budget is not None and not _fits(shape, request):
        request = attrs.evolve(request, budget=None)
    return request


def _fits(shape: Shape, request: Request) -> bool:
    """Whether `policies.auto` finds a schedule within ``request.budget`` for the shape's plan."""
    assert request.budget is not None
    pipeline = shape.build_empty()
    config = topology.OffloadConfig(
        strategy="layerwise",
        resident_layers=request.resident_layers,
        components=request.components,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        plan = topology.resolve(
            topology.discover(pipeline, ON_DEMAND_VAE if request.on_demand_vae else None), config
        )
    try:
        policies.choose(plan, _budget(pipeline, request.budget))
    except torchferry.ScheduleError:
        return False
    return True


def _budget(pipeline: torch.nn.Module, fraction: float) -> int:
    """``fraction`` of the pipeline's bytes (tied tensors once)."""
    return max(1, int(fraction * sum(t.nbytes for t in {id(t): t for _, t in _named(pipeline)}.values())))


@st.composite
def calls(draw: st.DrawFn, shape: Shape, min_size: int = 2, max_size: int = 4) -> tuple[Call, ...]:
    """A few calls with random step counts (at least two different ones) and random block skips."""
    out: list[Call] = []
    for _ in range(draw(st.integers(min_size, max_size))):
        steps = draw(st.integers(1, 4))
        skip = draw(
            st.dictionaries(
                st.integers(0, steps - 1),
                st.frozensets(st.integers(0, shape.blocks - 1), max_size=shape.blocks),
                max_size=steps,
            )
        )
        prompt = draw(st.sampled_from(["a cat", "a red fox in snow", ""]))
        inference = draw(st.integers(0, 3)) == 0
        out.append(Call(prompt=prompt, steps=steps, skip=tuple(sorted(skip.items())), inference=inference))
    if len({c.steps for c in out}) == 1:
        out.append(attrs.evolve(out[0], steps=out[0].steps % 4 + 1))
    return tuple(out)


# ------------------------------------------------------------------------------- invariants


def _named(p: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*p.named_parameters(remove_duplicate=False), *p.named_buffers(remove_duplicate=False)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


@attrs.frozen(eq=False)
class Record:
    """One tensor as the user sees it: which object, its bytes, device, dtype, layout and storage."""

    obj: int
    bits: torch.Tensor
    device: torch.device
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage_nbytes: int
    kind: type
    requires_grad: bool
    inference: bool


def snapshot(p: torch.nn.Module) -> dict[str, Record]:
    return {
        name: Record(
            obj=id(t),
            bits=_bits(t),
            device=t.device,
            dtype=t.dtype,
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            offset=int(t.storage_offset()),
            storage_nbytes=t.untyped_storage().nbytes(),
            kind=type(t),
            requires_grad=t.requires_grad,
            inference=t.is_inference(),
        )
        for name, t in _named(p)
    }


def _ties(p: torch.nn.Module) -> set[frozenset[str]]:
    """Names grouped by tensor object (tied weights share a group)."""
    groups: dict[int, set[str]] = {}
    for name, t in _named(p):
        groups.setdefault(id(t), set()).add(name)
    return {frozenset(g) for g in groups.values()}


def assert_restored(p: torch.nn.Module, before: Mapping[str, Record], *, same_objects: bool = True) -> None:
    """Every tensor is back as ``before`` recorded it; tied ones share memory, untied ones own theirs."""
    now = snapshot(p)
    assert now.keys() == before.keys()
    for name, was in before.items():
        got = now[name]
        assert torch.equal(got.bits, was.bits), name
        assert (got.device, got.dtype, got.shape, got.stride, got.offset) == (
            was.device,
            was.dtype,
            was.shape,
            was.stride,
            was.offset,
        ), name
        assert (got.storage_nbytes, got.kind, got.requires_grad, got.inference) == (
            was.storage_nbytes,
            was.kind,
            was.requires_grad,
            was.inference,
        ), name
        if same_objects:
            assert got.obj == was.obj, name
    storages: dict[int, set[int]] = {}
    tensors = dict(_named(p))
    for group in _ties(p):
        ptrs = {tensors[n].data_ptr() for n in group}
        assert len(ptrs) == 1, sorted(group)
        storages.setdefault(tensors[next(iter(group))].untyped_storage().data_ptr(), set()).add(id(group))
    assert all(len(owners) == 1 for owners in storages.values()), "untied tensors share storage after close"
    assert hook_count(p) == 0


def assert_peaks_simulated(session: Session) -> None:
    """Each finished step's measured peak equals the simulator's, and its schedule passes `check`."""
    assert session.step_peaks
    for step, peak in session.step_peaks.items():
        schedule = session.schedules[step]
        policies.check(schedule, session.plan)
        assert peak == policies.simulate(schedule).peak_device_bytes, policies.format_schedule(schedule)


def assert_closed(session: Session, p: torch.nn.Module, before: Mapping[str, Record]) -> None:
    session.close()
    assert session.device_bytes == 0
    assert_restored(p, before)


# ------------------------------------------------------------------------------------ faults
class Boom(RuntimeError):
    """The error a fault raises."""


class Fault:
    """A hook that raises on the ``nth`` forward of its module (a `Boom`, or a KeyboardInterrupt)."""

    def __init__(self, nth: int, interrupt: bool) -> None:
        self.left = nth
        self.interrupt = interrupt
        self.fired = False

    def _tick(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.fired = True
            raise KeyboardInterrupt if self.interrupt else Boom("fault injected")

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        self._tick()

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._tick()


@contextlib.contextmanager
def installed(module: torch.nn.Module, fault: Fault, where: str, prepend: bool) -> Iterator[None]:
    if where == "pre":
        handle = module.register_forward_pre_hook(fault.pre, prepend=prepend)
    else:
        handle = module.register_forward_hook(fault.post, prepend=prepend)
    try:
        yield
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------- tests
@PROPERTY
@given(st.data())
def test_random_sessions_equal_the_plain_run(data: st.DataObject) -> None:
    """Random pipelines under random requests give the plain run's outputs and the simulated peaks, and
    close() restores every tensor (object, bytes, device, strides, ties) and removes every hook."""
    shape = data.draw(shapes(), label="shape")
    request = data.draw(requests(shape), label="request")
    run = data.draw(calls(shape), label="calls")
    opened, closed = data.draw(st.tuples(st.booleans(), st.booleans()), label="inference mode at open, close")
    p, ref = shape.build(), shape.build()
    before = snapshot(p)
    with torch.inference_mode(opened):
        session = request.open(p)
    for call in run:
        assert torch.equal(call(p), call(ref)), call
        assert session.hook_count == hook_count(p)
    assert_peaks_simulated(session)
    with torch.inference_mode(closed):
        assert_closed(session, p, before)


@PROPERTY
@given(st.data())
def test_a_fault_anywhere_leaves_the_pipeline_usable(data: st.DataObject) -> None:
    """An error or interrupt raised before or after any module's forward, on any step, leaves the next
    calls equal to the plain run, and close() still restores everything."""
    shape = data.draw(shapes(), label="shape")
    request = data.draw(requests(shape), label="request")
    warm, after = data.draw(calls(shape, 0, 1), label="warm-up"), data.draw(calls(shape, 1, 2), label="after")
    failing = data.draw(calls(shape, 1, 1), label="failing")[0]
    p, ref = shape.build(), shape.build()
    path = data.draw(st.sampled_from([name for name, _ in p.named_modules()]), label="module")
    fault = Fault(data.draw(st.integers(1, 6), label="nth"), data.draw(st.booleans(), label="interrupt"))
    where = data.draw(st.sampled_from(["pre", "post"]), label="hook")
    prepend = data.draw(st.booleans(), label="prepend")
    before = snapshot(p)
    session = request.open(p)
    for call in warm:
        assert torch.equal(call(p), call(ref))
    with installed(p.get_submodule(path), fault, where, prepend):
        try:
            out = failing(p)
        except (Boom, KeyboardInterrupt):
            assert fault.fired
        else:
            assert not fault.fired
            assert torch.equal(out, failing(ref))
    for call in after:
        assert torch.equal(call(p), call(ref)), call
    assert session.hook_count == hook_count(p)
    assert_peaks_simulated(session)
    assert_closed(session, p, before)


@PROPERTY
@given(st.data())
def test_reopening_with_other_requests_after_close(data: st.DataObject) -> None:
    """Open, run, close, then reopen the same pipeline under other random requests: every session
    equals the plain run and every close restores the pipeline."""
    shape = data.draw(shapes(), label="shape")
    p, ref = shape.build(), shape.build()
    before = snapshot(p)
    for i in range(data.draw(st.integers(2, 3), label="sessions")):
        request = data.draw(requests(shape), label=f"request {i}")
        session = request.open(p)
        for call in data.draw(calls(shape, 1, 2), label=f"calls {i}"):
            assert torch.equal(call(p), call(ref)), call
        assert_peaks_simulated(session)
        assert_closed(session, p, before)


@PROPERTY
@given(st.data())
def test_meta_built_pipeline_from_checkpoint_equals_the_built_one(data: st.DataObject) -> None:
    """A pipeline built under meta_parameters() and filled from a checkpoint runs like the normally built
    one, and close() leaves it equal to it: bytes, devices, strides and ties."""
    shape = data.draw(shapes(), label="shape")
    request = data.draw(requests(shape), label="request")
    run = data.draw(calls(shape, 1, 3), label="calls")
    ref = shape.build()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "toy.safetensors"
        toy.save_checkpoint(ref, path)
        p = shape.build_empty()
        session = request.open(p, checkpoint=path)
        for call in run:
            assert torch.equal(call(p), call(ref)), call
        assert_peaks_simulated(session)
        session.close()
    assert _ties(p) == _ties(ref)
    assert_restored(p, snapshot(ref), same_objects=False)


# ------------------------------------------------------------------------ any order of forwards
@attrs.frozen
class Action:
    """One thing a user does with an open session: a component forward, a pipeline call, a fault.

    ``kind``: ``encode`` (the text encoder), ``dit`` (``component`` with ``t`` and ``skip``), ``decode``
    (the VAE's forward), ``decode-running`` (``vae.decode`` inside ``session.running("vae")``),
    ``pipeline`` (``call``), or ``traced`` (``call`` under ``session.trace(component)``). A
    ``fault`` (module path, nth forward, interrupt) makes that module raise during the action.
    """

    kind: str
    component: str = "transformer"
    t: float = 0.5
    skip: frozenset[int] = frozenset()
    call: Call | None = None
    fault: tuple[str, int, bool] | None = None

    def __call__(self, p: toy.ToyPipeline, session: Session | None, inputs: Inputs) -> torch.Tensor:
        with torch.no_grad():
            if self.kind == "encode":
                out: torch.Tensor = p.text_encoder(inputs.ids)
                return out
            if self.kind == "dit":
                dit = p.get_submodule(self.component)
                out = dit(inputs.latents, torch.tensor([self.t]), inputs.context, skip=self.skip)
                return out
            if self.kind == "decode":
                out = p.vae(inputs.latents)
                return out
            if self.kind == "decode-running":
                with session.running("vae") if session is not None else contextlib.nullcontext():
                    return p.vae.decode(inputs.latents)
        assert self.call is not None
        if self.kind == "traced" and session is not None:
            with session.trace(self.component):
                return self.call(p)
        return self.call(p)


@attrs.frozen(eq=False)
class Inputs:
    """Fixed inputs for direct component forwards."""

    ids: torch.Tensor
    latents: torch.Tensor
    context: torch.Tensor

    @classmethod
    def make(cls, shape: Shape) -> Inputs:
        g = torch.Generator().manual_seed(shape.seed)
        return cls(
            ids=toy.tokenize("a cat"),
            latents=torch.randn(1, toy.LATENT_TOKENS, toy.LATENT_CHANNELS, generator=g),
            context=torch.randn(1, toy.TEXT_LEN, shape.hidden, generator=g),
        )


@st.composite
def actions(draw: st.DrawFn, shape: Shape, modules: list[str]) -> Action:
    kind = draw(
        st.sampled_from(["encode", "dit", "dit", "dit", "decode", "decode-running", "pipeline", "traced"])
    )
    component = draw(st.sampled_from(shape.dits))
    t = draw(st.sampled_from([0.25, 0.5, 1.0]))
    skip = draw(st.frozensets(st.integers(0, shape.blocks - 1), max_size=shape.blocks))
    call = draw(calls(shape, 1, 1))[0] if kind in ("pipeline", "traced") else None
    if kind == "traced":
        component = draw(st.sampled_from([*shape.dits, "text_encoder", "vae"]))
    fault = None
    if draw(st.integers(0, 3)) == 0:
        fault = (draw(st.sampled_from(modules)), draw(st.integers(1, 4)), draw(st.booleans()))
    return Action(kind=kind, component=component, t=t, skip=skip, call=call, fault=fault)


@PROPERTY
@given(st.data())
def test_component_forwards_in_any_order(data: st.DataObject) -> None:
    """Components called directly in a random order (predicted next components turning out wrong,
    faults on the way, traced calls) give the plain modules' outputs, and close() restores everything."""
    shape = data.draw(shapes(), label="shape")
    request = data.draw(requests(shape), label="request")
    p, ref = shape.build(), shape.build()
    modules = [name for name, _ in p.named_modules()]
    run = data.draw(st.lists(actions(shape, modules), min_size=3, max_size=8), label="actions")
    inputs = Inputs.make(shape)
    before = snapshot(p)
    session = request.open(p)
    for action in run:
        expected = action(ref, None, inputs)
        if action.fault is None:
            assert torch.equal(action(p, session, inputs), expected), action
            continue
        path, nth, interrupt = action.fault
        fault = Fault(nth, interrupt)
        with installed(p.get_submodule(path), fault, "pre", False):
            try:
                out = action(p, session, inputs)
            except (Boom, KeyboardInterrupt):
                assert fault.fired
            else:
                assert not fault.fired
                assert torch.equal(out, expected), action
        assert session.hook_count == hook_count(p)
    if session.step_peaks:
        assert_peaks_simulated(session)
    assert_closed(session, p, before)


# --------------------------------------------------------------- minimal cases the search found
@pytest.mark.parametrize(
    "request_",
    [
        Request(strategy="none"),
        Request(strategy="model_level"),
        Request(strategy="layerwise", depth=2),
        Request(strategy="layerwise", components=frozenset({"dit", "vae"}), on_demand_vae=True),
    ],
    ids=["none", "model_level", "layerwise", "layerwise-on-demand-vae"],
)
def test_running_runs_the_components_step_around_a_call_that_bypasses_its_forward(request_: Request) -> None:
    """session.running("vae") around vae.decode() runs the VAE's whole step, so the call succeeds."""
    p, ref = toy.build(0, blocks=3), toy.build(0, blocks=3)
    latents = torch.randn(
        1, toy.LATENT_TOKENS, toy.LATENT_CHANNELS, generator=torch.Generator().manual_seed(0)
    )
    before = snapshot(p)
    session = request_.open(p)
    with torch.no_grad():
        Call("a cat", 2)(p)
        for _ in range(2):
            with session.running("vae"):
                out = p.vae.decode(latents)
            assert torch.equal(out, ref.vae.decode(latents))
    assert session.engine.last is not None and session.engine.last.step.component == "vae"
    assert torch.equal(Call("a cat", 2)(p), Call("a cat", 2)(ref))
    assert_peaks_simulated(session)
    assert_closed(session, p, before)


def test_running_abandons_the_step_when_its_body_raises() -> None:
    """An error inside session.running() abandons the component's step; the next call is correct."""
    p, ref = toy.build(0, blocks=3), toy.build(0, blocks=3)
    before = snapshot(p)
    session = Request(strategy="layerwise").open(p)
    with pytest.raises(Boom), session.running("vae"):
        raise Boom("fault injected")
    assert session.engine.program is None and session.device_bytes == 0
    assert torch.equal(Call("a cat", 2)(p), Call("a cat", 2)(ref))
    assert_closed(session, p, before)


def test_running_names_a_top_level_component() -> None:
    """session.running() of a path that is not a top-level component, or on a closed session, is refused."""
    p = toy.build(0, blocks=3)
    session = Request(strategy="layerwise").open(p)
    message = (
        "session.running('transformer.blocks.0'): not a top-level component of this plan; run one of "
        "'transformer', 'text_encoder', 'vae'"
    )
    with (
        pytest.raises(torchferry.PlanError, match=re.escape(message)),
        session.running("transformer.blocks.0"),
    ):
        pass
    session.close()
    message = "session.running('vae'): this session is closed; open a new one"
    with pytest.raises(torchferry.ExecutionError, match=re.escape(message)), session.running("vae"):
        pass


@pytest.mark.parametrize("strategy", ["none", "model_level", "layerwise"])
def test_a_call_under_inference_mode_leaves_later_plain_calls_working(strategy: str) -> None:
    """Slots first filled during a torch.inference_mode() call still load on the next plain call."""
    p, ref = toy.build(0, blocks=3), toy.build(0, blocks=3)
    before = snapshot(p)
    session = Request(strategy=strategy).open(p)
    assert torch.equal(Call("a cat", 2, inference=True)(p), Call("a cat", 2)(ref))
    assert torch.equal(Call("a cat", 3)(p), Call("a cat", 3)(ref))
    assert_peaks_simulated(session)
    assert_closed(session, p, before)


@pytest.mark.parametrize("strategy", ["none", "layerwise"])
def test_a_session_inside_inference_mode_gives_back_ordinary_weights(strategy: str) -> None:
    """Opened, run and closed inside torch.inference_mode(), the pipeline comes back with ordinary
    (non-inference) tensors that autograd can use, as before."""
    p, ref = toy.build(0, blocks=3), toy.build(0, blocks=3)
    before = snapshot(p)
    with torch.inference_mode():
        session = Request(strategy=strategy).open(p)
        assert not any(t.is_inference() for _, t in _named(p))
        assert torch.equal(Call("a cat", 2)(p), Call("a cat", 2)(ref))
        assert_closed(session, p, before)
    latents = torch.randn(1, toy.LATENT_TOKENS, toy.LATENT_CHANNELS)
    p.vae(latents).sum().backward()
