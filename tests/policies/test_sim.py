"""simulate: hand-computed stream replays, peak bytes as a slot-once runtime measures them."""

from __future__ import annotations

import math
import re

import attrs
import pytest
from policy_plans import ParallelLayout, ring_plan

from torchferry import PlanError, policies
from torchferry.policies import CostModel, Step

MIB = 1 << 20
# 1 MiB blocks: 2 ms transfer, 3 ms compute.
COST = CostModel(h2d_bytes_per_s=MIB / 0.002, block_s=0.003)


def test_four_blocks_depth_one_cold() -> None:
    """Cold start: block 0 stalls 2 ms, the rest hide; the wrap load ends before the last compute."""
    plan = ring_plan(4, MIB)
    report = policies.simulate(policies.layerwise(1)(plan, Step(component="transformer")), COST)
    assert report.makespan_s == pytest.approx(0.014)
    assert report.resident_makespan_s == pytest.approx(0.012)
    assert report.stall_s["transformer.blocks.0"] == pytest.approx(0.002)
    assert report.total_stall_s == pytest.approx(0.002)
    assert report.peak_device_bytes == 2 * MIB


def test_four_blocks_depth_one_steady() -> None:
    """In steady state (entry = previous exit) every transfer hides: makespan equals resident."""
    plan = ring_plan(4, MIB)
    policy = policies.layerwise(1)
    first = policy(plan, Step(component="transformer"))
    report = policies.simulate(policy(plan, Step(component="transformer", index=1, entry=first.exit)), COST)
    assert report.makespan_s == pytest.approx(0.012)
    assert report.overhead == pytest.approx(0.0)


def test_transfer_bound_steady() -> None:
    """4 ms transfers over 3 ms computes at depth 1: each later block stalls 1 ms, makespan 16 ms."""
    plan = ring_plan(4, MIB)
    cost = CostModel(h2d_bytes_per_s=MIB / 0.004, block_s=0.003)
    policy = policies.layerwise(1)
    first = policy(plan, Step(component="transformer"))
    report = policies.simulate(policy(plan, Step(component="transformer", index=1, entry=first.exit)), cost)
    # b1 loads 0-4 (stall 1), b2 loads after b0 frees s0 at 3: 4-8, b3 8-12, wrap b0 12-16.
    assert report.stall_s["transformer.blocks.1"] == pytest.approx(0.001)
    assert report.stall_s["transformer.blocks.2"] == pytest.approx(0.001)
    assert report.stall_s["transformer.blocks.3"] == pytest.approx(0.001)
    assert report.makespan_s == pytest.approx(0.016)


