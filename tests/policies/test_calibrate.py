"""auto's decisions in a session as pure functions, on literal figures: fit, measure, calibrate,
predicted_step_s, unmoved, and the trace and re-choice rules of `observe`."""

from __future__ import annotations

import math

import attrs
import pytest
from policy_plans import ring_plan

from torchferry import policies
from torchferry.policies import Calibration, ChooserState, CostModel, Measured, Schedule, Span, Step
from torchferry.topology import FrozenMap

MiB = 1 << 20


@pytest.mark.parametrize(
    ("xs", "ys", "expected"),
    [
        ([], [], (0.0, 0.0)),
        ([1.0, 2.0, 3.0], [3.0, 5.0, 7.0], (1.0, 2.0)),  # exact line
        ([2.0, 2.0], [4.0, 6.0], (0.0, 2.5)),  # x never varies: all of it per op
        ([0.0, 0.0], [1.0, 3.0], (2.0, 0.0)),  # no ops at all: all of it per block
        ([1.0, 2.0], [5.0, 3.0], (4.0, 0.0)),  # a negative slope: the mean, per block
        ([1.0, 2.0], [1.0, 4.0], (0.0, 2.5 / 1.5)),  # a negative intercept: the mean per op
    ],
)
def test_fit_is_least_squares_clamped_at_zero(
    xs: list[float], ys: list[float], expected: tuple[float, float]
) -> None:
    """`fit` gives the least-squares line, or its clamped form when a coefficient would be negative."""
    a, b = policies.fit(xs, ys)
    assert a == pytest.approx(expected[0]) and b == pytest.approx(expected[1])


@pytest.mark.parametrize(
    ("compute", "before", "expected"),
    [
        (1.25, 1.0, True),
        (0.75, 1.0, True),
        (1.26, 1.0, False),
        (0.7, 1.0, False),
        (0.0, 0.0, True),
        (0.1, 0.0, False),
    ],
)
def test_unmoved_is_within_the_remeasure_margin(compute: float, before: float, expected: bool) -> None:
    """Block compute within 25 % of what the last re-choice used is unmoved; from 0, only 0 is."""
    assert policies.REMEASURE_MARGIN == 0.25
    assert policies.unmoved(compute, before) is expected


def _figures(component: str, block_s: dict[str, float], **kw: object) -> Measured:
    values: dict[str, object] = {
        "policy": "layerwise(depth=1)",
        "wall_s": 0.1,
        "rest_s": 0.0,
        "host_op_s": 0.0,
        "host_block_s": 0.0,
        "clock": "cuda events",
    }
    values.update(kw)
    return Measured(component=component, block_s=block_s, **values)  # type: ignore[arg-type]


def test_calibrate_takes_each_compute_the_mean_host_cost_and_the_bandwidth() -> None:
    """Measured blocks keep their compute, others the mean; host costs are averaged over figures."""
    a = _figures(
        "t", {"t.blocks.0": 0.002, "t.blocks.1": 0.004}, rest_s=0.5, host_op_s=1e-5, host_block_s=3e-5
    )
    b = _figures("u", {"u.blocks.0": 0.006}, rest_s=0.25, host_op_s=3e-5, host_block_s=1e-5)
    cost = policies.calibrate([a, b], h2d_bytes_per_s=2e9, collective_bytes_per_s=5e9)
    assert cost.h2d_bytes_per_s == 2e9 and cost.collective_bytes_per_s == 5e9
    assert cost.compute_seconds("t.blocks.1", block=True) == 0.004
    assert cost.compute_seconds("t", block=False) == 0.5
    assert cost.compute_seconds("v.blocks.9", block=True) == pytest.approx(0.004)  # the mean of 2, 4, 6 ms
    assert cost.host_op_s == pytest.approx(2e-5) and cost.host_block_s == pytest.approx(2e-5)
    assert cost.source == "measured by the session"


def test_calibrate_on_the_cpu_charges_copies_as_host_time() -> None:
    """A figure measured with the host clock makes both bandwidths infinite (copies are host time)."""
    cpu = _figures("t", {"t.blocks.0": 0.001}, clock="host clock")
    cost = policies.calibrate([cpu], h2d_bytes_per_s=2e9)
    assert cost.h2d_bytes_per_s == math.inf and cost.collective_bytes_per_s == math.inf
    assert cost.source == "measured by the session; copies on the compute thread (CPU) charged per op"
    assert (
        policies.calibrate([], h2d_bytes_per_s=1e9, default_block_s=0.02).compute_seconds("x.0", block=True)
        == 0.02
    )


