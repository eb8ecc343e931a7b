"""The code in docs/ runs: examples that cannot drift from the code they describe."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _python_blocks(page: str) -> list[str]:
    text = (DOCS / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_writing_a_policy_example_runs() -> None:
    """The custom policy of docs/writing-a-policy.md runs the toy pipeline with bit-identical output."""
    blocks = _python_blocks("writing-a-policy.md")
    assert len(blocks) == 2
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(blocks[0] + "\n" + blocks[1], "writing-a-policy.md", "exec"), namespace)
    session = namespace["session"]
    assert getattr(session, "closed", False) is True


ROOT = DOCS.parent


def _ci_commands() -> list[str]:
    """The commands .ci/run runs, one a line, without its quiet flags, CI-only options and output
    redirections (it runs mypy in the background, beside the tests)."""
    commands: list[str] = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        if line.startswith(("pip ", "ruff ", "mypy", "python ")):
            commands += [c.split(" >")[0].strip() for c in line.split("&&")]
    return [c.replace(" -q", "").replace(" -p no:cacheprovider", "") for c in commands]


def test_readme_test_command_is_what_ci_runs() -> None:
    """README's second command is exactly the install, lint, type-check and test that .ci/run does."""
    lines = (ROOT / "README.md").read_text().splitlines()
    comment = next(i for i, line in enumerate(lines) if line.startswith("# install the pinned test releases"))
    readme = [c.strip() for c in lines[comment + 1].split("&&")]
    assert readme == [c.replace("python -m pytest", "python -m pytest -q") for c in _ci_commands()]
    assert all("-c constraints.txt" in c for c in readme if c.startswith("pip install"))


def test_constraints_pin_every_package_the_extras_name() -> None:
    """constraints.txt pins an exact release of torch and of every package an extra names."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and newer
    pins = {
        line.split("==")[0].lower().replace("_", "-")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    named = [*project["dependencies"], *(d for deps in extras for d in deps)]
    wanted = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in named}
    assert wanted - pins == set()


def test_the_exactness_promise_says_what_it_compares() -> None:
    """README's bit-identical claim names its reference (the same weights in memory of their own) and
    links to the contract's section on it, which says why a CPU from_pretrained model may differ."""
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    assert "equals the plain run's bit for bit" not in readme
    assert (
        "Every strategy's output equals, bit for bit, the plain run of the same weights in memory of their "
        "own (as `.to(device)` leaves them)"
    ) in readme
    assert "(docs/contract.md#what-bit-identical-compares)" in readme
    contract = " ".join((DOCS / "contract.md").read_text().split())
    assert "## What bit-identical compares" in (DOCS / "contract.md").read_text()
    assert "views into the memory-mapped safetensors file" in contract
