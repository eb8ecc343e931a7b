"""Filling the host buffers: which tensors a plan packs together, each pack's layout and size, and
its bytes, from the module's own tensors or from a checkpoint (see [Note: filling from a checkpoint]
in `torchferry.runtime.store._store` for when each happens).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from torchferry.policies import group_specs
from torchferry.runtime.memory import (
    Piece,
    contiguous_strides,
    dense_strides,
)
from torchferry.topology import TensorSpec, packed_nbytes
from torchferry.topology import pack as pack_specs

if TYPE_CHECKING:
    from torchferry.runtime.files import CheckpointReader

__all__ = [
    "fill_from_module",
    "group_specs",
    "in_pack_order",
    "make_ordinary",
    "materialise",
    "pack_layout",
    "read_loose",
    "read_pack",
    "swappable",
]


def in_pack_order(
    specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor | None]
) -> Iterator[torch.Tensor]:
    """The live tensors of a pack (``tensors``, in ``specs`` order) in `pack` order."""
    live = {s.name: t for s, t in zip(specs, tensors, strict=True)}
    for spec, _ in pack_specs(specs):
        t = live[spec.name]
        assert t is not None
        yield t


def pack_layout(
    specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor | None]
) -> tuple[tuple[Piece, ...], int]:
    """The pieces of a pack in `pack` order (strides from the live tensors) and its byte count."""
    live = {s.name: t for s, t in zip(specs, tensors, strict=True)}
    pieces: list[Piece] = []
    for spec, offset in pack_specs(specs):
        t = live[spec.name]
        assert t is not None
        if spec.compute_dtype is None:
            pieces.append(Piece(offset, spec.nbytes, t.dtype, tuple(t.shape), dense_strides(t)))
        else:  # stored in another dtype than the module's, which close gives back
            stored = getattr(torch, spec.dtype)
            pieces.append(Piece(offset, spec.nbytes, stored, tuple(t.shape), dense_strides(t), given=t.dtype))
    return tuple(pieces), packed_nbytes(pack_specs(specs))


def fill_from_module(
    tensors: Sequence[torch.Tensor],
    pieces: Sequence[Piece],
    nbytes: int,
    span: tuple[int, int] | None,
    host: torch.Tensor,
) -> None:
    """Fill the pack's zeroed host buffer from the module's own tensors (only the span when sharded)."""
    start, end = span if span is not None else (0, nbytes)
    packed = host if span is None else torch.zeros(nbytes, dtype=torch.uint8)
    with torch.no_grad():
        for t, p in zip(tensors, pieces, strict=True):
            p.view(packed).copy_(t.data)
    if span is not None:
        stop = max(start, min(end, nbytes))
        host[: stop - start].copy_(packed[start:stop])
        host[stop - start :].zero_()


def read_pack(
    reader: CheckpointReader,
    specs: Sequence[TensorSpec],
    pieces: Sequence[Piece],
    tensors: Sequence[torch.Tensor | None],
    span: tuple[int, int] | None,
    *,
    host: torch.Tensor,
) -> None:
    """Fill the pack's host buffer (or this rank's span of it) from the checkpoint.

    Checkpoint bytes are row-major; pieces stored with other strides are rearranged, and the bytes of
    non-persistent buffers come from the module (see [Note: filling from a checkpoint] in
    `torchferry.runtime.store._store`).
    """
    layout = pack_specs(specs)
    nbytes = packed_nbytes(layout)
    start, end = span if span is not None else (0, nbytes)
    reader.read_into(layout, host, start, end)
    live = {s.name: t for s, t in zip(specs, tensors, strict=True)}
    for (spec, offset), piece in zip(layout, pieces, strict=True):
        lo, hi = max(offset, start), min(offset + spec.nbytes, end)
        if lo >= hi:
            continue
        source: torch.Tensor
        if spec.buffer and not spec.persistent:
            t = live[spec.name]
            assert t is not None
            source = t.detach()
        elif spec.compute_dtype is not None:
            source = reader.read_tensor(spec.name)  # stored in another dtype: converted into the piece
        elif piece.row_major:
            continue
        elif (lo, hi) == (offset, offset + spec.nbytes):
            source = host[lo - start : hi - start].clone().view(piece.dtype).view(piece.shape)
        else:
            source = reader.read_tensor(spec.name)
        arranged = piece.arranged(source)
        host[lo - start : hi - start].copy_(arranged[lo - offset : hi - offset])


def read_loose(reader: CheckpointReader, spec: TensorSpec, live: torch.Tensor | None) -> torch.Tensor | None:
    """A fresh CPU tensor for an on-demand component's tensor, from the checkpoint, in its strides."""
    if live is None or (spec.buffer and not spec.persistent):
        return None
    value = reader.read_tensor(spec.name)
    strides = dense_strides(live)
    if strides == contiguous_strides(value.shape):
        return value
    out = torch.empty_strided(tuple(live.shape), strides, dtype=value.dtype)
    out.copy_(value)
    return out


def materialise(t: torch.Tensor) -> None:
    """Turn meta tensor ``t`` into an empty CPU tensor in place (same object, so ties survive; its class
    and attributes too, such as a ``GGUFParameter``'s ``quant_type``)."""
    fresh = torch.empty(0, dtype=t.dtype)
    if isinstance(t, nn.Parameter):
        fresh = nn.Parameter(fresh, requires_grad=t.requires_grad)
    cls = type(t)
    torch.utils.swap_tensors(t, fresh)  # type: ignore[no-untyped-call]
    t.__class__, fresh.__class__ = cls, type(t)
    t.__dict__, fresh.__dict__ = fresh.__dict__, t.__dict__


def swappable(t: torch.Tensor) -> bool:
    """Whether `make_ordinary` can swap ``t`` in place: no weak reference to it, and no other owner of
    its tensor than its Python object and, for a leaf, its gradient accumulator (what
    `torch.utils.swap_tensors` checks before it swaps)."""
    if weakref.getweakrefs(t):
        return False
    count: Callable[[], int] = t._use_count  # type: ignore[attr-defined]
    if count() == 1:
        return True
    if count() != 2 or not t.is_leaf or not t.requires_grad:
        return False
    try:
        node = torch.autograd.graph.get_gradient_edge(t).node
    except (AttributeError, RuntimeError):  # an inference tensor has no gradient edge to find
        return False
    return node is not None and count() == 2


def make_ordinary(t: torch.Tensor) -> None:
    """Turn inference tensor ``t`` into an empty ordinary CPU tensor in place, keeping the Python object
    (its identity, class and attributes: ties and references hold); `Prepared.commit` points it at its
    host view next. See [Note: inference tensors] in `torchferry.runtime.store._store`."""
    fresh = torch.empty(0, dtype=t.dtype)
    if isinstance(t, nn.Parameter):
        fresh = nn.Parameter(fresh, requires_grad=t.requires_grad)
    cls = type(t)
    torch.utils.swap_tensors(t, fresh)  # type: ignore[no-untyped-call]
    # swap_tensors swaps the classes and attributes too: give the object its own back.
    t.__class__, fresh.__class__ = cls, type(t)
    t.__dict__, fresh.__dict__ = fresh.__dict__, t.__dict__
