"""`check`'s part for the file tier: host bytes against the host budget ([8]) and every read, staging
slot and copy out of one ([9]), replayed op by op alongside the device checks of `_check`."""

from __future__ import annotations

from collections.abc import Callable

from torchferry._errors import HOST_BUDGET, Part
from torchferry.policies._ir import FILE, Op, Schedule
from torchferry.policies._layout import layout, pack_bytes, pack_table
from torchferry.policies._tiers import (
    file_packs,
    host_bytes,
    page_bytes,
    read_buffer_bytes,
    read_nbytes,
    read_size,
    reads_direct,
)
from torchferry.policies._tokens import format_bytes
from torchferry.topology import Plan

__all__ = ["FileTierCheck"]

#: How a violation is reported: ``add(line, invariant, text)``, the text in words or in parts.
Add = Callable[[int, int, "str | tuple[Part, ...]"], None]


class FileTierCheck:
    """The staging slots of one schedule as its ops replay: which holds a read not yet copied out."""

    def __init__(self, schedule: Schedule, plan: Plan, add: Add) -> None:
        self.s = schedule
        self.plan = plan
        self.add = add
        self.slots = {s.name: s for s in schedule.slots}
        self.staging = {s.name for s in schedule.slots if s.kind == "staging"}
        self.file = frozenset(schedule.file)
        self.sharded = layout(plan).allgather
        #: staging slot -> the unit read into it and not yet copied out
        self.held: dict[str, str] = {}

    def host(self, line: int) -> None:
        """[7] the file tier names packs of the plan; [8] host bytes fit the host budget."""
        packs = {name for name, _ in pack_table(self.plan)}
        stray = [name for name in self.s.file if name not in packs]
        if stray:
            self.add(line, 7, f"the file tier names {', '.join(stray)}, which are no packs of this plan")
        budget = self.plan.config.host_memory_bytes
        staging = [self.slots[n] for n in sorted(self.staging)]
        total, store = host_bytes(self.plan, self.file, staging)
        largest = read_size(self.plan, self.file, (sl.nbytes for sl in staging))
        buffers = read_buffer_bytes(largest) if self.file else 0
        self.locked(line, store + sum(page_bytes(sl.nbytes) for sl in staging) + buffers)
        if budget is None or total <= budget:
            return
        parts = f"{format_bytes(store)} of packs in host memory"
        if self.file:
            parts += (
                f", {len(staging)} staging slots ({format_bytes(sum(sl.nbytes for sl in staging))})"
                f" and {format_bytes(buffers)} of read buffers"
            )
        self.add(
            line,
            8,
            (
                f"host bytes reach {format_bytes(total)} ({parts}), over the budget of "
                f"{format_bytes(budget)} (",
                HOST_BUDGET,
                "); put more packs in the file tier (policies.tiers(plan) chooses them for this budget) or "
                "raise the budget",
            ),
        )

    def locked(self, line: int, pinned: int) -> None:
        """[10] pinned host bytes within the locked-memory limit, where it binds the pinner."""
        limit = self.plan.facts.locked_bytes
        if limit is not None and pinned > limit:
            self.add(
                line,
                10,
                f"pinned host bytes reach {format_bytes(pinned)}, over the locked-memory limit of "
                f"{format_bytes(limit)} (plan.facts.locked_bytes); put more packs in the file tier or raise "
                "the limit (ulimit -l)",
            )

    def read(self, op: Op, line: int) -> None:
        """A ``read``: into an empty staging slot, of a file-tier unit, its file bytes."""
        slot = op.slot or ""
        if slot not in self.staging:
            self.add(line, 7, f"read of {op.unit} goes to {slot or 'no slot'}, which is not a staging slot")
            return
        packs = file_packs(self.plan, self.file, op.unit)
        if not packs:
            self.add(
                line,
                9,
                f"read of {op.unit}, which has no pack in the file tier (# file:); its bytes are in host "
                "memory, so load or stage it without a read",
            )
        sharded = op.unit in self.sharded
        if op.src not in (None, "shard") or (op.src == "shard") != sharded:
            want = "'shard' (it is all-gathered)" if sharded else "none (it is not all-gathered)"
            self.add(line, 7, f"read source of {op.unit} is {op.src!r}; it must be {want}")
        expected = read_nbytes(self.plan, self.file, op.unit)
        if packs and op.nbytes != expected:
            shown = f"{format_bytes(expected)} from the file, not {format_bytes(op.nbytes)}"
            self.add(line, 3, f"{op.unit} reads {shown}")
        largest = max((pack_bytes(self.plan, p) for p in packs), default=0)
        if largest > self.slots[slot].nbytes:
            self.add(
                line,
                3,
                f"a pack of {op.unit} is {format_bytes(largest)} but staging slot {slot} holds "
                f"{format_bytes(self.slots[slot].nbytes)}; size staging slots to the largest file-tier pack",
            )
        if slot in self.held:
            self.add(
                line,
                9,
                f"read into {slot} while it still holds the read of {self.held[slot]}, which no load or "
                f"stage copied out yet; load or stage {self.held[slot]} from {slot} first, or read into "
                "another staging slot",
            )
        self.held[slot] = op.unit

    def copies(self, op: Op, line: int) -> bool:
        """A ``load`` or ``stage``: a file-tier unit copies from the staging slot it was read into,
        nothing else copies from one; that slot is free again. Whether ``op`` copies from staging."""
        src = op.src
        in_file = bool(file_packs(self.plan, self.file, op.unit))
        if src == FILE:
            self.direct(op, line, in_file)
            return True
        if src is None or src not in self.staging:
            if in_file:
                self.add(
                    line,
                    9,
                    f"{op.kind} of {op.unit} from host memory, but it is in the file tier and the store "
                    f"has no bytes for it; read it into a staging slot first and {op.kind} it from there",
                )
            return False
        held = self.held.pop(src, None)
        if not in_file:
            self.add(line, 9, f"{op.kind} of {op.unit} from staging slot {src}, but it has no file-tier pack")
        elif held != op.unit:
            holds = f"holds the read of {held}" if held is not None else "holds no read"
            self.add(line, 9, f"{op.kind} of {op.unit} from {src}, which {holds}; read {op.unit} there first")
        return True

    def direct(self, op: Op, line: int, in_file: bool) -> None:
        """A ``load`` or ``stage`` ``from file``: the reader fills the device's memory itself, which
        only a device whose memory is host memory allows (`reads_direct`), and only of a file-tier unit."""
        if not in_file:
            self.add(line, 9, f"{op.kind} of {op.unit} from file, but it has no file-tier pack; {op.kind} it "
                     "from host memory")  # fmt: skip
        elif not reads_direct(self.plan):
            self.add(
                line,
                9,
                f"{op.kind} of {op.unit} from file: the reader fills device memory itself only where it is "
                "host memory (a CPU device, plan.facts.host_device) and no block is all-gathered; read "
                f"{op.unit} into a staging slot and {op.kind} it from there",
            )

    def exit(self, line: int) -> None:
        """No read is left in a staging slot at the exit: reads never cross a step."""
        for slot, unit in sorted(self.held.items()):
            self.add(
                line,
                9,
                f"staging slot {slot} still holds the read of {unit} at the exit; reads never cross a step, "
                f"so load or stage {unit} in this step, or do not read it",
            )
