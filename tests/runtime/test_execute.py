"""`runtime.execute`: one schedule carried out on live modules through hooks and the dispatch table."""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs
import pytest
import torch

from torchferry import ExecutionError, policies, runtime, topology
from torchferry.policies import Op, Schedule
from torchferry.testing import toy


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)


def _plan(p: toy.ToyPipeline) -> topology.Plan:
    return topology.resolve(topology.discover(p), topology.OffloadConfig(strategy="layerwise"))


@torch.no_grad()
def test_ring_runs_bit_identical(hand_ring: Callable[..., Schedule]) -> None:
    """A hand-written two-slot ring gives the resident output and leaves the pipeline as it was."""
    p, ref = toy.build(0), toy.build(0)
    plan = _plan(p)
    schedule = hand_ring(plan)
    with runtime.execute(schedule, p, plan, device="cpu") as engine:
        out = p.transformer(*_inputs())
        assert p.transformer.blocks[7].q.weight.untyped_storage().data_ptr() != 0
        assert engine.hook_count > 0
    assert torch.equal(out, ref.transformer(*_inputs()))
    assert all(
        torch.equal(a, b) for a, b in zip(p.state_dict().values(), ref.state_dict().values(), strict=True)
    )
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in p.modules()) == 0


@torch.no_grad()
def test_skipped_block_ops_still_run(hand_ring: Callable[..., Schedule]) -> None:
    """A block the model skips has its ops run at the next anchor; later blocks get correct weights."""
    p, ref = toy.build(0), toy.build(0)
    plan = _plan(p)
    with runtime.execute(hand_ring(plan), p, plan, device="cpu"):
        out = p.transformer(*_inputs(), skip={3, 4})
    assert torch.equal(out, ref.transformer(*_inputs(), skip={3, 4}))


@torch.no_grad()
def test_peak_equals_simulate(hand_ring: Callable[..., Schedule]) -> None:
    """The device bytes the runtime held at its peak are what `policies.simulate` predicts."""
    p = toy.build(0)
    plan = _plan(p)
    schedule = hand_ring(plan)
    with runtime.execute(schedule, p, plan, device="cpu") as engine:
        p.transformer(*_inputs())
        assert engine.ledger.peak == policies.simulate(schedule).peak_device_bytes
        assert engine.ledger.allocations == 3


@torch.no_grad()
def test_block_not_resident_raises(hand_ring: Callable[..., Schedule]) -> None:
    """A block whose load the schedule forgot raises ExecutionError naming it, and the pipeline survives."""
    p, ref = toy.build(0), toy.build(0)
    plan = _plan(p)
    schedule = hand_ring(plan, drop="transformer.blocks.3")
    stop = next(i for i, op in enumerate(schedule.ops) if op.anchor == "transformer.blocks.3")
    message = (
        "block transformer.blocks.3 was reached while its weights were in host memory: step transformer#0 "
        "had not made it resident by then (the mark is the next op to run); the schedule must load and wait "
        "for a block before it runs\n" + runtime.listing(schedule, stop + 1)
    )
    with (
        pytest.raises(ExecutionError, match=re.escape(message)),
        runtime.execute(schedule, p, plan, device="cpu"),
    ):
        p.transformer(*_inputs())
    assert torch.equal(p("a cat"), ref("a cat"))


@torch.no_grad()
def test_an_op_check_refuses_is_called_a_bug_with_the_listing(hand_ring: Callable[..., Schedule]) -> None:
    """A wait for a block no load brought (check's [1]) reaching the runtime says it is a torchferry bug
    or a custom policy check missed, names the invariant, marks the op in the listing, and the
    pipeline survives."""
    p, ref = toy.build(0), toy.build(0)
    plan = _plan(p)
    base = hand_ring(plan)
    block = "transformer.blocks.3"
    ops = [op for op in base.ops if not (op.kind == "load" and op.unit == block)]
    schedule = attrs.evolve(base, ops=ops)
    wait = next(i for i, op in enumerate(ops) if op.kind == "wait" and op.unit == block)
    message = (
        f"wait for {block}, which no load brought to the device: a torchferry bug, or a custom policy that "
        f"check missed ([1] {policies.INVARIANTS[1]})\n" + runtime.listing(schedule, wait)
    )
    with pytest.raises(ExecutionError) as caught, runtime.execute(schedule, p, plan, device="cpu"):
        p.transformer(*_inputs())
    assert str(caught.value) == message
    assert torch.equal(p("a cat"), ref("a cat"))


@torch.no_grad()
def test_a_block_loaded_again_while_ready_points_at_host_memory_after_an_unwaited_evict(
    hand_ring: Callable[..., Schedule],
) -> None:
    """A block loaded into its slot again after its forward and evicted before any wait points at its
    host copy from then on, not at the slot the next block's copy overwrites."""
    p, ref = toy.build(0), toy.build(0)
    plan = _plan(p)
    schedule = hand_ring(plan)
    first = "transformer.blocks.0"
    ops = list(schedule.ops)
    evict = next(i for i, op in enumerate(ops) if op.kind == "evict" and op.unit == first)
    size = schedule.slots[0].nbytes
    again = Op(when="after", anchor=first, stream="copy", kind="load", unit=first, slot="s0", nbytes=size)
    ops.insert(evict, again)
    seen: list[torch.Tensor] = []
    p.transformer.blocks[3].register_forward_pre_hook(
        lambda m, a: seen.append(p.transformer.blocks[0].q.weight.detach().clone())
    )
    with runtime.execute(attrs.evolve(schedule, ops=ops), p, plan, device="cpu") as engine:
        out = p.transformer(*_inputs())
        pack = engine.store.units[first].packs[0]
        host = pack.host.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == host for t in pack.tensors)
    assert torch.equal(out, ref.transformer(*_inputs()))
    assert len(seen) == 1 and torch.equal(seen[0], ref.transformer.blocks[0].q.weight)


def test_unrun_ops_are_reported(hand_ring: Callable[..., Schedule]) -> None:
    """Leaving the context before the forward ran raises with the listing marked at the first unrun op."""
    p = toy.build(0)
    plan = _plan(p)
    schedule = hand_ring(plan)
    message = (
        f"step transformer#0 ended with {len(schedule.ops)} of its {len(schedule.ops)} ops never run: "
        "the forward never reached before 'transformer' (is the schedule for this component?)\n"
        + runtime.listing(schedule, 0)
    )
    with (
        pytest.raises(ExecutionError, match=re.escape(message)),
        runtime.execute(schedule, p, plan, device="cpu"),
    ):
        pass
    assert "<-- here" in runtime.listing(schedule, 0)


def test_entry_must_match(hand_ring: Callable[..., Schedule]) -> None:
    """A schedule whose entry residency the device does not hold is refused before anything runs."""
    p = toy.build(0)
    plan = _plan(p)
    base = hand_ring(plan)
    schedule = Schedule(
        policy=base.policy,
        plan=base.plan,
        step=base.step,
        slots=base.slots,
        entry=(policies.Placement(unit="transformer.blocks.0", where="s0"),),
        ops=base.ops[2:],
        exit=(),
    )
    message = (
        "step transformer#0 expects entry residency transformer.blocks.0@s0 but the device holds (nothing); "
        "run the step that leaves it there first, or build the schedule with this entry"
    )
    with (
        pytest.raises(ExecutionError, match=re.escape(message)),
        runtime.execute(schedule, p, plan, device="cpu"),
    ):
        pass
