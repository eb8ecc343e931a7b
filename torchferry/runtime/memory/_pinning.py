"""Host memory for the host store: page-aligned buffers, page-locked exactly where CUDA is used.

[Note: exact pinning]
``torch.empty(n, pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds
every request up to a power of two and keeps freed blocks cached for the process's life: with one
buffer per block, real models pinned 1.3-1.8x their size and held it after ``close()``. The store
instead takes each buffer from an anonymous ``mmap`` (page-aligned, zero-filled, untouched pages
cost nothing, and unmapping gives them back to the OS) and page-locks exactly its pages with
``cudaHostRegister``. So pinned bytes are the store's bytes rounded up to whole pages per buffer
(`policies.Tiers.store_bytes` counts them from a plan alone), and `HostMemory.close` unregisters and unmaps
every buffer. Registered memory is what ``non_blocking`` copies need to run asynchronously; the
copy engine reads it directly.

When pinning happens: while a session *prepares* (before the ranks agree that every rank could
open, see `Engine`) one probe page is registered and unregistered, so a driver or container that
refuses pinning at all is found there, and the store is pageable from the start, with one
`OffloadWarning`. Buffers filled from a checkpoint are pinned as they are read (in prepare: nothing
else holds those bytes). Buffers filled from the module are pinned in *commit*, each right after
its pack is copied in and its tensors re-pointed: pinning touches every page, and pinning them all
in prepare would hold the module's tensors and the whole store at once (twice the model); this way
the open peaks near the model plus one pack. A later refusal (the locked-memory limit reached
part-way) cannot raise in commit, which must not fail: it unpins what was pinned and continues in
pageable memory with the same one warning. Pinning is rank-local and changes no collective, so a
rank that falls back still agrees with its peers.

The CUDA calls live in one small final class, `CudaPinner`; its CPU twin `BookPinner` keeps the
same books without a device, so every line of the logic above runs in CPU tests.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import mmap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast, final

import torch

from torchferry._errors import OffloadWarning

__all__ = [
    "PAGE",
    "BookPinner",
    "CudaPinner",
    "HostMemory",
    "HostPinner",
    "page_bytes",
    "warn_pageable",
]

#: The host page size: buffers start on a page and are pinned in whole pages.
PAGE = mmap.PAGESIZE


def page_bytes(nbytes: int) -> int:
    """Bytes of host memory a buffer of ``nbytes`` occupies (and pins): whole pages, none when empty."""
    return -(-nbytes // PAGE) * PAGE


class HostPinner(abc.ABC):
    """Page-locks ranges of host memory: `register` and `unregister`, each raising on failure.

    ``memlock`` says whether what it pins is charged to ``RLIMIT_MEMLOCK`` (``mlock``-style pinning:
    the open plan then refuses pinned bytes over a finite limit, `policies.host_plan`); see [Note: the
    host budget].
    """

    #: Whether pinned bytes count against ``RLIMIT_MEMLOCK``.
    memlock: bool = True

    @abc.abstractmethod
    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` bytes at address ``ptr`` (page-aligned, whole pages)."""

    @abc.abstractmethod
    def unregister(self, ptr: int) -> None:
        """Undo the `register` that started at ``ptr``."""


@final
class CudaPinner(HostPinner):
    """``cudaHostRegister`` / ``cudaHostUnregister`` through the CUDA runtime torch uses.

    ``runtime`` (tests pass a fake) is an object with ``cudaHostRegister``, ``cudaHostUnregister`` and
    ``cudaGetLastError``; by default `cuda_runtime` builds it at the first pin, so a CUDA runtime
    that cannot load is a refused pin (the pageable fallback). The NVIDIA driver pins without
    charging ``RLIMIT_MEMLOCK`` (``memlock`` is False).
    """

    memlock = False

    def __init__(self, runtime: Any = None) -> None:
        self._cudart: Any = runtime

    def _runtime(self) -> Any:
        if self._cudart is None:
            self._cudart = cuda_runtime()
        return self._cudart

    def register(self, ptr: int, nbytes: int) -> None:
        cudart = self._runtime()
        code = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(code) != 0:
            # A refused register leaves the runtime's last error set, and the next kernel launch check
            # (torch reads cudaGetLastError after every launch) would raise it as its own failure: the
            # documented fallback to pageable memory would crash at the first kernel. Clear it now.
            cudart.cudaGetLastError()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes returned {code}")

    def unregister(self, ptr: int) -> None:
        cudart = self._runtime()
        code = cudart.cudaHostUnregister(ptr)
        if int(code) != 0:
            cudart.cudaGetLastError()
            raise RuntimeError(f"cudaHostUnregister returned {code}")


