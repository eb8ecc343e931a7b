"""The layers' dependency direction: load -> session -> runtime -> policies -> topology, never back
(docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torchferry"
# The modules of topology/ that may import torch: discovery, the only code that reads an nn.Module
# (its components, their blocks, their tensors and owners, the inner tensors of wrapper tensors, and
# the helpers they share).
TORCH_READERS = {
    "topology/_blocks.py",
    "topology/_discover.py",
    "topology/_owners.py",
    "topology/_reading.py",
    "topology/_layers.py",
    "topology/_wrapped.py",
}


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


ALL_MODULES = sorted(PACKAGE.rglob("*.py"))
#: Every package of torchferry/ at any depth, dotted (``torchferry.runtime.store``).
PACKAGES = sorted(
    ".".join(("torchferry", *p.parent.relative_to(PACKAGE).parts)) for p in PACKAGE.rglob("__init__.py")
)
#: The runtime's rooms, lowest first: a room imports only rooms before it (docs/architecture.md).
RUNTIME_ORDER = ["device", "interop", "memory", "files", "machine", "store", "executor", "guard"]
#: The package's layers and the root's rooms, lowest first: each imports only those before it. The
#: error family (`torchferry/_errors.py`) sits below them all; cli/, testing/ and integrations/ are
#: leaves above them (docs/architecture.md).
PACKAGE_ORDER = ["topology", "policies", "runtime", "session", "load"]


@pytest.mark.parametrize("layer", ["topology", "policies"])
def test_pure_layers_never_import_the_runtime(layer: str) -> None:
    """Nothing in topology/ or policies/ imports the runtime, the session, loading or torch.distributed."""
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name
            for name in _imports(path)
            if name.startswith(
                ("torchferry.runtime", "torchferry.session", "torchferry.load", "torch.distributed")
            )
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
    """Within topology/, only discovery imports torch (to read an nn.Module); the rest is plain data."""
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


def _inside(path: Path, package: str) -> bool:
    return _module_name(path) == package or _module_name(path).startswith(package + ".")


def test_subpackages_are_entered_through_their_init() -> None:
    """A module imports another package's names from its ``__init__``, never from its private modules.

    This holds at every depth: ``runtime/executor/`` reaches the store through
    ``torchferry.runtime.store``, never ``torchferry.runtime.store._store``.
    """
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name
            for name in _imports(path)
            for package in PACKAGES
            if name.startswith(f"{package}._") and not _inside(path, package)
        )
        for path in ALL_MODULES
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def _runtime_rooms() -> dict[str, set[str]]:
    """Which room of runtime/ imports which other room, at run time or for type checking."""
    rooms: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "runtime").rglob("*.py")):
        parts = path.relative_to(PACKAGE / "runtime").parts
        if len(parts) < 2:
            continue
        rooms.setdefault(parts[0], set()).update(
            name.split(".")[2]
            for name in _imports(path)
            if name.startswith("torchferry.runtime.") and name.split(".")[2] != parts[0]
        )
    return rooms


def test_runtime_rooms_import_one_way() -> None:
    """runtime/ is laid out by concern, and each room imports only the rooms listed before it."""
    rooms = _runtime_rooms()
    assert sorted(rooms) == sorted(RUNTIME_ORDER)
    upward = {
        room: sorted(other for other in uses if RUNTIME_ORDER.index(other) > RUNTIME_ORDER.index(room))
        for room, uses in rooms.items()
    }
    assert {k: v for k, v in upward.items() if v} == {}


def _reached(path: Path) -> set[str]:
    """The layers and rooms of ``PACKAGE_ORDER`` that ``path`` imports, at run time or for type checking
    (``from torchferry import runtime`` reaches the runtime as ``import torchferry.runtime`` does)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "torchferry":
                names.update(f"torchferry.{alias.name}" for alias in node.names)
    return {
        parts[1] for name in names if len(parts := name.split(".")) > 1 and parts[0] == "torchferry"
    } & set(PACKAGE_ORDER)


