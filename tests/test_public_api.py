"""The public surface: every name in each subpackage's ``__all__`` imports and is what it says."""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable

import pytest

import torchferry

PACKAGES = ["torchferry", "torchferry.topology", "torchferry.policies", "torchferry.runtime"]
#: Every package with a public ``__all__``, pinned whole in tests/golden/public_api.txt.
SURFACE = [*PACKAGES, "torchferry.cli", "torchferry.testing"]
ACCEPT = "python -m pytest tests/test_public_api.py --update-golden"


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_imports(name: str) -> None:
    """Each name listed in ``__all__`` is an attribute of its package."""
    module = importlib.import_module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert missing == []


def test_error_family() -> None:
    """Every torchferry error derives from OffloadError; PlanError is also a ValueError."""
    assert issubclass(torchferry.PlanError, torchferry.OffloadError)
    assert issubclass(torchferry.PlanError, ValueError)
    assert issubclass(torchferry.ScheduleError, torchferry.OffloadError)
    assert issubclass(torchferry.ExecutionError, torchferry.OffloadError)


def _kind(value: object) -> str:
    if isinstance(value, types.ModuleType):
        return "module"
    if inspect.isclass(value):
        return "class"
    if type(value).__module__ in ("typing", "typing_extensions") or isinstance(value, types.UnionType):
        return "type alias"
    if callable(value):
        return "function"
    return f"value: {type(value).__name__}"


def test_public_surface_is_pinned(golden: Callable[[str, str, str], None]) -> None:
    """Each package's ``__all__`` (names, kinds) equals tests/golden/public_api.txt: new exports are diffs."""
    lines = []
    for name in SURFACE:
        module = importlib.import_module(name)
        lines += [f"{name}.{n}  {_kind(getattr(module, n))}" for n in sorted(module.__all__)]
    golden("public_api.txt", "\n".join(lines) + "\n", ACCEPT)
