"""Fuzz of the header and index parsers: generated hostile checkpoints end in a PlanError or a parse.

The cases come from `checkpoint_cases` (a seeded generator: the same cases on every run). Each one
goes through both readers, topology's `from_checkpoint` and the runtime's `CheckpointReader` (open,
validate, read every tensor), and through ``torchferry plan`` for a sample; any other exception, a
message longer than `MAX_MESSAGE`, a hang, or a parse whose tensors do not have the good file's
sizes, dtypes and shapes (a flipped byte may rename a tensor or change its values, and stay valid)
fails the test naming the case.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from checkpoint_cases import Case, cases

from torchferry import PlanError
from torchferry.cli import main
from torchferry.runtime import CheckpointReader
from torchferry.topology import TensorSpec, from_checkpoint

#: The longest message a generated case may produce (values from the file are cut to 200 characters).
MAX_MESSAGE = 2000
_SPECS = [
    TensorSpec(name="blocks.0.w", shape=(2,), dtype="float32"),
    TensorSpec(name="blocks.1.w", shape=(2,), dtype="float32"),
    TensorSpec(name="head", shape=(3,), dtype="bfloat16"),
]
_GOOD = {
    "blocks.0.w": torch.frombuffer(bytearray(range(1, 9)), dtype=torch.float32),
    "blocks.1.w": torch.frombuffer(bytearray(range(9, 17)), dtype=torch.float32),
    "head": torch.frombuffer(bytearray(range(17, 23)), dtype=torch.bfloat16),
}


@contextmanager
def _deadline(seconds: int, case: Case) -> Iterator[None]:
    """Fail (instead of hanging) when a case blocks, e.g. on a FIFO or a device."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def hung(*_: object) -> None:
        raise AssertionError(f"{case.category} case {case.what!r} blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _outcome(case: Case, path: Path) -> tuple[str, str]:
    """How each reader ended on ``path``: ``ok`` or ``PlanError``; anything else propagates."""
    ends: list[str] = []
    try:
        topology = from_checkpoint(path)
        sizes = sorted(t.nbytes for c in topology.components for t in c.all_tensors())
        assert sizes == [6, 8, 8], f"{case.category} case {case.what!r} parsed to tensors of {sizes} bytes"
        ends.append("ok")
    except PlanError as exc:
        assert len(str(exc)) <= MAX_MESSAGE, f"{case.what!r}: a {len(str(exc))}-character message"
        ends.append("PlanError")
    try:
        with CheckpointReader(path) as reader:
            reader.validate(_SPECS)
            for name, tensor in _GOOD.items():
                got = reader.read_tensor(name)
                assert got.dtype == tensor.dtype and got.shape == tensor.shape, case.what
        ends.append("ok")
    except PlanError as exc:
        assert len(str(exc)) <= MAX_MESSAGE, f"{case.what!r}: a {len(str(exc))}-character message"
        ends.append("PlanError")
    return ends[0], ends[1]


def _run(tmp_path: Path, seed: int, n: int) -> Counter[tuple[str, str, str]]:
    tally: Counter[tuple[str, str, str]] = Counter()
    for i, case in enumerate(cases(seed, n)):
        folder = tmp_path / str(i)
        folder.mkdir()
        with _deadline(10, case):
            topology_end, runtime_end = _outcome(case, case.write(folder))
        tally[case.category, "topology", topology_end] += 1
        tally[case.category, "runtime", runtime_end] += 1
        shutil.rmtree(folder)
    return tally


def test_a_thousand_generated_checkpoints_end_in_plan_errors_or_parses(tmp_path: Path) -> None:
    """1,000 generated hostile headers, folders and indexes give only PlanErrors or the good tensors, fast."""
    started = time.monotonic()
    tally = _run(tmp_path, seed=0, n=1000)
    assert sum(tally.values()) == 2000
    for category in ("header", "folder", "index"):  # every category both fails and (for some) parses
        assert tally[category, "topology", "PlanError"] > 0
    assert time.monotonic() - started < 60


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_more_generated_checkpoints(tmp_path: Path, request: pytest.FixtureRequest, seed: int) -> None:
    """Five more seeds of 4,000 cases each (a slow run: ``pytest -m slow``): still PlanErrors or parses."""
    selected = str(request.config.getoption("markexpr") or "")
    if "slow" not in selected or "not slow" in selected:
        pytest.skip("20,000 more fuzz cases run only when slow tests are selected: pytest -m slow")
    tally = _run(tmp_path, seed=seed, n=4000)
    assert sum(tally.values()) == 8000


def test_plan_prints_one_line_and_exits_2_on_hostile_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchferry plan` on generated malformed checkpoints prints one error line and exits 2."""
    failed = 0
    for i, case in enumerate(cases(7, 120)):
        folder = tmp_path / str(i)
        folder.mkdir()
        path = case.write(folder)
        try:
            from_checkpoint(path)
        except PlanError:
            pass
        else:
            continue
        with _deadline(10, case):
            code = main(["plan", str(path), "--device-memory", "24GiB"])
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), case.what
        assert err.startswith("torchferry plan: error: ") and err.count("\n") == 1, (case.what, err[:300])
        failed += 1
    assert failed > 50
