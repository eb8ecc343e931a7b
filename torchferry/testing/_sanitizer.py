"""A stream sanitizer: a test-only stream context that proves every slot access is ordered.

CPU copies are synchronous, so no CPU test sees a missing event wait; on CUDA the same missing wait
is a race. `StreamSanitizer` runs every copy and collective synchronously (as `CpuStreams` does, so
outputs are unchanged) and, beside it, keeps the happens-before order the CUDA stream context would
give, with one vector clock per stream:

- every copy (copy stream), collective (comm stream), block forward (compute stream) and read of
  the file tier into a staging buffer or, on a CPU device, straight into a device buffer (``fill``;
  io stream: the reader threads) is an access that advances its stream's own entry; a load or stage
  from a staging buffer reads it on the copy stream;
- the compute stream is the caller's: ``compute`` unless a test runs the pipeline inside
  `caller_stream` (a second compute stream, as a caller's ``torch.cuda.stream(s)``), adopted at
  each step's start as the CUDA context adopts the current stream;
- an event records its stream's clock; waiting on it (`wait`, a copy ordered after ``free``, a
  collective after its source's ``ready``) merges that clock into the waiting stream's, as does a
  whole-stream wait (`fence`, `settle`, `synchronize`, a copy into fresh memory).

Each device buffer (a slot, a staged unit's memory) and staging buffer keeps its last write (a load,
a gather, a read) and the reads since (a gather reading a shard slot, a block running from its slot,
a copy from a staging buffer), and the compute streams
the caching allocator knows it is used on (the one it was allocated on, and those the engine handed
it to): a read on another compute stream could race the allocator giving the memory back to the
first while it is still read. An access raises
`StreamOrderError`, naming the schedule op, when a read is not ordered after the write it reads, or a
write is not ordered after the buffer's previous write and the reads of the data it overwrites.
Reads by blocks are seen through one global forward hook (it runs before the module's own hooks,
so before the engine's ``after`` ops), only while `sanitize` is active; the pipeline's modules get
no hook of their own, so a closed session still gives them back untouched.

    with sanitize():                 # every engine built inside uses a StreamSanitizer
        with torchferry.offload(pipe, strategy="layerwise") as session:
            pipe("a cat")
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, final

import attrs
import torch

from torchferry.policies import Op, format_marked, rest_unit
from torchferry.runtime import DeviceBuffer, PackState, aligned_empty, same_device, stream_factory
from torchferry.topology import find_attr

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torchferry.runtime import Engine, Reading, Timer

__all__ = ["StreamOrderError", "StreamSanitizer", "caller_stream", "sanitize"]

#: A stream's name: ``copy``, ``comm``, ``io`` (the file tier's reads), or a compute stream
#: (``compute``, or one `caller_stream` names).
Stream = str
_STREAMS: tuple[Stream, ...] = ("copy", "comm", "compute", "io")
#: The caller's current stream, as `caller_stream` sets it (the one entry: one thread runs the tests).
_CALLER: list[Stream] = ["compute"]


@contextlib.contextmanager
def caller_stream(name: str) -> Iterator[None]:
    """Run the body as a caller that made another stream current (``with torch.cuda.stream(s):``): steps
    that start inside adopt compute stream ``compute:<name>``, and block forwards read on it."""
    before = _CALLER[0]
    _CALLER[0] = f"compute:{name}"
    try:
        yield
    finally:
        _CALLER[0] = before


class StreamOrderError(AssertionError):
    """A device buffer access the CUDA streams would not order (a race on a GPU)."""


@attrs.define(slots=True, eq=False)
class _Clock:
    """A vector clock: how far each stream had got, as seen from one stream or event."""

    times: dict[Stream, int] = attrs.field(factory=dict)

    def merge(self, other: _Clock) -> None:
        times = self.times
        for stream, time in other.times.items():
            if time > times.get(stream, 0):
                times[stream] = time

    def snapshot(self) -> _Clock:
        return _Clock(dict(self.times))

    def seen(self, stream: Stream) -> int:
        return self.times.get(stream, 0)


@attrs.define(slots=True, eq=False)
class _Event:
    """A recorded event: the clock of the stream it was recorded on, at that point."""

    clock: _Clock = attrs.field(factory=_Clock)


@attrs.frozen(slots=True)
class _Access:
    """One access to a buffer: its stream, that stream's own clock entry, and what made it."""

    stream: Stream
    time: int
    what: str


@attrs.define(slots=True, eq=False)
class _History:
    """A buffer's last write and the reads of that write so far."""

    write: _Access | None = None
    reads: list[_Access] = attrs.field(factory=list)


