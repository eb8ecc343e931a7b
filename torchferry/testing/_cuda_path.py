"""The CUDA path on a CPU: a test-only stream context that makes a CPU session run the code a CUDA
session runs.

A session on a CPU device takes two shortcuts a CUDA session cannot: its packs dock at their slots
(one storage exchanged per move, [Note: docking] in `torchferry.runtime.memory._pack`) where CUDA
re-points each tensor, and since its copies have completed when they return, it skips every wait and
release and replays a steady step ([Note: replay] in `torchferry.runtime.executor._replay`). So the
hot path a CPU test counts or times is not the one a GPU user runs.

`CudaPathStreams` takes both away and keeps the CPU's arithmetic: packs are re-pointed tensor by
tensor, every transfer has a ``ready`` event its copy records and a ``free`` event its release
records, the engine calls `wait` and `release` for each block as on CUDA, and no step is replayed.
Copies still run at once, so outputs are bit-identical to the plain run. The events record and
count, nothing more: ordering is what `torchferry.testing.sanitize` checks. What it leaves out of
CUDA's work is the CUDA runtime's own (kernel launches, event records on the driver), which only a
GPU can show (``benchmarks/gpu_check.py``'s ``host per block``).

    with cuda_path():                # every engine built inside uses CudaPathStreams
        with torchferry.offload(pipe, strategy="layerwise", device="cpu"):
            pipe("a cat")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, final

import torch

from torchferry.runtime import DeviceBuffer, aligned_empty, stream_factory
from torchferry.runtime.device import CpuStreams

if TYPE_CHECKING:
    from torchferry.runtime import Engine, Reading, Timer

__all__ = ["CudaPathStreams", "cuda_path"]


@final
class _Event:
    """A CUDA event's calls the engine makes (``record``), counted."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records = 0

    def record(self, stream: Any = None) -> None:
        self.records += 1


@final
class CudaPathStreams:
    """A stream context with CUDA's shape over CPU memory (see the module docstring): the work is
    `CpuStreams`' own, the events recorded and the calls counted are CUDA's."""

    docks = False  # each tensor is re-pointed, as on CUDA

    def __init__(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(
                f"CudaPathStreams runs a CPU device's session as CUDA would; the device is {device}: "
                "use device='cpu' inside cuda_path()"
            )
        self.device = device
        #: What carries out each copy, collective and read (its tracer is this context's).
        self.cpu = CpuStreams(device)
        #: Calls the engine made, by kind: what a CUDA session would issue to its streams.
        self.calls: dict[str, int] = dict.fromkeys(("copy", "wait", "release", "collective"), 0)

    @property
    def tracer(self) -> Timer | None:
        return self.cpu.tracer

    @tracer.setter
    def tracer(self, tracer: Timer | None) -> None:
        self.cpu.tracer = tracer

    def begin(self, live: Iterable[DeviceBuffer]) -> None: ...

    def transfer(self, nbytes: int) -> DeviceBuffer:
        return DeviceBuffer(data=aligned_empty(nbytes, self.device), ready=_Event())

    def copy_in(self, dst: DeviceBuffer, dst_bytes: torch.Tensor, src: torch.Tensor) -> None:
        self.calls["copy"] += 1
        self.cpu.copy_in(dst, dst_bytes, src)
        dst.ready.record()

    def before_read(self, staging: DeviceBuffer) -> Callable[[], None] | None:
        return None  # every copy from it has completed

    def copy_staged(
        self, dst: DeviceBuffer, dst_bytes: torch.Tensor, staging: DeviceBuffer, src: torch.Tensor
    ) -> None:
        self.copy_in(dst, dst_bytes, src)
        staging.free = _Event()
        staging.free.record()

    def fill(self, dst: DeviceBuffer, read: Callable[[], Reading]) -> None:
        self.cpu.fill(dst, read)  # a CPU device's read straight into its memory

    def collective(self, dst: DeviceBuffer, src: DeviceBuffer, run: Callable[[], None]) -> None:
        self.calls["collective"] += 1
        self.cpu.collective(dst, src, run)
        dst.ready.record()
        if src.free is None:
            src.free = _Event()
        src.free.record()

    def wait(self, transfer: DeviceBuffer) -> None:
        self.calls["wait"] += 1
        self.cpu.wait(transfer)  # (a read still filling the buffer: the host waits for it)

    def release(self, transfer: DeviceBuffer) -> None:
        self.calls["release"] += 1
        if transfer.free is None:
            transfer.free = _Event()
        transfer.free.record()

    def fence(self) -> None: ...
    def settle(self) -> None: ...
    def synchronize(self) -> None: ...


def _factory(engine: Engine) -> CudaPathStreams:
    return CudaPathStreams(engine.device)


@contextlib.contextmanager
def cuda_path() -> Iterator[None]:
    """Every engine built inside runs on `CudaPathStreams` (CPU devices only; test and benchmark use)."""
    before = stream_factory(_factory)
    try:
        yield
    finally:
        stream_factory(before)
