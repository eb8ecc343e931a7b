"""Replayed steps over blocks without buffers ([Note: replay] in `torchferry.runtime.executor._replay`):
each move is one C call (the copy into the slot, the exchange of a pack's storage with the slot's), the
packs' record of where they are is left as the step found it, and is written where the replay hands
over or read back from memory when a step fails anywhere inside it."""

from __future__ import annotations

import gc
import signal
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_replay import Interrupt, inputs, run, same_state
from torch import nn

import torchferry
from torchferry.runtime.memory import Pack
from torchferry.testing import toy
from torchferry.testing._calls import count_calls

# (Not under tests/runtime, whose engines all run on the stream sanitizer, which is never replayed;
# the helpers are test_replay's.)


def bare(seed: int = 0) -> toy.ToyPipeline:
    """The toy pipeline with no buffer in its DiT blocks: every move of a replayed step is a C call."""
    p = toy.without_block_buffers(toy.build(seed))
    assert not any(True for b in p.transformer.blocks for _ in b.buffers())
    return p


def replays(session: torchferry.Session) -> list[Any]:
    return [p.replay for p in session.engine._programs.values() if p.replay is not None]


def spoil_slots(session: torchferry.Session) -> Iterator[torch.Tensor]:
    """Write junk over every slot's memory (and fill freed memory with junk): a weight left docked at
    a slot reads it."""
    for entry in session.engine.slots.slots.values():
        data = entry[1].data
        if data is not None and data.numel():
            data.fill_(7)
    yield from (torch.full((1 << 14,), 7.0) for _ in range(64))


def exact_from_here(p: toy.ToyPipeline, ref: toy.ToyPipeline, args: Any, session: torchferry.Session) -> None:
    """The next calls are the plain ones, and between calls every weight reads its own host bytes
    (junk written over the slots reaches none)."""
    for _ in range(3):
        assert torch.equal(run(p, args), run(ref, args))
    junk = list(spoil_slots(session))
    assert same_state(p, ref)
    del junk


