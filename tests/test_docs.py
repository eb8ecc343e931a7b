"""The code in docs/ runs: examples that cannot drift from the code they describe."""

from __future__ import annotations

import re
from pathlib import Path

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
