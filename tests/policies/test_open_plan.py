"""The open planner on facts given, not read: the default device budget, a device sharing host
memory, the refusals it raises before anything moves, whether the store pins, and auto's candidates
(one rule for a session and for `torchferry plan`)."""

from __future__ import annotations

import attrs
import pytest
from policy_plans import plan, ring_plan

from torchferry import PlanError, ScheduleError, policies
from torchferry.topology import Block, Component, Dequantized, Plan, Stack, TensorSpec

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


def _dequantizing(**config: object) -> policies.Plan:
    """A ring whose blocks each hold a Q8_0 weight of 64x256 dequantized to float32 (98,304 bytes)."""
    block, size = 32, 34
    specs = [
        TensorSpec(name=f"transformer.blocks.{i}.q.weight", shape=(64, 256 // block * size), dtype="uint8",
                   dequantized=Dequantized(quant_type="Q8_0", numel=64 * 256, dtype="float32"))
        for i in range(4)
    ]  # fmt: skip
    blocks = [Block(path=f"transformer.blocks.{i}", tensors=[s]) for i, s in enumerate(specs)]
    dit = Component(path="transformer", kind="dit", stacks=[Stack(attrs=("blocks",), blocks=blocks)])
    return plan([dit], **config)


def test_the_dequantize_reserve_comes_off_the_budget_after_it_is_settled() -> None:
    """Issue 39 (S3): the budget is settled first (given, the default, or a shared device's share) and
    the largest dequantized weight comes off it last, the source saying both."""
    reserve = 64 * 256 * 6
    given = policies.open_plan(_dequantizing(device_memory_bytes=GIB), policies.Facts(), auto=True)
    assert given.plan.config.device_memory_bytes == GIB - reserve
    assert given.device_source == "given, less 96.0 KiB (98304) for the largest dequantized weight"
    cuda = policies.Facts(device=policies.DeviceFacts(type="cuda", free_bytes=80 * GIB))
    free = policies.open_plan(_dequantizing(), cuda, auto=True)
    default, source = policies.default_device_budget(cuda.device)
    assert free.plan.config.device_memory_bytes == default - reserve
    assert free.device_source == f"{source}, less 96.0 KiB (98304) for the largest dequantized weight"
    bound = policies.Bound(what="cgroup v2 memory /x", available=512 * MIB, source="limit")
    shared = policies.open_plan(
        _dequantizing(checkpoint="ckpt"), policies.Facts(host=policies.HostFacts(bounds=(bound,))), auto=True
    )
    assert shared.plan.config.device_memory_bytes == shared.host.device_bytes - reserve
    assert shared.device_source == (
        f"{shared.host.device_source}, less 96.0 KiB (98304) for the largest dequantized weight"
    )


def test_every_open_time_refusal_in_full() -> None:
    """Each refusal open_plan makes, whole, in the API's words and the command line's: a file tier
    with nothing to read it from, a host budget too small for any tiering, pinned bytes over the
    locked-memory limit, no host memory left at all, a read mode no reader knows."""
    p = ring_plan(8, 64 * MIB, host_memory_bytes=300 * MIB)
    cuda = policies.DeviceFacts(type="cuda", free_bytes=8 * GIB)  # a device with staging slots
    with pytest.raises(PlanError) as caught:
        policies.open_plan(p, policies.Facts(device=cuda))
    # 8 blocks of 64 MiB in 300 MiB: 2 packs, 2 staging slots and 16 MiB of read buffers stay.
    said = (
        "the host budget of 300.0 MiB (given as {host}) leaves 6 pack(s) (transformer.blocks.2, "
        "transformer.blocks.3, transformer.blocks.4, ...) in the file tier, read on demand from a "
        "checkpoint, and this pipeline is built in memory with no checkpoint; pass {spill} (those packs "
        "are written there once as safetensors and read back), {ckpt}, or raise {host} to 512.0 MiB "
        "(536870912) so every pack stays in host memory"
    )
    assert caught.value.message("api") == said.format(
        host="host_memory=",
        spill="spill=<a folder>",
        ckpt="open it from its checkpoint (checkpoint=, or from_pretrained)",
    )
    assert caught.value.message("cli") == said.format(
        host="--host-memory", spill="--spill", ckpt="plan its checkpoint (a pipeline folder or file as MODEL)"
    )
    with pytest.raises(policies.HostBudgetTooSmall) as small:
        policies.open_plan(
            ring_plan(8, 64 * MIB, host_memory_bytes=64 * MIB), policies.Facts(device=cuda), spill=True
        )
    assert small.value.message("cli") == (
        "--host-memory 64.0 MiB is too small for this plan: even with packs read from the checkpoint (the "
        "file tier) its host buffers need 144.0 MiB (2 staging slots of 64.0 MiB, the largest pack read; "
        "16.0 MiB of read buffers; 0 B of packs in host memory); pass --host-memory 144.0MiB or more"
    )
    assert small.value.message("api").endswith("; raise host_memory= to 144.0 MiB")
    locked = policies.HostFacts(locked_bytes=256 * MIB, locked_source="RLIMIT_MEMLOCK", pins_locked=True)
    with pytest.raises(PlanError) as pinned:
        pinning = policies.Facts(host=locked, device=cuda)
        policies.open_plan(ring_plan(8, 64 * MIB, host_memory_bytes=GIB), pinning)
    assert pinned.value.message("api") == (
        "torchferry would pin 512.0 MiB of host memory, over the locked-memory limit of 256.0 MiB "
        "(RLIMIT_MEMLOCK); raise it (ulimit -l, or the container's memlock limit), pass "
        "pin_memory=False, or lower host_memory= so fewer bytes are pinned"
    )
    assert pinned.value.message("cli").endswith("or lower --host-memory so fewer bytes are pinned")
    bound = policies.Bound(what="cgroup v2 memory /x", available=100 * MIB, source="limit")
    with pytest.raises(PlanError) as none_left:  # 100 MiB less the 256 MiB reserve
        policies.open_plan(ring_plan(8, 64 * MIB), policies.Facts(host=policies.HostFacts(bounds=(bound,))))
    assert none_left.value.message("cli") == (
        "the host budget is 0 B (cgroup v2 memory /x 100.0 MiB (limit) less a reserve of 256.0 MiB): no "
        "host memory is left for torchferry's buffers; free host memory (close other processes or "
        "sessions), raise the memory cgroup's limit, or pass --host-memory to name what torchferry may hold"
    )
    odd = policies.Facts(host=policies.HostFacts(read_mode="sometimes"))
    with pytest.raises(PlanError) as mode:
        policies.open_plan(ring_plan(8, 64 * MIB, host_memory_bytes=300 * MIB, checkpoint="ckpt"), odd)
    assert str(mode.value) == (
        "TORCHFERRY_READ='sometimes' is no read mode; set it to direct, buffered or auto, or unset it"
    )


def test_the_read_mode_is_the_one_read_and_checked_only_with_a_file_tier() -> None:
    """The host figure carries the read mode as read; a mode no reader knows is refused only where a
    file tier would read in it."""
    tiered = ring_plan(8, 64 * MIB, host_memory_bytes=300 * MIB, checkpoint="ckpt")
    for mode in ("direct", "buffered", "auto"):
        facts = policies.Facts(host=policies.HostFacts(read_mode=mode))
        assert policies.open_plan(tiered, facts).host.read_mode == mode
    odd = policies.Facts(host=policies.HostFacts(read_mode="sometimes"))
    assert not policies.open_plan(ring_plan(8, 64 * MIB, host_memory_bytes=GIB), odd).host.tiers.file


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
