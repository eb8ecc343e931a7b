"""The budgets the runtime tests compare: the machine's facts as read under a (fake) ``/proc``, given to
the policy that decides from them (`policies.machine_budget`, `policies.given_budget`)."""

from __future__ import annotations

import os

import attrs

from torchferry import policies
from torchferry.runtime.machine._host_facts import host_facts, locked_limit


def host_budget(
    *,
    proc: str | os.PathLike[str] = "/proc",
    reserve_fraction: float = policies.RESERVE_FRACTION,
    reserve_min: int = policies.RESERVE_MIN,
) -> policies.HostBudget:
    """The machine's host budget now: the facts read under ``proc``, less the reserve."""
    facts = attrs.evolve(host_facts(proc=proc), reserve_fraction=reserve_fraction, reserve_min=reserve_min)
    return policies.machine_budget(facts)


def given_budget(nbytes: int) -> policies.HostBudget:
    """The budget a caller names (``host_memory=``), with this process's locked-memory limit."""
    locked, why = locked_limit()
    return policies.given_budget(nbytes, policies.HostFacts(locked_bytes=locked, locked_source=why))
