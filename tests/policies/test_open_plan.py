"""The open planner on facts given, not read: the default device budget, a device sharing host
memory, the refusals it raises before anything moves, whether the store pins, and auto's candidates
(one rule for a session and for `torchferry plan`)."""

from __future__ import annotations

import attrs
import pytest
from policy_plans import plan, ring_plan

from torchferry import PlanError, policies
from torchferry.topology import Block, Component, Dequantized, Stack, TensorSpec

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
    with pytest.raises(PlanError) as caught:
        policies.open_plan(p, policies.Facts())
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
        policies.open_plan(ring_plan(8, 64 * MIB, host_memory_bytes=64 * MIB), policies.Facts(), spill=True)
    assert small.value.message("cli") == (
        "--host-memory 64.0 MiB is too small for this plan: even with packs read from the checkpoint (the "
        "file tier) its host buffers need 144.0 MiB (2 staging slots of 64.0 MiB, the largest pack read; "
        "16.0 MiB of read buffers; 0 B of packs in host memory); pass --host-memory 144.0MiB or more"
    )
    assert small.value.message("api").endswith("; raise host_memory= to 144.0 MiB")
    locked = policies.HostFacts(locked_bytes=256 * MIB, locked_source="RLIMIT_MEMLOCK", pins_locked=True)
    cuda = policies.DeviceFacts(type="cuda", free_bytes=8 * GIB)  # only a CUDA device's store pins
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
