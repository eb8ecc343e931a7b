"""A CPU session run as a CUDA session runs (`torchferry.testing.cuda_path`): the tensors re-pointed
rather than docked, every wait and release issued, no step replayed, and every output still the
plain run's, bit for bit."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from module_checks import same_weights
from toy_runs import Interrupt, interrupt_once

import torchferry
from torchferry import ExecutionError, OffloadWarning
from torchferry.testing import CudaPathStreams, cuda_path, toy

SESSIONS: list[dict[str, Any]] = [
    {"strategy": "layerwise"},
    {"strategy": "layerwise", "prefetch_depth": 2, "resident_layers": 1},
    {"strategy": "model_level"},
]


@pytest.mark.parametrize("options", SESSIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_a_session_run_on_the_cuda_path_gives_the_plain_output_and_never_docks(
    options: dict[str, Any],
) -> None:
    """Three calls of each strategy on the CUDA path equal the plain calls, with every pack re-pointed,
    no step replayed, and the waits and releases a CUDA session issues issued."""
    pipe, ref = toy.build(0), toy.build(0)
    expected = [ref("a cat", steps=2), ref("a dog", steps=3)]
    with cuda_path():
        session = torchferry.offload(pipe, device="cpu", **options)
    with torch.no_grad(), session:
        streams = session.engine.streams
        assert isinstance(streams, CudaPathStreams)
        got = [pipe("a cat", steps=2), pipe("a dog", steps=3), pipe("a cat", steps=2)]
        assert all(pack.bound is None for pack in session.engine.store.packs.values())  # re-pointed
        assert all(p.replay is None for p in session.engine._programs.values())  # never replayed
        # The waits and releases the CPU streams skip are issued (a copy of a later call's first
        # block is waited for in that call; a staged component is never released, as on CUDA).
        assert streams.calls["copy"] > 0 and streams.calls["wait"] > 0
        assert (streams.calls["release"] > 0) is (options["strategy"] == "layerwise")
    for have, want in zip(got, [*expected, expected[0]], strict=True):
        assert torch.equal(have, want)
    assert same_weights(pipe, ref)


def test_sessions_opened_after_cuda_path_run_on_the_streams_they_ran_on_before() -> None:
    """`cuda_path` sets the stream seam only inside: a session opened after it docks as before."""
    pipe = toy.build(0)
    with torchferry.offload(pipe.transformer, strategy="layerwise", device="cpu") as session:
        before = type(session.engine.streams)  # (the suite's conftest may have set the sanitizer)
        docked = {pack.bound is not None for pack in session.engine.store.packs.values()}
    with cuda_path(), torchferry.offload(pipe.transformer, strategy="layerwise", device="cpu") as session:
        assert isinstance(session.engine.streams, CudaPathStreams)
    with torchferry.offload(pipe.transformer, strategy="layerwise", device="cpu") as session:
        assert type(session.engine.streams) is before is not CudaPathStreams
        assert {pack.bound is not None for pack in session.engine.store.packs.values()} == docked


@torch.no_grad()
def test_a_hook_reading_another_block_mid_step_sees_its_true_weights_on_the_cuda_path() -> None:
    """Between its load and its wait a block's tensors read its host copy, and after its evict
    again: what a hook of another block reads is the block's own weights, wherever it is."""
    pipe, ref = toy.build(0), toy.build(0)
    blocks, plain = list(pipe.transformer.blocks), list(ref.transformer.blocks)
    seen: list[bool] = []

    def look(module: torch.nn.Module, args: object) -> None:
        for mine, theirs in zip(blocks, plain, strict=True):
            for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
                seen.append(torch.equal(a.detach().cpu(), b))

    with cuda_path():
        session = torchferry.offload(pipe, strategy="layerwise", device="cpu", prefetch_depth=2)
    with session:
        handles = [b.register_forward_pre_hook(look) for b in blocks[::3]]
        try:
            out = pipe("a cat", steps=2)
        finally:
            for h in handles:
                h.remove()
    assert seen and all(seen)
    assert torch.equal(out, ref("a cat", steps=2))


