"""Built-in policies: switches, rings over several stacks, and properties over random plans."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_plans import ParallelLayout, component, model_plan, plan, ring_plan, stack

from torchferry import PlanError, policies
from torchferry.policies import DEVICE, Placement, Step, rest_unit
from torchferry.topology import Plan

MIB = 1 << 20


def _kinds(schedule: policies.Schedule, kind: str) -> list[str]:
    return [op.unit for op in schedule.ops if op.kind == kind]


def test_model_level_swaps_dit_against_encoder() -> None:
    """Encoder -> DiT unstages the selected encoder, stages the DiT, keeps the unselected VAE."""
    p = plan(
        [
            component("transformer", "dit", 10 * MIB),
            component("text_encoder", "encoder", 4 * MIB),
            component("vae", "vae", MIB, selected=False),
        ],
        strategy="model_level",
    )
    policy = policies.model_level()
    enc = policy(p, Step(component="text_encoder"))
    assert _kinds(enc, "stage") == ["text_encoder", "vae"]
    dit = policy(p, Step(component="transformer", entry=enc.exit))
    assert _kinds(dit, "unstage") == ["text_encoder"]
    assert _kinds(dit, "stage") == ["transformer"]
    assert {x.unit for x in dit.exit} == {"vae", "transformer"}
    policies.check(enc, p)
    policies.check(dit, p)


def test_on_demand_component_is_acquired_and_released() -> None:
    """An on-demand encoder is acquired before its forward and released after it."""
    p = plan(
        [component("transformer", "dit", MIB), component("text_encoder", "encoder", MIB, on_demand=True)]
    )
    s = policies.layerwise(1)(p, Step(component="text_encoder"))
    assert [(op.when, op.kind, op.unit) for op in s.ops] == [
        ("before", "stage", "transformer"),
        ("before", "acquire", "text_encoder"),
        ("after", "release", "text_encoder"),
    ]
    policies.check(s, p)


def test_wan_expert_switch_prefetches_the_next_expert() -> None:
    """The high-noise pass ends with transformer_2's first blocks loaded; the next pass starts from them."""
    p = model_plan("wan2.2-t2v-a14b", stream=("transformer", "transformer_2"))
    policy = policies.layerwise(2)
    first = policy(p, Step(component="transformer", next="transformer_2"))
    loaded = sorted(x.unit for x in first.exit if x.where != DEVICE)
    assert loaded == ["transformer_2.blocks.0", "transformer_2.blocks.1"]
    second = policy(p, Step(component="transformer_2", index=1, entry=first.exit))
    assert _kinds(second, "load")[:2] == ["transformer_2.blocks.2", "transformer_2.blocks.3"]
    policies.check(first, p)
    policies.check(second, p)


def test_two_stacks_share_one_ring_with_odd_count() -> None:
    """FLUX's two block lists stream through the same depth+1 slots sized to the larger block."""
    p = model_plan("flux.1-dev")
    s = policies.layerwise(1)(p, Step(component="transformer"))
    assert [x.name for x in s.slots] == ["s0", "s1"]
    assert s.slots[0].nbytes == 679662592
    assert len(_kinds(s, "load")) == 19 + 38 + 1
    policies.check(s, p)


def test_short_ring_stays_loaded() -> None:
    """A stack no longer than depth+1 stays in its slots: the steady step loads nothing."""
    p = ring_plan(2, MIB)
    policy = policies.layerwise(3)
    first = policy(p, Step(component="transformer"))
    second = policy(p, Step(component="transformer", entry=first.exit))
    assert _kinds(second, "load") == []
    policies.check(second, p)


def test_cached_returns_the_same_schedule() -> None:
    """cached(policy) memoises by (plan, step)."""
    p = ring_plan(4, MIB)
    policy = policies.cached(policies.layerwise(1))
    assert policy(p, Step(component="transformer")) is policy(p, Step(component="transformer"))


def test_shard_nbytes() -> None:
    """Shards round ceil(n / world) up to a multiple of 16 bytes."""
    assert policies.shard_nbytes(100, 3) == 48
    assert policies.shard_nbytes(64, 4) == 16
    assert policies.shard_nbytes(0, 4) == 0


# --------------------------------------------------------------------------------------------- properties


@st.composite
def random_plans(draw: st.DrawFn) -> tuple[Plan, int, int | None]:
    world = draw(st.sampled_from([1, 2, 3, 4]))
    distributed = draw(st.booleans())
    sizes = st.integers(min_value=1, max_value=5000).map(lambda n: n * 2)
    comps = []
    for i in range(draw(st.integers(min_value=1, max_value=3))):
        n_stacks = draw(st.integers(min_value=0, max_value=2))
        stacks = []
        for k in range(n_stacks):
            blocks = draw(st.lists(sizes, min_size=2, max_size=7))
            head = draw(st.integers(min_value=0, max_value=len(blocks)))
            if len(blocks) - head == 1:
                head = len(blocks)
            stacks.append(stack(f"c{i}", f"blocks{k}", blocks, head if i == 0 else 0))
        kind = "dit" if i == 0 else draw(st.sampled_from(["encoder", "vae", "dit"]))
        comps.append(
            component(
                f"c{i}",
                kind,
                draw(st.integers(min_value=0, max_value=3000)) * 2,
                stacks,
                on_demand=kind == "encoder" and draw(st.booleans()),
            )
        )
    config: dict[str, object] = {}
    chunk: int | None = None
    if distributed:
        config = {"strategy": "distributed_layerwise", "parallel": ParallelLayout(data_parallel_size=world)}
        chunk = draw(st.sampled_from([None, 512, 4096]))
    return plan(comps, **config), draw(st.integers(min_value=1, max_value=4)), chunk


