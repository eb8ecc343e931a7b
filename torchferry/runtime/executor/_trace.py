"""`Tracer`: measure one step, op by op and block by block, on the stream each ran on.

[Note: tracing a step]
A tracer is armed on an engine (``engine.arm(tracer)``; `Session.trace` does it) for one step of one
component. When that step begins, the engine hands the tracer to itself and to its stream context;
from then until the step finishes the stream context timestamps, on the stream that does the work,

- every copy (``load``, ``stage``) on the copy stream, after the copy stream's ordering wait, so a
  copy starts when it could start, not when the host queued it;
- every collective (``gather``) on the comm stream, after its ordering waits;
- every ``wait`` on the compute stream, before and after the stream waits on the transfer's event:
  the time between is a *stall* (compute waiting on a transfer);

and the engine's block hooks timestamp each block's forward on the compute stream (after the
block's ``before`` ops, before its ``after`` ops), and an ``acquire`` on the compute stream. On CUDA
a timestamp is an event with timing enabled recorded on that stream; the events are read once,
after one synchronize when the step finishes. On the CPU it is ``time.perf_counter()``: copies and
collectives are synchronous there, so the figures are host time and no two spans overlap, and the
one stall seen is a ``wait`` for a read of the file tier straight into its slot (the reader threads
fill it while compute runs; a copy runs on the compute thread).

Untraced, the engine pays one ``is not None`` check per op (and the stream call an op makes one more)
and one per block hook, and nothing is allocated.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import attrs
import torch

from torchferry._errors import ExecutionError
from torchferry.policies import Op, Schedule, Span, Step, StreamName

if TYPE_CHECKING:
    from torchferry.runtime.device import StreamContext

__all__ = ["Span", "StepTrace", "Tracer"]


@attrs.frozen(kw_only=True, slots=True)
class StepTrace:
    """What one traced step did and when: its spans, in start order, and its wall time.

    ``wall_s`` runs from the step's start (on CUDA, when the compute stream reached it) to its end on
    the compute stream (on CUDA a prefetch for the next step may still be copying after it).
    ``clock`` says how it was measured: ``"cuda events"`` or ``"host clock"``; ``schedule`` is the
    schedule the step ran (a span's ``op`` indexes its ops).
    """

    schedule: Schedule = attrs.field(repr=False)
    device: str
    clock: str
    wall_s: float
    spans: tuple[Span, ...]

    @property
    def component(self) -> str:
        return self.schedule.step.component

    def on(self, stream: StreamName) -> tuple[Span, ...]:
        """The spans of one stream (stalls are on ``compute``)."""
        return tuple(s for s in self.spans if s.stream == stream)

    def busy_s(self, stream: StreamName) -> float:
        """Seconds ``stream`` was busy (stalls not counted)."""
        return sum(s.duration_s for s in self.spans if s.stream == stream and s.kind != "stall")

    @property
    def stall_s(self) -> float:
        """Seconds compute waited on transfers (0 on the CPU, where copies are synchronous)."""
        return sum(s.duration_s for s in self.spans if s.kind == "stall")


class Tracer:
    """Records one step of ``component`` (any component when ``None``), after skipping ``skip`` of them.

    Arm it with ``engine.arm(tracer)`` (or use `Session.trace`); once the step has finished,
    `result` holds its `StepTrace`. The engine and the stream context call the other methods.
    """

    def __init__(self, device: torch.device | str, component: str | None = None, *, skip: int = 0) -> None:
        self.device = torch.device(device)
        self.component = component
        self.skip = skip
        self.cuda = self.device.type == "cuda"
        # Why: steps of ``component`` seen so far, to honour ``skip`` and explain a missing result.
        self.seen = 0
        self._result: StepTrace | None = None
        self._failed = False
        self._schedule: Schedule | None = None
        self._compute: Any = None
        self._start: Any = None
        # Why: the op running now, so a copy or collective the stream context times is labelled.
        self._op: tuple[int, Op] | None = None
        self._open: tuple[str, Any] | None = None
        self._raw: list[tuple[StreamName, str, str, int | None, int, Any, Any]] = []

    # ------------------------------------------------------------------------------ the engine
    def wants(self, step: Step) -> bool:
        """Whether the step about to begin is the one to trace (counts the steps it skips)."""
        if self._result is not None or self._failed:
            return False
        if self.component is not None and step.component != self.component:
            return False
        self.seen += 1
        return self.seen > self.skip

    def start(self, schedule: Schedule, streams: StreamContext) -> None:
        """The traced step of ``schedule`` begins, on ``streams`` (its compute stream is adopted).

        On CUDA the start is marked on the compute stream: the step starts when compute reaches it,
        having finished what the steps before it queued. (An idle copy or comm stream would reach a
        mark at once, while compute may still have a whole untraced step queued: a start taken from
        them measured that backlog as this step's time.) Work of this step that another stream began
        earlier, a copy overlapping the step before, counts from the start on.
        """
        self._schedule = schedule
        self._compute = getattr(streams, "compute", None)
        self._start = self.mark(self._compute) if self.cuda else self.mark()

    def at(self, index: int, op: Op) -> None:
        """Op ``index`` of the step is about to run."""
        self._op = (index, op)

    def mark(self, stream: Any = None) -> Any:
        """A timestamp on ``stream``: a recorded CUDA event, or the host clock on the CPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def compute_mark(self) -> Any:
        """A timestamp on the compute stream."""
        return self.mark(self._compute)

    def span(self, stream: StreamName, begin: Any, end: Any, nbytes: int = 0, *, kind: str = "") -> None:
        """The running op kept ``stream`` busy from ``begin`` to ``end`` (two `mark` results)."""
        assert self._op is not None, "a span is timed while an op runs"
        index, op = self._op
        self._raw.append((stream, kind or op.kind, op.unit, index, nbytes, begin, end))

    def block_begin(self, path: str) -> None:
        """Block ``path``'s forward starts (its ``before`` ops have run); the block before it ended."""
        self.block_end()
        self._open = (path, self.compute_mark())

    def block_end(self) -> None:
        """The open block's forward ended (its ``after`` ops have not run yet); nothing if none is open.

        A block has no post hook: the next block's hook, its component's post hook or the step's end
        says when it ended."""
        if self._open is not None:
            path, begin = self._open
            self._open = None
            self._raw.append(("compute", "compute", path, None, 0, begin, self.compute_mark()))

    def stop(self) -> StepTrace:
        """The traced step finished: read every timestamp (on CUDA after one synchronize)."""
        assert self._schedule is not None
        end = self.compute_mark()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            ref = self._start

            def seconds(mark: Any) -> float:
                return max(float(ref.elapsed_time(mark)) / 1e3, 0.0)

        else:
            origin = float(self._start)

            def seconds(mark: Any) -> float:
                return float(mark) - origin

        spans = [
            Span(stream=stream, kind=kind, label=label, op=op, nbytes=n, start_s=seconds(a), end_s=seconds(b))
            for stream, kind, label, op, n, a, b in self._raw
        ]
        spans = [s for s in spans if s.kind != "stall" or s.end_s > s.start_s]
        spans.sort(key=lambda s: (s.start_s, s.end_s))
        self._result = StepTrace(
            schedule=self._schedule,
            device=str(self.device),
            clock="cuda events" if self.cuda else "host clock",
            wall_s=seconds(end),
            spans=tuple(spans),
        )
        self._reset()
        return self._result

    def fail(self) -> None:
        """The traced step was aborted (it raised, or was interrupted): there is no result."""
        self._failed = True
        self._reset()

    def _reset(self) -> None:
        self._raw = []
        self._open = None
        self._op = None
        self._compute = None
        self._start = None

    # ------------------------------------------------------------------------------ the caller
    @property
    def done(self) -> bool:
        """Whether the traced step has finished (then `result` is its trace)."""
        return self._result is not None

    @property
    def result(self) -> StepTrace:
        """The traced step; `ExecutionError` when it has not run to its end."""
        if self._result is not None:
            return self._result
        what = "step" if self.component is None else f"{self.component} step"
        if self._failed:
            raise ExecutionError(
                f"the traced {what} did not finish (it raised or was aborted): there is no trace"
            )
        wanted = self.skip + 1
        raise ExecutionError(
            f"no {what} was traced: {self.seen} started while tracing and the trace takes step {wanted} "
            f"(skip={self.skip}); run the component inside the trace"
        )
