"""What moves where, when: pure functions from a plan and a step to a checked transfer schedule."""

from __future__ import annotations

# Imports written ``name as name`` are for the layers above, which enter only through this file
# (tests/test_layering.py); they are not public and not in ``__all__``.
from torchferry.policies._auto import Choice, auto, choose
from torchferry.policies._builtin import cached, distributed_layerwise, layerwise, model_level, none
from torchferry.policies._check import INVARIANTS, check
from torchferry.policies._ir import (
    DEVICE,
    OP_KINDS,
    OP_STREAM,
    Op,
    OpKind,
    Placement,
    Policy,
    Schedule,
    Slot,
    SlotKind,
    Step,
    StreamName,
    When,
    index_free,
    is_index_free,
    rest_unit,
)
from torchferry.policies._layout import layout as layout
from torchferry.policies._layout import shard_nbytes
from torchferry.policies._sim import DEFAULT_COST, CostModel, SimReport, Span, simulate, steady_schedule
from torchferry.policies._text import Mark, format_bytes, format_marked, format_schedule, parse_schedule

__all__ = [
    "DEFAULT_COST",
    "DEVICE",
    "INVARIANTS",
    "OP_KINDS",
    "OP_STREAM",
    "Choice",
    "CostModel",
    "Mark",
    "Op",
    "OpKind",
    "Placement",
    "Policy",
    "Schedule",
    "SimReport",
    "Slot",
    "SlotKind",
    "Span",
    "Step",
    "StreamName",
    "When",
    "auto",
    "cached",
    "check",
    "choose",
    "distributed_layerwise",
    "format_bytes",
    "format_marked",
    "format_schedule",
    "index_free",
    "is_index_free",
    "layerwise",
    "model_level",
    "none",
    "parse_schedule",
    "rest_unit",
    "shard_nbytes",
    "simulate",
    "steady_schedule",
]
