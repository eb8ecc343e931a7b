"""The engine that carries out schedules on a live pipeline, and `execute`, its one-schedule form.

An `Engine` binds one plan to one pipeline: it owns the host store, the device slots, the stream
context and the ledger, and installs forward hooks (`Hooks`) at the blocks and components schedules
anchor to. A schedule is compiled once into a `Program`: its ops as prebound ``(handler, unit, op)``
triples and, for every anchor, the index one past that anchor's last op. Reaching an anchor runs
every pending op up to there, so ops keyed to a block the model skipped still run, in order, before
anything later.

[Note: the multi-rank engine]
With a `Comm` (the distributed strategy, all-gathered blocks, more than one rank) every rank holds
only its shard of each all-gathered block (see `HostStore`). A ``load ... from shard`` copies that
shard into a shard slot on the copy stream; the ``gather`` that follows all-gathers the ranks' shards
into the block's slot on the comm stream, in the schedule's chunks, and the block's tensors point
into the slot from its wait on, as after any load. Collectives could hang if ranks disagreed, so
the ranks agree first: when the engine opens, on the plan (then on whether every rank could open: a
rank whose checkpoint is bad fails alone, the others fail with it, and nothing is changed
anywhere), and before every step that issues collectives, on its schedule's text. A disagreement
raises `ExecutionError` on every rank at once. Teardown needs no collective: `close` leaves sharded
tensors as placeholders unless asked to gather them (`close(gather=True)`, a collective).

[Note: inference mode]
The engine's own tensors (host buffers, device slots, staged copies, the views parameters point at,
and the tensors `close` gives back) are ordinary tensors whatever mode the caller runs in. Tensors
made under ``torch.inference_mode()`` can never again be written outside it nor take part in
autograd: a slot first allocated during an inference-mode call could not be loaded by the next plain
call, and a pipeline opened or closed inside one would come back with inference-tensor weights. So
every entry point that makes or re-points tensors (opening, the hooks, `abort`, `close`,
`gather_host`) turns inference mode off for its own work (`_ordinary`); the model's forward itself
still runs in the caller's mode. (Turning inference mode off turns grad mode on, so the hooks also
turn grad mode off for their work: a forward under inference mode never counts as one with grad.)

The hooks, with the grad guard ([Note: gradients]), are in `_hooks`; compiling in `_program`; step
naming and the schedule cache in `_steps`.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from torchferry._errors import ExecutionError, OffloadWarning, PlanError
from torchferry.policies import DEVICE, OP_KINDS, Op, Placement, Schedule, layout
from torchferry.runtime._checkpoint import CheckpointReader
from torchferry.runtime._comm import Comm
from torchferry.runtime._device import Ledger, SlotPool
from torchferry.runtime._hooks import Driver, GradGuard, Hooks
from torchferry.runtime._host import HostStore
from torchferry.runtime._pack import Pack, PackState, Sharding, Unit
from torchferry.runtime._pinning import warn_pageable
from torchferry.runtime._program import (
    MAX_PROGRAMS,
    Handler,
    Program,
    compile_program,
    listing,
    schedule_text,
)
from torchferry.runtime._progress import Progress
from torchferry.runtime._steps import step_name
from torchferry.runtime._streams import DeviceBuffer, StreamContext, stream_context
from torchferry.runtime._trace import Tracer
from torchferry.topology import Plan, order_mismatch

__all__ = ["RANGES", "Engine", "execute"]

#: The `torch.profiler` range each op runs in, by kind (``torchferry::load``, ``torchferry::gather``...),
#: so a user's profiler trace shows torchferry's loads, gathers, waits and evicts by name. Opened only
#: while a profiler is recording: one cheap check per `Engine.run` otherwise.
RANGES: dict[str, str] = {kind: f"torchferry::{kind}" for kind in OP_KINDS}

_profiling: Callable[[], bool] = torch.autograd._profiler_enabled  # type: ignore[attr-defined]
_READY, _IN_FLIGHT = PackState.READY, PackState.IN_FLIGHT

#: Builds each new engine's stream context when set (see `stream_factory`); ``None``: `stream_context`.
StreamFactory = Callable[["Engine"], StreamContext]
STREAMS: StreamFactory | None = None


def stream_factory(factory: StreamFactory | None) -> StreamFactory | None:
    """Make every engine built from now on take its stream context from ``factory``; returns the last one.

    The seam `torchferry.testing.sanitize` uses to run engines on the test-only stream sanitizer.
    """
    global STREAMS
    before, STREAMS = STREAMS, factory
    return before


def _ordinary() -> contextlib.AbstractContextManager[None]:
    """Inference mode off while the engine makes or re-points tensors (see [Note: inference mode])."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


