"""The engine that carries out schedules on a live pipeline, and `execute`, its one-schedule form.

An `Engine` binds one plan to one pipeline: it owns the host store, the stream context and the
ledger, opens and closes the session's hold on the pipeline, begins and finishes each step, and
installs forward hooks (`Hooks`) at the blocks and components schedules anchor to. It is a `Mover`
(`_mover`): the device tables and the op handlers that change them. A schedule is compiled once into
a `Program`: its ops as ``(handler, unit, op)`` triples, each handler bound to this engine, and, for
every anchor, the index one past that anchor's last op. Reaching an anchor runs every pending op up
to there, so ops keyed to a block the model skipped still run, in order, before anything later.

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
tensors as placeholders unless asked to gather them (`close(gather=True)`, a collective); a sharded
block of the file tier needs no peer (every rank has the file) and comes back as views of it.

[Note: inference mode]
The engine's own tensors (host buffers, device slots, staged copies, the views parameters point at,
and the tensors `close` gives back) are ordinary tensors whatever mode the caller runs in. Tensors
made under ``torch.inference_mode()`` can never again be written outside it nor take part in
autograd: a slot first allocated during an inference-mode call could not be loaded by the next plain
call, and a pipeline opened or closed inside one would come back with inference-tensor weights. So
every entry point that makes or re-points tensors (opening, the hooks, `abort`, `close`,
`gather_host`) turns inference mode off for its own work (`_ordinary`, or in the hooks torch's C
guard, `INFERENCE_OFF`); the model's forward itself still runs in the caller's mode. (Turning
inference mode off turns grad mode on, so the hooks also turn grad mode off for their work: a
forward under inference mode never counts as one with grad.) A replayed stop whose calls only move
memory (a copy into a slot, a storage exchange) makes no tensor and runs in the caller's mode.

The op handlers and the loop that runs them are in `_mover`; the hooks, with the grad guard
([Note: gradients]), in `_hooks`; compiling in `_program`; step naming and the schedule cache in
`_steps`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch

from torchferry._errors import ExecutionError, OffloadWarning, PlanError
from torchferry.policies import Placement, Schedule, layout, store_pins
from torchferry.runtime.device import Comm, Ledger, StreamContext, resolved, stream_context
from torchferry.runtime.executor._handlers import Mover, profiling
from torchferry.runtime.executor._hooks import Driver, Hooks
from torchferry.runtime.executor._program import (
    MAX_PROGRAMS,
    Program,
    compile_program,
    listing,
    schedule_text,
)
from torchferry.runtime.executor._replay import INFERENCE_OFF, Replay, Tables, build_replay
from torchferry.runtime.executor._step_cache import step_name
from torchferry.runtime.executor._trace import Tracer
from torchferry.runtime.files import CheckpointReader, open_checkpoint
from torchferry.runtime.interop import CastCache, kept_in_float32
from torchferry.runtime.memory import PackState, Sharding, warn_pageable
from torchferry.runtime.store import HostStore, Progress, TierLayout, tier_request
from torchferry.topology import Plan, own_weights

__all__ = ["Engine", "execute"]

_IN_FLIGHT = PackState.IN_FLIGHT

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
    return INFERENCE_OFF(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


class Engine(Mover):
    """Carries out schedules for one plan on one pipeline; the only object that moves weights.

    Built from a pipeline on the CPU: every tensor the plan manages moves into the host store (see
    `HostStore`), so building raises `PlanError` before mutating anything when the pipeline cannot
    be served. ``driver``, when given, is told when a top-level component's forward starts and ends
    (the session uses it to pick each step's schedule). With a checkpoint, ``checkpoint_components``
    names the top-level components filled from it (default: every one); the others keep the weights
    they hold (read from the module, as without a checkpoint). The engine decides nothing: the store
    pins as ``pin_memory`` says on a CUDA device (`policies.store_pins`; a session passes its open
    plan's `OpenPlan.pin`), and the file tier is ``tier`` (the open plan's tiers, `TierLayout.of`;
    ``None``: no file tier).
    """

    #: An abort is under way, or was cut short by a signal: the engine counts as running, so the next
    #: step start aborts again rather than starting from half-dropped tables.
    _aborting = False

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
        tier: TierLayout | None = None,
        variant: str | None = None,
        checkpoint_components: Collection[str] | None = None,
    ) -> None:
        from_module = own_weights(plan, checkpoint_components)
        self.pipeline = pipeline
        self.plan = plan
        # Why: resolved once (`cuda` -> `cuda:0`), so each check of where a tensor is compares like forms.
        self.device = resolved(device)
        self.streams: StreamContext = stream_context(self.device) if STREAMS is None else STREAMS(self)
        self.ledger = Ledger()
        pin = store_pins(pin_memory, self.device.type)  # a session passes its open plan's decision
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
        #: What a synchronize of the device raised (see `synchronize`), or ``None`` while it works.
        self.device_error: Exception | None = None
        sharding = None
        if self.comm is not None:
            self.comm.agree("the plan", plan.digest)
            sharding = Sharding(rank=self.comm.rank, world=world, names=layout(plan).allgather)
        self.store = self._open(
            pipeline, plan, pin=pin, sharding=sharding, prefix_map=prefix_map, tier=tier, variant=variant,
            from_module=from_module,
        )
        if getattr(self.streams, "docks", False):  # (a factory's context without it re-points)
            self.store.bind()  # host and slots are one kind of memory: packs dock ([Note: docking])
        super().__init__()  # the device tables, the slot pool and the grad guard
        self._residency: tuple[Placement, ...] = ()
        # Why: the schedule that finished last, for inspection (what did the last step do?).
        self.last: Schedule | None = None
        #: The program of the step running now (``None`` between steps).
        self.program: Program | None = None
        self._programs: dict[Schedule, Program] = {}
        self.hooks = Hooks(
            self, driver, pipeline=pipeline, plan=plan, units=self.store.units, guard=self.guard
        )
        # Why: a tracer waiting for the step it measures (see `Tracer`, `arm`); ``None``: nothing is traced.
        self._tracing: Tracer | None = None
        # Why: autocast's cast cache is off while a step runs ([Note: autocast] in `_autocast`).
        self._casts = CastCache()

    def _open(
        self,
        pipeline: Any,
        plan: Plan,
        *,
        pin: bool,
        sharding: Sharding | None,
        prefix_map: Mapping[str, str] | None,
        tier: TierLayout | None,
        variant: str | None = None,
        from_module: frozenset[str] = frozenset(),
    ) -> HostStore:
        """Check, read and take over; with several ranks, only once every rank could do the first two."""
        with _ordinary():
            failure: BaseException | None = None
            prepared = None
            path = plan.config.checkpoint
            what = "copying weights to pinned host memory" if pin else "copying weights to host memory"
            progress = Progress(what if path is None else f"reading weights from {path}")
            readers: list[CheckpointReader] = []
            try:
                reader = None
                if path is not None:
                    reader = open_checkpoint(
                        path,
                        pipeline=pipeline,
                        prefix_map=prefix_map,
                        variant=variant,
                        widen=kept_in_float32(pipeline, plan.topology),
                    )
                    readers.append(reader)
                request = tier_request(
                    plan, tier, reader, readers, prefix_map, from_module=from_module, device=self.device
                )
                prepared = HostStore.prepare(
                    pipeline, plan, pin=pin, reader=reader, sharding=sharding, progress=progress,
                    tier=request, from_module=from_module,
                )  # fmt: skip
            except Exception as exc:
                failure = exc
            finally:
                for opened in readers:  # the file tier keeps its source open for the session
                    if prepared is None or prepared.tier is None or opened is not prepared.tier.source:
                        opened.close()
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
        """Whether a step has begun and not yet finished or been aborted (an abort cut short by a
        signal leaves it running: the next step start aborts again)."""
        return self.program is not None or self._aborting

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
        program = compile_program(schedule, self.store.units, self.handlers(), self.comm)
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
        self.streams.begin(self.buffers())
        self.slots.prepare(schedule.slots, occupied=self.placed.values(), used=program.slots)
        self.ledger.mark()
        program.pc = 0
        self.program = program
        self._replay = self.replaying = self._recording = None
        self.deferred = frozenset()
        if (
            program.primitive is not None
            and self._synchronous
            and "copy_in" not in vars(self.streams)  # a probe shadowing the copy sees every copy
            and self._tracing is None
            and not self.guard.graded
            and not torch.is_grad_enabled()
            and not profiling()
        ):  # [Note: replay] in `_replay`
            replay = program.replay
            ready = replay is not None and replay.ready(self.slots)
            if replay is not None and not ready and replay.moved(self.slots):
                # The same slots, grown again elsewhere (another component used them between): the
                # recorded tables hold, the views over the slots are made anew.
                rebuilt = self._replay_of(program, replay.tables)
                if rebuilt is not None:
                    rebuilt.used = replay.used
                program.replay = replay = rebuilt
                ready = replay is not None and replay.ready(self.slots)
            if ready and replay is not None:
                replay.used += 1
                self._replay, self.replaying = replay, replay.segments
            elif program.recorded < 2 or (replay is not None and replay.used):
                # Recorded again when its slots moved, while the replays pay for it: a program whose
                # slots move before every run (never replayed between) stops after two recordings.
                self._recording = {0: self.tables()}
        self.gather_slot = program.gather
        self.hooks.ran.clear()
        self.hooks.check()  # every wrapped block still runs its hook from its forward
        if self._tracing is not None and self._tracing.wants(schedule.step):
            self.tracer = self.streams.tracer = self._tracing
            self.tracer.start(schedule, self.streams)
        self._casts.step_begins()
        return program

    def finish(self) -> None:
        """End the running step: every op must have run and the device must hold its exit residency."""
        program = self.program
        if program is None:
            return
        replayed = self._replay
        self.unreplay()  # the tables as the first run left them here
        self.deferred = frozenset() if replayed is None else replayed.later
        recording, self._recording = self._recording, None
        self.program = None
        self._casts.step_ends()
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
        if recording is not None:  # a whole run of a program a step can replay ([Note: replay])
            program.replay = self._replay_of(program, recording)
            program.recorded += 1
        self._residency = schedule.exit
        self.last = schedule
        tracer = self.tracer
        if tracer is not None:
            self._untrace()
            tracer.stop()

    def _replay_of(self, program: Program, tables: dict[int, Tables]) -> Replay | None:
        """``program``'s `Replay` from the ``tables`` a run of it recorded, over the slots now."""
        calls, entry = program.calls, program.entry
        return build_replay(calls, program.primitive, entry, tables, self.slots, ends=program.ends)

    def _untrace(self) -> None:
        """The traced step is over: nothing is timed from here on, and the tracer is disarmed."""
        self.tracer = self.streams.tracer = None
        self._tracing = None

    def synchronize(self) -> bool:
        """Block until every stream is idle; whether the device still works.

        A synchronize that raises (a device-side assert or an illegal address: CUDA's sticky errors,
        after which the context is dead) is kept in `device_error`, not raised: its device copies are
        lost with the context, the host copies are not, and the recovery that called it (abort,
        close) must still point every weight back at them. Once failed, the device is not asked again.
        """
        if self.device_error is not None:
            return False
        try:
            self.streams.synchronize()
        except Exception as exc:
            self.device_error = exc
            return False
        return True

    def abort(self) -> None:
        """Drop every device copy and point all weights at host memory: always safe, never loses one
        (a device that fails to synchronize is noted in `device_error`, and the weights go back all
        the same)."""
        with _ordinary():
            self._abort()

    def _abort(self) -> None:
        self._aborting = True
        replay = self._replay
        if replay is not None:  # (before it is dropped: a signal in it leaves it to recover again)
            replay.recover()  # the packs' record, read from their memory, for `_drop_all`
        self.program = None
        self._replay = self.replaying = self._recording = None
        self.deferred = frozenset()
        self._casts.step_ends()
        tracer = self.tracer
        if tracer is not None:
            self._untrace()
            tracer.fail()
        if not self.broken:
            self.synchronize()
        self._drop_all(wait=not self.broken)
        self._residency = ()
        self._aborting = False

    def close(self, *, gather: bool = False) -> None:
        """Remove every hook, free device memory and give each tensor host storage of its own again.

        Tensors of blocks this rank holds only a shard of stay placeholders (shape ``(0,)``), and
        their host shards are kept, unless ``gather`` is true: then every rank of the weight-shard
        group must call it (a collective), and full host copies are re-assembled first. `gather_host`
        does the same later, after a plain close. File-tier blocks come back as views of the file
        either way. The host store (with the file tier's reader and staging slots) closes whatever
        else fails.
        """
        with _ordinary():
            self._close(gather)

    def _close(self, gather: bool) -> None:
        self.unhook()
        self.abort()
        self._programs.clear()
        # After a failed collective a gather still queued may write the slots (the gather slot too)
        # one day, so their memory is kept, and no collective is tried (see [Note: failures] in `_comm`);
        # a device that failed to synchronize is asked nothing more either.
        try:
            if not self.broken and self.device_error is None:
                self._free()
                if self.comm is not None:
                    self.comm.forget()  # its cached slot views would keep the slots' memory
                if gather:
                    self.gather_host()
        finally:  # the reader threads, the checkpoint's descriptors and the staging slots always go
            self.store.close(broken=self.broken)
        if self.device_error is not None:
            raise ExecutionError(
                f"the device {self.device} failed ({type(self.device_error).__name__}: {self.device_error}); "
                "its memory went with its context, and every weight was given back from its host copy "
                "(no weight is lost, only what was written in place into device copies since the last "
                "step). CUDA cannot be used again in this process: restart it (CUDA_LAUNCH_BLOCKING=1 "
                "names the failing kernel)"
            ) from self.device_error
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
            if pack.in_file:  # every rank has the file: no collective (the same packs on every rank)
                self.store.unshard_from_file(pack)
            else:
                pack.unshard(comm.gather_host(pack.host, pack.name))
            self.store.give_back(pack)


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
    if engine is None:  # an engine for this schedule alone lays out the file tier it names
        tier = TierLayout.from_schedule(schedule)
        runner = Engine(pipeline, plan, device=device, pin_memory=pin_memory, tier=tier)
    else:
        runner = engine
    try:
        runner.begin(schedule)
        try:
            yield runner
        except BaseException:
            runner.abort()
            raise
        runner.finish()
    except BaseException as exc:
        if own:
            try:
                runner.close()
            except Exception as also:  # the body's own exception is the one to see (a dead device)
                note = getattr(exc, "add_note", None)
                if note is not None:
                    note(f"torchferry: closing the engine afterwards raised too: {also!r}")
        raise
    if own:
        runner.close()
