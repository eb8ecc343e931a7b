"""A block's hook runs from the block's forward, not as a forward pre hook ([Note: block forwards] in
`torchferry.runtime.executor._hooks`): what a user sees of it, and what happens to hooks and forwards
other code sets on a block before, during and after a session."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

import torchferry
from torchferry.testing import toy


def _in_slot(engine: Any, weight: torch.Tensor) -> bool:
    """Whether ``weight`` views one of ``engine``'s slots (re-pointed at it, or docked there)."""
    buffers = [b.data for _, b in engine.slots.slots.values()]
    slots = {t.untyped_storage().data_ptr() for t in buffers} | {t.data_ptr() for t in buffers}
    return weight.untyped_storage().data_ptr() in slots


@torch.no_grad()
def test_a_streamed_block_runs_no_pre_hook_and_gets_its_forward_back_at_close() -> None:
    """While the session is open a streamed block has no forward pre hook (torch's slow call path) and
    its forward is an instance function; after close its class's forward and a plain table are back,
    and the output is the resident one at every step."""
    p, ref = toy.build(0), toy.build(0)
    blocks = list(p.transformer.blocks)
    with torchferry.offload(p, strategy="layerwise") as session:
        assert all(not b._forward_pre_hooks and "forward" in vars(b) for b in blocks)
        assert session.hook_count == sum(
            len(m._forward_pre_hooks) + len(m._forward_hooks) for m in p.modules()
        )
        for _ in range(2):
            assert torch.equal(p("a cat"), ref("a cat"))
    assert all("forward" not in vars(b) and type(b._forward_pre_hooks) is OrderedDict for b in blocks)
    assert torch.equal(p("a cat"), ref("a cat"))


@torch.no_grad()
def test_a_pre_hook_registered_on_a_block_after_opening_sees_the_weights_it_runs_with() -> None:
    """A user's pre hook registered on a block while the session is open runs after torchferry's, which
    becomes a pre hook again, first: it reads the block's weights in their slot, every later step,
    and its handle still removes it after close."""
    p, ref = toy.build(0), toy.build(0)
    seen: list[bool] = []
    looked: list[torch.Tensor] = []
    with torchferry.offload(p, strategy="layerwise", prefetch_depth=1) as session:
        assert torch.equal(p("a cat"), ref("a cat"))  # a replayed step after this one
        engine = session.engine

        def look(module: torch.nn.Module, args: object) -> None:
            seen.append(_in_slot(engine, module.q.weight))
            looked.append(module.q.weight.detach().clone())

        block = p.transformer.blocks[3]
        handle = block.register_forward_pre_hook(look)
        assert "forward" not in vars(block) and len(block._forward_pre_hooks) == 2
        assert next(iter(block._forward_pre_hooks.values())) is not look  # torchferry's first
        for _ in range(2):
            assert torch.equal(p("a cat"), ref("a cat"))
    assert seen and all(seen)
    assert all(torch.equal(w, ref.transformer.blocks[3].q.weight) for w in looked)
    assert list(block._forward_pre_hooks.values()) == [look]
    handle.remove()
    assert not block._forward_pre_hooks
    assert torch.equal(p("a cat"), ref("a cat"))


@torch.no_grad()
def test_forwards_other_code_sets_on_a_block_before_or_during_a_session_are_kept() -> None:
    """An instance forward set before opening is what torchferry's calls, and is given back at close; one
    set over torchferry's during the session (another library's wrapper) is left at close, and
    torchferry's under it passes through from then on."""
    p, ref = toy.build(0), toy.build(0)
    calls: list[str] = []

    def wrapping(block: torch.nn.Module, name: str) -> Any:
        inner = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return inner(*args, **kwargs)

        block.forward = forward
        return forward

    before = wrapping(p.transformer.blocks[0], "before")
    with torchferry.offload(p, strategy="layerwise"):
        assert vars(p.transformer.blocks[0])["forward"] is not before
        assert torch.equal(p("a cat"), ref("a cat"))
        during = wrapping(p.transformer.blocks[1], "during")
        assert torch.equal(p("a cat"), ref("a cat"))
    assert vars(p.transformer.blocks[0])["forward"] is before
    assert vars(p.transformer.blocks[1])["forward"] is during
    calls.clear()
    assert torch.equal(p("a cat"), ref("a cat"))
    steps = len(calls) // 2
    assert steps > 0 and calls == ["before", "during"] * steps