def test_cuda_path_refuses_a_device_other_than_the_cpu_before_anything_moves() -> None:
    pipe, ref = toy.build(0), toy.build(0)
    with cuda_path(), pytest.raises(ValueError, match="use device='cpu' inside cuda_path"):
        torchferry.offload(pipe, strategy="layerwise", device="meta")
    assert same_weights(pipe, ref)


@torch.no_grad()
@pytest.mark.parametrize("edit", ["data", "in place", "load_state_dict"])
def test_edits_between_steps_reach_every_later_step_on_the_cuda_path(edit: str) -> None:
    """Rule 2 of the session contract where every tensor is re-pointed at each step (the step end
    remembers the re-pointed packs' pointers without reading them): an edit between calls is in
    every later output and in the weights after close."""
    pipe, ref = toy.build(0), toy.build(0)

    def change(p: toy.ToyPipeline) -> None:
        blocks = p.transformer.blocks
        target = blocks[len(blocks) // 2].q.weight
        if edit == "data":
            target.data = target.detach().clone() * 2
        elif edit == "in place":
            target.mul_(2)
        else:
            first = blocks[0]
            first.load_state_dict({k: v * 0.5 for k, v in first.state_dict().items()})

    with cuda_path():
        session = torchferry.offload(pipe, strategy="layerwise", device="cpu")
    with session:
        before = pipe("a cat", steps=2)
        change(pipe)
        after = [pipe("a cat", steps=2), pipe("a cat", steps=2)]
    assert torch.equal(before, ref("a cat", steps=2))
    change(ref)
    expected = ref("a cat", steps=2)
    assert not torch.equal(expected, before)
    assert all(torch.equal(a, expected) for a in after)
    assert same_weights(pipe, ref)


@torch.no_grad()
def test_steady_calls_on_the_cuda_path_keep_what_the_device_holds_between_steps() -> None:
    """What a step end remembers of the packs it re-pointed is what the next step start finds: the
    units the device keeps between steps (components' rests, a resident block) are never taken for
    an edit and dropped, so steady calls move them no more."""
    pipe, ref = toy.build(0), toy.build(0)
    with cuda_path():
        session = torchferry.offload(
            pipe, strategy="layerwise", device="cpu", prefetch_depth=2, resident_layers=1
        )
    with session:
        for _ in range(2):
            pipe("a cat", steps=3)
        units = session.engine.store.units
        kept = [name for name, where in session.engine.placed.items() if where == "device"]
        moves = {name: [p.moves for p in units[name].packs] for name in kept}
        out = [pipe("a cat", steps=3), pipe("a dog", steps=2)]
        assert "transformer.blocks.0" in kept
        assert {name: [p.moves for p in units[name].packs] for name in kept} == moves
    assert torch.equal(out[0], ref("a cat", steps=3)) and torch.equal(out[1], ref("a dog", steps=2))


@torch.no_grad()
@pytest.mark.parametrize("i", [0, 3])
@pytest.mark.parametrize("options", SESSIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_a_data_assignment_after_an_interrupted_step_is_adopted_on_the_cuda_path(
    options: dict[str, Any], i: int
) -> None:
    """A step cut short leaves blocks in slots and its record behind; ``w.data = t`` then, between
    calls, is an edit like any: the next call's clean start (which points every weight back at host
    memory) must not take ``t`` for the engine's own pointer, nor point ``w`` away from it unseen.
    Before, both lost the edit silently on the re-pointed path."""
    pipe, ref = toy.build(0), toy.build(0)
    with cuda_path():
        session = torchferry.offload(pipe, device="cpu", **options)
    with session:
        pipe("a cat", steps=2)
        handle = pipe.transformer.blocks[5].register_forward_pre_hook(interrupt_once())
        with pytest.raises(Interrupt):
            pipe("a cat", steps=2)
        handle.remove()
        for p in (pipe, ref):
            weight = p.transformer.blocks[i].fc1.weight
            weight.data = weight.detach() * 2
        got = [pipe("a cat", steps=2), pipe("a dog", steps=2)]
    assert torch.equal(got[0], ref("a cat", steps=2)) and torch.equal(got[1], ref("a dog", steps=2))
    assert same_weights(pipe, ref)


@torch.no_grad()
def test_a_weight_given_another_dtype_between_calls_is_refused_on_the_cuda_path() -> None:
    """A GPU session re-points every streamed weight at each step, so ``w.data = t`` of another dtype
    cannot run (a CPU session's docked weight runs with it, as plain torch): every later call is
    refused before its step starts, naming the weight, and ``close()`` points the weight back at the
    host copy the session kept (docs/contract.md, weight edits)."""
    pipe, ref = toy.build(0), toy.build(0)
    with cuda_path():
        session = torchferry.offload(pipe, strategy="layerwise", device="cpu")
    with session:
        pipe("a cat", steps=2)
        weight = pipe.transformer.blocks[2].q.weight
        weight.data = torch.zeros(weight.shape, dtype=torch.float64)
        for _ in range(2):
            with pytest.raises(ExecutionError, match=re.escape("transformer.blocks.2.q.weight")):
                pipe("a cat", steps=2)
    assert weight.dtype == torch.float32
    assert same_weights(pipe, ref)


@torch.no_grad()
def test_a_tensor_assigned_between_calls_gives_its_values_on_the_cuda_path() -> None:
    """``w.data = t`` between calls on a GPU session: the next step start adopts ``t``'s values into the
    host copy and points ``w`` there, so a later write to ``t`` does not reach ``w`` (on a CPU session
    ``w`` keeps ``t``, as in plain torch: docs/contract.md, weight edits)."""
    pipe, ref = toy.build(0), toy.build(0)
    with cuda_path():
        session = torchferry.offload(pipe, strategy="layerwise", device="cpu")
    with session:
        pipe("a cat", steps=2)
        given = {p: p.transformer.blocks[3].fc1.weight.detach() * 2 for p in (pipe, ref)}
        for p, t in given.items():
            p.transformer.blocks[3].fc1.weight.data = t
        assert torch.equal(pipe("a cat", steps=2), ref("a cat", steps=2))
        given[pipe].mul_(3)
        out = pipe("a cat", steps=2)
    assert torch.equal(out, ref("a cat", steps=2))  # the later write is not in it
    assert same_weights(pipe, ref)


@torch.no_grad()
def test_a_call_cut_short_inside_a_cast_layer_leaves_the_next_calls_exact_on_the_cuda_path() -> None:
    """Stored in bfloat16, computed in float32 (``storage_dtype=``): a layer's weights point at
    float32 copies while it runs. A KeyboardInterrupt there skips the hook that points them back; the
    next call's clean start must do it, not take the copies for an edit of another dtype and refuse
    every call after."""
    pipe = toy.build(0)
    with cuda_path():
        session = torchferry.offload(pipe, strategy="layerwise", device="cpu", storage_dtype=torch.bfloat16)
    with session:
        expected = pipe("a cat", steps=2)
        handle = pipe.transformer.blocks[3].fc1.register_forward_pre_hook(interrupt_once())
        with pytest.raises(Interrupt):
            pipe("a cat", steps=2)
        handle.remove()
        got = [pipe("a cat", steps=2), pipe("a cat", steps=2)]
    assert all(torch.equal(g, expected) for g in got)


def test_a_user_pre_hook_switching_grad_on_makes_the_backward_raise_on_the_cuda_path() -> None:
    """A block's pre hook of the user's runs after torchferry's and switches grad on for the block's
    forward, its forward hook off again: re-pointed, what autograd saved of the block's weights stays
    in the slot the next block overwrites, so the backward must raise, not return a wrong gradient."""
    pipe = toy.build(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)
    kept: dict[str, torch.Tensor] = {}

    def on(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        torch.set_grad_enabled(True)
        kept["leaf"] = args[0].detach().requires_grad_()
        return (kept["leaf"], *args[1:])

    def off(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        kept["out"] = out
        torch.set_grad_enabled(False)
        return out.detach()

    dit = pipe.transformer
    with cuda_path():
        session = torchferry.offload(dit, strategy="layerwise", device="cpu")
    with session:
        with torch.no_grad():
            dit(*x)
        dit.blocks[1].register_forward_pre_hook(on)
        dit.blocks[1].register_forward_hook(off)
        with torch.no_grad(), pytest.warns(OffloadWarning, match="gradients"):
            dit(*x)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(kept["out"].sum(), kept["leaf"])
