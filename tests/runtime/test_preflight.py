"""Preflight: host bytes over the budget, and pinned bytes over a locked-memory limit that binds the
pinner, are PlanErrors naming the bytes, the budget's source and the remedies."""

from __future__ import annotations

import re

import attrs
import pytest

from torchferry import PlanError, policies, topology
from torchferry.runtime.machine._host_facts import HostBudget, given_budget
from torchferry.runtime.store._preflight import HostPlan, preflight
from torchferry.testing import toy


def _plan(budget: int | None = None) -> topology.Plan:
    pipe = toy.build(0, hidden=512)
    config = topology.OffloadConfig(strategy="layerwise", host_memory_bytes=budget)
    return topology.resolve(topology.discover(pipe), config)


def test_over_the_budget_names_bytes_source_and_remedies() -> None:
    """Host buffers the tiers chose plus what they leave out, over the budget: one PlanError with the
    figures, where the budget came from, and what to do."""
    whole = policies.tiers(_plan()).host_bytes
    plan = _plan(int(whole * 0.6))
    chosen = policies.tiers(plan)
    budget = HostBudget(
        bytes=chosen.host_bytes - 1, source="cgroup v2 /job 2.0 GiB (/sys/...) less a reserve"
    )
    with pytest.raises(PlanError) as info:
        preflight(plan, HostPlan(budget=budget, cache_bytes=None), pin=False, memlock=False)
    text = str(info.value)
    assert text.startswith("torchferry would hold ")
    assert "over the host budget of " in text and "(cgroup v2 /job 2.0 GiB (/sys/...) less a reserve)" in text
    assert "remedies: pass a larger host_memory= if the machine has it;" in text
    fits = HostBudget(bytes=chosen.host_bytes + (1 << 20), source="given", given=True)
    assert preflight(plan, HostPlan(budget=fits, cache_bytes=None), pin=False, memlock=False) == chosen


def test_locked_memory_limit_binds_only_a_pinner_subject_to_it() -> None:
    """Pinned bytes over RLIMIT_MEMLOCK are refused where the pinner is subject to it (remedy
    pin_memory=False); the CUDA pinner is not (the NVIDIA driver pins with pin_user_pages)."""
    plan = _plan()
    chosen = policies.tiers(plan)
    budget = attrs.evolve(
        given_budget(chosen.host_bytes * 2),
        locked_bytes=1 << 20,
        locked_source="RLIMIT_MEMLOCK 1.0 MiB (ulimit -l)",
    )
    host = HostPlan(budget=budget, cache_bytes=None)
    message = "over the locked-memory limit of 1.0 MiB (RLIMIT_MEMLOCK 1.0 MiB (ulimit -l)); raise it"
    with pytest.raises(PlanError, match=re.escape(message)):
        preflight(plan, host, pin=True, memlock=True)
    assert preflight(plan, host, pin=True, memlock=False) == chosen
    assert preflight(plan, host, pin=False, memlock=True) == chosen
