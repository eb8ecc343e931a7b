"""The planner's refusals in `torchferry plan`'s words: flags for keywords, no plan digests.

`policies.tiers` and the runtime word their errors for the Python API (``host_memory=``,
``config.host_memory_bytes``, ``strategy='layerwise'``, ``plan 4b81edf0``); a user of the command
line set none of those, so `for_the_command_line` says the same with the flags that set them.
"""

from __future__ import annotations

import re

__all__ = ["for_the_command_line"]

#: `policies.tiers`'s refusal of a host budget too small even for the file tier (see `_too_small`).
_TOO_SMALL = re.compile(
    r"host budget (?P<budget>\S+ \S+) \(config\.host_memory_bytes\) is too small for plan [0-9a-f]+: "
    r"(?P<body>even with packs read from the checkpoint \(the file tier\) its host buffers need "
    r"(?P<need>\S+ \S+) \((?P<slots>\d+) staging slots of (?P<largest>\S+ \S+), the largest pack read; "
    r".*?\)); raise host_memory= to \S+ \S+"
    r"(?:, or stream the blocks of '(?P<holder>[^']+)' \(strategy='layerwise' with it selected\) so the "
    r"largest pack read is a block, not (?P<biggest>\S+) \((?P<biggest_size>\S+ \S+)\))?$"
)

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


def _flag_size(size: str) -> str:
    """``"50.6 MiB"`` as a flag takes it: ``50.6MiB``."""
    return size.replace(" ", "")


def for_the_command_line(text: str) -> str:
    """``text``, an error worded for the Python API, worded for ``torchferry plan``."""
    match = _TOO_SMALL.match(text)
    if match is not None:
        need = match["need"]
        said = (
            f"--host-memory {match['budget']} is too small for this plan: {match['body']}; pass "
            f"--host-memory {_flag_size(need)} or more"
        )
        holder = match["holder"]
        if holder is not None:
            if match["largest"] == match["biggest_size"]:  # the whole component is the largest pack read
                said += (
                    f", or stream the blocks of {holder!r} (--strategy layerwise) so the largest pack read "
                    f"is a block, not {match['biggest']} ({match['biggest_size']})"
                )
            else:  # too large to read through the staging slots, so held in host memory
                said += (
                    f", or stream the blocks of {holder!r} (--strategy layerwise), so that "
                    f"{match['biggest']} ({match['biggest_size']}), kept whole in host memory here, "
                    "can be read from the checkpoint a block at a time"
                )
        return said
    for pattern, flag in _FLAGS:
        text = pattern.sub(flag, text)
    return text
