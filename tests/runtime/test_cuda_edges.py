"""What a GPU would do at the edges of the CUDA path, shown on a CPU: device spellings, refused pins,
a device that fails to synchronize, a caller's stream changed between steps, a ready block loaded
again, autocast's cast cache, user hooks that read weights, and slot alignment (issue 26)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import re
import types
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from module_checks import hook_count, same_weights

import torchferry
from torchferry import ExecutionError, OffloadWarning, policies, runtime, topology
from torchferry.policies import Op, Schedule, Slot
from torchferry.runtime import PackState, Tracer, resolved, same_device, stream_factory
from torchferry.runtime.device._streams import CpuStreams, DeviceBuffer, aligned_empty, regrow
from torchferry.runtime.memory._pinning import (
    PAGE,
    BookPinner,
    CudaPinner,
    HostMemory,
    HostPinner,
    _loaded,
    last_error,
)
from torchferry.runtime.store._store import HostStore
from torchferry.testing import StreamSanitizer, toy
from torchferry.testing._sanitizer import caller_stream
from torchferry.topology import PACK_ALIGN


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)


# ------------------------------------------------------------------------ 1. device spellings
def test_every_spelling_of_a_device_resolves_to_what_its_tensors_report() -> None:
    """``cuda`` resolves to ``cuda:0`` and ``meta:0`` or ``cpu:0`` to the index-less form their tensors
    report, and `same_device` holds across spellings where ``==`` does not."""
    assert torch.device("cuda:0") != torch.device("cuda")  # why one comparison helper is needed
    assert resolved("cuda") == torch.device("cuda", 0)
    assert resolved("meta:0") == torch.empty(0, device="meta").device == torch.device("meta")
    assert resolved("cpu:0") == torch.device("cpu")
    assert same_device(torch.device("cuda:0"), torch.device("cuda"))
    assert not same_device(torch.device("cuda:1"), torch.device("cuda"))
    assert same_device(torch.device("cpu"), torch.device("cpu:0"))
    assert not same_device(torch.device("cpu"), torch.device("meta"))


@torch.no_grad()
def test_a_session_on_an_indexed_device_keeps_the_form_its_tensors_report() -> None:
    """A session opened on ``cpu:0`` (as on ``cuda`` a GPU's tensors report ``cuda:0``) holds its device in
    the form tensors report, and a tensor added on that device after opening runs where it is."""
    p, ref = toy.build(0), toy.build(0)
    extra = torch.full((32,), 0.5)
    for pipe in (p, ref):
        pipe.transformer.blocks[2].register_forward_hook(lambda m, a, out: out * m.extra)
    ref.transformer.blocks[2].register_buffer("extra", extra.clone())
    with torchferry.offload(p, strategy="model_level", device="cpu:0") as session:
        assert session.engine.device == torch.device("cpu")
        p.transformer.blocks[2].register_buffer("extra", extra.clone())
        assert torch.equal(p.transformer(*_inputs()), ref.transformer(*_inputs()))


# --------------------------------------------------------------------------- 2. refused pins
class _FullRuntime:
    """A CUDA runtime whose locked-memory limit is reached: every register fails and, as in the real
    runtime, leaves its error as the last error until ``cudaGetLastError`` reads and clears it."""

    def __init__(self) -> None:
        self.last = 0
        self.registers = 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registers += 1
        self.last = 2  # cudaErrorMemoryAllocation
        return 2

    def cudaHostUnregister(self, ptr: int) -> int:
        raise AssertionError("nothing was registered")

    def cudaGetLastError(self) -> int:
        last, self.last = self.last, 0
        return last


def test_a_refused_pin_clears_the_runtime_error_before_falling_back_to_pageable_memory() -> None:
    """A refused ``cudaHostRegister`` leaves no error set for the next kernel launch check to raise as its
    own: the fallback to pageable memory warns once and the runtime's last error is clear."""
    p = toy.build(0)
    plan = topology.resolve(topology.discover(p), topology.OffloadConfig(strategy="layerwise"))
    runtime = _FullRuntime()
    with pytest.warns(OffloadWarning, match="could not pin a host buffer"):
        prepared = HostStore.prepare(p, plan, pin=True, pinner=CudaPinner(runtime))
    assert runtime.registers == 1 and runtime.last == 0
    assert not prepared.memory.pinned
    prepared.discard()


def test_torch_without_a_cudaGetLastError_binding_clears_the_error_through_its_loaded_runtime() -> None:
    """torch 2.11 binds no ``cudaGetLastError``: the one of the ``libcudart`` torch loaded is used (a
    stand-in returning -1 where none is loaded, as with a CPU build); a binding that has it is used."""
    bound = types.SimpleNamespace(cudaGetLastError=lambda: 0)
    assert last_error(bound) is bound.cudaGetLastError
    clear = last_error(types.SimpleNamespace())  # the 2.11 bindings, without it
    if _loaded("libcudart.so"):
        assert isinstance(clear, ctypes._CFuncPtr)
        assert isinstance(clear(), int)
    else:
        assert clear() == -1


def test_host_buffers_dropped_without_close_are_unregistered_before_they_are_unmapped() -> None:
    """A store given up without ``close()`` (a session dropped) unregisters each pinned buffer when its
    last tensor goes, before the pages are unmapped, so no registration outlives its memory."""
    p = toy.build(0)
    plan = topology.resolve(topology.discover(p), topology.OffloadConfig(strategy="layerwise"))
    books = BookPinner()
    store = HostStore.prepare(p, plan, pin=True, pinner=books).commit()
    assert store.pinned and len(books.ranges) == len(store.packs)
    del store, p
    gc.collect()
    assert books.ranges == {}


class _DeadPinner(HostPinner):
    """Keeps books like `BookPinner`, but its unregister fails for one buffer, as after a device died."""

    def __init__(self) -> None:
        self.books = BookPinner()
        self.dead: int | None = None

    def register(self, ptr: int, nbytes: int) -> None:
        self.books.register(ptr, nbytes)
        self.dead = ptr if self.dead is None else self.dead

    def unregister(self, ptr: int) -> None:
        if ptr == self.dead:
            raise RuntimeError("cudaHostUnregister returned 710")
        self.books.unregister(ptr)


def test_releasing_host_memory_goes_on_past_an_unregister_that_fails() -> None:
    """An unregister that fails (a dead device) does not stop `HostMemory.close`: every other buffer is
    unregistered and the failure is kept."""
    pinner = _DeadPinner()
    memory = HostMemory(pinner)
    for name in ("a", "b", "c"):
        memory.alloc(name, 3 * PAGE)
    memory.close()
    assert list(pinner.books.ranges) == [pinner.dead]
    assert isinstance(memory.release_failure, RuntimeError)


# ---------------------------------------------------------------------------- 9. slot alignment
def test_slots_start_on_a_256_byte_boundary_on_the_cpu_too() -> None:
    """Every slot and staged copy starts 256-byte aligned, freshly made or grown back after a step freed it
    (the CPU allocator aligns to 64 only), so every weight a block runs with is 256-byte aligned."""
    p, ref = toy.build(0), toy.build(0)
    seen: list[int] = []

    def inside(module: torch.nn.Module, args: object) -> None:
        seen.extend(t.data_ptr() % PACK_ALIGN for t in module.parameters())

    with torch.no_grad(), torchferry.offload(p, strategy="layerwise", prefetch_depth=2) as session:
        for block in p.transformer.blocks:
            block.register_forward_pre_hook(inside)  # after the engine's own: the block is in its slot
        engine = session.engine
        fresh = [engine.streams.transfer(n).data for n in range(1, 64)]
        assert all(t.data_ptr() % PACK_ALIGN == 0 for t in fresh)
        out = p("a cat")
        slots = [buffer for _, buffer in engine.slots.slots.values()]
        assert slots and all(b.data.data_ptr() % PACK_ALIGN == 0 for b in slots)
        for buffer in slots:  # parked and grown back, as a step that does not use a slot does
            buffer.data.untyped_storage().resize_(0)
            regrow(buffer, 1000)
            assert buffer.data.data_ptr() % PACK_ALIGN == 0 and buffer.data.numel() == 1000
    assert torch.equal(out, ref("a cat"))
    assert seen and set(seen) == {0}


@pytest.mark.docking
def test_a_docked_block_follows_its_slot_to_memory_grown_back_elsewhere() -> None:
    """A slot whose memory moved while its buffer stayed the same tensor (`regrow` counts it in
    ``grown``) gives a docked block a storage over its new memory at the next load, never the old."""
    p = toy.build(0)
    with torch.no_grad(), torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        pack = session.engine.store.units["transformer.blocks.1"].packs[0]
        assert pack.bound is not None  # a CPU session docks its blocks
        buffer = DeviceBuffer(data=aligned_empty(pack.nbytes, torch.device("cpu")))
        data, at = buffer.data, buffer.data.data_ptr()
        _, before = pack.dock_at("s9", buffer)
        assert before.data_ptr() == at
        storage = data.untyped_storage()
        storage.resize_(storage.nbytes() + 4096)  # new memory, taken while the old is held: elsewhere
        buffer.grown += 1  # as `regrow` counts it
        assert buffer.data is data and data.data_ptr() != at
        dst, after = pack.dock_at("s9", buffer)
        assert after.data_ptr() == dst.data_ptr() == data.data_ptr()
        grown = buffer.grown
        storage.resize_(0)  # parked, then grown back as a slot pool does
        regrow(buffer, pack.nbytes)
        assert buffer.grown == grown + 1
        pack.forget_device()


# ---------------------------------------------------------------------- 3. a device that died
class _Dying:
    """CPU streams on a device that dies: once ``dead``, `synchronize` raises, as CUDA does at every sync
    after a device-side assert or an illegal address (a sticky error)."""

    def __init__(self, device: torch.device) -> None:
        self.inner = CpuStreams(device)
        self.device = device
        self.tracer = None
        self.dead = False
        self.syncs = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def synchronize(self) -> None:
        self.syncs += 1
        if self.dead:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


@contextlib.contextmanager
def _dying() -> Iterator[list[_Dying]]:
    """Every engine built inside runs on `_Dying` streams, listed as they are made."""
    made: list[_Dying] = []

    def factory(engine: Any) -> Any:
        made.append(_Dying(engine.device))
        return made[-1]

    before = stream_factory(factory)
    try:
        yield made
    finally:
        stream_factory(before)


def _assert(message: str) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: object) -> None:
        raise RuntimeError(message)

    return hook


