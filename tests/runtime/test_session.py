"""`torchferry.offload`: every single-process strategy streams the toy pipeline bit-identically."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from module_checks import hook_count, same_weights
from torch.utils._python_dispatch import TorchDispatchMode

import torchferry
from torchferry import ExecutionError, OffloadWarning, PlanError, policies, topology
from torchferry.testing import toy
from torchferry.topology import Plan

STRATEGIES: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("model_level", {}),
    *[("layerwise", {"prefetch_depth": d}) for d in (1, 2, 3)],
    *[("layerwise", {"resident_layers": r, "components": {"dit", "text_encoder"}}) for r in (1, 2)],
]




@pytest.mark.parametrize("two_experts", [False, True])
@pytest.mark.parametrize(("strategy", "options"), STRATEGIES)
def test_outputs_bit_identical(strategy: str, options: dict[str, Any], two_experts: bool) -> None:
    """Two calls under the session (with a skipped block) equal the plain run; close restores everything."""
    p, ref = toy.build(0, two_experts=two_experts), toy.build(0, two_experts=two_experts)
    skip = {1: {2}, 2: {7}}
    with torchferry.offload(p, strategy=strategy, device="cpu", **options) as session:
        assert torch.equal(p("a cat", steps=4), ref("a cat", steps=4))
        assert torch.equal(p("a cat", steps=4, skip=skip), ref("a cat", steps=4, skip=skip))
        assert torch.equal(p("a dog", steps=4), ref("a dog", steps=4))
        for step, peak in session.step_peaks.items():
            assert peak == policies.simulate(session.schedules[step]).peak_device_bytes, step
    assert same_weights(p, ref)
    assert hook_count(p) == 0


def test_two_experts_switch_components() -> None:
    """The session runs steps of both experts, learning that transformer_2 follows transformer."""
    p = toy.build(0, two_experts=True)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        p("a cat", steps=4)
        p("a cat", steps=4)
        steps = {(s.component, s.index, s.next) for s in session.schedules}
    # Built-in policies are index-free: schedules are shared across forwards, keyed with index 0.
    assert ("transformer", 0, "transformer_2") in steps
    assert ("transformer_2", 0, "vae") in steps
    assert {s.index for s in session.schedules} == {0}


def test_on_demand_component_uses_its_lifecycle() -> None:
    """A component declared on demand is acquired and released through its own methods."""
    decl = topology.Declaration(
        resident_dit_paths={"transformer"},
        encoder_block_attrs={"text_encoder": ("blocks",)},
        on_demand_component_paths={"vae"},
    )
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(
        p, strategy="layerwise", device="cpu", declaration=decl, components={"dit", "vae"}
    ) as s:
        assert torch.equal(p("a cat"), ref("a cat"))
        kinds = [
            op.kind for step, sched in s.schedules.items() if step.component == "vae" for op in sched.ops
        ]
    assert "acquire" in kinds and "release" in kinds
    assert same_weights(p, ref)


def test_a_lifecycle_that_fails_while_a_failed_step_recovers_leaves_the_session_usable() -> None:
    """The VAE's forward fails and its own offload_to_cpu then fails too during recovery: the forward's
    error is raised, the lifecycle's is an OffloadWarning, and the very next call is exact."""
    decl = topology.Declaration(
        resident_dit_paths={"transformer"},
        encoder_block_attrs={"text_encoder": ("blocks",)},
        on_demand_component_paths={"vae"},
    )
    p, ref = toy.build(0), toy.build(0)
    expected = ref("a cat")
    failing = {"forward": False, "offload": False}
    decode, offload = p.vae.decode, p.vae.offload_to_cpu

    def flaky_decode(latents: torch.Tensor) -> torch.Tensor:
        if failing.pop("forward", False):
            raise ValueError("decode failed")
        return decode(latents)

    def flaky_offload() -> None:
        if failing.pop("offload", False):
            raise RuntimeError("offload failed")
        offload()

    p.vae.decode = flaky_decode  # type: ignore[method-assign]
    p.vae.offload_to_cpu = flaky_offload  # type: ignore[method-assign]
    options: dict[str, Any] = {"declaration": decl, "components": {"dit", "vae"}}
    with torchferry.offload(p, strategy="layerwise", device="cpu", **options):
        assert torch.equal(p("a cat"), expected)
        failing.update(forward=True, offload=True)
        warned = r"offload_to_cpu\(\) of 'vae' raised RuntimeError: offload failed"
        with pytest.raises(ValueError, match="decode failed"), pytest.warns(OffloadWarning, match=warned):
            p("a cat")
        assert torch.equal(p("a cat"), expected)
    assert same_weights(p, ref)


