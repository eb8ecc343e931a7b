"""Every tensor of a discovered pipeline and its one owner: walked, checked, grouped by storage.

A tensor reachable under several names (tied weights, a block that also sits in the remainder) is
one `TensorSpec` whose owner is the earliest component, its remainder before its children before its
blocks, with the other names as aliases; distinct views of overlapping bytes are refused. This is
the code that reads tensors (dtype, shape, storage), so discovery works on meta tensors too.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch
from torch import nn

from torchferry._errors import PlanError
from torchferry.topology._blocks import Skeleton
from torchferry.topology._layers import castable_ids, dequantized_weights
from torchferry.topology._model import (
    DTYPE_SIZES,
    Block,
    Component,
    Dequantized,
    Stack,
    TensorSpec,
    join_path,
)
from torchferry.topology._wrapped import inner_tensors

__all__ = ["build_components"]


@attrs.frozen
class _Occurrence:
    """One qualified name under which a tensor is reachable, and which part of the tree holds it."""

    rank: tuple[int, int, int]  # (component index, 0 remainder | 1 child | 2 block, sequence)
    owner: str  # "" for the remainder, else the child or block path
    component: int
    name: str
    tensor: torch.Tensor = attrs.field(eq=False)
    buffer: bool
    persistent: bool


_Found = tuple[str, torch.Tensor, bool, bool]


def _walk(module: nn.Module, prefix: str, stop: frozenset[int]) -> Iterator[_Found]:
    """``(name, tensor, is_buffer, persistent)`` for every tensor under ``module``, skipping ``stop``."""
    active: set[int] = set()

    def visit(mod: nn.Module, pre: str) -> Iterator[_Found]:
        active.add(id(mod))
        for name, param in mod._parameters.items():
            if param is not None:
                yield join_path(pre, name), param, False, True
        non_persistent = mod._non_persistent_buffers_set
        for name, buf in mod._buffers.items():
            if buf is not None:
                yield join_path(pre, name), buf, True, name not in non_persistent
        for name, child in mod._modules.items():
            if child is None or id(child) in stop or id(child) in active:
                continue
            yield from visit(child, join_path(pre, name))
        active.discard(id(mod))

    yield from visit(module, prefix)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` of ``t`` within its storage."""
    size = int(t.element_size())
    start = int(t.storage_offset()) * size
    if t.numel() == 0:
        return start, start
    span = 1 + sum((int(d) - 1) * int(s) for d, s in zip(t.shape, t.stride(), strict=True))
    return start, start + span * size


def _storage_key(t: torch.Tensor) -> tuple[object, ...]:
    storage = t.untyped_storage()
    if storage.nbytes() == 0 and t.device.type != "meta":
        return ("tensor", id(t))
    if t.device.type == "meta":
        return ("meta", storage._cdata)
    return (str(t.device), storage.data_ptr())


def _assign_owners(occurrences: list[_Occurrence]) -> dict[int, list[tuple[_Occurrence, tuple[str, ...]]]]:
    """Group occurrences of one tensor, pick its one owner, reject overlapping distinct views.

    Returns, per component index, the owning occurrences with their aliases. The owner is the
    occurrence with the lowest rank: the earliest component, then its remainder before its
    children before its blocks (a weight the remainder also uses must not be evicted with a block).
    """
    by_storage: dict[tuple[object, ...], dict[tuple[object, ...], list[_Occurrence]]] = {}
    for occ in occurrences:
        t = occ.tensor
        view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        by_storage.setdefault(_storage_key(t), {}).setdefault(view, []).append(occ)

    owned: dict[int, list[tuple[_Occurrence, tuple[str, ...]]]] = {}
    for views in by_storage.values():
        if len(views) > 1:
            spans = sorted(
                ((*_extent(group[0].tensor), group[0].name) for group in views.values()),
                key=lambda s: (s[0], s[1], s[2]),
            )
            reach, reach_name = -1, ""
            for start, end, name in spans:
                if start < end:
                    if start < reach:
                        raise PlanError(
                            f"Tensors {reach_name!r} and {name!r} are different views of overlapping "
                            "bytes of one storage; torchferry moves whole tensors, so give each "
                            "parameter and buffer its own storage (clone one of them) or tie them as "
                            "the same tensor"
                        )
                    if end > reach:
                        reach, reach_name = end, name
        for group in views.values():
            owner = min(group, key=lambda o: o.rank)
            aliases: list[str] = []
            for occ in sorted(group, key=lambda o: o.rank):
                if occ.name != owner.name and occ.name not in aliases:
                    aliases.append(occ.name)
            owned.setdefault(owner.component, []).append((owner, tuple(aliases)))
    for entries in owned.values():
        entries.sort(key=lambda e: e[0].rank)
    return owned