def _at_host(session: torchferry.Session) -> bool:
    """Whether every tensor the session manages points at its host copy."""
    return all(
        pack.where is PackState.HOST
        and all(t.data_ptr() == v.data_ptr() for t, v in zip(pack.tensors, pack.host_views, strict=True))
        for pack in session.engine.store.packs.values()
    )


@torch.no_grad()
@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
def test_after_the_device_dies_mid_step_every_weight_points_at_its_host_copy(strategy: str) -> None:
    """A step that fails on a dead device (its synchronize raises) re-raises the caller's own error, not
    the synchronize's, leaves every weight pointing at its intact host copy, and close() then gives the
    pipeline back as it was before saying the device failed."""
    p, ref = toy.build(0), toy.build(0)
    with _dying() as made:
        session = torchferry.offload(p, strategy=strategy)
        p("a cat")
        made[0].dead = True
        handle = p.transformer.blocks[3].register_forward_pre_hook(_assert("device-side assert triggered"))
        with pytest.raises(RuntimeError, match="device-side assert triggered"):
            p("a cat")
        handle.remove()
        assert _at_host(session)
        failed = "the device cpu failed (RuntimeError: CUDA error: an illegal memory access"
        with pytest.raises(ExecutionError, match=re.escape(failed)):
            session.close()
    assert session.closed and hook_count(p) == 0
    assert same_weights(p, ref)