class _Runtime:
    """torch's CUDA runtime bindings, with ``cudaGetLastError`` (torch 2.11 binds none: see `last_error`)."""

    def __init__(self, binding: Any) -> None:
        self.cudaHostRegister = binding.cudaHostRegister
        self.cudaHostUnregister = binding.cudaHostUnregister
        self.cudaGetLastError = last_error(binding)


def cuda_runtime() -> Any:
    """The CUDA runtime calls `CudaPinner` makes, from ``torch.cuda.cudart()`` (which initialises CUDA)."""
    return _Runtime(torch.cuda.cudart())  # type: ignore[no-untyped-call]


def last_error(binding: Any) -> Callable[[], int]:
    """``cudaGetLastError`` of the CUDA runtime instance torch calls (it returns and clears the error).

    From torch's own bindings where they have it; else (torch 2.11 binds only a few calls) from the
    ``libcudart`` shared library already loaded into this process, the same instance torch uses;
    else (a runtime linked statically) a stand-in that clears nothing and returns -1.
    """
    bound = getattr(binding, "cudaGetLastError", None)
    if bound is not None:
        return cast("Callable[[], int]", bound)
    for path in _loaded("libcudart.so"):
        try:
            function = ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
        function.restype = ctypes.c_int
        function.argtypes = []
        return cast("Callable[[], int]", function)
    return lambda: -1


def _loaded(name: str) -> list[str]:
    """Paths of the shared libraries mapped into this process whose file name starts with ``name``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = dict.fromkeys(
        line.split(maxsplit=5)[-1] for line in maps.splitlines() if name in line and "/" in line
    )
    return [path for path in found if Path(path).name.startswith(name)]


@final
class BookPinner(HostPinner):
    """The CPU twin of `CudaPinner`: pins nothing, keeps the books (and CUDA's rules) exactly.

    Like the driver it refuses a range that overlaps one already registered and an `unregister` of
    an address nothing registered, so a CPU test sees the same misuse a GPU would.
    """

    def __init__(self) -> None:
        #: Start address -> bytes registered there.
        self.ranges: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int) -> None:
        for start, size in self.ranges.items():
            if ptr < start + size and start < ptr + nbytes:
                raise RuntimeError(f"host range at {ptr:#x} overlaps one registered at {start:#x}")
        self.ranges[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        if self.ranges.pop(ptr, None) is None:
            raise RuntimeError(f"host range at {ptr:#x} is not registered")


def warn_pageable(device: torch.device) -> None:
    """The one warning a session on a CUDA device gets for ``pin_memory=False``."""
    warnings.warn(
        f"torchferry: pin_memory=False on {device}: host weights stay in pageable memory, so every "
        "non_blocking host-to-device copy is synchronous and no transfer overlaps compute (each block "
        "waits for its own copy); leave pin_memory=True unless host memory cannot be page-locked",
        OffloadWarning,
        stacklevel=4,
    )


class _Region(mmap.mmap):
    """An anonymous mapping that unregisters its pages before they are unmapped, however it dies.

    A session dropped without ``close()`` leaves its buffers to the garbage collector (the pipeline's
    tensors may still point at them): the mapping then goes with its last tensor, and unmapping
    pages still registered with CUDA would leave the driver a registration over memory the process
    may map again for something else. ``__del__`` runs before the pages are unmapped.
    """

    pinner: HostPinner | None = None
    ptr: int = 0

    def pin(self, pinner: HostPinner, ptr: int, nbytes: int) -> None:
        pinner.register(ptr, nbytes)
        self.pinner, self.ptr = pinner, ptr

    def unpin(self) -> None:
        pinner, self.pinner = self.pinner, None
        if pinner is not None:
            pinner.unregister(self.ptr)

    def __del__(self) -> None:
        # A finaliser cannot report a failure (the process may be shutting down): best effort.
        with contextlib.suppress(Exception):
            self.unpin()


def _mapped(nbytes: int) -> tuple[torch.Tensor, _Region | None]:
    """``nbytes`` zeroed bytes at the start of a fresh anonymous mapping (whole pages), and the mapping."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8), None
    region = _Region(-1, page_bytes(nbytes))
    # The tensor keeps ``region`` alive; the pages are unmapped when its storage is freed.
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes), region


