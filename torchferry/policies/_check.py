"""`check`: prove a schedule safe for a plan, or report every violation at once."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache

import attrs

from torchferry._errors import DEVICE_BUDGET, Flag, Part, ScheduleError
from torchferry.policies._check_file import FileTierCheck
from torchferry.policies._ir import DEVICE, OP_STREAM, Op, Schedule, gather_nbytes, rest_unit
from torchferry.policies._layout import PlanFacts, forward_blocks, has_blocks, layout, shard_nbytes
from torchferry.policies._text import format_marked
from torchferry.policies._tokens import format_bytes
from torchferry.topology import Component, Plan

__all__ = ["INVARIANTS", "check"]

#: The invariants `check` proves, by number (error messages cite them as ``[n]``).
INVARIANTS: dict[int, str] = {
    1: "a unit is read only while resident and after a wait that follows its last load/gather/stage",
    2: "no slot is written while it still holds a unit that was not evicted (or a shard not yet gathered)",
    3: "each op's byte count is its unit's and fits the slot it goes to",
    4: "device bytes never exceed config.device_memory_bytes",
    5: "the exit residency is exactly what the entry and the ops leave",
    6: "collectives match on every rank: only all-gathered blocks of loaded components gather, right "
    "after their shard load",
    7: "the schedule is well formed: its plan, step, anchors in forward order, streams, units and slots",
    8: "host bytes (packs in host memory, staging slots, read buffers, and the kept, widened and scratch "
    "buffers the plan's facts add) never exceed config.host_memory_bytes",
    9: "only file-tier units are read, each into an empty staging slot; a file-tier unit is loaded or "
    "staged only from the staging slot it was read into, in the same step",
    10: "pinned host bytes (packs in host memory, staging slots, read buffers) never exceed the "
    "locked-memory limit where it binds the pinner (plan.facts.locked_bytes)",
}


# Header lines of the listing: 1 the version, 2 the policy, 3 the plan, 4 the step, 5 the file tier
# (when the schedule has one).
_PLAN_LINE = 3
_STEP_LINE = 4
_FILE_LINE = 5


@lru_cache(maxsize=64)
def _stub_blocks(plan: Plan) -> Mapping[str, str]:
    """Block path -> the stub component (declared but not loaded on this rank) whose forward runs it."""
    return {
        b.path: c.path for top in plan.components for c in top.walk() if c.stub for b in forward_blocks(c)
    }


def _this_plan(digest: str) -> Flag:
    """The plan a schedule is checked against: by its digest for the API, in words for the command line."""
    return Flag(f"this plan {digest}", "this plan")


@attrs.define
class _Violation:
    line: int
    number: int
    #: The violation, in words or in parts naming request fields (`torchferry._errors.Flag`).
    text: str | tuple[Part, ...]


class _Checker:
    def __init__(self, schedule: Schedule, plan: Plan) -> None:
        self.s = schedule
        self.plan = plan
        self.found: list[_Violation] = []
        self.lay: PlanFacts = layout(plan)
        # Line numbers of the listing (`format_schedule`): the header, the notes, any step-entry rows,
        # the slots, the entry rows (at least one), the ops, the exit.
        entry_rows = max(len(schedule.entry), 1)
        step_rows = max(len(schedule.step.entry), 1) if schedule.step.entry != schedule.entry else 0
        header = _STEP_LINE + (1 if schedule.file else 0) + len(schedule.notes)
        self.entry_line = header + 1 + step_rows + len(schedule.slots)
        self.op_line0 = self.entry_line + entry_rows
        self.exit_line = self.op_line0 + len(schedule.ops)
        self.slots = {s.name: s for s in schedule.slots}
        self.staging = {s.name for s in schedule.slots if s.kind == "staging"}
        self.tier = FileTierCheck(schedule, plan, self.add)
        self.world = plan.config.dp_size
        # residency state
        self.where: dict[str, str] = {}
        self.occupant: dict[str, str] = {}
        self.shard: dict[str, tuple[str, Op]] = {}
        self.ready: set[str] = set()
        self.acquired: set[str] = set()
        self.held: dict[str, int] = {}
        self.allocated: set[str] = set()
        self.current = 0
        self.over_reported = False
        self.covers: dict[str, list[str]] = {}
        self.whole: set[str] = set()
        # forward position -> line of the last op anchored there (where that point's compute reads)
        self.point_line: dict[int, int] = {}

    def add(self, line: int, number: int, text: str | tuple[Part, ...]) -> None:
        self.found.append(_Violation(line=line, number=number, text=text))

    # ---------------------------------------------------------------- sizes

    def size(self, unit: str) -> int | None:
        return self.lay.sizes.get(unit)

    def _grow(self, nbytes: int, line: int) -> None:
        self.current += nbytes
        budget = self.plan.config.device_memory_bytes
        if budget is not None and self.current > budget and not self.over_reported:
            self.over_reported = True
            self.add(
                line,
                4,
                (
                    f"device bytes reach {format_bytes(self.current)} here, over the budget of "
                    f"{format_bytes(budget)} (",
                    DEVICE_BUDGET,
                    "); stream more blocks, lower the prefetch depth or raise the budget",
                ),
            )

    # ---------------------------------------------------------------- forward model

    def forward(self) -> tuple[Component | None, list[str]]:
        for top in self.plan.components:
            if top.path == self.s.step.component:
                for c in top.walk():
                    chain = self.covering(top, c.path)
                    for b in forward_blocks(c):
                        self.covers.setdefault(b.path, chain)
                return top, [b.path for b in forward_blocks(top)]
        known = ", ".join(repr(c.path) for c in self.plan.components)
        self.add(
            _STEP_LINE,
            7,
            f"step component {self.s.step.component!r} is not a top-level component; known: {known}",
        )
        return None, []

    def covering(self, top: Component, path: str) -> list[str]:
        """Whole-component units (outermost first) whose residency covers component ``path``."""
        chain: list[str] = []

        def walk(c: Component, trail: list[str]) -> bool:
            if c.path == path:
                chain.extend([*trail, c.path])
                return True
            return any(walk(ch, [*trail, c.path]) for ch in c.children)

        walk(top, [])
        return chain

    def reads_ready(self, unit: str, covers: list[str], line: int, what: str, *, block: bool) -> None:
        """Report unless ``unit`` or a whole component covering it is resident and ready."""
        candidates = [unit, *(c for c in covers if c != unit)]
        for u in candidates:
            w = self.where.get(u)
            if w is None or (w == "acquired" and block and u != unit and u not in self.whole):
                continue
            if w == "acquired" or u in self.ready:
                return
        resident = next((u for u in candidates if u in self.where), None)
        if resident is not None:
            self.add(line, 1, f"{what} reads {resident} before a wait on it; add 'wait {resident}' before it")
        else:
            self.add(line, 1, f"{what} reads {unit}, which is not on the device; load or stage it first")

    def component_reads(self, top: Component, line: int, when: str) -> None:
        for c in top.walk():
            blocky = has_blocks(c)
            if blocky and not c.tensors:
                continue
            unit = rest_unit(c.path) if blocky else c.path
            self.reads_ready(unit, self.covering(top, c.path), line, f"{top.path} ({when})", block=False)

    # ---------------------------------------------------------------- replay

    def run(self) -> None:
        s = self.s
        if s.plan != self.plan.digest:
            self.add(
                _PLAN_LINE,
                7,
                (f"schedule was made for plan {s.plan}, not ", _this_plan(self.plan.digest), "; rebuild it"),
            )
        top, blocks = self.forward()
        self.tier.host(_FILE_LINE if s.file else _PLAN_LINE)
        for k, p in enumerate(s.entry):
            line = self.entry_line + k
            if p.where in self.staging:
                self.add(
                    line,
                    9,
                    f"entry places {p.unit} in staging slot {p.where}; a staging slot is host memory that "
                    "holds a read within one step, never a unit between steps",
                )
                continue
            if p.where == DEVICE:
                self.held[p.unit] = self.size(p.unit) or p.nbytes
                self.current += self.held[p.unit]
            elif p.where not in self.slots:
                self.add(line, 7, f"entry places {p.unit} in slot {p.where}, which the slot table lacks")
                continue
            else:
                self.occupant[p.where] = p.unit
                if p.where not in self.allocated:
                    self.allocated.add(p.where)
                    self.current += self.slots[p.where].nbytes
            if self.size(p.unit) is None:
                self.add(line, 7, f"entry names {p.unit}, which is no unit of this plan")
            self.where[p.unit] = p.where
        budget = self.plan.config.device_memory_bytes
        if budget is not None and self.current > budget:
            self.over_reported = True
            self.add(
                self.entry_line,
                4,
                (
                    f"entry already holds {format_bytes(self.current)}, over the budget of "
                    f"{format_bytes(budget)} (",
                    DEVICE_BUDGET,
                    ")",
                ),
            )
        order = {("before", self.s.step.component): 0, ("after", self.s.step.component): 2 * len(blocks) + 1}
        for k, b in enumerate(blocks):
            order[("before", b)] = 2 * k + 1
            order[("after", b)] = 2 * k + 2
        done = -1  # last forward position whose compute has run
        position = 0
        for i, op in enumerate(s.ops):
            line = self.op_line0 + i
            pos = order.get((op.when, op.anchor))
            if pos is None:
                self.add(
                    line, 7, f"anchor {op.when} {op.anchor} is not a point of {s.step.component}'s forward"
                )
            elif pos < position:
                self.add(line, 7, f"op at {op.when} {op.anchor} comes after a later point of the forward")
            else:
                position = pos
                if top is not None:
                    done = self.computes(top, blocks, done, pos, line)
                self.point_line[pos] = line
            self.op(op, line)
        if top is not None:
            self.computes(top, blocks, done, 2 * len(blocks) + 2, self.exit_line - 1)
        self.exit()

    def computes(self, top: Component, blocks: list[str], done: int, pos: int, line: int) -> int:
        """Run the forward's reads between the last position done and ``pos`` (exclusive).

        The compute at a point follows that point's ops, so its reads are reported on the point's last
        op (where a missing wait belongs), or on ``line``, the first op after it, when it has none.
        """
        for p in range(done + 1, pos):
            at = self.point_line.get(p, line)
            if p == 0:
                self.component_reads(top, at, "start")
            elif p % 2 == 1 and p < 2 * len(blocks):
                b = blocks[(p - 1) // 2]
                self.reads_ready(b, self.covers[b], at, f"block {b}", block=True)
            if p == 2 * len(blocks):
                self.component_reads(top, at, "end")
        return max(done, pos - 1)

    def op(self, op: Op, line: int) -> None:
        if OP_STREAM[op.kind] != op.stream:
            self.add(line, 7, f"{op.kind} runs on the {OP_STREAM[op.kind]} stream, not {op.stream}")
        size = self.size(op.unit)
        if size is None and op.kind not in ("evict", "unstage", "release", "wait"):
            self.add(line, 7, f"{op.unit} is no unit of this plan")
            return
        _CHECKS[op.kind](self, op, line, size or 0)

    def _slot(self, op: Op, line: int, kind: str) -> bool:
        if op.slot is None or op.slot not in self.slots:
            self.add(line, 7, f"{op.kind} of {op.unit} names slot {op.slot}, which the slot table lacks")
            return False
        if self.slots[op.slot].kind != kind:
            self.add(
                line,
                7,
                f"{op.kind} of {op.unit} goes to {self.slots[op.slot].kind} slot {op.slot}; "
                f"it needs a {kind} slot",
            )
            return False
        if op.nbytes > self.slots[op.slot].nbytes:
            self.add(
                line,
                3,
                f"{op.unit} needs {format_bytes(op.nbytes)} but slot {op.slot} holds "
                f"{format_bytes(self.slots[op.slot].nbytes)}; size the slot to the largest unit it takes",
            )
        if op.slot not in self.allocated:
            self.allocated.add(op.slot)
            self._grow(self.slots[op.slot].nbytes, line)
        return True

    def _write_block_slot(self, op: Op, line: int) -> None:
        slot = op.slot or ""
        if slot in self.occupant and self.occupant[slot] != op.unit:
            self.add(
                line,
                2,
                f"{op.kind} writes slot {slot} while it still holds {self.occupant[slot]}; "
                f"evict {self.occupant[slot]} after its last read first",
            )
            self.where.pop(self.occupant[slot], None)
        old = self.where.get(op.unit)
        if old is not None and old != slot and old in self.occupant:
            del self.occupant[old]
        self.occupant[slot] = op.unit
        self.where[op.unit] = slot
        self.ready.discard(op.unit)

    def _read(self, op: Op, line: int, size: int) -> None:
        self.tier.read(op, line)

    def _load(self, op: Op, line: int, size: int) -> None:
        staged = self.tier.copies(op, line)
        if staged and op.slot in self.slots and self.slots[op.slot].kind == "shard":
            op = attrs.evolve(op, src="shard")
        if op.src == "shard":
            expected = shard_nbytes(size, self.world)
            if op.nbytes != expected:
                self.add(
                    line, 3, f"shard of {op.unit} is {format_bytes(expected)}, not {format_bytes(op.nbytes)}"
                )
            if not self._slot(op, line, "shard"):
                return
            slot = op.slot or ""
            if slot in self.shard:
                self.add(
                    line,
                    2,
                    f"load writes shard slot {slot} before the gather of "
                    f"{self.shard[slot][0]} read it; gather it first",
                )
            self.shard[slot] = (op.unit, op)
            return
        if op.src is not None and not staged:
            self.add(line, 7, f"load source {op.src!r} is not 'shard', a staging slot, or none (whole)")
        if op.nbytes != size:
            self.add(line, 3, f"{op.unit} is {format_bytes(size)}, not {format_bytes(op.nbytes)}")
        if self._slot(op, line, "block"):
            self._write_block_slot(op, line)

    def _gather(self, op: Op, line: int, size: int) -> None:
        shard_op = self.shard.get(op.src or "")
        if op.unit not in self.lay.allgather or self.world <= 1:
            self.add(
                line,
                6,
                f"{op.unit} is not all-gathered under this plan (world {self.world}); load it whole instead",
            )
        stub = _stub_blocks(self.plan).get(op.unit)
        if stub is not None:
            self.add(
                line,
                6,
                f"gather of {op.unit} is a collective on {stub!r}, which this plan marks as a stub (not "
                f"loaded on this rank), so the ranks would not agree on it; stream {stub!r} rank-local "
                "or load it on every rank",
            )
        if shard_op is None or shard_op[0] != op.unit:
            self.add(
                line,
                6,
                f"gather of {op.unit} reads shard slot {op.src}, which holds no shard of it; "
                f"load its shard there first",
            )
        elif shard_op[1].chunks != op.chunks:
            self.add(
                line,
                6,
                f"gather of {op.unit} uses {op.chunks} chunks but its shard load "
                f"{shard_op[1].chunks}; use the same count",
            )
        expected = shard_nbytes(size, self.world) * self.world
        if op.nbytes != expected:
            self.add(
                line, 3, f"gathered {op.unit} is {format_bytes(expected)}, not {format_bytes(op.nbytes)}"
            )
        if shard_op is not None:
            del self.shard[op.src or ""]
        self._gather_slot(op, line, shard_nbytes(size, self.world))
        if self._slot(op, line, "block"):
            self._write_block_slot(op, line)

    def _gather_slot(self, op: Op, line: int, shard: int) -> None:
        """A chunked gather lands each chunk of every rank in the table's gather slot (counted from here)."""
        need = gather_nbytes(shard, op.chunks, self.world)
        if not need:
            return
        gathers = [s for s in self.slots.values() if s.kind == "gather"]
        if not gathers:
            self.add(
                line,
                3,
                f"gather of {op.unit} in {op.chunks} chunks lands each chunk of every rank in a gather slot "
                f"of {format_bytes(need)}, and the slot table has none; add 'slot g0 gather {need}'",
            )
            return
        slot = gathers[0]
        if len(gathers) > 1:
            self.add(line, 7, f"the slot table has {len(gathers)} gather slots; chunked gathers share one")
        if slot.nbytes < need:
            self.add(
                line,
                3,
                f"gather of {op.unit} in {op.chunks} chunks needs {format_bytes(need)} in gather slot "
                f"{slot.name}, which holds {format_bytes(slot.nbytes)}; size it to the largest chunk set",
            )
        if slot.name not in self.allocated:
            self.allocated.add(slot.name)
            self._grow(slot.nbytes, line)

    def _stage(self, op: Op, line: int, size: int) -> None:
        if not self.tier.copies(op, line) and op.src is not None:
            self.add(line, 7, f"stage source {op.src!r} is not a staging slot (or none: from host memory)")
        if op.nbytes != size:
            self.add(line, 3, f"{op.unit} is {format_bytes(size)}, not {format_bytes(op.nbytes)}")
        if op.unit in self.where:
            self.add(line, 7, f"stage of {op.unit}, which is already on the device at {self.where[op.unit]}")
            return
        self.where[op.unit] = DEVICE
        self.held[op.unit] = size
        self.ready.discard(op.unit)
        self._grow(size, line)

    def _unstage(self, op: Op, line: int, size: int) -> None:
        if self.where.get(op.unit) != DEVICE:
            self.add(line, 7, f"unstage of {op.unit}, which is not staged")
            return
        del self.where[op.unit]
        self.ready.discard(op.unit)
        self.current -= self.held.pop(op.unit, 0)

    def _acquire(self, op: Op, line: int, size: int) -> None:
        expected = self.lay.acquired.get(op.unit)
        if expected is None:
            self.add(line, 7, f"{op.unit} is not an on-demand component of this plan")
            return
        if op.nbytes == size:
            self.whole.add(op.unit)
            expected = size
        if op.nbytes != expected:
            self.add(
                line,
                3,
                f"{op.unit} brings {format_bytes(expected)} (or {format_bytes(size)} whole), "
                f"not {format_bytes(op.nbytes)}",
            )
        self.where[op.unit] = "acquired"
        self.acquired.add(op.unit)
        self.held[op.unit] = expected
        self._grow(expected, line)

    def _release(self, op: Op, line: int, size: int) -> None:
        if op.unit not in self.acquired:
            self.add(line, 7, f"release of {op.unit}, which was not acquired")
            return
        self.acquired.discard(op.unit)
        self.whole.discard(op.unit)
        del self.where[op.unit]
        self.current -= self.held.pop(op.unit, 0)

    def _wait(self, op: Op, line: int, size: int) -> None:
        if op.unit not in self.where:
            self.add(line, 7, f"wait on {op.unit}, which is not on the device")
            return
        self.ready.add(op.unit)

    def _evict(self, op: Op, line: int, size: int) -> None:
        slot = self.where.get(op.unit)
        if slot is None or slot in (DEVICE, "acquired"):
            self.add(line, 7, f"evict of {op.unit}, which is in no slot")
            return
        del self.where[op.unit]
        self.occupant.pop(slot, None)
        self.ready.discard(op.unit)

    def exit(self) -> None:
        left = {(u, w) for u, w in self.where.items() if w != "acquired"}
        listed = [(p.unit, p.where) for p in self.s.exit]
        for k, pair in enumerate(listed):
            if pair not in left:
                actual = self.where.get(pair[0])
                now = f"the ops leave it at {actual}" if actual else "the ops leave it off the device"
                self.add(self.exit_line + k, 5, f"exit lists {pair[0]}@{pair[1]} but {now}")
        for u, w in sorted(left - set(listed)):
            self.add(self.exit_line, 5, f"exit omits {u}@{w}, which the ops leave on the device")
        for u in sorted(self.acquired):
            self.add(self.exit_line, 5, f"{u} is acquired but never released")
        self.tier.exit(self.exit_line)

    def report(self) -> None:
        if not self.found:
            return
        s = self.s
        self.found.sort(key=lambda v: (v.line, v.number))
        n = len(self.found)
        head = (
            f"schedule {s.policy} for step {s.step.component!r} #{s.step.index} breaks "
            f"{n} invariant{'s' if n != 1 else ''} of policies.check:"
        )
        parts: list[Part] = [head]
        for v in self.found:
            parts.append(f"\n  line {v.line}: [{v.number}] ")
            parts.extend((v.text,) if isinstance(v.text, str) else v.text)
        listing = format_marked(s, lines={v.line for v in self.found}, numbered=True)
        raise ScheduleError.worded(*parts, "\nlisting:\n", listing)


