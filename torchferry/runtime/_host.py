"""The host store: every weight the runtime moves lives in one flat byte buffer per block.

A *group* is the set of tensors that always move together: one block, one component's non-block
remainder, or what is left of a component that the plan does not split. Each group owns one flat
``uint8`` buffer laid out by `topology.pack` (itemsize descending, so every offset is aligned and the
buffer is exactly the topology's byte count), and the module's parameters and buffers are re-pointed
(``tensor.data = view``) at views into it. Re-pointing keeps each tensor object, so tied weights (one
object under several names) stay tied. A tensor whose elements are dense in memory keeps its strides
(a transposed weight stays transposed); one with gaps is stored contiguously.

Host buffers are filled once when a session opens and are never written or freed while it lives: a
device copy can always be dropped, and no failure can lose a weight. `HostStore.close` gives every
tensor ordinary storage of its own again.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch

from torchferry._errors import PlanError
from torchferry.policies import rest_unit
from torchferry.topology import Component, Plan, TensorSpec, pack

__all__ = ["HOST", "READY", "STAGED_IN", "Group", "HostStore", "Unit", "find_attr"]

#: Where a group's tensors point: host memory, device memory not yet waited for, device memory ready.
HOST, STAGED_IN, READY = 0, 1, 2


def find_attr(root: Any, dotted: str) -> Any:
    """The object at ``dotted`` (``transformer.blocks.3``) under ``root``; ``""`` is ``root`` itself."""
    return functools.reduce(getattr, dotted.split("."), root) if dotted else root


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides if its elements fill a gap-free range of memory, else contiguous strides."""
    contiguous: list[int] = []
    expected = 1
    for size in reversed(t.shape):
        contiguous.insert(0, expected)
        expected *= size
    if t.is_contiguous():
        return tuple(contiguous)
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return tuple(contiguous)
        expected *= size
    return tuple(t.stride())


@attrs.define(slots=True, frozen=True)
class Piece:
    """Where one tensor sits in its group's flat buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor's view into ``flat`` (a ``uint8`` buffer laid out like its group)."""
        return flat.narrow(0, self.offset, self.nbytes).view(self.dtype).as_strided(self.shape, self.stride)


@attrs.define(slots=True, eq=False)
class Group:
    """Tensors that move together, their host buffer, and where they point now.

    ``where`` is `HOST`, `STAGED_IN` or `READY`; ``device_views`` caches, per slot name, the byte range
    and tensor views into the slot's buffer last used, so a repeated load into a slot builds nothing.
    """

    name: str
    tensors: tuple[torch.Tensor, ...]
    pieces: tuple[Piece, ...]
    nbytes: int
    host: torch.Tensor
    host_views: tuple[torch.Tensor, ...]
    where: int = HOST
    device_views: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]] = attrs.field(
        factory=dict
    )

    def views(self, key: str, flat: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The group's bytes of ``flat`` and its tensors' views, cached per ``key`` while ``flat`` stays."""
        cached = self.device_views.get(key)
        if cached is not None and cached[0] is flat:
            return cached[1], cached[2]
        dst = flat.narrow(0, 0, self.nbytes)
        views = tuple(p.view(flat) for p in self.pieces)
        self.device_views[key] = (flat, dst, views)
        return dst, views

    def point(self, views: Sequence[torch.Tensor]) -> None:
        """Re-point every tensor of the group at ``views``."""
        for t, v in zip(self.tensors, views, strict=True):
            t.data = v

    def to_host(self) -> None:
        """Point the group back at its host buffer (nothing is copied: host bytes are the truth)."""
        if self.where != HOST:
            self.point(self.host_views)
            self.where = HOST


@attrs.define(slots=True, eq=False)
class Unit:
    """A schedule's unit: a block, ``<component>:rest`` or a whole component, and its groups."""

    name: str
    groups: tuple[Group, ...]
    component: str
    module: Any = None

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


def _subtree(component: Component) -> Iterator[Component]:
    yield from component.walk()


class HostStore:
    """The host buffers of one session, the units that name them, and the live tensors they back."""

    def __init__(self, groups: dict[str, Group], units: dict[str, Unit], pinned: bool) -> None:
        self.groups = groups
        self.units = units
        self.pinned = pinned

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the store holds."""
        return sum(g.nbytes for g in self.groups.values())

    @classmethod
    def build(cls, pipeline: Any, plan: Plan, *, pin: bool) -> HostStore:
        """Lay out, check and fill the host buffers for ``plan``; raises `PlanError` before mutating."""
        specs = _group_specs(plan)
        lookup = _Lookup(pipeline)
        resolved = {name: [lookup.tensor(s) for s in group] for name, group in specs.items()}
        problems = [p for name, group in specs.items() for p in _check(group, resolved[name])]
        if problems:
            raise PlanError(
                "torchferry.offload cannot take over this pipeline:\n  "
                + "\n  ".join(problems[:8])
                + ("\n  ..." if len(problems) > 8 else "")
                + f"\nThe {plan.strategy} plan keeps every weight in host memory and moves it itself: "
                "build or load the pipeline on the CPU (or call pipeline.to('cpu')) before "
                "torchferry.offload(...), and let the session place it on the device."
            )
        groups: dict[str, Group] = {}
        for name, group in specs.items():
            groups[name] = _fill(name, group, resolved[name], pin=pin)
        units = _units(plan, groups, pipeline)
        return cls(groups, units, pin)

    def reset(self) -> None:
        """Point every tensor back at host memory (error recovery; host bytes are never lost)."""
        for group in self.groups.values():
            group.to_host()
            group.device_views.clear()

    def close(self) -> None:
        """Give every tensor ordinary storage of its own again, bit-identical, strides kept."""
        for group in self.groups.values():
            group.to_host()
            fresh = []
            for piece, view in zip(group.pieces, group.host_views, strict=True):
                t = torch.empty_strided(piece.shape, piece.stride, dtype=piece.dtype)
                t.copy_(view)
                fresh.append(t)
            group.point(fresh)
            group.device_views.clear()
        self.groups.clear()
        self.units.clear()


class _Lookup:
    """Qualified tensor names to the live tensor objects of a pipeline."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def tensor(self, spec: TensorSpec) -> torch.Tensor | None:
        owner, _, leaf = spec.name.rpartition(".")
        try:
            t = getattr(find_attr(self.pipeline, owner), leaf)
        except AttributeError:
            return None
        return t if isinstance(t, torch.Tensor) else None


def _check(specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor | None]) -> Iterator[str]:
    for spec, t in zip(specs, tensors, strict=True):
        if t is None:
            yield f"{spec.name}: not found on the pipeline (the topology is stale; discover it again)"
        elif tuple(t.shape) != spec.shape or str(t.dtype).removeprefix("torch.") != spec.dtype:
            yield (
                f"{spec.name}: the pipeline holds {tuple(t.shape)} {t.dtype}, the topology says "
                f"{spec.shape} {spec.dtype} (discover it again)"
            )
        elif t.device.type != "cpu":
            yield f"{spec.name}: found on {t.device}"