def test_a_steady_step_is_copies_and_exchanges_only() -> None:
    """From the third call on, a step of the transformer runs no Python function of a pack: one copy
    per block and two exchanges, and every output is the plain one, bit for bit."""
    p, ref = bare(), bare()
    args = inputs()
    with torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
        assert replays(session)
        counted = count_calls(lambda: run(p, args))
        # Only the unit the step finds in its slot (block 0) meets its handlers: its wait and evict.
        handled = [n for n in counted.by_function if n.endswith(("(_load)", "(load_docked)", "(land)"))]
        assert not handled, handled
        packs = sum(n for name, n in counted.by_function.items() if "memory/_pack.py" in name)
        assert packs <= 12, counted.by_function  # block 0's alone, whatever the number of blocks
        blocks = len(p.transformer.blocks)
        assert counted.by_function["T TensorBase.copy_"] == blocks  # block 0's for the next step too
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_failure_anywhere_inside_a_replayed_stop_is_recovered_from_memory(where: str) -> None:
    """A call of a replayed stop raises (a BaseException) before, between or after the stop's moves (the
    first stop with moves also runs the evict handler of the unit the step found in its slot): the
    abort reads where each pack is from its memory, so between steps every weight reads its own host
    bytes (junk written over the slots reaches none), and the next calls and close are exact."""
    p, ref = bare(), bare()
    args = inputs()

    def boom(a: Any, b: Any) -> None:
        raise Interrupt()

    with torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        stops = None
        for cut in range(8):
            for _ in range(3):
                assert torch.equal(run(p, args), run(ref, args))
            (replay,) = replays(session)
            starts = sorted(replay.segments)
            start = {"first": starts[2], "middle": starts[len(starts) // 2], "last": starts[-1]}[where]
            original = replay.segments[start]
            stop, fns, firsts, seconds, key, _ = original
            stops = len(fns)
            if cut > stops:
                break
            replay.segments[start] = (
                stop,
                (*fns[:cut], boom, *fns[cut:]),
                (*firsts[:cut], None, *firsts[cut:]),
                (*seconds[:cut], None, *seconds[cut:]),
                key,
                False,
            )
            with pytest.raises(Interrupt):
                run(p, args)
            replay.segments[start] = original
            junk = list(spoil_slots(session))
            assert same_state(p, ref), f"cut after {cut} of the stop's {stops} calls"
            del junk
        assert stops is not None and stops >= 1
        for _ in range(2):
            assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


def test_an_interrupt_between_replayed_blocks_hands_over_exactly() -> None:
    """A BaseException from a user's hook between blocks of a replayed step (forward hooks are skipped,
    as for a KeyboardInterrupt): the next step starts from where the replay's moves left the packs, and
    the next calls, an in-place edit made meanwhile, and close are exact."""
    p, ref = bare(), bare()
    args = inputs()
    armed = {"on": False}

    def interrupt(module: nn.Module, inputs: Any) -> None:
        if armed["on"]:
            armed["on"] = False
            raise Interrupt()

    session = torchferry.offload(p.transformer, strategy="layerwise", device="cpu")
    for _ in range(3):
        run(p, args)
    assert replays(session)
    p.transformer.blocks[5].register_forward_pre_hook(interrupt)
    armed["on"] = True
    with pytest.raises(Interrupt):
        run(p, args)
    with torch.no_grad():
        for pipe in (p, ref):
            pipe.transformer.blocks[5].fc1.weight.mul_(2)  # docked when the step stopped
    for _ in range(3):
        assert torch.equal(run(p, args), run(ref, args))
    session.close()
    assert same_state(p, ref)


@pytest.mark.parametrize("again", [3, 2])
def test_a_block_called_again_in_a_replayed_step_is_checked_on_an_exact_record(again: int) -> None:
    """A forward calls a block a second time once its stop is behind (after block 3: block 3 again,
    still docked, or block 2, evicted): the hook reads the pack's record only after the replay has
    written it, so the first runs as the plain model does and the second is refused loudly, as in a
    step the handlers run, with every weight its own after."""
    p, ref = bare(), bare()
    args = inputs()

    def twice(self: Any, latents: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        angles = t.float()[:, None] * 1000.0 * self.freqs[None]
        temb = self.time_out(
            torch.nn.functional.silu(self.time_in(torch.cat([angles.sin(), angles.cos()], -1)))
        )
        h, ctx = self.patch_in(latents), self.context_proj(context)
        for i, module in enumerate(self.blocks):
            h = module(h, temb, ctx)
            if i == 3 and self.again:
                h = self.blocks[again](h, temb, ctx)
        out: torch.Tensor = self.proj_out(self.norm_out(h))
        return out

    for pipe in (p, ref):
        pipe.transformer.forward = types.MethodType(twice, pipe.transformer)
        pipe.transformer.again = False
    with torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
        assert replays(session)
        for pipe in (p, ref):
            pipe.transformer.again = True
        if again == 3:
            for _ in range(2):
                assert torch.equal(run(p, args), run(ref, args))
        else:
            with pytest.raises(torchferry.ExecutionError, match=r"blocks\.2 was reached"):
                run(p, args)
            assert same_state(p, ref)
        for pipe in (p, ref):
            pipe.transformer.again = False
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


def test_grad_switched_on_inside_a_replayed_step_hands_over_exactly() -> None:
    """Grad switched on by a hook inside a replayed step: the handlers take over with the record the
    replay wrote, and the outputs are the plain ones."""
    p, ref = bare(), bare()
    args = inputs()

    def grad_on(module: nn.Module, inputs: Any) -> None:
        torch.set_grad_enabled(True)

    for pipe in (p, ref):
        pipe.transformer.blocks[4].register_forward_pre_hook(grad_on)
    with (
        pytest.warns(torchferry.OffloadWarning),
        torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session,
    ):
        for _ in range(4):
            with torch.no_grad():
                outs = [pipe.transformer(*args) for pipe in (p, ref)]
            assert torch.equal(outs[0], outs[1])
        assert replays(session)
    assert same_state(p, ref)


def test_an_in_place_edit_inside_a_replayed_step_that_then_fails_is_kept() -> None:
    """A hook edits a weight the device keeps (the transformer's own layers) in place inside a replayed
    step, and a later block raises: the failed step keeps what it wrote, as plain torch does, and every
    streamed block is its own after (docs/contract.md: a step that fails keeps its in-place writes)."""
    p, ref = bare(), bare()
    args = inputs()
    armed = {"on": False}

    def hooks(pipe: toy.ToyPipeline) -> tuple[Any, Any]:
        def edit(module: nn.Module, inputs: Any) -> None:
            if armed["on"]:
                with torch.no_grad():
                    pipe.transformer.proj_out.weight.mul_(2)

        def fail(module: nn.Module, inputs: Any) -> None:
            if armed["on"]:
                armed["on"] = False
                raise RuntimeError("a later block fails")

        return edit, fail

    for pipe in (p, ref):
        edit, fail = hooks(pipe)
        pipe.transformer.blocks[5].register_forward_pre_hook(edit)
        pipe.transformer.blocks[6].register_forward_pre_hook(fail)
    with torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
        assert replays(session)
        for pipe in (p, ref):
            armed["on"] = True
            with pytest.raises(RuntimeError, match="a later block fails"):
                run(pipe, args)
        junk = list(spoil_slots(session))
        assert same_state(p, ref)
        del junk
        for _ in range(2):
            assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


@pytest.mark.parametrize("when", ["between calls", "in a hook after the step starts"])
def test_the_next_steps_first_block_is_copied_at_its_wait(when: str) -> None:
    """A replayed step loads the next step's first block without copying it (its wait copies it, and
    the session guard does not watch it between steps): an in-place edit of that block between calls,
    or from a transformer hook registered after opening (it runs after the step's start), reaches its
    forward and the weights after close, as in the plain run; junk in the slot it will use reaches
    nothing."""
    p, ref = bare(), bare()
    args = inputs()
    armed = {"on": False}

    def edit(pipe: toy.ToyPipeline) -> None:
        with torch.no_grad():
            pipe.transformer.blocks[0].fc1.weight.add_(0.5)

    with torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        if when != "between calls":
            for pipe in (p, ref):
                pipe.transformer.register_forward_pre_hook(
                    lambda module, inputs, pipe=pipe: edit(pipe) if armed["on"] else None
                )
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
        (replay,) = replays(session)
        assert replay.later == {"blocks.0"}, replay.later
        assert session.engine.deferred == {"blocks.0"}
        for _ in range(2):
            junk = list(spoil_slots(session))  # what the slot holds before the wait copies
            del junk
            armed["on"] = True
            if when == "between calls":
                edit(p)
                edit(ref)
            out, expected = run(p, args), run(ref, args)
            armed["on"] = False
            assert torch.equal(out, expected)
        assert replays(session)
    assert same_state(p, ref)


def test_grad_switched_on_after_the_deferred_load_hands_over_exactly() -> None:
    """Grad switched on in the last block's forward, after the replay loaded the next step's first
    block without copying it: the hand-over records that its wait must copy it, and the next calls
    are exact."""
    p, ref = bare(), bare()
    args = inputs()
    armed = {"on": False}

    def grad_on(module: nn.Module, inputs: Any) -> None:
        if armed["on"]:
            torch.set_grad_enabled(True)

    with torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        for pipe in (p, ref):  # registered after opening: runs after the session's own hook
            pipe.transformer.blocks[-1].register_forward_pre_hook(grad_on)
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
        assert replays(session)
        armed["on"] = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torchferry.OffloadWarning)  # a block run with grad
            outs = [run(pipe, args) for pipe in (p, ref)]
        armed["on"] = False
        assert torch.equal(outs[0], outs[1])
        # The handlers ended the step: the load's copy is left to the wait, as recorded on the pack.
        assert session.engine.deferred == frozenset()
        assert session.engine.store.units["blocks.0"].packs[0].watched == {0: -1}
        junk = list(spoil_slots(session))
        del junk
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


@pytest.mark.parametrize("failed_before", [False, True])
def test_a_session_dropped_after_an_interrupted_replay_leaves_kept_weights_at_host_memory(
    failed_before: bool,
) -> None:
    """A replayed step interrupted inside a block (its record of the packs left behind), then the
    session and pipeline dropped without close(): a weight kept elsewhere owns its host memory (the
    pack undocks by what its memory says), not a slot freed with the session; also when an earlier
    replayed step failed and was aborted (the replay runs on over the storages it was built with)."""
    p, ref = bare(), bare()
    args = inputs()
    kept = p.transformer.blocks[3].fc1.weight
    expected = ref.transformer.blocks[3].fc1.weight.detach().clone()
    armed = {"on": False}

    def interrupt(module: nn.Module, inputs: Any) -> None:
        if armed["on"]:
            raise Interrupt()

    p.transformer.blocks[3].register_forward_pre_hook(interrupt)
    session = torchferry.offload(p.transformer, strategy="layerwise", device="cpu")
    for _ in range(3):
        run(p, args)
    if failed_before:
        (replay,) = replays(session)
        start = sorted(replay.segments)[-1]
        original = replay.segments[start]
        stop, fns, firsts, seconds, key, _ = original

        def boom(a: Any, b: Any) -> None:
            raise RuntimeError("a failed stop")

        replay.segments[start] = (stop, (*fns, boom), (*firsts, None), (*seconds, None), key, False)
        with pytest.raises(RuntimeError, match="a failed stop"):
            run(p, args)
        replay.segments[start] = original
        for _ in range(3):
            run(p, args)
        assert replays(session) == [replay]
        del replay, fns, firsts, seconds  # (they hold the slots' memory)
    assert replays(session)
    armed["on"] = True
    with pytest.raises(Interrupt):
        run(p, args)
    sizes = [entry[1].data.numel() for entry in session.engine.slots.slots.values()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a session dropped without close()
        del p, session
        gc.collect()
    junk = [torch.full((n,), 7, dtype=torch.uint8) for n in sizes for _ in range(64)]
    assert torch.equal(kept.detach(), expected)
    del junk


@pytest.mark.parametrize("where", ["settle", "to_host"])
def test_a_second_signal_while_the_record_is_written_loses_nothing(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal landing as a replay writes the packs' record (a hand-over at a skipped block, then
    `settle`), or as the abort after a failed stop undocks the packs (its first `Pack.to_host`): the
    replay stays to write the record again, and where each pack is docked is read from memory when
    the step is abandoned, so every weight is its own between calls and the next calls are exact."""
    p, ref = bare(), bare()
    args = inputs()
    with torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
        (replay,) = replays(session)
        once = {"armed": where == "settle"}
        owner: Any = type(replay) if where == "settle" else Pack
        method = getattr(owner, where)

        def cut(self: Any, *rest: Any) -> Any:
            if once["armed"]:
                once["armed"] = False
                raise Interrupt()
            return method(self, *rest)

        monkeypatch.setattr(owner, where, cut)
        if where == "settle":  # a forward that skips block 4 hands over at block 5
            with pytest.raises(Interrupt), torch.no_grad():
                p.transformer(*args, skip=(4,))
        else:  # a stop that fails after its moves, then the abort is cut short
            start = sorted(replay.segments)[len(replay.segments) // 2]
            original = replay.segments[start]
            stop, fns, firsts, seconds, key, _ = original

            def boom(a: Any, b: Any) -> None:
                once["armed"] = True  # the abort's first undock is cut short
                raise Interrupt()

            replay.segments[start] = (stop, (*fns, boom), (*firsts, None), (*seconds, None), key, False)
            with pytest.raises(Interrupt):
                run(p, args)
            replay.segments[start] = original
        assert not once["armed"]
        exact_from_here(p, ref, args, session)
    assert same_state(p, ref)


@pytest.mark.parametrize("replayed", [True, False])
def test_a_signal_as_an_exchange_returns_leaves_every_weight_its_own(replayed: bool) -> None:
    """A real signal handled right after a storage exchange returns, before the pack's record says
    so (CPython checks for signals after every C call): a replayed step's undock of a block with a
    buffer, or a handler's dock. The next step start finds where each pack is from memory: no
    weight reads a slot between calls, and the next calls are exact."""
    p, ref = toy.build(0), toy.build(0)  # blocks with a buffer: their replayed moves are Python
    args = inputs()
    seen = {"n": 0}

    def on_signal(signum: int, frame: Any) -> None:
        raise Interrupt()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and getattr(arg, "__name__", "") == "_swap_data_ptr_":
            seen["n"] += 1
            if seen["n"] == 4:
                sys.setprofile(None)
                signal.raise_signal(signal.SIGINT)

    before = signal.signal(signal.SIGINT, on_signal)
    try:
        with torchferry.offload(p.transformer, strategy="layerwise", device="cpu") as session:
            for _ in range(3 if replayed else 0):
                assert torch.equal(run(p, args), run(ref, args))
            assert bool(replays(session)) is replayed
            sys.setprofile(profile)
            try:
                with pytest.raises(Interrupt):
                    run(p, args)
            finally:
                sys.setprofile(None)
            exact_from_here(p, ref, args, session)
        assert same_state(p, ref)
    finally:
        signal.signal(signal.SIGINT, before)
