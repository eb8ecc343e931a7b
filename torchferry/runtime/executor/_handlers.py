"""The op handlers: what each kind of op does to the device, and the tables of what is where.

`Mover` is the engine's device side. It owns the slot pool (the schedule's slots, the gather slot of
chunked all-gathers among them), the tables that say where each unit is (``placed``), which transfer
is bringing or brought it (``transfers``), which unit each slot holds (``occupants``) and what is
staged, acquired or held as a shard, and the grad guard. One short handler per op kind
(`_HANDLERS`) changes them; a program binds each of its ops to this mover's handler when it is
compiled, and `Mover.run` carries the ops out in order. `Engine`, built on it, adds the lifecycle:
opening, steps begun and finished, abort and close ([Note: the multi-rank engine] in `_engine` says
how loads of shards and gathers meet).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from types import MethodType

import torch

from torchferry._errors import ExecutionError, OffloadWarning
from torchferry.policies import FILE, OP_KINDS, Op
from torchferry.runtime.device import Comm, CpuStreams, DeviceBuffer, Ledger, SlotPool, StreamContext
from torchferry.runtime.executor._hooks import GradGuard
from torchferry.runtime.executor._on_demand import OnDemand
from torchferry.runtime.executor._program import Handler, Program, missed
from torchferry.runtime.executor._replay import (
    GRAD_OFF,
    INFERENCE_OFF,
    Replay,
    Segment,
    Tables,
    call,
    consume,
    restore,
)
from torchferry.runtime.executor._stage_ops import Staging
from torchferry.runtime.executor._trace import Tracer
from torchferry.runtime.memory import Arriving, Pack, PackState, Unit
from torchferry.runtime.store import HostStore
from torchferry.topology import Plan

__all__ = ["RANGES", "Mover", "profiling"]

#: The `torch.profiler` range each op runs in, by kind (``torchferry::load``, ``torchferry::gather``...),
#: so a user's profiler trace shows torchferry's loads, gathers, waits and evicts by name. Opened only
#: while a profiler is recording: one cheap check per `Mover.run` otherwise.
RANGES: dict[str, str] = {kind: f"torchferry::{kind}" for kind in OP_KINDS}

#: Whether a profiler is recording (ops then run inside their ranges, and no step is replayed).
profiling: Callable[[], bool] = torch.autograd._profiler_enabled  # type: ignore[attr-defined]
_inference = torch.is_inference_mode_enabled
_READY, _IN_FLIGHT = PackState.READY, PackState.IN_FLIGHT


class Mover(Staging, OnDemand):
    """Moves units between the host store and the device, one handler per op kind, and keeps the tables.

    `Engine` is the one kind of mover: it sets the attributes declared here (what the handlers read
    but do not own) when it opens, then `Mover.__init__` makes the tables, empty.
    """

    #: Given by the engine before `Mover.__init__` runs.
    plan: Plan
    device: torch.device
    streams: StreamContext
    ledger: Ledger
    comm: Comm | None
    store: HostStore
    #: The program of the step running now (``None`` between steps); its ``pc`` is the op running.
    program: Program | None

    def __init__(self) -> None:
        self.slots = SlotPool(self.streams, self.ledger)
        # Why: unit -> where it is on the device (slot name or DEVICE); checked against entry and exit.
        self.placed: dict[str, str] = {}
        # Why: a unit's latest transfer into device memory, which a wait or evict refers to.
        self.transfers: dict[str, DeviceBuffer] = {}
        # Why: slot name -> the unit whose bytes it holds, so a load never overwrites a live unit.
        self.occupants: dict[str, Unit] = {}
        # Why: staged units own device memory until unstaged; slots are shared and owned by the pool.
        self.staged: dict[str, tuple[tuple[DeviceBuffer, int], ...]] = {}
        self.acquired: dict[str, int] = {}
        self._load_takes_device: dict[str, bool] = {}
        # Why: shard slot -> the unit whose shard it holds, so a gather reads the shard it names.
        self.shards: dict[str, Unit] = {}
        #: The running program's gather slot (`Program.gather`), which its chunked gathers land in.
        self.gather_slot: str | None = None
        # Why: the tracer of the step running now; checked once per op and per block hook.
        self.tracer: Tracer | None = None
        self.guard = GradGuard(self.placed, self.store.units)
        # Why: on `CpuStreams` a copy has completed when it returns: a wait or release orders nothing unless
        # a file-tier read fills the buffer (``filling``), else the hot path skips it (not on test streams).
        self._synchronous = type(self.streams) is CpuStreams
        # Why: the replay the running step follows, or the tables its first run records at each stop for
        # one ([Note: replay] in `_replay`); at most one of them, ``None`` both between steps.
        self._replay: Replay | None = None
        self.replaying: dict[int, Segment] | None = None  # its segments, which the block hooks run
        self._recording: dict[int, Tables] | None = None
        #: Units a replayed step loaded for a later one, their copy left to their wait (`Replay.later`).
        self.deferred: frozenset[str] = frozenset()

    def _missed(self, what: str, invariant: int) -> ExecutionError:
        """`missed` at the op running now, with the step's listing marked there."""
        program = self.program
        if program is None:
            return missed(what, invariant)
        return missed(what, invariant, program.schedule, program.pc)

    def handlers(self) -> dict[str, Handler]:
        """Each op kind's handler bound to this mover, as a compiled program calls it (read now)."""
        return {kind: MethodType(handler, self) for kind, handler in _HANDLERS.items()}

    # ---------------------------------------------------------------------------------- running
    def advance(self, program: Program, stop: int) -> bool:
        """Run ``program``'s ops up to op ``stop``, as ordinary tensors whatever the caller's mode;
        whether a replay ran them ([Note: replay] in `_replay`)."""
        replay = self._replay
        if replay is not None:
            segment = replay.segments.get(program.pc)
            if segment is not None and segment[0] == stop:  # the hot path of a steady step
                try:
                    if segment[5] or not _inference():  # (moves of memory alone: in any mode)
                        consume(map(call, segment[1], segment[2], segment[3]))  # ``fn(a, b)`` each, in C
                    else:
                        with INFERENCE_OFF(False):
                            GRAD_OFF()
                            consume(map(call, segment[1], segment[2], segment[3]))
                    program.pc = stop
                except BaseException:
                    # Some of the segment's moves ran: the abort reads where the packs are from their
                    # memory (`Replay.recover`), and nothing of the step may run on (a caller that
                    # catches this and calls the block again gets a clear error, not another block's).
                    self.abort()
                    raise
                return True
            self.unreplay()  # stopped elsewhere than its first run did: the handlers take over
        if _inference():
            with INFERENCE_OFF(False):
                GRAD_OFF()
                self.run(program, stop)
        elif self.tracer is not None or profiling():
            self._run_observed(program, stop)
        else:
            # `run`'s loop, inline. An op that raises leaves ``pc`` at itself, as `run` does.
            calls = program.calls
            for i in range(program.pc, stop):
                program.pc = i
                handler, unit, op = calls[i]
                handler(unit, op)
            program.pc = stop
        if self._recording is not None:
            self._recording[stop] = self.tables()
        return False

    def abort(self) -> None:
        """Drop every device copy and point all weights at host memory (`Engine.abort`)."""
        raise NotImplementedError

    def tables(self) -> Tables:
        """Copies of the tables of what is where (``placed``, ``transfers``, ``occupants``)."""
        return dict(self.placed), dict(self.transfers), dict(self.occupants)

    def unreplay(self) -> None:
        """Hand a replayed step over to the handlers here: its record and tables as at this stop."""
        replay, program = self._replay, self.program
        if replay is None or program is None:
            self._replay = self.replaying = None
            return
        replay.settle(program.pc)  # the packs' record; a signal in it leaves the replay to settle again
        found = replay.tables.get(program.pc)
        if found is None:
            raise self._missed(f"a replayed step stopped at op {program.pc}, where its first run did not", 2)
        restore(found, self.placed, self.transfers, self.occupants)
        self._replay = self.replaying = None

    def run(self, program: Program, stop: int) -> None:
        """Run ``program``'s ops up to (not including) op ``stop``."""
        calls = program.calls
        i = program.pc
        if self.tracer is not None or profiling():
            self._run_observed(program, stop)
            return
        try:
            while i < stop:
                handler, unit, op = calls[i]
                program.pc = i  # the op running now, as listings and the stream sanitizer name it
                handler(unit, op)
                i += 1
        finally:
            program.pc = i

    def _run_observed(self, program: Program, stop: int) -> None:
        """`run` with each op told to the tracer and inside its profiler range."""
        calls = program.calls
        i = program.pc
        tracer = self.tracer
        recorded = profiling()
        while i < stop:
            handler, unit, op = calls[i]
            if tracer is not None:
                tracer.at(i, op)
            if recorded:
                with torch.profiler.record_function(RANGES[op.kind]):
                    handler(unit, op)
            else:
                handler(unit, op)
            i += 1
            program.pc = i

    def _drop_all(self, *, wait: bool = True) -> None:
        """Release every acquired module, drop every staged copy and point every weight at host memory.

        Reads in flight finish first, into staging slots or straight into device slots (those slots
        are free again; ``wait=False``, after a failed collective, they are given up instead: see
        `FileTier.settle`), and no device buffer is left waiting for one. Recovery cannot stop
        half-way: a component's own ``offload_to_cpu`` that raises here (while a failed step is
        abandoned, or the session closes) is an `OffloadWarning`, and everything else is dropped all
        the same, so the next step starts from an empty device; whatever else raises, host memory is
        where every weight can always go back to.
        """
        if self.store.tier is not None:
            self.store.tier.settle(wait=wait)
        for buffer in self.buffers():
            buffer.filling = None  # settled above: a later wait on the buffer has nothing to take
        try:
            self.guard.leaving_all()
            for path in list(self.acquired):
                try:
                    self._release_module(path)
                except Exception as exc:
                    warnings.warn(
                        f"torchferry: offload_to_cpu() of {path!r} raised {type(exc).__name__}: {exc} "
                        "while the session dropped its device copies; everything else was dropped and the "
                        f"session is usable, but {path!r} may still hold the device memory its lifecycle "
                        "did not free",
                        OffloadWarning,
                        stacklevel=2,
                    )
        finally:
            self.store.reset()  # before the staged copies go: no pack stays docked at freed memory
            for name in list(self.staged):
                self._drop_staged(name)
            self.shards.clear()
            self.transfers.clear()
            self.occupants.clear()
            self.placed.clear()

    def buffers(self) -> Iterator[DeviceBuffer]:
        """Every device buffer this mover holds: slots (parked ones too) and staged copies."""
        for _, buffer in (*self.slots.slots.values(), *self.slots.parked.values()):
            yield buffer
        for held in self.staged.values():
            for buffer, _ in held:
                yield buffer

    def _free(self) -> None:
        """Give the slots' device memory back (nothing may still write them)."""
        self.slots.clear()

    # ------------------------------------------------------------------------------ handlers
    def _read(self, unit: Unit, op: Op) -> None:
        """Start reading ``unit``'s (first file-tier) pack into staging slot ``op.slot`` (the io stream)."""
        tier = self.store.tier
        pack = next((g for g in unit.packs if g.in_file), None)
        if tier is None or pack is None:
            raise self._missed(
                f"read of {unit.name}: it is not in this session's file tier (its bytes are in host "
                "memory); the schedule's file set must be the one the session's store was laid out from",
                9,
            )
        assert op.slot is not None
        tier.issue(pack, op.slot, self.streams.before_read(tier.slot(op.slot).buffer))

    def _load(self, unit: Unit, op: Op) -> None:
        if op.src == "shard":
            self._load_shard(unit, op)
            return
        if op.src is not None:
            self._load_staged(unit, op)
            return
        name = op.slot
        assert name is not None
        allocated = self.slots.slots.get(name)  # `SlotPool.get`, inline for a slot in use
        slot = self.slots.get(name) if allocated is None else allocated[1]
        held = self.occupants.get(name)
        if held is not None and held is not unit:
            self._claim(unit, op)  # raises
        pack = unit.packs[0]
        if pack.in_file or pack.shard is not None:
            raise self._unloadable(unit)
        transfers = self.transfers
        if unit.name in transfers:
            self._leave_first(unit, op)
        # The views into this slot are cached per slot (`Pack.views`, `Pack.dock_at` for a pack that
        # docks): a steady load builds nothing.
        arriving: Arriving
        if pack.bound is not None:
            docked = pack.docks.get(name)  # `Pack.dock_at`, inline for a slot whose memory stayed
            if docked is not None and docked[0] is slot.data and docked[1] == slot.grown:
                _, _, dst, arriving = docked
            else:
                dst, arriving = pack.dock_at(name, slot)
        else:
            cached = pack.device_views.get(name)
            if cached is not None and cached[0] is slot.data:
                _, dst, arriving = cached
            else:
                dst, arriving = pack.views(name, slot.data)
        self.streams.copy_in(slot, dst, pack.host)
        # `_placed_in`, inline (see there)
        pack.arriving = arriving
        if pack.rewatch:
            pack.rewatch = False
            pack.carry(range(len(pack.tensors)))
        elif pack.buffers:
            pack.carry(pack.buffers)
        pack.where = _IN_FLIGHT
        transfers[unit.name] = slot
        self.occupants[name] = unit
        self.placed[unit.name] = name

    def _unloadable(self, unit: Unit) -> ExecutionError:
        """Why ``unit`` cannot be loaded from host memory (it is in the file tier, or a shard)."""
        if unit.packs[0].in_file:
            return self._missed(
                f"load of {unit.name}: it is in the file tier (no host copy), so it is loaded from the "
                "staging slot its read fills (load ... from tK)",
                9,
            )
        return self._missed(
            f"load of {unit.name}: this rank holds only its shard of the block; the schedule must "
            "load the shard and all-gather it (the distributed_layerwise policy does)",
            6,
        )

    def _claim(self, unit: Unit, op: Op) -> None:
        assert op.slot is not None
        held = self.occupants.get(op.slot)
        if held is not None and held is not unit:
            raise self._missed(
                f"{op.kind} of {unit.name} into slot {op.slot} while {held.name} still occupies it", 2
            )

    def _leave_first(self, unit: Unit, op: Op) -> None:
        """``unit`` is loaded or gathered again while a slot holds it (`check` allows it): it leaves
        that slot first, as at an evict, so the new copy is ordered after this unit's own reads (the
        slot's ``free`` is recorded after them), what a forward wrote to its buffers there is kept,
        its tensors point at the host copy until the next wait, and the slot it leaves, when another,
        is free for its next occupant."""
        if unit.name in self.transfers:
            self._evict(unit, op)

    def _placed_in(self, unit: Unit, name: str, slot: DeviceBuffer, views: Arriving) -> None:
        # The tensors move to ``views`` at the wait, once compute is ordered after the copy: until
        # then anything that reads them (a hook, a tied weight, the caller between steps) reads the
        # host copy, not bytes still being written on another stream. What is written in place
        # meanwhile is found at the wait, which copies again: the buffers (a hook of the block before
        # may write one), or every tensor when the engine bumped the pack's versions since its last
        # load (`Pack.rewatch`: the session guard then cannot tell an edit from that bump).
        pack = unit.packs[0]
        pack.arriving = views
        if pack.rewatch:
            pack.rewatch = False
            pack.carry(range(len(pack.tensors)))
        elif pack.buffers:
            pack.carry(pack.buffers)
        pack.where = _IN_FLIGHT
        self.transfers[unit.name] = slot
        self.occupants[name] = unit
        self.placed[unit.name] = name

    def _load_staged(self, unit: Unit, op: Op) -> None:
        """Copy ``unit``'s bytes from staging slot ``op.src`` (once its read is in) into ``op.slot``: a
        block slot, or a shard slot for this rank's shard of an all-gathered block; from `FILE`, the
        reader fills the block slot itself (the device's memory is host memory)."""
        assert op.slot is not None and op.src is not None and self.store.tier is not None
        pack = unit.packs[0]
        slot = self.slots.get(op.slot)
        if op.src == FILE:
            self._claim(unit, op)
            self._leave_first(unit, op)
            dst, views = pack.views(op.slot, slot.data)
            self._read_into(unit, pack, slot, dst)
            self._placed_in(unit, op.slot, slot, views)
            return
        if pack.shard is not None:
            staging, data = self.store.tier.take(pack, op.src)
            self.streams.copy_staged(slot, pack.shard_bytes(op.slot, slot.data), staging, data)
            self.shards[op.slot] = unit
            return
        self._claim(unit, op)
        staging, data = self.store.tier.take(pack, op.src)
        self._leave_first(unit, op)  # loaded again while a slot holds it: as `_load` does
        dst, views = pack.views(op.slot, slot.data)
        self.streams.copy_staged(slot, dst, staging, data)
        self._placed_in(unit, op.slot, slot, views)

    def _read_into(self, unit: Unit, pack: Pack, buffer: DeviceBuffer, dst: torch.Tensor) -> None:
        """Start reading file-tier ``pack`` of ``unit`` straight into ``dst``, its place in device
        ``buffer`` whose memory is host memory (a load or stage ``from file``); the wait on ``buffer``
        waits for it (`StreamContext.fill`), so it runs while the blocks before compute. Device memory
        no reader can write is refused, not written."""
        tier = self.store.tier
        assert tier is not None
        if dst.device.type != "cpu":
            raise ExecutionError(
                f"{unit.name} is read from the file straight into device memory, and the device is "
                f"{dst.device}, whose memory no reader thread can write; such a schedule is for a CPU "
                "device only; elsewhere file-tier units are read into staging slots and loaded from there"
            )
        self.streams.fill(buffer, lambda: tier.read_into(pack, dst))

    def _load_shard(self, unit: Unit, op: Op) -> None:
        """Copy this rank's shard of the block into a shard slot (compile checked it is sharded)."""
        assert op.slot is not None
        pack = unit.packs[0]
        slot = self.slots.get(op.slot)
        self.streams.copy_in(slot, pack.shard_bytes(op.slot, slot.data), pack.host)
        self.shards[op.slot] = unit

    def _gather(self, unit: Unit, op: Op) -> None:
        """All-gather the ranks' shards held in slot ``op.src`` into the block's slot ``op.slot``."""
        assert op.slot is not None and op.src is not None and self.comm is not None
        if self.shards.get(op.src) is not unit:
            held = self.shards.get(op.src)
            raise self._missed(
                f"gather of {unit.name} from slot {op.src}, which holds "
                f"{'no shard' if held is None else 'the shard of ' + held.name}; load its shard first",
                6,
            )
        self._claim(unit, op)
        self._leave_first(unit, op)
        pack = unit.packs[0]
        src = self.slots.get(op.src)
        slot = self.slots.get(op.slot)
        shard = pack.shard_bytes(op.src, src.data)
        # A gather in chunks lands each in the schedule's gather slot (compiling checked it has one).
        staging = self.slots.get(self.gather_slot).data if op.chunks > 1 and self.gather_slot else None
        comm = self.comm

        def run() -> None:
            comm.all_gather(slot.data, shard, op.chunks, unit.name, staging)

        self.streams.collective(slot, src, run)
        del self.shards[op.src]
        _, views = pack.views(op.slot, slot.data)
        self._placed_in(unit, op.slot, slot, views)

    def _wait(self, unit: Unit, op: Op) -> None:
        transfer = self.transfers.get(unit.name)
        if transfer is None:
            if unit.name in self.staged:
                return
            raise self._missed(f"wait for {unit.name}, which no load brought to the device", 1)
        pack = unit.packs[0]  # a unit with a transfer streams through a slot: one pack
        if pack.watched and pack.stale():
            self._reload(unit, transfer)
        if not self._synchronous or transfer.filling is not None:
            self.streams.wait(transfer)
        if pack.arriving is not None:
            pack.arrive()  # re-pointed, or docked (see [Note: docking] in `_pack`)
            if pack.buffers:
                pack.arrived()
        pack.where = _READY

    def _reload(self, unit: Unit, slot: DeviceBuffer) -> None:
        """Copy ``unit``'s host bytes into its slot (again: see `Pack.carry`); all-gathered: raise."""
        pack = unit.packs[0]
        if pack.in_file:
            raise ExecutionError(
                f"{unit.name} was written in place while its load was in flight (by a hook, or a forward of "
                "the blocks before), and it is in the file tier: the write cannot be kept (its bytes are "
                "read from the checkpoint); raise host_memory= so it stays in host memory, or edit the "
                "weights before opening the session"
            )
        if pack.shard is not None:
            # Its tensors point at empty placeholders until the wait: the write reached no copy of it.
            raise ExecutionError(
                f"{unit.name} was written in place while its all-gather was in flight (by a hook, or a "
                "forward of the blocks before): this rank holds only its shard of the block, so the write "
                "cannot reach the gathered copy; edit an all-gathered block's weights only between "
                "sessions (close(gather=True), edit, open again)"
            )
        key = self.placed[unit.name]  # a pack that docks: its bytes of the slot, cached (`dock_at`)
        dst = pack.views(key, slot.data)[0] if pack.bound is None else pack.dock_at(key, slot)[0]
        self.streams.copy_in(slot, dst, pack.host)

    def _evict(self, unit: Unit, op: Op) -> None:
        packs = unit.packs
        single = packs[0] if len(packs) == 1 else None
        if single is not None:  # a block or a remainder in its slot: `_leaving`, inline
            if single.buffers and single.where is _READY:
                single.keep_written()
            if self.guard.graded:
                self.guard.leaving(unit)
        else:
            self._leaving(unit)
        name = unit.name
        transfer = self.transfers.pop(name, None)
        if transfer is not None and (not self._synchronous or transfer.filling is not None):
            if packs[0].where is _IN_FLIGHT:
                # A prefetch compute never waited for (a stale one, which `check` allows): the slot's
                # next writer waits only on ``free``, so compute must first be ordered after this
                # unit's load or gather, which may still be writing the slot on another stream.
                self.streams.wait(transfer)
            self.streams.release(transfer)
        where = self.placed.pop(name, None)
        if where is not None and self.occupants.get(where) is unit:
            del self.occupants[where]
        if single is not None:
            single.to_host()
            return
        for pack in packs:
            pack.to_host()

    def _leaving(self, unit: Unit) -> None:
        """``unit`` leaves the device: what was written to its buffers there is kept, then the grad
        guard spoils what autograd saved of it (see [Note: gradients] in `_hooks`)."""
        for pack in unit.packs:
            if pack.buffers and pack.where is _READY:
                pack.keep_written()  # before the grad guard bumps versions of its own
        if self.guard.graded:
            self.guard.leaving(unit)


#: One short handler per op kind; a program binds each op to its handler once, when compiled.
_HANDLERS: dict[str, Callable[[Mover, Unit, Op], None]] = {
    "read": Mover._read,
    "load": Mover._load,
    "gather": Mover._gather,
    "wait": Mover._wait,
    "evict": Mover._evict,
    "stage": Staging._stage,
    "unstage": Staging._unstage,
    "acquire": OnDemand._acquire,
    "release": OnDemand._release,
}