class HostMemory:
    """The host store's buffers: allocated page-aligned, pinned when asked and possible, and freed.

    ``pinner`` is ``None`` for pageable memory. Each buffer is kept here under its group's name until
    `release` (or `close`) unregisters it and drops it; a buffer dropped otherwise (the session
    was never closed) unregisters itself before its pages are unmapped (`_Region`).
    """

    def __init__(self, pinner: HostPinner | None) -> None:
        self.pinner = pinner
        # Why: group name -> its buffers and their mappings (which know whether they are registered).
        self._held: dict[str, list[tuple[torch.Tensor, _Region | None]]] = {}
        self.pinned_bytes = 0
        #: Why pinning was given up (the first failure), or ``None``.
        self.failure: str | None = None
        #: Host memory of the buffers held now and at most so far (whole pages), for reports.
        self.held_bytes = 0
        self.peak_bytes = 0
        #: The first unregister that failed while releasing (a device that died), or ``None``.
        self.release_failure: Exception | None = None

    @property
    def pinned(self) -> bool:
        """Whether every buffer is page-locked (the truth, not the request)."""
        return self.pinner is not None and self.failure is None

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held (what tensors see, without page rounding)."""
        return sum(t.numel() for held in self._held.values() for t, _ in held)

    def probe(self) -> None:
        """Register and unregister one page: a pinner that refuses outright turns pinning off now."""
        if not self.pinned:
            return
        assert self.pinner is not None
        page, region = _mapped(PAGE)
        assert region is not None
        try:
            region.pin(self.pinner, page.data_ptr(), PAGE)
        except Exception as exc:
            self._give_up(f"{type(exc).__name__}: {exc}", PAGE)
            return
        region.unpin()

    def alloc(self, name: str, nbytes: int, *, pin: bool = True) -> torch.Tensor:
        """A zeroed buffer of ``nbytes`` for pack ``name``, page-aligned, pinned if pinning holds.

        ``pin=False`` leaves the pin for `pin` (after the buffer is filled). A refused pin unpins
        every buffer and turns pinning off for good, with one `OffloadWarning`.
        """
        buffer, region = _mapped(nbytes)
        self._held.setdefault(name, []).append((buffer, region))
        self.held_bytes += page_bytes(nbytes)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        if pin:
            self.pin(name)
        return buffer

    def pin(self, name: str) -> None:
        """Page-lock pack ``name``'s buffers not yet pinned (nothing once pinning was given up)."""
        for buffer, region in self._held.get(name, []):
            if region is None or region.pinner is not None or not self.pinned:
                continue
            assert self.pinner is not None
            nbytes = buffer.numel()
            try:
                region.pin(self.pinner, buffer.data_ptr(), page_bytes(nbytes))
            except Exception as exc:
                self._give_up(f"{type(exc).__name__}: {exc}", nbytes)
                return
            self.pinned_bytes += page_bytes(nbytes)

    def _give_up(self, why: str, nbytes: int) -> None:
        self.failure = why
        for held in self._held.values():
            for buffer, region in held:
                self._unregister(buffer, region)
        warnings.warn(
            f"torchferry: could not pin a host buffer of {nbytes} bytes ({why}); the session keeps its "
            "weights in pageable host memory instead, where every host-to-device copy is synchronous "
            "(no overlap with compute). Raise the locked-memory limit (ulimit -l, or the container's "
            "memlock limit) or free host memory, or pass pin_memory=False to choose pageable memory",
            OffloadWarning,
            stacklevel=2,
        )

    def _unregister(self, buffer: torch.Tensor, region: _Region | None) -> None:
        if region is None or region.pinner is None:
            return
        self.pinned_bytes -= page_bytes(buffer.numel())
        region.unpin()

    def release(self, name: str) -> None:
        """Unregister and drop group ``name``'s buffers (their pages go back to the OS once unused).

        An unregister that fails (a device whose context died) does not stop the others: the first
        failure is kept in ``release_failure``.
        """
        for buffer, region in self._held.pop(name, ()):
            self.held_bytes -= page_bytes(buffer.numel())
            try:
                self._unregister(buffer, region)
            except Exception as exc:
                if self.release_failure is None:
                    self.release_failure = exc

    def close(self) -> None:
        """Release every buffer still held."""
        for name in list(self._held):
            self.release(name)
