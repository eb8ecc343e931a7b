"""A schedule compiled for one engine: ops bound to handlers, anchor stops, and the text ranks agree on.

Compiling checks every op against the host store (its unit exists, its slot is in the slot table,
a shard load or gather fits this rank's shard, a gather in chunks has the table's gather slot to
land them in) and raises `ExecutionError` with the listing marked
at the first op that cannot run, before anything moves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import attrs

from torchferry._errors import ExecutionError
from torchferry.policies import FILE, INVARIANTS, Op, Schedule, format_marked, format_schedule
from torchferry.runtime.executor._replay import Replay, block_key, plan_replay
from torchferry.runtime.executor._step_cache import step_name
from torchferry.runtime.memory import Unit
from torchferry.topology import Plan

if TYPE_CHECKING:
    from torchferry.runtime.device import Comm

__all__ = [
    "MAX_PROGRAMS",
    "MISSED",
    "Handler",
    "Program",
    "compile_program",
    "listing",
    "missed",
    "schedule_text",
]

#: An op kind's handler, bound to the engine that runs it (see `Mover.handlers`): a program needs
#: nothing else of the engine.
Handler = Callable[[Unit, Op], None]

#: Compiled schedules an engine keeps (oldest dropped first).
MAX_PROGRAMS = 512


#: What a runtime check that `check` makes unreachable calls its failure: not the caller's input.
MISSED = "a torchferry bug, or a custom policy that check missed"


def missed(what: str, invariant: int, schedule: Schedule | None = None, pc: int = 0) -> ExecutionError:
    """An op that `check` proves never comes (its invariant ``[invariant]``) reached the runtime:
    `ExecutionError` saying what, that it is a bug (`MISSED`) and which invariant, with ``schedule``'s
    listing marked at op ``pc``."""
    text = f"{what}: {MISSED} ([{invariant}] {INVARIANTS[invariant]})"
    return ExecutionError(text if schedule is None else f"{text}\n{listing(schedule, pc)}")


def listing(schedule: Schedule, pc: int) -> str:
    """The schedule's listing marked at op ``pc``, the next op to run (past the last: the end)."""
    return format_marked(schedule, ["exit" if pc >= len(schedule.ops) else pc])


def schedule_text(schedule: Schedule, plan: Plan) -> str:
    """The text ranks compare before a schedule's first collective (its canonical form)."""
    return format_schedule(attrs.evolve(schedule, plan=plan.digest), sim=False)


@attrs.define(slots=True, eq=False)
class Program:
    """A compiled schedule: prebound op calls, anchor stops, and how far it has run (``pc``)."""

    schedule: Schedule
    calls: tuple[tuple[Handler, Unit, Op], ...]
    stops: dict[str, int]
    #: The stop of each block's hook, to its key (`block_key`): what a replay's segments end at.
    ends: dict[int, str]
    entry: dict[str, str]
    exit: dict[str, str]
    slots: frozenset[str]
    collective: bool = False
    #: The gather slot its chunked gathers land their chunks in (``None``: it gathers in one piece).
    gather: str | None = None
    #: The schedule's text the ranks agree on before every run (made at the first; see `Engine.begin`).
    agreed: str | None = None
    #: Per op, whether a replay runs it as a pack's move; ``None``: never replayed ([Note: replay]).
    primitive: tuple[bool, ...] | None = None
    #: The replay its last recorded run made (``None`` until then, or when it cannot be made), and
    #: how many runs recorded one (see `Engine.begin`).
    replay: Replay | None = None
    recorded: int = 0
    pc: int = 0


