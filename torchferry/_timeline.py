"""A plain-SVG picture of the copy, comm and compute streams of one step.

Each lane is one stream; each bar is one op (a transfer, a collective, a block's compute) from its
start to its end; stalls on the compute lane are drawn in red so a person sees at a glance where the
device waited for weights.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from xml.sax.saxutils import escape

import attrs

__all__ = ["Bar", "render_svg"]

_COLOURS = {"copy": "#4c78a8", "comm": "#f58518", "compute": "#54a24b", "stall": "#e45756"}
_LANE_H = 28
_LEFT = 150
_WIDTH = 1100


@attrs.frozen(kw_only=True)
class Bar:
    """One interval on one lane, in seconds from the start of the step."""

    start_s: float
    end_s: float
    label: str
    kind: str = "compute"


def _ticks(span: float) -> list[float]:
    if span <= 0:
        return [0.0]
    raw = span / 8
    magnitude = 10 ** len(str(int(1 / raw))) if raw < 1 else 1.0
    step = max(round(raw * magnitude) / magnitude, 1e-9) if raw < 1 else float(round(raw) or 1)
    ticks = []
    t = 0.0
    while t <= span * 1.0001:
        ticks.append(t)
        t += step
    return ticks


def render_svg(lanes: Mapping[str, Sequence[Bar]], *, title: str, subtitle: str = "") -> str:
    """An SVG document with one lane per entry of ``lanes`` (in order) and a time axis."""
    span = max((bar.end_s for bars in lanes.values() for bar in bars), default=0.0) or 1e-9
    scale = (_WIDTH - _LEFT - 20) / span
    notes = textwrap.wrap(subtitle, 180) if subtitle else []
    top = 44 + 14 * len(notes)
    height = top + _LANE_H * len(lanes) + 50
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{_WIDTH}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    out.extend(
        f'<text x="10" y="{38 + 14 * i}" fill="#555">{escape(line)}</text>' for i, line in enumerate(notes)
    )
    for row, (lane, bars) in enumerate(lanes.items()):
        y = top + row * _LANE_H
        out.append(f'<text x="10" y="{y + 18}">{escape(lane)}</text>')
        out.append(
            f'<line x1="{_LEFT}" y1="{y + _LANE_H - 2}" x2="{_WIDTH - 20}" y2="{y + _LANE_H - 2}" '
            'stroke="#ddd"/>'
        )
        for bar in bars:
            x = _LEFT + bar.start_s * scale
            w = max((bar.end_s - bar.start_s) * scale, 0.5)
            colour = _COLOURS.get(bar.kind, "#999")
            ms = (bar.end_s - bar.start_s) * 1e3
            out.append(
                f'<rect x="{x:.2f}" y="{y + 4}" width="{w:.2f}" height="{_LANE_H - 10}" fill="{colour}" '
                f'stroke="white" stroke-width="0.5"><title>{escape(bar.label)}: '
                f"{bar.start_s * 1e3:.3f}-{bar.end_s * 1e3:.3f} ms ({ms:.3f} ms)</title></rect>"
            )
    axis_y = top + _LANE_H * len(lanes) + 12
    for t in _ticks(span):
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{axis_y - 6}" stroke="#eee"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 6}" text-anchor="middle">{t * 1e3:.4g} ms</text>')
    legend_x = _LEFT
    for kind, colour in _COLOURS.items():
        out.append(f'<rect x="{legend_x}" y="{axis_y + 16}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{legend_x + 14}" y="{axis_y + 25}">{kind}</text>')
        legend_x += 90
    out.append("</svg>")
    return "\n".join(out) + "\n"