class Engine:
    """Carries out schedules for one plan on one pipeline; the only object that moves weights.

    Built from a pipeline on the CPU: every tensor the plan manages moves into the host store (see
    `HostStore`), so building raises `PlanError` before mutating anything when the pipeline cannot
    be served. ``driver``, when given, is told when a top-level component's forward starts and ends
    (the session uses it to pick each step's schedule).
    """

    def __init__(
        self,
        pipeline: Any,
        plan: Plan,
        *,
        device: torch.device | str,
        pin_memory: bool = True,
        comm: Comm | None = None,
        prefix_map: Mapping[str, str] | None = None,
        driver: Driver | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.plan = plan
        self.device = torch.device(device)
        self.streams: StreamContext = stream_context(self.device) if STREAMS is None else STREAMS(self)
        self.ledger = Ledger()
        pin = pin_memory and self.device.type == "cuda" and torch.cuda.is_available()
        if not pin_memory and self.device.type == "cuda":
            warn_pageable(self.device)
        world = plan.config.dp_size
        if world > 1 and (comm is None or comm.world != world):
            have = "no process group" if comm is None else f"a process group of {comm.world} ranks"
            raise PlanError(
                f"the plan all-gathers weights across {world} ranks but the engine was given {have}; "
                f"pass the {world}-rank group (torchferry.offload(..., process_group=...)) or set the "
                "parallel layout to its size"
            )
        #: The weight-shard group's collectives, or ``None`` when nothing is all-gathered.
        self.comm = comm if world > 1 else None
        sharding = None
        if self.comm is not None:
            self.comm.agree("the plan", plan.digest)
            sharding = Sharding(rank=self.comm.rank, world=world, names=layout(plan).allgather)
        self.store = self._open(pipeline, plan, pin, sharding, prefix_map)
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
        self._residency: tuple[Placement, ...] = ()
        # Why: the schedule that finished last, for inspection (what did the last step do?).
        self.last: Schedule | None = None
        #: The program of the step running now (``None`` between steps).
        self.program: Program | None = None
        self._programs: dict[Schedule, Program] = {}
        self.hooks = Hooks(self, driver)
        self._load_takes_device: dict[str, bool] = {}
        # Why: shard slot -> the unit whose shard it holds, so a gather reads the shard it names.
        self.shards: dict[str, Unit] = {}
        # Why: chunked gathers on NCCL land in one staging buffer, sized at open (see `_size_staging`).
        self._staging: DeviceBuffer | None = None
        self._size_staging(self._plan_staging())
        # Why: a tracer waiting for the step it measures (see `Tracer`, `arm`); ``None``: nothing is traced.
        self._tracing: Tracer | None = None
        # Why: the tracer of the step running now; checked once per op and per block hook.
        self.tracer: Tracer | None = None
        self.guard = GradGuard(self.placed, self.store.units)
        # Why: the blocks the running step's forward reached, in order, to report a ring it does not follow.
        self.ran: list[str] = []

    def _open(
        self,
        pipeline: Any,
        plan: Plan,
        pin: bool,
        sharding: Sharding | None,
        prefix_map: Mapping[str, str] | None,
    ) -> HostStore:
        """Check, read and take over; with several ranks, only once every rank could do the first two."""
        with _ordinary():
            failure: BaseException | None = None
            prepared = None
            path = plan.config.checkpoint
            what = "copying weights to pinned host memory" if pin else "copying weights to host memory"
            progress = Progress(what if path is None else f"reading weights from {path}")
            try:
                source: contextlib.AbstractContextManager[CheckpointReader | None] = contextlib.nullcontext()
                if path is not None:
                    source = CheckpointReader(path, prefix_map=prefix_map)
                with source as reader:
                    prepared = HostStore.prepare(
                        pipeline, plan, pin=pin, reader=reader, sharding=sharding, progress=progress
                    )
            except Exception as exc:
                failure = exc
            try:
                if self.comm is not None:
                    try:
                        self.comm.agree("open the session", "ready", ok=failure is None)
                    except ExecutionError:
                        if prepared is not None:
                            prepared.discard()
                        if failure is not None:
                            raise failure from None
                        raise
                if failure is not None:
                    raise failure
                assert prepared is not None
                return prepared.commit()
            finally:
                progress.close()

    # ------------------------------------------------------------------------------- the seam
    @property
    def broken(self) -> bool:
        """Whether a collective of the weight-shard group failed (the device is then never waited on)."""
        return self.comm is not None and self.comm.broken

    @property
    def hook_count(self) -> int:
        """Forward hooks this engine has installed on the pipeline."""
        return self.hooks.count

    @property
    def running(self) -> bool:
        """Whether a step has begun and not yet finished or been aborted."""
        return self.program is not None

    @property
    def residency(self) -> tuple[Placement, ...]:
        """What the last finished step left on the device (``()`` after an abort)."""
        return self._residency

    @property
    def tracing(self) -> Tracer | None:
        """The armed tracer still waiting for its step, if any."""
        return self._tracing

    @property
    def traced(self) -> bool:
        """Whether a tracer is armed or measuring a step now."""
        return self._tracing is not None or self.tracer is not None

    def arm(self, tracer: Tracer) -> None:
        """Trace the first step ``tracer`` wants (see `Tracer`); one tracer at a time."""
        if self.traced:
            raise ExecutionError("engine.arm(): a trace is already running on this engine; end it first")
        self._tracing = tracer

    def disarm(self, tracer: Tracer) -> None:
        """Stop waiting for ``tracer``'s step, if it has not started yet."""
        if self._tracing is tracer:
            self._tracing = None

    def anchor(self, paths: Iterable[str]) -> None:
        """Install forward pre/post hooks at each block or component path (once per path)."""
        self.hooks.anchor(paths)

    def forward(self, path: str) -> contextlib.AbstractContextManager[None]:
        """Treat the body as a forward of the anchored module at ``path``: its hooks fire around it.

        For calls that bypass the module's own forward (``vae.decode()``): the pre hook runs first
        (a top-level component's step starts and its ``before`` ops run), the post hook after (its
        ``after`` ops run and the step finishes), or, if anything raises, the post hook sees the
        failure and the step is abandoned, as around a forward that raised.
        """
        return self.hooks.forward(path)

    def unhook(self) -> None:
        """Remove every hook from the pipeline."""
        self.hooks.remove()

    # ------------------------------------------------------------------------------ programs
    def compile(self, schedule: Schedule) -> Program:
        """The compiled form of ``schedule`` (cached); unknown units or slots raise `ExecutionError`."""
        program = self._programs.get(schedule)
        if program is not None:
            return program
        program = compile_program(schedule, self.store.units, _HANDLERS, self.comm)
        self._size_staging(max((self._staging_need(u, op) for _, u, op in program.calls), default=0))
        self.anchor(dict.fromkeys(op.anchor for op in schedule.ops))
        self.anchor(self._blocks_of(schedule.step.component))
        if len(self._programs) >= MAX_PROGRAMS:  # bounded: a policy that is not index-free makes many
            self._programs.pop(next(iter(self._programs)))
        self._programs[schedule] = program
        return program

    def _blocks_of(self, component: str) -> list[str]:
        """Block paths a forward of ``component`` runs, so each one's residency is checked."""
        try:
            top = self.plan.component(component)
        except KeyError:
            return []
        return [b.path for c in top.walk() for b in c.blocks]

    def begin(self, schedule: Schedule) -> Program:
        """Start ``schedule``: its entry residency must be what the device holds now."""
        if self.program is not None:
            raise ExecutionError(
                f"step {step_name(schedule.step)} cannot start while step "
                f"{step_name(self.program.schedule.step)} is still running"
            )
        program = self.compile(schedule)
        if program.entry != self.placed:
            have = ", ".join(f"{u}@{w}" for u, w in self.placed.items()) or "(nothing)"
            raise ExecutionError(
                f"step {step_name(schedule.step)} expects entry residency "
                f"{', '.join(map(str, schedule.entry)) or '(nothing)'} but the device holds {have}; "
                "run the step that leaves it there first, or build the schedule with this entry"
            )
        if program.collective and self.comm is not None:
            # Every run, not only the first: ranks out of step meet here ([Note: ranks out of step]).
            if program.agreed is None:
                program.agreed = schedule_text(schedule, self.plan)
            self.comm.agree(f"the schedule of step {step_name(schedule.step)}", program.agreed)
        self.streams.begin()
        self.slots.prepare(schedule.slots, occupied=self.placed.values(), used=program.slots)
        self.ledger.mark()
        program.pc = 0
        self.program = program
        self.ran = []
        if self._tracing is not None and self._tracing.wants(schedule.step):
            self.tracer = self.streams.tracer = self._tracing
            self.tracer.start(schedule, self.streams)
        return program

    def finish(self) -> None:
        """End the running step: every op must have run and the device must hold its exit residency."""
        program = self.program
        if program is None:
            return
        self.program = None
        schedule = program.schedule
        if program.pc < len(program.calls):
            self.abort()
            op = schedule.ops[program.pc]
            raise ExecutionError(
                f"step {step_name(schedule.step)} ended with {len(program.calls) - program.pc} of its "
                f"{len(program.calls)} ops never run: the forward never reached {op.when} {op.anchor!r} "
                "(is the schedule for this component?)\n" + listing(schedule, program.pc)
            )
        if program.exit != self.placed:
            have = ", ".join(f"{u}@{w}" for u, w in self.placed.items()) or "(nothing)"
            self.abort()
            raise ExecutionError(
                f"step {step_name(schedule.step)} left {have} on the device but its exit says "
                f"{', '.join(map(str, schedule.exit)) or '(nothing)'}\n"
                + listing(schedule, len(schedule.ops))
            )
        for name in self.transfers:
            for pack in self.store.units[name].packs:
                if pack.where is _IN_FLIGHT:
                    # Between steps any tensor may be edited (a session adopts such an edit at the
                    # next step start, but a hook there may edit after that check, and `execute`
                    # checks nothing): the wait copies again if one was.
                    pack.carry(range(len(pack.tensors)))
        self._residency = schedule.exit
        self.last = schedule
        tracer = self.tracer
        if tracer is not None:
            self._untrace()
            tracer.stop()

    def _untrace(self) -> None:
        """The traced step is over: nothing is timed from here on, and the tracer is disarmed."""
        self.tracer = self.streams.tracer = None
        self._tracing = None

    def abort(self) -> None:
        """Drop every device copy and point all weights at host memory: always safe, never loses one."""
        with _ordinary():
            self._abort()

    def _abort(self) -> None:
        self.program = None
        tracer = self.tracer
        if tracer is not None:
            self._untrace()
            tracer.fail()
        if not self.broken:
            self.streams.synchronize()
        self.guard.leaving_all()
        for path in list(self.acquired):
            self._release_module(path)
        for name in list(self.staged):
            self._drop_staged(name)
        self.store.reset()
        self.shards.clear()
        self.transfers.clear()
        self.occupants.clear()
        self.placed.clear()
        self._residency = ()

    def close(self, *, gather: bool = False) -> None:
        """Remove every hook, free device memory and give each tensor host storage of its own again.

        Tensors of blocks this rank holds only a shard of stay placeholders (shape ``(0,)``), and
        their host shards are kept, unless ``gather`` is true: then every rank of the weight-shard
        group must call it (a collective), and full host copies are re-assembled first. `gather_host`
        does the same later, after a plain close.
        """
        with _ordinary():
            self._close(gather)

    def _close(self, gather: bool) -> None:
        self.unhook()
        self.abort()
        self._programs.clear()
        # After a failed collective a gather still queued may write the slots and the staging buffer
        # one day, so their memory is kept, and no collective is tried (see [Note: failures] in `_comm`).
        if not self.broken:
            self.slots.clear()
            if self._staging is not None:
                self.ledger.sub(self._staging.data.numel())
                self._staging = None
            if gather:
                self.gather_host()
        self.store.close()
        if self.store.sharded:
            names = [g.name for g in self.store.sharded]
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            warnings.warn(
                f"torchferry: this rank holds only its 1/{self.plan.config.dp_size} shard of {len(names)} "
                f"all-gathered block(s) ({shown}), so their tensors are left empty (shape (0,)); call "
                "close(gather=True) on every rank (a collective) to get full weights back",
                OffloadWarning,
                stacklevel=4,
            )

    def gather_host(self) -> None:
        """Re-assemble full host copies of every sharded block, one block at a time (a collective).

        Every rank of the weight-shard group must call it, in the same order of sessions.
        """
        if self.comm is None:
            return
        with _ordinary():
            self._gather_host(self.comm)

    def _gather_host(self, comm: Comm) -> None:
        for pack in self.store.sharded:
            pack.unshard(comm.gather_host(pack.host, pack.name))
            self.store.give_back(pack)

    def advance(self, program: Program, stop: int) -> None:
        """Run ``program``'s ops up to op ``stop``, as ordinary tensors whatever the caller's mode."""
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                self.run(program, stop)
        else:
            self.run(program, stop)

    def run(self, program: Program, stop: int) -> None:
        """Run ``program``'s ops up to (not including) op ``stop``."""
        calls = program.calls
        i = program.pc
        if self.tracer is not None or _profiling():
            self._run_observed(program, stop)
            return
        try:
            while i < stop:
                handler, unit, op = calls[i]
                program.pc = i  # the op running now, as listings and the stream sanitizer name it
                handler(self, unit, op)
                i += 1
        finally:
            program.pc = i

    def _run_observed(self, program: Program, stop: int) -> None:
        """`run` with each op told to the tracer and inside its profiler range."""
        calls = program.calls
        i = program.pc
        tracer = self.tracer
        profiling = _profiling()
        while i < stop:
            handler, unit, op = calls[i]
            if tracer is not None:
                tracer.at(i, op)
            if profiling:
                with torch.profiler.record_function(RANGES[op.kind]):
                    handler(self, unit, op)
            else:
                handler(self, unit, op)
            i += 1
            program.pc = i

    def not_resident(self, path: str, pack: Pack, program: Program) -> None:
        """Raise: block ``path`` was reached while ``pack`` was not ready on the device."""
        owner = self.plan.block_owner(path)
        order = None if owner is None else order_mismatch(owner[1], self.ran)
        if order is not None:
            raise ExecutionError(
                f"block {path} was reached out of its ring's order in step "
                f"{step_name(program.schedule.step)}: {order}"
            )
        raise ExecutionError(
            f"block {path} was reached while its weights were {pack.where.value}: step "
            f"{step_name(program.schedule.step)} had not made it resident by then (the mark is the next op "
            "to run); the schedule must load and wait for a block before it runs\n"
            + listing(program.schedule, program.pc)
        )

    # ------------------------------------------------------------------------------ handlers
    def _load(self, unit: Unit, op: Op) -> None:
        if op.src is not None:
            self._load_shard(unit, op)
            return
        name = op.slot
        assert name is not None
        slot = self.slots.get(name)
        held = self.occupants.get(name)
        if held is not None and held is not unit:
            self._claim(unit, op)  # raises
        pack = unit.packs[0]
        if pack.shard is not None:
            raise ExecutionError(
                f"load of {unit.name}: this rank holds only its shard of the block; the schedule must "
                "load the shard and all-gather it (the distributed_layerwise policy does)"
            )
        dst, views = pack.views(name, slot.data)
        self.streams.copy_in(slot, dst, pack.host)
        self._placed_in(unit, name, slot, views)

    def _claim(self, unit: Unit, op: Op) -> None:
        assert op.slot is not None
        held = self.occupants.get(op.slot)
        if held is not None and held is not unit:
            raise ExecutionError(
                f"{op.kind} of {unit.name} into slot {op.slot} while {held.name} still occupies it"
            )

    def _placed_in(self, unit: Unit, name: str, slot: DeviceBuffer, views: tuple[torch.Tensor, ...]) -> None:
        # The tensors move to ``views`` at the wait, once compute is ordered after the copy: until
        # then anything that reads them (a hook, a tied weight, the caller between steps) reads the
        # host copy, not bytes still being written on another stream. What is written in place
        # meanwhile is found at the wait, which copies again: the buffers (a hook of the block before
        # may write one), or every tensor when the engine bumped the pack's versions since its last
        # load (`Pack.rewatch`: the session guard then cannot tell an edit from that bump).
        pack = unit.packs[0]
        if pack.where is _READY:
            # Loaded again while on the device (`check` allows it): back at its host copy until the
            # wait, as any pack in flight, so an evict before that wait leaves nothing in the slot.
            pack.point(pack.host_views)
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
            raise ExecutionError(
                f"gather of {unit.name} from slot {op.src}, which holds "
                f"{'no shard' if held is None else 'the shard of ' + held.name}; load its shard first"
            )
        self._claim(unit, op)
        pack = unit.packs[0]
        src = self.slots.get(op.src)
        slot = self.slots.get(op.slot)
        shard = pack.shard_bytes(op.src, src.data)
        staging = None if self._staging is None else self._staging.data
        comm = self.comm

        def run() -> None:
            comm.all_gather(slot.data, shard, op.chunks, unit.name, staging)

        self.streams.collective(slot, src, run)
        del self.shards[op.src]
        _, views = pack.views(op.slot, slot.data)
        self._placed_in(unit, op.slot, slot, views)

    def _staging_need(self, unit: Unit, op: Op) -> int:
        """Staging bytes op ``op`` (a chunked gather of ``unit`` on a staged backend) needs, else 0."""
        comm = self.comm
        if comm is None or op.kind != "gather" or op.chunks <= 1 or not comm.staged:
            return 0
        return comm.world * -(-unit.packs[0].host.numel() // op.chunks)

    def _plan_staging(self) -> int:
        """Staging bytes the plan's own chunking needs: ``world`` chunks of at most ``chunk_bytes``."""
        comm, chunk = self.comm, self.plan.config.chunk_bytes
        if comm is None or not comm.staged or not chunk or not self.store.sharded:
            return 0
        largest = max(pack.host.numel() for pack in self.store.sharded)
        return comm.world * min(largest, chunk) if largest > chunk else 0

    def _size_staging(self, need: int) -> None:
        """Make the staging buffer hold ``need`` bytes: sized at open for the plan's chunks, so a step
        never swaps it; a custom policy's larger chunks grow it when its schedule is compiled, before
        the step begins, with compute ordered after every gather first (the old buffer's memory goes
        back to the allocator under the compute stream)."""
        if need == 0 or (self._staging is not None and self._staging.data.numel() >= need):
            return
        if self._staging is not None:
            self.streams.settle()
            self.ledger.sub(self._staging.data.numel())
        self._staging = self.streams.transfer(need)
        self.ledger.add(need)
        self.streams.fence()

    def _wait(self, unit: Unit, op: Op) -> None:
        transfer = self.transfers.get(unit.name)
        if transfer is None:
            if unit.name in self.staged:
                return
            raise ExecutionError(f"wait for {unit.name}, which no load brought to the device")
        pack = unit.packs[0]  # a unit with a transfer streams through a slot: one pack
        if pack.watched and pack.stale():
            self._reload(unit, transfer)
        self.streams.wait(transfer)
        views = pack.arriving
        if views is not None:
            pack.arriving = None
            pack.point(views)
            if pack.buffers:
                pack.arrived()
        pack.where = _READY

    def _reload(self, unit: Unit, slot: DeviceBuffer) -> None:
        """Copy ``unit``'s host bytes into its slot again: some of its tensors were written in place
        while the copy was in flight (see `Pack.carry`); for an all-gathered block, raise."""
        pack = unit.packs[0]
        if pack.shard is not None:
            # Its tensors point at empty placeholders until the wait: the write reached no copy of it.
            raise ExecutionError(
                f"{unit.name} was written in place while its all-gather was in flight (by a hook, or a "
                "forward of the blocks before): this rank holds only its shard of the block, so the write "
                "cannot reach the gathered copy; edit an all-gathered block's weights only between "
                "sessions (close(gather=True), edit, open again)"
            )
        dst, _ = pack.views(self.placed[unit.name], slot.data)
        self.streams.copy_in(slot, dst, pack.host)

    def _evict(self, unit: Unit, op: Op) -> None:
        for pack in unit.packs:
            if pack.buffers and pack.where is _READY:
                pack.keep_written()  # before the grad guard bumps versions of its own
        if self.guard.graded:
            self.guard.leaving(unit)
        name = unit.name
        transfer = self.transfers.pop(name, None)
        if transfer is not None:
            if unit.packs[0].where is _IN_FLIGHT:
                # A prefetch compute never waited for (a stale one, which `check` allows): the slot's
                # next writer waits only on ``free``, so compute must first be ordered after this
                # unit's load or gather, which may still be writing the slot on another stream.
                self.streams.wait(transfer)
            self.streams.release(transfer)
        where = self.placed.pop(name, None)
        if where is not None and self.occupants.get(where) is unit:
            del self.occupants[where]
        for pack in unit.packs:
            pack.to_host()

    def _stage(self, unit: Unit, op: Op) -> None:
        sharded = [g.name for g in unit.packs if g.shard is not None]
        if sharded:
            raise ExecutionError(
                f"stage of {unit.name}: this rank holds only shards of {', '.join(sharded)}, which are "
                "all-gathered into ring slots, never staged; keep all-gathered blocks out of a policy's "
                "resident set"
            )
        if unit.name in self.staged:
            self._drop_staged(unit.name)
        held = []
        for pack in unit.packs:
            transfer = self.streams.transfer(pack.nbytes)
            self.ledger.add(pack.nbytes)
            self.streams.copy_in(transfer, transfer.data, pack.host)
            self.streams.wait(transfer)
            pack.point(tuple(p.view(transfer.data) for p in pack.pieces))
            if pack.buffers:
                pack.arrived()
            pack.where = PackState.READY
            held.append((transfer, pack.nbytes))
        self.staged[unit.name] = tuple(held)
        self.placed[unit.name] = DEVICE

    def _unstage(self, unit: Unit, op: Op) -> None:
        for pack in unit.packs:
            if pack.buffers and pack.where is _READY:
                pack.keep_written()  # before the grad guard bumps versions of its own
        if self.guard.graded:
            self.guard.leaving(unit)
        self._drop_staged(unit.name)
        for pack in unit.packs:
            pack.to_host()
        self.placed.pop(unit.name, None)

    def _drop_staged(self, name: str) -> None:
        for _, nbytes in self.staged.pop(name, ()):
            self.ledger.sub(nbytes)

    def _acquire(self, unit: Unit, op: Op) -> None:
        module = unit.module
        load = getattr(module, "load_to_device", None)
        if load is None:
            raise ExecutionError(f"acquire {unit.name}: the module defines no load_to_device()")
        takes = self._load_takes_device.get(unit.name)
        if takes is None:
            takes = bool(inspect.signature(load).parameters)
            self._load_takes_device[unit.name] = takes
        tracer = self.tracer
        begin = None if tracer is None else tracer.compute_mark()
        if takes:
            load(self.device)
        else:
            load()
        if tracer is not None:
            tracer.span("compute", begin, tracer.compute_mark())
        nbytes = op.nbytes or self.plan.topology.component(unit.name).nbytes
        self.acquired[unit.name] = nbytes
        self.ledger.add(nbytes)
        self.placed[unit.name] = DEVICE

    def _release(self, unit: Unit, op: Op) -> None:
        self._release_module(unit.name)
        self.placed.pop(unit.name, None)

    def _release_module(self, name: str) -> None:
        nbytes = self.acquired.pop(name, None)
        if nbytes is None:
            return
        self.ledger.sub(nbytes)
        offload = getattr(self.store.units[name].module, "offload_to_cpu", None)
        if offload is None:
            raise ExecutionError(f"release {name}: the module defines no offload_to_cpu()")
        offload()


#: One short handler per op kind; a program binds each op to its handler once, when compiled.
_HANDLERS: dict[str, Handler] = {
    "load": Engine._load,
    "gather": Engine._gather,
    "wait": Engine._wait,
    "evict": Engine._evict,
    "stage": Engine._stage,
    "unstage": Engine._unstage,
    "acquire": Engine._acquire,
    "release": Engine._release,
}


@contextlib.contextmanager
def execute(
    schedule: Schedule,
    pipeline: Any,
    plan: Plan,
    *,
    device: torch.device | str,
    engine: Engine | None = None,
    pin_memory: bool = True,
) -> Iterator[Engine]:
    """Carry out ``schedule`` while the body runs the forward it was written for.

    Hooks go in at the schedule's anchors; on a clean exit every op must have run and the device must
    hold the schedule's exit residency, else `ExecutionError` shows the listing marked ``<-- here``.
    Without ``engine`` a fresh one is built for this schedule alone and closed on exit, which gives the
    pipeline back as it was; with one (a session's), its state carries on to the next schedule.
    """
    own = engine is None
    runner = Engine(pipeline, plan, device=device, pin_memory=pin_memory) if engine is None else engine
    try:
        runner.begin(schedule)
        try:
            yield runner
        except BaseException:
            runner.abort()
            raise
        runner.finish()
    finally:
        if own:
            runner.close()
