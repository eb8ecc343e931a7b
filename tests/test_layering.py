"""The layers' dependency direction: runtime -> policies -> topology, never back (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torchferry"
# The one module of topology/ that may read an nn.Module, and so import torch.
TORCH_READERS = {"topology/_discover.py"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # ``from torchferry.x import _y`` reaches a private module as surely as ``torchferry.x._y``.
            names.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name.startswith("_"))
    return names


def _modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).glob("*.py"))


def _package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return "torchferry" if len(parts) == 1 else f"torchferry.{parts[0]}"


SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
ALL_MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("layer", ["topology", "policies"])
def test_pure_layers_never_import_the_runtime(layer: str) -> None:
    """Nothing in topology/ or policies/ imports the runtime, the session or torch.distributed."""
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name
            for name in _imports(path)
            if name.startswith(("torchferry.runtime", "torchferry._session", "torch.distributed"))
        )
        for path in _modules(layer)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_policies_never_import_torch() -> None:
    """Policies decide from names and numbers alone: no module of policies/ imports torch."""
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in _modules("policies")
        if any(name == "torch" or name.startswith("torch.") for name in _imports(path))
    ]
    assert offenders == []


def test_topology_reads_modules_only_in_discover() -> None:
    """Within topology/, only discover imports torch (to read an nn.Module); the rest is plain data."""
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in _modules("topology")
        if str(path.relative_to(PACKAGE)) not in TORCH_READERS
        and any(name == "torch" or name.startswith("torch.") for name in _imports(path))
    ]
    assert offenders == []


def test_topology_never_imports_policies() -> None:
    """topology/ sits at the bottom: it imports nothing from policies/."""
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in _imports(path) if name.startswith("torchferry.policies")
        )
        for path in _modules("topology")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_subpackages_are_entered_through_their_init() -> None:
    """A module imports another subpackage's names from its ``__init__``, never from its private modules."""
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name
            for name in _imports(path)
            for sub in SUBPACKAGES
            if name.startswith(f"torchferry.{sub}._") and _package_of(path) != f"torchferry.{sub}"
        )
        for path in ALL_MODULES
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize(
    ("leaf", "allowed"),
    [("cli", {"cli", "__main__.py"}), ("testing", {"testing", "cli"})],
)
def test_cli_and_testing_are_leaves(leaf: str, allowed: set[str]) -> None:
    """Nothing in the layers or the session imports ``torchferry.cli`` or ``torchferry.testing``."""
    offenders = sorted(
        str(path.relative_to(PACKAGE))
        for path in ALL_MODULES
        if path.relative_to(PACKAGE).parts[0] not in allowed
        and any(name.split(".")[:2] == ["torchferry", leaf] for name in _imports(path))
    )
    assert offenders == []
