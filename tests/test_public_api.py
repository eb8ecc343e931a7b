"""The public surface: every name in each subpackage's ``__all__`` imports and is what it says."""

from __future__ import annotations

import importlib

import pytest

import torchferry

PACKAGES = ["torchferry", "torchferry.topology", "torchferry.policies", "torchferry.runtime"]


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
