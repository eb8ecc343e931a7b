"""tiers: which packs stay in the checkpoint under a host budget, and the schedules that read them."""

from __future__ import annotations

import re

import attrs
import pytest
from policy_plans import ParallelLayout, component, model_plan, plan, ring_plan, stack

from torchferry import PlanError, policies
from torchferry.policies import Slot, Step
from torchferry.topology import Component, Plan

MIB = 1 << 20
GIB = 1 << 30
BLOCK = 16 * MIB
BOUNCE = policies.READ_BOUNCE_BYTES
T = "transformer"


def _blocks(prefix: str, *indices: int) -> set[str]:
    return {f"{prefix}.blocks.{i}" for i in indices}


def _staging(nbytes: int) -> tuple[Slot, ...]:
    return (Slot(name="t0", nbytes=nbytes, kind="staging"), Slot(name="t1", nbytes=nbytes, kind="staging"))


def test_no_budget_or_enough_of_it_means_no_file_tier() -> None:
    """Without a host budget, or with one the whole store fits, nothing is read: schedules are as before."""
    streamed = (T, "transformer_2", "text_encoder")
    bare = model_plan("wan2.2-t2v-a14b", stream=streamed)
    roomy = model_plan("wan2.2-t2v-a14b", stream=streamed, host_memory_bytes=1 << 40)
    for p in (bare, roomy):
        t = policies.tiers(p)
        assert (t.file, t.staging, t.host_bytes == t.store_bytes) == (frozenset(), (), True)
    step = Step(component=T, next="transformer_2")
    assert policies.layerwise(2)(roomy, step) == policies.layerwise(2)(bare, step)
    assert bare.digest == roomy.digest


def test_remainder_first_then_the_last_blocks() -> None:
    """Under a 96 MiB budget the remainder (read once a session) and blocks 5, 4, 3 leave host memory."""
    p = ring_plan(6, BLOCK, rest=BLOCK, host_memory_bytes=96 * MIB)
    t = policies.tiers(p)
    assert t.file == {"transformer:rest"} | _blocks(T, 3, 4, 5)
    assert t.staging == _staging(BLOCK)
    assert (t.store_bytes, t.host_bytes) == (3 * BLOCK, 3 * BLOCK + 2 * BLOCK + BOUNCE)
    assert t.host_bytes == 96 * MIB
    assert dict(t.read_bytes.items()) == {"session": BLOCK, "call": 0, "forward": 3 * BLOCK}
    assert t.notes == (
        "host 96.0 MiB of 96.0 MiB: 3 packs pinned (48.0 MiB), 2 staging slots of 16.0 MiB, "
        "16.0 MiB read buffers",
        "file tier: 4 packs read from the checkpoint, 48.0 MiB every DiT forward, 16.0 MiB once a session",
    )


def test_encoder_blocks_go_before_dit_blocks_and_two_dits_share() -> None:
    """Encoder blocks (read once a call) leave before DiT blocks; two DiTs give up their last ones in turn."""
    dit = component(T, "dit", 0, [stack(T, "blocks", [BLOCK] * 3)])
    dit2 = component("transformer_2", "dit", 0, [stack("transformer_2", "blocks", [BLOCK] * 3)])
    enc = component("text_encoder", "encoder", 0, [stack("text_encoder", "blocks", [BLOCK] * 2)])
    # 8 packs (128 MiB) under 96: 32 MiB slots and 16 MiB buffers leave 48 MiB, 3 packs, for the store.
    p = plan([dit, dit2, enc], host_memory_bytes=96 * MIB)
    t = policies.tiers(p)
    assert t.file == _blocks("text_encoder", 0, 1) | _blocks(T, 1, 2) | _blocks("transformer_2", 2)
    assert dict(t.read_bytes.items()) == {"session": 0, "call": 2 * BLOCK, "forward": 3 * BLOCK}


def test_a_large_remainder_stays_when_its_slot_would_cost_more() -> None:
    """A 64 MiB remainder would need 64 MiB staging slots, more than it frees: the blocks go instead."""
    p = ring_plan(4, BLOCK, rest=4 * BLOCK, host_memory_bytes=112 * MIB)
    t = policies.tiers(p)
    assert t.file == _blocks(T, 0, 1, 2, 3)
    assert t.staging == _staging(BLOCK)
    assert t.host_bytes == 4 * BLOCK + 2 * BLOCK + BOUNCE


def test_a_budget_nothing_fits_is_refused_with_the_least_it_could_take() -> None:
    """Even with every pack in the file tier, two 16 MiB slots and the read buffers need 48 MiB."""
    p = ring_plan(3, BLOCK, host_memory_bytes=40 * MIB)
    with pytest.raises(PlanError) as caught:
        policies.tiers(p)
    assert str(caught.value) == (
        f"host budget 40.0 MiB (config.host_memory_bytes) is too small for plan {p.digest}: even with "
        "packs read from the checkpoint (the file tier) its host buffers need 48.0 MiB (2 staging slots of "
        "16.0 MiB, the largest pack read; 16.0 MiB of read buffers; 0 B of packs in host memory); raise "
        "host_memory= to 48.0 MiB"
    )
    with pytest.raises(PlanError, match=re.escape("too small for plan")):
        policies.layerwise(1)(p, Step(component=T))


