"""The records the session guard keeps of managed tensors (`Record`), and what it asks of them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import torch

from torchferry.runtime.device import DeviceBuffer
from torchferry.runtime.memory import Pack

__all__ = [
    "Record",
    "address_ranges",
    "offsets_of",
    "pointer",
    "shard_of",
    "under",
    "under_any",
    "write_back",
]


@attrs.define(slots=True, eq=False)
class Record:
    """One managed tensor, its pack, and where it lives in the module tree."""

    name: str
    tensor: torch.Tensor
    pack: Pack
    index: int
    #: (a module's ``_parameters`` or ``_buffers`` table, key) for each name the tensor has.
    places: tuple[tuple[dict[str, Any], str], ...]
    #: The object those tables hold: the tensor, or the wrapper tensor it is an inner tensor of.
    holder: torch.Tensor


def under(path: str, roots: list[str]) -> bool:
    """Whether module ``path`` is one of ``roots`` or inside one."""
    return any(path == r or path.startswith(r + ".") for r in roots)


def under_any(component: Any, paths: list[str]) -> bool:
    """Whether any of ``paths`` is inside the component (it streams some of its blocks)."""
    return any(under(p, [component.path]) for p in paths)


def pointer(t: torch.Tensor) -> int:
    return int(t.data_ptr())  # 0 on the meta device


def offsets_of(pack: Pack) -> list[int | None]:
    base = 0 if pack.bound is None else int(pack.bound.data_ptr())
    return [pointer(t) - base if pointer(t) else None for t in pack.tensors]


def write_back(r: Record) -> bool:
    """Copy ``r``'s tensor into its host copy when it points elsewhere (a device copy, or the object
    a ``.data =`` gave it); whether it copied."""
    host = r.pack.host_views[r.index]
    if pointer(r.tensor) == pointer(host) or r.tensor.is_meta:  # meta (a test device) holds no bytes
        return False
    with torch.no_grad():
        host.copy_(r.tensor.detach())
    return True


def shard_of(pack: Pack) -> torch.Tensor:
    """Bytes of this rank's shard to send for a gather a failed step owes (a file-tier pack has none
    at hand: zeros of its size, as the results are dropped)."""
    return torch.zeros(pack.held_bytes, dtype=torch.uint8) if pack.in_file else pack.host


def address_ranges(buffers: Iterable[DeviceBuffer]) -> list[tuple[int, int]]:
    """Where each buffer's memory starts and ends (past its last byte)."""
    return [(pointer(b.data), pointer(b.data) + b.data.numel() * b.data.element_size()) for b in buffers]
