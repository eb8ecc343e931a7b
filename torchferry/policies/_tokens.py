"""The tokens of the schedule text, below the IR: byte counts and names, quoted where they could misread.

The IR prints an op's line with them (an op's ``repr`` is its text line), `_text` a whole schedule,
and every message naming a size prints it with `format_bytes`.
"""

from __future__ import annotations

import json
import re

__all__ = ["NUMBER", "UNIT_NAMES", "format_bytes", "format_name", "natural_key"]

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
#: The units a byte count may carry in the text.
UNIT_NAMES = {"B", "KiB", "MiB", "GiB", "TiB"}
#: The keywords of the text, which a bare name must not read as (nor as a `NUMBER`).
_KEYWORDS = {"->", "from", "chunks", "(none)", "before", "after", "entry", "exit", "slot", "step-entry"}
NUMBER = re.compile(r"\d+(\.\d+)?")


def natural_key(path: str) -> tuple[tuple[int, str], ...]:
    """Sort key that orders ``blocks.2`` before ``blocks.10``: a dotted path's ASCII-digit parts as
    numbers, after the other parts."""
    return tuple((int(p), "") if p.isascii() and p.isdigit() else (-1, p) for p in path.split("."))


def format_bytes(nbytes: int, *, exact: bool = True) -> str:
    """``670.2 MiB (702788608)``: a binary-unit figure, then the exact count unless it reads in bytes."""
    for name, size in _UNITS:
        if abs(nbytes) >= size:
            human = f"{nbytes / size:.1f} {name}"
            return f"{human} ({nbytes})" if exact else human
    return f"{nbytes} B"


def format_name(text: str) -> str:
    """A name (a unit, an anchor, a slot) as one token: bare, or a JSON string where it is empty,
    holds whitespace or quotes, or could read as a keyword or a number."""
    if (
        not text
        or text in _KEYWORDS
        or text.startswith("#")
        or '"' in text
        or NUMBER.fullmatch(text)
        or not text.isprintable()
        or " " in text
    ):
        return json.dumps(text)
    return text