def _whole(*found: Component, **config: object) -> Plan:
    """The plan `resolve` makes of a topology that found ``found`` with their blocks."""
    from torchferry.topology import OffloadConfig, Topology, resolve

    return resolve(Topology(pipeline_class="TestPipeline", components=found), OffloadConfig(**config))  # type: ignore[arg-type]


def test_a_whole_component_pack_names_the_remedy() -> None:
    """A plan that keeps a component whole says which pack makes the slots large and how to stream it;
    the least it names is the whole store in host memory (128 MiB), less than the file tier's 272 MiB."""
    p = _whole(
        component(T, "dit", 0, [stack(T, "blocks", [BLOCK] * 8)]), strategy="none", host_memory_bytes=64 * MIB
    )
    with pytest.raises(PlanError) as caught:
        policies.tiers(p)
    assert str(caught.value).endswith(
        "raise host_memory= to 128.0 MiB, or stream the blocks of 'transformer' (strategy='layerwise') so "
        "the largest pack read is a block, not transformer:rest (128.0 MiB)"
    )
    opens = attrs.evolve(p, config=attrs.evolve(p.config, host_memory_bytes=128 * MIB))
    assert not policies.tiers(opens).file


def test_a_text_encoder_left_out_of_the_selection_names_the_selection_that_streams_it() -> None:
    """Under a session's default selection (the DiT alone) a text encoder is kept whole: when its pack
    is the largest, the remedy names the selection that streams it too, in each wording."""
    dit = component(T, "dit", BLOCK, [stack(T, "blocks", [BLOCK] * 4)])
    encoder = component("text_encoder", "encoder", 0, [stack("text_encoder", "layers", [BLOCK] * 8)])
    p = _whole(dit, encoder, strategy="layerwise", host_memory_bytes=64 * MIB)
    with pytest.raises(policies.HostBudgetTooSmall) as caught:
        policies.tiers(p)
    assert caught.value.select == ("dit", "text_encoder")
    assert "or stream the blocks of 'text_encoder' (strategy='layerwise', components={'dit', " in str(
        caught.value
    )
    assert "(--strategy layerwise --components dit,text_encoder)" in caught.value.message("cli")
    # A VAE the request selects without a lifecycle to stage it is left out of the suggestion.
    with_vae = attrs.evolve(p, config=attrs.evolve(p.config, components=frozenset({"dit", "vae"})))
    with pytest.raises(policies.HostBudgetTooSmall) as vae:
        policies.tiers(with_vae)
    assert vae.value.select == ("dit", "text_encoder")
    chosen = attrs.evolve(p, config=attrs.evolve(p.config, components=frozenset({"dit", "text_encoder"})))
    with pytest.raises(policies.HostBudgetTooSmall) as again:
        policies.tiers(chosen)  # selected, yet still kept whole (its blocks undeclared): no selection to name
    assert again.value.select == ()


