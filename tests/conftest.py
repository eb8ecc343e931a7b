"""Shared pytest configuration: the ``--update-golden`` flag, CUDA-only skips, no saved profile.

With ``TORCHFERRY_REQUIRE_EXTRAS=1`` (set by .ci/run) a test skipped because an optional package
is missing fails instead: CI installs every extra, so such a skip there is a broken install.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest
import torch

#: tests/engines/ drives vLLM-Omni's own code, whose pins conflict with CI's environment: it runs in the
#: environment tools/vllm_omni_env.sh builds, which sets TORCHFERRY_ENGINE_TESTS=1 (docs/testing.md).
collect_ignore = [] if os.environ.get("TORCHFERRY_ENGINE_TESTS") == "1" else ["engines"]

#: Golden files: plain text, compared whole; ``--update-golden`` rewrites them (CI never passes it).
GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(autouse=True)
def _no_saved_profile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests never read this machine's `torchferry probe` profile: it points at an empty folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHFERRY_PROFILE", str(Path(tmp_path_factory.getbasetemp()) / "no-profile.json"))
        yield


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in each worker of ``-n N``
    if workers:
        # Why: torch's default pool is a thread a core in every worker; N workers on it oversubscribe
        # the cores, and OpenMP's threads spin waiting for work another worker's threads hold up.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // int(workers)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/**/*.txt from the current code instead of comparing against them",
    )
    parser.addoption(
        "--no-stream-sanitizer",
        action="store_true",
        default=False,
        help="run the runtime tests on the plain CPU stream context instead of the stream sanitizer",
    )
    parser.addoption(
        "--cuda-path",
        action="store_true",
        default=False,
        help="run the runtime tests with every tensor re-pointed, as on CUDA, rather than docked (the stream "
        "sanitizer still checks their order)",
    )


def _missing_extra_fails(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and os.environ.get("TORCHFERRY_REQUIRE_EXTRAS") == "1":
        reason = str(report.longrepr)
        if "could not import" in reason:
            report.outcome = "failed"
            report.longrepr = (
                f"{reason}\nTORCHFERRY_REQUIRE_EXTRAS=1: an optional package the test needs is missing; "
                "install every extra: pip install -c constraints.txt -e '.[dev,diffusers,quant]'"
            )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _missing_extra_fails(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _missing_extra_fails(report)
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, variable in (("zoo_full", "TORCHFERRY_ZOO_FULL"), ("bench_full", "TORCHFERRY_BENCH_FULL")):
        if os.environ.get(variable) != "1":  # the whole pipeline zoo and some benchmarks run on demand only
            left = [item for item in items if marker in item.keywords]
            if left:
                config.hook.pytest_deselected(items=left)
                items[:] = [item for item in items if marker not in item.keywords]
    if config.getoption("--cuda-path"):
        docked = pytest.mark.skip(reason="asserts a CPU session's docked weights; --cuda-path re-points them")
        for item in items:
            if "docking" in item.keywords:
                item.add_marker(docked)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[[str, str, str], None]:
    """``golden(name, text, accept)``: ``text`` must equal tests/golden/``name``.

    A mismatch fails with a unified diff and ``accept``, the command that rewrites the file; a
    missing file is written and fails (review it and rerun); ``--update-golden`` rewrites it.
    """
    update = bool(request.config.getoption("--update-golden"))

    def check(name: str, text: str, accept: str) -> None:
        path = GOLDEN / name
        if update or not path.exists():
            existed = path.exists()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if not existed and not update:
                pytest.fail(f"golden file {path} was missing and has been written; review it and rerun")
            return
        expected = path.read_text()
        if expected != text:
            diff = "".join(
                difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "current")
            )
            pytest.fail(f"{name} differs from {path}:\n{diff}\naccept it with: {accept}", pytrace=False)

    return check
