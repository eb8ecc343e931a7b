"""Topology test setup: every test starts with discovery's once-per-class warning caches empty."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from torchferry.topology._reading import reset_warning_caches


@pytest.fixture(autouse=True)
def _fresh_warning_caches() -> Iterator[None]:
    reset_warning_caches()
    yield
    reset_warning_caches()
