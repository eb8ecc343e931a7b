"""The file tier in the engine: blocks read from the checkpoint into staging slots, loaded from there,
bit-identical to the plain model, viewing the file between uses; failures named, nothing lost."""

from __future__ import annotations

import gc
import os
import re
from pathlib import Path

import attrs
import pytest
import torch

from torchferry import ExecutionError, runtime, topology
from torchferry.policies import FILE, Op, Schedule, Slot, Step, rest_unit
from torchferry.runtime.store._file_tier import TierLayout
from torchferry.testing import toy


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)


def _plan(p: toy.ToyPipeline, checkpoint: Path | None) -> topology.Plan:
    config = topology.OffloadConfig(
        strategy="layerwise", checkpoint=None if checkpoint is None else str(checkpoint)
    )
    return topology.resolve(topology.discover(p), config)


def file_ring(plan: topology.Plan, component: str = "transformer") -> Schedule:
    """A depth-1 ring over two block slots whose blocks come from the file tier through two staging
    slots: each block is read two anchors before it runs and loaded one before (hand-written)."""
    top = plan.component(component)
    blocks = [b.path for b in top.blocks]
    size = max(b.nbytes for b in top.blocks)
    rest = rest_unit(component)

    def op(when: str, anchor: str, stream: str, kind: str, unit: str, **kw: object) -> Op:
        return Op(when=when, anchor=anchor, stream=stream, kind=kind, unit=unit, **kw)  # type: ignore[arg-type]

    ops = [
        op("before", component, "copy", "stage", rest, nbytes=top.rest_bytes),
        op("before", component, "io", "read", blocks[0], slot="t0", nbytes=size),
        op("before", component, "copy", "load", blocks[0], slot="s0", src="t0", nbytes=size),
        op("before", component, "io", "read", blocks[1], slot="t1", nbytes=size),
    ]
    for i, block in enumerate(blocks):
        ops.append(op("before", block, "compute", "wait", block))
        if i + 1 < len(blocks):
            k = (i + 1) % 2
            ops.append(
                op("before", block, "copy", "load", blocks[i + 1], slot=f"s{k}", src=f"t{k}", nbytes=size)
            )
        if i + 2 < len(blocks):
            ops.append(op("before", block, "io", "read", blocks[i + 2], slot=f"t{i % 2}", nbytes=size))
        ops.append(op("after", block, "compute", "evict", block))
    ops.append(op("after", component, "copy", "unstage", rest))
    return Schedule(
        policy="file ring(hand-written)",
        plan=plan.digest,
        step=Step(component=component),
        slots=[
            Slot(name="s0", nbytes=size),
            Slot(name="s1", nbytes=size),
            Slot(name="t0", nbytes=size, kind="staging"),  # type: ignore[arg-type]
            Slot(name="t1", nbytes=size, kind="staging"),  # type: ignore[arg-type]
        ],
        entry=(),
        ops=ops,
        exit=(),
    )


def _layout(plan: topology.Plan, **kw: object) -> TierLayout:
    top = plan.component("transformer")
    size = max(b.nbytes for b in top.blocks)
    return TierLayout(
        packs=frozenset(b.path for b in top.blocks),
        staging=(("t0", size), ("t1", size)),
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0), path)
    return path


