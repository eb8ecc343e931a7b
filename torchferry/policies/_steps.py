"""Step naming as a pure state machine: which `Step` each forward of a top-level component is.

A step is ``Step(component, index, entry, next)``: ``index`` numbers consecutive forwards of the
same component (the run length; ``0`` for every forward under an index-free policy,
`policies.index_free`, which serves every forward that starts from the same residency alike),
``entry`` is what the device holds when it starts, and ``next`` is the component that followed this
step last time, so a policy can prefetch across a switch. `init_steps` and `next_step` are optax-style:
the state is a frozen `StepState` and each call returns the new one.
"""

from __future__ import annotations

import attrs

from torchferry.policies._ir import Placement, Step
from torchferry.topology import FrozenMap

__all__ = ["MAX_FOLLOWS", "StepState", "init_steps", "next_step", "step_failed", "step_fields", "step_name"]

#: Follow-ups remembered (oldest dropped first): a model called in a loop counts forwards without end.
MAX_FOLLOWS = 512


@attrs.frozen(kw_only=True, slots=True)
class StepState:
    """The step that ran last (``(component, run index)``; ``None``: a run starts with the next
    forward) and what followed each ``(component, run index)`` last time when that was another
    component (a step absent from ``follows`` was followed by its own component, or never ran)."""

    last: tuple[str, int] | None = None
    follows: FrozenMap[tuple[str, int], str | None] = attrs.field(factory=FrozenMap)

    @property
    def index(self) -> int:
        """The run index of the step that ran last (``-1`` when a run starts with the next forward)."""
        return -1 if self.last is None else self.last[1]


def init_steps() -> StepState:
    """The state before the first forward."""
    return StepState()


def step_name(step: Step) -> str:
    """``component#index``, the step's name in messages."""
    return f"{step.component or '(pipeline)'}#{step.index}"


def next_step(
    state: StepState, component: str, entry: tuple[Placement, ...], *, index_free: bool
) -> tuple[Step, StepState]:
    """The step a forward of ``component`` starting from ``entry`` is, and the state after it.

    Its run index is one past the last step's when that was of the same component, else 0; the last
    step learns that ``component`` followed it.
    """
    index, after, state = step_fields(state, component, index_free=index_free)
    return Step(component=component, index=index, entry=entry, next=after), state


def step_fields(state: StepState, component: str, *, index_free: bool) -> tuple[int, str | None, StepState]:
    """`next_step`'s ``Step.index`` and ``Step.next`` (the step has ``component`` and its entry
    besides), and the state after it: a caller that keeps the `Step` objects it made finds a steady
    step's among them without building one (which costs more than this whole function)."""
    last = state.last
    index = last[1] + 1 if last is not None and last[0] == component else 0
    follows = state.follows
    after = None if last is None or last[0] == component else component
    # A step followed by its own component (``None``) is not stored: a missing key reads as ``None``,
    # so a component called in a loop (a DiT per denoising step) copies no table at its steps.
    if last is not None and follows.get(last) != after:
        table = dict(follows.items())  # in C (`FrozenMap.items` is the dict's view)
        if after is None:
            del table[last]
        else:
            if last not in table and len(table) >= MAX_FOLLOWS:
                table.pop(next(iter(table)))
            table[last] = after
        follows = FrozenMap(table)
    key = (component, index)
    return 0 if index_free else index, follows.get(key), StepState(last=key, follows=follows)


def step_failed(state: StepState) -> StepState:
    """A step failed: the next forward starts a new run (its index is 0); what followed what is kept."""
    return attrs.evolve(state, last=None)
