"""Sizes and bandwidths as people type them on the command line."""

from __future__ import annotations

import re

import pytest

from torchferry.topology import parse_bytes, parse_rate


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("80GB", 80 * 10**9),
        ("512 MiB", 512 * 2**20),
        ("1.5gib", 3 * 2**29),
        ("4096", 4096),
    ],
)
def test_sizes_read_in_decimal_and_binary_units(text: str, expected: int) -> None:
    """Decimal (GB) and binary (GiB) units, any case, optional space, bare bytes."""
    assert parse_bytes(text) == expected


def test_a_bare_number_is_refused_where_a_unit_is_required() -> None:
    """With bare_bytes=False, ``"24"`` is refused with the forms to write instead of read as 24 bytes."""
    message = "'24' has no unit; write 24GiB (binary) or 24GB (decimal)"
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_bytes("24", bare_bytes=False)
    assert parse_bytes("24MiB", bare_bytes=False) == 24 * 2**20


def test_rates_are_sizes_per_second() -> None:
    """``25GB/s`` is 25e9 bytes per second."""
    assert parse_rate("25GB/s") == 25e9
    assert parse_rate("1.5 GiB/s") == 1.5 * 2**30


@pytest.mark.parametrize("text", ["24 GiBs", "lots", "GiB", "-3GB"])
def test_unreadable_sizes_say_how_to_write_them(text: str) -> None:
    """A size that does not parse names itself and shows the expected form."""
    message = f"cannot read {text!r} as a size; write a number with a unit such as 24GiB, 80GB or 512MiB"
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_bytes(text)


def test_unreadable_rates_say_how_to_write_them() -> None:
    """A rate without ``/s``, or a zero one, is refused with the form to use."""
    message = "cannot read '25GB' as a bandwidth; write a size per second such as 25GB/s"
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_rate("25GB")
    with pytest.raises(ValueError, match=re.escape("bandwidth '0GB/s' must be positive")):
        parse_rate("0GB/s")
