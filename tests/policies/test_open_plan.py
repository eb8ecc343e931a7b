"""The open planner on facts given, not read: the default device budget, a device sharing host
memory, the refusals it raises before anything moves, whether the store pins, and auto's candidates
(one rule for a session and for `torchferry plan`)."""

from __future__ import annotations

import attrs
import pytest
from policy_plans import ring_plan

from torchferry import PlanError, policies

MIB = 1 << 20
GIB = 1 << 30


def test_the_default_device_budget_is_free_memory_less_the_margin_settled() -> None:
    """A CUDA device's free memory less max(10%, 1 GiB), rounded down to its grain; a CPU with no free
    figure gets the 8 GiB default; a budget given is kept as given."""
    free = 80 * GIB + 12345
    budget, source = policies.default_device_budget(policies.DeviceFacts(type="cuda", free_bytes=free))
    assert budget == policies.settled(free - int(free * 0.1)) <= free - 8 * GIB
    assert source == "free device memory at open 80.0 GiB minus 8.0 GiB for activations, rounded down"
    small = policies.default_device_budget(policies.DeviceFacts(type="cuda", free_bytes=4 * GIB))[0]
    assert small == 3 * GIB  # the margin is at least 1 GiB
    assert policies.default_device_budget(policies.DeviceFacts())[0] == policies.CPU_BUDGET
    cuda = policies.Facts(device=policies.DeviceFacts(type="cuda", free_bytes=free))
    opened = policies.open_plan(ring_plan(4, 64 * MIB), cuda, auto=True)
    assert opened.plan.config.device_memory_bytes == budget and opened.device_source == source
    given = policies.open_plan(ring_plan(4, 64 * MIB, device_memory_bytes=GIB), cuda, auto=True)
    assert given.plan.config.device_memory_bytes == GIB and given.device_source == "given"


def test_a_cpu_device_takes_its_share_of_the_one_host_budget() -> None:
    """Auto on the CPU with no device budget: the device's share of the host's one budget, its source
    in words; a named strategy or a CUDA device takes none."""
    bound = policies.Bound(what="cgroup v1 memory /x", available=768 * MIB, source="limit")
    facts = policies.Facts(host=policies.HostFacts(bounds=(bound,)))
    p = ring_plan(8, 64 * MIB, checkpoint="ckpt")
    opened = policies.open_plan(p, facts, auto=True)
    least = policies.least_device_bytes(p)
    assert opened.plan.config.device_memory_bytes == least == opened.host.device_bytes
    assert opened.device_source.startswith("the least the device's schedules need, 128.0 MiB, of the host")
    assert opened.host.tiers.file and not opened.pin
    assert policies.open_plan(p, facts).host.device_bytes is None
    cuda = attrs.evolve(facts, device=policies.DeviceFacts(type="cuda", free_bytes=8 * GIB))
    assert policies.open_plan(p, cuda, auto=True).host.device_bytes is None


def test_every_open_time_refusal_comes_from_the_open_planner() -> None:
    """A file tier with nothing to read it from and a host budget too small are refused by open_plan,
    worded for either caller; a spill makes the first open."""
    p = ring_plan(8, 64 * MIB, host_memory_bytes=300 * MIB)
    with pytest.raises(PlanError) as caught:
        policies.open_plan(p, policies.Facts())
    assert "pass --spill (those packs" in caught.value.message("cli")
    assert "pass spill=<a folder> (those packs" in caught.value.message("api")
    assert policies.open_plan(p, policies.Facts(), spill=True).host.tiers.file
    with pytest.raises(policies.HostBudgetTooSmall):
        policies.open_plan(ring_plan(8, 64 * MIB, host_memory_bytes=64 * MIB), policies.Facts(), spill=True)


def test_pinning_and_candidates_follow_one_rule() -> None:
    """The store pins on CUDA only (when pin_memory is on); auto weighs layerwise, and the distributed
    strategy only over more than one rank, for a session and for plan alike."""
    p = ring_plan(2, MIB, device_memory_bytes=GIB)
    cuda = policies.Facts(device=policies.DeviceFacts(type="cuda", free_bytes=8 * GIB))
    assert policies.open_plan(p, cuda).pin and not policies.open_plan(p, policies.Facts()).pin
    unpinned = attrs.evolve(p, config=attrs.evolve(p.config, pin_memory=False))
    assert not policies.open_plan(unpinned, cuda).pin
    assert policies.open_plan(p, cuda, auto=True).candidates == ("layerwise",)
    both = ("layerwise", "distributed_layerwise")
    assert policies.open_plan(p, cuda, auto=True, world=2).candidates == both
    assert policies.open_plan(p, cuda).candidates == ()


def test_a_cpu_refusal_for_want_of_a_spill_names_a_figure_that_opens() -> None:
    """On the CPU the host budget is one memory with the device's: the figure a pipeline built in
    memory is told to raise host_memory= to counts the device's share too, and opens."""
    p = ring_plan(8, 64 * MIB, host_memory_bytes=400 * MIB)
    with pytest.raises(PlanError) as caught:
        policies.open_plan(p, policies.Facts(), auto=True)
    whole = policies.tiers(ring_plan(8, 64 * MIB)).host_bytes + policies.least_device_bytes(p)
    assert f"or raise host_memory= to {policies.format_bytes(whole)} so every pack" in str(caught.value)
    bigger = attrs.evolve(p, config=attrs.evolve(p.config, host_memory_bytes=whole))
    opened = policies.open_plan(bigger, policies.Facts(), auto=True)
    assert not opened.host.tiers.file
    assert opened.plan.config.device_memory_bytes == policies.least_device_bytes(p)
