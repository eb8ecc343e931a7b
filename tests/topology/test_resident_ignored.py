"""Rule 2 of `resolve`: ``resident_layers`` that would be ignored is said, never silent: a strategy or
selection with no DiT ring for it to head, and a DiT left out of ``Declaration.resident_dit_paths``
while another is declared."""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest

import torchferry
from torchferry import OffloadWarning, PlanError
from torchferry.testing import toy
from torchferry.topology import OffloadConfig, discover, resolve


def _warns(message: str) -> Any:
    return pytest.warns(OffloadWarning, match=f"^{re.escape(message)}$")


@pytest.mark.parametrize("strategy", ["model_level", "none"])
def test_resident_layers_under_a_strategy_without_a_ring_warn_that_they_are_ignored(strategy: str) -> None:
    """resident_layers=3 with a strategy that streams no ring warns that it is ignored (the request is
    not explicit), and the plan is the one without it."""
    topo = discover(toy.build(0, blocks=4))
    message = (
        f"resident_layers=3 keeps the leading blocks of a streamed DiT on the device, and "
        f"strategy={strategy!r} streams no block ring; it is ignored"
    )
    with _warns(message):
        plan = resolve(topo, OffloadConfig(strategy=strategy, resident_layers=3))  # type: ignore[arg-type]
    plain = resolve(topo, OffloadConfig(strategy=strategy))  # type: ignore[arg-type]
    assert plan.components == plain.components


def test_resident_layers_without_the_dit_selected_are_refused_when_explicit() -> None:
    """An explicit selection that leaves the DiT out has no ring for resident_layers: a PlanError."""
    topo = discover(toy.build(0, blocks=4))
    message = (
        "resident_layers=2 keeps the leading blocks of a streamed DiT on the device, and the DiT is not "
        "selected (components=); set resident_layers=0"
    )
    with pytest.raises(PlanError, match=f"^{re.escape(message)}$"):
        resolve(topo, OffloadConfig(strategy="layerwise", components={"text_encoder"}, resident_layers=2))


def test_a_dit_left_out_of_the_resident_declaration_is_named() -> None:
    """With two expert DiTs of which only one is declared resident, offload(resident_layers=3) keeps
    three blocks of that one and warns that the other streams all its blocks."""
    pipe = toy.build(0, two_experts=True, blocks=6)
    declaration = attrs.evolve(type(pipe)._offload_plan, resident_dit_paths={"transformer"})
    message = (
        "resident_layers=3 applies to the DiTs declared in Declaration.resident_dit_paths "
        "('transformer'); 'transformer_2' is not declared there, so all its blocks stream"
    )
    with _warns(message):
        session = torchferry.offload(pipe, device="cpu", resident_layers=3, declaration=declaration)
    with session:
        heads = {c.path: c.stacks[0].resident_head for c in session.plan.components if c.kind == "dit"}
    assert heads == {"transformer": 3, "transformer_2": 0}


def test_a_dit_not_declared_resident_warns_at_offload() -> None:
    """offload(model, resident_layers=3) on a pipeline whose DiT is not declared resident warns that
    every block streams (rule 2's warning reaches the caller of offload)."""
    pipe = toy.build(0, blocks=4)
    declaration = attrs.evolve(type(pipe)._offload_plan, resident_dit_paths=frozenset())
    message = (
        "resident_layers=3 was requested, but no DiT of this pipeline is declared in "
        "Declaration.resident_dit_paths (declared: none; DiTs: 'transformer'); all blocks will stream"
    )
    with _warns(message):
        session = torchferry.offload(pipe, device="cpu", resident_layers=3, declaration=declaration)
    with session:
        assert session.plan.component("transformer").stacks[0].resident_head == 0