@attrs.frozen
class _Trace:
    schedule: Schedule
    clock: str
    wall_s: float
    spans: tuple[Span, ...]


def test_measure_splits_a_literal_step_into_compute_host_cost_and_rest() -> None:
    """Four blocks whose gaps take 1 ms plus 2 ms per op anchored there (3, 3, then 2 ops, as the
    schedule says): 1 ms per block, 2 ms per op, and the 50 ms left over is the rest."""
    plan = ring_plan(4, MiB)
    policy = policies.layerwise(depth=1, resident=("transformer.blocks.3",))
    schedule = policy(plan, Step(component="transformer", index=1))
    blocks = [f"transformer.blocks.{i}" for i in range(4)]
    spans = [Span(stream="copy", kind="load", label="transformer.blocks.0", start_s=0.0, end_s=0.004)]
    t = 0.0
    for gap in (None, 3, 3, 2):
        if gap is not None:
            t += 0.001 + 0.002 * gap
        label = blocks[len(spans) - 1]
        spans.append(Span(stream="compute", kind="compute", label=label, start_s=t, end_s=t + 0.010))
        t += 0.010
    ops = len(schedule.ops)
    wall = 4 * 0.010 + 0.050 + 0.001 * 4 + 0.002 * ops  # blocks, the rest, per block, per op
    figures = policies.measure(
        _Trace(schedule=schedule, clock="cuda events", wall_s=wall, spans=tuple(spans)), plan
    )
    assert figures.component == "transformer" and figures.policy == "layerwise(depth=1, resident=1)"
    assert figures.block_s == pytest.approx(dict.fromkeys(blocks, 0.010))
    assert (figures.host_block_s, figures.host_op_s) == pytest.approx((0.001, 0.002))
    assert figures.rest_s == pytest.approx(0.050)
    # With the host clock (the CPU) the copies' 4 ms are host time, spread over the step's ops.
    cpu = policies.measure(
        _Trace(schedule=schedule, clock="host clock", wall_s=wall, spans=tuple(spans)), plan
    )
    assert cpu.host_op_s == pytest.approx(0.002 + 0.004 / ops)



def test_measure_scales_a_host_fit_larger_than_the_step_down_to_the_wall() -> None:
    """Gaps that say more host time than the step had beside its blocks (a noisy trace) give host
    figures scaled down to what there was: no rest, and the figures still add up to the wall."""
    plan = ring_plan(4, MiB)
    schedule = policies.layerwise(depth=1)(plan, Step(component="transformer", index=1))
    blocks = [f"transformer.blocks.{i}" for i in range(4)]
    spans, t = [], 0.0
    for i, label in enumerate(blocks):
        t += 0.004 if i else 0.0
        spans.append(Span(stream="compute", kind="compute", label=label, start_s=t, end_s=t + 0.010))
        t += 0.010
    wall = 4 * 0.010 + 0.003  # less than the 12 ms the three gaps alone hold
    figures = policies.measure(
        _Trace(schedule=schedule, clock="cuda events", wall_s=wall, spans=tuple(spans)), plan
    )
    ops = len(schedule.ops)
    assert figures.rest_s == 0.0 and figures.host_block_s >= 0 and figures.host_op_s >= 0
    total = sum(figures.block_s.values()) + figures.host_block_s * 4 + figures.host_op_s * ops
    assert total == pytest.approx(wall, rel=1e-9)

def test_predicted_step_of_a_whole_component_schedule_adds_its_blocks() -> None:
    """A schedule anchoring no block (none()) is simulated plus its blocks' compute and hooks."""
    plan = ring_plan(4, MiB)
    cost = CostModel.calibrated(h2d_bytes_per_s=1e9, block_s=0.003, host_block_s=0.0005)
    whole = policies.none()
    schedule = policies.steady_schedule(whole, plan, "transformer")
    expected = policies.simulate(schedule, cost).makespan_s + 4 * 0.003 + 4 * 0.0005
    assert policies.predicted_step_s(whole, plan, "transformer", cost) == pytest.approx(expected)
    ring = policies.layerwise(depth=1)
    streamed = policies.simulate(policies.steady_schedule(ring, plan, "transformer"), cost).makespan_s
    assert policies.predicted_step_s(ring, plan, "transformer", cost) == streamed


