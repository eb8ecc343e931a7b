"""The planner's refusals in `torchferry plan`'s words: flags for keywords, no plan digests.

The host planner's refusals carry their figures and word themselves for the command line
(`policies.HostBudgetTooSmall.message`); the other refusals name keywords and config fields of the
Python API (``config.device_memory_bytes``, ``strategy='layerwise'``, ``plan 4b81edf0``), which a user
of the command line set none of, so `for_the_command_line` says the same with the flags that set them.
"""

from __future__ import annotations

import re

__all__ = ["for_the_command_line"]

#: Python keywords and config fields, and the flag that sets each on the command line.
_FLAGS = (
    (re.compile(r"\s*\(config\.host_memory_bytes\)"), " (--host-memory)"),
    (re.compile(r"\s*\(config\.device_memory_bytes\)"), " (--device-memory)"),
    (re.compile(r"a larger host_memory="), "a larger --host-memory"),
    (re.compile(r"host_memory=<bytes>"), "--host-memory SIZE"),
    (re.compile(r"raise host_memory= to (\S+) (\S+)"), r"raise --host-memory to \1\2"),
    (re.compile(r"host_memory="), "--host-memory"),
    (re.compile(r"strategy='(\w+)'"), r"--strategy \1"),
    (re.compile(r" (?:for|of) plan [0-9a-f]{8}\b"), " for this plan"),
)


def for_the_command_line(text: str) -> str:
    """``text``, an error worded for the Python API, worded for ``torchferry plan``."""
    for pattern, flag in _FLAGS:
        text = pattern.sub(flag, text)
    return text