def _spec(
    occ: _Occurrence, aliases: tuple[str, ...], castable: set[int], dequantized: dict[int, Dequantized]
) -> TensorSpec:
    dtype = _dtype_name(occ.tensor.dtype)
    if dtype not in DTYPE_SIZES:
        known = ", ".join(sorted(DTYPE_SIZES))
        raise PlanError(
            f"Tensor {occ.name!r} has dtype {dtype}, which torchferry cannot stream; "
            f"convert it to one of {known}"
        )
    return TensorSpec(
        name=occ.name,
        shape=tuple(occ.tensor.shape),
        dtype=dtype,
        buffer=occ.buffer,
        persistent=occ.persistent,
        aliases=aliases,
        castable=id(occ.tensor) in castable,
        dequantized=dequantized.get(id(occ.tensor)),
    )


def _has_lifecycle(module: nn.Module) -> bool:
    return all(callable(getattr(module, name, None)) for name in ("load_to_device", "offload_to_cpu"))


def _occurrences(skeletons: list[Skeleton], component_ids: frozenset[int]) -> list[_Occurrence]:
    occurrences: list[_Occurrence] = []
    seq = 0

    def add(
        index: int, category: int, owner: str, root: nn.Module, *, prefix: str, stop: frozenset[int]
    ) -> None:
        nonlocal seq
        for found, whole, buffer, persistent in _walk(root, prefix, stop):
            for name, tensor in inner_tensors(found, whole):  # a wrapper's inner tensors (see _wrapped)
                occurrences.append(
                    _Occurrence(
                        rank=(index, category, seq),
                        owner=owner,
                        component=index,
                        name=name,
                        tensor=tensor,
                        buffer=buffer,
                        persistent=persistent,
                    )
                )
                seq += 1

    for index, sk in enumerate(skeletons):
        others = component_ids - {id(sk.module)}
        parts = [sk, *sk.children]
        cut = frozenset(
            [id(b) for part in parts for _, blocks in part.stacks for _, b in blocks]
            + [id(c.module) for c in sk.children]
        )
        add(index, 0, "", sk.module, prefix=sk.path, stop=cut | others)
        for child in sk.children:
            stop = (cut - {id(child.module)}) | others
            add(index, 1, child.path, child.module, prefix=child.path, stop=stop)
        for part in parts:
            for _, blocks in part.stacks:
                for block_path, block in blocks:
                    add(index, 2, block_path, block, prefix=block_path, stop=(cut - {id(block)}) | others)
    return occurrences


def _build(sk: Skeleton, owned: list[tuple[_Occurrence, tuple[str, ...]]]) -> Component:
    by_owner: dict[str, list[TensorSpec]] = {}
    castable = castable_ids(sk.module)
    dequantized = dequantized_weights(sk.module)
    for occ, aliases in owned:
        by_owner.setdefault(occ.owner, []).append(_spec(occ, aliases, castable, dequantized))

    def component(part: Skeleton, remainder_key: str, children: tuple[Component, ...]) -> Component:
        return Component(
            path=part.path,
            kind=part.kind,
            class_name=type(part.module).__name__,
            tensors=by_owner.get(remainder_key, ()),
            stacks=[
                Stack(attrs=a, blocks=[Block(path=p, tensors=by_owner.get(p, ())) for p, _ in blocks])
                for a, blocks in part.stacks
            ],
            children=children,
            has_lifecycle=_has_lifecycle(part.module),
            stub=part.stub,
            problems=part.problems,
        )

    children = tuple(component(c, c.path, ()) for c in sk.children)
    return component(sk, "", children)


def build_components(skeletons: list[Skeleton], component_ids: frozenset[int]) -> list[Component]:
    """The components of ``skeletons``, in order, each tensor under them given exactly one owner.

    ``component_ids`` are the ids of every component's module: a walk stops at another component.
    """
    owned = _assign_owners(_occurrences(skeletons, component_ids))
    return [_build(sk, owned.get(i, [])) for i, sk in enumerate(skeletons)]
