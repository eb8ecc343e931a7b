"""The one stream context: copy, comm and compute streams and the events handed between them.

[Note: copy / comm / compute overlap]
A step runs on three streams. The model's kernels run on the *compute* stream (whatever stream is
current when the step begins, so torchferry composes with a caller's own stream). Host-to-device
copies of weights run on the *copy* stream, and all-gathers of weight shards on the *comm* stream.
Nothing on the host ever waits for the device: ordering is expressed only with events.

- A load into a slot first makes the copy stream wait on the slot's ``free`` event, recorded on the
  compute stream by the evict of the slot's previous occupant: the copy must not overwrite bytes a
  kernel may still read (write-after-read). It then copies and records the slot's ``ready`` event on
  the copy stream. The transfer and its event travel together, as one `DeviceBuffer` owned by the slot.
- A wait makes the compute stream wait on the unit's ``ready`` event; the block's kernels, enqueued
  afterwards, see the copied bytes (read-after-write). The host thread does not block.
- An evict records the slot's ``free`` on the compute stream. A unit compute never waited for (a
  stale prefetch) is waited for first: ``free`` must follow its load or gather too, or the slot's
  next writer, on another stream, could race a gather still writing it (write-after-write).
- A gather (multi-rank) has the comm stream wait on the shard copy's event, all-gathers into the
  block slot and records that slot's ``ready`` event on the comm stream; the wait is the same.
- A caller that runs a step on another stream than the last (``with torch.cuda.stream(s):``) gets
  that stream adopted as compute, ordered after the old one, and every buffer the engine holds
  handed to it (``record_stream``), so what the last step left ready is read after it was made
  ready and no memory allocated on the old stream goes back to it while the new one reads it.
- Staging gives a unit fresh memory allocated on the compute stream; the copy stream first waits on
  the compute stream (the fresh memory may be a block compute just released), copies, and the compute
  stream waits on that copy before anything later is enqueued.

- A read of the file tier (the *io* stream: reader threads on the host) writes a pinned staging
  buffer; it first waits, on its thread, for the buffer's ``free`` event, recorded on the copy stream
  by the last copy from it (write-after-read). The load or stage from the buffer waits for the read
  on the host, copies on the copy stream and records ``free`` again.
- Where the device's memory is host memory (a CPU device) the reader threads write the device
  buffer itself (a load or stage ``from file``: `fill`), and the read in flight is the buffer's
  ``filling``: a `wait` blocks the host on it (the compute thread is the compute stream), so the
  read of block N+1 runs while block N computes. A buffer is filled again only once its last read
  was waited for (the evict of a unit never waited for waits first, as above).

So while block N computes, block N+1 (or N+d with prefetch depth d) is in flight on the copy stream,
and the only serialisation is the one the schedule's slots force. Events are created once per slot
and per staged unit, never per op. On a machine without CUDA the same calls run synchronously on the
CPU: copies complete before they return and events are ``None``, so everything above this module is
one code path; a read straight into a device buffer (`fill`) is the one thing a CPU waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, final

import attrs
import torch

from torchferry._errors import ExecutionError
from torchferry.policies import StreamName
from torchferry.topology import PACK_ALIGN

__all__ = [
    "CpuStreams",
    "CudaStreams",
    "DeviceBuffer",
    "Reading",
    "StreamContext",
    "Timer",
    "aligned_empty",
    "regrow",
    "stream_context",
]


def _pad(device: torch.device) -> int:
    """Bytes a fresh buffer on ``device`` needs beyond its size to start on a `PACK_ALIGN` boundary:
    none on CUDA (the caching allocator aligns every block to 512), else 256 (the CPU allocator aligns
    to 64)."""
    return 0 if device.type == "cuda" else PACK_ALIGN


def _aligned(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` of ``raw`` (a flat ``uint8`` tensor over its whole storage) from its first
    `PACK_ALIGN` boundary on."""
    skip = -raw.untyped_storage().data_ptr() % PACK_ALIGN
    return raw if skip == 0 and raw.numel() == nbytes else raw.narrow(0, skip, nbytes)


