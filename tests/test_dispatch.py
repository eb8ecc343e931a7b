"""Op-kind dispatch is one style everywhere: a table keyed by kind that covers every kind."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from torchferry.policies import OP_KINDS
from torchferry.policies._check import _CHECKS
from torchferry.policies._sim import _REPLAYS
from torchferry.runtime.executor._handlers import _HANDLERS, RANGES


@pytest.mark.parametrize(
    ("name", "table"),
    [("engine handlers", _HANDLERS), ("check", _CHECKS), ("simulate", _REPLAYS), ("profiler ranges", RANGES)],
)
def test_every_dispatcher_covers_every_op_kind(name: str, table: Mapping[str, object]) -> None:
    """Each op-kind table has exactly one entry per kind in ``OP_KINDS``, each callable or named."""
    assert sorted(table) == sorted(OP_KINDS), name
    assert all(callable(v) or isinstance(v, str) for v in table.values()), name
