"""Step naming: each forward of a top-level component becomes a `Step`, and its schedule is cached.

A step is ``Step(component, index, entry, next)``: ``index`` numbers consecutive forwards of the
same component (the run length), ``entry`` is what the device holds when it starts, and ``next`` is
the component that followed this step last time, so a policy can prefetch across a switch. Policies
are pure, so each distinct step asks the policy once; an index-free policy (`policies.index_free`)
serves every forward that starts from the same residency with the schedule of index 0.
"""

from __future__ import annotations

from typing import TypeVar

from torchferry._errors import PlanError, ScheduleError
from torchferry.policies import Placement, Policy, Schedule, Step, check
from torchferry.topology import Plan

__all__ = ["MAX_SCHEDULES", "Steps", "prove", "step_name"]

#: Schedules (and step peaks, and follow-ups) kept, oldest dropped first; a pipeline call needs one
#: per component forward, and a model called in a loop counts forwards without end.
MAX_SCHEDULES = 512

K = TypeVar("K")
V = TypeVar("V")


def step_name(step: Step) -> str:
    """``component#index``, the step's name in messages."""
    return f"{step.component or '(pipeline)'}#{step.index}"


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
        # Why: the step key that ran last, to number run lengths and learn what follows each step.
        self._last: tuple[str, int] | None = None
        # Why: what followed each step last time, so a policy can prefetch across a switch.
        self._follows: dict[tuple[str, int], str | None] = {}
        # Why: the Step objects made lately, by (component, index, next, entry identity).
        self._known: dict[tuple[str, int, str | None, int], Step] = {}

    def next(self, component: str, entry: tuple[Placement, ...]) -> Step:
        """The step a forward of ``component`` starting from ``entry`` is."""
        last = self._last
        index = last[1] + 1 if last is not None and last[0] == component else 0
        if last is not None:
            bounded_put(self._follows, last, None if last[0] == component else component)
        key = (component, index)
        self._last = key
        follows = self._follows.get(key)
        # One schedule serves every forward that starts from the same residency (`index_free`).
        named = 0 if self.index_free else index
        memo = (component, named, follows, id(entry))
        known = self._known.get(memo)
        if known is not None and known.entry is entry:
            return known  # a steady step: the same Step object, so its schedule is found by identity
        step = Step(component=component, index=named, entry=entry, next=follows)
        bounded_put(self._known, memo, step)
        return step

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
        self._last = None

    def finished(self, step: Step, peak: int) -> None:
        """``step`` ran to its end holding at most ``peak`` device bytes."""
        bounded_put(self.peaks, step, max(peak, self.peaks.get(step, peak)))
