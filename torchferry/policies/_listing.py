"""`format_schedule`: a schedule's canonical text (`_text`) with the ``# sim:`` line `simulate` derives.

The one module that holds both the text form and the simulator, so neither needs the other: the
summary is `simulate` under `DEFAULT_COST` (documented there), and `parse_schedule` ignores it.
"""

from __future__ import annotations

from torchferry.policies._ir import Schedule
from torchferry.policies._sim import DEFAULT_COST, simulate
from torchferry.policies._text import format_text

__all__ = ["format_schedule"]


def format_schedule(schedule: Schedule, *, sim: bool = True) -> str:
    """The canonical text of ``schedule``; ``sim`` appends the derived ``# sim:`` summary line."""
    text = format_text(schedule)
    if not sim:
        return text
    return f"{text}{simulate(schedule, DEFAULT_COST).summary()}\n"