def op_line(op: Op) -> str:
    """``op``'s canonical text line (its ``repr`` without the ``Op<...>`` wrapper)."""
    return repr(op).removeprefix("Op<").removesuffix(">")


def _ordered(clock: _Clock, access: _Access) -> bool:
    return clock.seen(access.stream) >= access.time


@final
class StreamSanitizer:
    """The stream context that checks ordering (see the module docstring); one per engine.

    ``engine`` names the op that runs (for messages) and the modules whose forwards are reads.
    """

    def __init__(self, engine: Engine, *, docks: bool = True) -> None:
        self.engine = engine
        self.device: torch.device = engine.device
        self.tracer: Timer | None = None
        # As under `CpuStreams`; ``False``: every tensor is re-pointed, as on CUDA (`sanitize`).
        self.docks = docks and self.device.type == "cpu"
        self._clocks: dict[Stream, _Clock] = {s: _Clock() for s in _STREAMS}
        #: The compute stream adopted at the last step's start (the caller's then).
        self.compute: Stream = _CALLER[0]
        # Why: each buffer's writes and reads, keyed by identity (a buffer outlives storage resizes).
        self._history: weakref.WeakKeyDictionary[DeviceBuffer, _History] = weakref.WeakKeyDictionary()
        # Why: the compute streams the allocator knows each buffer is used on (see the module docstring).
        self._users: weakref.WeakKeyDictionary[DeviceBuffer, set[Stream]] = weakref.WeakKeyDictionary()
        # Why: id(module) -> the unit whose weights its forward reads (blocks, component remainders).
        self._readers: dict[int, str] | None = None
        #: Accesses checked, and host waits for every stream (`synchronize`), for tests and figures.
        self.checked = 0
        self.synchronized = 0

    # ----------------------------------------------------------------------------- the clocks
    def _clock(self, stream: Stream) -> _Clock:
        clock = self._clocks.get(stream)
        if clock is None:
            clock = self._clocks[stream] = _Clock()
        return clock

    def _tick(self, stream: Stream) -> int:
        clock = self._clock(stream)
        time = clock.seen(stream) + 1
        clock.times[stream] = time
        return time

    def _record(self, event: Any, stream: Stream) -> _Event:
        recorded = event if isinstance(event, _Event) else _Event()
        recorded.clock = self._clock(stream).snapshot()
        return recorded

    def _wait_event(self, stream: Stream, event: Any) -> None:
        if isinstance(event, _Event):
            self._clock(stream).merge(event.clock)

    def _wait_stream(self, stream: Stream, other: Stream) -> None:
        self._clock(stream).merge(self._clock(other))

    # -------------------------------------------------------------------------------- checks
    def _where(self) -> str:
        """The op running now, as its line, or the block/step position when no op runs."""
        program = self.engine.program
        if program is None or program.pc >= len(program.calls):
            return "outside any op"
        return f"op {program.pc} ({op_line(program.schedule.ops[program.pc])})"

    def _listing(self) -> str:
        program = self.engine.program
        if program is None:
            return ""
        pc = program.pc
        return "\n" + format_marked(program.schedule, ["exit" if pc >= len(program.calls) else pc])

    def _write(self, buffer: DeviceBuffer, stream: Stream, what: str) -> None:
        history = self._history.setdefault(buffer, _History())
        clock = self._clock(stream)
        self.checked += 1
        last = history.write
        if last is not None and not _ordered(clock, last):
            self._fail(
                f"{what} on the {stream} stream writes a buffer that {last.what} wrote on the "
                f"{last.stream} stream, and is not ordered after that write (write after write)"
            )
        for read in history.reads:
            if not _ordered(clock, read):
                self._fail(
                    f"{what} on the {stream} stream overwrites bytes that {read.what} reads on the "
                    f"{read.stream} stream, and is not ordered after that read (write after read)"
                )
        history.write = _Access(stream=stream, time=self._tick(stream), what=what)
        history.reads.clear()

    def _read(self, buffer: DeviceBuffer, stream: Stream, what: str) -> None:
        history = self._history.setdefault(buffer, _History())
        self.checked += 1
        users = self._users.get(buffer) if stream not in ("copy", "comm", "io") else None  # compute streams
        if users is not None and stream not in users:
            self._fail(
                f"{what} on the {stream} stream reads memory the caching allocator knows only on "
                f"{' and '.join(sorted(users))}: freed, it may be handed to work there while this stream "
                "still reads it (hand it to this stream: record_stream)"
            )
        last = history.write
        if last is not None and not _ordered(self._clock(stream), last):
            self._fail(
                f"{what} on the {stream} stream reads bytes that {last.what} writes on the "
                f"{last.stream} stream, and is not ordered after that write (read after write)"
            )
        history.reads.append(_Access(stream=stream, time=self._tick(stream), what=what))

    def _fail(self, message: str) -> None:
        raise StreamOrderError(f"stream sanitizer: {message}; a missing event wait{self._listing()}")

    def _exposed(self, when: str) -> None:
        """Fail if the tensors of a unit not yet waited for point at its slot while compute is not
        ordered after the slot's last write: on a GPU anything reading them on the compute stream (a
        hook, a tied weight, the caller between steps) would race that write. (A unit the engine took
        as waited for is checked where its block reads it, in `ran`.)"""
        engine = self.engine
        clock = self._clock(self.compute)
        for name, buffer in engine.transfers.items():
            history = self._history.get(buffer)
            if history is None or history.write is None or _ordered(clock, history.write):
                continue
            # A pack re-pointed at the slot views its storage; a docked one ([Note: docking] in
            # `torchferry.runtime.memory._pack`) a storage that starts where the slot's bytes do.
            bases = (buffer.data.untyped_storage().data_ptr(), buffer.data.data_ptr())
            for pack in engine.store.units[name].packs:
                if pack.where is PackState.READY:
                    continue
                tensor = self._first(pack.tensors)
                if tensor is not None and tensor.untyped_storage().data_ptr() in bases:
                    self._fail(
                        f"{when}, the tensors of {pack.name} point at a slot that {history.write.what} "
                        f"writes on the {history.write.stream} stream, and compute is not ordered after "
                        "that write (a read of them races it)"
                    )

    def _first(self, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """The first non-empty tensor of ``tensors`` on the device, if any."""
        return next((t for t in tensors if t.numel() and same_device(t.device, self.device)), None)

    # ------------------------------------------------------------------------ StreamContext
    def begin(self, live: Iterable[DeviceBuffer]) -> None:
        current = _CALLER[0]
        if current != self.compute:
            self._wait_stream(current, self.compute)
            for buffer in live:
                self._users.setdefault(buffer, set()).add(current)
            self.compute = current
        self._exposed("as the last step left them")

    def transfer(self, nbytes: int) -> DeviceBuffer:
        buffer = DeviceBuffer(data=aligned_empty(nbytes, self.device), ready=_Event())
        self._users[buffer] = {self.compute}
        return buffer

    def copy_in(self, dst: DeviceBuffer, dst_bytes: torch.Tensor, src: torch.Tensor) -> None:
        if dst.free is None:
            self._wait_stream("copy", self.compute)
        else:
            self._wait_event("copy", dst.free)
        self._write(dst, "copy", self._where())
        tracer = self.tracer
        begin = None if tracer is None else tracer.mark()
        dst_bytes.copy_(src)
        if tracer is not None:
            tracer.span("copy", begin, tracer.mark(), dst_bytes.nbytes)
        dst.ready = self._record(dst.ready, "copy")

    def before_read(self, staging: DeviceBuffer) -> Callable[[], None] | None:
        # The reader threads wait for the staging buffer's last drain, then write it on the io stream.
        self._wait_event("io", staging.free)
        self._write(staging, "io", self._where())
        staging.ready = self._record(staging.ready, "io")
        return None

    def copy_staged(
        self, dst: DeviceBuffer, dst_bytes: torch.Tensor, staging: DeviceBuffer, src: torch.Tensor
    ) -> None:
        # The host waited for the read before issuing the copy: the copy stream is ordered after it.
        self._wait_event("copy", staging.ready)
        self._read(staging, "copy", self._where())
        self.copy_in(dst, dst_bytes, src)
        staging.free = self._record(staging.free, "copy")

    def fill(self, dst: DeviceBuffer, read: Callable[[], Reading]) -> None:
        # The reader threads write the device buffer on the io stream, after compute's last read of
        # it; each read has threads of its own, so two reads into one buffer are never ordered by the
        # io stream: the last must have been waited for.
        if dst.filling is not None:
            self._fail(
                f"{self._where()} reads into a device buffer that a read not yet waited for still fills "
                "(write after write)"
            )
        if dst.free is None:
            self._wait_stream("io", self.compute)
        else:
            self._wait_event("io", dst.free)
        self._write(dst, "io", self._where())
        dst.ready = self._record(dst.ready, "io")
        dst.filling = read()

    def collective(self, dst: DeviceBuffer, src: DeviceBuffer, run: Callable[[], None]) -> None:
        self._wait_event("comm", src.ready)
        if dst.free is None:
            self._wait_stream("comm", self.compute)
        else:
            self._wait_event("comm", dst.free)
        where = self._where()
        self._read(src, "comm", where)
        self._write(dst, "comm", where)
        tracer = self.tracer
        begin = None if tracer is None else tracer.mark()
        run()
        if tracer is not None:
            tracer.span("comm", begin, tracer.mark())
        dst.ready = self._record(dst.ready, "comm")
        src.free = self._record(src.free, "comm")

    def wait(self, transfer: DeviceBuffer) -> None:
        self._wait_event(self.compute, transfer.ready)
        filling = transfer.filling
        if filling is not None:  # the host waits for the read, as `CpuStreams.wait` does
            transfer.filling = None
            filling.wait()

    def release(self, transfer: DeviceBuffer) -> None:
        transfer.free = self._record(transfer.free, self.compute)

    def fence(self) -> None:
        self._wait_stream("copy", self.compute)
        self._wait_stream("comm", self.compute)

    def settle(self) -> None:
        self._wait_stream(self.compute, "copy")
        self._wait_stream(self.compute, "comm")

    def synchronize(self) -> None:
        self.synchronized += 1
        every = _Clock()
        for clock in self._clocks.values():
            every.merge(clock)
        for clock in self._clocks.values():
            clock.merge(every)

    # ------------------------------------------------------------------------- block reads
    def ran(self, module: torch.nn.Module) -> None:
        """``module``'s forward has run on the compute stream: if it is a block (or a component's
        remainder), it read its unit's device buffers."""
        if getattr(self.engine, "program", None) is None:  # between steps, or an engine that never opened
            return
        self._exposed(f"after the forward of {type(module).__name__} (before {self._where()})")
        readers = self._readers
        if readers is None:
            readers = self._readers = self._find_readers()
        unit = readers.get(id(module))
        if unit is None:
            return
        buffers = self._buffers()
        for pack in self.engine.store.units[unit].packs:
            tensor = self._first(pack.tensors)
            if tensor is None:
                continue
            buffer = buffers.get(tensor.untyped_storage().data_ptr())
            if buffer is not None:
                self._read(buffer, _CALLER[0], f"the forward of {unit} (before {self._where()})")

    def _find_readers(self) -> dict[int, str]:
        engine = self.engine
        readers: dict[int, str] = {}
        for top in engine.plan.components:
            for c in top.walk():
                rest = rest_unit(c.path)
                if rest in engine.store.units:
                    readers[id(find_attr(engine.pipeline, c.path))] = rest
                for b in c.blocks:
                    if b.path in engine.store.units:
                        readers[id(find_attr(engine.pipeline, b.path))] = b.path
        return readers

    def _buffers(self) -> dict[int, DeviceBuffer]:
        """Every buffer with a history or in the engine's slots and staged units, by storage address."""
        engine = self.engine
        found: dict[int, DeviceBuffer] = {}
        live = [b for _, b in engine.slots.slots.values()]
        live += [b for held in engine.staged.values() for b, _ in held]
        for buffer in live:
            storage = buffer.data.untyped_storage()
            if storage.nbytes():
                found[storage.data_ptr()] = buffer
                found[buffer.data.data_ptr()] = buffer  # where a docked pack's storage starts
        return found


#: The sanitizers of engines built under `sanitize`, told of every module forward.
_LIVE: weakref.WeakSet[StreamSanitizer] = weakref.WeakSet()


def _ran(module: torch.nn.Module, args: Any, output: Any) -> None:
    for sanitizer in list(_LIVE):
        sanitizer.ran(module)


# Dynamo must not trace the hook: a compiled module calls global hooks inside its graph, and guards
# on the weak set's contents fail to build once the garbage collector has shrunk it.
_ran = torch.compiler.disable(_ran, recursive=True)  # type: ignore[no-untyped-call]


def _factory(engine: Engine, docks: bool) -> StreamSanitizer:
    sanitizer = StreamSanitizer(engine, docks=docks)
    _LIVE.add(sanitizer)
    return sanitizer


@contextlib.contextmanager
def sanitize(*, docks: bool = True) -> Iterator[None]:
    """Every engine built inside runs on a `StreamSanitizer` (CPU devices only; test use).

    Swaps the engine's stream-context seam (`runtime.stream_factory`) and installs one global
    forward hook for block reads; both are restored on exit. ``docks=False`` re-points every tensor
    instead of docking packs, as a CUDA session does (what `torchferry.testing.cuda_path` does, here
    with the ordering checks).
    """
    before = stream_factory(functools.partial(_factory, docks=docks))
    handle = torch.nn.modules.module.register_module_forward_hook(_ran)
    try:
        yield
    finally:
        handle.remove()
        stream_factory(before)
