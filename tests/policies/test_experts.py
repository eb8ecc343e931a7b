"""choose on a two-expert pipeline (Wan 2.2 A14B): a forward is one expert's, as a denoising step runs."""

from __future__ import annotations

import json
import re

import pytest
from policy_plans import model_plan

from torchferry import policies
from torchferry.cli import main
from torchferry.policies import CostModel
from torchferry.topology import Plan

GB = 10**9
EXPERTS = ("transformer", "transformer_2")


def wan_plan() -> Plan:
    """Wan 2.2 A14B with both experts and the text encoder streaming."""
    return model_plan("wan2.2-t2v-a14b", stream=(*EXPERTS, "text_encoder"))


def forward_s(choice: policies.Choice, plan: Plan, cost: CostModel, expert: str) -> float:
    """The simulated steady forward of ``expert`` under the chosen policy."""
    return policies.simulate(policies.steady_schedule(choice.policy(), plan, expert), cost).makespan_s


def per_step(reason: str) -> float:
    """The per-step seconds a why-line ends with (``x2 forwards = N s per step``)."""
    found = re.search(r"x\d+ forwards = ([0-9.]+) s per step$", reason)
    assert found is not None, reason
    return float(found.group(1))


@pytest.mark.parametrize("host", [(), ("--host-memory", "32GiB", "--spill")])
def test_plan_why_line_per_step_is_the_table_step_for_two_experts(
    capsys: pytest.CaptureFixture[str], host: tuple[str, ...]
) -> None:
    """`torchferry plan wan2.2-t2v-a14b`'s why-line gives the step its table shows, not twice it."""
    assert main(["plan", "wan2.2-t2v-a14b", "--device-memory", "24GiB", *host, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (auto,) = [r for r in doc["strategies"] if r["strategy"] == "auto"]
    assert auto["step_s"] > 0
    assert per_step(auto["reason"]) == pytest.approx(auto["step_s"], abs=1e-4)


def test_a_two_expert_forward_is_one_experts_steady_forward() -> None:
    """At 720p and 24 GB both experts stream alike; the choice's forward is either one's, not their sum."""
    plan = wan_plan()
    flops = {b.path: 163e12 for c in plan.components for b in c.blocks}
    cost = CostModel(h2d_bytes_per_s=25 * GB, device_flops_per_s=150e12, flops=flops, forwards_per_step=2)
    choice = policies.choose(plan, 24 * GB, cost)
    one = forward_s(choice, plan, cost, "transformer")
    assert one == pytest.approx(40 * 163e12 / 150e12)
    assert choice.step_s == pytest.approx(one)
    assert choice.predicted_step_s == pytest.approx(2 * one)
    assert dict(choice.forward_s) == pytest.approx(dict.fromkeys(EXPERTS, one))
    assert "(one of transformer, transformer_2; a step runs one)" in choice.reason
    assert per_step(choice.reason) == pytest.approx(2 * one, abs=1e-4)


def test_experts_that_differ_are_each_named_and_averaged() -> None:
    """With an odd count of resident blocks the experts' forwards differ: the why-line names each, and
    the choice's forward is their mean (each is its own simulated steady forward)."""
    plan = wan_plan()
    cost = CostModel(h2d_bytes_per_s=5 * GB, block_s=0.05, forwards_per_call=80, forwards_per_step=2)
    choice = policies.choose(plan, 28 * GB, cost)
    each = {e: forward_s(choice, plan, cost, e) for e in EXPERTS}
    assert each["transformer"] != pytest.approx(each["transformer_2"])
    assert dict(choice.forward_s) == pytest.approx(each)
    assert choice.step_s == pytest.approx(sum(each.values()) / 2)
    named = ", ".join(f"{e} {t:.4f} s" for e, t in each.items())
    assert f"forward {choice.step_s:.4f} s (the mean of {named}; a step runs one)" in choice.reason


def test_two_experts_stream_where_a_summed_forward_would_swap_whole_models() -> None:
    """At 40 GB over 5 GB/s a ring with resident blocks beats model-level swapping per forward; scored
    against both experts' forwards summed, the swap (spread over the call) would have won."""
    plan = wan_plan()
    cost = CostModel(h2d_bytes_per_s=5 * GB, block_s=0.05, forwards_per_call=80, forwards_per_step=2)
    choice = policies.choose(plan, 40 * GB, cost)
    assert choice.strategy == "layerwise"
    assert choice.resident
    swapped = [c for c in plan.components if c.selected and c.kind in ("dit", "encoder")]
    swap = sum(c.nbytes for c in swapped) / (5 * GB) / 80
    resident = 40 * 0.05
    assert choice.resident_step_s == pytest.approx(resident)
    # One forward: the ring is faster than the resident forward plus the swap's share...
    assert choice.step_s < resident + swap
    # ...but twice the ring's overhead (both experts counted in one forward) exceeds the swap's share.
    assert 2 * (choice.step_s - resident) > swap
