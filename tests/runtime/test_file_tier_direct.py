"""The file tier's reads straight into a CPU device's slots run behind compute: a load 'from file'
starts the read and returns, the block's wait waits for it; an abort, a close or a failed read with
such a read in flight loses no weight, and the stream sanitizer orders these reads too."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from test_file_tier import _inputs, _layout, _plan, direct_ring

import torchferry
from torchferry import ExecutionError, policies, runtime, topology
from torchferry.policies import FILE, Op
from torchferry.runtime.store._file_tier import FileTier
from torchferry.testing import StreamOrderError, StreamSanitizer, toy

#: How long a held read waits for its release before it fails (reached only when a load waits for
#: its own read: then nothing can release it).
HELD_S = 5.0


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0), path)
    return path


@pytest.fixture(params=["sanitizer", "cpu"])
def streams(request: pytest.FixtureRequest) -> Iterator[str]:
    """Engines on the stream sanitizer (the runtime tests' default), or on the CPU's own streams."""
    if request.param == "sanitizer":
        if request.config.getoption("--no-stream-sanitizer"):
            pytest.skip("the stream sanitizer is off (--no-stream-sanitizer)")
        yield "sanitizer"
        return
    before = runtime.stream_factory(None)
    try:
        yield "cpu"
    finally:
        runtime.stream_factory(before)


class Held:
    """Reads of chosen packs held at their start, on the reader threads, until released (or failed):
    through the reader's ``before`` seam (what a read waits for before it writes), so the reads stay
    real. Packs may be added to ``gates`` while reads run."""

    def __init__(self, tier: FileTier, names: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tier = tier
        self.gates = {n: threading.Event() for n in names}
        self.failing: set[str] = set()
        submit = tier.reader.submit

        def held(read: Any, into: torch.Tensor, before: Callable[[], None] | None = None) -> Any:
            gate = self.gates.get(read.name)
            if gate is None:
                return submit(read, into, before)

            def wait() -> None:
                if not gate.wait(HELD_S):
                    raise TimeoutError(f"the read of {read.name} was never released")
                if read.name in self.failing:
                    raise OSError(5, "Input/output error")
                if before is not None:
                    before()

            return submit(read, into, wait)

        monkeypatch.setattr(tier.reader, "submit", held)

    def release(self, name: str) -> None:
        gate = self.gates.get(name)
        if gate is not None:
            gate.set()

    def release_all(self) -> None:
        for gate in self.gates.values():
            gate.set()

    def in_flight(self) -> list[str]:
        """The held packs whose reads straight into device memory are submitted and not finished."""
        return [t.read.name for t in self.tier.direct if not t.done and t.read.name in self.gates]


def _on_blocks(module: torch.nn.Module, names: list[str], pre: Callable[[int], None]) -> None:
    """Call ``pre(i)`` as the forward of block ``names[i]`` of ``module`` starts (after the engine's
    ops before it: its wait, the loads it issues)."""
    for i, name in enumerate(names):
        block = module.get_submodule(name.removeprefix("transformer."))
        block.register_forward_pre_hook(lambda _m, _a, i=i: pre(i))


def _same_values(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every parameter and buffer of ``a`` equals ``b``'s."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _engine(saved: Path) -> tuple[toy.ToyPipeline, topology.Plan, runtime.Engine, list[str]]:
    """A CPU engine whose DiT blocks are all in the file tier, with no staging slot."""
    p = toy.build_empty()
    plan = _plan(p, saved)
    engine = runtime.Engine(p, plan, device="cpu", tier=attrs.evolve(_layout(plan), staging=()))
    return p, plan, engine, [b.path for b in plan.component("transformer").blocks]


def _settling(tier: FileTier, held: Held, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Each `FileTier.settle` (an abort, a close) notes the held reads in flight, then releases them."""
    seen: list[list[str]] = []
    settle = tier.settle

    def noted(*, wait: bool = True) -> None:
        seen.append(held.in_flight())
        held.release_all()
        settle(wait=wait)

    monkeypatch.setattr(tier, "settle", noted)
    return seen


@torch.no_grad()
def test_a_load_from_file_returns_before_its_read_and_the_read_runs_behind_compute(
    saved: Path, monkeypatch: pytest.MonkeyPatch, streams: str
) -> None:
    """A load 'from file' returns with its read still held on the reader threads: each block's forward
    starts with the next block's read in flight and releases it, its wait then takes it, and the
    output equals the plain model's (a load that waited for its read would never return)."""
    ref = toy.build(0)
    p, plan, engine, names = _engine(saved)
    try:
        assert isinstance(engine.streams, StreamSanitizer) == (streams == "sanitizer")
        assert engine.store.tier is not None
        held = Held(engine.store.tier, names[1:], monkeypatch)
        seen: list[list[str]] = []

        def pre(i: int) -> None:
            seen.append(held.in_flight())
            if i + 1 < len(names):
                held.release(names[i + 1])

        _on_blocks(p.transformer, names, pre)
        with runtime.execute(direct_ring(plan), p, plan, device="cpu", engine=engine):
            out = p.transformer(*_inputs())
        assert seen == [[n] for n in names[1:]] + [[]]
        assert torch.equal(out, ref.transformer(*_inputs()))
        assert all(b.filling is None for b in engine.buffers())
    finally:
        engine.close()


@torch.no_grad()
def test_a_depth_2_session_keeps_two_reads_in_flight_bit_identical(
    saved: Path, monkeypatch: pytest.MonkeyPatch, streams: str
) -> None:
    """A CPU session at prefetch depth 2 with its DiT blocks from block 1 on in the checkpoint: as a
    block's forward starts, the reads of the next two are in flight (held until then), and every
    call's output equals the plain pipeline's."""
    ref = toy.build(0)
    p = toy.build_empty()
    plan = topology.resolve(topology.discover(ref), topology.OffloadConfig(strategy="layerwise"))
    names = [b.path for b in plan.component("transformer").blocks]
    host = policies.tiers(plan).host_bytes // 2
    with torchferry.offload(
        p, strategy="layerwise", prefetch_depth=2, device="cpu", checkpoint=str(saved), host_memory=host
    ) as session:
        tier = session.engine.store.tier
        assert tier is not None and tier.staging == {} and set(names[2:]) <= tier.packs
        held = Held(tier, names[2:], monkeypatch)
        seen: list[list[str]] = []

        def pre(i: int) -> None:
            seen.append(held.in_flight())
            if i + 1 < len(names):
                held.release(names[i + 1])

        _on_blocks(p.transformer, names, pre)
        try:
            for _ in range(2):
                assert torch.equal(p("a cat", steps=2), ref("a cat", steps=2))
        finally:
            held.release_all()
    # The first forward (its reads held until the block before starts): later ones run unheld.
    want = [[names[j] for j in (i + 1, i + 2) if 2 <= j < len(names)] for i in range(len(names))]
    assert seen[: len(names)] == want
    assert max(map(len, want)) == 2


@torch.no_grad()
def test_an_abort_with_a_read_in_flight_waits_for_it_and_loses_nothing(
    saved: Path, monkeypatch: pytest.MonkeyPatch, streams: str
) -> None:
    """A forward that fails while the next block's read straight into its slot is in flight: the
    abort waits for that read before the slot is used again, every weight is the file's, and the
    next step is bit-identical."""
    ref = toy.build(0)
    p, plan, engine, names = _engine(saved)
    try:
        tier = engine.store.tier
        assert tier is not None
        held = Held(tier, [names[2]], monkeypatch)
        settled = _settling(tier, held, monkeypatch)

        def pre(i: int) -> None:
            if i == 1 and not settled:
                raise RuntimeError("the forward fails")

        _on_blocks(p.transformer, names, pre)
        with (
            pytest.raises(RuntimeError, match="the forward fails"),
            runtime.execute(direct_ring(plan), p, plan, device="cpu", engine=engine),
        ):
            p.transformer(*_inputs())
        assert settled == [[names[2]]]
        assert all(b.filling is None for b in engine.buffers()) and tier.direct == []
        assert _same_values(p, ref)
        with runtime.execute(direct_ring(plan), p, plan, device="cpu", engine=engine):
            out = p.transformer(*_inputs())
        assert torch.equal(out, ref.transformer(*_inputs()))
    finally:
        engine.close()
    assert _same_values(p, ref)


def _ends_with_a_read(plan: topology.Plan) -> Any:
    """`direct_ring` whose step ends by loading block 0 for the next one (never waited for)."""
    ring = direct_ring(plan)
    blocks = plan.component("transformer").blocks
    load = Op(when="after", anchor="transformer", stream="copy", kind="load", unit=blocks[0].path,
              slot="s0", src=FILE, nbytes=max(b.nbytes for b in blocks))  # fmt: skip
    exit = (policies.Placement(unit=blocks[0].path, where="s0"),)
    return attrs.evolve(ring, ops=[*ring.ops, load], exit=exit)


@torch.no_grad()
def test_a_close_with_a_read_in_flight_waits_for_it_and_gives_back_the_weights(
    saved: Path, monkeypatch: pytest.MonkeyPatch, streams: str
) -> None:
    """A step that ends with the next step's first block still being read into its slot, then the
    engine closed: the close waits for the read before the slot is freed, and every weight given back
    is the file's."""
    ref = toy.build(0)
    p, plan, engine, names = _engine(saved)
    try:
        tier = engine.store.tier
        assert tier is not None
        held = Held(tier, [], monkeypatch)
        settled = _settling(tier, held, monkeypatch)
        # Block 0's next read (the step's last op) is held; its first (the step's first op) is not.

        def pre(i: int) -> None:
            held.gates.setdefault(names[0], threading.Event())

        _on_blocks(p.transformer, names, pre)
        with runtime.execute(_ends_with_a_read(plan), p, plan, device="cpu", engine=engine):
            out = p.transformer(*_inputs())
        assert torch.equal(out, ref.transformer(*_inputs()))
        assert held.in_flight() == [names[0]]
    finally:
        engine.close()
    assert settled[0] == [names[0]]
    assert _same_values(p, ref)
    assert torch.equal(p.transformer(*_inputs()), ref.transformer(*_inputs()))


@torch.no_grad()
def test_a_failed_read_into_a_slot_is_raised_at_its_wait_and_loses_nothing(
    saved: Path, monkeypatch: pytest.MonkeyPatch, streams: str
) -> None:
    """A read straight into a slot that fails does not stop its load: the blocks before it run, the
    block's wait raises the read's ExecutionError, and the engine runs the next step bit-identical."""
    ref = toy.build(0)
    p, plan, engine, names = _engine(saved)
    try:
        assert engine.store.tier is not None
        held = Held(engine.store.tier, [names[2]], monkeypatch)
        held.failing.add(names[2])
        held.release_all()
        ran: list[int] = []
        _on_blocks(p.transformer, names, ran.append)
        said = f"read of {names[2]}"
        with (
            pytest.raises(ExecutionError, match=re.escape("the read failed: Input/output error (errno 5)")),
            runtime.execute(direct_ring(plan), p, plan, device="cpu", engine=engine),
        ):
            p.transformer(*_inputs())
        assert ran == [0, 1], said
        held.failing.clear()
        assert _same_values(p, ref)
        with runtime.execute(direct_ring(plan), p, plan, device="cpu", engine=engine):
            out = p.transformer(*_inputs())
        assert torch.equal(out, ref.transformer(*_inputs()))
    finally:
        engine.close()


def _blind_wait(self: StreamSanitizer, transfer: Any) -> None:
    """A wait that takes a read straight into the buffer on the host but orders compute after nothing."""
    filling = transfer.filling
    if filling is None:
        self._wait_event(self.compute, transfer.ready)
        return
    transfer.filling = None
    filling.wait()


def _unclaimed_wait(self: StreamSanitizer, transfer: Any) -> None:
    """A wait that waits for a read straight into the buffer but leaves it on the buffer."""
    self._wait_event(self.compute, transfer.ready)
    if transfer.filling is not None:
        transfer.filling.wait()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (_blind_wait, "writes on the io stream, and is not ordered after that write (read after write)"),
        (_unclaimed_wait, "reads into a device buffer that a read not yet waited for still fills"),
    ],
)
def test_sanitizer_orders_reads_into_device_slots(
    saved: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, fault: object, message: str
) -> None:
    """The stream sanitizer covers reads straight into device slots: a block run from a slot compute
    is not ordered after the read filling it, or a slot read into again before its last read was
    waited for, is a StreamOrderError."""
    if request.config.getoption("--no-stream-sanitizer"):
        pytest.skip("the stream sanitizer is off (--no-stream-sanitizer)")
    p, plan, engine, _ = _engine(saved)
    try:
        assert isinstance(engine.streams, StreamSanitizer)
        with torch.no_grad(), runtime.execute(direct_ring(plan), p, plan, device="cpu", engine=engine):
            p.transformer(*_inputs())
        monkeypatch.setattr(StreamSanitizer, "wait", fault)
        with (
            pytest.raises(StreamOrderError, match=re.escape(message)),
            torch.no_grad(),
            runtime.execute(direct_ring(plan), p, plan, device="cpu", engine=engine),
        ):
            p.transformer(*_inputs())
    finally:
        monkeypatch.undo()
        engine.close()