@torch.no_grad()
def test_a_with_block_that_fails_on_a_dead_device_keeps_the_callers_exception() -> None:
    """Leaving a ``with offload(...)`` block by the caller's exception on a dead device raises that
    exception (close's own failure is a note on it), and every weight is back as it was."""
    p, ref = toy.build(0), toy.build(0)
    with (
        _dying() as made,
        pytest.raises(RuntimeError, match="device-side assert") as caught,
        torchferry.offload(p, strategy="layerwise", prefetch_depth=2),
    ):
        p("a cat")
        made[0].dead = True
        p.transformer.blocks[5].register_forward_pre_hook(_assert("device-side assert triggered"))
        p("a cat")
    assert type(caught.value) is RuntimeError
    notes = getattr(caught.value, "__notes__", None)  # Python 3.11 on
    assert notes is None or any("the device cpu failed" in note for note in notes)
    for block in p.transformer.blocks:
        block._forward_pre_hooks.clear()
    assert hook_count(p) == 0 and same_weights(p, ref)


# ------------------------------------------------------------------- 8. user hooks read weights
@torch.no_grad()
def test_a_user_pre_hook_registered_before_opening_sees_the_weights_its_block_runs_with() -> None:
    """A block's forward pre hook registered before the session opened runs after torchferry's own, so it
    reads the block's weights in their slot (what the block computes with), not the host copy while
    the block's copy is still in flight."""
    p, ref = toy.build(0), toy.build(0)
    engines: list[Any] = []
    seen: list[bool] = []
    looked: list[torch.Tensor] = []

    def look(module: torch.nn.Module, args: object) -> None:
        # A re-pointed weight views a slot's storage; a docked one (CPU) a storage from the slot's bytes on.
        buffers = [b.data for _, b in engines[0].slots.slots.values()]
        slots = {t.untyped_storage().data_ptr() for t in buffers} | {t.data_ptr() for t in buffers}
        seen.append(module.q.weight.untyped_storage().data_ptr() in slots)
        looked.append(module.q.weight.detach().clone())

    for block in p.transformer.blocks:
        block.register_forward_pre_hook(look)
    with torchferry.offload(p, strategy="layerwise", prefetch_depth=1) as session:
        engines.append(session.engine)
        out = p("a cat")
    assert torch.equal(out, ref("a cat"))
    assert seen and all(seen)
    blocks = len(p.transformer.blocks)
    assert all(torch.equal(w, ref.transformer.blocks[i % blocks].q.weight) for i, w in enumerate(looked))


