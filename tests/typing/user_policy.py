"""An example user policy: a function built by a factory that mypy strict accepts as a `Policy`.

It keeps the first ``keep`` blocks of every ring resident and streams the rest with `layerwise`,
by wrapping a built-in policy rather than subclassing anything.
"""

from __future__ import annotations

import attrs

from torchferry import policies
from torchferry.policies import Policy, Schedule, Step
from torchferry.topology import Plan


def keep_leading(keep: int, depth: int = 1) -> Policy:
    """Layerwise streaming with the first ``keep`` blocks of every stack kept on the device."""

    def keep_leading_policy(plan: Plan, step: Step, /) -> Schedule:
        resident = [b.path for c in plan.components for s in c.stacks for b in s.blocks[:keep]]
        schedule = policies.layerwise(depth, resident)(plan, step)
        return attrs.evolve(schedule, policy=f"keep_leading(keep={keep}, depth={depth})")

    return keep_leading_policy


POLICY: Policy = keep_leading(2)
CACHED: Policy = policies.cached(keep_leading(2))
DECLARED: policies.Declared = policies.declare(keep_leading(2), name="keep_leading(keep=2)", index_free=True)
AS_POLICY: Policy = DECLARED
BUILTIN: Policy = policies.builtin("layerwise", depth=2)
