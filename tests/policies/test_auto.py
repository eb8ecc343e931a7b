"""auto: the acceptance cases on real shapes, and an exhaustive search on a small instance."""

from __future__ import annotations

import itertools
import re

import pytest
from policy_plans import model_plan, ring_plan

from torchferry import ScheduleError, policies
from torchferry.policies import CostModel, Step
from torchferry.topology import Plan

GB = 10**9
# An RTX 4090-class device: 24 GB, ~150 TFLOP/s achieved bf16, PCIe Gen4 at 25 GB/s.
DEVICE_FLOPS = 150e12


def block_flops(params: int, tokens: int, dim: int) -> float:
    """Linear FLOPs 2*T*params plus attention 4*T^2*dim for one block's forward."""
    return 2.0 * tokens * params + 4.0 * tokens * tokens * dim


def image_cost(plan: Plan, tokens: int, dim: int) -> CostModel:
    """Per-block compute for a DiT at ``tokens`` tokens, from each block's bf16 bytes."""
    flops = {b.path: block_flops(b.nbytes // 2, tokens, dim) for c in plan.components for b in c.blocks}
    return CostModel(h2d_bytes_per_s=25 * GB, device_flops_per_s=DEVICE_FLOPS, flops=flops)


def _steady(policy: policies.Policy, plan: Plan, cost: CostModel | None = None) -> float:
    from torchferry.policies._auto import steady_step_s

    return steady_step_s(policy, plan, cost or policies.DEFAULT_COST, ["transformer"])[0]


@pytest.mark.parametrize(("model", "tokens"), [("qwen-image", 4096 + 256), ("flux.1-dev", 4096 + 512)])
def test_auto_beats_every_leading_resident_choice(model: str, tokens: int) -> None:
    """At 1024x1024, 24 GB and 25 GB/s, auto is no slower than the best leading-resident ring."""
    plan = model_plan(model, stream=("transformer", "text_encoder"))
    cost = image_cost(plan, tokens, 3072)
    choice = policies.choose(plan, 24 * GB, cost)
    pool = [b.path for b in plan.component("transformer").blocks]
    best_leading = min(
        _steady(policies.layerwise(d, pool[:r]), plan, cost)
        for d in (1, 2, 3, 4)
        for r in range(0, len(pool) + 1, 4)
        if policies._auto.footprint(plan, d, pool[:r]) <= 24 * GB
    )
    assert choice.footprint <= 24 * GB
    assert choice.step_s <= best_leading * (1 + 1e-9)
    schedule = policies.auto(24 * GB, cost)(plan, Step(component="transformer"))
    assert schedule.notes[0].startswith("auto chose layerwise(depth=")
    policies.check(schedule, plan)


def test_auto_within_two_percent_of_exhaustive() -> None:
    """On 8 transfer-bound blocks, auto is within 2% of the best (depth, resident set) there is."""
    mib = 1 << 20
    plan = ring_plan(8, mib)
    cost = CostModel(h2d_bytes_per_s=mib / 0.004, block_s=0.002)
    budget = 6 * mib
    choice = policies.choose(plan, budget, cost)
    pool = [f"transformer.blocks.{i}" for i in range(8)]
    best = min(
        _steady(policies.layerwise(d, subset), plan, cost)
        for d in (1, 2, 3)
        for r in range(0, 9)
        for subset in itertools.combinations(pool, r)
        if policies._auto.footprint(plan, d, subset) <= budget
    )
    assert choice.step_s <= best * 1.02


def test_auto_streams_wan_at_depth_one() -> None:
    """Wan 2.2 at 720p hides every transfer: depth 1, nothing resident, overhead under 1%."""
    plan = model_plan("wan2.2-t2v-a14b", stream=("transformer", "transformer_2", "text_encoder"))
    flops = {b.path: 163e12 for c in plan.components for b in c.blocks}
    cost = CostModel(h2d_bytes_per_s=25 * GB, device_flops_per_s=DEVICE_FLOPS, flops=flops)
    choice = policies.choose(plan, 24 * GB, cost)
    assert (choice.depth, choice.resident) == (1, ())
    assert choice.step_s / choice.resident_step_s - 1 < 0.01


def test_auto_explains_when_nothing_fits() -> None:
    """A budget below the smallest ring is a ScheduleError saying what is needed."""
    plan = ring_plan(4, 1 << 20)
    message = (
        f"auto(budget=1.0 MiB (1048576)): even depth 1 with no resident blocks needs 2.0 MiB (2097152) "
        f"on plan {plan.digest}; raise the budget to at least that"
    )
    with pytest.raises(ScheduleError, match=re.escape(message)):
        policies.auto(1 << 20)(plan, Step(component="transformer"))


def test_auto_swaps_whole_models_when_the_ring_is_transfer_bound() -> None:
    """FLUX.1-dev at 24 GB over a slow link: model-level swapping, amortised over a call, beats any ring."""
    plan = model_plan("flux.1-dev", stream=("transformer", "text_encoder", "text_encoder_2"))
    slow = CostModel(h2d_bytes_per_s=2 * GB, block_s=0.002, forwards_per_call=50)
    choice = policies.choose(plan, 24 * GB, slow)
    assert choice.strategy == "model_level"
    swapped = sum(c.nbytes for c in plan.components if c.selected and c.kind in ("dit", "encoder"))
    assert choice.step_s == pytest.approx(choice.resident_step_s + swapped / (2 * GB) / 50)
    schedule = policies.auto(24 * GB, slow)(plan, Step(component="transformer"))
    assert schedule.notes[0].startswith("auto chose model_level(): footprint")
    policies.check(schedule, plan)
    fast = CostModel(h2d_bytes_per_s=25 * GB, block_s=0.05, forwards_per_call=50)
    assert policies.choose(plan, 24 * GB, fast).strategy == "layerwise"


def test_the_choice_says_what_it_picked_and_predicts_a_step() -> None:
    """choose() takes the budget as text, and its Choice carries the budget, the step and a reason."""
    mib = 1 << 20
    plan = ring_plan(8, mib)
    cost = CostModel.calibrated(h2d_bytes_per_s=mib / 0.004, block_s=0.002, forwards_per_step=2)
    choice = policies.choose(plan, "6MiB", cost)
    assert choice == policies.choose(plan, 6 * mib, cost)
    assert (choice.budget, choice.forwards_per_step) == (6 * mib, 2)
    assert choice.predicted_step_s == pytest.approx(2 * choice.step_s)
    assert choice.reason == choice.explain()
    assert choice.reason == (
        f"{choice.policy().name}: the fastest of {choice.candidates} simulated candidates that fit "
        f"(footprint {policies.format_bytes(choice.footprint, exact=False)} of 6.0 MiB); forward "
        f"{choice.step_s:.4f} s vs all-resident {choice.resident_step_s:.4f} s "
        f"(+{choice.overhead * 100:.2f}%), x2 forwards = {choice.predicted_step_s:.4f} s per step"
    )


def test_host_cost_per_op_moves_the_choice_toward_fewer_ops() -> None:
    """Where transfers hide, a host cost per op makes a ring with more resident blocks (fewer ops) win."""
    mib = 1 << 20
    plan = ring_plan(8, mib)
    free = CostModel.calibrated(h2d_bytes_per_s=mib / 0.001, block_s=0.002)
    costly = CostModel.calibrated(h2d_bytes_per_s=mib / 0.001, block_s=0.002, host_op_s=0.001)
    assert policies.choose(plan, "6MiB", free).resident == ()
    assert len(policies.choose(plan, "6MiB", costly).resident) > 0


def test_reads_slower_than_compute_make_auto_keep_file_blocks_resident() -> None:
    """With blocks 3-7 read from the file at 12 ms each over 3 ms computes, auto keeps file-tier blocks
    on the device first (read once a session, not every forward), and its step beats leading ones."""
    mib = 1 << 20
    block = 16 * mib
    plan = ring_plan(8, block, host_memory_bytes=96 * mib)
    assert policies.tiers(plan).file == {f"transformer.blocks.{i}" for i in range(3, 8)}
    cost = CostModel(h2d_bytes_per_s=block / 0.002, block_s=0.003, read_bytes_per_s=block / 0.012)
    choice = policies.choose(plan, 6 * block, cost)
    assert (choice.strategy, choice.depth, choice.placement) == ("layerwise", 1, "file-first")
    assert choice.resident == tuple(f"transformer.blocks.{i}" for i in (4, 5, 6, 7))
    leading = _steady(policies.layerwise(1, [f"transformer.blocks.{i}" for i in range(4)]), plan, cost)
    assert choice.step_s == pytest.approx(0.029)
    assert choice.step_s < leading
    # The same plan without a host budget reads nothing: auto keeps nothing resident (transfers hide).
    bare = policies.choose(ring_plan(8, block), 6 * block, cost)
    assert (bare.resident, bare.step_s) == ((), pytest.approx(0.024))


def test_auto_schedule_notes_say_the_host_tier() -> None:
    """auto's schedule carries the file tier's notes after its own, and reads what tiers put in the file."""
    mib = 1 << 20
    plan = ring_plan(8, 16 * mib, host_memory_bytes=96 * mib)
    schedule = policies.auto(96 * mib)(plan, Step(component="transformer"))
    policies.check(schedule, plan)
    assert schedule.notes[-2:] == policies.tiers(plan).notes
    assert set(schedule.file) == policies.tiers(plan).file
