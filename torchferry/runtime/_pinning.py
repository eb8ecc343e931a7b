"""Host memory for the host store: page-aligned buffers, page-locked exactly where CUDA is used.

[Note: exact pinning]
``torch.empty(n, pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds
every request up to a power of two and keeps freed blocks cached for the process's life: with one
buffer per block, real models pinned 1.3-1.8x their size and held it after ``close()``. The store
instead takes each buffer from an anonymous ``mmap`` (page-aligned, zero-filled, untouched pages
cost nothing, and unmapping gives them back to the OS) and page-locks exactly its pages with
``cudaHostRegister``. So pinned bytes are the store's bytes rounded up to whole pages per buffer
(`footprint` computes them from a plan alone), and `HostMemory.close` unregisters and unmaps
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
import mmap
import warnings
from collections.abc import Iterable
from typing import Any, final

import attrs
import torch

from torchferry._errors import OffloadWarning

__all__ = [
    "PAGE",
    "BookPinner",
    "CudaPinner",
    "Footprint",
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
    """Page-locks ranges of host memory: `register` and `unregister`, each raising on failure."""

    @abc.abstractmethod
    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` bytes at address ``ptr`` (page-aligned, whole pages)."""

    @abc.abstractmethod
    def unregister(self, ptr: int) -> None:
        """Undo the `register` that started at ``ptr``."""


@final
class CudaPinner(HostPinner):
    """``cudaHostRegister`` / ``cudaHostUnregister`` through ``torch.cuda.cudart()``."""

    def __init__(self) -> None:
        # Why: fetched at the first pin, so a CUDA runtime that cannot load is a refused pin (fallback).
        self._cudart: Any = None

    def register(self, ptr: int, nbytes: int) -> None:
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        code = self._cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes returned {code}")

    def unregister(self, ptr: int) -> None:
        code = self._cudart.cudaHostUnregister(ptr)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostUnregister returned {code}")


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


def _mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes at the start of a fresh anonymous mapping (whole pages)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    region = mmap.mmap(-1, page_bytes(nbytes))
    # The tensor keeps ``region`` alive; the pages are unmapped when its storage is freed.
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)


class HostMemory:
    """The host store's buffers: allocated page-aligned, pinned when asked and possible, and freed.

    ``pinner`` is ``None`` for pageable memory. Each buffer is kept here under its group's name until
    `release` (or `close`) unregisters it and drops it, so no buffer is unmapped while registered.
    """

    def __init__(self, pinner: HostPinner | None) -> None:
        self.pinner = pinner
        # Why: group name -> its buffers and whether each is registered; the only owner of a pin.
        self._held: dict[str, list[tuple[torch.Tensor, bool]]] = {}
        self.pinned_bytes = 0
        #: Why pinning was given up (the first failure), or ``None``.
        self.failure: str | None = None
        #: Host memory of the buffers held now and at most so far (whole pages), for reports.
        self.held_bytes = 0
        self.peak_bytes = 0

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
        page = _mapped(PAGE)
        try:
            self.pinner.register(page.data_ptr(), PAGE)
        except Exception as exc:
            self._give_up(f"{type(exc).__name__}: {exc}", PAGE)
            return
        self.pinner.unregister(page.data_ptr())

    def alloc(self, name: str, nbytes: int, *, pin: bool = True) -> torch.Tensor:
        """A zeroed buffer of ``nbytes`` for pack ``name``, page-aligned, pinned if pinning holds.

        ``pin=False`` leaves the pin for `pin` (after the buffer is filled). A refused pin unpins
        every buffer and turns pinning off for good, with one `OffloadWarning`.
        """
        buffer = _mapped(nbytes)
        self._held.setdefault(name, []).append((buffer, False))
        self.held_bytes += page_bytes(nbytes)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        if pin:
            self.pin(name)
        return buffer

    def pin(self, name: str) -> None:
        """Page-lock pack ``name``'s buffers not yet pinned (nothing once pinning was given up)."""
        held = self._held.get(name, [])
        for i, (buffer, pinned) in enumerate(held):
            if pinned or not buffer.numel() or not self.pinned:
                continue
            assert self.pinner is not None
            nbytes = buffer.numel()
            try:
                self.pinner.register(buffer.data_ptr(), page_bytes(nbytes))
            except Exception as exc:
                self._give_up(f"{type(exc).__name__}: {exc}", nbytes)
                return
            held[i] = (buffer, True)
            self.pinned_bytes += page_bytes(nbytes)

    def _give_up(self, why: str, nbytes: int) -> None:
        self.failure = why
        for held in self._held.values():
            for i, (buffer, pinned) in enumerate(held):
                if pinned:
                    self._unregister(buffer)
                    held[i] = (buffer, False)
        warnings.warn(
            f"torchferry: could not pin a host buffer of {nbytes} bytes ({why}); the session keeps its "
            "weights in pageable host memory instead, where every host-to-device copy is synchronous "
            "(no overlap with compute). Raise the locked-memory limit (ulimit -l, or the container's "
            "memlock limit) or free host memory, or pass pin_memory=False to choose pageable memory",
            OffloadWarning,
            stacklevel=2,
        )

    def _unregister(self, buffer: torch.Tensor) -> None:
        assert self.pinner is not None
        self.pinner.unregister(buffer.data_ptr())
        self.pinned_bytes -= page_bytes(buffer.numel())

    def release(self, name: str) -> None:
        """Unregister and drop group ``name``'s buffers (their pages go back to the OS once unused)."""
        for buffer, pinned in self._held.pop(name, ()):
            self.held_bytes -= page_bytes(buffer.numel())
            if pinned:
                self._unregister(buffer)

    def close(self) -> None:
        """Release every buffer still held."""
        for name in list(self._held):
            self.release(name)


@attrs.frozen(kw_only=True)
class Footprint:
    """What a host store holds: ``store_bytes`` (its buffers), ``pinned_bytes`` (whole pages of them)."""

    store_bytes: int
    pinned_bytes: int
    buffers: int

    @property
    def ratio(self) -> float:
        """Pinned bytes per store byte (1.0 when empty)."""
        return self.pinned_bytes / self.store_bytes if self.store_bytes else 1.0

    @classmethod
    def of(cls, sizes: Iterable[int]) -> Footprint:
        """The footprint of buffers of these sizes."""
        listed = [n for n in sizes if n]
        return cls(store_bytes=sum(listed), pinned_bytes=sum(map(page_bytes, listed)), buffers=len(listed))