def _fill(
    name: str, specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor | None], *, pin: bool
) -> Group:
    live = {s.name: t for s, t in zip(specs, tensors, strict=True)}
    pieces: list[Piece] = []
    ordered: list[torch.Tensor] = []
    for spec, offset in pack(specs):
        t = live[spec.name]
        assert t is not None
        pieces.append(Piece(offset, spec.nbytes, t.dtype, tuple(t.shape), _dense_strides(t)))
        ordered.append(t)
    nbytes = sum(s.nbytes for s in specs)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    views = tuple(p.view(host) for p in pieces)
    with torch.no_grad():
        for t, v in zip(ordered, views, strict=True):
            v.copy_(t.data)
            t.data = v
    return Group(
        name=name, tensors=tuple(ordered), pieces=tuple(pieces), nbytes=nbytes, host=host, host_views=views
    )


def _group_specs(plan: Plan) -> dict[str, list[TensorSpec]]:
    """Group name -> tensors: each plan block, each plan component's remainder, then leftovers.

    Tensors of on-demand components are left to the component's own lifecycle and get no group.
    """
    specs: dict[str, list[TensorSpec]] = {}
    covered: set[str] = set()

    def add(name: str, tensors: Iterable[TensorSpec]) -> None:
        fresh = [t for t in tensors if t.name not in covered]
        covered.update(t.name for t in fresh)
        if fresh:
            specs[name] = fresh

    for top in plan.components:
        if top.on_demand:
            continue
        for c in _subtree(top):
            add(rest_unit(c.path), c.tensors)
            for block in c.blocks:
                add(block.path, block.tensors)
        topo = plan.topology.component(top.path)
        add(f"{top.path}:extra", topo.all_tensors())
    return specs


def _units(plan: Plan, groups: dict[str, Group], pipeline: Any) -> dict[str, Unit]:
    units: dict[str, Unit] = {}
    for top in plan.components:
        for c in _subtree(top):
            for name in [rest_unit(c.path), *(b.path for b in c.blocks)]:
                units[name] = Unit(name=name, groups=_pick(groups, [name]), component=top.path)
            inner = [rest_unit(d.path) for d in _subtree(c)] + [b.path for d in _subtree(c) for b in d.blocks]
            if c is top:
                inner.append(f"{top.path}:extra")
            units[c.path] = Unit(
                name=c.path,
                groups=_pick(groups, inner),
                component=top.path,
                module=find_attr(pipeline, c.path),
            )
    return units


def _pick(groups: dict[str, Group], names: Iterable[str]) -> tuple[Group, ...]:
    return tuple(groups[n] for n in names if n in groups)
