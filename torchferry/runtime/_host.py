"""The host store: every weight the runtime moves lives in one flat byte buffer per block.

A *pack* is the set of tensors that always move together: one block, one component's non-block
remainder, or what is left of a component that the plan does not split. Each pack owns one flat
``uint8`` buffer laid out by `topology.pack` (every tensor on a 256-byte boundary; the buffer is
exactly the topology's byte count) in page-aligned host memory, page-locked on CUDA (see
`torchferry.runtime._pinning`), and the module's parameters and buffers are re-pointed
(``tensor.data = view``) at views into it. Re-pointing keeps each tensor object, so tied weights (one
object under several names) stay tied. A tensor whose elements are dense in memory keeps its strides
(a transposed weight stays transposed); one with gaps is stored contiguously.

Host buffers are filled once when a session opens and are never written or freed while it lives: a
device copy can always be dropped, and no failure can lose a weight. `HostStore.close` gives every
tensor ordinary storage of its own again.

[Note: filling from a checkpoint]
With a `CheckpointReader` the buffers fill from the safetensors files (one block at a time, straight
from mapped windows of the file into the buffer), never from the module, so the pipeline may be
built with its parameters on the meta device: host memory then peaks near the model's size once.
Opening is two phases: `HostStore.prepare` checks everything (the live tensors against the plan,
the checkpoint against the topology), allocates and pins every buffer and, from a checkpoint, reads
it, without touching the pipeline (a module's own bytes are copied in by commit); only
`Prepared.commit` mutates it (meta tensors become CPU tensors in place, by `torch.utils.swap_tensors`,
so their identity and ties survive, then every tensor is re-pointed). Any failure before commit
leaves the pipeline exactly as it was. Checkpoint bytes are in row-major order; a tensor whose
module stores it with other strides (a transposed weight) is rearranged into those strides.

Non-persistent buffers (RoPE tables and the like) are not in checkpoints: their bytes come from the
module, which must have computed them on the CPU. Build the pipeline under `meta_parameters()`
(parameters on meta, buffers as the module makes them); a non-persistent buffer left on the meta
device (``with torch.device("meta")`` puts everything there) cannot be recomputed and is rejected.

[Note: why tensors are re-pointed]
A block reaches its slot once per step, so how its modules are made to read the slot is the hot
path: each tensor is re-pointed (``tensor.data = view``) at the wait and back at the evict, 2 x 27
assignments per step for a block of a Wan transformer, about 0.13 us each in a tight loop and 0.3 us
in a live forward. Swapping each module's ``_parameters``/``_buffers`` dict for a cached one holding
parameters over slot views ("binding", 16 dict assignments each way) was built and measured: it cut
torchferry's own code per block from 43 to 20 us on benchmarks/overhead.py, and was taken out again,
because it gives every weight a second identity during a step. A reference taken during a forward
(a hook or a module keeping ``self.weight``) then pointed into a slot: it read another block's
bytes after the evict, and crashed the process once the slot was freed; a tensor a forward assigns
(``self.count = self.count + 1``) or registers landed in the cached dict and was lost; table edits
between steps (``bias = None``, ``register_parameter``, ``functional_call``) were ignored; a
weight's own attributes and ``requires_grad_`` changes were not seen, and a backward inside a no-grad
forward gave its gradient to the stand-in. Each can be checked for, at about the cost binding saved.
tests/runtime/test_weights_hostile.py keeps those cases, all exact with re-pointing. The tensors
move at the wait, not at the load: until compute is ordered after the copy they read the host copy,
so nothing that reads them then (a hook, a tied weight, the caller between steps) races the copy
stream on a GPU; an in-place write to them meanwhile is caught at the wait, which copies again
(`Pack.carry`: a pack's buffers from its load on, all its tensors from its load on once the engine
bumped their versions, which hides a write from the session guard, and all of them once a step ends
with it in flight; `Pack.recopy`: a write the guard finds at the step's end). An all-gathered
block in flight points at its empty placeholders: a write then raises at the wait.

[Note: sharded packs]
Under the distributed strategy each rank keeps only its shard of an all-gathered block: bytes
``[rank * shard, (rank + 1) * shard)`` of the block's packed buffer, zero-padded past the block's end
(``shard = policies.shard_nbytes(block, world)``); from a checkpoint only those bytes are read.
Outside a step the tensors of a sharded pack are placeholders of shape ``(0,)`` (this rank has no
full copy to point them at): running a block that is not resident is an `ExecutionError`, and
reading its weights directly shows empty tensors. They point into a device slot while the block is
resident, and the session's ``close(gather=True)`` re-assembles full host copies (a collective).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from torchferry._errors import PlanError
from torchferry.policies import rest_unit
from torchferry.runtime._layouts import Layouts, aliased, dense
from torchferry.runtime._pinning import CudaPinner, Footprint, HostMemory, HostPinner
from torchferry.topology import Component, Plan, TensorSpec, find_attr, packed_nbytes
from torchferry.topology import pack as pack_specs

if TYPE_CHECKING:
    from torchferry.runtime._checkpoint import CheckpointReader

__all__ = [
    "HostStore",
    "Pack",
    "PackState",
    "Prepared",
    "Sharding",
    "Unit",
    "footprint",
]


class PackState(enum.Enum):
    """Where a pack's bytes are: host memory only, also a device copy still in flight, or a ready
    device copy. Its tensors point at the device copy only when it is ready (see `Pack.point`)."""

    #: At its host buffer (between steps, and after an evict or unstage).
    HOST = "in host memory"
    #: A load or gather has issued the device copy but no wait has ordered compute after it yet: the
    #: tensors still point at the host buffer (a read of them on any stream does not race the copy).
    IN_FLIGHT = "still in flight (loaded but never waited for)"
    #: At device bytes compute may read (waited for, or staged).
    READY = "ready"


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides: list[int] = []
    expected = 1
    for size in reversed(shape):
        strides.insert(0, expected)
        expected *= size
    return tuple(strides)


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides if its elements fill a gap-free range of memory, else contiguous strides."""
    if t.is_contiguous() or not dense(t):
        return _contiguous(t.shape)
    return tuple(t.stride())


