"""Each forward of a top-level component becomes a `Step` (named by `policies.step_fields`), and
its schedule is cached: policies are pure, so each distinct step asks the policy once.
"""

from __future__ import annotations

from typing import TypeVar

from torchferry._errors import PlanError, ScheduleError
from torchferry.policies import (
    Placement,
    Policy,
    Schedule,
    Step,
    check,
    init_steps,
    step_failed,
    step_fields,
    step_name,
)
from torchferry.topology import Plan

__all__ = ["MAX_SCHEDULES", "Steps", "prove", "step_name"]

#: Schedules (and step peaks, and follow-ups) kept, oldest dropped first; a pipeline call needs one
#: per component forward, and a model called in a loop counts forwards without end.
MAX_SCHEDULES = 512

K = TypeVar("K")
V = TypeVar("V")


def bounded_put(table: dict[K, V], key: K, value: V, limit: int = MAX_SCHEDULES) -> None:
    """``table[key] = value``, dropping the oldest entry first when a new key would pass ``limit``."""
    if key not in table and len(table) >= limit:
        table.pop(next(iter(table)))
    table[key] = value


def prove(schedule: Schedule, plan: Plan) -> None:
    """`policies.check` for a schedule the session is about to run: a violation is a `PlanError`."""
    try:
        check(schedule, plan)
    except ScheduleError as exc:
        raise PlanError(
            f"step {step_name(schedule.step)}: the schedule {schedule.policy} made breaks the plan, so "
            f"none of it ran; fix the policy, lower its depth or raise device_memory=\n{exc}"
        ) from None


class Steps:
    """Names the steps of one session and keeps each distinct step's schedule and device peak."""

    def __init__(self, plan: Plan, policy: Policy, *, index_free: bool) -> None:
        self.plan = plan
        self.policy = policy
        self.index_free = index_free
        #: Every schedule the session has run, by step.
        self.schedules: dict[Step, Schedule] = {}
        #: The most device bytes each step held while it ran, to compare with `policies.simulate`.
        self.peaks: dict[Step, int] = {}
        #: The run index and what followed each step (`policies.StepState`).
        self.state = init_steps()
        # Why: the Step objects made lately, by (component, index, next, entry identity).
        self._known: dict[tuple[str, int, str | None, int], Step] = {}

    def next(self, component: str, entry: tuple[Placement, ...]) -> Step:
        """The step a forward of ``component`` starting from ``entry`` is."""
        index, after, self.state = step_fields(self.state, component, index_free=self.index_free)
        memo = (component, index, after, id(entry))
        known = self._known.get(memo)
        if known is not None and known.entry is entry:
            return known  # a steady step: the same Step object, so its schedule is found by identity
        step = Step(component=component, index=index, entry=entry, next=after)
        bounded_put(self._known, memo, step)
        return step

    @property
    def index(self) -> int:
        """The run index of the step named last (``-1`` before the first of a run)."""
        return self.state.index

    def schedule(self, step: Step) -> Schedule:
        """The policy's schedule for ``step`` (asked once per distinct step), proved by `policies.check`.

        The proof runs once, when the schedule is made, and is cached with it: a schedule that breaks
        an invariant (a depth or a custom policy over ``config.device_memory_bytes``, say) is a
        `PlanError` with the marked listing before any of its ops runs.
        """
        schedule = self.schedules.get(step)
        if schedule is None:
            schedule = self.policy(self.plan, step)
            prove(schedule, self.plan)
            bounded_put(self.schedules, step, schedule)
        return schedule

    def use(self, policy: Policy, *, index_free: bool) -> None:
        """Serve the steps from here on with ``policy`` (a switch between steps): its schedules replace
        the cached ones; step naming carries on."""
        self.policy = policy
        self.index_free = index_free
        self.schedules.clear()
        self._known.clear()

    def interrupted(self) -> None:
        """The running step failed: the next forward starts a new run (its index is 0)."""
        self.state = step_failed(self.state)

    def finished(self, step: Step, peak: int) -> None:
        """``step`` ran to its end holding at most ``peak`` device bytes."""
        known = self.peaks.get(step)
        if known is None or peak > known:  # (a replayed step allocates nothing: never above its first run)
            bounded_put(self.peaks, step, peak)