#: One check per op kind (the engine and `simulate` dispatch the same way: a table keyed by kind).
_CHECKS: dict[str, Callable[[_Checker, Op, int, int], None]] = {
    "load": _Checker._load,
    "gather": _Checker._gather,
    "wait": _Checker._wait,
    "evict": _Checker._evict,
    "stage": _Checker._stage,
    "unstage": _Checker._unstage,
    "acquire": _Checker._acquire,
    "release": _Checker._release,
    "read": _Checker._read,
}


def check(schedule: Schedule, plan: Plan) -> None:
    """Prove ``schedule`` safe for ``plan``; raise one `ScheduleError` listing every violation.

    Invariants (cited as ``[n]`` in the report, each located on its line of the listing):

    1. A block, a remainder or a whole component is read (its compute) only while it is on the
       device and after a ``wait`` on it that follows its last load, gather or stage.
    2. No slot is written while a reader may still use it: a block slot is loaded or gathered into
       only after its previous unit was evicted; a shard slot only after its shard was gathered.
    3. Every op's byte count is its unit's (shards: `shard_nbytes`; gathers: shard x world) and fits
       the slot it goes to; a gather in more than one chunk has the table's one ``gather`` slot of at
       least `gather_nbytes` to land them in.
    4. Device bytes (slots from first use, the gather slot from the first chunked gather, staged and
       acquired units while held) never exceed ``plan.config.device_memory_bytes``.
    5. The exit residency is exactly what the entry and the ops leave; acquired units are released.
    6. Collective order is identical across ranks: only blocks that the plan all-gathers (world > 1)
       are gathered, never a block of a component the plan marks as a stub (loaded on some ranks
       only), each right after its shard load, with the same chunk count; everything else depends
       only on the plan and the step, which every rank shares.
    7. The schedule is well formed: made for this plan, its step a top-level component, every op
       anchored at a point of that forward in forward order, on its kind's stream, naming units of
       the plan and slots of the table (a read a staging slot), its file tier packs of the plan.
    8. Host bytes (the packs in host memory, whole pages, an all-gathered block's shard only; the
       staging slots; the reader's buffers when there is a file tier: `policies.tiers`) never
       exceed ``plan.config.host_memory_bytes``; with the kept, widened and scratch buffers of its
       `StoreFacts`, that is the whole host figure.
    9. Only units with packs in the file tier (``schedule.file``) are read, each into a staging slot
       whose previous read a load or stage already copied out; a load or stage of such a unit copies
       from the staging slot it was read into (the store has no bytes for it), and no other does; no
       read is left in a staging slot at the exit (reads never cross a step).
    10. Pinned host bytes (the store, the staging slots, the read buffers) never exceed
        ``plan.facts.locked_bytes``, ``RLIMIT_MEMLOCK`` where it binds the pinner.
    """
    checker = _Checker(schedule, plan)
    checker.run()
    checker.report()