def test_shards_count_and_read_as_shards() -> None:
    """Under distributed layerwise a pack is this rank's shard: it counts, and is read, as the shard."""
    layout = ParallelLayout(data_parallel_size=4)
    p = ring_plan(8, BLOCK, strategy="distributed_layerwise", parallel=layout, host_memory_bytes=28 * MIB)
    t = policies.tiers(p)
    shard = BLOCK // 4
    assert t.file == _blocks(T, 1, 2, 3, 4, 5, 6, 7)
    assert t.staging == _staging(shard)
    assert t.host_bytes == shard + 2 * shard + BOUNCE
    policy = policies.distributed_layerwise(1)
    first = policy(p, Step(component=T))
    steady = policy(p, Step(component=T, index=1, entry=first.exit))
    for s in (first, steady):
        policies.check(s, p)
    reads = [op for op in steady.ops if op.kind == "read"]
    assert {(op.src, op.nbytes) for op in reads} == {("shard", shard)}
    # Shards under 4 MiB take read buffers as large as a shard, not 16 MiB.
    budget = 2 * MIB - 4096  # under the 2 MiB of shards: 7 of them go to the file tier
    small = ring_plan(8, MIB, strategy="distributed_layerwise", parallel=layout, host_memory_bytes=budget)
    t = policies.tiers(small)
    assert t.staging == _staging(MIB // 4) and t.file
    assert t.host_bytes == t.store_bytes + 2 * (MIB // 4) + policies.read_buffer_bytes(MIB // 4)
    assert policies.read_buffer_bytes(MIB // 4) == 2 * (MIB // 4 + 2 * policies.DIRECT_ALIGN)
    loads = [op for op in steady.ops if op.kind == "load" and op.src not in (None, "shard")]
    assert {(op.slot, op.src, op.nbytes) for op in loads} <= {
        ("h0", "t0", shard),
        ("h1", "t0", shard),
        ("h0", "t1", shard),
        ("h1", "t1", shard),
    }
    assert len(loads) == len(reads) == 7


def test_ring_reads_ahead_into_alternating_slots() -> None:
    """The steady ring reads each file block one anchor ahead of its load, t0 and t1 in turn, and
    reads and stages the remainder at the component's start."""
    p = ring_plan(6, BLOCK, rest=BLOCK, host_memory_bytes=96 * MIB)
    policy = policies.layerwise(1)
    first = policy(p, Step(component=T))
    steady = policy(p, Step(component=T, index=1, entry=first.exit))
    policies.check(steady, p)
    text = policies.format_schedule(steady, sim=False)
    moves = [line.split()[:8] for line in text.splitlines() if line.split()[3:4] in (["read"], ["load"])]
    assert moves == [
        ["before", "transformer.blocks.0", "copy", "load", "transformer.blocks.1", "->", "s1", "16.0"],
        ["before", "transformer.blocks.0", "io", "read", "transformer.blocks.3", "->", "t0", "16.0"],
        ["before", "transformer.blocks.1", "copy", "load", "transformer.blocks.2", "->", "s0", "16.0"],
        ["before", "transformer.blocks.2", "copy", "load", "transformer.blocks.3", "->", "s1", "from"],
        ["before", "transformer.blocks.2", "io", "read", "transformer.blocks.4", "->", "t1", "16.0"],
        ["before", "transformer.blocks.3", "copy", "load", "transformer.blocks.4", "->", "s0", "from"],
        ["before", "transformer.blocks.3", "io", "read", "transformer.blocks.5", "->", "t0", "16.0"],
        ["before", "transformer.blocks.4", "copy", "load", "transformer.blocks.5", "->", "s1", "from"],
        ["before", "transformer.blocks.5", "copy", "load", "transformer.blocks.0", "->", "s0", "16.0"],
    ]
    assert "# file: transformer.blocks.{3,4,5} transformer:rest" in text.splitlines()
    cold = [line.split()[:8] for line in policies.format_schedule(first, sim=False).splitlines()[:18]]
    assert ["before", "transformer", "io", "read", "transformer:rest", "->", "t0", "16.0"] in cold
    assert ["before", "transformer", "copy", "stage", "transformer:rest", "from", "t0", "16.0"] in cold


@pytest.mark.parametrize("strategy", ["layerwise", "distributed_layerwise"])
@pytest.mark.parametrize("budget_gib", [32, 16, 6])
def test_every_step_of_a_generation_checks(strategy: str, budget_gib: int) -> None:
    """Wan2.2 under host budgets from half the model down: every step of a generation passes check and
    round-trips, ring and whole-component policies alike, and every read is drained in its step."""
    extra = {"parallel": ParallelLayout(data_parallel_size=4)} if strategy == "distributed_layerwise" else {}
    p = model_plan(
        "wan2.2-t2v-a14b",
        stream=(T, "transformer_2", "text_encoder"),
        strategy=strategy,
        host_memory_bytes=budget_gib * GIB,
        **extra,
    )
    order = [("text_encoder", T), (T, T), (T, "transformer_2"), ("transformer_2", "vae"), ("vae", None)]
    ring = policies.builtin(strategy, depth=2, resident=["transformer.blocks.39"])
    for policy in (ring, policies.none(), policies.model_level()):
        entry: tuple[policies.Placement, ...] = ()
        for index, (component_, nxt) in enumerate(order):
            s = policy(p, Step(component=component_, index=index, entry=entry, next=nxt))
            policies.check(s, p)
            assert policies.parse_schedule(policies.format_schedule(s)) == s
            assert set(s.file) == policies.tiers(p).file
            entry = s.exit


def test_read_buffers_are_as_large_as_the_largest_pack_read_up_to_16_mib() -> None:
    """Bounce buffers each the largest pack's span aligned out at both ends, one per chunk in flight: a
    small model's file tier takes no more than it reads; packs of 4 MiB and over take 16 MiB."""
    threads, align = policies.READ_THREADS, policies.DIRECT_ALIGN
    assert policies.read_buffer_bytes(0) == 0
    # A pack read in one chunk: one buffer for each of the two staging slots' reads in flight.
    assert policies.read_buffer_bytes(1) == 2 * policies.page_bytes(3 * align)
    assert policies.read_buffer_bytes(100 * 1024) == 2 * policies.page_bytes(100 * 1024 + 2 * align)
    # Packs read in two chunks or more: one buffer per reader thread, each the largest.
    assert policies.bounce_count(4 * MIB) == threads == 4
    assert policies.read_buffer_bytes(BLOCK) == policies.read_buffer_bytes(GIB) == BOUNCE == 16 * MIB
    small = ring_plan(8, MIB, host_memory_bytes=7 * MIB)
    t = policies.tiers(small)  # 8 MiB of blocks in a 7 MiB budget: 16 MiB of buffers could never fit
    assert t.file and t.staging[0].nbytes == MIB
    assert t.host_bytes == t.store_bytes + 2 * MIB + policies.read_buffer_bytes(MIB) <= 7 * MIB
