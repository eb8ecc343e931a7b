"""The request's vocabulary and field checks: the strategies, transfers and components it may name.

Every validator here is an attrs validator (or a check it builds on) whose message names the field
as ``<Class>.<field>``: ``TypeError`` for a wrong type, `PlanError` for a bad value. `OffloadConfig`,
`ParallelLayout` and the older forms of the request (`from_legacy`, `from_mapping`) all check
their values with them, so one bad value reads the same whichever way it came in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar, cast

import attrs

from torchferry._errors import PlanError
from torchferry.topology._frozen import WHEN_SET
from torchferry.topology._storage import STORAGE_DTYPES
from torchferry.topology._units import MAX_BYTES, memory_bytes, too_large

__all__ = [
    "COMPONENT_NAMES",
    "MAX_PREFETCH_DEPTH",
    "STRATEGIES",
    "TRANSFERS",
    "WHEN_SET",
    "SelectableComponent",
    "Strategy",
    "Transfer",
    "bool_field",
    "choices",
    "int_field",
    "memory_or_none",
    "non_negative",
    "one_of",
    "positive",
    "positive_or_none",
    "require_bool",
    "require_int",
    "ring_depth",
    "storage_dtype",
    "storage_dtype_name",
    "type_name",
]

Strategy = Literal["none", "model_level", "layerwise", "distributed_layerwise"]
Transfer = Literal["rank-local", "allgather"]
SelectableComponent = Literal["dit", "text_encoder", "vae"]

STRATEGIES: tuple[Strategy, ...] = ("none", "model_level", "layerwise", "distributed_layerwise")
TRANSFERS: tuple[Transfer, ...] = ("rank-local", "allgather")
COMPONENT_NAMES: tuple[SelectableComponent, ...] = ("dit", "text_encoder", "vae")
#: The deepest prefetch ring a config accepts. A ring of depth d holds d + 1 whole blocks on the
#: device, and a stack of n blocks keeps at most n of them in flight, so depth past the stack's block
#: count only adds slots no block fills; the longest stack of a known model has 60 blocks. The bound
#: keeps every schedule small (an unbounded depth built 2**62 slots and never finished).
MAX_PREFETCH_DEPTH = 256


_T = TypeVar("_T")
_S = TypeVar("_S", bound=str)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def type_name(value: object) -> str:
    """The name of ``value``'s type, as messages about a wrong type quote it."""
    return type(value).__name__


def require_int(where: str, value: object) -> int:
    """``value`` if it is an int (not a bool), else a ``TypeError`` naming ``where``."""
    if not _is_int(value):
        raise TypeError(f"{where} must be an int, got {type_name(value)} {value!r}")
    return cast("int", value)


def require_bool(where: str, value: object) -> bool:
    """``value`` if it is a bool, else a ``TypeError`` naming ``where``."""
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be a bool, got {type_name(value)} {value!r}")
    return value


def choices(values: Iterable[str]) -> str:
    """``values`` quoted and comma-separated, for a message that lists what may be chosen."""
    return ", ".join(repr(v) for v in values)


# ---------------------------------------------------------------------------------------------
# Field validators: every message names the field as ``<Class>.<field>``


def _where(instance: object, attribute: attrs.Attribute[_T]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def positive(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    """An int field of at least 1."""
    where = _where(instance, attribute)
    if require_int(where, value) < 1:
        raise PlanError(f"{where} must be >= 1, got {value}")


def ring_depth(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    """A prefetch depth: an int from 1 to `MAX_PREFETCH_DEPTH`."""
    where = _where(instance, attribute)
    depth = require_int(where, value)
    if depth < 1:
        raise PlanError(f"{where} must be >= 1, got {value}")
    if depth > MAX_PREFETCH_DEPTH:
        raise PlanError(
            f"{where} must be at most {MAX_PREFETCH_DEPTH} (blocks in flight ahead of the one computing; "
            f"more than a stack's block count buys nothing), got {_show_int(depth)}"
        )


def _show_int(value: int) -> str:
    """An int as text, its digits cut short when there are many (a message stays short)."""
    text = str(value) if value.bit_length() < 10_000 else f"an int of {value.bit_length()} bits"
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} digits)"


def non_negative(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    """An int field of at least 0."""
    where = _where(instance, attribute)
    if require_int(where, value) < 0:
        raise PlanError(f"{where} must be >= 0, got {value}")


def positive_or_none(instance: object, attribute: attrs.Attribute[int | None], value: object) -> None:
    """A byte count above 0 and at most `MAX_BYTES`, or ``None`` for none given."""
    if value is None:
        return
    where = _where(instance, attribute)
    count = require_int(where, value)
    if count <= 0:
        raise PlanError(f"{where} must be a positive number of bytes or None, got {_show_int(count)}")
    if count > MAX_BYTES:
        raise PlanError(f"{where}: {too_large(_show_int(count))}")


def memory_or_none(value: int | str | None, where: str) -> int | None:
    """A memory budget field's value: bytes, or a size as text (``"32GiB"``) read with `memory_bytes`,
    whose error names ``where``; any other type passes on for `positive_or_none` to name."""
    if isinstance(value, str):
        return memory_bytes(value, where)
    return value


def bool_field(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    """A field that must be a bool (not an int that looks like one)."""
    require_bool(_where(instance, attribute), value)


def int_field(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    """A field that must be an int (not a bool), of any value."""
    require_int(_where(instance, attribute), value)


def storage_dtype_name(value: Any) -> Any:
    """A torch dtype as its name (``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"``); anything else as
    given, for the validator to judge (this layer never imports torch: a dtype is told by its text)."""
    if value is None or isinstance(value, str) or type(value).__name__ != "dtype":
        return value
    return str(value).removeprefix("torch.")


def storage_dtype(instance: object, attribute: attrs.Attribute[str | None], value: object) -> None:
    """A dtype to store weights in: one of `STORAGE_DTYPES`, or ``None`` for each tensor's own."""
    if value is None:
        return
    where = _where(instance, attribute)
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a dtype or its name, got {type_name(value)} {value!r}")
    if value not in STORAGE_DTYPES:
        raise PlanError(
            f"{where} is {value!r}; weights can be stored in one of {choices(STORAGE_DTYPES)} (cast to "
            "their own dtype around each forward, as diffusers' enable_layerwise_casting does)"
        )


def one_of(allowed: tuple[_S, ...]) -> Callable[[object, attrs.Attribute[_S], object], None]:
    """A validator that holds a str field to the values ``allowed``."""

    def check(instance: object, attribute: attrs.Attribute[_S], value: object) -> None:
        where = _where(instance, attribute)
        if not isinstance(value, str):
            raise TypeError(f"{where} must be a str, got {type_name(value)} {value!r}")
        if value not in allowed:
            raise PlanError(f"{where} is {value!r}; choose one of {choices(allowed)}")

    return check
