"""What one read of a pack is: the chunks each ``preadv`` reads (contiguous in one file, at most a
limit each) and the fixups that follow them (buffers no file holds, tensors stored with other strides).
`FileReader.plan` makes them; its threads carry them out."""

from __future__ import annotations

import os
from collections.abc import Sequence

import attrs
import torch

from torchferry.runtime.files._spans import FileSpan
from torchferry.runtime.memory import Piece

__all__ = ["Chunk", "Fixup", "PackRead", "chunked"]

#: The most parts one ``preadv`` scatters into.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@attrs.frozen
class Chunk:
    """Bytes contiguous in one file, read by one ``preadv``: from file offset ``offset``, each part
    ``(dst, length)`` in turn lands at ``dst`` of the destination; ``names`` are its tensors'."""

    file: str
    offset: int
    parts: tuple[tuple[int, int], ...]
    names: tuple[str, ...]

    @property
    def length(self) -> int:
        return sum(n for _, n in self.parts)


@attrs.frozen(eq=False)
class Fixup:
    """Bytes ``[lo, hi)`` of a piece placed at ``dst`` that a chunk did not leave right: a
    non-persistent buffer's bytes from ``source`` (kept at open); a tensor the module stores with
    other strides, read row-major into its place and rearranged there (``in_place``), or, for a
    shard's part of one, read whole from ``(file, src)`` aside and arranged."""

    dst: int
    lo: int
    hi: int
    piece: Piece
    name: str
    source: torch.Tensor | None = None
    file: str | None = None
    src: int = 0
    #: The piece's row-major bytes were read into its place: rearrange them there.
    in_place: bool = False


@attrs.frozen(eq=False)
class PackRead:
    """How pack ``name`` is read: ``nbytes`` destination bytes (the pack, or this rank's shard), its
    chunks, and the fixups that follow them."""

    name: str
    nbytes: int
    chunks: tuple[Chunk, ...]
    fixups: tuple[Fixup, ...] = ()

    @property
    def file_bytes(self) -> int:
        return sum(c.length for c in self.chunks)


def chunked(file: str, spans: Sequence[FileSpan], limit: int) -> list[Chunk]:
    """``spans`` of one file, in file order, as chunks: contiguous in the file, at most ``limit``
    bytes and `_IOV_MAX` parts each (a tensor larger than ``limit`` spans several chunks)."""
    chunks: list[Chunk] = []
    parts: list[tuple[int, int]] = []
    names: list[str] = []
    offset = cursor = 0
    size = 0

    def flush() -> None:
        nonlocal parts, names, size
        if parts:
            named = tuple(dict.fromkeys(names))
            chunks.append(Chunk(file=file, offset=offset, parts=tuple(parts), names=named))
        parts, names, size = [], [], 0

    for span in spans:
        src, dst, left = span.src, span.dst, span.length
        if parts and src != cursor:
            flush()
        while left:
            if not parts:
                offset = src
            take = min(left, limit - size)
            parts.append((dst, take))
            names.append(span.name)
            size += take
            src, dst, left = src + take, dst + take, left - take
            cursor = src
            if size >= limit or len(parts) >= _IOV_MAX:
                flush()
    flush()
    return chunks