def test_chunked_gather_overlaps_copy() -> None:
    """With 4 chunks the gather of chunk k overlaps the copy of chunk k+1."""
    plan = ring_plan(
        2,
        4 * MIB,
        strategy="distributed_layerwise",
        parallel=ParallelLayout(data_parallel_size=4),
    )
    # shard 1 MiB in 4 chunks of 0.25 MiB: copy 0.5 ms each; gather receives 3 MiB, 0.75 MiB per chunk: 1 ms.
    cost = CostModel(
        h2d_bytes_per_s=MIB / 0.002, collective_bytes_per_s=MIB / (1 / 0.75 * 0.001), block_s=0.0
    )
    schedule = policies.distributed_layerwise(1, chunk_bytes=MIB // 4)(plan, Step(component="transformer"))
    first_gather = next(op for op in schedule.ops if op.kind == "gather")
    assert first_gather.chunks == 4
    one = policies.simulate(
        type(schedule)(
            policy=schedule.policy,
            plan=schedule.plan,
            step=schedule.step,
            slots=schedule.slots,
            entry=(),
            ops=schedule.ops[:2],
            exit=(),
        ),
        cost,
    )
    # copy chunks end at .5,1,1.5,2 ms; gather chunk k starts at max(prev end, copy end): .5-1.5, 1.5-2.5, ...
    assert one.makespan_s == pytest.approx(0.0045)


def test_zero_transfer_cost_is_resident() -> None:
    """With free transfers the makespan is exactly the all-resident makespan."""
    plan = ring_plan(5, MIB)
    cost = CostModel(h2d_bytes_per_s=math.inf, collective_bytes_per_s=math.inf, block_s=0.003)
    report = policies.simulate(policies.layerwise(2)(plan, Step(component="transformer")), cost)
    assert report.makespan_s == report.resident_makespan_s == pytest.approx(0.015)


def test_peak_counts_entry_staged_bytes() -> None:
    """Units staged before the schedule count with their placement bytes; slots from first use."""
    plan = ring_plan(4, MIB, rest=1000)
    policy = policies.layerwise(1)
    first = policy(plan, Step(component="transformer"))
    second = policy(plan, Step(component="transformer", index=1, entry=first.exit))
    assert policies.simulate(second).peak_device_bytes == 2 * MIB + 1000


def test_host_cost_is_charged_to_compute_and_not_to_the_resident_baseline() -> None:
    """host_op_s per op and host_block_s per block lengthen the step; the all-resident run pays neither."""
    plan = ring_plan(4, MIB)
    schedule = policies.layerwise(1)(plan, Step(component="transformer"))
    free = CostModel(h2d_bytes_per_s=math.inf, block_s=0.001)
    costly = CostModel(h2d_bytes_per_s=math.inf, block_s=0.001, host_op_s=1e-4, host_block_s=2e-4)
    base, report = policies.simulate(schedule, free), policies.simulate(schedule, costly)
    assert report.resident_makespan_s == base.resident_makespan_s == pytest.approx(0.004)
    assert report.makespan_s == pytest.approx(0.004 + len(schedule.ops) * 1e-4 + 4 * 2e-4)
    hosts = [i for i in report.timeline if i.kind == "host"]
    assert len(hosts) == len(schedule.ops) + 4 and {i.stream for i in hosts} == {"compute"}


def test_calibrated_needs_the_measured_compute() -> None:
    """CostModel.calibrated refuses figures without compute, and spreads a call over steps x forwards."""
    with pytest.raises(ValueError, match="needs the measured compute: block_s"):
        CostModel.calibrated(h2d_bytes_per_s=1e9)
    cost = CostModel.calibrated(h2d_bytes_per_s=1e9, block_s=0.01, forwards_per_step=2, steps=30)
    assert (cost.forwards_per_step, cost.forwards_per_call, cost.source) == (2, 60, "measured")


def test_a_profile_round_trips_through_its_json_document() -> None:
    """DeviceProfile.to_json / from_json are inverse; a foreign document is refused with a fix."""
    profile = policies.DEVICE_CLASSES["h100"]
    assert policies.DeviceProfile.from_json(profile.to_json()) == profile
    with pytest.raises(PlanError, match=re.escape("p is not a torchferry profile of version 1; write a new")):
        policies.DeviceProfile.from_json({"torchferry_profile": 2}, where="p")


# --- the io stream ---------------------------------------------------------------------------------

BLOCK = 16 * MIB


def _file_ring(read_s: float) -> tuple[policies.Schedule, policies.Schedule, CostModel]:
    """Six 16 MiB blocks and a remainder under a 96 MiB host budget (blocks 3-5 and the remainder
    in the file tier): 2 ms loads, 3 ms computes, ``read_s`` per 16 MiB read."""
    plan = ring_plan(6, BLOCK, rest=BLOCK, host_memory_bytes=96 * MIB)
    policy = policies.layerwise(1)
    first = policy(plan, Step(component="transformer"))
    steady = policy(plan, Step(component="transformer", index=1, entry=first.exit))
    cost = CostModel(h2d_bytes_per_s=BLOCK / 0.002, block_s=0.003, read_bytes_per_s=BLOCK / read_s)
    return first, steady, cost


def test_reads_that_hide_behind_compute() -> None:
    """4 ms reads, one anchor ahead into alternating slots, hide entirely: the steady step is resident."""
    _, steady, cost = _file_ring(0.004)
    report = policies.simulate(steady, cost)
    # read b3 0-4 | load b3 from t0 6-8 (s1 free at 6), read b4 into t1 4-8 | load b4 9-11, read b5
    # into t0 8-12 (t0 drained at 8) | load b5 12-14 | compute ends at 18.
    assert report.makespan_s == pytest.approx(0.018)
    assert report.resident_makespan_s == pytest.approx(0.018)
    assert report.total_stall_s == pytest.approx(0.0)
    reads = [(s.label, s.start_s, s.end_s) for s in report.timeline if s.stream == "io"]
    assert reads == [
        ("transformer.blocks.3", 0.0, pytest.approx(0.004)),
        ("transformer.blocks.4", pytest.approx(0.004), pytest.approx(0.008)),
        ("transformer.blocks.5", pytest.approx(0.008), pytest.approx(0.012)),
    ]
    assert report.peak_device_bytes == 3 * BLOCK  # the remainder and two slots: staging is host memory


def test_reads_slower_than_compute_stall_the_blocks_they_feed() -> None:
    """8 ms reads over 3 ms computes: the read stream paces blocks 3-5 (stalls 1, 5 and 5 ms)."""
    _, steady, cost = _file_ring(0.008)
    report = policies.simulate(steady, cost)
    # read b3 0-8 | load b3 8-10, read b4 8-16 | load b4 16-18 (stall 1 at b3, which waits b3 until
    # 10), read b5 16-24 (t0 drained at 10) | load b5 24-26 (stall 5 at b4) | load b0 26-28 (stall 5).
    assert report.stall_s["transformer.blocks.3"] == pytest.approx(0.001)
    assert report.stall_s["transformer.blocks.4"] == pytest.approx(0.005)
    assert report.stall_s["transformer.blocks.5"] == pytest.approx(0.005)
    assert report.makespan_s == pytest.approx(0.029)
    assert report.summary().endswith("overhead 61.11% · stall 0.0110 s")


def test_a_stage_from_staging_waits_for_its_read() -> None:
    """Cold, the remainder is read (4 ms) then staged (2 ms): the component waits 6 ms for it."""
    first, _, cost = _file_ring(0.004)
    report = policies.simulate(first, cost)
    assert report.stall_s["transformer"] == pytest.approx(0.006)
    spans = [(s.stream, s.kind, s.label) for s in report.timeline if s.kind in ("read", "stage")][:2]
    assert spans == [("io", "read", "transformer:rest"), ("copy", "stage", "transformer:rest")]


def test_reads_are_free_by_default() -> None:
    """`DEFAULT_COST` and any cost model that names no read rate time the io stream at zero."""
    _, steady, cost = _file_ring(0.008)
    assert math.isinf(policies.DEFAULT_COST.read_bytes_per_s)
    free = policies.simulate(steady, attrs.evolve(cost, read_bytes_per_s=math.inf))
    assert free.makespan_s == pytest.approx(0.018)


def test_a_timeline_with_reads_draws_an_io_lane() -> None:
    """The reads of a simulated step get a lane of their own, first; a step without reads has none."""
    from torchferry.cli._timeline import IO_LANE, LANES, Panel, lanes_of, render_panels

    _, steady, cost = _file_ring(0.004)
    lanes = lanes_of(policies.simulate(steady, cost).timeline)
    assert list(lanes) == [IO_LANE, *LANES.values()]
    assert [bar.tag for bar in lanes[IO_LANE]] == ["3", "4", "5"]
    assert ">io<" in render_panels([Panel(heading="", lanes=lanes)], title="t")
    ring = policies.layerwise(1)(ring_plan(4, MIB), Step(component="transformer"))
    plain = lanes_of(policies.simulate(ring, COST).timeline)
    assert list(plain) == list(LANES.values())
    assert ">io<" not in render_panels([Panel(heading="", lanes=plain)], title="t")
