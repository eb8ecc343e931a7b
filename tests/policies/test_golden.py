"""Golden schedules for real model shapes: the canonical text under each policy, kept in tests/golden/."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from policy_plans import ParallelLayout, model_plan

from torchferry import policies
from torchferry.policies import CostModel, Schedule, Step
from torchferry.topology import Plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
ACCEPT = "python -m pytest tests/policies/test_golden.py --update-golden"
#: Golden files other tests own (tests/test_public_api.py: the public surface).
OTHER_GOLDENS = {"public_api.txt"}
GB = 10**9
MIB = 1 << 20
GIB = 1 << 30


def _steps(plan: Plan, policy: policies.Policy, steps: list[Step]) -> Schedule:
    """The schedule of the last step, each step entering with the previous one's exit."""
    schedule: Schedule | None = None
    for step in steps:
        entry = schedule.exit if schedule is not None else step.entry
        schedule = policy(plan, Step(component=step.component, index=step.index, entry=entry, next=step.next))
        policies.check(schedule, plan)
    assert schedule is not None
    return schedule


def _wan(**config: object) -> Plan:
    return model_plan("wan2.2-t2v-a14b", stream=("transformer", "transformer_2", "text_encoder"), **config)


def _flux(**config: object) -> Plan:
    return model_plan("flux.1-dev", stream=("transformer", "text_encoder_2"), **config)


def _qwen(**config: object) -> Plan:
    return model_plan("qwen-image", stream=("transformer",), **config)


T, T2 = "transformer", "transformer_2"
_DIST4 = {"strategy": "distributed_layerwise", "parallel": ParallelLayout(data_parallel_size=4)}
_DIST8 = {
    "strategy": "distributed_layerwise",
    "parallel": ParallelLayout(data_parallel_size=8),
}
_QWEN_COST = CostModel(h2d_bytes_per_s=25 * GB, block_s=0.021)

CASES: dict[str, Callable[[], Schedule]] = {
    "wan2.2-a14b/layerwise-d1-encoder-to-expert1": lambda: _steps(
        _wan(),
        policies.layerwise(1),
        [Step(component="text_encoder", next=T), Step(component=T, index=1, next=T)],
    ),
    "wan2.2-a14b/layerwise-d1-expert1-to-expert2": lambda: _steps(
        _wan(), policies.layerwise(1), [Step(component=T, next=T2), Step(component=T, index=1, next=T2)]
    ),
    "wan2.2-a14b/layerwise-d2-expert2-after-switch": lambda: _steps(
        _wan(), policies.layerwise(2), [Step(component=T, next=T2), Step(component=T2, index=1)]
    ),
    "wan2.2-a14b/layerwise-d1-expert2-to-vae": lambda: _steps(
        _wan(), policies.layerwise(1), [Step(component=T2, next="vae"), Step(component="vae", index=1)]
    ),
    "wan2.2-a14b/model-level-encoder-to-expert1": lambda: _steps(
        _wan(strategy="model_level"),
        policies.model_level(),
        [Step(component="text_encoder"), Step(component=T, index=1)],
    ),
    "wan2.2-a14b/distributed-d1-world4-expert1": lambda: _steps(
        _wan(**_DIST4), policies.distributed_layerwise(1), [Step(component=T)]
    ),
    # A host-limited machine: a 32 GiB host holds 30 of Wan2.2's 64 GiB; the rest is read from the
    # checkpoint (the file tier) into two staging slots, one anchor ahead of each load.
    "wan2.2-a14b/layerwise-d1-host32G-expert1-to-expert2": lambda: _steps(
        _wan(host_memory_bytes=32 * GIB),
        policies.layerwise(1),
        [Step(component=T, next=T), Step(component=T, index=1, next=T2)],
    ),
    "wan2.2-a14b/layerwise-d2-host32G-encoder-to-expert1": lambda: _steps(
        _wan(host_memory_bytes=32 * GIB),
        policies.layerwise(2),
        [Step(component="text_encoder", next=T)],
    ),
    "wan2.2-a14b/distributed-d1-world4-host8G-expert1": lambda: _steps(
        _wan(**_DIST4, host_memory_bytes=8 * GIB), policies.distributed_layerwise(1), [Step(component=T)]
    ),
    "flux.1-dev/layerwise-d1": lambda: _steps(_flux(), policies.layerwise(1), [Step(component=T)]),
    "flux.1-dev/layerwise-d2-steady": lambda: _steps(
        _flux(), policies.layerwise(2), [Step(component=T), Step(component=T, index=1)]
    ),
    "flux.1-dev/distributed-d2-world8-chunk64M": lambda: _steps(
        _flux(**_DIST8), policies.distributed_layerwise(2, chunk_bytes=64 * MIB), [Step(component=T)]
    ),
    "qwen-image/none": lambda: _steps(_qwen(strategy="none"), policies.none(), [Step(component=T)]),
    "qwen-image/layerwise-d1": lambda: _steps(_qwen(), policies.layerwise(1), [Step(component=T)]),
    "qwen-image/layerwise-d3-head4-steady": lambda: _steps(
        model_plan("qwen-image", resident_head=4),
        policies.layerwise(3),
        [Step(component=T), Step(component=T, index=1)],
    ),
    "qwen-image/auto-24GB-steady": lambda: _steps(
        model_plan("qwen-image", stream=(T, "text_encoder")),
        policies.auto(24 * GB, _QWEN_COST),
        [Step(component=T), Step(component=T, index=1)],
    ),
    "qwen-image/auto-12GB-steady": lambda: _steps(
        model_plan("qwen-image", stream=(T, "text_encoder")),
        policies.auto(12 * GB, _QWEN_COST),
        [Step(component=T), Step(component=T, index=1)],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_schedule(name: str, golden: Callable[[str, str, str], None]) -> None:
    """The schedule's canonical text matches tests/golden/<name>.txt (and parses back to itself)."""
    schedule = CASES[name]()
    text = policies.format_schedule(schedule)
    assert policies.parse_schedule(text) == schedule
    golden(f"{name}.txt", text, ACCEPT)


def test_no_orphaned_golden_files() -> None:
    """Every tests/golden/**/*.txt file belongs to a case here."""
    known = {f"{name}.txt" for name in CASES} | OTHER_GOLDENS
    orphans = sorted(
        str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*.txt") if str(p.relative_to(GOLDEN)) not in known
    )
    assert orphans == [], f"orphaned golden files (delete them or add a case): {orphans}"
