"""check: one broken schedule per invariant, and the exact report it gives."""

from __future__ import annotations

import re

import attrs
import pytest
from policy_plans import ParallelLayout, ring_plan

from torchferry import ScheduleError, policies
from torchferry.policies import Op, Placement, Schedule, Step
from torchferry.topology import Plan

MIB = 1 << 20


def _ring() -> tuple[Plan, Schedule]:
    plan = ring_plan(3, MIB)
    return plan, policies.layerwise(1)(plan, Step(component="transformer"))


def _violations(schedule: Schedule, plan: Plan) -> list[str]:
    """The report's violation lines, after checking that exactly their lines are marked."""
    with pytest.raises(ScheduleError) as info:
        policies.check(schedule, plan)
    text = str(info.value)
    head, _, listing = text.partition("\nlisting:\n")
    marked = [line.split("|")[0].strip() for line in listing.splitlines() if line.endswith("<-- here")]
    lines = head.splitlines()[1:]
    reported = set(re.findall(r"^  line (\d+):", head, flags=re.MULTILINE))
    assert sorted(reported, key=int) == marked
    return lines


def test_valid_schedules_pass() -> None:
    """The built-in ring schedule passes check silently."""
    plan, schedule = _ring()
    policies.check(schedule, plan)


def test_full_report_of_a_missing_wait() -> None:
    """[1] a block computing with no wait: the whole report, on the block's last op before it computes."""
    plan, schedule = _ring()
    ops = tuple(op for op in schedule.ops if not (op.kind == "wait" and op.unit == "transformer.blocks.1"))
    broken = attrs.evolve(schedule, ops=ops)
    listing = policies.format_schedule(broken, sim=False).splitlines()
    listing = [f"  {k:>2} | {t}" + ("  <-- here" if k == 12 else "") for k, t in enumerate(listing, start=1)]
    expected = "\n".join(
        [
            "schedule layerwise(depth=1) for step 'transformer' #0 breaks 1 invariant of policies.check:",
            "  line 12: [1] block transformer.blocks.1 reads transformer.blocks.1 before a wait on it; "
            "add 'wait transformer.blocks.1' before it",
            "listing:",
            *listing,
        ]
    )
    with pytest.raises(ScheduleError, match=re.escape(expected)):
        policies.check(broken, plan)


def test_missing_wait_at_a_point_without_ops() -> None:
    """[1] a block whose point has no op of its own is reported on the first op after it computes."""
    plan = ring_plan(2, MIB)
    policy = policies.layerwise(1)
    first = policy(plan, Step(component="transformer"))
    steady = policy(plan, Step(component="transformer", index=1, entry=first.exit))
    ops = tuple(op for op in steady.ops if not (op.kind == "wait" and op.unit == "transformer.blocks.1"))
    assert [(op.anchor, op.kind) for op in ops] == [
        ("transformer.blocks.0", "load"),
        ("transformer.blocks.0", "wait"),
        ("transformer.blocks.1", "evict"),
    ]
    assert _violations(attrs.evolve(steady, ops=ops), plan) == [
        "  line 10: [1] block transformer.blocks.1 reads transformer.blocks.1 before a wait on it; "
        "add 'wait transformer.blocks.1' before it",
    ]


def test_slot_written_while_held() -> None:
    """[2] loading into a slot before its block was evicted."""
    plan, schedule = _ring()
    ops = tuple(op for op in schedule.ops if not (op.kind == "evict" and op.unit == "transformer.blocks.0"))
    exit_ = tuple(p for p in schedule.exit)
    broken = attrs.evolve(schedule, ops=ops, exit=exit_)
    assert _violations(broken, plan) == [
        "  line 11: [2] load writes slot s0 while it still holds transformer.blocks.0; "
        "evict transformer.blocks.0 after its last read first",
    ]


