"""Tensors given back as they were: alias objects moved with their owner, storage layouts restored.

[Note: as it was]
A pack stores each tensor once, in dense strides, at its own offset of the pack's buffer. Three
things a module may have that this layout does not keep are handled here:

1. *Alias objects*: two `Parameter` objects over the same bytes (``b = nn.Parameter(a.data)``) are
   one `TensorSpec` with aliases (discovery groups them by storage and view). Only the owner is
   looked up by name, so `aliased` adds every other object of the same view to the pack, on a copy
   of the owner's piece: each re-point moves them together, and they keep reading the same bytes.
2. *Non-dense strides* (a slice ``w[:, ::2]``, whose elements have gaps) are stored contiguously.
3. *Shared storage*: tensors that are disjoint views of one storage (``base[:64].view(8, 8)`` and
   ``base[64:].view(8, 8)``), or that start at an offset of a larger storage.

`Layouts.take` records, before the pack takes the tensors over, each storage whose layout a pack
would not give back (its size, and every tensor's offset, shape and strides on it); ordinary
tensors (one object, offset 0, dense, the whole storage) record nothing and cost nothing. Meta
tensors (a pipeline built under `meta_parameters`, filled from a checkpoint) are grouped by their
storage object, so aliases made on the meta device share one CPU storage after close. When the
last pack holding one of its tensors gives its tensors back (`Layouts.given_back`), one storage of
the recorded size is allocated again and every tensor is set onto it with its recorded offset and
strides and its bit-identical values: aliases share bytes again, views share one storage again.
Bytes of the storage that no managed tensor covers were never copied to the host store and come
back as zeros.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch

from torchferry.topology import TensorSpec, find_attr

__all__ = ["Layouts", "aliased", "dense", "shared_elsewhere"]

_P = TypeVar("_P")


def aliased(
    pipeline: Any, specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor], pieces: Sequence[_P]
) -> tuple[list[torch.Tensor], list[_P]]:
    """``tensors`` and ``pieces`` (one per spec, in order) with every alias object of a spec added.

    ``specs`` are in the order of ``tensors``. An alias name that resolves to the owner's own object
    (a tied weight) adds nothing; another object on the same view is appended with the owner's piece.
    """
    out_tensors, out_pieces = list(tensors), list(pieces)
    seen = {id(t) for t in tensors}
    for spec, owner, piece in zip(specs, tensors, pieces, strict=True):
        for name in spec.aliases:
            try:
                other = find_attr(pipeline, name)
            except AttributeError:
                continue
            if not isinstance(other, torch.Tensor) or id(other) in seen or not _same_storage(other, owner):
                continue
            seen.add(id(other))
            out_tensors.append(other)
            out_pieces.append(piece)
    return out_tensors, out_pieces


#: torch's count of the references to a storage (its tensors and Python storage objects); private.
_USE_COUNT: Any = getattr(torch._C, "_storage_Use_Count", None)


def shared_elsewhere(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names (one per storage) of tensors in ``named`` whose storage another tensor also holds.

    ``named`` is every tensor object a session is about to take over. A view or alias of one taken
    before opening (``w[0]``, ``w.t()``, ``state_dict()`` kept from before, the tensor a parameter
    was made from), by the caller or cached by a module, would silently stop sharing its memory once
    the weight is re-pointed at the session's host buffer (see [Note: as it was]). Each tensor holds
    one reference to its storage, so a storage with more references than the taken-over tensors on
    it (and the base a registered view was made from: ``torch.arange(6).reshape(2, 3)`` keeps its
    ``_base``) is a suspect, at no cost for the others. A suspect is reported when a Python tensor
    object the session does not take over is found on it among every object the garbage collector
    tracks (after one collection, so a view kept only by a cycle is not one); references held by
    C++ alone (what autograd saved of a forward run with grad) read the weight's memory as it was
    and are left alone.
    """
    if _USE_COUNT is None:
        return []
    found: dict[int, tuple[torch.UntypedStorage, set[int], str]] = {}
    for name, t in named:
        if t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        entry = found.setdefault(storage._cdata, (storage, set(), name))
        entry[1].add(id(t))
        base = t._base
        if base is not None:
            entry[1].add(id(base))

    def suspects() -> dict[int, str]:
        return {key: name for key, (s, ids, name) in found.items() if _USE_COUNT(s._cdata) - 1 > len(ids)}

    suspected = suspects()
    if not suspected:
        return []
    import gc

    gc.collect()
    suspected = suspects()
    if not suspected:
        return []
    taken = {i for _, ids, _ in found.values() for i in ids}
    shared: dict[int, str] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and id(obj) not in taken:  # type(): no __class__ lookups
            key = _storage_of(obj)
            if key in suspected:
                shared[key] = suspected[key]
    return list(shared.values())


