"""`Session.trace` and `runtime.Tracer`: one step measured op by op and block by block (see the Note in
`torchferry.runtime.executor._trace`)."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from module_checks import hook_count

import torchferry
from torchferry import ExecutionError, PlanError, runtime, topology
from torchferry.cli._timeline import LANES, lanes_of
from torchferry.policies import Schedule
from torchferry.runtime import StepTrace
from torchferry.testing import run_ranks, toy


@contextmanager
def _forward_clock(module: torch.nn.Module) -> Iterator[list[float]]:
    """Host seconds of every forward of ``module``, measured outside every hook already installed."""
    seconds: list[float] = []
    started: list[float] = []

    def pre(m: torch.nn.Module, args: Any) -> None:
        started.append(time.perf_counter())

    def post(m: torch.nn.Module, args: Any, output: Any) -> None:
        seconds.append(time.perf_counter() - started.pop())

    handles = [module.register_forward_pre_hook(pre, prepend=True), module.register_forward_hook(post)]
    try:
        yield seconds
    finally:
        for h in handles:
            h.remove()


def _traced_layerwise(p: toy.ToyPipeline, session: torchferry.Session) -> tuple[StepTrace, float]:
    """The middle DiT step of a warm three-step call, traced, and the DiT forward's own host time."""
    p("a cat", steps=3)
    with _forward_clock(p.transformer) as seconds, session.trace("transformer", skip=1) as tracer:
        p("a cat", steps=3)
    return tracer.result, seconds[1]


def test_layerwise_step_has_one_copy_per_load_and_one_compute_per_block() -> None:
    """A traced layerwise step on the CPU: a copy span per load op and a compute span per block, in
    order, back to back on one thread, inside the step's wall time, which lies inside the forward."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu", prefetch_depth=1) as session:
        trace, forward_s = _traced_layerwise(p, session)
    ops = trace.schedule.ops
    loads = [i for i, op in enumerate(ops) if op.kind == "load"]
    assert trace.component == "transformer" and trace.clock == "host clock" and trace.device == "cpu"
    assert trace.schedule.policy == "layerwise(depth=1)"
    assert len(loads) == 8  # blocks 1-7 for this step, block 0 for the next
    copies = trace.on("copy")
    assert [s.op for s in copies] == loads
    assert [s.label for s in copies] == [ops[i].unit for i in loads]
    assert all(s.kind == "load" and s.nbytes == ops[s.op or 0].nbytes for s in copies)
    computes = trace.on("compute")
    assert [s.label for s in computes] == [f"transformer.blocks.{i}" for i in range(8)]
    assert all(s.kind == "compute" and s.op is None and s.nbytes == 0 for s in computes)
    assert trace.on("comm") == () and trace.stall_s == 0.0
    spans = trace.spans
    assert len(spans) == len(copies) + len(computes)
    assert all(0.0 <= s.start_s < s.end_s <= trace.wall_s for s in spans)
    assert all(a.end_s <= b.start_s for a, b in itertools.pairwise(spans))  # one thread: no overlap
    # Each block's prefetch is issued in its pre-hook, so the copy of block i+1 precedes block i.
    assert spans[0].stream == "copy" and spans[1].label == "transformer.blocks.0"
    assert trace.busy_s("copy") + trace.busy_s("compute") <= trace.wall_s <= forward_s


def test_tracing_changes_no_output_and_adds_no_hook() -> None:
    """A traced call gives the same output bit for bit as an untraced one and the resident model, the
    hook count never moves, and after the step nothing is left armed on the engine or its streams."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu", prefetch_depth=2) as session:
        before = hook_count(p)
        untraced = p("a cat", steps=3)
        with session.trace("transformer", skip=1) as tracer:
            assert session.engine.tracing is tracer and hook_count(p) == before
            traced = p("a cat", steps=3)
        assert tracer.done and hook_count(p) == before == session.hook_count
        assert session.engine.tracing is None and session.engine.tracer is None
        assert session.engine.streams.tracer is None
        again = p("a cat", steps=3)
    assert torch.equal(traced, untraced) and torch.equal(again, untraced)
    assert torch.equal(traced, ref("a cat", steps=3))


