"""Binding: a streamed block's modules read its slot through swapped tables; its tensors never move.

See [Note: binding] in `torchferry.runtime._host`.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import torchferry
from torchferry import OffloadWarning
from torchferry.testing import toy

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def inputs() -> Inputs:
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)


def tables(module: nn.Module) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every submodule's ``_parameters`` and ``_buffers`` dict objects, by module name."""
    return {name: (m._parameters, m._buffers) for name, m in module.named_modules()}


def slot_addresses(session: torchferry.Session) -> set[int]:
    return {buf.data.untyped_storage().data_ptr() for _, buf in session.engine.slots.slots.values()}


def test_a_streamed_block_reads_its_slot_while_its_tensors_stay_at_host() -> None:
    """Inside a no-grad step the block's modules read views into a slot; the weight objects (held by
    anyone) still point at host memory and read its values, state_dict gives host values, and after
    the step every module has its own tables back. Outputs are bit-identical."""
    p, ref = toy.build(0), toy.build(0)
    args = inputs()
    with torch.no_grad():
        expected = [ref.transformer(*args) for _ in range(3)]
    block = p.transformer.blocks[3]
    seen: list[dict[str, Any]] = []
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        held = block.q.weight
        host_address = held.data_ptr()
        own = tables(p)
        reference = ref.transformer.blocks[3].q.weight.detach().clone()

        def probe(module: nn.Module, _: Any) -> None:  # runs after the engine's pre hook
            reading = module.q.weight
            seen.append(
                {
                    "reads_slot": reading.untyped_storage().data_ptr() in slot_addresses(session),
                    "reads_parameter": isinstance(reading, nn.Parameter),
                    "swapped": module.q._parameters is not own["transformer.blocks.3.q"][0],
                    "held_at_host": held.data_ptr() == host_address,
                    "held_values": torch.equal(held, reference),
                    "state_dict": torch.equal(module.state_dict()["q.weight"], reference),
                }
            )

        handle = block.register_forward_pre_hook(probe)
        with torch.no_grad():
            got = [p.transformer(*args) for _ in range(3)]
        handle.remove()
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert len(seen) == 3
        assert all(all(s.values()) for s in seen), seen
        after = tables(p)
        assert all(after[n][0] is own[n][0] and after[n][1] is own[n][1] for n in own)
        assert held.data_ptr() == host_address


def test_a_forward_with_grad_repoints_the_tensors() -> None:
    """With grad enabled the tensors themselves point into the slot (autograd sees the user's
    parameters); the module tables are never swapped."""
    p = toy.build(0)
    args = inputs()
    block = p.transformer.blocks[3]
    seen: list[tuple[bool, bool]] = []
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        own = block.q._parameters

        def probe(module: nn.Module, _: Any) -> None:
            weight = module.q.weight
            seen.append(
                (module.q._parameters is own, weight.untyped_storage().data_ptr() in slot_addresses(session))
            )

        block.register_forward_pre_hook(probe)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)
            p.transformer(*args)
    assert seen == [(True, True)]


def test_a_bound_block_that_runs_with_grad_is_repointed_first() -> None:
    """Loaded under no grad (the load runs at the block before), run with grad: the block's own pre
    hook re-points its tensors before its forward, so autograd sees them."""
    p = toy.build(0)
    args = inputs()
    blocks = p.transformer.blocks
    seen: list[tuple[bool, bool]] = []
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        own = blocks[4].q._parameters

        def grad_on(module: nn.Module, _: Any) -> None:
            torch.set_grad_enabled(True)

        def probe(module: nn.Module, _: Any) -> None:
            weight = module.q.weight
            seen.append(
                (module.q._parameters is own, weight.untyped_storage().data_ptr() in slot_addresses(session))
            )
            torch.set_grad_enabled(False)

        blocks[3].register_forward_hook(lambda m, a, o: grad_on(m, a))
        blocks[4].register_forward_pre_hook(probe)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)
            p.transformer(*args)
    assert seen == [(True, True)]


def test_a_weight_tied_across_blocks_is_repointed_and_exact() -> None:
    """A table holding tensors of two packs (a weight tied across blocks) cannot be swapped alone:
    those packs are re-pointed instead, and the outputs stay bit-identical."""
    p, ref = toy.build(0), toy.build(0)
    for pipe in (p, ref):
        pipe.transformer.blocks[2].fc2.weight = pipe.transformer.blocks[1].fc2.weight
    args = inputs()
    with torch.no_grad():
        expected = [ref.transformer(*args) for _ in range(2)]
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        packs = session.engine.store.packs
        assert packs["transformer.blocks.2"].tables is None
        assert packs["transformer.blocks.3"].tables is not None
        with torch.no_grad():
            got = [p.transformer(*args) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    with torch.no_grad():
        assert torch.equal(p.transformer(*args), expected[0])


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_edits_between_steps_reach_bound_blocks(mode: str) -> None:
    """Edits between steps (in place, and through ``.data``) land in the host copy a bound block
    is loaded from, so the next step computes with them."""
    p, ref = toy.build(0), toy.build(0)
    args = inputs()
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with torchferry.offload(p, strategy="layerwise", device="cpu"):
        with context():
            p.transformer(*args)
        with torch.no_grad():
            p.transformer.blocks[5].fc1.weight.mul_(2)
            p.transformer.blocks[6].fc1.weight.data = p.transformer.blocks[6].fc1.weight.detach() * 3
            ref.transformer.blocks[5].fc1.weight.mul_(2)
            ref.transformer.blocks[6].fc1.weight.mul_(3)
        with context():
            got = p.transformer(*args)
    with torch.no_grad():
        assert torch.equal(got, ref.transformer(*args))
        assert torch.equal(p.transformer.blocks[6].fc1.weight, ref.transformer.blocks[6].fc1.weight)


def test_an_object_written_straight_into_a_module_table_is_refused_at_close() -> None:
    """A weight written into ``_parameters`` directly fires no registration hook: the next step does
    not see it, but ``close()`` looks at every module slot and leaves the new object in place, as it
    does for every replacement it cannot adopt; the step after a registration refuses it."""
    p = toy.build(0)
    args = inputs()
    session = torchferry.offload(p, strategy="layerwise", device="cpu")
    with torch.no_grad():
        p.transformer(*args)
    replacement = nn.Parameter(torch.zeros_like(p.transformer.blocks[5].fc1.weight))
    p.transformer.blocks[5].fc1._parameters["weight"] = replacement
    p.transformer.blocks[5].register_buffer("extra", torch.zeros(1))  # any registration
    with pytest.raises(torchferry.ExecutionError, match="another tensor object"), torch.no_grad():
        p.transformer(*args)
    session.close()
    assert p.transformer.blocks[5].fc1.weight is replacement