def test_layers_and_root_rooms_import_one_way() -> None:
    """topology/ <- policies/ <- runtime/ <- session/ <- load/: each imports only those before it, so the
    root's rooms sit above the runtime and nothing below them reaches back for the session or a loader."""
    upward = {
        str(path.relative_to(PACKAGE)): sorted(
            other
            for other in _reached(path)
            if PACKAGE_ORDER.index(other) > PACKAGE_ORDER.index(path.relative_to(PACKAGE).parts[0])
        )
        for path in ALL_MODULES
        if path.relative_to(PACKAGE).parts[0] in PACKAGE_ORDER
    }
    assert {k: v for k, v in upward.items() if v} == {}


def test_the_order_check_sees_every_form_of_import(tmp_path: Path) -> None:
    """`_reached` finds a layer through ``from torchferry import x``, ``from torchferry.x import y``
    and ``import torchferry.x._y``, and ignores names of the root and other packages."""
    module = tmp_path / "m.py"
    module.write_text(
        "from torchferry import _errors, policies\nfrom torchferry.session import offload\n"
        "import torchferry.load._pretrained\nfrom torchferry.runtime.store import HostStore\n"
        "import torchferry.cli\nfrom torch import nn\n"
    )
    assert _reached(module) == {"policies", "session", "load", "runtime"}


def test_no_two_modules_share_a_name() -> None:
    """No two modules of torchferry/ have one name: a reader finds a module by its name alone."""
    seen: dict[str, list[str]] = {}
    for path in ALL_MODULES:
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}


@pytest.mark.parametrize(
    ("leaf", "allowed"),
    [
        ("cli", {"cli", "__main__.py"}),
        ("testing", {"testing", "cli"}),
        ("integrations", {"integrations"}),
    ],
)
def test_cli_and_testing_are_leaves(leaf: str, allowed: set[str]) -> None:
    """Nothing in the layers, the session or loading imports ``torchferry.cli``, ``torchferry.testing``
    or ``torchferry.integrations``."""
    offenders = sorted(
        str(path.relative_to(PACKAGE))
        for path in ALL_MODULES
        if path.relative_to(PACKAGE).parts[0] not in allowed
        and any(name.split(".")[:2] == ["torchferry", leaf] for name in _imports(path))
    )
    assert offenders == []


#: The longest a module of torchferry/ may be: past it, a module holds two things a reader would name.
MAX_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    """Every module of torchferry/ is at most MAX_LINES long; split a longer one along its seam."""
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in ALL_MODULES
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lifted(importer: str, target: str) -> tuple[str, str] | None:
    """The import as an edge between two members of one package, at whatever depth they meet.

    ``torchferry.runtime.executor._engine`` importing ``torchferry.runtime.store`` is the edge
    ``runtime.executor -> runtime.store`` in the runtime's graph; a package's ``__init__`` is the
    package's own node, so an ``__init__`` importing its modules and a module importing its
    package's ``__init__`` back close a circle too.
    """
    mine, theirs = importer.split("."), target.split(".")
    k = 0
    while k < min(len(mine), len(theirs)) and mine[k] == theirs[k]:
        k += 1
    if k == len(mine) == len(theirs):
        return None
    if k == len(theirs):  # the importer lies inside the package it imports
        return ".".join(mine[: k + 1]), target
    if k == len(mine):  # a package's __init__ imports something inside it
        return importer, ".".join(theirs[: k + 1])
    return ".".join(mine[: k + 1]), ".".join(theirs[: k + 1])


def _package_imports(path: Path, modules: set[str]) -> set[tuple[str, str]]:
    """The edges of torchferry's import graphs that ``path`` adds, at run time or for type checking."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            base = node.module
            if node.level:
                anchor = _module_name(path).split(".")
                anchor = anchor if path.name == "__init__.py" else anchor[:-1]
                base = ".".join([*anchor[: len(anchor) - node.level + 1], node.module])
            # ``from pkg import mod`` reaches the module; ``from pkg import name`` reaches pkg's __init__.
            subs = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t for t in subs if t in modules] or [base]
            if len(targets) < len(subs):
                targets.append(base)
        else:
            continue
        for target in targets:
            if target in modules and (edge := _lifted(_module_name(path), target)) is not None:
                found.add(edge)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of two or more modules (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycle_inside_a_package() -> None:
    """No set of modules or packages of one package imports each other in a circle, at any depth.

    A package's ``__init__`` imports its modules; a module importing its own package's ``__init__``
    back would close a circle too, and so would two rooms of runtime/ importing each other. Seams
    between modules are one-way: a protocol in the lower module, not an import back.
    """
    # A package's __init__ is the package's own node, in its own graph and in its parent's.
    modules = {_module_name(path) for path in ALL_MODULES}
    graph: dict[str, set[str]] = {}
    for path in ALL_MODULES:
        for source, target in _package_imports(path, modules):
            graph.setdefault(source, set()).add(target)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    """The check above can fail: a circle of three modules and a pair are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert _cycles({"a": {"b"}, "b": {"c"}}) == []