def _is_view_of_file(t: torch.Tensor, store_buffers: list[torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return not any(b.untyped_storage().data_ptr() == ptr for b in store_buffers)


@torch.no_grad()
def test_file_ring_bit_identical_and_views_between_uses(saved: Path) -> None:
    """Every DiT block read from the checkpoint through staging slots: the output equals the plain
    model's, steps later too; between steps the blocks view the file (no host buffer), and close()
    leaves them as those views, bit-identical."""
    p, ref = toy.build_empty(), toy.build(0)
    plan = _plan(p, saved)
    schedule = file_ring(plan)
    engine = runtime.Engine(p, plan, device="cpu", tier=_layout(plan))
    try:
        store = engine.store
        assert store.tier is not None
        filed = [g for g in store.packs.values() if g.in_file]
        assert sorted(g.name for g in filed) == sorted(b.path for b in plan.component("transformer").blocks)
        assert all(g.host.numel() == 0 for g in filed)
        assert store.nbytes == sum(g.host.numel() for g in store.packs.values() if not g.in_file)
        buffers = [g.host for g in store.packs.values() if not g.in_file]
        for _ in range(3):
            with runtime.execute(schedule, p, plan, device="cpu", engine=engine):
                out = p.transformer(*_inputs())
            assert torch.equal(out, ref.transformer(*_inputs()))
            weight = p.transformer.blocks[5].fc1.weight
            assert _is_view_of_file(weight, buffers)
            assert torch.equal(weight, ref.transformer.blocks[5].fc1.weight)
        assert store.tier.reader.bytes_read > 0
    finally:
        engine.close()
    for a, b in zip(p.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # The transposed weight comes back row-major (it views the file), with the same values.
    assert p.transformer.blocks[0].out.weight.is_contiguous()


@torch.no_grad()
def test_execute_alone_lays_out_the_file_tier_its_schedule_names(saved: Path) -> None:
    """runtime.execute with no engine lays out the file tier its schedule names (its file set and
    staging slots, nothing planned again), reads those blocks from the checkpoint, and the output and
    the weights given back equal the plain model's."""
    p, ref = toy.build_empty(), toy.build(0)
    plan = _plan(p, saved)
    blocks = [b.path for b in plan.component("transformer").blocks]
    schedule = attrs.evolve(file_ring(plan), file=blocks)
    assert TierLayout.from_schedule(schedule) == _layout(plan)
    with runtime.execute(schedule, p, plan, device="cpu") as engine:
        assert engine.store.tier is not None and engine.store.tier.packs == frozenset(blocks)
        out = p.transformer(*_inputs())
    assert torch.equal(out, ref.transformer(*_inputs()))
    for a, b in zip(p.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@torch.no_grad()
def test_a_file_tier_with_nothing_to_read_it_from_is_a_bug_the_engine_names(saved: Path) -> None:
    """A layout the open planner refuses (file-tier packs of a pipeline built in memory, no checkpoint
    nor spill) reaching the engine is an ExecutionError calling it a bug and naming the packs, raised
    before anything is changed."""
    p = toy.build(0)
    plan = _plan(p, None)
    before = p.transformer.blocks[0].q.weight
    message = (
        "the file tier names 8 pack(s) (transformer.blocks.0, transformer.blocks.1, "
        "transformer.blocks.2, ...) and nothing to read them from (no checkpoint nor spill): a torchferry "
        "bug, or a TierLayout that policies.open_plan did not decide (it refuses both: needs_source, "
        "unfiled); lay the file tier out from the open plan's tiers"
    )
    with pytest.raises(ExecutionError, match=re.escape(message)):
        runtime.Engine(p, plan, device="cpu", tier=_layout(plan))
    assert p.transformer.blocks[0].q.weight is before and before.untyped_storage().data_ptr() != 0


@torch.no_grad()
def test_truncated_checkpoint_fails_the_step_and_closes(saved: Path) -> None:
    """A checkpoint truncated while the session reads it: the step raises an ExecutionError naming
    the file and a tensor, the device is left clean, and close() still works."""
    p = toy.build_empty()
    plan = _plan(p, saved)
    schedule = file_ring(plan)
    engine = runtime.Engine(p, plan, device="cpu", tier=_layout(plan))
    try:
        with runtime.execute(schedule, p, plan, device="cpu", engine=engine):
            p.transformer(*_inputs())
        os.truncate(saved, 1000)
        with (
            pytest.raises(
                ExecutionError, match=rf"of {re.escape(str(saved))} \(tensor transformer\.blocks\.\d"
            ),
            runtime.execute(schedule, p, plan, device="cpu", engine=engine),
        ):
            p.transformer(*_inputs())
        assert engine.placed == {} and not engine.running
    finally:
        engine.close()
    gc.collect()


@torch.no_grad()
def test_schedule_without_reads_is_refused(saved: Path, hand_ring: object) -> None:
    """A schedule that loads a file-tier block as if it had a host copy is refused at the load, and
    one that loads from a staging slot no read filled is refused too: [9] of check, at run time."""
    p = toy.build_empty()
    plan = _plan(p, saved)
    engine = runtime.Engine(p, plan, device="cpu", tier=_layout(plan))
    try:
        plain = hand_ring(plan)  # type: ignore[operator]
        with (
            pytest.raises(
                ExecutionError, match=re.escape("load of transformer.blocks.0: it is in the file tier")
            ),
            runtime.execute(plain, p, plan, device="cpu", engine=engine),
        ):
            p.transformer(*_inputs())
        ring = file_ring(plan)
        dropped = Schedule(
            policy=ring.policy,
            plan=ring.plan,
            step=ring.step,
            slots=ring.slots,
            entry=ring.entry,
            ops=[o for i, o in enumerate(ring.ops) if i != 1],
            exit=ring.exit,
        )
        with (
            pytest.raises(
                ExecutionError, match=re.escape("from staging slot t0, which holds nothing; read it first")
            ),
            runtime.execute(dropped, p, plan, device="cpu", engine=engine),
        ):
            p.transformer(*_inputs())
    finally:
        engine.close()


def _no_wait(self: object, dst: object, dst_bytes: torch.Tensor, staging: object, src: torch.Tensor) -> None:
    """A load from staging not ordered after the read that fills it."""
    self._read(staging, "copy", self._where())  # type: ignore[attr-defined]
    self.copy_in(dst, dst_bytes, src)  # type: ignore[attr-defined]
    staging.free = self._record(staging.free, "copy")  # type: ignore[attr-defined]


def _no_drain(self: object, dst: object, dst_bytes: torch.Tensor, staging: object, src: torch.Tensor) -> None:
    """A load from staging ordered after its read that records no drain for the next read."""
    self._wait_event("copy", staging.ready)  # type: ignore[attr-defined]
    self._read(staging, "copy", self._where())  # type: ignore[attr-defined]
    self.copy_in(dst, dst_bytes, src)  # type: ignore[attr-defined]


@torch.no_grad()
@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (_no_wait, "reads bytes that op 1 (before transformer io read transformer.blocks.0"),
        (_no_drain, "overwrites bytes that op 2 (before transformer copy load transformer.blocks.0"),
    ],
)
def test_sanitizer_orders_reads_and_drains(
    saved: Path, monkeypatch: pytest.MonkeyPatch, fault: object, message: str
) -> None:
    """The stream sanitizer covers the io stream: a load from a staging slot not ordered after the
    read filling it, or a read into a slot whose last load recorded no drain, is a StreamOrderError."""
    from torchferry.testing import StreamOrderError, StreamSanitizer

    p = toy.build_empty()
    plan = _plan(p, saved)
    engine = runtime.Engine(p, plan, device="cpu", tier=_layout(plan))
    assert isinstance(engine.streams, StreamSanitizer)
    try:
        with runtime.execute(file_ring(plan), p, plan, device="cpu", engine=engine):
            p.transformer(*_inputs())
        monkeypatch.setattr(StreamSanitizer, "copy_staged", fault)
        with (
            pytest.raises(StreamOrderError, match=re.escape(message)),
            runtime.execute(file_ring(plan), p, plan, device="cpu", engine=engine),
        ):
            p.transformer(*_inputs())
    finally:
        monkeypatch.undo()
        engine.close()


def direct_ring(plan: topology.Plan) -> Schedule:
    """`file_ring` as on a CPU device: no staging slot and no read, each block loaded ``from file``
    (the reader fills its device slot itself)."""
    ring = file_ring(plan)
    ops = [attrs.evolve(o, src=FILE) if o.kind == "load" else o for o in ring.ops if o.kind != "read"]
    slots = [s for s in ring.slots if s.kind != "staging"]
    return attrs.evolve(ring, policy="direct ring(hand-written)", ops=ops, slots=slots)


@torch.no_grad()
def test_a_direct_ring_reads_into_the_device_slots_bit_identical(saved: Path) -> None:
    """Every DiT block loaded 'from file' on a CPU device: the reader fills the block slots with no
    staging slot allocated, the output equals the plain model's, steps later too; a load 'from file'
    of a unit in host memory is refused before anything runs."""
    p, ref = toy.build_empty(), toy.build(0)
    plan = _plan(p, saved)
    schedule = direct_ring(plan)
    engine = runtime.Engine(p, plan, device="cpu", tier=attrs.evolve(_layout(plan), staging=()))
    try:
        assert engine.store.tier is not None and engine.store.tier.staging == {}
        for _ in range(2):
            with runtime.execute(schedule, p, plan, device="cpu", engine=engine):
                out = p.transformer(*_inputs())
            assert torch.equal(out, ref.transformer(*_inputs()))
        rest = rest_unit("transformer")
        wrong = [attrs.evolve(o, src=FILE) if o.kind == "stage" else o for o in schedule.ops]
        said = f"{rest} is in host memory, not the file tier: no read fills the file"
        with (
            pytest.raises(ExecutionError, match=re.escape(said)),
            runtime.execute(attrs.evolve(schedule, ops=wrong), p, plan, device="cpu", engine=engine),
        ):
            pass
    finally:
        engine.close()