def compile_program(
    schedule: Schedule, units: Mapping[str, Unit], handlers: Mapping[str, Handler], comm: Comm | None
) -> Program:
    """``schedule`` bound to ``units`` and ``handlers``; an op that cannot run raises `ExecutionError`."""
    calls: list[tuple[Handler, Unit, Op]] = []
    stops: dict[str, int] = {}
    names = {s.name for s in schedule.slots} | {p.where for p in schedule.entry}
    staging = {s.name for s in schedule.slots if s.kind == "staging"}
    gather = next((s.name for s in schedule.slots if s.kind == "gather"), None)
    chunked = False
    for i, op in enumerate(schedule.ops):
        unit = units.get(op.unit)
        problem = None
        if unit is None:
            problem = f"unit {op.unit!r} is not in this plan"
        elif op.kind not in handlers:
            problem = f"this engine has no handler for {op.kind!r} ops"
        elif op.slot is not None and op.slot not in names:
            problem = f"slot {op.slot!r} is not in the slot table"
        elif op.kind == "load" and op.src is None and len(unit.packs) != 1:
            problem = f"a load moves one block or remainder, and {op.unit!r} is {len(unit.packs)} buffers"
        elif op.src is not None and (op.src in staging or op.src == FILE):
            problem = _staged_problem(unit, op)
        elif op.kind in ("load", "gather") and op.src is not None:
            problem = _shard_problem(unit, op, names, comm)
        if problem is None and op.kind == "gather" and op.chunks > 1:
            chunked = True
            if gather is None:
                problem = f"a gather in {op.chunks} chunks lands them in a gather slot; the table has none"
        if problem is not None or unit is None:
            raise ExecutionError(
                f"cannot run op {i} of step {step_name(schedule.step)}: {problem} ({MISSED}, or a schedule "
                "for another plan)\n" + listing(schedule, i)
            )
        calls.append((handlers[op.kind], unit, op))
        stops[f"{op.when} {op.anchor}"] = i + 1
    # The end of the step's own component is past every anchor inside it: whatever a skipped last
    # block left pending runs there.
    stops[f"after {schedule.step.component}"] = len(calls)
    used = {gather} if chunked and gather is not None else set()
    bound = tuple(calls)
    return Program(
        schedule=schedule,
        calls=bound,
        stops=stops,
        ends={stop: block_key(key[7:]) for key, stop in stops.items() if key.startswith("before ")},
        entry={p.unit: p.where for p in schedule.entry},
        exit={p.unit: p.where for p in schedule.exit},
        slots=frozenset(op.slot for op in schedule.ops if op.slot is not None) | used,
        collective=any(op.kind == "gather" for op in schedule.ops),
        gather=gather if chunked else None,
        primitive=plan_replay(schedule, bound),
    )


def _staged_problem(unit: Unit, op: Op) -> str | None:
    """Why ``op`` cannot move ``unit`` from a staging slot (or straight from the file, `FILE`), or
    ``None`` when it can."""
    where = "the file" if op.src == FILE else f"staging slot {op.src!r}"
    if op.kind not in ("load", "stage"):
        return f"a {op.kind} cannot read from {where}; only a load or a stage can"
    if not any(p.in_file for p in unit.packs):
        return f"{op.unit} is in host memory, not the file tier: no read fills {where}"
    if op.kind == "load" and len(unit.packs) != 1:
        return f"a load moves one block or remainder, and {op.unit!r} is {len(unit.packs)} buffers"
    return None


def _shard_problem(unit: Unit, op: Op, slots: set[str], comm: Comm | None) -> str | None:
    """Why this rank cannot run a shard load or a gather of ``unit``, or ``None`` when it can."""
    if op.kind == "load" and op.src != "shard":
        return f"a load's source must be 'shard' (this rank's shard) or none, not {op.src!r}"
    if op.kind == "gather" and op.src not in slots:
        return f"gather source slot {op.src!r} is not in the slot table"
    if comm is None:
        return (
            f"{op.unit} is all-gathered across ranks, but this engine has no weight-shard group (the "
            "plan's shard group size is 1); use a plan whose parallel layout matches the process group"
        )
    pack = unit.packs[0] if len(unit.packs) == 1 else None
    if pack is None or pack.shard is None:
        return f"{op.unit} is not sharded on this rank (the plan does not all-gather it)"
    shard = pack.held_bytes
    expect = shard if op.kind == "load" else shard * comm.world
    if op.nbytes and op.nbytes != expect:
        return (
            f"the schedule moves {op.nbytes} bytes but this rank's {op.kind} of {op.unit} is {expect} "
            f"bytes ({comm.world} ranks, {shard}-byte shards); the schedule was made for another "
            "plan or world size"
        )
    return None
