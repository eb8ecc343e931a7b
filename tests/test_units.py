"""Sizes and bandwidths as people type them on the command line."""

from __future__ import annotations

import re

import pytest

from torchferry import PlanError
from torchferry.topology import OffloadConfig, memory_bytes, parse_bytes, parse_rate


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


_TOO_LARGE = (
    " is more than 8 EiB (2**63 - 1 bytes), the most a size can name (budgets are exchanged and counted "
    "as signed 64-bit integers, and no machine holds more); give the size of the memory meant"
)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("1" * 400 + "GiB", "'11111111111111111111'...'11111GiB' (403 characters)"),
        ("8388608TiB", "'8388608TiB'"),
        ("9223372036854775808", "'9223372036854775808'"),
    ],
)
def test_a_size_past_2_63_bytes_is_refused_not_overflowed(text: str, shown: str) -> None:
    """A size of 2**63 bytes or more (400 digits too) is a ValueError saying so, never an OverflowError;
    one byte less is read exactly."""
    with pytest.raises(ValueError, match=re.escape(shown + _TOO_LARGE)):
        parse_bytes(text, bare_bytes=False)
    assert parse_bytes("9223372036854775807B") == 2**63 - 1
    assert parse_bytes("8388607.5TiB") == 8388607 * 2**40 + 2**39


def test_a_rate_past_2_63_bytes_per_second_says_it_is_too_large() -> None:
    """A bandwidth of 400 digits is refused as too large, not as unreadable and not with an OverflowError."""
    message = (
        "bandwidth '11111111111111111111'...'1111GB/s' (404 characters) is more than 8 EiB per second "
        "(2**63 - 1 bytes), faster than any link; write the link's rate, such as 25GB/s"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_rate("1" * 400 + "GB/s")


@pytest.mark.parametrize("where", ["host_memory", "device_memory"])
@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("1" * 400 + "GiB", "'11111111111111111111'...'11111GiB' (403 characters)"),
        (2**63, "9223372036854775808"),
        (10**400, "10000000000000000000...00000000 (401 digits)"),
    ],
)
def test_a_budget_past_2_63_bytes_is_a_plan_error(where: str, value: object, shown: str) -> None:
    """host_memory= and device_memory= (text or int) past 2**63 - 1 bytes are a PlanError naming the
    argument, as is an OffloadConfig field of that size: refused where read, never exchanged later."""
    with pytest.raises(PlanError, match=re.escape(f"{where}: {shown}{_TOO_LARGE}")):
        memory_bytes(value, where)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=re.escape(f"OffloadConfig.{where}_bytes: {shown}{_TOO_LARGE}")):
        OffloadConfig(**{f"{where}_bytes": value})
    assert memory_bytes(2**63 - 1, where) == 2**63 - 1


def test_plan_with_a_400_digit_host_memory_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --host-memory 111...1GiB`` (400 digits) is a one-line usage error and status 2, no traceback."""
    from torchferry.cli import main

    assert main(["plan", "flux.1-dev", "--device-memory", "24GiB", "--host-memory", "1" * 400 + "GiB"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "torchferry plan: error: argument --host-memory: '11111111111111111111'...'11111GiB' (403 "
        f"characters){_TOO_LARGE} (see torchferry plan --help)\n"
    )