# --------------------------------------------------------------- 6. a ready block loaded again
def _plan(p: toy.ToyPipeline) -> topology.Plan:
    return topology.resolve(topology.discover(p), topology.OffloadConfig(strategy="layerwise"))


def _again(schedule: Schedule, block: str, slot: str) -> Schedule:
    """``schedule`` with ``block`` loaded again into ``slot`` right after its forward (before its evict),
    and a third slot ``s2`` in its table."""
    ops = list(schedule.ops)
    evict = next(i for i, op in enumerate(ops) if op.kind == "evict" and op.unit == block)
    size = schedule.slots[0].nbytes
    load = Op(when="after", anchor=block, stream="copy", kind="load", unit=block, slot=slot, nbytes=size)
    ops.insert(evict, load)
    slots = [*schedule.slots, Slot(name="s2", nbytes=size)]
    return attrs.evolve(schedule, ops=ops, slots=slots)


def _bump(module: torch.nn.Module, args: object) -> None:
    module.scale.add_(1)  # a buffer the forward writes in place (a running statistic, a counter)


@torch.no_grad()
def test_a_ready_block_loaded_again_into_its_slot_waits_for_its_reads_and_keeps_its_writes(
    hand_ring: Callable[..., Schedule],
) -> None:
    """Loading a block again into its own slot after its forward orders the copy after that forward's
    reads (the stream sanitizer sees it; before, the copy waited only on the slot's previous occupant)
    and keeps what the forward wrote to its buffers there, as the plain run does."""
    p, ref = toy.build(0), toy.build(0)
    plan = _plan(p)
    block = "transformer.blocks.2"
    schedule = _again(hand_ring(plan), block, "s0")
    for pipe in (p, ref):
        pipe.transformer.blocks[2].register_forward_pre_hook(_bump)
    with runtime.execute(schedule, p, plan, device="cpu"):
        out = p.transformer(*_inputs())
    assert torch.equal(out, ref.transformer(*_inputs()))
    assert torch.equal(p.transformer.blocks[2].scale, ref.transformer.blocks[2].scale)
    assert same_weights(p, ref)


