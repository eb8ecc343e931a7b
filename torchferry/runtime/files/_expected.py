"""The tensors a checkpoint is checked against (`expected_specs`), and the words its problems are
listed in; `torchferry.runtime.files._checkpoint_reader` validates with them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeAlias

from torchferry.topology import Block, Component, Plan, TensorSpec, Topology

__all__ = ["Expected", "expected_specs", "plural", "shape_text"]

#: What a checkpoint may be checked against: a plan, a topology, a component, a block or tensors.
Expected: TypeAlias = Plan | Topology | Component | Block | Iterable[TensorSpec]


def shape_text(shape: Iterable[int]) -> str:
    """``shape`` as a list's text: ``[3, 4]``."""
    return str(list(shape))


def expected_specs(expected: Expected) -> list[TensorSpec]:
    """The tensors a checkpoint must hold: persistent ones, each owner once, in a stable order."""
    if isinstance(expected, Plan):
        expected = expected.topology
    specs: Iterable[TensorSpec]
    if isinstance(expected, Topology):
        specs = (t for c in expected.components for t in c.all_tensors())
    elif isinstance(expected, Component):
        specs = expected.all_tensors()
    elif isinstance(expected, Block):
        specs = expected.tensors
    else:
        specs = expected
    seen: set[str] = set()
    kept: list[TensorSpec] = []
    for spec in specs:
        if spec.buffer and not spec.persistent:
            continue
        if spec.name in seen:
            continue
        seen.add(spec.name)
        seen.update(spec.aliases)
        kept.append(spec)
    return kept


def plural(n: int, word: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
