"""`load_json` and `read_json_object`: a user's JSON file (a ``config.json``, a ``model_index.json``, an
index, a profile) read so that no hostile file escapes as a ``RecursionError``.

Python's ``json`` parses nested arrays and objects by recursion, so a file of 100,000 ``[`` raises
``RecursionError``; one nested 900 deep parses, and then whatever walks it by recursion (diffusers'
``deepcopy`` of a configuration, ``repr``) raises it later, far from the file. The configurations
torchferry reads nest a few levels (a ``quantization_config`` inside a model's config is the deepest
known, at four or five), so anything nested deeper than `MAX_DEPTH` is refused here, by name, as
not a configuration.
"""

from __future__ import annotations

import json
import os
from typing import Any

from torchferry._errors import PlanError

__all__ = ["MAX_DEPTH", "load_json", "read_json_object"]

#: The deepest nesting of arrays and objects accepted in a user's JSON file.
MAX_DEPTH = 64


def _depth(doc: Any) -> int:
    """How deep ``doc``'s arrays and objects nest (0 for a scalar), walked without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        elif not isinstance(value, list):
            continue
        depth += 1
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        stack.extend((v, depth) for v in value)
    return deepest


def load_json(text: str | bytes) -> Any:
    """``json.loads(text)``; nesting deeper than `MAX_DEPTH` (or than Python parses) is a
    ``ValueError`` saying so, like any other text that is not a configuration."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError(f"it nests arrays and objects deeper than {MAX_DEPTH} levels") from None
    if _depth(doc) > MAX_DEPTH:
        raise ValueError(f"it nests arrays and objects deeper than {MAX_DEPTH} levels")
    return doc


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 at byte {exc.start}"
    return str(exc)


def read_json_object(file: str | os.PathLike[str], what: str, fix: str) -> dict[str, Any]:
    """The JSON object in ``file`` (the ``what``: "config.json beside it"), or a `PlanError` naming the
    file, what is wrong with it (unreadable, not JSON, nested too deep, an array or a scalar) and
    ``fix``."""
    where = os.fspath(file)
    try:
        with open(where, "rb") as f:
            doc = load_json(f.read())
    except (OSError, ValueError) as exc:
        raise PlanError(f"{where}: the {what} cannot be read ({_reason(exc)}); {fix}") from None
    if not isinstance(doc, dict):
        kinds = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}
        kind = kinds.get(type(doc), "a number")
        raise PlanError(f"{where}: the {what} holds {kind}, not a JSON object of settings; {fix}")
    return doc
