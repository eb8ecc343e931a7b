"""auto's decisions in a session, as pure functions: what a traced step measured, the cost model
fitted to it, the step predicted under it, and when to trace and to re-choose.

[Note: choosing in a session]
`offload` with ``strategy="auto"`` asks `choose` for strategy, depth and resident blocks under a cost
model from the device's profile, then measures what the choice depends on. `should_trace` says which steps
of a streaming DiT to trace: every steady step (not the first of a run, so a step starts where the
one before ended, nor the first after a switch) up to `MAX_TRACES` per schedule, then one in
`TRACE_EVERY`. `measure` turns a traced step into figures (each block's compute, the host seconds
per op and per hooked block, the component's non-block remainder), and `observe` folds them into a
`ChooserState`: after the first measured step of a component it re-chooses under the calibrated
cost model (`calibrate`); a changed choice is returned and used from the next step on (`switch_policy`),
never inside one. A component re-chooses again only when a later measurement moves its block compute
by more than `REMEASURE_MARGIN` (`unmoved`); later measurements still refine the cost model.

On the CPU copies run on the compute thread, so the calibrated model charges them as host time per
op (its bandwidth is infinite) instead of on a copy stream that would hide them.

Every function here is pure: the state is a frozen `ChooserState`, the fixed inputs a `Calibration`,
and each returns a new state (optax's ``init``/``update``: `init_chooser`, `observe`);
``torchferry.session._chooser`` wires them to the session's tracer and probes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

import attrs

from torchferry.policies._auto import Choice, choose
from torchferry.policies._ir import Policy, Schedule
from torchferry.policies._sim import CostModel, Span, simulate, steady_schedule
from torchferry.topology import FrozenMap, Plan

__all__ = [
    "MAX_TRACES",
    "REMEASURE_MARGIN",
    "TRACE_EVERY",
    "Calibration",
    "ChooserState",
    "Measured",
    "Traced",
    "calibrate",
    "fit",
    "init_chooser",
    "measure",
    "observe",
    "predicted_step_s",
    "should_trace",
    "switch_policy",
    "unmoved",
]

#: A component re-chooses a second time only if its measured block compute moves by more than this fraction.
REMEASURE_MARGIN = 0.25
#: Steady steps traced per component; calibration uses the fastest (the least disturbed).
MAX_TRACES = 8
#: After `MAX_TRACES`, one step in this many is still traced, so a quieter moment refines the figures.
TRACE_EVERY = 8

V = TypeVar("V")


class Traced(Protocol):
    """What `measure` reads of a traced step (`runtime.StepTrace` is one)."""

    @property
    def schedule(self) -> Schedule: ...
    @property
    def clock(self) -> str: ...
    @property
    def wall_s(self) -> float: ...
    @property
    def spans(self) -> tuple[Span, ...]: ...


@attrs.frozen(kw_only=True)
class Measured:
    """What one traced step of ``component`` measured (seconds).

    ``block_s`` holds each block's forward; ``rest_s`` the component's own compute outside its blocks;
    ``host_op_s`` the host time per op the runtime ran (on the CPU its copies included) and
    ``host_block_s`` per block it hooked; ``wall_s`` the step; ``policy`` the schedule's policy.
    """

    component: str
    policy: str
    wall_s: float
    block_s: Mapping[str, float]
    rest_s: float
    host_op_s: float
    host_block_s: float
    clock: str


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` with ``y ~ a + b x`` by least squares, both at least 0: a negative slope gives
    ``(mean y, 0)``, a negative intercept ``(0, mean y / mean x)``; ``(0, mean y / mean x)`` when x
    never varies (``(mean y, 0)`` when it is always 0); ``(0, 0)`` with no points."""
    if not ys:
        return 0.0, 0.0
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        # Not separable: every gap holds as many ops. Ops carry the runtime's real work (re-pointing,
        # copies), so all of it goes to them; a schedule with another op mix refits it.
        return (0.0, my / mx) if mx else (my, 0.0)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    a = my - b * mx
    if b < 0:
        return my, 0.0
    if a < 0:
        return 0.0, my / mx if mx else 0.0
    return a, b