class _Fail:
    """A forward pre-hook that raises ``error`` the first time its block runs."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error


@pytest.mark.parametrize("error", [ValueError("boom"), KeyboardInterrupt()])
def test_failure_inside_a_block_leaves_pipeline_usable(error: BaseException) -> None:
    """An exception or interrupt inside a block's forward: the next call is correct and close restores."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu", prefetch_depth=2) as session:
        p("a cat")
        handle = p.transformer.blocks[4].register_forward_pre_hook(_Fail(error))
        with pytest.raises(type(error)):
            p("a cat")
        handle.remove()
        assert torch.equal(p("a cat"), ref("a cat"))
        assert session.hook_count == hook_count(p)
    assert same_weights(p, ref)
    assert hook_count(p) == 0


def test_round_trip_reopen_other_strategy() -> None:
    """Open, run, close, reopen with another strategy, run, close: weights bit-identical throughout."""
    p, ref = toy.build(0, two_experts=True), toy.build(0, two_experts=True)
    expected = ref("a cat")
    for strategy in ("layerwise", "model_level", "none", "layerwise"):
        session = torchferry.offload(p, strategy=strategy, device="cpu")
        assert same_weights(p, ref)
        assert torch.equal(p("a cat"), expected)
        session.close()
        assert same_weights(p, ref)
        assert hook_count(p) == 0


def test_second_session_on_same_pipeline_is_refused() -> None:
    """A pipeline served by an open session cannot be offloaded again until it is closed."""
    p = toy.build(0)
    with torchferry.offload(p, device="cpu"):
        message = (
            "this pipeline is already served by an open torchferry session; close() it before opening "
            "another (torchferry.session_of(pipe).close() when you no longer hold the session)"
        )
        with pytest.raises(ExecutionError, match=re.escape(message)):
            torchferry.offload(p, device="cpu")
    torchferry.offload(p, device="cpu").close()


def test_meta_pipeline_without_checkpoint_is_refused() -> None:
    """A pipeline with weights on the meta device and no checkpoint is rejected with what to do, untouched."""
    p = toy.build(0)
    p.vae.to("meta")
    message = (
        "torchferry.offload cannot take over this pipeline: 4 tensor(s) are on the meta device "
        "(vae.fc1.weight, vae.fc1.bias, vae.fc2.weight, ...) and no checkpoint was given to fill them; "
        "pass checkpoint=<a .safetensors file, a folder of them or an *.index.json> to "
        "torchferry.offload(...), or load the weights into the pipeline on the CPU first"
    )
    before = p.transformer.blocks[0].q.weight.data_ptr()
    with pytest.raises(PlanError, match=re.escape(message)):
        torchferry.offload(p, strategy="layerwise", device="cpu")
    assert p.transformer.blocks[0].q.weight.data_ptr() == before
    assert hook_count(p) == 0


