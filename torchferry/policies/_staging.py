"""Reads in a schedule being built: file-tier units read into staging slots before their load or stage.

[Note: reads in the ring]
A unit with packs in the file tier (`policies.tiers`) has no host copy, so every load or stage of
it copies from a staging slot that a ``read`` on the io stream filled first. The ring reads ahead:
at each anchor, once the window's loads are issued, it reads the next `READ_AHEAD` file-tier units
of its queue that are neither on the device nor read yet, each into a free staging slot. A staging
slot is free again once the load or stage that copies it out was issued (the runtime starts the
next read into it after that copy has finished), and slots are reused first-freed-first, so one is
read into while the other is copied out. A unit the window needs that was not read ahead (the
first blocks of a step, a unit right after a resident one) is read at the anchor of its load,
just before it. Staged units (remainders, resident blocks, whole components) are read and staged
at the same anchor. Reads never cross a step: a step reads only what it loads or stages itself,
so every staging slot is empty at its exit and the next step starts with no read in flight.

Where the reader fills device slots itself (`reads_direct`: the device's memory is host memory) there
is no staging slot to read ahead into: a load or stage of a file-tier unit names `FILE` as its source
and reads as it loads, into the slot it loads into.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

from torchferry.policies._ir import FILE, OpKind, Schedule, When
from torchferry.policies._layout import layout
from torchferry.policies._tiers import Tiers, file_packs, read_nbytes, reads_direct
from torchferry.topology import Plan

__all__ = ["READ_AHEAD", "Emit", "Reads", "file_read_bytes"]

#: File-tier units the ring reads ahead of the window it loads (see the note).
READ_AHEAD = 1

#: How `Reads` appends an op: ``emit(when, anchor, kind, unit, slot=..., src=..., nbytes=...)``.
Emit = Callable[..., None]


def file_read_bytes(schedule: Schedule) -> int:
    """Bytes ``schedule`` reads from the checkpoint: its ``read`` ops into staging slots, and its loads
    and stages `FILE` (the reader filling device memory itself)."""
    return sum(op.nbytes for op in schedule.ops if op.kind == "read" or op.src == FILE)


class Reads:
    """The staging slots of one schedule being built: which hold a read not yet copied out, which
    are free (see the note)."""

    def __init__(self, plan: Plan, tiers: Tiers, emit: Emit) -> None:
        self.plan = plan
        self.file = tiers.file
        self.free = [s.name for s in tiers.staging]
        self.holding: dict[str, str] = {}
        self.emit = emit
        self.sharded = layout(plan).allgather
        #: The reader fills device slots itself: no staging slot, no read op (see the note).
        self.direct = reads_direct(plan)

    def needed(self, unit: str) -> bool:
        """Whether ``unit`` has packs in the file tier (so its loads and stages copy from staging)."""
        return bool(file_packs(self.plan, self.file, unit))

    def _read(self, when: When, anchor: str, unit: str) -> None:
        slot = self.free.pop(0)
        kind: OpKind = "read"
        src = "shard" if unit in self.sharded else None
        nbytes = read_nbytes(self.plan, self.file, unit)
        self.emit(when, anchor, kind, unit, slot=slot, src=src, nbytes=nbytes)
        self.holding[unit] = slot

    def take(self, when: When, anchor: str, unit: str) -> str | None:
        """The staging slot a load or stage of ``unit`` at this anchor copies from (read now unless
        it was read ahead), free for the next read from here on; `FILE` when the reader fills the
        device slot itself; ``None`` when ``unit`` is wholly in host memory."""
        if not self.needed(unit):
            return None
        if self.direct:
            return FILE
        if unit not in self.holding:
            self._read(when, anchor, unit)
        slot = self.holding.pop(unit)
        self.free.append(slot)
        return slot

    def ahead(self, when: When, anchor: str, queue: Iterable[str], resident: Container[str]) -> None:
        """Read the next file-tier units of ``queue`` (what the ring loads after its window, in
        order) that are not ``resident`` nor read yet, while fewer than `READ_AHEAD` wait (none
        without staging slots: each is read as it is loaded)."""
        if self.direct:
            return
        for unit in dict.fromkeys(queue):
            if len(self.holding) >= READ_AHEAD or not self.free:
                return
            if unit in self.holding or unit in resident or not self.needed(unit):
                continue
            self._read(when, anchor, unit)