def test_lanes_of_a_trace() -> None:
    """A trace converts to the timeline's three lanes: copies on the copy lane, blocks on compute."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        trace, _ = _traced_layerwise(p, session)
    lanes = lanes_of(trace.spans)
    assert list(lanes) == list(LANES.values())
    assert [b.tag for b in lanes["copy (H2D)"]] == [s.label.rsplit(".", 1)[1] for s in trace.on("copy")]
    assert [b.kind for b in lanes["compute"]] == ["compute"] * 8 and lanes["comm (all-gather)"] == []
    assert lanes["compute"][3].label == "compute transformer.blocks.3"


def test_engine_traces_a_hand_written_schedule(hand_ring: Callable[..., Schedule]) -> None:
    """An engine armed directly (`engine.arm`) times the ring's staged remainder as a ``stage`` copy
    and every block load, labelled with its op."""
    p = toy.build(0)
    plan = topology.resolve(topology.discover(p), topology.OffloadConfig(strategy="layerwise"))
    schedule = hand_ring(plan)
    engine = runtime.Engine(p, plan, device="cpu")
    tracer = runtime.Tracer("cpu")
    engine.arm(tracer)
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)
    try:
        with runtime.execute(schedule, p, plan, device="cpu", engine=engine), torch.no_grad():
            p.transformer(*inputs)
    finally:
        engine.close()
    trace = tracer.result
    kinds = [(s.kind, s.label) for s in trace.on("copy")]
    assert kinds[0] == ("stage", "transformer:rest")
    assert kinds[1:] == [("load", f"transformer.blocks.{i}") for i in range(8)]
    assert trace.on("copy")[0].nbytes == plan.component("transformer").rest_bytes
    assert len(trace.on("compute")) == 8


def test_trace_takes_only_its_component_and_one_step() -> None:
    """Steps of other components are not counted or traced, and only one step of the component is."""
    p = toy.build(0)
    with (
        torchferry.offload(p, strategy="layerwise", device="cpu", components={"dit", "text_encoder"}) as s,
        s.trace("text_encoder") as tracer,
    ):
        p("a cat", steps=2)
    trace = tracer.result
    assert tracer.seen == 1 and trace.component == "text_encoder"
    assert {sp.label for sp in trace.on("compute")} == {"text_encoder.blocks.0", "text_encoder.blocks.1"}


def test_no_step_traced_is_an_error() -> None:
    """Asking for a result when the traced step never ran says how many steps started and which it takes."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        with session.trace("transformer", skip=2) as tracer:
            p("a cat", steps=2)
        assert not tracer.done
        msg = (
            "no transformer step was traced: 2 started while tracing and the trace takes step 3 (skip=2); "
            "run the component inside the trace"
        )
        with pytest.raises(ExecutionError, match=re.escape(msg)):
            tracer.result  # noqa: B018 (the property raises)


def test_a_step_that_raises_leaves_no_trace() -> None:
    """A traced step that raises is aborted untraced: the result says so, and the next call is untraced."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:

        def boom(module: torch.nn.Module, args: Any) -> None:
            raise ValueError("boom")

        handle = p.transformer.blocks[3].register_forward_pre_hook(boom)
        with session.trace("transformer") as tracer, pytest.raises(ValueError, match="boom"):
            p("a cat", steps=2)
        handle.remove()
        msg = "the traced transformer step did not finish (it raised or was aborted): there is no trace"
        with pytest.raises(ExecutionError, match=re.escape(msg)):
            tracer.result  # noqa: B018 (the property raises)
        assert session.engine.tracer is None and session.engine.streams.tracer is None
        assert torch.equal(p("a cat", steps=2), toy.build(0)("a cat", steps=2))


def test_trace_arguments_are_checked() -> None:
    """An unknown component, a negative skip and a second trace at once are refused with what to do."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        msg = (
            "session.trace('transformer.blocks.0'): not a top-level component of this plan; trace one of "
            "'transformer', 'text_encoder', 'vae'"
        )
        with pytest.raises(PlanError, match=re.escape(msg)), session.trace("transformer.blocks.0"):
            pass
        msg = "session.trace(skip=-1): skip counts steps, so it must be 0 or more"
        with pytest.raises(PlanError, match=re.escape(msg)), session.trace("transformer", skip=-1):
            pass
        msg = "session.trace(): a trace is already running on this session; end it first"
        with (
            session.trace("transformer"),
            pytest.raises(ExecutionError, match=re.escape(msg)),
            session.trace("transformer"),
        ):
            pass
        assert session.engine.tracing is None


def _distributed_trace(rank: int, world: int) -> StepTrace:
    p = toy.build(0)
    session = torchferry.offload(p, strategy="distributed_layerwise", device="cpu", dit_transfer="allgather")
    try:
        p("a cat", steps=3)
        with session.trace("transformer", skip=1) as tracer:
            p("a cat", steps=3)
    finally:
        session.close(gather=True)
    return tracer.result


@pytest.mark.dist
def test_distributed_step_times_each_gather_on_the_comm_stream() -> None:
    """On 2 gloo ranks each all-gather is one comm span, after the copy of its shard, one per gather op;
    the trace crosses the process boundary intact."""
    for trace in run_ranks(_distributed_trace, 2, timeout=90):
        ops = trace.schedule.ops
        gathers = [i for i, op in enumerate(ops) if op.kind == "gather"]
        comms = trace.on("comm")
        assert gathers and [s.op for s in comms] == gathers
        assert all(s.kind == "gather" for s in comms)
        shard_copy = {s.label: s for s in trace.on("copy")}
        assert all(shard_copy[s.label].end_s <= s.start_s for s in comms)
        assert all(a.end_s <= b.start_s for a, b in itertools.pairwise(trace.spans))
        assert len(trace.on("compute")) == 8


@pytest.mark.gpu
def test_cuda_trace_uses_events_and_overlaps_copies() -> None:
    """On CUDA the spans come from events: one per load and per block, blocks in order on the compute
    stream, none before the step's start, and the output is unchanged."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cuda", prefetch_depth=1) as session:
        untraced = p("a cat", steps=3, device="cuda")
        with session.trace("transformer", skip=1) as tracer:
            traced = p("a cat", steps=3, device="cuda")
    trace = tracer.result
    assert trace.clock == "cuda events"
    assert torch.equal(traced, untraced)
    loads = [i for i, op in enumerate(trace.schedule.ops) if op.kind == "load"]
    assert [s.op for s in trace.on("copy")] == loads
    blocks = [s for s in trace.on("compute") if s.kind == "compute"]
    assert [s.label for s in blocks] == [f"transformer.blocks.{i}" for i in range(8)]
    assert all(a.end_s <= b.start_s for a, b in itertools.pairwise(blocks))
    assert all(0.0 <= s.start_s <= s.end_s for s in trace.spans)
    assert trace.stall_s >= 0.0
