"""Shared pytest configuration: the ``--update-golden`` flag, CUDA-only skips, no saved profile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_saved_profile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests never read this machine's `torchferry probe` profile: it points at an empty folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHFERRY_PROFILE", str(Path(tmp_path_factory.getbasetemp()) / "no-profile.json"))
        yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/**/*.txt from the current code instead of comparing against them",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
