"""A plain-SVG picture of the copy, comm and compute streams of one step.

Each lane is one stream; each bar is one op (a transfer, a collective, a block's compute) from its
start to its end; stalls on the compute lane are drawn in red so a person sees at a glance where the
device waited for weights. A picture holds one or more panels (a simulated step above the same
step measured, say) drawn to one time scale, so their lengths compare by eye.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol
from xml.sax.saxutils import escape

import attrs

__all__ = ["LANES", "Bar", "Panel", "lanes_of", "render_panels"]

_COLOURS = {"copy": "#4c78a8", "comm": "#f58518", "compute": "#54a24b", "io": "#9d755d", "stall": "#e45756"}
_LANE_H = 28
_LEFT = 150
_WIDTH = 1100
_WRAP = 180

#: Lane titles of the three streams, in drawing order.
LANES: dict[str, str] = {"copy": "copy (H2D)", "comm": "comm (all-gather)", "compute": "compute"}
#: The io stream's lane, drawn first and only when a step reads from the file tier.
IO_LANE = "io (file reads)"


@attrs.frozen(kw_only=True)
class Bar:
    """One interval on one lane, in seconds from the start of the step; ``tag`` is drawn inside it."""

    start_s: float
    end_s: float
    label: str
    kind: str = "compute"
    tag: str = ""


@attrs.frozen(kw_only=True)
class Panel:
    """A group of lanes under one heading (one step, simulated or measured), with a note below it."""

    heading: str
    lanes: Mapping[str, Sequence[Bar]]
    note: str = ""


class Stretch(Protocol):
    """A busy stretch of one stream: a `policies.Span`, simulated or measured."""

    @property
    def stream(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def label(self) -> str: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...


def _tag(label: str) -> str:
    """The block number of a block or unit path (``transformer.blocks.3`` -> ``3``), else nothing."""
    last = label.rsplit(".", 1)[-1]
    return last if last.isdigit() else ""


def lanes_of(stretches: Iterable[Stretch]) -> dict[str, list[Bar]]:
    """One lane per stream (`LANES`; `IO_LANE` first when a stretch reads), a bar per stretch; stalls
    are drawn in red on the compute lane."""
    stretches = list(stretches)
    reads = any(s.stream == "io" for s in stretches)
    lanes: dict[str, list[Bar]] = {title: [] for title in ([IO_LANE] if reads else []) + list(LANES.values())}
    for s in stretches:
        kind = "stall" if s.kind == "stall" else s.stream
        lanes[IO_LANE if s.stream == "io" else LANES[s.stream]].append(
            Bar(start_s=s.start_s, end_s=s.end_s, label=f"{s.kind} {s.label}", kind=kind, tag=_tag(s.label))
        )
    return lanes


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


def render_panels(panels: Sequence[Panel], *, title: str, subtitle: str = "") -> str:
    """An SVG document: the title, then each panel's heading, lanes and time axis, all to one scale.

    Each panel is one ``<g class="panel">`` element, so a reader of the file can take it apart.
    """
    span = max((bar.end_s for p in panels for bars in p.lanes.values() for bar in bars), default=0.0) or 1e-9
    scale = (_WIDTH - _LEFT - 20) / span
    body: list[str] = []
    notes = textwrap.wrap(subtitle, _WRAP) if subtitle else []
    body.extend(
        f'<text x="10" y="{38 + 14 * i}" fill="#555">{escape(line)}</text>' for i, line in enumerate(notes)
    )
    y = 44 + 14 * len(notes)
    for panel in panels:
        body.append('<g class="panel">')
        if panel.heading:
            y += 10
            body.append(
                f'<text x="10" y="{y + 8}" font-size="13" font-weight="bold">{escape(panel.heading)}</text>'
            )
            y += 14
        for line in textwrap.wrap(panel.note, _WRAP) if panel.note else []:
            body.append(f'<text x="10" y="{y + 8}" fill="#555">{escape(line)}</text>')
            y += 14
        y += 4
        body.extend(_panel(panel, y, scale, span))
        body.append("</g>")
        y += _LANE_H * len(panel.lanes) + 24
    legend_x = _LEFT
    reads = any(IO_LANE in p.lanes for p in panels)
    for kind, colour in _COLOURS.items():
        if kind == "io" and not reads:
            continue
        body.append(f'<rect x="{legend_x}" y="{y + 4}" width="10" height="10" fill="{colour}"/>')
        body.append(f'<text x="{legend_x + 14}" y="{y + 13}">{kind}</text>')
        legend_x += 90
    height = y + 24
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{_WIDTH}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(title)}</text>',
        *body,
        "</svg>",
    ]
    return "\n".join(out) + "\n"


def _panel(panel: Panel, top: int, scale: float, span: float) -> list[str]:
    """One panel's lanes, bars and tick marks, from ``top`` down."""
    out: list[str] = []
    axis_y = top + _LANE_H * len(panel.lanes) + 12
    for t in _ticks(span):
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{axis_y - 6}" stroke="#eee"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 6}" text-anchor="middle">{t * 1e3:.4g} ms</text>')
    for row, (lane, bars) in enumerate(panel.lanes.items()):
        y = top + row * _LANE_H
        out.append(f'<text x="10" y="{y + 18}">{escape(lane)}</text>')
        out.append(
            f'<line x1="{_LEFT}" y1="{y + _LANE_H - 2}" x2="{_WIDTH - 20}" y2="{y + _LANE_H - 2}" '
            'stroke="#ddd"/>'
        )
        for bar in bars:
            x = _LEFT + bar.start_s * scale
            # Why: a bar too short to see at this scale is drawn one pixel wide, without its white edge.
            w = max((bar.end_s - bar.start_s) * scale, 1.0)
            colour = _COLOURS.get(bar.kind, "#999")
            ms = (bar.end_s - bar.start_s) * 1e3
            edge = ' stroke="white" stroke-width="0.5"' if w > 3 else ""
            out.append(
                f'<rect x="{x:.2f}" y="{y + 4}" width="{w:.2f}" height="{_LANE_H - 10}" fill="{colour}"'
                f"{edge}><title>{escape(bar.label)}: "
                f"{bar.start_s * 1e3:.3f}-{bar.end_s * 1e3:.3f} ms ({ms:.3f} ms)</title></rect>"
            )
            if bar.tag and w >= 7 * len(bar.tag) + 4:
                out.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + 17}" text-anchor="middle" fill="white" '
                    f'font-size="10">{escape(bar.tag)}</text>'
                )
    return out