@attrs.define(slots=True, frozen=True)
class Piece:
    """Where one tensor sits in its group's flat buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def view(self, flat: torch.Tensor, at: int | None = None) -> torch.Tensor:
        """This tensor's view into ``flat`` (a ``uint8`` buffer laid out like its pack), or at ``at``."""
        offset = self.offset if at is None else at
        return flat.narrow(0, offset, self.nbytes).view(self.dtype).as_strided(self.shape, self.stride)

    @property
    def row_major(self) -> bool:
        """Whether the bytes are in the row-major order checkpoints store."""
        return self.stride == _contiguous(self.shape)

    def arranged(self, source: torch.Tensor) -> torch.Tensor:
        """``source``'s values as this piece stores them: ``nbytes`` bytes in the piece's strides."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8)
        self.view(flat, 0).copy_(source)
        return flat


@attrs.frozen(kw_only=True)
class Sharding:
    """This rank's part of the weight-shard group: it keeps 1/``world`` of every group in ``names``."""

    rank: int
    world: int
    names: frozenset[str]


@attrs.define(slots=True, eq=False)
class Pack:
    """Tensors that move together, their host buffer, and where they point now.

    ``where`` is a `PackState`; ``device_views`` caches, per slot name, the byte range
    and tensor views into the slot's buffer last used, so a repeated load into a slot builds nothing;
    ``arriving`` holds the views a load or gather issued, which the tensors take at the wait.
    ``shard`` is the byte range ``[start, end)`` of the pack this rank holds when it holds
    only a shard (then ``host`` is those bytes and ``host_views`` are placeholders); else ``None``.
    ``moves`` counts re-pointings and ``bumps`` version bumps the engine made (see `GradGuard`), so
    the session guard refreshes what it remembers of a pack only when they change.
    """

    name: str
    tensors: tuple[torch.Tensor, ...]
    pieces: tuple[Piece, ...]
    nbytes: int
    host: torch.Tensor
    host_views: tuple[torch.Tensor, ...]
    where: PackState = PackState.HOST
    device_views: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]] = attrs.field(
        factory=dict
    )
    shard: tuple[int, int] | None = None
    moves: int = 0
    bumps: int = 0
    #: The indices of the pack's buffers (not parameters): a forward may write them in place.
    buffers: tuple[int, ...] = ()
    # Why: the buffers' version counters when the pack reached the device (see `arrived`, `keep_written`).
    _arrival: tuple[int, ...] = ()
    # Why: per shard slot name, (the slot's buffer, this rank's shard bytes of it).
    shard_views: dict[str, tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=dict)
    arriving: tuple[torch.Tensor, ...] | None = None
    #: While the pack's copy is in flight, the tensors watched for in-place writes (its buffers from
    #: the load on, all of them from the load on after `rewatch` and once a step ends): index ->
    #: version counter when the watch began, -1 for one known written (see `carry`, `recopy`).
    watched: dict[int, int] = attrs.field(factory=dict)
    # Why: the engine bumped the pack's version counters since its last load (`keep_written`, the grad
    # guard), so the session guard re-reads them at the step's end and cannot tell an in-place edit
    # made after the next load from its own bump: that load watches every tensor (see `carry`).
    rewatch: bool = False

    def shard_bytes(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """The first bytes of ``flat`` (shard slot ``key``'s buffer) that hold this rank's shard of
        the pack, cached per slot while ``flat`` stays (a sharded pack's ``host`` is its shard)."""
        cached = self.shard_views.get(key)
        if cached is None or cached[0] is not flat:
            cached = (flat, flat.narrow(0, 0, self.host.numel()))
            self.shard_views[key] = cached
        return cached[1]

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
        """Re-point every tensor of the pack at ``views`` (all on one device, so it is checked once)."""
        tensors = self.tensors
        if len(views) != len(tensors):
            raise ValueError(f"pack {self.name}: {len(views)} views for {len(tensors)} tensors")
        self.moves += 1
        if not tensors or tensors[0].is_meta is views[0].is_meta:
            for t, v in zip(tensors, views):  # noqa: B905 (lengths checked above)
                t.data = v
        else:
            for t, v in zip(tensors, views):  # noqa: B905
                _swap_in(t, v)
            self.bumps += 1  # swapping tensors swaps their version counters too

    def to_host(self) -> None:
        """Point the pack back at its host buffer (nothing is copied: host bytes are the truth); a
        pack whose copy is still in flight points there already."""
        where = self.where
        if where is PackState.READY:  # the wait took `arriving` and the watch (`stale`)
            self.point(self.host_views)
        elif where is PackState.IN_FLIGHT:
            self.arriving = None
            self.watched.clear()
        self.where = PackState.HOST

    def carry(self, indices: Iterable[int]) -> None:
        """The pack's copy is in flight: watch tensors ``indices`` from now on, so its wait finds an
        in-place write made to their host bytes meanwhile (`stale`). Tensors already watched keep the
        counter seen first."""
        watched, tensors = self.watched, self.tensors
        for i in indices:
            if i not in watched:
                watched[i] = tensors[i]._version

    def recopy(self, index: int) -> None:
        """The pack's copy is in flight and tensor ``index`` was written in place since some time in
        the step that issued it (its host bytes hold the write; the copy may not): make its wait copy
        the pack again (`stale`)."""
        self.watched[index] = -1  # no version counter reads -1

    def stale(self) -> bool:
        """Whether a watched tensor was written in place since `carry` (the copy holds old bytes);
        the watch ends."""
        watched, tensors = self.watched, self.tensors
        written = any(tensors[i]._version != v for i, v in watched.items())
        watched.clear()
        return written

    def arrived(self) -> None:
        """The pack's tensors point at a device copy now: remember its buffers' version counters."""
        tensors = self.tensors
        self._arrival = tuple(tensors[i]._version for i in self.buffers)

    def keep_written(self) -> None:
        """Before the pack leaves the device: copy into the host buffer each buffer a forward wrote in
        place meanwhile (a running statistic, a counter), as the plain run keeps it. A pack this rank
        holds only a shard of has no host copy of the whole buffer to take it."""
        if self.shard is not None:
            return
        for i, then in zip(self.buffers, self._arrival, strict=True):
            t = self.tensors[i]
            if t._version != then:
                with torch.no_grad():
                    self.host_views[i].copy_(t.detach())
                self.bumps += 1
                self.rewatch = True

    def forget_device(self) -> None:
        """Drop every cached view of device memory (the slots may be freed)."""
        self.device_views.clear()
        self.shard_views.clear()

    def unshard(self, full: torch.Tensor) -> None:
        """Adopt ``full`` (the whole pack, at least ``nbytes`` bytes) as the host buffer."""
        self.host = full
        self.host_views = tuple(p.view(full) for p in self.pieces)
        self.shard = None
        self.point(self.host_views)
        self.where = PackState.HOST


def _swap_in(t: torch.Tensor, v: torch.Tensor) -> None:
    """Re-point ``t`` at ``v`` across the meta device (a session device for tests only).

    ``t.data = v`` cannot cross between CPU and meta tensors; swapping in a fresh alias of ``v`` (of
    ``t``'s own class) keeps the tensor object, as the plain path does.
    """
    alias = v.view_as(v)
    if isinstance(t, torch.nn.Parameter):
        alias = torch.nn.Parameter(alias, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, alias)  # type: ignore[no-untyped-call]


@attrs.define(slots=True, eq=False)
class Unit:
    """A schedule's unit: a block, ``<component>:rest`` or a whole component, and its packs."""

    name: str
    packs: tuple[Pack, ...]
    component: str
    module: Any = None

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.packs)