@torch.no_grad()
def test_a_ready_block_loaded_again_into_another_slot_frees_the_one_it_left(
    hand_ring: Callable[..., Schedule],
) -> None:
    """A block loaded again into another slot leaves the first one free: the next block the ring loads
    there finds it free (before, the block stayed its occupant and that load raised)."""
    p, ref = toy.build(0), toy.build(0)
    plan = _plan(p)
    schedule = _again(hand_ring(plan), "transformer.blocks.2", "s2")
    with runtime.execute(schedule, p, plan, device="cpu") as engine:
        out = p.transformer(*_inputs())
        assert engine.occupants == {}
    assert torch.equal(out, ref.transformer(*_inputs()))


# --------------------------------------------------------------------- 4. where a trace starts
class _FakeStream:
    """A CUDA stream as the tracer sees it: ``at`` is when work enqueued on it now would run."""

    def __init__(self, at: float) -> None:
        self.at = at


class _FakeEvent:
    """A timing CUDA event: recorded on a `_FakeStream`, it completes when that stream gets there."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = math.nan

    def record(self, stream: _FakeStream) -> None:
        self.at = stream.at

    def elapsed_time(self, other: _FakeEvent) -> float:
        return (other.at - self.at) * 1e3


def test_a_traced_step_starts_when_compute_reaches_it_not_when_an_idle_stream_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA a traced step that begins while compute still runs 50 ms queued by an untraced step before
    it measures its own 10 ms (the idle copy and comm streams reach their marks at once; the start was
    taken from them), and a copy that ran before compute got there counts from the step's start."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    p = toy.build(0)
    schedule = policies.layerwise(depth=1)(_plan(p), policies.Step(component="transformer"))
    streams = types.SimpleNamespace(compute=_FakeStream(0.050), copy=_FakeStream(0.0), comm=_FakeStream(0.0))
    tracer = Tracer("cuda", "transformer")
    assert tracer.wants(schedule.step)
    tracer.start(schedule, streams)
    load = next(i for i, op in enumerate(schedule.ops) if op.kind == "load")
    tracer.at(load, schedule.ops[load])
    streams.copy.at = 0.045
    begin = tracer.mark(streams.copy)
    streams.copy.at = 0.055
    tracer.span("copy", begin, tracer.mark(streams.copy), 1024)
    streams.compute.at = 0.060
    trace = tracer.stop()
    assert trace.wall_s == pytest.approx(0.010)
    (copy,) = trace.on("copy")
    assert (copy.start_s, copy.end_s) == (0.0, pytest.approx(0.005))


# ------------------------------------------------------------- 5. the caller's stream changes
@torch.no_grad()
@pytest.mark.parametrize(
    "options",
    [
        {"strategy": "model_level"},
        {"strategy": "layerwise", "prefetch_depth": 2},
        {"strategy": "layerwise", "resident_layers": 2},
    ],
    ids=["model_level", "layerwise d2", "resident set"],
)
def test_a_step_on_another_caller_stream_is_ordered_after_the_last_and_owns_its_memory(
    options: dict[str, Any],
) -> None:
    """A call on another stream than the last (``torch.cuda.stream(s)`` around it) reads what the last
    step left on the device only after it was made ready there, and every buffer the engine holds is
    handed to the new stream, which the stream sanitizer's second compute stream checks."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, **options) as session:
        first = p("a cat")
        with caller_stream("side"):
            second = p("a cat")
        third = p("a cat")
        assert isinstance(session.engine.streams, StreamSanitizer)
        assert session.engine.streams.compute == "compute"
    expected = ref("a cat")
    assert all(torch.equal(out, expected) for out in (first, second, third))


