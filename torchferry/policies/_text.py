"""The canonical text form of a schedule: `format_text` and its exact inverse `parse_schedule`.

Layout (one line each, columns aligned; blank lines ignored by the parser)::

    # torchferry schedule v1
    # policy: layerwise(depth=1)
    # plan: 7f3a9c12
    # step: transformer #0 -> transformer_2
    # file: transformer.blocks.{38,39} (only when some packs are in the file tier)
    # note: free text a policy uses to explain itself (zero or more)
    slot    s0  block  670.2 MiB (702788608)
    slot    t0  staging  670.2 MiB (702788608)
    entry   transformer.blocks.0@s0  670.2 MiB (702788608)
    before  transformer.blocks.0  compute  wait  transformer.blocks.0
    before  transformer.blocks.0  copy     load  transformer.blocks.1  -> s1  670.2 MiB (702788608)
    exit    transformer.blocks.0@s0  670.2 MiB (702788608)
    # sim: peak ... (derived: `format_schedule` adds it; the parser ignores it)

Byte counts print in binary units with the exact count in brackets, so the text parses back to
the same schedule. Tokens that are empty, hold whitespace or quotes, or could read as a keyword
(a bare model's component path is ``""``) print as JSON strings. ``step-entry`` rows, before the
slots, appear only when the step's entry differs from the schedule's. Op lines align the columns of
`_ir.op_columns`, which an op's ``repr`` joins unaligned. The ``# file:`` line lists
`Schedule.file` with the paths that share a parent written once (``blocks.{0,3,7}``); a name that
could misread there (braces, commas, whitespace, quotes) is a JSON string of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Literal

from torchferry._errors import ScheduleError
from torchferry.policies._ir import OP_KINDS, Op, Placement, Schedule, Slot, Step, op_columns
from torchferry.policies._tokens import NUMBER, UNIT_NAMES, format_bytes, format_name
from torchferry.topology import load_json

if TYPE_CHECKING:
    from torchferry.policies._ir import SlotKind, StreamName, When

__all__ = ["HEADER", "Mark", "format_marked", "format_names", "format_text", "parse_schedule"]

HEADER = "# torchferry schedule v1"

_TOKEN = re.compile(r'(?:"(?:[^"\\]|\\.)*"|[^\s"]+)+')
_EXACT = re.compile(r"\((\d+)\)")
_WHEN: tuple[When, ...] = ("before", "after")
_STREAMS: tuple[StreamName, ...] = ("copy", "comm", "compute", "io")
_SLOT_KINDS: tuple[SlotKind, ...] = ("block", "shard", "staging", "gather")
_GROUP = re.compile(r"(.*)(\.)\{([^{}]*)\}")
_HEADER_KEYS = ("policy", "plan", "step", "file", "note", "sim")


def _free(text: str) -> str:
    if not text or text != text.strip() or text.startswith('"') or not text.isprintable():
        return json.dumps(text)
    return text


def format_names(names: Collection[str]) -> str:
    """``transformer.blocks.{38,39} vae:rest``: names in the order given, those sharing a parent
    written once; a name that could misread (`format_name` would quote it, or it holds braces or
    commas) is a JSON string of its own. `parse_names` reads it back."""
    groups: dict[tuple[str, str], list[str]] = {}  # (parent, ".") -> leaves
    tokens: list[str] = []
    for name in names:
        if format_name(name) != name or any(c in name for c in "{},"):
            tokens.append(json.dumps(name))
            continue
        parent, sep, leaf = name.rpartition(".")
        if not sep:  # a top-level name (``vae:rest``) stands alone
            tokens.append(name)
            continue
        key = (parent, sep)
        if key not in groups:
            groups[key] = []
            tokens.append("")  # a group's place, filled below
        groups[key].append(leaf)
    grouped = iter(groups.items())
    out = []
    for token in tokens:
        if token:
            out.append(token)
            continue
        (parent, sep), leaves = next(grouped)
        out.append(parent + sep + (leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}"))
    return " ".join(out)


def _parse_names(line: _Line, text: str) -> list[str]:
    names: list[str] = []
    for token in _TOKEN.findall(text):
        if token.startswith('"'):
            names.append(_untoken(line, token))
            continue
        group = _GROUP.fullmatch(token)
        if group is not None:
            parent, sep, leaves = group.groups()
            names += [parent + sep + leaf for leaf in leaves.split(",")]
        elif any(c in token for c in "{},"):
            raise line.error(f"cannot read {token!r} as a name or a group parent.{{a,b}}")
        else:
            names.append(token)
    return names


def _placement(p: Placement) -> str:
    unit, where = format_name(p.unit), format_name(p.where)
    if unit != p.unit or where != p.where or "@" in p.where:
        return f"{json.dumps(p.unit)}@{json.dumps(p.where)}"
    return f"{unit}@{where}"


def _parse_placement(line: _Line, token: str) -> Placement:
    if token.startswith('"'):
        try:
            unit, end = json.JSONDecoder().raw_decode(token)
            where = load_json(token[end + 1 :]) if token[end : end + 1] == "@" else None
        except ValueError:
            where = None
        if not isinstance(unit, str) or not isinstance(where, str):
            raise line.error(f"placement {token} is not of the form unit@where")
        return Placement(unit=unit, where=where)
    unit, sep, where = token.rpartition("@")
    if not sep or not unit or not where:
        raise line.error(f"placement {token!r} is not of the form unit@where")
    return Placement(unit=unit, where=where)


def _align(rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    widths[0] = max(widths[0], 6)
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths, strict=True) if w]
        lines.append("  ".join(cells).rstrip())
    return lines


def _residency_rows(tag: str, placements: tuple[Placement, ...]) -> list[list[str]]:
    if not placements:
        return [[tag, "(none)", ""]]
    return [[tag, _placement(p), format_bytes(p.nbytes) if p.nbytes else ""] for p in placements]


def format_text(schedule: Schedule) -> str:
    """The canonical text of ``schedule``, which `parse_schedule` reads back to an equal schedule."""
    s = schedule
    step = s.step
    step_line = f"# step: {format_name(step.component)} #{step.index}"
    if step.next is not None:
        step_line += f" -> {format_name(step.next)}"
    lines = [HEADER, f"# policy: {_free(s.policy)}", f"# plan: {_free(s.plan)}", step_line]
    if s.file:
        lines.append(f"# file: {format_names(s.file)}")
    lines += [f"# note: {_free(n)}" for n in s.notes]
    table: list[list[str]] = []
    if step.entry != s.entry:
        table += _residency_rows("step-entry", step.entry)
    table += [["slot", format_name(sl.name), f"{sl.kind}  {format_bytes(sl.nbytes)}"] for sl in s.slots]
    table += _residency_rows("entry", s.entry)
    lines += _align(table)
    lines += _align([op_columns(op) for op in s.ops])
    lines += _align(_residency_rows("exit", s.exit))
    return "\n".join(lines) + "\n"


#: What `format_marked` can mark: an op, by its index in ``schedule.ops``, or ``"exit"``, the end.
Mark = int | Literal["exit"]


def format_marked(
    schedule: Schedule,
    marks: Collection[Mark] = (),
    *,
    lines: Collection[int] = (),
    note: str = "here",
    numbered: bool = False,
) -> str:
    """The canonical text of ``schedule`` (no summary) with ``<-- note`` after each marked line.

    ``marks`` names ops by index, and ``"exit"`` the end of the schedule (a last line
    ``(end of schedule)`` when not ``numbered``, else the first exit row); ``lines`` names lines by
    number (1-based), for marks on the header or the residency rows. ``numbered`` prefixes each line
    with its number, as `check`'s report shows the listing. One renderer serves `check` and the
    runtime's `ExecutionError`.
    """
    rows = format_text(schedule).splitlines()
    first_op = len(rows) - max(len(schedule.exit), 1) - len(schedule.ops)
    marked = {n - 1 for n in lines}
    marked.update(first_op + m for m in marks if m != "exit")
    end = "exit" in marks
    if end and numbered:
        marked.add(first_op + len(schedule.ops))
    if numbered:
        width = len(str(len(rows)))
        rows = [f"  {k:>{width}} | {t}" for k, t in enumerate(rows, start=1)]
    rows = [f"{t}  <-- {note}" if k in marked else t for k, t in enumerate(rows)]
    if end and not numbered:
        rows.append(f"(end of schedule)  <-- {note}")
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------- parse


class _Line:
    def __init__(self, number: int, text: str) -> None:
        self.number = number
        self.text = text

    def error(self, problem: str) -> ScheduleError:
        return ScheduleError(f"line {self.number}: {problem}: {self.text!r}")

    def tokens(self) -> list[str]:
        return _TOKEN.findall(self.text)


def _untoken(line: _Line, token: str) -> str:
    if token.startswith('"'):
        try:
            value = load_json(token)
        except ValueError:
            raise line.error(f"bad quoted name {token}") from None
        if not isinstance(value, str):
            raise line.error(f"bad quoted name {token}")
        return value
    return token


def _unfree(line: _Line, text: str) -> str:
    return _untoken(line, text) if text.startswith('"') else text


def _bytes(line: _Line, tokens: list[str], i: int) -> tuple[int, int]:
    """Parse ``<number> <unit> [(<exact>)]`` at ``tokens[i]``; returns (bytes, next index)."""
    if i + 1 >= len(tokens) or not NUMBER.fullmatch(tokens[i]) or tokens[i + 1] not in UNIT_NAMES:
        raise line.error(f"expected a byte count such as '670.2 MiB (702788608)' at {tokens[i]!r}")
    if tokens[i + 1] == "B":
        if "." in tokens[i]:
            raise line.error(f"byte count {tokens[i]} B is not a whole number")
        return int(tokens[i]), i + 2
    exact = _EXACT.fullmatch(tokens[i + 2]) if i + 2 < len(tokens) else None
    if exact is None:
        raise line.error(f"byte count {tokens[i]} {tokens[i + 1]} needs its exact value in brackets")
    return int(exact.group(1)), i + 3


def _residency(line: _Line, tokens: list[str]) -> Placement | None:
    if tokens[1:] == ["(none)"]:
        return None
    if len(tokens) < 2:
        raise line.error("expected a placement unit@where")
    p = _parse_placement(line, tokens[1])
    nbytes = 0
    if len(tokens) > 2:
        nbytes, end = _bytes(line, tokens, 2)
        if end != len(tokens):
            raise line.error(f"unexpected {tokens[end]!r} after the byte count")
    return Placement(unit=p.unit, where=p.where, nbytes=nbytes)


def _op(line: _Line, tokens: list[str]) -> Op:
    if len(tokens) < 5:
        raise line.error("an op needs at least: when anchor stream kind unit")
    when, anchor, stream, kind, unit = tokens[:5]
    if when not in _WHEN:
        raise line.error(f"unknown anchor side {when!r} (before, after)")
    if stream not in _STREAMS:
        raise line.error(f"unknown stream {stream!r} ({', '.join(_STREAMS)})")
    if kind not in OP_KINDS:
        raise line.error(f"unknown op kind {kind!r} ({', '.join(OP_KINDS)})")
    slot: str | None = None
    src: str | None = None
    chunks = 1
    nbytes = 0
    i = 5
    while i < len(tokens):
        tok = tokens[i]
        if tok in ("->", "from", "chunks") and i + 1 >= len(tokens):
            raise line.error(f"{tok!r} needs a value after it")
        if tok == "->":
            slot = _untoken(line, tokens[i + 1])
            i += 2
        elif tok == "from":
            src = _untoken(line, tokens[i + 1])
            i += 2
        elif tok == "chunks":
            if not tokens[i + 1].isdigit():
                raise line.error(f"chunks needs a whole number, got {tokens[i + 1]!r}")
            chunks = int(tokens[i + 1])
            i += 2
        else:
            nbytes, i = _bytes(line, tokens, i)
    return Op(
        when=when,
        anchor=_untoken(line, anchor),
        stream=stream,
        kind=kind,
        unit=_untoken(line, unit),
        slot=slot,
        src=src,
        nbytes=nbytes,
        chunks=chunks,
    )


def _step(line: _Line, rest: str) -> Step:
    tokens = _TOKEN.findall(rest)
    if len(tokens) not in (2, 4) or not re.fullmatch(r"#\d+", tokens[1]):
        raise line.error("expected '# step: <component> #<index> [-> <next>]'")
    nxt = None
    if len(tokens) == 4:
        if tokens[2] != "->":
            raise line.error("expected '->' before the next component")
        nxt = _untoken(line, tokens[3])
    return Step(component=_untoken(line, tokens[0]), index=int(tokens[1][1:]), next=nxt)


def parse_schedule(text: str) -> Schedule:
    """Parse the canonical text of a schedule; a `ScheduleError` names the first bad line."""
    lines = [_Line(n, t.rstrip()) for n, t in enumerate(text.splitlines(), start=1) if t.strip()]
    if not lines or lines[0].text != HEADER:
        where = lines[0] if lines else _Line(1, "")
        raise where.error(f"a schedule starts with {HEADER!r}")
    headers: dict[str, str] = {}
    notes: list[str] = []
    file: list[str] | None = None
    step: Step | None = None
    step_entry: list[Placement] | None = None
    slots: list[Slot] = []
    entry: list[Placement] = []
    ops: list[Op] = []
    exit_: list[Placement] = []
    section = 0  # 0 header, 1 table, 2 ops, 3 exit
    for line in lines[1:]:
        t = line.text
        if t.startswith("#"):
            key, sep, value = t[1:].strip().partition(":")
            value = value.strip()
            if not sep or key not in _HEADER_KEYS:
                raise line.error(f"unknown header line ({', '.join(_HEADER_KEYS)})")
            if key == "sim":
                continue
            if section != 0:
                raise line.error(f"'# {key}:' must come before the slot table")
            if key == "note":
                notes.append(_unfree(line, value))
            elif key == "file":
                if file is not None:
                    raise line.error("duplicate '# file:' line")
                file = _parse_names(line, value)
            elif key == "step":
                step = _step(line, value)
            elif key in headers:
                raise line.error(f"duplicate '# {key}:' line")
            else:
                headers[key] = _unfree(line, value)
            continue
        tokens = line.tokens()
        tag = tokens[0]
        if tag == "step-entry":
            if section > 1:
                raise line.error("'step-entry' must come before the ops")
            section = 1
            p = _residency(line, tokens)
            step_entry = step_entry if step_entry is not None else []
            if p is not None:
                step_entry.append(p)
        elif tag == "slot":
            kind = tokens[2] if len(tokens) >= 4 else ""
            if section > 1 or kind not in _SLOT_KINDS:
                raise line.error("expected 'slot <name> block|shard|staging|gather <bytes>' before the ops")
            section = 1
            nbytes, end = _bytes(line, tokens, 3)
            if end != len(tokens):
                raise line.error(f"unexpected {tokens[end]!r} after the byte count")
            slots.append(Slot(name=_untoken(line, tokens[1]), nbytes=nbytes, kind=kind))
        elif tag == "entry":
            if section > 1:
                raise line.error("'entry' must come before the ops")
            section = 1
            p = _residency(line, tokens)
            if p is not None:
                entry.append(p)
        elif tag in _WHEN:
            if section > 2:
                raise line.error("ops must come before 'exit'")
            section = 2
            ops.append(_op(line, tokens))
        elif tag == "exit":
            section = 3
            p = _residency(line, tokens)
            if p is not None:
                exit_.append(p)
        else:
            raise line.error(f"unknown line kind {tag!r} (slot, entry, before, after, exit)")
    for key in ("policy", "plan"):
        if key not in headers:
            raise ScheduleError(f"line 1: the schedule has no '# {key}:' line: {HEADER!r}")
    if step is None:
        raise ScheduleError(f"line 1: the schedule has no '# step:' line: {HEADER!r}")
    step_entry_t = tuple(step_entry) if step_entry is not None else tuple(entry)
    return Schedule(
        policy=headers["policy"],
        plan=headers["plan"],
        step=Step(component=step.component, index=step.index, entry=step_entry_t, next=step.next),
        slots=slots,
        entry=entry,
        ops=ops,
        exit=exit_,
        notes=notes,
        file=file or (),
    )
