"""A block's hook runs from the block's forward, not as a forward pre hook ([Note: block forwards] in
`torchferry.runtime.executor._hooks`): what a user sees of it, and what happens to hooks and forwards
other code sets on a block before, during and after a session."""

from __future__ import annotations

import gc
import pickle
import weakref
from collections import OrderedDict
from typing import Any

import pytest
import torch

import torchferry
from torchferry import ExecutionError
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


@torch.no_grad()
def test_a_forward_put_back_by_other_code_during_a_session_still_runs_the_blocks_hook() -> None:
    """Other code that puts back a forward it kept from before (diffusers' hook registry removing a
    cache hook does) drops torchferry's from the block's forward: the next step start notices and
    runs torchferry's as a pre hook, so the block is still loaded, checked and refused outside a
    step."""
    p, ref = toy.build(0), toy.build(0)
    block = p.transformer.blocks[3]
    kept = block.forward

    def wrapper(*args: Any, **kwargs: Any) -> Any:  # a library's wrapper, set before opening
        return kept(*args, **kwargs)

    block.forward = wrapper
    seen: list[bool] = []
    with torchferry.offload(p, strategy="layerwise") as session:
        block.register_forward_hook(
            lambda module, args, out: seen.append(_in_slot(session.engine, module.q.weight))
        )
        assert torch.equal(p("a cat"), ref("a cat"))
        block.forward = kept  # the library removes its wrapper
        for _ in range(2):
            assert torch.equal(p("a cat"), ref("a cat"))
        with pytest.raises(ExecutionError, match=r"blocks\.3"):
            block(torch.zeros(1, 4, 16))
    assert seen and all(seen)
    assert vars(block)["forward"] is kept and not block._forward_pre_hooks


@torch.no_grad()
def test_a_patch_of_the_block_class_forward_during_a_session_counts() -> None:
    """A patch of the block class's forward made during the session, and its removal, reach the
    wrapped blocks as they reach a resident model's."""
    p, ref = toy.build(0), toy.build(0)
    cls = type(p.transformer.blocks[0])
    plain = cls.forward

    def doubled(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return plain(self, *args, **kwargs) * 2

    with torchferry.offload(p, strategy="layerwise"):
        assert torch.equal(p("a cat"), ref("a cat"))
        cls.forward = doubled  # type: ignore[method-assign]
        try:
            assert torch.equal(p("a cat"), ref("a cat"))
        finally:
            cls.forward = plain  # type: ignore[method-assign]
        assert torch.equal(p("a cat"), ref("a cat"))


@torch.no_grad()
def test_a_block_forward_kept_from_a_session_runs_the_plain_forward_after_close() -> None:
    """A block's forward read while the session is open and called after close runs the block as a
    plain one (torchferry's hook passes through) and holds nothing of the closed session."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, strategy="layerwise") as session:
        p("a cat")
        kept = p.transformer.blocks[2].forward
        engine = weakref.ref(session.engine)
    g = torch.Generator().manual_seed(0)
    hidden = ref.transformer.blocks[2].q.in_features
    args = [torch.randn(*shape, generator=g) for shape in ((1, 4, hidden), (1, hidden), (1, 3, hidden))]
    assert torch.equal(kept(*args), ref.transformer.blocks[2](*args))
    del session
    gc.collect()
    assert engine() is None


@torch.no_grad()
def test_a_block_pickles_plainly_after_a_pre_hook_came_and_went_and_wraps_again() -> None:
    """A pre hook registered on a block during a session and removed after it leaves the block's table
    of pre hooks pickling as a plain `OrderedDict` (nothing of torchferry's runtime in the pickle),
    and a later session runs that block's hook from its forward again."""
    p, ref = toy.build(0), toy.build(0)
    block = p.transformer.blocks[1]
    with torchferry.offload(p, strategy="layerwise"):
        handle = block.register_forward_pre_hook(lambda module, args: None)
        assert torch.equal(p("a cat"), ref("a cat"))
    handle.remove()
    assert b"torchferry.runtime" not in pickle.dumps(p)
    with torchferry.offload(p, strategy="layerwise"):
        assert "forward" in vars(block) and not block._forward_pre_hooks
        assert torch.equal(p("a cat"), ref("a cat"))
    assert "forward" not in vars(block)
