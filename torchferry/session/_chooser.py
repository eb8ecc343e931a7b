"""The session's side of ``strategy="auto"``: the wiring of the pure re-choice in
`policies._calibrate` ([Note: choosing in a session] there) to the session's tracer.

`offload` with ``strategy="auto"`` (its default) resolves a layerwise plan whose budget
(``config.device_memory_bytes``) the open planner set (`policies.open_plan`: the one given, else
`policies.default_device_budget` of the device's free memory, or a device sharing host memory its
share of the host budget), and what auto starts from (`policies.auto_setup`: the device's figures
by `policies.device_profile`, the host-to-device rate the runtime timed once with the facts, the
cost inputs, the components measured). `Chooser` measures nothing itself: it holds the
`policies.ChooserState` and hands it each traced step (`runtime.Tracer`) measured by
`policies.measure`; every decision is a pure function of that state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from torchferry import policies
from torchferry._errors import PlanError, ScheduleError
from torchferry.policies import Calibration, Choice, ChooserState, CostModel, Policy
from torchferry.runtime import StepTrace, Tracer
from torchferry.topology import Plan

__all__ = [
    "Chooser",
    "SessionReport",
    "named_report",
]

LOG = logging.getLogger("torchferry")


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
    from the checkpoint so far. ``planned_host_bytes`` is what the tiers planned and the open plan
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


def named_report(name: str, plan: Plan, source: str = "given", **memory: Any) -> SessionReport:
    """The report of a session whose caller named the policy ``name``: nothing chosen or measured;
    ``source`` says where the device budget came from (given, less a GGUF model's dequantize)."""
    budget = plan.config.device_memory_bytes
    return SessionReport(
        **memory,
        budget=budget,
        budget_source=source if budget is not None else "none given",
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
    """The auto strategy inside one session: the `policies.ChooserState`, updated by its pure functions.

    The session asks `tracer` at each step's start (with the step's run index) whether to trace it,
    hands each finished trace to `traced`, and asks `pending` between steps for a policy to switch to.
    """

    def __init__(self, setup: Calibration, device: torch.device, budget_source: str, h2d_source: str) -> None:
        #: What stays fixed (`policies.auto_setup`, decided by `policies.open_plan` from the facts read
        #: at open): the plan, the budget, the measured bandwidth, the starting cost model, and the
        #: components whose steps are measured and predicted.
        self.setup = setup
        self.plan = setup.plan
        self.device = device
        self.budget = setup.budget
        self.budget_source = budget_source
        self.h2d, self.h2d_source = setup.h2d_bytes_per_s, h2d_source
        try:
            #: Every choice, measurement and re-choice so far.
            self.state: ChooserState = policies.init_chooser(setup)
        except ScheduleError as exc:
            raise PlanError(
                f"offload(strategy='auto'): nothing fits the budget ({budget_source}): {exc}; pass a "
                "larger device_memory= or fewer components"
            ) from None

    @property
    def components(self) -> tuple[str, ...]:
        return self.setup.components

    @property
    def policy(self) -> Policy:
        """The policy running now."""
        return self.state.policy

    @property
    def choice(self) -> Choice:
        return self.state.choice

    @property
    def cost(self) -> CostModel:
        return self.state.cost

    # ------------------------------------------------------------------------------ the session
    def pending(self) -> Policy | None:
        """The policy to switch to before the next step, once (``None``: keep the running one)."""
        self.state, policy = policies.switch_policy(self.state)
        return policy

    def tracer(self, component: str, index: int) -> Tracer | None:
        """A tracer for the step of ``component`` at run index ``index`` starting now, if it is one to
        measure (`policies.should_trace`)."""
        self.state, trace = policies.should_trace(self.setup, self.state, component, index)
        return Tracer(self.device, component) if trace else None

    def traced(self, trace: StepTrace) -> bool:
        """One traced steady step: fold its figures in (`policies.observe`); ``True`` when it re-chose.

        A step in which no block ran (a cache that skips the whole transformer, or a compiled forward
        whose blocks no hook timed) measured nothing: it is not counted, and the next is traced.
        """
        before = self.state
        self.state, switch = policies.observe(self.setup, before, policies.measure(trace, self.plan))
        if switch is not None:
            new, old = getattr(switch, "name", ""), before.running
            LOG.info("torchferry: after measuring %s, switching %s -> %s", trace.component, old, new)
        return self.state.choice is not before.choice

    @property
    def switching(self) -> bool:
        """Whether a re-choice is waiting for the next step."""
        return self.state.pending is not None

    @property
    def running_name(self) -> str:
        return self.state.running

    # ------------------------------------------------------------------------------ the figures
    def predicted(self, component: str) -> float:
        """Simulated steady step of ``component`` under the running policy and the current model."""
        return policies.predicted_step_s(self.state.policy, self.plan, component, self.state.cost)

    def report(self) -> SessionReport:
        state = self.state
        calibrated = bool(state.measured)
        figures = list(state.measured.values())
        return SessionReport(
            budget=self.budget,
            budget_source=self.budget_source,
            h2d_bytes_per_s=self.h2d,
            h2d_source=self.h2d_source,
            policy=state.running,
            choice=state.choice,
            cost=state.cost,
            calibrated=calibrated,
            block_s={m.component: sum(m.block_s.values()) / max(len(m.block_s), 1) for m in figures},
            predicted_step_s={c: self.predicted(c) for c in self.components},
            measured_step_s={c: min(w) for c, w in state.walls.items() if w},
            host_op_s=sum(m.host_op_s for m in figures) / len(figures) if figures else 0.0,
            host_block_s=sum(m.host_block_s for m in figures) / len(figures) if figures else 0.0,
            switches=state.switches,
            reason=state.choice.reason
            + ("" if calibrated else " (under assumed compute; re-chosen once a step is measured)"),
            checked_step_s=dict(state.checks),
            traced_steps={c: len(w) for c, w in state.walls.items() if w},
        )