def _subtree(component: Component) -> Iterator[Component]:
    yield from component.walk()


class HostStore:
    """The host buffers of one session, the units that name them, and the live tensors they back."""

    def __init__(self, packs: dict[str, Pack], units: dict[str, Unit], memory: HostMemory) -> None:
        self.packs = packs
        self.units = units
        #: The buffers' memory: it alone pins and frees them.
        self.memory = memory
        # Why: storage layouts (aliases, shared storage, gapped strides) close restores ([Note: as it was]).
        self.layouts = Layouts()

    @property
    def pinned(self) -> bool:
        """Whether every host buffer is page-locked (the truth: false after a refused pin)."""
        return self.memory.pinned

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory page-locked for the store now (whole pages of its buffers)."""
        return self.memory.pinned_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the store holds (a sharded pack counts its shard only)."""
        return sum(g.host.numel() for g in self.packs.values())

    @property
    def sharded(self) -> tuple[Pack, ...]:
        """The packs this rank holds only a shard of."""
        return tuple(g for g in self.packs.values() if g.shard is not None)

    @classmethod
    def prepare(
        cls,
        pipeline: Any,
        plan: Plan,
        *,
        pin: bool,
        reader: CheckpointReader | None = None,
        sharding: Sharding | None = None,
        pinner: HostPinner | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Prepared:
        """Check everything, allocate (and pin) every buffer and, from a checkpoint, read it, without
        touching the pipeline.

        ``pin`` page-locks the buffers with ``pinner`` (default `CudaPinner`); a refused pin falls
        back to pageable memory with one `OffloadWarning`. Raises `PlanError` for a pipeline or
        checkpoint that cannot serve ``plan`` (every problem at once); see the Notes at the top of
        this module. A `Prepared` that is not committed must be `Prepared.discard`-ed. ``progress``,
        when given, is called once per pack as its buffer is filled (here from a checkpoint, else in
        `Prepared.commit`) with the pack's bytes and the bytes of all packs.
        """
        specs = _group_specs(plan)
        lookup = _Lookup(pipeline)
        resolved = {name: [lookup.tensor(s) for s in pack] for name, pack in specs.items()}
        loose = _loose_specs(plan, specs)
        loose_live = [lookup.tensor(s) for s in loose]
        problems: list[str] = []
        meta: list[str] = []
        on_meta: list[str] = []
        unmanaged: list[str] = []
        for name, pack in specs.items():
            _check(pack, resolved[name], problems, meta, on_meta)
        _check(loose, loose_live, problems, meta, on_meta, missing_ok=True)
        _check_unmanaged(pipeline, plan, meta, unmanaged)
        if meta and reader is None:
            raise PlanError(
                f"torchferry.offload cannot take over this pipeline: {len(meta)} tensor(s) are on the meta "
                f"device ({_some(meta)}) and no checkpoint was given to fill them; pass checkpoint=<a "
                ".safetensors file, a folder of them or an *.index.json> to torchferry.offload(...), or "
                "load the weights into the pipeline on the CPU first"
            )
        if on_meta or unmanaged:
            raise PlanError(
                "torchferry.offload cannot fill this pipeline from its checkpoint: "
                + (
                    f"{len(on_meta)} non-persistent buffer(s) are on the meta device ({_some(on_meta)}), "
                    "and checkpoints do not hold such buffers nor can torchferry recompute them; build the "
                    "pipeline under torchferry.meta_parameters() (parameters on meta, buffers computed on "
                    "the CPU as the module makes them) instead of torch.device('meta')"
                    if on_meta
                    else f"{len(unmanaged)} tensor(s) on the meta device belong to no component torchferry "
                    f"manages ({_some(unmanaged)}), so nothing would fill them; give them real values first"
                )
            )
        if problems:
            raise PlanError(
                "torchferry.offload cannot take over this pipeline:\n  "
                + "\n  ".join(problems[:8])
                + ("\n  ..." if len(problems) > 8 else "")
                + f"\nThe {plan.strategy} plan keeps every weight in host memory and moves it itself: "
                "build or load the pipeline on the CPU (or call pipeline.to('cpu')) before "
                "torchferry.offload(...), and let the session place it on the device."
            )
        if reader is not None:
            reader.validate(plan.topology)
        layouts: dict[str, tuple[tuple[Piece, ...], int]] = {}
        for name, pack in specs.items():
            layouts[name] = _layout(pack, resolved[name])
        memory = HostMemory((pinner or CudaPinner()) if pin else None)
        buffers: dict[str, torch.Tensor] = {}
        loose_values: list[torch.Tensor | None] = []
        total = sum(_span_bytes(name, layouts[name][1], sharding) for name in specs)
        try:
            memory.probe()
            for name, (_, nbytes) in layouts.items():
                start, end = _span(name, nbytes, sharding) or (0, nbytes)
                # From the module, each pack is pinned in commit once filled (see [Note: exact pinning]).
                buffers[name] = memory.alloc(name, end - start, pin=reader is not None)
            if reader is not None:
                for name, pack in specs.items():
                    pieces, nbytes = layouts[name]
                    span = _span(name, nbytes, sharding)
                    _read(reader, pack, pieces, resolved[name], span, host=buffers[name])
                    if progress is not None:
                        progress(buffers[name].numel(), total)
                for spec, live in zip(loose, loose_live, strict=True):
                    loose_values.append(_read_loose(reader, spec, live))
        except BaseException:
            memory.close()
            raise
        return Prepared(
            pipeline=pipeline, plan=plan, sharding=sharding, specs=specs, live=resolved, layouts=layouts,
            buffers=buffers, filled=reader is not None, memory=memory,
            loose=list(zip(loose_live, loose_values, strict=True)) if reader is not None else [],
            progress=None if reader is not None or progress is None else (progress, total),
        )

    def reset(self) -> None:
        """Point every tensor back at host memory (error recovery; host bytes are never lost)."""
        for pack in self.packs.values():
            pack.to_host()
            pack.forget_device()

    def close(self) -> None:
        """Give every tensor ordinary storage of its own again, bit-identical, strides kept.

        Pack by pack, each host buffer dropped as soon as its tensors have their own copies, so
        closing peaks at the host store plus one pack; each buffer is unpinned and unmapped as it
        goes, so its memory goes back to the OS (nothing stays cached). Sharded packs cannot be
        given back without their peers' shards: they keep their placeholders and stay in
        ``packs`` (host shards are never dropped) until `Pack.unshard` gives them their full
        bytes and `give_back` or `close` runs again.
        """
        for name in list(self.packs):
            pack = self.packs[name]
            if pack.shard is None:
                self.give_back(pack)
            else:
                pack.to_host()
                pack.forget_device()
        self.units.clear()

    def give_back(self, pack: Pack) -> None:
        """Give ``pack``'s tensors storage of their own and drop the pack (it must hold full bytes)."""
        pack.to_host()
        pack.forget_device()
        fresh = []
        for piece, view in zip(pack.pieces, pack.host_views, strict=True):
            t = torch.empty_strided(piece.shape, piece.stride, dtype=piece.dtype)
            t.copy_(view)
            fresh.append(t)
        pack.point(fresh)
        pack.host_views = tuple(fresh)
        pack.host = torch.empty(0, dtype=torch.uint8)
        del self.packs[pack.name]
        self.memory.release(pack.name)
        self.layouts.given_back(pack.name)


@attrs.define(eq=False)
class Prepared:
    """A checked (and, from a checkpoint, fully read) host store whose `commit` takes the pipeline over."""

    pipeline: Any
    plan: Plan
    sharding: Sharding | None
    specs: dict[str, list[TensorSpec]]
    live: dict[str, list[torch.Tensor | None]]
    layouts: dict[str, tuple[tuple[Piece, ...], int]]
    #: Every pack's buffer, allocated (and pinned) already; read from the checkpoint if ``filled``.
    buffers: dict[str, torch.Tensor]
    filled: bool
    memory: HostMemory
    loose: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    #: Told of each group `commit` fills from the module, with the bytes of all groups.
    progress: tuple[Callable[[int, int], None], int] | None = None

    def discard(self) -> None:
        """Give up this store without taking the pipeline over: unpin and free every buffer."""
        self.buffers = {}
        self.memory.close()

    def commit(self) -> HostStore:
        """Re-point the pipeline's tensors at the host buffers (copying the module's bytes in if no
        checkpoint was read); the only step that mutates the pipeline, and it cannot fail."""
        packs: dict[str, Pack] = {}
        members = {}
        for name, tensors in self.live.items():
            specs = [spec for spec, _ in pack_specs(self.specs[name])]
            ordered = list(_ordered(self.specs[name], tensors))
            members[name] = aliased(self.pipeline, specs, ordered, self.layouts[name][0])
        layouts = Layouts.take({name: tensors for name, (tensors, _) in members.items()})
        for name in self.live:
            nbytes = self.layouts[name][1]
            ordered, pieces = members[name]
            span = _span(name, nbytes, self.sharding)
            host = self.buffers[name]
            if not self.filled:
                _from_module(ordered, pieces, nbytes, span, host)
                if self.progress is not None:
                    self.progress[0](host.numel(), self.progress[1])
            for t in ordered:
                if t.is_meta:
                    _materialise(t)
            if span is None:
                views = tuple(p.view(host) for p in pieces)
            else:
                views = tuple(torch.empty(0, dtype=p.dtype) for p in pieces)
            with torch.no_grad():
                for t, v in zip(ordered, views, strict=True):
                    t.data = v
            if not self.filled:
                # The module's own copy of this pack is dropped now: pinning here, not in prepare,
                # keeps the open near the model plus one pack (a refusal falls back, never raises).
                self.memory.pin(name)
            packs[name] = Pack(
                name=name,
                tensors=tuple(ordered),
                pieces=tuple(pieces),
                nbytes=nbytes,
                host=host,
                host_views=views,
                shard=span,
                buffers=tuple(i for i, t in enumerate(ordered) if not isinstance(t, nn.Parameter)),
            )
        for live, value in self.loose:
            if live is None or value is None:
                continue
            if live.is_meta:
                _materialise(live)
            with torch.no_grad():
                live.data = value
        self.buffers = {}
        units = _units(self.plan, packs, self.pipeline)
        store = HostStore(packs, units, self.memory)
        store.layouts = layouts
        return store


class _Lookup:
    """Qualified tensor names to the live tensor objects of a pipeline."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def tensor(self, spec: TensorSpec) -> torch.Tensor | None:
        try:
            t = find_attr(self.pipeline, spec.name)
        except AttributeError:
            return None
        return t if isinstance(t, torch.Tensor) else None


def _check(
    specs: Sequence[TensorSpec],
    tensors: Sequence[torch.Tensor | None],
    problems: list[str],
    meta: list[str],
    buffers: list[str],
    *,
    missing_ok: bool = False,
) -> None:
    for spec, t in zip(specs, tensors, strict=True):
        if t is None:
            if not missing_ok:
                problems.append(
                    f"{spec.name}: not found on the pipeline (the topology is stale; discover it again)"
                )
        elif tuple(t.shape) != spec.shape or str(t.dtype).removeprefix("torch.") != spec.dtype:
            problems.append(
                f"{spec.name}: the pipeline holds {tuple(t.shape)} {t.dtype}, the topology says "
                f"{spec.shape} {spec.dtype} (discover it again)"
            )
        elif t.is_meta:
            if spec.buffer and not spec.persistent:
                buffers.append(spec.name)
            meta.append(spec.name)
        elif t.device.type != "cpu":
            problems.append(f"{spec.name}: found on {t.device}")


def _check_unmanaged(pipeline: Any, plan: Plan, meta: list[str], unmanaged: list[str]) -> None:
    """Meta tensors of the pipeline that no component of the topology owns: nothing would fill them."""
    if not isinstance(pipeline, nn.Module):
        return
    known = {n for c in plan.topology.components for s in c.all_tensors() for n in (s.name, *s.aliases)}
    named = [*pipeline.named_parameters(), *pipeline.named_buffers()]
    for name, t in named:
        if t.is_meta and name not in known:
            meta.append(name)
            unmanaged.append(name)


def _some(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _loose_specs(plan: Plan, specs: Mapping[str, Sequence[TensorSpec]]) -> list[TensorSpec]:
    """Tensors of the topology no pack holds (on-demand components'): filled in place from a checkpoint."""
    covered = {s.name for specs_ in specs.values() for s in specs_}
    return [s for c in plan.topology.components for s in c.all_tensors() if s.name not in covered]


def _ordered(specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor | None]) -> Iterator[torch.Tensor]:
    live = {s.name: t for s, t in zip(specs, tensors, strict=True)}
    for spec, _ in pack_specs(specs):
        t = live[spec.name]
        assert t is not None
        yield t


def _layout(
    specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor | None]
) -> tuple[tuple[Piece, ...], int]:
    """The pieces of a pack in `pack` order (strides from the live tensors) and its byte count."""
    live = {s.name: t for s, t in zip(specs, tensors, strict=True)}
    pieces: list[Piece] = []
    for spec, offset in pack_specs(specs):
        t = live[spec.name]
        assert t is not None
        pieces.append(Piece(offset, spec.nbytes, t.dtype, tuple(t.shape), _dense_strides(t)))
    return tuple(pieces), packed_nbytes(pack_specs(specs))


