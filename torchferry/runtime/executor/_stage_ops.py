"""The handlers of a staged unit (one the device keeps for the step: the none and model_level
strategies, a policy's resident set): ``stage`` gives it device memory of its own and copies or
reads it there, ``unstage`` lets it go."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchferry._errors import ExecutionError
from torchferry.policies import DEVICE, FILE, Op
from torchferry.runtime.device import DeviceBuffer, Ledger, StreamContext
from torchferry.runtime.memory import Pack, PackState, Unit, views_into
from torchferry.runtime.store import HostStore

__all__ = ["Staging"]


class Staging:
    """The stage and unstage handlers of `Mover` (which sets every attribute declared here)."""

    store: HostStore
    streams: StreamContext
    ledger: Ledger
    placed: dict[str, str]
    #: Staged units own device memory until unstaged (each copy with its bytes on the ledger).
    staged: dict[str, tuple[tuple[DeviceBuffer, int], ...]]

    if TYPE_CHECKING:  # `Mover`'s

        def _missed(self, what: str, invariant: int) -> ExecutionError: ...

        def _read_into(self, unit: Unit, pack: Pack, buffer: DeviceBuffer, dst: torch.Tensor) -> None: ...

        def _leaving(self, unit: Unit) -> None: ...

    def _stage(self, unit: Unit, op: Op) -> None:
        sharded = [g.name for g in unit.packs if g.shard is not None]
        if sharded:
            raise self._missed(
                f"stage of {unit.name}: this rank holds only shards of {', '.join(sharded)}, which are "
                "all-gathered into ring slots, never staged; keep all-gathered blocks out of a policy's "
                "resident set",
                6,
            )
        if unit.name in self.staged:
            for pack in unit.packs:
                pack.to_host()  # undocked before its staged copy goes
            self._drop_staged(unit.name)
        tier = self.store.tier
        held: list[tuple[DeviceBuffer, int]] = []
        first = True
        try:
            for pack in unit.packs:
                read = None
                if pack.in_file:
                    if tier is None or op.src is None:
                        raise self._missed(
                            f"stage of {unit.name}: {pack.name} is in the file tier (no host copy), so it is "
                            "staged from the staging slot its read fills (stage ... from tK)",
                            9,
                        )
                    # A unit of several packs goes through its staging slot one pack at a time: the read
                    # op brought the first, each later one is read once the copy before it drained.
                    if op.src != FILE and not first:
                        tier.issue(pack, op.src, self.streams.before_read(tier.slot(op.src).buffer))
                    first = False
                    if op.src != FILE:
                        read = tier.take(pack, op.src)  # before any device memory is counted: it may fail
                transfer = self.streams.transfer(pack.nbytes)
                self.ledger.add(pack.nbytes)
                held.append((transfer, pack.nbytes))
                if pack.in_file and op.src == FILE:
                    self._read_into(unit, pack, transfer, transfer.data.narrow(0, 0, pack.nbytes))
                elif read is not None:
                    self.streams.copy_staged(transfer, transfer.data, *read)
                else:
                    self.streams.copy_in(transfer, transfer.data, pack.host)
                self.streams.wait(transfer)
                if pack.bound is not None:
                    pack.dock(transfer.data)  # see [Note: docking] in `_pack`
                else:
                    pack.point(views_into(pack.pieces, transfer.data))
                if pack.buffers:
                    pack.arrived()
                pack.where = PackState.READY
        except BaseException:
            # Nothing of the unit is staged: the copies made so far go, and so do their bytes on the
            # ledger; its packs point at the host first (the abort that follows does it again), so
            # none stays docked at a copy about to be freed.
            for pack in unit.packs:
                pack.to_host()
            for _, nbytes in held:
                self.ledger.sub(nbytes)
            raise
        self.staged[unit.name] = tuple(held)
        self.placed[unit.name] = DEVICE

    def _unstage(self, unit: Unit, op: Op) -> None:
        self._leaving(unit)
        for pack in unit.packs:
            pack.to_host()
        self._drop_staged(unit.name)
        self.placed.pop(unit.name, None)

    def _drop_staged(self, name: str) -> None:
        for _, nbytes in self.staged.pop(name, ()):
            self.ledger.sub(nbytes)
