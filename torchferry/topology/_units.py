"""Reading byte counts and rates as people write them (``24GiB``, ``25GB/s``), and device budgets.

Printing them is `torchferry.policies.format_bytes`.
"""

from __future__ import annotations

import re
from decimal import Decimal

from torchferry._errors import PlanError

__all__ = ["MAX_BYTES", "memory_bytes", "parse_bytes", "parse_rate", "show_int", "too_large"]

#: The largest byte count a size may name: 2**63 - 1 (8 EiB). Budgets are exchanged between the ranks
#: of a process group as signed 64-bit integers and counted by the kernel in them, and no machine
#: holds more; a size past it is refused where it is read, not met as an overflow later.
MAX_BYTES = (1 << 63) - 1

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, *, bare_bytes: bool = True) -> int:
    """``"24GiB"`` -> 25769803776; decimal (GB) and binary (GiB) units, case-insensitive.

    With ``bare_bytes=False`` a number without a unit (``"24"``) is refused rather than read as bytes,
    since a person who types it may mean GiB; every budget option reads its text this way. A size
    over `MAX_BYTES` is a ``ValueError`` too.
    """
    match = _NUMBER.match(text)
    unit = match.group(2).lower() if match else ""
    if match is not None and Decimal(match.group(1)) > MAX_BYTES:
        raise _TooLarge(too_large(_shown(text)))
    if match is not None and not match.group(2) and not bare_bytes:
        number = match.group(1)
        raise ValueError(f"{number!r} has no unit; write {number}GiB (binary) or {number}GB (decimal)")
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {_shown(text)} as a size; write a number with a unit such as 24GiB, 80GB or 512MiB"
        )
    value = Decimal(match.group(1)) * _UNITS[unit]  # exact: a float of 400 digits is infinite
    if value > MAX_BYTES:
        raise _TooLarge(too_large(_shown(text)))
    return round(value)


class _TooLarge(ValueError):
    """A size over `MAX_BYTES` (a bandwidth says so, not that it cannot be read)."""


def _shown(text: str) -> str:
    """``text`` quoted, cut short when it is long (a message stays one line)."""
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}...{text[-8:]!r} ({len(text)} characters)"


def too_large(shown: str) -> str:
    """Why a size over `MAX_BYTES` (``shown`` as the caller quotes it) is refused."""
    return (
        f"{shown} is more than 8 EiB (2**63 - 1 bytes), the most a size can name (budgets are "
        "exchanged and counted as signed 64-bit integers, and no machine holds more); give the size "
        "of the memory meant"
    )


def parse_rate(text: str) -> float:
    """``"25GB/s"`` -> 25e9 bytes per second."""
    body = text.strip()
    if not body.lower().endswith("/s"):
        raise ValueError(f"cannot read {text!r} as a bandwidth; write a size per second such as 25GB/s")
    try:
        value = parse_bytes(body[:-2])
    except _TooLarge:
        raise ValueError(
            f"bandwidth {_shown(text)} is more than 8 EiB per second (2**63 - 1 bytes), faster than any "
            "link; write the link's rate, such as 25GB/s"
        ) from None
    except ValueError:
        raise ValueError(
            f"cannot read {text!r} as a bandwidth; write a size per second such as 25GB/s"
        ) from None
    if value <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive")
    return float(value)


def memory_bytes(value: int | str, where: str = "device_memory") -> int:
    """A device budget given as bytes (``25769803776``) or as text (``"24GiB"``, ``"80GB"``), in bytes.

    This is what every ``device_memory=`` and ``host_memory=`` accepts; ``where`` names the argument
    in the error. Text without a unit (``"24"``: bytes or GiB?), a size that does not parse, one
    that is not positive, or one over `MAX_BYTES`, is a `PlanError`; another type is a ``TypeError``.
    An int is bytes.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{where} must be a number of bytes or a size such as '24GiB', "
            f"got {type(value).__name__} {value!r}"
        )
    if isinstance(value, str):
        try:
            value = parse_bytes(value, bare_bytes=False)
        except ValueError as exc:
            raise PlanError(f"{where}: {exc}") from None
    if value <= 0:
        raise PlanError(f"{where} must be a positive number of bytes, got {show_int(value)}")
    if value > MAX_BYTES:
        raise PlanError(f"{where}: {too_large(show_int(value))}")
    return value


def show_int(value: int) -> str:
    """An int as text, its digits cut short when there are many."""
    text = str(value) if value.bit_length() < 10_000 else f"an int of {value.bit_length()} bits"
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} digits)"