def _span(name: str, nbytes: int, sharding: Sharding | None) -> tuple[int, int] | None:
    """The byte range of pack ``name`` this rank keeps, or ``None`` when it keeps all of it."""
    if sharding is None or name not in sharding.names:
        return None
    from torchferry.policies import shard_nbytes

    shard = shard_nbytes(nbytes, sharding.world)
    return sharding.rank * shard, (sharding.rank + 1) * shard


def _span_bytes(name: str, nbytes: int, sharding: Sharding | None) -> int:
    span = _span(name, nbytes, sharding)
    return nbytes if span is None else span[1] - span[0]


def _from_module(
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


def _read(
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
    non-persistent buffers come from the module (see the Note at the top).
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
        elif piece.row_major:
            continue
        elif (lo, hi) == (offset, offset + spec.nbytes):
            source = host[lo - start : hi - start].clone().view(piece.dtype).view(piece.shape)
        else:
            source = reader.read_tensor(spec.name)
        arranged = piece.arranged(source)
        host[lo - start : hi - start].copy_(arranged[lo - offset : hi - offset])


def _read_loose(reader: CheckpointReader, spec: TensorSpec, live: torch.Tensor | None) -> torch.Tensor | None:
    """A fresh CPU tensor for an on-demand component's tensor, from the checkpoint, in its strides."""
    if live is None or (spec.buffer and not spec.persistent):
        return None
    value = reader.read_tensor(spec.name)
    strides = _dense_strides(live)
    if strides == _contiguous(value.shape):
        return value
    out = torch.empty_strided(tuple(live.shape), strides, dtype=value.dtype)
    out.copy_(value)
    return out


def _materialise(t: torch.Tensor) -> None:
    """Turn meta tensor ``t`` into an empty CPU tensor in place (same object, so ties survive)."""
    fresh = torch.empty(0, dtype=t.dtype)
    if isinstance(t, nn.Parameter):
        fresh = nn.Parameter(fresh, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, fresh)  # type: ignore[no-untyped-call]


def footprint(plan: Plan, sharding: Sharding | None = None) -> Footprint:
    """The host memory a store for ``plan`` holds and pins: a pure function of the plan (and this
    rank's sharding), the same sizes `HostStore.prepare` allocates."""
    sizes = []
    for name, specs in _group_specs(plan).items():
        nbytes = packed_nbytes(pack_specs(specs))
        start, end = _span(name, nbytes, sharding) or (0, nbytes)
        sizes.append(end - start)
    return Footprint.of(sizes)


def _group_specs(plan: Plan) -> dict[str, list[TensorSpec]]:
    """Pack name -> tensors: each plan block, each plan component's remainder, then leftovers.

    Tensors of on-demand components are left to the component's own lifecycle and get no pack.
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


def _units(plan: Plan, packs: dict[str, Pack], pipeline: Any) -> dict[str, Unit]:
    units: dict[str, Unit] = {}
    for top in plan.components:
        for c in _subtree(top):
            for name in [rest_unit(c.path), *(b.path for b in c.blocks)]:
                units[name] = Unit(name=name, packs=_pick(packs, [name]), component=top.path)
            inner = [rest_unit(d.path) for d in _subtree(c)] + [b.path for d in _subtree(c) for b in d.blocks]
            if c is top:
                inner.append(f"{top.path}:extra")
            units[c.path] = Unit(
                name=c.path,
                packs=_pick(packs, inner),
                component=top.path,
                module=find_attr(pipeline, c.path),
            )
    return units


def _pick(packs: dict[str, Pack], names: Iterable[str]) -> tuple[Pack, ...]:
    return tuple(packs[n] for n in names if n in packs)
