"""The one plain-text table renderer of the command line (the plan report's and the demo's tables)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["table"]


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int]) -> list[str]:
    """``header`` and ``rows`` as aligned lines, two spaces apart; columns in ``right`` right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return out
