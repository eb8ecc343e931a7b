"""The host planner on facts given, not read: the budget's arithmetic, the refusals' least budgets,
packs that cannot be in the file tier, read frequencies by policy, and a device sharing host memory
(the cases of the issue on one host planner, each a figure a user was told wrong)."""

from __future__ import annotations

import attrs
import pytest
from policy_plans import component, plan, ring_plan, stack

from torchferry import PlanError, ScheduleError, policies
from torchferry.topology import Block, Plan, Stack, StoreFacts, TensorSpec

MIB = 1 << 20
BLOCK = 4 * MIB
T = "transformer"


def _budget(p: Plan, nbytes: int) -> Plan:
    return attrs.evolve(p, config=attrs.evolve(p.config, host_memory_bytes=nbytes))


def _opens(p: Plan, nbytes: int) -> bool:
    try:
        policies.tiers(_budget(p, nbytes))
    except policies.HostBudgetTooSmall:
        return False
    return True


def _rope_plan(n: int, **config: object) -> Plan:
    """A DiT of ``n`` 4 MiB blocks, each with a 16 KiB non-persistent buffer (as RoPE tables are)."""
    blocks = []
    for i in range(n):
        weight = TensorSpec(name=f"{T}.blocks.{i}.weight", shape=(BLOCK // 2,), dtype="bfloat16")
        name = f"{T}.blocks.{i}.freqs"
        freqs = TensorSpec(name=name, shape=(4096,), dtype="float32", buffer=True, persistent=False)
        blocks.append(Block(path=f"{T}.blocks.{i}", tensors=[weight, freqs]))
    return plan([component(T, "dit", 0, [Stack(attrs=("blocks",), blocks=blocks)])], **config)


def test_a_refusal_names_the_given_budget_and_a_least_that_opens() -> None:
    """Case 1: the refusal says the budget as given (not one lowered for kept buffers), and the least it
    names opens while one byte less is refused, kept buffers of file-tier packs counted."""
    p = _rope_plan(8, host_memory_bytes=23 * MIB)
    with pytest.raises(policies.HostBudgetTooSmall) as caught:
        policies.tiers(p)
    refused = caught.value
    assert refused.budget == 23 * MIB
    assert str(refused).startswith("host budget 23.0 MiB (config.host_memory_bytes)")
    assert refused.kept > 0
    assert _opens(p, refused.minimum) and not _opens(p, refused.minimum - 1)
    opened = policies.tiers(_budget(p, refused.minimum))
    assert opened.host_bytes == refused.minimum and opened.kept_bytes == refused.kept


@pytest.mark.parametrize("strategy", ["none", "model_level"])
def test_a_component_kept_whole_asks_for_the_whole_store_not_more(strategy: str) -> None:
    """Case 2: under none/model_level the least is every pack in host memory, which the file tier
    (staging slots as large as the whole component) cannot beat."""
    dit = component(T, "dit", 8 * BLOCK)
    enc = component("text_encoder", "encoder", 2 * BLOCK)
    p = plan([dit, enc], strategy=strategy, host_memory_bytes=20 * MIB)
    with pytest.raises(policies.HostBudgetTooSmall) as caught:
        policies.tiers(p)
    assert caught.value.minimum == 10 * BLOCK and not caught.value.file_tier
    assert _opens(p, 10 * BLOCK) and not _opens(p, 10 * BLOCK - 1)


def test_the_reserve_is_kept_when_the_pipelines_weights_are_credited() -> None:
    """Case 3: 95 MiB free in a cgroup, 252.9 MiB of the pipeline's own weights credited and a 256 MiB
    reserve: the budget is 95 + 252.9 - 256 = 91.9 MiB, not 0 + 252.9, and its source adds up."""
    bound = policies.Bound(what="cgroup v1 memory /x", available=95 * MIB, source="memory.limit_in_bytes ...")
    weights = 265_187_738  # 252.9 MiB
    budget = policies.machine_budget(policies.HostFacts(bounds=(bound,)), weights)
    assert budget.bytes == 95 * MIB + weights - policies.RESERVE_MIN
    assert budget.source == (
        "cgroup v1 memory /x 95.0 MiB (memory.limit_in_bytes ...), plus 252.9 MiB of the pipeline's own "
        "weights the store takes over, less a reserve of 256.0 MiB"
    )
    empty = policies.machine_budget(policies.HostFacts(bounds=(bound,)), 0)
    assert empty.bytes == 0


def test_kept_buffers_are_counted_as_packs_are_chosen() -> None:
    """Case 4: the tiers count each file-tier pack's kept buffers as they choose, so the figure proven
    is the whole figure (no budget lowered after the fact) and stays within the budget."""
    p = _rope_plan(8, host_memory_bytes=26 * MIB)
    t = policies.tiers(p)
    assert t.file and t.kept_bytes == len(t.file) * policies.page_bytes(4096 * 4)
    assert t.host_bytes <= 26 * MIB
    assert t.host_bytes == policies.host_bytes(p, t.file, t.staging)[0]


def test_packs_in_storage_dtype_are_never_in_the_file_tier() -> None:
    """Case 5: a pack held in storage_dtype= is read back only in its own dtypes, so tiers keep it in
    host memory; with nothing else to file, the refusal says why and names drop storage_dtype=."""
    spec = TensorSpec(name=f"{T}.blocks.0.weight", shape=(BLOCK,), dtype="float8_e4m3fn",
                      compute_dtype="bfloat16")  # fmt: skip
    cast = Block(path=f"{T}.blocks.0", tensors=[spec])
    dit = component(T, "dit", 0, [Stack(attrs=("blocks",), blocks=[cast])])
    enc = component("text_encoder", "encoder", 0, [stack("text_encoder", "blocks", [4 * BLOCK] * 6)])
    p = plan([dit, enc], host_memory_bytes=80 * MIB)
    t = policies.tiers(p)
    assert t.file and f"{T}.blocks.0" not in t.file
    with pytest.raises(policies.HostBudgetTooSmall, match=r"or drop storage_dtype=$"):
        policies.tiers(plan([dit], host_memory_bytes=MIB))


def test_none_reads_nothing_after_its_first_call() -> None:
    """Case 6: none() keeps every weight on the device once staged, so on a layerwise plan with a file
    tier it reads every file-tier byte once a session, not every forward."""
    p = ring_plan(8, BLOCK, host_memory_bytes=30 * MIB)
    t = policies.tiers(p)
    streaming = policies.policy_reads(policies.layerwise(1), p, t)[T]
    kept = policies.policy_reads(policies.none(), p, t)[T]
    assert streaming["forward"] > 0
    assert kept == {"forward": 0, "call": 0, "session": sum(streaming.values())}


def test_a_component_given_by_keyword_leaves_the_others_to_the_file_tier() -> None:
    """Case 7: an 80 KiB vae= given by keyword (its own weights) stays in host memory, and the
    transformer's blocks go to the file tier instead of the budget being refused."""
    dit = component(T, "dit", 0, [stack(T, "blocks", [BLOCK] * 8)])
    vae = component("vae", "vae", 80 << 10)
    p = plan([dit, vae], host_memory_bytes=28 * MIB)
    mine = attrs.evolve(p, facts=StoreFacts(own=frozenset({"vae"})))
    t = policies.tiers(mine)
    assert t.file and all(name.startswith(f"{T}.blocks.") for name in t.file)
    assert t.host_bytes <= 28 * MIB


def test_a_cpu_device_and_the_host_share_one_budget() -> None:
    """Issue 38 item 9: on a device sharing host memory, one budget (the machine's, or host_memory=)
    holds both: the device its least (depth 1), the host the rest, or the host every pack and the
    device the rest; a budget too small names one figure, the least of both, which opens while one
    byte less is refused, so the remedy leads to no second refusal."""
    bound = policies.Bound(what="cgroup v1 memory /x", available=768 * MIB, source="limit")
    facts = policies.HostFacts(bounds=(bound,))
    p = ring_plan(8, 64 * MIB, checkpoint="ckpt")  # 512 MiB of weights in the checkpoint
    least = policies.least_device_bytes(p)
    assert least == 128 * MIB  # two ring slots of a block at depth 1
    policies.choose(p, least, policies.DEFAULT_COST)
    with pytest.raises(ScheduleError):
        policies.choose(p, least - 1, policies.DEFAULT_COST)
    figure = policies.host_plan(p, facts, shared=True)
    machine = 768 * MIB - policies.RESERVE_MIN
    assert figure.device_bytes == least and figure.budget.bytes == machine - least
    assert figure.tiers.file and figure.tiers.host_bytes <= machine - least
    said = "the least the device's schedules need, 128.0 MiB, of the host budget"
    assert figure.device_source.startswith(said)
    whole = policies.tiers(p).host_bytes  # no budget: every pack in host memory
    roomy = policies.host_plan(_budget(p, whole + 200 * MIB), facts, shared=True)
    assert not roomy.tiers.file and roomy.device_bytes == 200 * MIB
    with pytest.raises(policies.HostBudgetTooSmall) as caught:
        policies.host_plan(_budget(p, 200 * MIB), facts, shared=True)
    refused = caught.value
    assert refused.budget == 200 * MIB and refused.device == least
    assert "128.0 MiB for the device, whose memory is host memory, at its least" in str(refused)
    opened = policies.host_plan(_budget(p, refused.minimum), facts, shared=True)
    assert opened.device_bytes == least and opened.tiers.host_bytes <= refused.minimum - least
    with pytest.raises(policies.HostBudgetTooSmall):
        policies.host_plan(_budget(p, refused.minimum - 1), facts, shared=True)
    assert policies.host_plan(p, facts).device_bytes is None


def test_a_measured_budget_plans_once() -> None:
    """Issue 39 item 5: two opens whose free memory differs by a few bytes plan one plan: a measured
    host budget that binds is carried as the least budget choosing the same tiers, a measured device
    share is rounded down to its grain, and what was measured stays in the figure's budget."""
    p = ring_plan(8, 64 * MIB, checkpoint="ckpt")
    figures = []
    for available in (700 * MIB, 700 * MIB + 4099):
        bound = policies.Bound(what="MemAvailable", available=available, source="x")
        facts = policies.HostFacts(bounds=(bound,))
        figures.append((policies.host_plan(p, facts), policies.host_plan(p, facts, shared=True)))
    (host, shared), (host2, shared2) = figures
    assert host.budget.bytes != host2.budget.bytes and host.plan == host2.plan and host.tiers.file
    assert host.plan.config.host_memory_bytes == host.tiers.least_budget <= host.budget.bytes
    assert policies.tiers(host.plan).file == policies.tiers(_budget(p, host.budget.bytes or 0)).file
    assert shared.plan == shared2.plan and shared.device_bytes == shared2.device_bytes
    roomy = policies.HostFacts(bounds=(policies.Bound(what="MemAvailable", available=64 << 30, source="x"),))
    most = policies.whole_device_bytes(p)
    assert policies.host_plan(p, roomy, shared=True).device_bytes == most  # more would choose the same
    assert policies.settled(20_937_965_568 + 5_000_000) == policies.settled(20_937_965_568) == 20_937_965_568


def test_zero_budget_and_locked_memory_are_refused_with_their_sources() -> None:
    """No memory left after the reserve, or pinned bytes over RLIMIT_MEMLOCK, is a PlanError naming why."""
    tight = policies.Bound(what="MemAvailable", available=100 * MIB, source="/proc/meminfo MemAvailable")
    with pytest.raises(PlanError, match=r"^the host budget is 0 B \(MemAvailable 100\.0 MiB"):
        policies.host_plan(ring_plan(2, BLOCK), policies.HostFacts(bounds=(tight,)))
    locked = policies.HostFacts(locked_bytes=MIB, locked_source="RLIMIT_MEMLOCK 1.0 MiB", pins_locked=True)
    with pytest.raises(PlanError, match=r"^torchferry would pin 8\.0 MiB of host memory, over the locked"):
        policies.host_plan(ring_plan(2, BLOCK, host_memory_bytes=64 * MIB), locked)


def test_check_proves_pinned_bytes_against_the_locked_memory_limit() -> None:
    """[10]: a schedule whose pinned host bytes exceed the plan's locked-memory fact is refused by check."""
    p = ring_plan(2, BLOCK)
    schedule = policies.layerwise(1)(p, policies.Step(component=T))
    policies.check(schedule, attrs.evolve(p, facts=StoreFacts(locked_bytes=2 * BLOCK)))
    with pytest.raises(ScheduleError, match=r"\[10\] pinned host bytes reach 8\.0 MiB"):
        policies.check(schedule, attrs.evolve(p, facts=StoreFacts(locked_bytes=BLOCK)))


def test_the_read_mode_is_a_pure_decision() -> None:
    """Direct I/O when the file tier's files outgrow what the page cache keeps, unless a mode is forced;
    an unknown mode is a PlanError naming the three."""
    assert policies.read_direct(2 * MIB, MIB) and not policies.read_direct(MIB, 2 * MIB)
    assert not policies.read_direct(2 * MIB, None)
    assert policies.read_direct(MIB, 2 * MIB, "direct") and not policies.read_direct(2 * MIB, MIB, "buffered")
    with pytest.raises(PlanError, match=r"^TORCHFERRY_READ='fast' is no read mode; set it to direct, buff"):
        policies.read_direct(MIB, MIB, "fast")


def test_the_read_mode_is_read_once_and_checked_when_planning() -> None:
    """The read mode in the facts is the one the figure carries for the file tier, and a mode no reader
    knows is refused by the host planner when there is a file tier, before anything is read."""
    p = ring_plan(8, 64 * MIB, checkpoint="ckpt", host_memory_bytes=400 * MIB)
    assert policies.host_plan(p, policies.HostFacts(read_mode="direct")).read_mode == "direct"
    with pytest.raises(PlanError, match=r"^TORCHFERRY_READ='fast' is no read mode"):
        policies.host_plan(p, policies.HostFacts(read_mode="fast"))
    whole = _budget(p, 1 << 40)  # no file tier: the mode is never used, so not refused
    assert policies.host_plan(whole, policies.HostFacts(read_mode="fast")).read_mode == "fast"


def test_a_file_tier_with_nothing_to_read_it_from_is_refused_in_either_words() -> None:
    """A budget that leaves packs in the file tier of a pipeline built in memory (no checkpoint) is a
    PlanError from the host planner itself, worded with keywords or flags, naming spill, the checkpoint
    and a host budget that opens; with a spill or a checkpoint the same budget plans a file tier."""
    p = _rope_plan(8, host_memory_bytes=26 * MIB)
    with pytest.raises(PlanError) as caught:
        policies.host_plan(p, policies.HostFacts())
    whole = policies.tiers(_budget(p, 1 << 40)).host_bytes
    tail = (
        "in the file tier, read on demand from a checkpoint, and this pipeline is built in memory with "
        "no checkpoint; pass {spill} (those packs are written there once as safetensors and read back), "
        "{ckpt}, or raise {host} to " + policies.format_bytes(whole) + " so every pack stays in host memory"
    )
    api = tail.format(
        spill="spill=<a folder>", ckpt="open it from its checkpoint (checkpoint=, or from_pretrained)",
        host="host_memory=",
    )  # fmt: skip
    cli = tail.format(
        spill="--spill", ckpt="plan its checkpoint (a pipeline folder or file as MODEL)", host="--host-memory"
    )
    head = "the host budget of 26.0 MiB (given as host_memory=) leaves "
    assert caught.value.message("api").startswith(head)
    assert caught.value.message("api").endswith(api)
    assert caught.value.message("cli").startswith("the host budget of 26.0 MiB (given as --host-memory) ")
    assert caught.value.message("cli").endswith(cli)
    assert "(transformer.blocks.0, transformer.blocks.1, transformer.blocks.2, ...)" in str(caught.value)
    assert not policies.host_plan(_budget(p, whole), policies.HostFacts()).tiers.file  # the figure opens
    assert policies.host_plan(p, policies.HostFacts(), spill=True).tiers.file
    with_files = attrs.evolve(p, config=attrs.evolve(p.config, checkpoint="ckpt"))
    assert policies.host_plan(with_files, policies.HostFacts()).tiers.file