def _setup(budget: int = 5 * MiB) -> Calibration:
    plan = ring_plan(8, MiB)
    base = CostModel.calibrated(h2d_bytes_per_s=1e9, block_s=1e-6)
    return Calibration(plan=plan, budget=budget, h2d_bytes_per_s=1e9, base=base, components=("transformer",))


def test_should_trace_skips_run_starts_switches_and_thins_out_after_max_traces() -> None:
    """Index 0, the first step after a switch and other components are not traced; after MAX_TRACES
    walls, one step in TRACE_EVERY is."""
    setup = _setup()
    state = policies.init_chooser(setup)
    assert policies.should_trace(setup, state, "transformer", 0)[1] is False
    assert policies.should_trace(setup, state, "vae", 3)[1] is False
    assert policies.should_trace(setup, state, "transformer", 1) == (state, True)
    fresh = attrs.evolve(state, fresh=True)
    after, traced = policies.should_trace(setup, fresh, "transformer", 5)
    assert traced is False and after.fresh is False
    full = attrs.evolve(state, walls=FrozenMap({"transformer": (0.1,) * policies.MAX_TRACES}))
    assert policies.TRACE_EVERY == 8 and policies.should_trace(setup, full, "transformer", 9)[1] is False
    assert policies.should_trace(setup, full, "transformer", 16)[1] is True


def test_observe_re_chooses_once_then_only_when_compute_moves() -> None:
    """The first figures re-choose under the calibrated model; figures within the margin refit the
    model only; figures whose compute moved re-choose again, each as `choose` would by hand."""
    setup = _setup()
    state = policies.init_chooser(setup)
    assert state.choice == policies.choose(setup.plan, setup.budget, setup.base)
    blocks = {f"transformer.blocks.{i}": 0.010 for i in range(8)}
    first = _figures("transformer", blocks, policy=state.running, wall_s=0.2)
    one, _ = policies.observe(setup, state, first)
    assert one.choice is not state.choice
    cost = policies.calibrate(
        [first],
        h2d_bytes_per_s=1e9,
        collective_bytes_per_s=setup.base.collective_bytes_per_s,
        default_block_s=setup.base.block_s,
    )
    assert one.cost == cost and one.choice == policies.choose(setup.plan, setup.budget, cost)
    assert one.chosen_at == {"transformer": pytest.approx(0.080)} and one.walls == {"transformer": (0.2,)}
    # 20 % more compute, and faster: the model refits, the choice stands; the check is the prediction before.
    near = _figures("transformer", {k: 0.012 for k in blocks}, policy=one.running, wall_s=0.15)
    two, switch = policies.observe(setup, one, near)
    assert switch is None and two.choice is one.choice and two.measured["transformer"] is near
    assert two.checks == {
        "transformer": (policies.predicted_step_s(one.policy, setup.plan, "transformer", one.cost), 0.15)
    }
    # Twice the compute: a second re-choice.
    far = _figures("transformer", {k: 0.024 for k in blocks}, policy=two.running, wall_s=0.1)
    three, _ = policies.observe(setup, two, far)
    assert three.choice is not two.choice and three.chosen_at == {"transformer": pytest.approx(0.192)}
    # A step in which no block ran measured nothing.
    assert policies.observe(setup, three, _figures("transformer", {}, wall_s=0.01)) == (three, None)


def test_a_changed_choice_is_pending_until_switched_to() -> None:
    """A re-choice naming another policy than the running one is returned and pending; `switch_policy`
    hands it over once, starts its walls again and skips tracing its first step."""
    setup = _setup()
    start = policies.init_chooser(setup)
    other = policies.layerwise(depth=2)
    state = ChooserState(choice=start.choice, policy=other, cost=setup.base)
    blocks = {f"transformer.blocks.{i}": 0.010 for i in range(8)}
    after, new = policies.observe(setup, state, _figures("transformer", blocks, policy=other.name))
    assert new is not None and new.name == after.choice.policy().name != other.name
    assert after.pending is new and after.switches == (
        f"layerwise(depth=2) -> {new.name}: calibrated on transformer",
    )
    assert after.running == "layerwise(depth=2)"
    switched, policy = policies.switch_policy(after)
    assert policy is new and switched.running == new.name and switched.pending is None
    assert switched.fresh is True and switched.walls == {}
    assert policies.switch_policy(switched) == (switched, None)
