"""A user policy type-checks under mypy strict; a wrong one is rejected."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

WRONG = """
from __future__ import annotations

from torchferry.policies import Policy, Step
from torchferry.topology import Plan


def broken(plan: Plan, step: Step) -> str:
    return "not a schedule"


POLICY: Policy = broken
"""


def _mypy(cache: Path, *paths: str) -> tuple[str, int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # A machine without the dev extra (a GPU box's image) skips; CI, which has it, fails instead
        # (TORCHFERRY_REQUIRE_EXTRAS, tests/conftest.py).
        api = pytest.importorskip("mypy.api")

        # Why: a cache of its own; .ci/run's mypy writes the checkout's (a SQLite file) at the same time.
        config = ["--strict", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache)]
        out, err, status = api.run([*config, *paths])
    return out + err, status


@pytest.mark.slow
def test_user_policy_type_checks_and_wrong_one_is_rejected(tmp_path: Path) -> None:
    """mypy strict accepts tests/typing/user_policy.py and rejects a policy returning a str."""
    wrong = tmp_path / "wrong_policy.py"
    wrong.write_text(WRONG)
    out, status = _mypy(tmp_path / "cache", str(HERE / "user_policy.py"), str(wrong))
    assert status == 1
    assert "user_policy.py" not in out, out
    assert 'Incompatible types in assignment (expression has type "Callable[[Plan, Step], str]"' in out
