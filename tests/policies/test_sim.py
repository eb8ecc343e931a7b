"""simulate: hand-computed stream replays, peak bytes as a slot-once runtime measures them."""

from __future__ import annotations

import math
import re

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