@settings(max_examples=60, deadline=None)
@given(random_plans(), st.data())
def test_every_policy_passes_check_and_bounds_memory(
    case: tuple[Plan, int, int | None], data: st.DataObject
) -> None:
    """Every built-in policy's schedules pass check over a sequence of steps; the ring's peak is bounded
    by what it keeps, its slots (a chunked gather's gather slot among them) and what it acquires."""
    p, depth, chunk = case
    names = [c.path for c in p.components]
    steps = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=4))
    for policy in (
        policies.none(),
        policies.model_level(),
        policies.layerwise(depth),
        policies.distributed_layerwise(depth, chunk_bytes=chunk),
    ):
        entry: tuple[Placement, ...] = ()
        for i, c in enumerate(steps):
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            s = policy(p, Step(component=c, index=i, entry=entry, next=nxt))
            policies.check(s, p)
            assert policies.parse_schedule(policies.format_schedule(s)) == s
            entry = s.exit
    # memory bound of the ring over one steady step of the first component
    policy = policies.distributed_layerwise(depth, chunk_bytes=chunk)
    first = policy(p, Step(component=names[0]))
    report = policies.simulate(first)
    ring = sum(sl.nbytes for sl in first.slots)
    largest = max((sl.nbytes for sl in first.slots if sl.kind == "block"), default=0)
    shard = max((sl.nbytes for sl in first.slots if sl.kind == "shard"), default=0)
    # Chunked gathers land their chunks in one gather slot of at most world chunks of chunk_bytes.
    gather = [sl.nbytes for sl in first.slots if sl.kind == "gather"]
    assert len(gather) <= 1 and (not gather or (chunk is not None and gather[0] <= p.config.dp_size * chunk))
    assert ring == (depth + 1) * largest + 2 * shard + sum(gather)
    kept = sum(x.nbytes for x in first.exit if x.where == DEVICE)
    assert report.peak_device_bytes <= kept + ring + sum(
        op.nbytes for op in first.ops if op.kind == "acquire"
    )


@settings(max_examples=30, deadline=None)
@given(random_plans())
def test_zero_transfer_cost_makespan_is_resident(case: tuple[Plan, int, int | None]) -> None:
    """With free transfers every ring schedule's makespan equals its all-resident makespan."""
    p, depth, chunk = case
    cost = policies.CostModel(h2d_bytes_per_s=math.inf, collective_bytes_per_s=math.inf, block_s=0.001)
    for c in p.components:
        schedule = policies.distributed_layerwise(depth, chunk_bytes=chunk)(p, Step(component=c.path))
        report = policies.simulate(schedule, cost)
        assert report.makespan_s == report.resident_makespan_s


def test_rest_unit_name() -> None:
    """A remainder's unit name is '<component>:rest'."""
    assert rest_unit("transformer") == "transformer:rest"


def test_builtin_is_the_one_route_from_a_strategy_to_its_policy() -> None:
    """builtin(strategy, knobs) names the factory's policy; each knob is a factory argument."""
    assert policies.STRATEGIES == ("none", "model_level", "layerwise", "distributed_layerwise")
    assert sorted(policies.BUILTINS) == sorted(policies.STRATEGIES)
    assert [policies.builtin(s).name for s in policies.STRATEGIES] == [
        "none()",
        "model_level()",
        "layerwise(depth=1)",
        "distributed_layerwise(depth=1)",
    ]
    assert (
        policies.builtin("layerwise", depth=2, resident=["t.blocks.0"]).name
        == "layerwise(depth=2, resident=1)"
    )
    chunked = policies.builtin("distributed_layerwise", depth=2, chunk_bytes=64 << 20)
    assert chunked.name == "distributed_layerwise(depth=2, chunk=64.0 MiB)"
    assert all(policies.is_index_free(policies.builtin(s)) for s in policies.STRATEGIES)


@pytest.mark.parametrize(
    ("strategy", "knobs", "message"),
    [
        (
            "none",
            {"depth": 2},
            "policies.builtin('none'): the none policy takes no knobs, and depth was set; drop it, or "
            "choose a strategy that uses it (layerwise or distributed_layerwise)",
        ),
        (
            "layerwise",
            {"chunk_bytes": 4096},
            "policies.builtin('layerwise'): the layerwise policy takes only depth, resident, and chunk_bytes "
            "was set; drop it, or choose a strategy that uses it (distributed_layerwise)",
        ),
        (
            "ring",
            {},
            "policies.builtin('ring'): no built-in policy has that name; choose one of 'none', "
            "'model_level', 'layerwise', 'distributed_layerwise'",
        ),
    ],
)
def test_builtin_refuses_a_knob_it_would_ignore(strategy: str, knobs: dict[str, int], message: str) -> None:
    """A knob the strategy does not take is an error, not a silent no-op."""
    with pytest.raises(PlanError) as caught:
        policies.builtin(strategy, **knobs)
    assert str(caught.value) == message


def test_depth_is_checked_once_with_the_config_s_exception_types() -> None:
    """A factory refuses a bad depth as OffloadConfig does: TypeError for a type, PlanError for a value."""
    with pytest.raises(PlanError, match=re.escape("layerwise(depth=0): depth must be >= 1")):
        policies.layerwise(0)
    with pytest.raises(TypeError, match=re.escape("layerwise(depth='2'): depth must be an int, got str '2'")):
        policies.layerwise("2")  # type: ignore[arg-type]


def test_cached_keeps_what_a_policy_declares() -> None:
    """cached() of a declared policy keeps its name and index-freedom."""
    memo = policies.cached(policies.layerwise(2))
    assert isinstance(memo, policies.Declared)
    assert (memo.name, policies.is_index_free(memo)) == ("layerwise(depth=2)", True)
