"""The order a model's forward visits its block lists, read from the forward's source.

A ring found from structure lists its block lists in registration order; a forward may visit them in
another (Lumina-Image 2.0 registers ``noise_refiner`` before ``context_refiner`` and runs the context
refiner first). `forward_order` reads where the forward (and the model's own methods it calls, a few
levels deep) first names each list as ``self.<list>``, and orders the lists so. It reads source text
only (no call, no tensor); when the source cannot be read or a list is never named, the given order
stands, and the runtime still refuses a ring that runs out of its order, naming the order it ran.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence

__all__ = ["forward_order"]

#: How many levels of the model's own method calls are followed from ``forward``.
_DEPTH = 3


def _function_tree(function: Callable[..., object]) -> ast.AST | None:
    """The parsed source of ``function`` (its innermost wrapped function), or None when unreadable."""
    try:
        source = inspect.getsource(inspect.unwrap(function))
        return ast.parse(textwrap.dedent(source))
    except (OSError, TypeError, SyntaxError, ValueError):
        return None


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain rooted at the name ``self``, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(reversed(parts))
    return None


@functools.lru_cache(maxsize=256)
def _self_reads(cls: type, method: str, depth: int) -> tuple[str, ...]:
    """Every ``self.<dotted>`` the method reads, in source order, with the model's own methods it
    names expanded in place (up to ``depth`` levels; each method once per path)."""
    function = getattr(cls, method, None)
    tree = _function_tree(function) if callable(function) else None
    if tree is None:
        return ()
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        name = _dotted(node)
        if name is not None and isinstance(node, ast.Attribute):
            found.append((node.lineno, node.col_offset, name))
    # A chain and its inner parts start at one position (``self.a.b`` and ``self.a``): keep the longest.
    longest: dict[tuple[int, int], str] = {}
    for line, col, name in found:
        if len(name) > len(longest.get((line, col), "")):
            longest[(line, col)] = name
    reads: list[str] = []
    for _, name in sorted(longest.items()):
        reads.append(name)
        head = name.split(".")[0]
        if depth > 0 and head != method and inspect.isfunction(inspect.getattr_static(cls, head, None)):
            reads.extend(_self_reads(cls, head, depth - 1))
    return tuple(reads)


def forward_order(cls: type, attrs: Sequence[str]) -> tuple[str, ...]:
    """``attrs`` in the order ``cls.forward`` first names each, or unchanged when one is never named.

    An attribute counts as named by ``self.<attr>`` or by a longer chain through it
    (``self.<attr>[0]``, ``self.<attr>.children()``).
    """
    given = tuple(attrs)
    if len(given) < 2:
        return given
    reads = _self_reads(cls, "forward", _DEPTH)
    first: dict[str, int] = {}
    for index, name in enumerate(reads):
        for attr in given:
            if attr not in first and (name == attr or name.startswith(attr + ".")):
                first[attr] = index
    if len(first) < len(given):
        return given
    return tuple(sorted(given, key=lambda a: first[a]))
