"""What the runtime's preflight once proved at open, decided by the open planner on facts given: the
locked-memory limit binds only a store that pins with a pinner held to it, the budget a rank offers a
process group, and host bytes within the budget the figure names."""

from __future__ import annotations

import re

import attrs
import pytest
from policy_plans import ring_plan

from torchferry import PlanError, policies

MIB = 1 << 20
GIB = 1 << 30
BLOCK = 4 * MIB

WHY = "RLIMIT_MEMLOCK 1.0 MiB (ulimit -l)"
LOCKED = policies.HostFacts(locked_bytes=MIB, locked_source=WHY, pins_locked=True)
CUDA = policies.DeviceFacts(type="cuda", free_bytes=8 * GIB)


def test_the_locked_memory_limit_binds_a_store_that_pins_with_a_pinner_held_to_it() -> None:
    """Pinned bytes over RLIMIT_MEMLOCK are refused in full, worded in keywords or flags, only when the
    store pins (pin_memory on a CUDA device) and its pinner is held to the limit."""
    p = ring_plan(2, BLOCK, host_memory_bytes=64 * MIB)
    with pytest.raises(PlanError) as caught:
        policies.open_plan(p, policies.Facts(host=LOCKED, device=CUDA))
    said = (
        "torchferry would pin 8.0 MiB of host memory, over the locked-memory limit of 1.0 MiB "
        "(RLIMIT_MEMLOCK 1.0 MiB (ulimit -l)); raise it (ulimit -l, or the container's memlock limit), "
        "pass pin_memory=False, or lower {} so fewer bytes are pinned"
    )
    assert caught.value.message("api") == said.format("host_memory=")
    assert caught.value.message("cli") == said.format("--host-memory")
    assert not policies.open_plan(p, policies.Facts(host=LOCKED)).pin  # a CPU device: nothing pinned
    unpinned = attrs.evolve(p, config=attrs.evolve(p.config, pin_memory=False))
    assert not policies.open_plan(unpinned, policies.Facts(host=LOCKED, device=CUDA)).pin
    free = attrs.evolve(LOCKED, pins_locked=False)  # CUDA's pinner (pin_user_pages) is not charged to it
    assert policies.open_plan(p, policies.Facts(host=free, device=CUDA)).pin


def test_a_rank_offers_its_given_budget_else_the_machine_s_credited_with_its_own_weights() -> None:
    """The budget a rank offers its group is host_memory= when given, else the machine's tightest bound
    less the reserve, plus the pipeline's own bytes only when the store copies them (no checkpoint)."""
    bound = policies.Bound(what="MemAvailable", available=GIB, source="/proc/meminfo")
    facts = policies.HostFacts(bounds=(bound,), module_bytes=100 * MIB)
    given = policies.offered_budget(ring_plan(2, BLOCK, host_memory_bytes=64 * MIB), facts)
    assert (given.bytes, given.source, given.given) == (64 * MIB, "given as host_memory=", True)
    copied = policies.offered_budget(ring_plan(2, BLOCK), facts)
    assert copied.bytes == GIB + 100 * MIB - 256 * MIB and copied.credit == 100 * MIB
    read = policies.offered_budget(ring_plan(2, BLOCK, checkpoint="ckpt"), facts)
    assert read.bytes == GIB - 256 * MIB and read.credit == 0
    least = policies.host_plan(ring_plan(2, BLOCK, checkpoint="ckpt"), facts, least=32 * MIB).budget
    assert least.bytes == 32 * MIB
    assert least.source == "another rank's host budget, 32.0 MiB, the least of the group"


def test_the_host_figure_holds_within_its_budget_and_names_its_source() -> None:
    """Every host byte the tiers hold is within the budget (nothing is proved again at open), and they are
    the tiers of the plan the session runs; a budget too small for any tiering names the bound it came
    from."""
    p = ring_plan(8, BLOCK, checkpoint="ckpt", host_memory_bytes=30 * MIB)
    opened = policies.open_plan(p, policies.Facts())
    figure = opened.host
    assert figure.tiers.file and figure.tiers.host_bytes <= 30 * MIB
    assert figure.tiers == policies.tiers(opened.plan)  # the tiers the session hands the runtime
    tight = policies.Bound(what="cgroup v2 /job", available=300 * MIB, source="memory.max")
    named = re.escape("(cgroup v2 /job 300.0 MiB (memory.max)")
    with pytest.raises(policies.HostBudgetTooSmall, match=named):
        policies.open_plan(ring_plan(8, 64 * MIB, checkpoint="ckpt"), policies.Facts(
            host=policies.HostFacts(bounds=(tight,)), device=CUDA
        ))  # fmt: skip
