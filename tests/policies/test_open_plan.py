"""The open planner on facts given, not read: the default device budget, a device sharing host
memory, the refusals it raises before anything moves, whether the store pins, and auto's candidates
(one rule for a session and for `torchferry plan`)."""

from __future__ import annotations

import attrs
import pytest
from policy_plans import ring_plan

from torchferry import PlanError, ScheduleError, policies
from torchferry.topology import Plan

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
    cuda = policies.Facts(device=policies.DeviceFacts(type="cuda", free_bytes=8 * GIB))
    with pytest.raises(policies.HostBudgetTooSmall):
        policies.open_plan(ring_plan(8, 64 * MIB, host_memory_bytes=64 * MIB), cuda, spill=True)


def test_a_cpu_device_plans_no_staging_slot_and_a_cuda_device_two() -> None:
    """Eight 64 MiB blocks in 300 MiB of host memory: on the CPU the reader fills the device slots, so
    the plan counts no staging slot (256 MiB of packs stay in host memory, 4 in the file tier) and its
    loads read 'from file'; on CUDA two 64 MiB staging slots are counted (128 MiB of packs stay, 6
    in the file tier) and every file-tier block is read into one, then loaded from it."""
    p = ring_plan(8, 64 * MIB, host_memory_bytes=300 * MIB, device_memory_bytes=GIB, checkpoint="ckpt")
    cpu = policies.open_plan(p, policies.Facts(device=policies.DeviceFacts(type="cpu")))
    cuda = policies.open_plan(p, policies.Facts(device=policies.DeviceFacts(type="cuda", free_bytes=8 * GIB)))
    assert cpu.plan.facts.host_device and not cuda.plan.facts.host_device
    assert policies.reads_direct(cpu.plan) and not policies.reads_direct(cuda.plan)
    one, two = cpu.host.tiers, cuda.host.tiers
    assert one.staging == () and one.largest == 64 * MIB
    assert two.staging == (
        policies.Slot(name="t0", nbytes=64 * MIB, kind="staging"),
        policies.Slot(name="t1", nbytes=64 * MIB, kind="staging"),
    )
    assert (one.store_bytes, one.read_buffer_bytes, one.host_bytes) == (256 * MIB, 16 * MIB, 272 * MIB)
    assert (two.store_bytes, two.read_buffer_bytes, two.host_bytes) == (128 * MIB, 16 * MIB, 272 * MIB)
    assert (len(one.file), len(two.file)) == (4, 6)
    assert one.notes[0] == (
        "host 272.0 MiB of 300.0 MiB: 4 packs pinned (256.0 MiB), read straight into device slots, "
        "16.0 MiB read buffers"
    )
    step = policies.Step(component="transformer")
    direct = policies.layerwise(depth=1)(cpu.plan, step)
    staged = policies.layerwise(depth=1)(cuda.plan, step)
    policies.check(direct, cpu.plan)
    policies.check(staged, cuda.plan)
    loads = [(op.unit, op.src) for op in direct.ops if op.kind == "load" and op.src is not None]
    assert loads == [(f"transformer.blocks.{i}", policies.FILE) for i in (4, 5, 6, 7)]
    assert not any(op.kind == "read" for op in direct.ops)
    assert not any(s.kind == "staging" for s in direct.slots)
    assert sum(op.kind == "read" for op in staged.ops) == 6
    assert [s.name for s in staged.slots if s.kind == "staging"] == ["t0", "t1"]


def test_a_load_from_file_is_refused_where_the_device_is_not_host_memory() -> None:
    """The CPU plan's schedule checked against the same plan for a CUDA device: every load 'from
    file' is a [9] violation (no reader can write CUDA memory), as the engine refuses it at run time."""
    p = ring_plan(8, 64 * MIB, host_memory_bytes=300 * MIB, device_memory_bytes=GIB, checkpoint="ckpt")
    cpu = policies.open_plan(p, policies.Facts())
    direct = policies.layerwise(depth=1)(cpu.plan, policies.Step(component="transformer"))
    cuda = attrs.evolve(cpu.plan, facts=attrs.evolve(cpu.plan.facts, host_device=False))
    with pytest.raises(ScheduleError) as caught:
        policies.check(direct, cuda)
    text = str(caught.value)
    assert text.count("from file: the reader fills device memory itself only where it is host memory") == 4


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


def test_a_cpu_device_refusal_names_one_figure_without_staging_slots_that_opens() -> None:
    """Auto on the CPU with host_memory= too small: the refusal's one figure (the device's least and
    the host's, no staging slot among them) opens while one byte less is refused, and it is two 64 MiB
    staging slots less than on MPS, whose memory is host memory too but whose reads go through them."""
    p = ring_plan(8, 64 * MIB, checkpoint="ckpt")

    def given(nbytes: int) -> Plan:
        return attrs.evolve(p, config=attrs.evolve(p.config, host_memory_bytes=nbytes))

    def refusal(facts: policies.Facts) -> policies.HostBudgetTooSmall:
        with pytest.raises(policies.HostBudgetTooSmall) as caught:
            policies.open_plan(given(130 * MIB), facts, auto=True)
        return caught.value

    cpu, mps = policies.Facts(), policies.Facts(device=policies.DeviceFacts(type="mps"))
    refused = refusal(cpu)
    said = str(refused)
    assert "no staging slot (packs of up to 64.0 MiB read into device memory)" in said
    assert "128.0 MiB for the device, whose memory is host memory, at its least" in said
    opened = policies.open_plan(given(refused.minimum), cpu, auto=True)
    assert opened.host.tiers.staging == () and opened.plan.config.device_memory_bytes == 128 * MIB
    with pytest.raises(policies.HostBudgetTooSmall):
        policies.open_plan(given(refused.minimum - 1), cpu, auto=True)
    assert refusal(mps).minimum == refused.minimum + 2 * 64 * MIB
