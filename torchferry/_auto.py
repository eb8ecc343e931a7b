"""The session's side of ``strategy="auto"``: the budget, what is measured, the calibrated re-choice.

[Note: choosing in a session]
`offload` with ``strategy="auto"`` (its default) resolves a layerwise plan whose budget
(``config.device_memory_bytes``) is the one given, else the device's free memory when the session
opens minus `ACTIVATION_MARGIN` (at least `ACTIVATION_MARGIN_MIN`) for activations, else on the CPU
`CPU_BUDGET`. It measures the host-to-device bandwidth once per process (`h2d_bandwidth`: a pinned
copy on CUDA, a host memcpy on the CPU) and asks `policies.choose`, the chooser behind
``torchferry plan``, for strategy, depth and resident blocks under a cost model from the device's
profile (`runtime.load_profile`, else its device class) with that bandwidth.

Then it measures what the choice depends on. `Chooser` traces up to `MAX_TRACES` steady steps of
each streaming DiT per schedule, then one in `TRACE_EVERY` (`runtime.Tracer`; every step of a run
but the first, so the step starts where the one before ended), and turns the fastest into figures
(`measure`): each block's compute, the host seconds per op and per hooked block, and the
component's non-block remainder. After the first measured step of a component it re-chooses under
`policies.CostModel.calibrated`; a changed choice is used from the next step on (never inside one:
the session drops what the old schedule left on the device between the two steps and the new
schedule stages what it needs). A component re-chooses again only when a later measurement moves
its block compute by more than `REMEASURE_MARGIN`; later measurements still refine the cost model.

On the CPU copies run on the compute thread, so the calibrated model charges them as host time per
op (its bandwidth is infinite) instead of on a copy stream that would hide them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from torchferry import policies
from torchferry._errors import PlanError, ScheduleError
from torchferry.policies import Choice, CostModel, DeviceProfile, Policy, Schedule
from torchferry.runtime import StepTrace, Tracer, copy_bytes_per_s, host_name, load_profile
from torchferry.topology import Plan

__all__ = [
    "ACTIVATION_MARGIN",
    "ACTIVATION_MARGIN_MIN",
    "CPU_BUDGET",
    "MAX_TRACES",
    "REMEASURE_MARGIN",
    "TRACE_EVERY",
    "Chooser",
    "Measured",
    "SessionReport",
    "calibrate",
    "default_budget",
    "h2d_bandwidth",
    "measure",
    "named_report",
    "predicted_step_s",
]

LOG = logging.getLogger("torchferry")

#: Fraction of the device's free memory at open left to activations when no budget is given.
ACTIVATION_MARGIN = 0.10
#: The least left to activations (bytes): 1 GiB.
ACTIVATION_MARGIN_MIN = 1 << 30
#: The budget on a CPU "device" when none is given (bytes): 8 GiB.
CPU_BUDGET = 8 << 30
#: A component re-chooses a second time only if its measured block compute moves by more than this fraction.
REMEASURE_MARGIN = 0.25
#: Steady steps traced per component; calibration uses the fastest (the least disturbed).
MAX_TRACES = 8
#: After `MAX_TRACES`, one step in this many is still traced, so a quieter moment refines the figures.
TRACE_EVERY = 8
#: Bytes of the timed copy that measures the host-to-device bandwidth (CUDA, CPU).
_COPY_BYTES = {"cuda": 64 << 20, "cpu": 16 << 20}


def default_budget(device: torch.device) -> tuple[int, str]:
    """The budget when none is given, and a sentence saying where it came from."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        margin = max(ACTIVATION_MARGIN_MIN, int(free * ACTIVATION_MARGIN))
        budget = max(free - margin, 0)
        return budget, (
            f"free device memory at open {policies.format_bytes(free, exact=False)} minus "
            f"{policies.format_bytes(margin, exact=False)} for activations"
        )
    return CPU_BUDGET, f"the CPU default of {policies.format_bytes(CPU_BUDGET, exact=False)}"


@functools.cache
def _bandwidth(device: str) -> float:
    target = torch.device(device)
    rate = copy_bytes_per_s(target, _COPY_BYTES["cuda" if target.type == "cuda" else "cpu"], 3)
    if target.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def h2d_bandwidth(device: torch.device) -> tuple[float, str]:
    """Host-to-device bytes per second, measured once per process and device (the fastest of three
    timed copies after a warm-up), and how it was measured."""
    cuda = device.type == "cuda"
    what = "pinned host-to-device copy" if cuda else "host memcpy"
    nbytes = _COPY_BYTES["cuda" if cuda else "cpu"]
    return _bandwidth(str(device)), f"measured: {policies.format_bytes(nbytes, exact=False)} {what}"