def measure(trace: Traced, plan: Plan) -> Measured:
    """The figures of one traced step: block compute, host cost per op and per block, remainder.

    Host cost is fitted over the gaps between consecutive block forwards (each gap holds the hooks of
    two blocks' ends and the ops anchored there): ``gap = host_block + ops x host_op`` (`fit`). On the
    CPU (``clock == "host clock"``) the copies inside a gap are taken out first and then spread over
    the step's ops (they run on the compute thread). The remainder is what the step took beyond its
    blocks, stalls and host cost; where the fitted host cost is more than the step had beside its
    blocks and stalls, both host figures are scaled down to it, so the figures always add up to the
    step's wall time.
    """
    schedule = trace.schedule
    component = schedule.step.component
    paths = {b.path for c in plan.component(component).walk() for b in c.blocks}
    cpu = trace.clock == "host clock"
    blocks = [s for s in trace.spans if s.stream == "compute" and s.kind == "compute" and s.label in paths]
    stalls = [s for s in trace.spans if s.kind == "stall"]
    copies = [s for s in trace.spans if s.stream in ("copy", "comm")] if cpu else []
    at: dict[tuple[str, str], int] = {}
    for op in schedule.ops:
        at[op.when, op.anchor] = at.get((op.when, op.anchor), 0) + 1
    xs: list[float] = []
    ys: list[float] = []
    for a, b in itertools.pairwise(blocks):
        inside = sum(
            s.duration_s
            for s in (*stalls, *copies)
            if s.start_s >= a.end_s - 1e-9 and s.end_s <= b.start_s + 1e-9
        )
        xs.append(at.get(("after", a.label), 0) + at.get(("before", b.label), 0))
        ys.append(max(b.start_s - a.end_s - inside, 0.0))
    host_block, host_op = fit(xs, ys)
    ops = len(schedule.ops)
    if cpu and ops:
        host_op += sum(s.duration_s for s in copies) / ops
    compute = sum(s.duration_s for s in blocks)
    stall = sum(s.duration_s for s in stalls)
    host = host_block * len(blocks) + host_op * ops
    rest = trace.wall_s - compute - stall - host
    if rest < 0 and host > 0:
        # The fit charged more host time than the step had beside its blocks (noise on a busy
        # machine): scale the host figures down to what there was, so the figures add up to the wall.
        scale = max(trace.wall_s - compute - stall, 0.0) / host
        host_block, host_op, rest = host_block * scale, host_op * scale, 0.0
    per_block: dict[str, float] = {}
    for s in blocks:
        per_block[s.label] = per_block.get(s.label, 0.0) + s.duration_s
    return Measured(
        component=component,
        policy=schedule.policy,
        wall_s=trace.wall_s,
        block_s=per_block,
        rest_s=max(rest, 0.0),
        host_op_s=host_op,
        host_block_s=host_block,
        clock=trace.clock,
    )


def predicted_step_s(policy: Policy, plan: Plan, component: str, cost: CostModel) -> float:
    """Simulated steady step of ``component`` under ``policy``: `simulate` of its steady schedule,
    plus, for a whole-component schedule (which anchors no block, so simulates none), its blocks'
    compute and hooks."""
    schedule = steady_schedule(policy, plan, component)
    report = simulate(schedule, cost)
    blocks = [b.path for c in plan.component(component).walk() for b in c.blocks]
    anchored = {op.anchor for op in schedule.ops}
    if blocks and not anchored & set(blocks):
        extra = sum(cost.compute_seconds(b, block=True) for b in blocks) + cost.host_block_s * len(blocks)
        return report.makespan_s + extra
    return report.makespan_s


def calibrate(
    figures: Sequence[Measured],
    *,
    h2d_bytes_per_s: float,
    collective_bytes_per_s: float = 100e9,
    default_block_s: float = 0.01,
) -> CostModel:
    """`CostModel.calibrated` from measurements: each block's and component's compute (a later
    figure's wins), the mean host cost per op and per block, the bandwidth given (infinite when
    measured on the CPU, whose copies are in the host cost per op); blocks never measured take the
    measured mean (``default_block_s`` with no figures)."""
    compute: dict[str, float] = {}
    for m in figures:
        compute.update(m.block_s)
        compute[m.component] = m.rest_s
    blocks = [v for m in figures for v in m.block_s.values()]
    cpu = any(m.clock == "host clock" for m in figures)
    n = max(len(figures), 1)
    return CostModel.calibrated(
        h2d_bytes_per_s=math.inf if cpu else h2d_bytes_per_s,
        block_s=sum(blocks) / len(blocks) if blocks else default_block_s,
        compute_s=compute,
        host_op_s=sum(m.host_op_s for m in figures) / n,
        host_block_s=sum(m.host_block_s for m in figures) / n,
        collective_bytes_per_s=math.inf if cpu else collective_bytes_per_s,
        forwards_per_step=1,
        source="measured by the session"
        + ("; copies on the compute thread (CPU) charged per op" if cpu else ""),
    )


def unmoved(compute: float, before: float) -> bool:
    """Whether measured block compute stayed within `REMEASURE_MARGIN` of what a re-choice used."""
    if before <= 0:
        return compute <= 0
    return abs(compute / before - 1) <= REMEASURE_MARGIN


@attrs.frozen(kw_only=True)
class Calibration:
    """What stays fixed while a session chooses: the plan, the device budget, the measured
    host-to-device bandwidth, the cost model before any step was measured (``base``), and the
    components whose steps are measured and predicted (``components``)."""

    plan: Plan
    budget: int
    h2d_bytes_per_s: float
    base: CostModel
    components: tuple[str, ...]


