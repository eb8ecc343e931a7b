"""Where a packed buffer's bytes are in the checkpoint's files: `FileSpan` runs, and the merging of
runs that are contiguous in both the file and the buffer into one copy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeAlias

import attrs
import torch

__all__ = ["FileSpan", "Source", "merge_runs"]

#: A copy's source: a file, bytes already in memory (a widened tensor), or ``None`` (keep the bytes).
Source: TypeAlias = "str | torch.Tensor | None"


@attrs.frozen
class FileSpan:
    """Where the bytes ``[dst, dst + length)`` of a packed buffer are: file ``file`` at offset ``src``
    (``None``: a non-persistent buffer, whose bytes come from the module, a tensor the caller converts,
    or bytes in memory, ``source``); ``name`` is the tensor's."""

    name: str
    file: str | None
    src: int
    dst: int
    length: int
    #: The bytes in memory when they are not the file's (a 16-bit float widened to float32): ``src``
    #: is then an offset into them.
    source: torch.Tensor | None = attrs.field(default=None, eq=False)


def merge_runs(
    segments: list[tuple[Source, int, int, int]],
) -> Iterator[tuple[Source, int, int, int]]:
    """Join copies that are contiguous in both the file and the destination into one."""
    current: tuple[Source, int, int, int] | None = None
    for seg in segments:
        if (
            current is not None
            and isinstance(seg[0], str)
            and seg[0] == current[0]
            and seg[1] == current[1] + current[3]
            and (seg[2] == current[2] + current[3])
        ):
            current = (current[0], current[1], current[2], current[3] + seg[3])
            continue
        if current is not None:
            yield current
        current = seg
    if current is not None:
        yield current