def _storage_of(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage object (``_cdata``) for a plain CPU tensor, else ``None``."""
    try:
        if t.device.type != "cpu" or t.is_meta:
            return None
        return int(t.untyped_storage()._cdata)
    except Exception:  # a wrapper subclass, a fake tensor: no storage of its own to share
        return None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view one storage (meta tensors have no address: compare the storage object)."""
    if a.is_meta or b.is_meta:
        return a.is_meta and b.is_meta and a.untyped_storage()._cdata == b.untyped_storage()._cdata
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


@attrs.define(slots=True, eq=False)
class _Storage:
    """One storage to rebuild: its size, the tensors on it, and the packs still holding any of them."""

    nbytes: int
    tensors: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]]
    packs: set[str]


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t`` alone is its whole storage, dense and at offset 0 (a pack gives that back as is)."""
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return False
    return dense(t)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a gap-free range of memory, its dimensions in any order."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class Layouts:
    """Storage layouts to restore when packs give their tensors back (see [Note: as it was])."""

    def __init__(self) -> None:
        # Why: pack name -> the storages that wait for it, so each give-back touches only its own.
        self._waiting: dict[str, list[_Storage]] = {}

    @classmethod
    def take(cls, packs: Mapping[str, Iterable[torch.Tensor]]) -> Layouts:
        """Record the layouts that ``packs`` (name -> its tensors, still on their own storage) would lose."""
        by_storage: dict[tuple[str, int], tuple[_Storage, set[int]]] = {}
        for name, tensors in packs.items():
            for t in tensors:
                if t.device.type not in ("cpu", "meta") or t.untyped_storage().nbytes() == 0:
                    continue
                storage_ = t.untyped_storage()
                key = ("meta", storage_._cdata) if t.is_meta else ("cpu", storage_.data_ptr())
                entry = by_storage.get(key)
                if entry is None:
                    entry = (_Storage(nbytes=t.untyped_storage().nbytes(), tensors=[], packs=set()), set())
                    by_storage[key] = entry
                storage, ids = entry
                if id(t) in ids:
                    continue
                ids.add(id(t))
                storage.tensors.append((t, int(t.storage_offset()), tuple(t.shape), tuple(t.stride())))
                storage.packs.add(name)
        layouts = cls()
        for storage, _ in by_storage.values():
            if len(storage.tensors) == 1 and _plain(storage.tensors[0][0]):
                continue
            for name in storage.packs:
                layouts._waiting.setdefault(name, []).append(storage)
        return layouts

    @property
    def pending(self) -> int:
        """Storages still waiting for a pack to give its tensors back."""
        return len({id(s) for group in self._waiting.values() for s in group})

    def given_back(self, pack: str) -> None:
        """Pack ``pack`` gave its tensors storage of their own: rebuild each storage no pack holds now."""
        for storage in self._waiting.pop(pack, ()):
            storage.packs.discard(pack)
            if not storage.packs:
                _rebuild(storage)


def _rebuild(storage: _Storage) -> None:
    """One fresh storage of the recorded size, every tensor set onto it with its values and layout."""
    fresh = torch.zeros(storage.nbytes, dtype=torch.uint8).untyped_storage()
    with torch.no_grad():
        for t, offset, shape, stride in storage.tensors:
            view = torch.empty(0, dtype=t.dtype).set_(fresh, offset, shape, stride)
            if _overlapping(shape, stride):
                _scatter(view, t.data, offset)
            else:
                view.copy_(t.data)
            t.data = view


def _overlapping(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of a tensor of ``shape`` and ``stride`` may share a memory location
    (an ``expand``-ed buffer, stride 0): ``copy_`` refuses to write such a tensor."""
    extent = 1
    for s, n in sorted((s, n) for s, n in zip(stride, shape, strict=True) if n != 1):
        if s < extent:
            return True
        extent = s * (n - 1) + extent
    return False


def _scatter(view: torch.Tensor, values: torch.Tensor, offset: int) -> None:
    """Write ``values`` into ``view``, whose elements overlap, one memory location at a time."""
    index = torch.full((), offset, dtype=torch.int64)
    for dim, (n, s) in enumerate(zip(view.shape, view.stride(), strict=True)):
        shape = [1] * view.dim()
        shape[dim] = n
        index = index + (torch.arange(n, dtype=torch.int64) * s).view(shape)
    size = view.untyped_storage().nbytes() // view.element_size()
    flat = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage(), 0, (size,), (1,))
    flat[index.reshape(-1)] = values.reshape(-1).to(view.dtype)
