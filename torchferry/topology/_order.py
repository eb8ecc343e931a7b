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
import itertools
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchferry.topology._model import Component

__all__ = ["forward_order", "order_mismatch"]

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


def _runs(paths: list[str], ring: tuple[str, ...], attr_of: dict[str, str]) -> str:
    """``paths`` compactly: consecutive blocks of one attribute as ``attr.0-3``."""
    out: list[str] = []
    i = 0
    while i < len(paths):
        attr = attr_of.get(paths[i])
        j = i
        while (
            attr is not None
            and j + 1 < len(paths)
            and attr_of.get(paths[j + 1]) == attr
            and paths[j + 1] in ring
            and ring.index(paths[j + 1]) == ring.index(paths[j]) + 1
        ):
            j += 1
        if j > i + 1 or (j == i + 1):
            first, last = paths[i], paths[j].rsplit(".", 1)[-1]
            out.append(f"{first}-{last}")
        else:
            out.append(paths[i])
        i = j + 1
    return ", ".join(out)


def order_mismatch(component: Component, ran: list[str]) -> str | None:
    """Why the blocks ``ran`` (in forward order so far) do not follow ``component``'s ring, and the fix.

    ``None`` when they do. Otherwise: ``declared order X, forward ran Y; declare ...`` with the
    `Declaration` whose ring follows the forward: the attributes in the order the forward first
    entered them when it runs each one's blocks together, else every block named on its own.
    """
    for stack in component.stacks:
        ring = tuple(b.path for b in stack.blocks)
        seen = [p for p in ran if p in ring]
        if not seen or seen == list(ring[: len(seen)]):
            continue
        prefix = f"{component.path}." if component.path else ""
        attr_of: dict[str, str] = {}
        for path in ring:
            relative = path.removeprefix(prefix)
            attr_of[path] = next(
                (a for a in stack.attrs if relative == a or relative.startswith(f"{a}.")), relative
            )
        order: list[str] = []
        for path in seen:
            if attr_of[path] not in order:
                order.append(attr_of[path])
        order += [a for a in stack.attrs if a not in order]
        grouped = [p for a in order for p in ring if attr_of[p] == a]
        entered = [attr_of[p] for p in seen]
        together = all(
            order.index(x) <= order.index(y) for x, y in itertools.pairwise(entered)
        )
        if together and seen == grouped[: len(seen)]:
            attrs_ = tuple(order)
        else:
            rest = [p for p in ring if p not in seen]
            attrs_ = tuple(p.removeprefix(prefix) for p in [*seen, *rest])
        return (
            f"declared order {_runs(list(ring), ring, attr_of)}, forward ran {_runs(seen, ring, attr_of)}; "
            f"declare Declaration(block_attrs={{{component.path!r}: {attrs_!r}}}) so the ring follows "
            "the forward"
        )
    return None