@attrs.frozen(kw_only=True)
class ChooserState:
    """Where auto stands in a session.

    ``choice`` is the latest `choose` result and ``policy`` the policy running now; ``pending`` the
    policy a re-choice switches to before the next step (``None``: none); ``cost`` the model in use.
    Per component: ``measured`` the fastest figures under the schedule they ran, ``walls`` the traced
    step times under the running policy, ``chosen_at`` the block compute its last re-choice used, and
    ``checks`` (the step predicted before the model was fitted to a traced step, what that step
    measured). ``switches`` says each change of schedule; ``fresh`` is true for the first step after
    a switch, which is not traced.
    """

    choice: Choice
    policy: Policy
    cost: CostModel
    pending: Policy | None = None
    measured: FrozenMap[str, Measured] = attrs.field(factory=FrozenMap)
    walls: FrozenMap[str, tuple[float, ...]] = attrs.field(factory=FrozenMap)
    chosen_at: FrozenMap[str, float] = attrs.field(factory=FrozenMap)
    checks: FrozenMap[str, tuple[float, float]] = attrs.field(factory=FrozenMap)
    switches: tuple[str, ...] = ()
    fresh: bool = False

    @property
    def running(self) -> str:
        """The running policy's name."""
        return getattr(self.policy, "name", "")


def _put(table: Mapping[str, V], key: str, value: V) -> FrozenMap[str, V]:
    """``table`` with ``key`` set to ``value``, as a new map."""
    return FrozenMap({**table, key: value})


def init_chooser(setup: Calibration) -> ChooserState:
    """The state before any step ran: `choose` under ``setup.base`` (its `ScheduleError` when nothing
    fits the budget)."""
    choice = choose(setup.plan, setup.budget, setup.base)
    return ChooserState(choice=choice, policy=choice.policy(), cost=setup.base)


def should_trace(
    setup: Calibration, state: ChooserState, component: str, index: int
) -> tuple[ChooserState, bool]:
    """Whether to trace the step of ``component`` at run index ``index`` (the first of a run, the
    first after a switch and those of unmeasured components are not), and the state after asking."""
    if state.fresh:
        state = attrs.evolve(state, fresh=False)
        return state, False
    if component not in setup.components or index == 0:
        return state, False
    if len(state.walls.get(component, ())) >= MAX_TRACES and index % TRACE_EVERY:
        return state, False
    return state, True


def switch_policy(state: ChooserState) -> tuple[ChooserState, Policy | None]:
    """The policy to run from the next step on, once (``None``: keep the running one), and the state
    that runs it (its traced walls start again; its first step is not traced)."""
    if state.pending is None:
        return state, None
    state = attrs.evolve(state, policy=state.pending, pending=None, fresh=True, walls=FrozenMap())
    return state, state.policy


def observe(setup: Calibration, state: ChooserState, figures: Measured) -> tuple[ChooserState, Policy | None]:
    """Fold one traced steady step's ``figures`` into the state; the policy to switch to, if any.

    A step in which no block ran measured nothing: the state is returned as it was. Otherwise the
    model's prediction for the step (fitted to earlier steps only) is kept as the component's check,
    the step's wall joins its walls, the fastest figures under one policy are kept, and then: when
    the component's block compute is `unmoved` since its last re-choice, only the model is refitted;
    else `choose` runs again under the refitted model (``state.choice`` is then a new `Choice`), and
    a different policy is returned and becomes ``pending``.
    """
    c = figures.component
    if not figures.block_s:
        return state, None
    checks = state.checks
    if c in state.measured and figures.policy == state.running:
        predicted = predicted_step_s(state.policy, setup.plan, c, state.cost)
        checks = _put(checks, c, (predicted, figures.wall_s))
    walls = _put(state.walls, c, (*state.walls.get(c, ()), figures.wall_s))
    best = state.measured.get(c)
    measured = state.measured
    if best is None or figures.wall_s < best.wall_s or best.policy != figures.policy:
        measured = _put(measured, c, figures)
    cost = calibrate(
        list(measured.values()),
        h2d_bytes_per_s=setup.h2d_bytes_per_s,
        collective_bytes_per_s=setup.base.collective_bytes_per_s,
        default_block_s=setup.base.block_s,
    )
    state = attrs.evolve(state, checks=checks, walls=walls, measured=measured, cost=cost)
    # Compute does not depend on the schedule, so it is what a second re-choice is judged by.
    compute = sum(measured[c].block_s.values())
    before = state.chosen_at.get(c)
    if before is not None and unmoved(compute, before):
        return state, None  # the model keeps learning; the choice stands
    choice = choose(setup.plan, setup.budget, cost)
    state = attrs.evolve(state, choice=choice, chosen_at=_put(state.chosen_at, c, compute))
    new = choice.policy()
    old = state.running
    if new.name == old:
        return state, None
    switched = f"{old} -> {new.name}: calibrated on {c}"
    state = attrs.evolve(state, pending=new, switches=(*state.switches, switched))
    return state, new