# ----------------------------------------------------------------------- 7. autocast's cast cache
def test_autocast_caches_no_cast_copy_of_a_streamed_weight_and_outputs_stay_exact() -> None:
    """Under ``torch.autocast`` the cast cache (which would keep every streamed block's cast copy on the
    device, keyed on the re-pointed weight) is off while a step runs and on again after it, a step that
    raised included; outputs equal the plain autocast run's, which caches."""
    p, ref = toy.build(0), toy.build(0)
    seen: list[bool] = []
    block = p.transformer.blocks[4]
    block.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_cache_enabled()))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref("a cat")
        with torchferry.offload(p, strategy="layerwise", prefetch_depth=2):
            out = p("a cat")
            assert torch.is_autocast_cache_enabled()
            handle = p.transformer.blocks[6].register_forward_pre_hook(_assert("a failing step"))
            with pytest.raises(RuntimeError, match="a failing step"):
                p("a cat")
            handle.remove()
            assert torch.is_autocast_cache_enabled()
    assert torch.equal(out, expected)
    assert seen and not any(seen)


@torch.no_grad()
def test_execute_on_a_device_that_dies_keeps_the_callers_exception(
    hand_ring: Callable[..., Schedule],
) -> None:
    """`runtime.execute` whose body fails on a dead device raises the body's exception (the engine's close
    then fails too, after giving every weight back), and the pipeline is as it was."""
    p, ref = toy.build(0), toy.build(0)
    plan = _plan(p)
    with (
        _dying() as made,
        pytest.raises(RuntimeError, match="device-side assert") as caught,
        runtime.execute(hand_ring(plan), p, plan, device="cpu"),
    ):
        made[0].dead = True
        raise RuntimeError("CUDA error: device-side assert triggered")
    assert type(caught.value) is RuntimeError
    assert hook_count(p) == 0 and same_weights(p, ref)


# ----------------------------------------------------------------------------- on a real GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_on_cuda_an_edit_of_a_weight_on_the_device_is_adopted_on_the_default_device() -> None:
    """With ``device=None`` (``cuda``, whose tensors report ``cuda:0``) an in-place edit of a staged weight
    between calls is adopted at the next step, not refused, and reaches the weights after close."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, strategy="model_level"):
        p("a cat")
        weight = p.transformer.blocks[0].q.weight
        assert weight.device == torch.device("cuda", torch.cuda.current_device())
        weight.mul_(2)
        ref.transformer.blocks[0].q.weight.mul_(2)
        out = p("a cat").cpu()
    assert torch.allclose(out, ref("a cat"), atol=1e-4, rtol=1e-4)
    assert torch.equal(p.transformer.blocks[0].q.weight, ref.transformer.blocks[0].q.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
@pytest.mark.parametrize("strategy", ["model_level", "layerwise"])
def test_on_cuda_calls_on_another_stream_give_the_same_output(strategy: str) -> None:
    """A call made on a side stream between calls on the default stream gives the same output."""
    p = toy.build(0)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torchferry.offload(p, strategy=strategy, device="cuda"):
        first = p("a cat")
        with torch.cuda.stream(side):
            second = p("a cat")
        torch.cuda.current_stream().wait_stream(side)
        third = p("a cat")
        torch.cuda.synchronize()
    assert torch.equal(first, second) and torch.equal(first, third)