def test_unit_larger_than_its_slot() -> None:
    """[3] a slot smaller than the unit loaded into it."""
    plan, schedule = _ring()
    broken = attrs.evolve(
        schedule, slots=(attrs.evolve(schedule.slots[0], nbytes=MIB // 2), schedule.slots[1])
    )
    assert _violations(broken, plan) == [
        "  line 8: [3] transformer.blocks.0 needs 1.0 MiB (1048576) but slot s0 holds 512.0 KiB (524288); "
        "size the slot to the largest unit it takes",
        "  line 12: [3] transformer.blocks.2 needs 1.0 MiB (1048576) but slot s0 holds 512.0 KiB (524288); "
        "size the slot to the largest unit it takes",
    ]


def test_over_budget() -> None:
    """[4] the second slot's first use crosses config.device_memory_bytes."""
    plan = ring_plan(3, MIB, device_memory_bytes=MIB + MIB // 2)
    schedule = policies.layerwise(1)(plan, Step(component="transformer"))
    assert _violations(schedule, plan) == [
        "  line 9: [4] device bytes reach 2.0 MiB (2097152) here, over the budget of 1.5 MiB (1572864) "
        "(config.device_memory_bytes); stream more blocks, lower the prefetch depth or raise the budget",
    ]


def test_exit_not_what_ops_leave() -> None:
    """[5] an exit that claims a block the ops evicted and omits the one they loaded."""
    plan, schedule = _ring()
    broken = attrs.evolve(schedule, exit=(Placement(unit="transformer.blocks.2", where="s0"),))
    assert _violations(broken, plan) == [
        "  line 18: [5] exit lists transformer.blocks.2@s0 but the ops leave it off the device",
        "  line 18: [5] exit omits transformer.blocks.0@s1, which the ops leave on the device",
    ]


def test_gather_without_shard_and_on_rank_local_plan() -> None:
    """[6] a gather of a block the plan does not all-gather, with no shard loaded."""
    plan, schedule = _ring()
    gather = Op(
        when="before",
        anchor="transformer.blocks.0",
        stream="comm",
        kind="gather",
        unit="transformer.blocks.1",
        slot="s1",
        src="h0",
        nbytes=MIB,
    )
    broken = attrs.evolve(schedule, ops=(*schedule.ops[:2], gather, *schedule.ops[2:]))
    assert _violations(broken, plan)[:2] == [
        "  line 10: [6] transformer.blocks.1 is not all-gathered under this plan (world 1); "
        "load it whole instead",
        "  line 10: [6] gather of transformer.blocks.1 reads shard slot h0, which holds no shard of it; "
        "load its shard there first",
    ]


def test_gather_on_a_stub_component() -> None:
    """[6] a gather of a block of a component the plan marks as a stub (loaded on some ranks only)."""
    plan = ring_plan(3, MIB, strategy="distributed_layerwise", parallel=ParallelLayout(data_parallel_size=2))
    schedule = policies.distributed_layerwise(1)(plan, Step(component="transformer"))
    policies.check(schedule, plan)
    stub = attrs.evolve(plan.components[0], stub=True)
    stub_plan = attrs.evolve(plan, components=(stub,))
    rebuilt = attrs.evolve(schedule, plan=stub_plan.digest)
    first_op_line = 10  # 4 header lines, 4 slots, the entry
    gathers = [(first_op_line + k, op.unit) for k, op in enumerate(rebuilt.ops) if op.kind == "gather"]
    assert len(gathers) == 4
    assert _violations(rebuilt, stub_plan) == [
        f"  line {line}: [6] gather of {unit} is a collective on 'transformer', which this plan marks as a "
        "stub (not loaded on this rank), so the ranks would not agree on it; stream 'transformer' "
        "rank-local or load it on every rank"
        for line, unit in gathers
    ]


def test_distributed_schedule_passes() -> None:
    """A chunked distributed schedule over four ranks passes, steady state included."""
    plan = ring_plan(
        5,
        MIB,
        strategy="distributed_layerwise",
        parallel=ParallelLayout(data_parallel_size=4),
    )
    policy = policies.distributed_layerwise(2, chunk_bytes=MIB // 8)
    first = policy(plan, Step(component="transformer"))
    policies.check(first, plan)
    policies.check(policy(plan, Step(component="transformer", index=1, entry=first.exit)), plan)


def test_every_violation_at_once() -> None:
    """[7] and [1] together: a wrong stream and an op before an earlier anchor are all reported."""
    plan, schedule = _ring()
    ops = list(schedule.ops)
    ops[2] = attrs.evolve(ops[2], stream="copy")
    ops.append(attrs.evolve(ops[0], when="before", anchor="transformer"))
    broken = attrs.evolve(schedule, ops=ops)
    lines = _violations(broken, plan)
    assert lines[0] == "  line 10: [7] wait runs on the compute stream, not copy"
    assert "  line 18: [7] op at before transformer comes after a later point of the forward" in lines