def base_profile(device: torch.device) -> DeviceProfile:
    """The device's saved profile (`runtime.load_profile`) when it was measured on this device: of
    this type, of this name (``"cpu"``, or the CUDA device name) and on this machine (a profile of
    another GPU model, of the CPU, of another machine or that does not say is not used); else its
    device class, else `policies.DEFAULT_DEVICE`. A profile of another device of this machine still
    gives its drive's read rates (``torchferry probe PATH``): they are the drive's, not the device's."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    saved = load_profile()
    if saved is not None and saved.measured_on(device.type, name, host_name()):
        return saved
    base = policies.match_device_class(name) or policies.DEFAULT_DEVICE
    if saved is not None and saved.read_bytes_per_s is not None and saved.host == host_name():
        base = attrs.evolve(
            base,
            read_bytes_per_s=saved.read_bytes_per_s,
            read_direct_bytes_per_s=saved.read_direct_bytes_per_s,
            source=f"{base.source}; read rates from the profile of {saved.name} on this machine",
        )
    return base


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


def measure(trace: StepTrace, plan: Plan) -> Measured:
    """The figures of one traced step: block compute, host cost per op and per block, remainder.

    Host cost is fitted over the gaps between consecutive block forwards (each gap holds the hooks of
    two blocks' ends and the ops anchored there): ``gap = host_block + ops x host_op``, least squares
    when the op count varies, all of it per op otherwise. On the CPU the copies inside a gap are taken
    out first and then spread over the step's ops (they run on the compute thread). The remainder is
    what the step took beyond its blocks, stalls and host cost.
    """
    schedule = trace.schedule
    component = trace.component
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
    host_block, host_op = _fit(xs, ys)
    ops = len(schedule.ops)
    copy_s = sum(s.duration_s for s in copies)
    if cpu and ops:
        host_op += copy_s / ops
    compute = sum(s.duration_s for s in blocks)
    stall = sum(s.duration_s for s in stalls)
    rest = trace.wall_s - compute - stall - host_block * len(blocks) - host_op * ops
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
    """Simulated steady step of ``component`` under ``policy``: `policies.simulate` of its steady
    schedule, plus, for a whole-component schedule (which anchors no block, so simulates none), its
    blocks' compute and hooks."""
    schedule: Schedule = policies.steady_schedule(policy, plan, component)
    report = policies.simulate(schedule, cost)
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
    """`policies.CostModel.calibrated` from measurements: each block's and component's compute, the
    mean host cost per op and per block, the bandwidth given (infinite when measured on the CPU,
    whose copies are in the host cost per op); blocks never measured take the measured mean."""
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


def _unmoved(compute: float, before: float) -> bool:
    """Whether measured block compute stayed within `REMEASURE_MARGIN` of what a re-choice used."""
    if before <= 0:
        return compute <= 0
    return abs(compute / before - 1) <= REMEASURE_MARGIN


def _fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` with ``y ~ a + b x``, both at least 0; ``(0, y / x)`` when x never varies."""
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


@attrs.frozen(kw_only=True)
class SessionReport:
    """What a session measured, what it chose, what it predicted and what it then measured, and why.

    ``budget`` (bytes) and ``budget_source`` say what the schedules must fit; ``h2d_bytes_per_s`` and
    ``h2d_source`` the bandwidth measured (``None`` when nothing was chosen here); ``policy`` is the
    policy running now and ``choice`` the chooser's `policies.Choice` behind it (``None`` when the
    caller picked the strategy or policy). Per streaming component: ``block_s`` the mean measured
    block forward, ``predicted_step_s`` the simulated steady step of the running schedule under the
    calibrated cost model, ``measured_step_s`` the fastest traced step of it (absent until traced).
    The calibrated model is fitted to those traced steps, so the two agree by construction;
    ``checked_step_s`` is the honest comparison: per component, the step the model predicted for its
    last traced step *before* being fitted to it (a model fitted to earlier steps only), and what that
    step measured (absent until a component has been traced twice); ``traced_steps`` counts the
    steps traced under the running schedule.
    ``cost`` is the cost model in use, ``calibrated`` whether it holds measured compute, ``switches``
    each change of schedule (``old -> new: why``), ``reason`` the choice in a sentence. ``device`` is
    where the weights run; ``device_bytes`` and ``host_bytes`` what torchferry holds there and in host
    memory now (device slots and staged units; the host copies of every managed weight), with their
    peaks so far; ``host_budget`` the host budget given (``config.host_memory_bytes``), if any.
    ``host_budget_source`` says where the host budget came from (given, or the machine's bound that
    set it), ``file_packs`` how many packs the file tier holds and ``file_read_bytes`` the bytes read
    from the checkpoint so far. ``planned_host_bytes`` is what the tiers planned and preflight
    proved against the budget, ``read_buffer_bytes`` the direct-I/O buffers in it and ``read_mode``
    how the file tier read (``"buffered"``: those buffers were reserved, never allocated);
    ``memlock_bytes`` the finite ``RLIMIT_MEMLOCK`` (``None``: unlimited), said by ``memlock_source``.
    """

    budget: int | None
    budget_source: str
    h2d_bytes_per_s: float | None
    h2d_source: str
    policy: str
    choice: Choice | None
    cost: CostModel | None
    calibrated: bool
    block_s: Mapping[str, float]
    predicted_step_s: Mapping[str, float]
    measured_step_s: Mapping[str, float]
    host_op_s: float
    host_block_s: float
    switches: tuple[str, ...]
    reason: str
    checked_step_s: Mapping[str, tuple[float, float]] = attrs.field(factory=dict)
    traced_steps: Mapping[str, int] = attrs.field(factory=dict)
    device: str = ""
    device_bytes: int = 0
    peak_device_bytes: int = 0
    host_bytes: int = 0
    peak_host_bytes: int = 0
    host_budget: int | None = None
    host_budget_source: str = ""
    file_packs: int = 0
    file_read_bytes: int = 0
    planned_host_bytes: int | None = None
    read_buffer_bytes: int = 0
    read_mode: str = ""
    memlock_bytes: int | None = None
    memlock_source: str = ""
    #: The plan's digest, its file-tier packs, and the bytes the file tier reads by how often
    #: (`policies.policy_reads`): what `torchferry plan` says of the same plan.
    plan_digest: str = ""
    file_pack_names: tuple[str, ...] = ()
    planned_read_bytes: Mapping[str, int] = attrs.field(factory=dict)

    def error(self, component: str) -> float | None:
        """``predicted / measured - 1`` of ``component``'s step, the prediction made before the model
        was fitted to that measurement (`checked_step_s`); ``None`` until there is one."""
        p, m = self.checked_step_s.get(component, (None, None))
        return p / m - 1 if p is not None and m else None

    def summary(self) -> str:
        """One line: what runs, within what, and the last honest check of a prediction (logged at INFO)."""
        parts = [f"torchferry: {self._running()} within budget {_size(self.budget)} ({self.budget_source})"]
        for c in self.predicted_step_s:
            parts.append(f"{c}: {self._step_text(c)}")
        parts.append(f"why: {self.reason}")
        return "; ".join(parts)

    def _running(self) -> str:
        where = f" on {self.device}" if self.device else ""
        return ("auto: " if self.choice is not None else "") + self.policy + where

    def _step_text(self, c: str) -> str:
        predicted = self.predicted_step_s[c]
        text = f"step predicted {_ms(predicted)}"
        measured = self.measured_step_s.get(c)
        if measured is None:
            return text + " (not yet measured)"
        n = self.traced_steps.get(c, 1)
        text += f", fastest of {n} traced {_ms(measured)} (the model is fitted to it)"
        check = self.checked_step_s.get(c)
        if check is None:
            return text + "; not yet checked against a step it was not fitted to"
        before, then = check
        off = (before / then - 1) * 100
        return text + f"; last check: {_ms(before)} predicted, then measured {_ms(then)} ({off:+.1f}%)"

    def __str__(self) -> str:
        """The report as aligned lines: what runs where, the budget, memory now and at peak, what was
        measured, each component's step, and why (`summary` is the one-line form)."""
        rows = [("running", self._running())]
        host = "none given"
        if self.host_budget is not None:
            host = f"{_size(self.host_budget)} ({self.host_budget_source or 'given'})"
        rows.append(("budget", f"device {_size(self.budget)} ({self.budget_source}); host {host}"))
        rows.append(("device", f"{_size(self.device_bytes)} now, {_size(self.peak_device_bytes)} at peak"))
        held = f"{_size(self.host_bytes)} now, {_size(self.peak_host_bytes)} at peak"
        planned = self.planned_host_bytes
        if planned is not None and self.read_buffer_bytes and _size(planned) != _size(self.peak_host_bytes):
            buffers = _size(self.read_buffer_bytes)  # without a file tier, the plan is the store, to a page
            held += f", of {_size(planned)} planned ({buffers} of direct-I/O buffers reserved; "
            held += f"reads {self.read_mode})"
        if self.file_packs:
            held += f"; {self.file_packs} packs in the file tier, {_size(self.file_read_bytes)} read from it"
        rows.append(("host", held))
        if self.memlock_bytes is not None:
            rows.append(("memlock", f"{_size(self.memlock_bytes)} ({self.memlock_source})"))
        if self.h2d_bytes_per_s is not None:
            rows.append(("h2d", f"{self.h2d_bytes_per_s / 1e9:.3g} GB/s ({self.h2d_source})"))
        for c in self.predicted_step_s:
            block = self.block_s.get(c)
            rows.append((c, (f"block {_ms(block)}; " if block is not None else "") + self._step_text(c)))
        if self.calibrated:
            host = f"{self.host_op_s * 1e6:.1f} us/op, {self.host_block_s * 1e6:.1f} us/block"
            rows.append(("host cost", host))
        rows.extend(("switched", s) for s in self.switches)
        rows.append(("why", self.reason))
        width = max(len(k) for k, _ in rows)
        return "torchferry session\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _size(nbytes: int | None) -> str:
    return "none" if nbytes is None else policies.format_bytes(nbytes, exact=False)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def named_report(name: str, plan: Plan, **memory: Any) -> SessionReport:
    """The report of a session whose caller named the policy ``name``: nothing chosen or measured."""
    budget = plan.config.device_memory_bytes
    return SessionReport(
        **memory,
        budget=budget,
        budget_source="given" if budget is not None else "none given",
        h2d_bytes_per_s=None,
        h2d_source="",
        policy=name,
        choice=None,
        cost=None,
        calibrated=False,
        block_s={},
        predicted_step_s={},
        measured_step_s={},
        host_op_s=0.0,
        host_block_s=0.0,
        switches=(),
        reason=f"{name}: named by the caller (strategy={plan.strategy!r}); nothing was chosen",
    )


class Chooser:
    """The auto strategy inside one session: the current choice, the measurements, the re-choices.

    The session asks `tracer` at each step's start whether to trace it, hands each finished trace to
    `traced`, and asks `pending` between steps for a policy to switch to.
    """

    def __init__(self, plan: Plan, device: torch.device, budget: int, budget_source: str) -> None:
        self.plan = plan
        self.device = device
        self.budget = budget
        self.budget_source = budget_source
        self.h2d, self.h2d_source = h2d_bandwidth(device)
        profile = base_profile(device)
        topo = plan.topology
        self.base = policies.estimate_cost(
            topo, device=attrs.evolve(profile, h2d_bytes_per_s=self.h2d), forwards_per_step=1
        )
        self.cost = self.base
        lay = policies.layout(plan)
        dits = [c.path for c in plan.components if lay.streamed.get(c.path) and c.kind == "dit"]
        #: Components whose steps are measured and predicted: the streaming DiTs (else any streamer).
        self.components: tuple[str, ...] = tuple(
            dits or [c.path for c in plan.components if lay.streamed.get(c.path)]
        )
        try:
            self.choice: Choice = policies.choose(plan, budget, self.cost)
        except ScheduleError as exc:
            raise PlanError(
                f"offload(strategy='auto'): nothing fits the budget ({budget_source}): {exc}; pass a "
                "larger device_memory= or fewer components"
            ) from None
        self.policy: Policy = self.choice.policy()
        self._pending: Policy | None = None
        self.switches: list[str] = []
        # Why: the fastest measurement of each component under the schedule it ran, for the cost model.
        self.measured: dict[str, Measured] = {}
        # Why: the traced walls of each component under the running policy, for `measured_step_s`.
        self.walls: dict[str, list[float]] = {}
        # Why: the measured step each component's last re-choice used, against REMEASURE_MARGIN.
        self._chosen_at: dict[str, float] = {}
        # Why: per component, (the step predicted before the model was fitted to a traced step, what
        # that step measured): the one comparison of prediction and measurement that is not circular.
        self.checks: dict[str, tuple[float, float]] = {}
        self._run: tuple[str, int] | None = None
        self._fresh = False

    # ------------------------------------------------------------------------------ the session
    def pending(self) -> Policy | None:
        """The policy to switch to before the next step, once (``None``: keep the running one)."""
        policy, self._pending = self._pending, None
        if policy is not None:
            self.policy = policy
            self._fresh = True
            self.walls.clear()
        return policy

    def tracer(self, component: str) -> Tracer | None:
        """A tracer for the step of ``component`` starting now, if it is one to measure."""
        last = self._run
        index = last[1] + 1 if last is not None and last[0] == component else 0
        self._run = (component, index)
        fresh, self._fresh = self._fresh, False
        if component not in self.components or index == 0 or fresh:
            return None
        if len(self.walls.get(component, ())) >= MAX_TRACES and index % TRACE_EVERY:
            return None
        return Tracer(self.device, component)

    def interrupted(self) -> None:
        """A step failed: the next forward starts a new run."""
        self._run = None

    def traced(self, trace: StepTrace) -> bool:
        """One traced steady step: keep its figures, re-choose when they call for it (then ``True``).

        A step in which no block ran (a cache that skips the whole transformer, or a compiled forward
        whose blocks no hook timed) measured nothing: it is not counted, and the next is traced.
        """
        c = trace.component
        figures = measure(trace, self.plan)
        if not figures.block_s:
            return False
        if c in self.measured and trace.schedule.policy == self.running_name:
            # The model was fitted to earlier steps only: what it predicts for this one is a real test.
            self.checks[c] = (self.predicted(c), trace.wall_s)
        self.walls.setdefault(c, []).append(trace.wall_s)
        best = self.measured.get(c)
        if best is None or figures.wall_s < best.wall_s or best.policy != figures.policy:
            self.measured[c] = figures
        # Compute does not depend on the schedule, so it is what a second re-choice is judged by.
        compute = sum(self.measured[c].block_s.values())
        before = self._chosen_at.get(c)
        if before is not None and _unmoved(compute, before):
            self.cost = self.calibrated()  # the model keeps learning; the choice stands
            return False
        self._chosen_at[c] = compute
        self._rechoose(c)
        return True

    @property
    def switching(self) -> bool:
        """Whether a re-choice is waiting for the next step."""
        return self._pending is not None

    @property
    def running_name(self) -> str:
        return getattr(self.policy, "name", "")

    def _rechoose(self, component: str) -> None:
        self.cost = self.calibrated()
        choice = policies.choose(self.plan, self.budget, self.cost)
        old = self.running_name
        new = choice.policy()
        self.choice = choice
        if new.name != old:
            self._pending = new
            self.switches.append(f"{old} -> {new.name}: calibrated on {component}")
            LOG.info("torchferry: after measuring %s, switching %s -> %s", component, old, new.name)

    def calibrated(self) -> CostModel:
        """The cost model of every measurement so far (blocks never measured take their mean)."""
        return calibrate(
            list(self.measured.values()),
            h2d_bytes_per_s=self.h2d,
            collective_bytes_per_s=self.base.collective_bytes_per_s,
            default_block_s=self.base.block_s,
        )

    # ------------------------------------------------------------------------------ the figures
    def predicted(self, component: str) -> float:
        """Simulated steady step of ``component`` under the running policy and the current model."""
        return predicted_step_s(self.policy, self.plan, component, self.cost)

    def report(self) -> SessionReport:
        calibrated = bool(self.measured)
        figures = list(self.measured.values())
        return SessionReport(
            budget=self.budget,
            budget_source=self.budget_source,
            h2d_bytes_per_s=self.h2d,
            h2d_source=self.h2d_source,
            policy=self.running_name,
            choice=self.choice,
            cost=self.cost,
            calibrated=calibrated,
            block_s={m.component: sum(m.block_s.values()) / max(len(m.block_s), 1) for m in figures},
            predicted_step_s={c: self.predicted(c) for c in self.components},
            measured_step_s={c: min(w) for c, w in self.walls.items() if w},
            host_op_s=sum(m.host_op_s for m in figures) / len(figures) if figures else 0.0,
            host_block_s=sum(m.host_block_s for m in figures) / len(figures) if figures else 0.0,
            switches=tuple(self.switches),
            reason=self.choice.reason
            + ("" if calibrated else " (under assumed compute; re-chosen once a step is measured)"),
            checked_step_s=dict(self.checks),
            traced_steps={c: len(w) for c, w in self.walls.items() if w},
        )
