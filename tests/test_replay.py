"""Replayed steps ([Note: replay] in `torchferry.runtime.executor._replay`): a steady layerwise step
on a CPU session runs as a list of pack moves, exact as the handlers, and hands over to them
wherever its first run did not go."""

from __future__ import annotations

import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import torchferry
from torchferry import OffloadWarning
from torchferry.runtime.executor._replay import block_key
from torchferry.runtime.memory import Pack
from torchferry.testing import toy
from torchferry.testing._calls import count_calls

# (Not under tests/runtime, whose engines all run on the stream sanitizer, which is never replayed.)


class Interrupt(BaseException):
    """A BaseException that is not an Exception (as KeyboardInterrupt is)."""


def pair() -> tuple[toy.ToyPipeline, toy.ToyPipeline]:
    return toy.build(0), toy.build(0)


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)


def run(p: toy.ToyPipeline, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = p.transformer(*args)
    return out


def block(p: toy.ToyPipeline, i: int) -> nn.Module:
    module: nn.Module = p.transformer.blocks[i]
    return module


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _replays(session: torchferry.Session) -> int:
    return sum(p.replay is not None for p in session.engine._programs.values())


def test_a_steady_step_is_replayed_exact_without_the_handlers() -> None:
    """From the second step on, the transformer's step is replayed: no load handler runs in it, and
    every step's output is the plain one, bit for bit."""
    p, ref = pair()
    args = inputs()
    with torch.no_grad(), torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
        assert _replays(session) >= 1
        counted = count_calls(lambda: run(p, args))
        handled = [n for n in counted.by_function if "executor/_handlers.py" in n and n.endswith("(_load)")]
        assert not handled
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


def test_a_replayed_step_interrupted_mid_way_leaves_every_weight_exact() -> None:
    """A BaseException from a block's hook in a replayed step: the abort finds each pack where the
    replay left it, and the next calls (recorded again, then replayed) and the state after close are
    the plain ones."""
    p, ref = pair()
    args = inputs()
    armed = {"on": False}

    def interrupt(module: nn.Module, inputs: Any) -> None:
        if armed["on"]:
            armed["on"] = False
            raise Interrupt()

    with torch.no_grad(), torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        for _ in range(3):
            run(p, args)
        assert _replays(session) >= 1
        block(p, 5).register_forward_pre_hook(interrupt)
        armed["on"] = True
        with pytest.raises(Interrupt):
            run(p, args)
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


def test_grad_switched_on_inside_a_replayed_step_hands_over_to_the_handlers() -> None:
    """A hook that turns grad on inside the forward of a replayed step: from that block on the
    handlers run with the tables the first run had there (the grad guard reads them), and the
    outputs, with their gradients, are the plain ones."""
    p, ref = pair()
    args = inputs()

    def grad_on(module: nn.Module, inputs: Any) -> None:
        torch.set_grad_enabled(True)

    for pipe in (p, ref):
        block(pipe, 3).register_forward_pre_hook(grad_on)
    with (
        warnings.catch_warnings(),
        torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session,
    ):
        warnings.simplefilter("ignore", OffloadWarning)  # blocks run with grad in a shared slot
        for _ in range(4):
            with torch.no_grad():
                outs = [run(pipe, args) for pipe in (p, ref)]
            assert torch.equal(outs[0], outs[1])
        assert _replays(session) >= 1
    assert same_state(p, ref)


def test_a_denoising_loop_replays_its_later_steps_at_every_call() -> None:
    """The components of a pipeline share slots of different sizes, so the DiT's slots hold other
    memory at each call: the same slot buffers, grown again, so its steady program's replay is made
    anew over them with no recording run, and every step but the first replays once each program has
    run once (every block load of those steps a pack's move), every output the plain one."""
    p, ref = pair()
    with torch.no_grad(), torchferry.offload(p, strategy="layerwise", device="cpu"):
        out: list[torch.Tensor] = []
        for call in range(3):
            counted = count_calls(lambda: out.append(p("a cat", steps=5)))
            assert torch.equal(out[-1], ref("a cat", steps=5))
            moved = sum(n for name, n in counted.by_function.items() if name.endswith("(load_docked)"))
            # the first call records the steady step, the second the last step (it prefetches the
            # decoder, known from the first call on): from the third, four steps of five replay
            assert moved >= (3, 3, 4)[call] * len(p.transformer.blocks)
    assert same_state(p, ref)


def test_an_edit_after_a_step_interrupted_mid_replay_reaches_close() -> None:
    """A step interrupted while it replays (its tables as the step found them) and an in-place edit of
    a block it left docked: close finds the edit (it puts the recorded tables in place first) and the
    pipeline after close holds it, as the plain one does."""
    p, ref = pair()
    args = inputs()

    def interrupt(module: nn.Module, inputs: Any) -> None:
        raise Interrupt()

    session = torchferry.offload(p.transformer, strategy="layerwise", device="cpu")
    with torch.no_grad():
        for _ in range(3):
            run(p, args)
        assert _replays(session) >= 1
        handle = block(p, 3).register_forward_pre_hook(interrupt)
        with pytest.raises(Interrupt):
            run(p, args)
        handle.remove()
        for pipe in (p, ref):
            block(pipe, 3).fc1.weight.mul_(2)
    session.close()
    assert same_state(p, ref)


def test_a_failure_inside_a_replayed_segment_leaves_no_block_in_another_blocks_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A move of a replayed segment raises after others of the segment ran, and the model catches it
    and calls the block again: the step was abandoned at the failure, so the second call is refused
    loudly (its weights are at host memory, no step runs), every weight is its own between steps, and
    the next calls are exact. (Continuing the segment from its start would undock a block twice and
    leave it reading another block's bytes.)"""
    p, ref = pair()
    args = inputs()
    armed = {"on": False}
    stale = Pack.stale

    def failing(pack: Pack) -> bool:
        if armed["on"] and pack.name.endswith("blocks.4"):
            armed["on"] = False
            raise RuntimeError("boom")
        return stale(pack)

    def retrying(self: Any, latents: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        angles = t.float()[:, None] * 1000.0 * self.freqs[None]
        temb = self.time_out(
            torch.nn.functional.silu(self.time_in(torch.cat([angles.sin(), angles.cos()], -1)))
        )
        h, ctx = self.patch_in(latents), self.context_proj(context)
        for module in self.blocks:
            try:
                h = module(h, temb, ctx)
            except RuntimeError as exc:
                if "boom" not in str(exc):
                    raise
                h = module(h, temb, ctx)
        out: torch.Tensor = self.proj_out(self.norm_out(h))
        return out

    monkeypatch.setattr(Pack, "stale", failing)
    p.transformer.forward = types.MethodType(retrying, p.transformer)
    with torch.no_grad(), torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
        assert _replays(session) >= 1
        armed["on"] = True
        with pytest.raises(torchferry.ExecutionError, match=r"blocks\.4"):
            run(p, args)
        assert not armed["on"]
        assert same_state(p, ref)  # between steps: every weight reads its own host bytes
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


def test_a_stage_interrupted_after_its_dock_leaves_no_weight_at_freed_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """model_level stages whole components, docking each: an interrupt between the dock and the end of
    the stage (simulated in `Pack.arrived`) undocks the unit before its staged copy is freed, so the
    weights between calls are the plain ones and the next calls are exact."""
    p, ref = pair()
    armed = {"on": True}
    arrived = Pack.arrived

    def failing(pack: Pack) -> None:
        if armed["on"] and pack.docked is not None:
            armed["on"] = False
            raise Interrupt()
        arrived(pack)

    monkeypatch.setattr(Pack, "arrived", failing)
    with (
        torch.no_grad(),
        warnings.catch_warnings(),
        torchferry.offload(p, strategy="model_level", device="cpu"),
    ):
        warnings.simplefilter("ignore", OffloadWarning)
        with pytest.raises(Interrupt):
            p("a cat", steps=2)
        assert not armed["on"]
        junk = [torch.full((1 << 14,), 7.0) for _ in range(64)]  # reuse what a freed copy held
        assert same_state(p, ref)
        del junk
        for seed in range(2):
            assert torch.equal(p("a cat", steps=2, seed=seed), ref("a cat", steps=2, seed=seed))
    assert same_state(p, ref)


@pytest.mark.parametrize("buffers", [False, True], ids=["bare blocks", "blocks with a buffer"])
def test_steps_replayed_under_inference_mode_leave_ordinary_tensors_for_plain_and_grad_calls(
    buffers: bool,
) -> None:
    """Under inference mode a replayed stop whose calls only move memory (the copy into a slot, the
    storage exchanges) runs in the caller's mode: it makes no tensor, so the slots and the weights
    stay ordinary tensors; a stop with a Python call among them (a block with a buffer, which is
    watched) turns inference mode off first. Either way the next no_grad and grad calls are exact,
    and the weights take part in autograd after close."""
    p, ref = pair()
    if not buffers:
        p, ref = toy.without_block_buffers(p), toy.without_block_buffers(ref)
    args = inputs()
    with torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        with torch.inference_mode():
            for _ in range(3):
                assert torch.equal(p.transformer(*args), run(ref, args))
        (program,) = [q for q in session.engine._programs.values() if q.replay is not None]
        assert program.replay is not None and program.replay.used >= 1
        plain = {segment[4]: segment[5] for segment in program.replay.segments.values()}
        steady = [block_key(f"blocks.{i}") for i in range(2, len(p.transformer.blocks))]
        # (the stops of blocks 0 and 1 run handlers: the wait of the block loaded the step before, the
        # evict of the remainder; a block with a buffer is moved by Python functions, which watch it)
        assert not any(plain.values()) if buffers else all(plain[key] for key in steady)
        slots = [entry[1].data for entry in session.engine.slots.slots.values()]
        assert slots and not any(t.is_inference() for t in slots)
        assert not any(t.is_inference() for t in p.transformer.parameters())
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)
    weight = next(p.transformer.blocks[0].parameters()).requires_grad_(True)  # (an inference tensor cannot)
    p.transformer(*args).sum().backward()
    assert weight.grad is not None