def test_unknown_option_is_refused() -> None:
    """A keyword that is not an OffloadConfig field is rejected naming it."""
    with pytest.raises(PlanError, match=re.escape("offload() got unknown option(s) 'depth'; ")):
        torchferry.offload(toy.build(0), device="cpu", depth=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_plan_error_before_anything_moves() -> None:
    """device='cuda' (or 'cuda:1') where torch has no CUDA device is a PlanError saying so, not
    torch's own error from inside a copy, and the pipeline is untouched."""
    p, ref = toy.build(0), toy.build(0)
    for device in ("cuda", "cuda:1", torch.device("cuda")):
        with pytest.raises(PlanError) as refused:
            torchferry.offload(p, strategy="layerwise", device=device)
        assert str(refused.value).startswith(f"offload(device={device!r}): no CUDA device is available (")
        assert str(refused.value).endswith("); run where a GPU is visible, or pass device='cpu'")
    assert same_weights(p, ref) and hook_count(p) == 0


def test_a_strategy_may_be_passed_in_the_config_place() -> None:
    """offload(pipe, "layerwise") is offload(pipe, strategy="layerwise"); two strategies, or
    another object there, are PlanErrors."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, "layerwise", device="cpu", prefetch_depth=2) as session:
        assert session.plan.strategy == "layerwise" and session.running_policy == "layerwise(depth=2)"
        assert torch.equal(p("a cat"), ref("a cat"))
    two = re.escape("offload(pipe, 'none', strategy='layerwise'): two strategies")
    with pytest.raises(PlanError, match=two):
        torchferry.offload(p, "none", strategy="layerwise", device="cpu")
    other = re.escape("offload(pipe, dict): the second argument is an OffloadConfig or a strategy name")
    with pytest.raises(PlanError, match=other):
        torchferry.offload(p, {"strategy": "none"}, device="cpu")  # type: ignore[arg-type]
    assert hook_count(p) == 0


def test_diffusers_options_are_refused_with_their_equivalent() -> None:
    """Group-offloading keywords of diffusers are refused, each with what torchferry does instead."""
    with pytest.raises(PlanError) as refused:
        torchferry.offload(
            toy.build(0), device="cpu", onload_device="cpu", num_blocks_per_group=2, use_stream=True
        )
    assert str(refused.value).startswith(
        "offload() got unknown option(s) 'num_blocks_per_group', 'onload_device', 'use_stream'; "
        "num_blocks_per_group= has no equivalent because torchferry moves one block per slot; how many "
        "load ahead is prefetch_depth= (or leave strategy to auto, which picks it); onload_device= is "
        "device= here (where the weights compute); use_stream= has no equivalent because torchferry "
        "always copies on its own CUDA stream, overlapped with compute; drop it; the options are the "
        "OffloadConfig fields: checkpoint, chunk_bytes, "
    )
    with pytest.raises(PlanError, match=re.escape("variant= picks a pipeline folder's weight files")):
        torchferry.offload(toy.build(0), device="cpu", variant="fp16")


def test_checkpoint_variant_is_a_short_name_and_needs_a_checkpoint() -> None:
    """checkpoint_variant names which files of checkpoint= to read: a short name, never alone."""
    with pytest.raises(PlanError, match=re.escape("a weight variant is a short name such as 'fp16'")):
        torchferry.offload(toy.build(0), device="cpu", checkpoint="/x", checkpoint_variant="../fp16")
    with pytest.raises(PlanError) as alone:
        torchferry.offload(toy.build(0), device="cpu", checkpoint_variant="fp16")
    assert str(alone.value) == (
        "offload(checkpoint_variant='fp16') picks which files of the checkpoint to read, and no "
        "checkpoint= is given; pass the pipeline folder as checkpoint="
    )


def test_gather_on_close_is_refused_where_nothing_is_sharded() -> None:
    """gather_on_close=True asks to re-assemble shards, which only distributed_layerwise makes."""
    with pytest.raises(PlanError, match=re.escape("strategy='layerwise', which keeps whole weights")):
        torchferry.offload(toy.build(0), strategy="layerwise", device="cpu", gather_on_close=True)


def test_thousand_passes_leave_counts_unchanged() -> None:
    """1,000 pipeline passes leave host bytes, device bytes, allocations, hooks and schedules unchanged."""
    p = toy.build(0, blocks=6, hidden=16)
    with torchferry.offload(p, strategy="layerwise", device="cpu", prefetch_depth=2) as session:
        first = p("a cat", steps=1)
        p("a cat", steps=1)
        p("a cat", steps=1)
        counts = (session.host_bytes, session.device_bytes, hook_count(p))
        schedules = len(session.schedules)
        allocations = session.engine.ledger.allocations
        p("a cat", steps=1)
        per_pass = session.engine.ledger.allocations - allocations
        for _ in range(1000):
            out = p("a cat", steps=1)
        assert (session.host_bytes, session.device_bytes, hook_count(p)) == counts
        assert session.engine.ledger.allocations == allocations + 1001 * per_pass
        assert len(session.schedules) == schedules
        assert torch.equal(out, first)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _count(run: Callable[[], object]) -> Counter[str]:
    with _OpCounter() as counter:
        run()
    return counter.ops


def test_steady_state_issues_only_block_copies() -> None:
    """Denoising steps after the first allocate nothing and add only the block copies to the resident ops."""
    p, ref = toy.build(0), toy.build(0)
    context = torch.randn(1, 8, 32)
    latents, t = torch.randn(1, 16, 16), torch.tensor([0.5])
    with torch.no_grad():
        resident = _count(lambda: ref.transformer(latents, t, context))
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session, torch.no_grad():
        for _ in range(3):
            p.transformer(latents, t, context)
        allocations = session.engine.ledger.allocations
        streamed = _count(lambda: p.transformer(latents, t, context))
        assert session.engine.ledger.allocations == allocations
        last = session.engine.last
        assert last is not None
        loads = sum(op.kind == "load" for op in last.ops)
    assert streamed - resident == Counter({"aten.copy_.default": loads})
    assert resident - streamed == Counter()


def test_a_model_called_in_a_loop_reuses_one_schedule() -> None:
    """Forwards of one component from the same residency share one schedule and one compiled program."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        p("a cat", steps=20)
        dit_steps = [s for s in session.schedules if s.component == "transformer"]
        assert len(dit_steps) <= 2  # the first forward's entry differs from the steady state's
        assert len(session.engine._programs) == len(session.schedules)


def test_a_policy_not_declared_index_free_gets_every_index() -> None:
    """A user policy that may read the index is asked once per index, so it can act on it."""
    seen: list[int] = []
    base = policies.layerwise(1)

    def counting(plan: Plan, step: policies.Step, /) -> policies.Schedule:
        seen.append(step.index)
        return base(plan, step)

    p = toy.build(0)
    expected = p("a cat", steps=3)
    with torchferry.offload(p, strategy="layerwise", device="cpu", policy=counting):
        assert torch.equal(p("a cat", steps=3), expected)
    assert sorted(i for i in set(seen)) == [0, 1, 2]


def test_a_policy_declared_index_free_gets_one_index() -> None:
    """`policies.declare(fn, index_free=True)` travels with the value: the session asks for index 0 only."""
    seen: list[int] = []
    base = policies.layerwise(1)

    def counting(plan: Plan, step: policies.Step, /) -> policies.Schedule:
        seen.append(step.index)
        return base(plan, step)

    declared = policies.declare(counting, name="counting()", index_free=True)
    assert (declared.name, policies.is_index_free(declared), policies.is_index_free(counting)) == (
        "counting()",
        True,
        False,
    )
    p = toy.build(0)
    expected = p("a cat", steps=3)
    with torchferry.offload(p, strategy="layerwise", device="cpu", policy=declared):
        assert torch.equal(p("a cat", steps=3), expected)
    assert set(seen) == {0}


@pytest.mark.parametrize(
    ("options", "knobs"),
    [
        ({"prefetch_depth": 2}, "prefetch_depth=2"),
        ({"config": topology.OffloadConfig(prefetch_depth=3)}, "prefetch_depth=3"),
    ],
)
def test_a_policy_with_builtin_knobs_is_refused_before_anything_moves(
    options: dict[str, Any], knobs: str
) -> None:
    """offload(policy=..., prefetch_depth=...) is a PlanError: the depth would be silently ignored."""
    p = toy.build(0)
    before = {n: t.device for n, t in p.transformer.state_dict().items()}
    with pytest.raises(PlanError) as caught:
        torchferry.offload(p, device="cpu", policy=policies.layerwise(1), **options)
    assert str(caught.value) == (
        f"offload(policy=...) with {knobs}: those knobs configure the strategy's built-in policy, which "
        "policy= replaces; pass them to the policy's factory (policies.layerwise(depth=2)) and drop them here"
    )
    assert {n: t.device for n, t in p.transformer.state_dict().items()} == before
    torchferry.offload(p, device="cpu").close()  # nothing was left open


def test_device_memory_is_taken_as_text_or_bytes() -> None:
    """offload(device_memory="1GiB") stores the budget in bytes; both budget names at once are refused."""
    p = toy.build(0)
    with torchferry.offload(p, device="cpu", device_memory="1GiB") as session:
        assert session.plan.config.device_memory_bytes == 2**30
    with pytest.raises(
        PlanError, match=re.escape("two names for the device budget; pass device_memory= alone")
    ):
        torchferry.offload(p, device="cpu", device_memory=1, device_memory_bytes=1)


def test_host_memory_is_taken_as_text_or_bytes() -> None:
    """offload(host_memory="1GiB") stores the host budget in bytes; both of its names at once are refused."""
    p = toy.build(0)
    with torchferry.offload(p, device="cpu", host_memory="1GiB", strategy="layerwise") as session:
        assert session.plan.config.host_memory_bytes == 2**30
    with pytest.raises(PlanError, match=re.escape("two names for the host budget; pass host_memory= alone")):
        torchferry.offload(p, device="cpu", host_memory=1, host_memory_bytes=1)
    with pytest.raises(PlanError, match=re.escape("host_memory: cannot read 'lots' as a size")):
        torchferry.offload(p, device="cpu", host_memory="lots")


def test_budgets_as_text_without_a_unit_are_refused_by_offload() -> None:
    """offload(host_memory="32") and device_memory="24" are refused (bytes or GiB?) before anything moves."""
    p = toy.build(0)
    with pytest.raises(PlanError, match=re.escape("host_memory: '32' has no unit; write 32GiB (binary)")):
        torchferry.offload(p, device="cpu", host_memory="32")
    with pytest.raises(PlanError, match=re.escape("device_memory: '24' has no unit; write 24GiB (binary)")):
        torchferry.offload(p, device="cpu", device_memory="24")


def test_pipeline_called_inside_an_except_block_runs_normally() -> None:
    """Inside an ``except`` clause a call allocates as outside one and gives the plain outputs (no abort)."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        p("a cat", steps=2)
        before = session.engine.ledger.allocations
        p("a cat", steps=2)
        per_call = session.engine.ledger.allocations - before
        try:
            raise ValueError("a retry handler's exception")
        except ValueError:
            before = session.engine.ledger.allocations
            out = p("a cat", steps=2)
            inside = session.engine.ledger.allocations - before
        assert (per_call, inside) == (1, 1)
        assert torch.equal(out, ref("a cat", steps=2))
    assert same_weights(p, ref)
