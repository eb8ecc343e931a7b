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


def _chunked() -> tuple[Plan, Schedule]:
    """Three 1 MiB blocks over two ranks, gathered in chunks of 128 KiB: 512 KiB shards in 4 chunks."""
    plan = ring_plan(3, MIB, strategy="distributed_layerwise", parallel=ParallelLayout(data_parallel_size=2))
    return plan, policies.distributed_layerwise(1, chunk_bytes=MIB // 8)(plan, Step(component="transformer"))


def test_a_chunked_gather_has_its_gather_slot_counted_by_simulate() -> None:
    """The schedule holds one gather slot of world x chunk bytes; simulate counts it on top of the
    same schedule gathered whole, and `gather_nbytes` says its size."""
    plan, chunked = _chunked()
    whole = policies.distributed_layerwise(1)(plan, Step(component="transformer"))
    assert [s for s in chunked.slots if s.kind == "gather"] == [
        policies.Slot(name="g0", nbytes=MIB // 4, kind="gather")
    ]
    assert policies.gather_nbytes(MIB // 2, 4, 2) == MIB // 4 and policies.gather_nbytes(MIB // 2, 1, 2) == 0
    assert not [s for s in whole.slots if s.kind == "gather"]
    peak = policies.simulate(chunked).peak_device_bytes
    assert peak == policies.simulate(whole).peak_device_bytes + MIB // 4 == 3 * MIB + MIB // 4
    policies.check(chunked, plan)
    assert policies.parse_schedule(policies.format_schedule(chunked)) == chunked


def test_a_chunked_gather_slot_counts_against_the_budget() -> None:
    """[4] the gather slot's bytes count: a budget one byte under the simulated peak is crossed."""
    plan, chunked = _chunked()
    peak = policies.simulate(chunked).peak_device_bytes
    fits = attrs.evolve(plan, config=attrs.evolve(plan.config, device_memory_bytes=peak))
    policies.check(attrs.evolve(chunked, plan=fits.digest), fits)
    under = attrs.evolve(plan, config=attrs.evolve(plan.config, device_memory_bytes=peak - 1))
    report = policies.simulate(chunked)
    assert report.peak_op is not None
    line = 4 + len(chunked.notes) + len(chunked.slots) + 1 + 1 + report.peak_op
    assert _violations(attrs.evolve(chunked, plan=under.digest), under) == [
        f"  line {line}: [4] device bytes reach 3.2 MiB ({peak}) here, over the budget of 3.2 MiB "
        f"({peak - 1}) (config.device_memory_bytes); stream more blocks, lower the prefetch depth or raise "
        "the budget",
    ]


def test_a_chunked_gather_without_its_gather_slot() -> None:
    """[3] a gather in chunks needs the slot table's gather slot, of world x chunk bytes at least."""
    plan, chunked = _chunked()
    first = 4 + len(chunked.notes) + len(chunked.slots) + 2  # the header, the slots, the entry
    gathers = [(first + i, op.unit) for i, op in enumerate(chunked.ops) if op.kind == "gather"]
    missing = attrs.evolve(chunked, slots=tuple(s for s in chunked.slots if s.kind != "gather"))
    assert _violations(missing, plan) == [
        f"  line {line - 1}: [3] gather of {unit} in 4 chunks lands each chunk of every rank in a gather "
        "slot of 256.0 KiB (262144), and the slot table has none; add 'slot g0 gather 262144'"
        for line, unit in gathers
    ]
    small = attrs.evolve(
        chunked,
        slots=tuple(attrs.evolve(s, nbytes=1000) if s.kind == "gather" else s for s in chunked.slots),
    )
    assert _violations(small, plan) == [
        f"  line {line}: [3] gather of {unit} in 4 chunks needs 256.0 KiB (262144) in gather slot g0, which "
        "holds 1000 B; size it to the largest chunk set"
        for line, unit in gathers
    ]


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


# --- the file tier: [8] host bytes, [9] reads and staging slots ----------------------------------

BLOCK = 16 * MIB


def _file_ring() -> tuple[Plan, Schedule]:
    """Six 16 MiB blocks and a remainder under a 96 MiB host budget: blocks 3-5 and the remainder
    are read from the file (listing: file line 5, slots s0 s1 t0 t1 on 8-11, ops from line 14)."""
    plan = ring_plan(6, BLOCK, rest=BLOCK, host_memory_bytes=96 * MIB)
    policy = policies.layerwise(1)
    first = policy(plan, Step(component="transformer"))
    return plan, policy(plan, Step(component="transformer", index=1, entry=first.exit))


def _ops(schedule: Schedule, change: dict[tuple[str, str], object]) -> tuple[Op, ...]:
    """``schedule``'s ops with the (kind, unit) ops in ``change`` dropped (None) or replaced."""
    out = []
    for op in schedule.ops:
        new = change.get((op.kind, op.unit), op)
        if isinstance(new, Op):
            out.append(new)
    return tuple(out)


def test_file_tier_schedule_passes() -> None:
    """The ring with reads passes check, and its listing places the reads where the tests below say."""
    plan, schedule = _file_ring()
    policies.check(schedule, plan)
    lines = policies.format_schedule(schedule, sim=False).splitlines()
    assert lines[4] == "# file: transformer.blocks.{3,4,5} transformer:rest"
    assert lines[15].split()[2:5] == ["io", "read", "transformer.blocks.3"]


def test_host_bytes_over_the_host_budget() -> None:
    """[8] the same schedule against a smaller host budget: located on the file line, every part named."""
    plan, schedule = _file_ring()
    smaller = attrs.evolve(plan, config=attrs.evolve(plan.config, host_memory_bytes=80 * MIB))
    assert smaller.digest == plan.digest
    assert _violations(schedule, smaller) == [
        "  line 5: [8] host bytes reach 96.0 MiB (100663296) (48.0 MiB (50331648) of packs in host memory, "
        "2 staging slots (32.0 MiB (33554432)) and 16.0 MiB (16777216) of read buffers), over the budget of "
        "80.0 MiB (83886080) (config.host_memory_bytes); put more packs in the file tier "
        "(policies.tiers(plan) chooses them for this budget) or raise the budget",
    ]


def test_host_bytes_without_a_file_tier() -> None:
    """[8] a schedule that keeps every pack in host memory, against a budget the store exceeds."""
    plan = ring_plan(3, MIB)
    schedule = policies.layerwise(1)(plan, Step(component="transformer"))
    tight = attrs.evolve(plan, config=attrs.evolve(plan.config, host_memory_bytes=2 * MIB))
    assert _violations(schedule, tight) == [
        "  line 3: [8] host bytes reach 3.0 MiB (3145728) (3.0 MiB (3145728) of packs in host memory), over "
        "the budget of 2.0 MiB (2097152) (config.host_memory_bytes); put more packs in the file tier "
        "(policies.tiers(plan) chooses them for this budget) or raise the budget",
    ]


def test_load_from_a_slot_nothing_was_read_into() -> None:
    """[9] a load from a staging slot whose read was dropped."""
    plan, schedule = _file_ring()
    broken = attrs.evolve(schedule, ops=_ops(schedule, {("read", "transformer.blocks.4"): None}))
    assert _violations(broken, plan) == [
        "  line 25: [9] load of transformer.blocks.4 from t1, which holds no read; "
        "read transformer.blocks.4 there first",
    ]


def test_file_tier_unit_loaded_from_host_memory() -> None:
    """[9] a file-tier block loaded as if the store held it; its read then blocks the next one into t0."""
    plan, schedule = _file_ring()
    load = next(op for op in schedule.ops if op.kind == "load" and op.unit == "transformer.blocks.3")
    broken = attrs.evolve(schedule, ops=_ops(schedule, {("load", load.unit): attrs.evolve(load, src=None)}))
    assert _violations(broken, plan) == [
        "  line 22: [9] load of transformer.blocks.3 from host memory, but it is in the file tier and the "
        "store has no bytes for it; read it into a staging slot first and load it from there",
        "  line 27: [9] read into t0 while it still holds the read of transformer.blocks.3, which no load or "
        "stage copied out yet; load or stage transformer.blocks.3 from t0 first, or read into another "
        "staging slot",
    ]


def test_read_of_a_host_unit_left_at_the_exit() -> None:
    """[9] a read of a block in host memory, never copied out: both reported, the second at the exit."""
    plan, schedule = _file_ring()
    read = Op(
        when="after",
        anchor="transformer.blocks.5",
        stream="io",
        kind="read",
        unit="transformer.blocks.1",
        slot="t1",
        nbytes=BLOCK,
    )
    broken = attrs.evolve(schedule, ops=(*schedule.ops, read))
    assert _violations(broken, plan) == [
        "  line 36: [9] read of transformer.blocks.1, which has no pack in the file tier (# file:); its "
        "bytes are in host memory, so load or stage it without a read",
        "  line 37: [9] staging slot t1 still holds the read of transformer.blocks.1 at the exit; reads "
        "never cross a step, so load or stage transformer.blocks.1 in this step, or do not read it",
    ]


def test_read_of_the_wrong_size_into_a_block_slot() -> None:
    """[3] a read whose byte count is not the unit's file bytes; [7] a read into a device slot."""
    plan, schedule = _file_ring()
    read = next(op for op in schedule.ops if op.kind == "read" and op.unit == "transformer.blocks.5")
    ops = _ops(schedule, {("read", read.unit): attrs.evolve(read, nbytes=MIB)})
    assert _violations(attrs.evolve(schedule, ops=ops), plan) == [
        "  line 27: [3] transformer.blocks.5 reads 16.0 MiB (16777216) from the file, not 1.0 MiB (1048576)",
    ]
    ops = _ops(schedule, {("read", read.unit): attrs.evolve(read, slot="s0")})
    assert _violations(attrs.evolve(schedule, ops=ops), plan)[0] == (
        "  line 27: [7] read of transformer.blocks.5 goes to s0, which is not a staging slot"
    )


def test_entry_in_a_staging_slot() -> None:
    """[9] an entry that places a block in a staging slot, as if it stayed there between steps."""
    plan, schedule = _file_ring()
    entry = (*schedule.entry, Placement(unit="transformer.blocks.3", where="t0"))
    broken = attrs.evolve(schedule, entry=entry, step=attrs.evolve(schedule.step, entry=entry))
    assert _violations(broken, plan)[0] == (
        "  line 14: [9] entry places transformer.blocks.3 in staging slot t0; a staging slot is host "
        "memory that holds a read within one step, never a unit between steps"
    )
