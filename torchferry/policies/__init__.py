"""What moves where, when: pure functions from a plan and a step to a checked transfer schedule."""

from __future__ import annotations

from torchferry.policies._ir import (
    DEVICE,
    OP_KINDS,
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
    rest_unit,
)

__all__ = [
    "DEVICE",
    "OP_KINDS",
    "Op",
    "OpKind",
    "Placement",
    "Policy",
    "Schedule",
    "Slot",
    "SlotKind",
    "Step",
    "StreamName",
    "When",
    "rest_unit",
]