def test_imports_become_edges_where_their_packages_meet() -> None:
    """An import deep in one room of a package is an edge between rooms, so rooms in a circle are found."""
    assert _lifted("torchferry.runtime.executor._engine", "torchferry.runtime.store") == (
        "torchferry.runtime.executor",
        "torchferry.runtime.store",
    )
    assert _lifted("torchferry.runtime", "torchferry.runtime.store._store") == (
        "torchferry.runtime",
        "torchferry.runtime.store",
    )
    assert _lifted("torchferry.runtime.store._store", "torchferry.runtime") == (
        "torchferry.runtime.store",
        "torchferry.runtime",
    )
    assert _lifted("torchferry.session._session", "torchferry.session._session") is None
    graph = {"runtime.executor": {"runtime.guard"}, "runtime.guard": {"runtime.executor"}}
    assert _cycles(graph) == [["runtime.executor", "runtime.guard"]]


#: The pure planners: what a session decides before its first byte moves (`policies.open_plan`), and
#: the pieces it is made of (the host planner, the tiers, the budgets, the device's figures, auto's
#: setup and choice).
PLANNERS = {
    "open_plan",
    "host_plan",
    "share_budget",
    "default_device_budget",
    "needs_source",
    "tiers",
    "tiers_at",
    "machine_budget",
    "given_budget",
    "offered_budget",
    "group_least",
    "weight_budget",
    "dequantize_reserve",
    "auto_candidates",
    "device_profile",
    "auto_setup",
    "estimate_cost",
    "choose",
}
#: What reads or times the device: its free memory, its name and properties, its saved profile, a
#: timed copy (the runtime's fact readers call these; the root and its rooms never do).
MEASURES = {
    "mem_get_info",
    "get_device_name",
    "get_device_properties",
    "memory_reserved",
    "copy_bytes_per_s",
    "load_profile",
    "device_facts",
}


def _called(path: Path) -> set[str]:
    """The names ``path`` calls, as ``f(...)`` or ``x.f(...)``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def test_the_runtime_calls_no_planner_and_the_root_measures_no_device() -> None:
    """Issue 39: the runtime carries out what `policies.open_plan` decided (no module under runtime/
    calls a planner, nor picks the device's figures), and no module of the root or its rooms
    (session/, load/) reads or times the device (its free memory, its name, its saved profile, its
    H2D rate: the runtime's fact readers do)."""
    modules = (PACKAGE / "runtime").rglob("*.py")
    runtime = {p.relative_to(PACKAGE).as_posix(): _called(p) & PLANNERS for p in modules}
    assert {k: v for k, v in runtime.items() if v} == {}
    root = [*PACKAGE.glob("*.py"), *(PACKAGE / "session").rglob("*.py"), *(PACKAGE / "load").rglob("*.py")]
    found = {p.relative_to(PACKAGE).as_posix(): _called(p) & MEASURES for p in root}
    assert {name: names for name, names in found.items() if names} == {}


def test_the_layering_check_sees_a_planner_call_and_a_measure(tmp_path: Path) -> None:
    """The check above finds ``policies.tiers(plan)`` and ``torch.cuda.mem_get_info()`` when written,
    and not a name that is only read."""
    path = tmp_path / "probe.py"
    path.write_text("policies.tiers(plan)\nfree = torch.cuda.mem_get_info(device)[0]\nx = host_plan\n")
    assert _called(path) & PLANNERS == {"tiers"} and _called(path) & MEASURES == {"mem_get_info"}
