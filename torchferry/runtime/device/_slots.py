"""Device memory the runtime holds: the schedule's fixed slots, and a ledger of every byte."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import attrs

from torchferry._errors import ExecutionError
from torchferry.policies import Slot
from torchferry.runtime.device._streams import DeviceBuffer, StreamContext, regrow

__all__ = ["Ledger", "SlotPool"]


@attrs.define(slots=True)
class Ledger:
    """Device bytes the runtime holds now, the most it held, and how many allocations it made.

    ``peak`` covers the ledger's whole life; ``step_peak`` restarts at every `mark` (each step).
    """

    held: int = 0
    peak: int = 0
    step_peak: int = 0
    allocations: int = 0

    def add(self, nbytes: int) -> None:
        self.held += nbytes
        self.allocations += 1
        if self.held > self.step_peak:
            self.step_peak = self.held
            self.peak = max(self.peak, self.held)

    def mark(self) -> None:
        """Start measuring a step's peak from what is held now."""
        self.step_peak = self.held

    def sub(self, nbytes: int) -> None:
        self.held -= nbytes


class SlotPool:
    """Slots by name, each allocated at its first use and kept while later steps use it unchanged.

    A slot a step does not use is freed by shrinking its storage to nothing (FSDP2's trick), so its
    tensor object, and every view into it that loads cached, stays valid: when a later step uses the
    slot again its storage grows back and no view is rebuilt. Steady-state steps allocate nothing.
    """

    def __init__(self, streams: StreamContext, ledger: Ledger) -> None:
        self.streams = streams
        self.ledger = ledger
        self.slots: dict[str, tuple[Slot, DeviceBuffer]] = {}
        # Why: freed slots keep their (empty) tensor, so views cached into it survive a re-allocation.
        self.parked: dict[str, tuple[Slot, DeviceBuffer]] = {}
        self.table: dict[str, Slot] = {}

    def prepare(self, table: Iterable[Slot], occupied: Collection[str], used: Collection[str]) -> None:
        """Adopt a schedule's slot table: keep slots its ops use (and occupied ones), free the rest.

        Freeing what a step does not use makes the bytes held exactly those `policies.simulate` counts:
        a slot from its first use, or from the start when the entry names it.
        """
        self.table = {s.name: s for s in table}
        for name, (slot, _) in list(self.slots.items()):
            wanted = self.table.get(name) if name in used else None
            if wanted is not None and wanted.nbytes == slot.nbytes and wanted.kind == slot.kind:
                continue
            if name in occupied:
                if wanted is None:
                    continue
                raise ExecutionError(
                    f"slot {name} is resized from {slot.nbytes} to {wanted.nbytes} bytes while a unit "
                    "still occupies it; the schedule's entry residency and slot table disagree"
                )
            self._free(name)

    def get(self, name: str) -> DeviceBuffer:
        """The slot's memory, allocated now if this is its first use."""
        held = self.slots.get(name)
        if held is not None:
            return held[1]
        slot = self.table[name]
        parked = self.parked.get(name)
        if parked is not None and parked[0].nbytes == slot.nbytes:
            transfer = parked[1]
            regrow(transfer, slot.nbytes)
            transfer.free = None  # fresh memory: the next copy orders itself after compute instead
        else:
            transfer = self.streams.transfer(slot.nbytes)
        # Counted once the memory exists: an allocation that fails (out of memory) holds nothing.
        self.parked.pop(name, None)
        self.ledger.add(slot.nbytes)
        self.slots[name] = (slot, transfer)
        return transfer

    def _free(self, name: str) -> None:
        slot, transfer = self.slots.pop(name)
        self.streams.settle()
        transfer.data.untyped_storage().resize_(0)
        self.parked[name] = (slot, transfer)
        self.ledger.sub(slot.nbytes)

    def clear(self) -> None:
        for name in list(self.slots):
            self._free(name)
        self.parked.clear()