def aligned_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` fresh device bytes whose first byte is on a `PACK_ALIGN` (256-byte) boundary.

    Every tensor of a pack sits at a multiple of 256 bytes from its pack's start (`topology.pack`),
    so a slot whose base is aligned gives every tensor in it the same alignment on every device, as
    the host buffers (page-aligned) do.
    """
    return _aligned(torch.empty(nbytes + _pad(device), dtype=torch.uint8, device=device), nbytes)


def regrow(buffer: DeviceBuffer, nbytes: int) -> None:
    """Give ``buffer`` (its storage shrunk to nothing while parked) ``nbytes`` bytes of memory again,
    its first byte on a `PACK_ALIGN` boundary: where the new memory starts elsewhere relative to the
    boundary (never on CUDA), ``buffer.data`` becomes a new view, so views cached on the old one miss."""
    data = buffer.data
    storage = data.untyped_storage()
    storage.resize_(nbytes + _pad(data.device))
    skip = -storage.data_ptr() % PACK_ALIGN
    buffer.grown += 1
    if data.storage_offset() != skip or data.numel() != nbytes:
        fresh = torch.empty(0, dtype=torch.uint8, device=data.device)
        buffer.data = fresh.set_(storage, skip, (nbytes,), (1,))


class Reading(Protocol):
    """A read of the file tier in flight on the reader threads (`torchferry.runtime.files.Ticket`)."""

    @property
    def done(self) -> bool:
        """Whether the read has finished (or failed)."""
        ...

    def wait(self) -> None:
        """Block until the read has finished; raise its `ExecutionError` if it failed."""
        ...


@attrs.define(slots=True, eq=False)
class DeviceBuffer:
    """Device bytes and the events that say when they are written (``ready``) and free (``free``).

    On the CPU both events are ``None``: every copy has completed when it returns. What it has not is
    a read of the file tier the reader threads are writing straight into the buffer (`fill`): that is
    ``filling`` until a `StreamContext.wait` takes it.
    """

    data: torch.Tensor
    ready: Any = None
    free: Any = None
    filling: Reading | None = None
    #: How many times `regrow` gave the buffer memory again (which may start at another address), so
    #: what was made for its old address (a docked pack's storage over it) is made again.
    grown: int = 0


class Timer(Protocol):
    """What a stream context tells the tracer of a traced step (`Tracer`): marks and the spans between.

    Defined with the streams, so that they need nothing of the tracer ([Note: tracing a step] in
    `_trace`).
    """

    def mark(self, stream: Any = None) -> Any:
        """A timestamp on ``stream``, to hand back to `span` (the tracer knows what it holds)."""
        ...

    def span(self, stream: StreamName, begin: Any, end: Any, nbytes: int = 0, *, kind: str = "") -> None:
        """``stream`` was busy with the running op between marks ``begin`` and ``end``."""
        ...


class StreamContext(Protocol):
    """Issues copies, collectives and stream waits; `CpuStreams` and `CudaStreams` are the two kinds
    a session runs on (the test-only `StreamSanitizer` and `CudaPathStreams` of `torchferry.testing`
    are two more).

    A protocol with final implementations (no shared base): a method one of them lacks is a type
    error, never a silent CPU no-op on CUDA.
    """

    device: torch.device
    #: The tracer of the step being traced (see `Timer`), else ``None``: one check per copy.
    tracer: Timer | None
    #: Whether the device's memory is host memory, so a pack docks at its slot (one storage exchanged)
    #: instead of having each tensor re-pointed ([Note: docking] in `torchferry.runtime.memory._pack`).
    docks: bool

    def begin(self, live: Iterable[DeviceBuffer]) -> None:
        """Called when a step starts: adopt the current stream as the compute stream.

        When it is another stream than the last step's (the caller switched streams between calls),
        order it after that one (what the last step left on the device was made ready for the old
        stream) and hand it ``live``, the device buffers the engine holds (their memory belongs to
        the stream it was allocated on, which the allocator could give it back to while the new one
        still reads it).
        """
        ...

    def transfer(self, nbytes: int) -> DeviceBuffer:
        """Fresh device bytes with their own events (allocated on the compute stream)."""
        ...

    def copy_in(self, dst: DeviceBuffer, dst_bytes: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host bytes ``src`` into ``dst_bytes`` (a view of ``dst.data``), ordered after ``dst.free``."""
        ...

    def before_read(self, staging: DeviceBuffer) -> Callable[[], None] | None:
        """A read of the file tier into host staging buffer ``staging`` is issued (the io stream):
        what the reader threads must wait for before writing it (the last copy from it), or ``None``."""
        ...

    def copy_staged(
        self, dst: DeviceBuffer, dst_bytes: torch.Tensor, staging: DeviceBuffer, src: torch.Tensor
    ) -> None:
        """`copy_in` from ``src``, bytes of ``staging`` that a read the host has waited for wrote, then
        record ``staging.free`` (its drain) after the copy."""
        ...

    def fill(self, dst: DeviceBuffer, read: Callable[[], Reading]) -> None:
        """Start ``read()``, a read of the file tier by the reader threads straight into ``dst`` (device
        memory that is host memory: a CPU device only), once ``dst``'s last read is in; `wait` on
        ``dst`` then blocks until it is in too. A device whose memory no reader thread can write
        refuses it."""
        ...

    def collective(self, dst: DeviceBuffer, src: DeviceBuffer, run: Callable[[], None]) -> None:
        """Run ``run`` (a collective reading ``src`` and writing ``dst``) on the comm stream.

        It is ordered after ``src``'s copy and after ``dst.free``; ``dst.ready`` is recorded after it,
        and ``src.free`` too (so the next copy into ``src`` waits for the collective to read it).
        """
        ...

    def wait(self, transfer: DeviceBuffer) -> None:
        """Make the compute stream wait until ``transfer`` is written (the host, for a read that
        fills it: ``transfer.filling``, whose error it raises)."""
        ...

    def release(self, transfer: DeviceBuffer) -> None:
        """Mark the point after which compute no longer reads ``transfer`` (its ``free`` event)."""
        ...

    def fence(self) -> None:
        """Order the copy and comm streams after everything compute has issued (fresh scratch memory)."""
        ...

    def settle(self) -> None:
        """Order compute after everything the copy and comm streams issued (before memory is freed)."""
        ...

    def synchronize(self) -> None:
        """Block the host until every stream is idle (teardown and error recovery only)."""
        ...


@final
class CpuStreams:
    """The CPU stream context: every copy and collective runs synchronously; events are ``None``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tracer: Timer | None = None
        self.docks = device.type == "cpu"  # (not on ``meta``, a test device whose memory holds no bytes)

    def begin(self, live: Iterable[DeviceBuffer]) -> None: ...

    def transfer(self, nbytes: int) -> DeviceBuffer:
        return DeviceBuffer(data=aligned_empty(nbytes, self.device))

    def copy_in(self, dst: DeviceBuffer, dst_bytes: torch.Tensor, src: torch.Tensor) -> None:
        tracer = self.tracer
        if tracer is None:
            dst_bytes.copy_(src)
            return
        begin = tracer.mark()
        dst_bytes.copy_(src)
        tracer.span("copy", begin, tracer.mark(), dst_bytes.nbytes)

    def before_read(self, staging: DeviceBuffer) -> Callable[[], None] | None:
        return None  # every copy from it has completed

    def copy_staged(
        self, dst: DeviceBuffer, dst_bytes: torch.Tensor, staging: DeviceBuffer, src: torch.Tensor
    ) -> None:
        self.copy_in(dst, dst_bytes, src)

    def fill(self, dst: DeviceBuffer, read: Callable[[], Reading]) -> None:
        last = dst.filling
        if last is not None:  # never waited for (the engine waits at the evict): in before a write
            dst.filling = None
            last.wait()
        dst.filling = read()

    def collective(self, dst: DeviceBuffer, src: DeviceBuffer, run: Callable[[], None]) -> None:
        tracer = self.tracer
        if tracer is None:
            run()
            return
        begin = tracer.mark()
        run()
        tracer.span("comm", begin, tracer.mark())

    def wait(self, transfer: DeviceBuffer) -> None:
        # Every copy and collective has completed when it returns; a read into the buffer may not.
        filling = transfer.filling
        if filling is None:
            return
        transfer.filling = None
        tracer = self.tracer
        if tracer is None:
            filling.wait()
            return
        begin = tracer.mark()
        filling.wait()
        tracer.span("compute", begin, tracer.mark(), kind="stall")

    # On the CPU every copy and collective has completed when it returns: there is nothing to order.
    def release(self, transfer: DeviceBuffer) -> None: ...
    def fence(self) -> None: ...
    def settle(self) -> None: ...
    def synchronize(self) -> None: ...


@final
class CudaStreams:
    """The CUDA stream context: a dedicated copy stream and comm stream, events per transfer."""

    docks = False  # a CPU tensor cannot read device memory: each tensor is re-pointed

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tracer: Timer | None = None
        # Why: copies must not queue behind the model's kernels, nor collectives behind copies.
        self.copy = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.comm = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # Why: the compute stream is the caller's current stream, captured at each step's start.
        self.compute = torch.cuda.current_stream(device)

    def begin(self, live: Iterable[DeviceBuffer]) -> None:
        current = torch.cuda.current_stream(self.device)
        if current == self.compute:
            return
        current.wait_stream(self.compute)
        for buffer in live:
            if buffer.data.untyped_storage().nbytes():  # a parked slot grows back on the stream current then
                buffer.data.record_stream(current)
        self.compute = current

    def transfer(self, nbytes: int) -> DeviceBuffer:
        with torch.cuda.stream(self.compute):
            data = aligned_empty(nbytes, self.device)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return DeviceBuffer(data=data, ready=ready, free=None)

    def _writes(self, stream: Any, dst: DeviceBuffer) -> None:
        """Order ``stream`` after compute's last read of ``dst`` (its ``free`` event), or after all of
        compute when ``dst`` is fresh memory that no event covers yet."""
        if dst.free is None:
            stream.wait_stream(self.compute)
        else:
            stream.wait_event(dst.free)

    def copy_in(self, dst: DeviceBuffer, dst_bytes: torch.Tensor, src: torch.Tensor) -> None:
        self._writes(self.copy, dst)
        tracer = self.tracer
        with torch.cuda.stream(self.copy):
            begin = None if tracer is None else tracer.mark(self.copy)
            dst_bytes.copy_(src, non_blocking=True)
            if tracer is not None:
                tracer.span("copy", begin, tracer.mark(self.copy), dst_bytes.nbytes)
        dst.ready.record(self.copy)

    def before_read(self, staging: DeviceBuffer) -> Callable[[], None] | None:
        drained = staging.free
        if drained is None:
            return None
        device = self.device

        def wait() -> None:
            # A reader thread has no device of its own: without this the wait would run on device 0
            # (creating its context there). The event is blocking, so the thread sleeps, not spins.
            torch.cuda.set_device(device)
            drained.synchronize()

        return wait

    def copy_staged(
        self, dst: DeviceBuffer, dst_bytes: torch.Tensor, staging: DeviceBuffer, src: torch.Tensor
    ) -> None:
        self.copy_in(dst, dst_bytes, src)
        # A fresh event per drain: a reader still holding the last one waits for what it was told.
        staging.free = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        staging.free.record(self.copy)

    def fill(self, dst: DeviceBuffer, read: Callable[[], Reading]) -> None:
        raise ExecutionError(
            f"a read of the file tier straight into device memory, and the device is {self.device}, whose "
            "memory no reader thread can write: such a schedule (load or stage 'from file') is for a CPU "
            "device only; on CUDA file-tier units are read into staging slots and loaded from there"
        )

    def collective(self, dst: DeviceBuffer, src: DeviceBuffer, run: Callable[[], None]) -> None:
        self.comm.wait_event(src.ready)
        self._writes(self.comm, dst)
        tracer = self.tracer
        with torch.cuda.stream(self.comm):
            begin = None if tracer is None else tracer.mark(self.comm)
            run()
            if tracer is not None:
                tracer.span("comm", begin, tracer.mark(self.comm))
        dst.ready.record(self.comm)
        if src.free is None:
            src.free = torch.cuda.Event()  # type: ignore[no-untyped-call]
        src.free.record(self.comm)

    def wait(self, transfer: DeviceBuffer) -> None:
        tracer = self.tracer
        if tracer is None:
            self.compute.wait_event(transfer.ready)
            return
        begin = tracer.mark(self.compute)
        self.compute.wait_event(transfer.ready)
        tracer.span("compute", begin, tracer.mark(self.compute), kind="stall")

    def release(self, transfer: DeviceBuffer) -> None:
        if transfer.free is None:
            transfer.free = torch.cuda.Event()  # type: ignore[no-untyped-call]
        transfer.free.record(self.compute)

    def fence(self) -> None:
        self.copy.wait_stream(self.compute)
        self.comm.wait_stream(self.compute)

    def settle(self) -> None:
        # Why: slot memory goes back to the allocator under the compute stream; a copy or gather
        # still in flight on another stream (a prefetch the next step never waits for) must finish
        # before compute can reuse it.
        self.compute.wait_stream(self.copy)
        self.compute.wait_stream(self.comm)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def stream_context(device: torch.device) -> StreamContext:
    """The stream context for ``device``: CUDA streams and events, or the synchronous CPU context."""
    if device.type == "cuda":
        return CudaStreams(device)
    return CpuStreams(device)
