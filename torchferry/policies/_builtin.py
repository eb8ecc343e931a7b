"""The built-in policies: `none`, `model_level`, `layerwise`, `distributed_layerwise`, and `cached`.

Each factory returns a pure function ``(plan, step) -> Schedule`` that reads nothing but its
arguments, so the same inputs give the same schedule on every rank and in every process.

[Note: the ring]
Streaming blocks of the running component go through one shared ring of ``depth + 1`` block slots
sized to the largest streaming block of the whole plan. Think of the blocks to stream as one queue:
this pass's streaming blocks, then the first ``depth`` streaming blocks of the next pass (this
component again, or ``step.next``). Before each block computes, the next ``depth + 1`` queued
blocks are made resident (a load into a free slot; a slot is free once the compute that read its
previous block has passed that block's ``evict``), so while block i computes, blocks i+1..i+depth
are in flight. A block is evicted right after it computes unless the queue needs it again within
the window (a ring no longer than its slots simply stays). The tail of the queue is the next pass's
head, so the schedule exits with those blocks loaded and the next step's entry starts with them.
Slots are taken first-free-first-used, so odd block counts, several stacks and nested rings share
the slots without special cases. Remainders, unstreamed components and resident blocks are staged
once and stay; a step stages what is missing from its entry and unstages what the policy no longer
keeps. With a file tier, every load or stage of a file-tier unit copies from a staging slot a read
filled first (see [Note: reads in the ring] in `torchferry.policies._staging`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from types import MappingProxyType
from typing import cast

from torchferry._errors import PlanError, ScheduleError, plan_named
from torchferry.policies._ir import (
    DEVICE,
    OP_STREAM,
    Declared,
    Op,
    OpKind,
    Placement,
    Policy,
    Schedule,
    Slot,
    Step,
    When,
    declare,
    gather_nbytes,
)
from torchferry.policies._layout import PlanFacts, forward_blocks, layout, shard_nbytes, swaps
from torchferry.policies._staging import Reads
from torchferry.policies._tiers import tiers
from torchferry.policies._tokens import format_bytes, natural_key
from torchferry.topology import MAX_PREFETCH_DEPTH, STRATEGIES, Component, Plan, Strategy

__all__ = [
    "BUILTINS",
    "STRATEGIES",
    "builtin",
    "cached",
    "compress_paths",
    "distributed_layerwise",
    "layerwise",
    "model_level",
    "none",
    "ring_slots",
]


def compress_paths(paths: Iterable[str]) -> str:
    """``transformer.blocks.{0,3,7}``: paths in natural order, those sharing a parent written once (for
    notes); ``none`` when there are none."""
    groups: dict[str, list[str]] = {}
    for p in sorted(paths, key=natural_key):
        parent, _, leaf = p.rpartition(".")
        groups.setdefault(parent, []).append(leaf)
    parts = []
    for parent, leaves in groups.items():
        inner = leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}"
        parts.append(f"{parent}.{inner}" if parent else inner)
    return " ".join(parts) if parts else "none"


def _top(plan: Plan, path: str) -> Component:
    for c in plan.components:
        if c.path == path:
            return c
    known = ", ".join(repr(c.path) for c in plan.components)
    raise ScheduleError.worded(
        f"step names component {path!r}, which is not a top-level component of ",
        plan_named(plan.digest),
        f"; known: {known}; pass one of them as Step(component=...)",
    )


class _Builder:
    """Accumulates ops while tracking what is where, so the exit is what the ops leave; with a file
    tier, it reads what it stages (`Reads`) and adds the staging slots."""

    def __init__(self, step: Step, slots: tuple[Slot, ...], plan: Plan) -> None:
        self.step = step
        self.tiers = tiers(plan)
        self.reads = Reads(plan, self.tiers, self.emit) if self.tiers.file else None
        self.slots = (*slots, *self.tiers.staging) if self.tiers.file else slots
        self.ops: list[Op] = []
        self.where: dict[str, str] = {}
        self.size: dict[str, int] = {}
        self.order: list[str] = []
        self.occupant: dict[str, str] = {}
        block_slots = [s.name for s in slots if s.kind == "block"]
        for p in step.entry:
            self.where[p.unit] = p.where
            self.size[p.unit] = p.nbytes
            self.order.append(p.unit)
            if p.where != DEVICE:
                self.occupant[p.where] = p.unit
        self.free = [s for s in block_slots if s not in self.occupant]

    def emit(
        self,
        when: When,
        anchor: str,
        kind: OpKind,
        unit: str,
        *,
        slot: str | None = None,
        src: str | None = None,
        nbytes: int = 0,
        chunks: int = 1,
    ) -> None:
        """Append one op, on the stream its kind runs on."""
        self.ops.append(
            Op(
                when=when,
                anchor=anchor,
                stream=OP_STREAM[kind],
                kind=kind,
                unit=unit,
                slot=slot,
                src=src,
                nbytes=nbytes,
                chunks=chunks,
            )
        )

    def _place(self, unit: str, where: str, nbytes: int) -> None:
        """``unit`` is now at ``where`` (the latest placed last in the exit)."""
        self.where[unit] = where
        self.size[unit] = nbytes
        if unit in self.order:
            self.order.remove(unit)
        self.order.append(unit)

    def _drop(self, unit: str) -> None:
        del self.where[unit]
        self.order.remove(unit)

    def stage(self, when: When, anchor: str, unit: str, nbytes: int) -> None:
        src = self.reads.take(when, anchor, unit) if self.reads is not None else None
        self.emit(when, anchor, "stage", unit, src=src, nbytes=nbytes)
        self._place(unit, DEVICE, nbytes)

    def from_file(self, when: When, anchor: str, unit: str) -> str | None:
        """The staging slot a load of ``unit`` copies from (`Reads.take`), or ``None`` from host memory."""
        return self.reads.take(when, anchor, unit) if self.reads is not None else None

    def read_ahead(self, when: When, anchor: str, queue: Iterable[str]) -> None:
        """Read the next file-tier units of ``queue`` ahead of their loads (`Reads.ahead`)."""
        if self.reads is not None:
            self.reads.ahead(when, anchor, queue, self.where)

    def unstage(self, when: When, anchor: str, unit: str) -> None:
        self.emit(when, anchor, "unstage", unit)
        self._drop(unit)

    def occupy(self, slot: str, unit: str, nbytes: int) -> None:
        """``unit`` (``nbytes`` on the device) now holds the free block slot ``slot``."""
        self.free.remove(slot)
        self.occupant[slot] = unit
        self._place(unit, slot, nbytes)

    def evict(self, when: When, anchor: str, unit: str) -> None:
        slot = self.where[unit]
        self.emit(when, anchor, "evict", unit)
        self._drop(unit)
        del self.occupant[slot]
        self.free.append(slot)

    def staged(self) -> list[str]:
        return [u for u in self.order if self.where[u] == DEVICE]

    def exit(self) -> tuple[Placement, ...]:
        staged = [Placement(unit=u, where=DEVICE, nbytes=self.size[u]) for u in self.staged()]
        ring = [
            Placement(unit=self.occupant[s.name], where=s.name, nbytes=self.size[self.occupant[s.name]])
            for s in self.slots
            if s.name in self.occupant
        ]
        return (*staged, *ring)

    def schedule(self, policy: str, plan: Plan, notes: Iterable[str] = ()) -> Schedule:
        return Schedule(
            policy=policy,
            plan=plan.digest,
            step=self.step,
            slots=self.slots,
            entry=self.step.entry,
            ops=self.ops,
            exit=self.exit(),
            notes=(*notes, *self.tiers.notes),
            file=self.tiers.file,
        )


# ------------------------------------------------------------------------------------ whole components


def _whole(plan: Plan, step: Step, *, swap: bool, policy: str) -> Schedule:
    top = _top(plan, step.component)
    c = top.path
    b = _Builder(step, (), plan)
    swappable = [x for x in plan.components if swap and swaps(x)]
    dits = {x.path for x in swappable if x.kind == "dit"}
    encoders = {x.path for x in swappable if x.kind == "encoder"}
    on_demand = {x.path for x in plan.components if x.on_demand}
    sizes = layout(plan).sizes
    kept = [x.path for x in plan.components if x.path not in dits | encoders | on_demand]
    if c in dits:
        out = (dits | encoders) - {c}
    elif top.kind == "encoder":
        out = dits
    else:
        out = set()
    swapped = (dits | encoders) - out
    for p in step.entry:
        if p.where == DEVICE and (p.unit in out or (p.unit not in kept and p.unit not in swapped)):
            b.unstage("before", c, p.unit)
    wanted = [c] if c in swapped else []
    for unit in [*wanted, *(k for k in kept if k != c), *(k for k in kept if k == c)]:
        if unit not in b.where and unit in sizes:
            b.stage("before", c, unit, sizes[unit])
    if c in on_demand:
        b.emit("before", c, "acquire", c, nbytes=sizes[c])
        b.emit("after", c, "release", c)
    else:
        b.emit("before", c, "wait", c)
    return b.schedule(policy, plan)


def none() -> Declared:
    """No offload: every component is staged whole on first use and stays (on-demand ones are acquired)."""

    def none_policy(plan: Plan, step: Step, /) -> Schedule:
        return _whole(plan, step, swap=False, policy="none()")

    return declare(none_policy, name="none()", index_free=True)


def model_level() -> Declared:
    """Whole-component swapping: a selected DiT unstages the selected encoders and other selected
    DiTs, any encoder unstages the selected DiTs; everything else is staged once and kept.
    """

    def model_level_policy(plan: Plan, step: Step, /) -> Schedule:
        return _whole(plan, step, swap=True, policy="model_level()")

    return declare(model_level_policy, name="model_level()", index_free=True)


# ------------------------------------------------------------------------------------------- ring


def _chunks(shard: int, chunk_bytes: int | None) -> int:
    if not chunk_bytes or shard <= chunk_bytes:
        return 1
    return -(-shard // chunk_bytes)


def ring_slots(
    plan: Plan, lay: PlanFacts, depth: int, allgather: frozenset[str], chunk_bytes: int | None = None
) -> tuple[Slot, ...]:
    """The shared ring's block slots (``s0..s<depth>``) and, when some block is all-gathered, two
    shard slots (``h0``, ``h1``), each sized to the largest unit it will hold; when some gather is
    chunked (``chunk_bytes`` under a shard), the ``gather`` slot ``g0`` its chunks land in
    (`gather_nbytes`: ``world`` chunks of at most ``chunk_bytes``)."""
    world = plan.config.dp_size
    full = 0
    shard = 0
    gathered = 0
    for blocks in lay.streamed.values():
        for blk in blocks:
            if blk.path in allgather:
                s = shard_nbytes(blk.nbytes, world)
                shard = max(shard, s)
                full = max(full, s * world)
                gathered = max(gathered, gather_nbytes(s, _chunks(s, chunk_bytes), world))
            else:
                full = max(full, blk.nbytes)
    if full == 0:
        return ()
    slots = [Slot(name=f"s{i}", nbytes=full) for i in range(depth + 1)]
    if shard:
        slots += [Slot(name=f"h{i}", nbytes=shard, kind="shard") for i in range(2)]
    if gathered:
        slots.append(Slot(name="g0", nbytes=gathered, kind="gather"))
    return tuple(slots)


def _ring(
    plan: Plan,
    step: Step,
    *,
    depth: int,
    resident: frozenset[str],
    gather: bool,
    chunk_bytes: int | None,
    policy: str,
    notes: tuple[str, ...] = (),
) -> Schedule:
    top = _top(plan, step.component)
    c = top.path
    lay = layout(plan, resident)
    allgather = lay.allgather if gather else frozenset()
    slots = ring_slots(plan, lay, depth, allgather, chunk_bytes)
    b = _Builder(step, slots, plan)
    world = plan.config.dp_size
    kept = set(lay.kept)
    # 1. unstage what the policy no longer keeps; 2. stage what is missing (this component's first).
    for p in step.entry:
        if p.where == DEVICE and p.unit not in kept:
            b.unstage("before", c, p.unit)
    mine = lay.top_kept(c)
    for unit in (*mine, *(u for u in lay.kept if u not in mine)):
        if unit not in b.where:
            b.stage("before", c, unit, lay.sizes[unit])
    for unit in lay.top_acquired(c):
        b.emit("before", c, "acquire", unit, nbytes=lay.acquired[unit])
    for unit in mine:
        if unit not in lay.resident:
            b.emit("before", c, "wait", unit)

    # The queue: this pass's streaming blocks, then the first ``depth`` of the next pass's.
    nxt = step.next if step.next is not None else c
    if nxt not in lay.streamed:
        _top(plan, nxt)  # raises: the step's next names no top-level component
    queue = [*lay.streamed[c], *lay.streamed[nxt][:depth]]
    n = len(lay.streamed[c])
    names = [blk.path for blk in queue]
    nbytes = {blk.path: blk.nbytes for blk in queue}
    shard_slot = 0

    def ensure(when: When, anchor: str, window: list[str]) -> None:
        nonlocal shard_slot
        for unit in dict.fromkeys(window):
            if unit in b.where:
                continue
            if not b.free:
                stale = next(
                    s.name for s in slots if s.name in b.occupant and b.occupant[s.name] not in window
                )
                b.evict(when, anchor, b.occupant[stale])
            slot = b.free[0]
            if unit in allgather:
                shard = shard_nbytes(nbytes[unit], world)
                k = _chunks(shard, chunk_bytes)
                h = f"h{shard_slot % 2}"
                shard_slot += 1
                staged = b.from_file(when, anchor, unit)
                b.emit(when, anchor, "load", unit, slot=h, src=staged or "shard", nbytes=shard, chunks=k)
                b.emit(when, anchor, "gather", unit, slot=slot, src=h, nbytes=shard * world, chunks=k)
                size = shard * world
            else:
                src = b.from_file(when, anchor, unit)
                b.emit(when, anchor, "load", unit, slot=slot, src=src, nbytes=nbytes[unit])
                size = nbytes[unit]
            b.occupy(slot, unit, size)

    j = 0
    for blk in forward_blocks(top):
        streamed = j < n and names[j] == blk.path
        ensure("before", blk.path, names[j : j + depth + 1])
        b.read_ahead("before", blk.path, names[j + depth + 1 :])
        b.emit("before", blk.path, "wait", blk.path)
        if streamed:
            j += 1
            if blk.path not in names[j : j + depth + 1]:
                b.evict("after", blk.path, blk.path)
    ensure("after", c, names[j : j + depth + 1])
    for unit in lay.top_acquired(c):
        b.emit("after", c, "release", unit)
    return b.schedule(policy, plan, notes)


def _depth(where: str, depth: object) -> int:
    """The one check of a prefetch depth (`OffloadConfig.prefetch_depth` is checked alike)."""
    if not isinstance(depth, int) or isinstance(depth, bool):
        raise TypeError(f"{where}: depth must be an int, got {type(depth).__name__} {depth!r}")
    if depth > MAX_PREFETCH_DEPTH:
        shown = str(depth) if depth.bit_length() < 64 else "a larger int"
        raise PlanError(
            f"depth must be at most {MAX_PREFETCH_DEPTH} (blocks in flight ahead of the one computing; "
            f"the ring holds depth + 1 blocks), got {shown}"
        )
    if depth < 1:
        raise PlanError(
            f"{where}: depth must be >= 1 (blocks in flight ahead of the one computing), got {depth}"
        )
    return depth


def _chunk_bytes(where: str, chunk_bytes: object) -> int | None:
    if chunk_bytes is None:
        return None
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool):
        raise TypeError(f"{where}: chunk_bytes must be an int or None, got {type(chunk_bytes).__name__}")
    if chunk_bytes < 1:
        raise PlanError(f"{where}: chunk_bytes must be a positive number of bytes or None, got {chunk_bytes}")
    return chunk_bytes


def _ring_policy(
    base: str, depth: int, resident: Iterable[str], *, gather: bool, chunk_bytes: int | None = None
) -> Declared:
    """The ring policy ``base(depth=..., resident=..., chunk=...)`` (see the ring note); its name and
    notes say which extra blocks stay resident and how all-gathers are chunked."""
    d = _depth(f"{base}(depth={depth!r})", depth)
    chunk = _chunk_bytes(f"{base}(chunk_bytes={chunk_bytes!r})", chunk_bytes)
    extra = frozenset(resident)
    args = [f"depth={d}"]
    if extra:
        args.append(f"resident={len(extra)}")
    if chunk is not None:
        args.append(f"chunk={format_bytes(chunk, exact=False)}")
    name = f"{base}({', '.join(args)})"
    notes = (f"resident blocks: {compress_paths(extra)}",) if extra else ()

    def ring_policy(plan: Plan, step: Step, /) -> Schedule:
        return _ring(
            plan, step, depth=d, resident=extra, gather=gather, chunk_bytes=chunk, policy=name, notes=notes
        )

    return declare(ring_policy, name=name, index_free=True)


def layerwise(depth: int = 1, resident: Iterable[str] = ()) -> Declared:
    """Stream every streaming block through one shared ring of ``depth + 1`` slots (see the ring note).

    ``resident`` names extra blocks (any, not only leading ones) to keep on the device for good, on
    top of the plan's resident heads.
    """
    return _ring_policy("layerwise", depth, resident, gather=False)


def distributed_layerwise(
    depth: int = 1, resident: Iterable[str] = (), *, chunk_bytes: int | None = None
) -> Declared:
    """The ring of `layerwise`, with each all-gathered block loaded as this rank's shard
    (``load ... from shard`` into a shard slot, ``shard_nbytes`` bytes) and then all-gathered on the
    comm stream into a full slot, in ``ceil(shard / chunk_bytes)`` chunks (one when ``None``).
    Rank-local components load whole blocks. The schedule is the same on every rank; the runtime
    derives each rank's shard offset as ``rank * shard_nbytes(block, world)``.
    """
    return _ring_policy("distributed_layerwise", depth, resident, gather=True, chunk_bytes=chunk_bytes)


#: Strategy -> the factory of its built-in policy: the one place a strategy name becomes a policy.
BUILTINS: Mapping[Strategy, Callable[..., Declared]] = MappingProxyType(
    {
        "none": none,
        "model_level": model_level,
        "layerwise": layerwise,
        "distributed_layerwise": distributed_layerwise,
    }
)
#: The knobs each built-in policy takes: its factory's parameters (`builtin` refuses any other).
_KNOBS: Mapping[str, frozenset[str]] = MappingProxyType(
    {name: frozenset(inspect.signature(factory).parameters) for name, factory in BUILTINS.items()}
)


def builtin(
    strategy: str, *, depth: int = 1, resident: Iterable[str] = (), chunk_bytes: int | None = None
) -> Declared:
    """The built-in policy of ``strategy`` with its knobs: ``depth`` (blocks in flight, ring
    strategies), ``resident`` (extra block paths kept on the device, ring strategies) and
    ``chunk_bytes`` (all-gather chunk size, ``distributed_layerwise``).

    A knob the strategy does not take, set away from its default, is a `PlanError` (it would be
    silently ignored otherwise); so is an unknown strategy.
    """
    if strategy not in BUILTINS:
        raise PlanError(
            f"policies.builtin({strategy!r}): no built-in policy has that name; choose one of "
            f"{', '.join(map(repr, STRATEGIES))}"
        )
    name = cast("Strategy", strategy)
    values = {"depth": depth, "resident": tuple(resident), "chunk_bytes": chunk_bytes}
    defaults = {"depth": 1, "resident": (), "chunk_bytes": None}
    stray = sorted(k for k, v in values.items() if v != defaults[k] and k not in _KNOBS[name])
    if stray:
        takes = sorted(_KNOBS[name])
        what = f"takes only {', '.join(takes)}" if takes else "takes no knobs"
        raise PlanError(
            f"policies.builtin({strategy!r}): the {strategy} policy {what}, and "
            f"{', '.join(stray)} was set; drop it, or choose a strategy that uses it "
            f"({'distributed_layerwise' if 'chunk_bytes' in stray else 'layerwise or distributed_layerwise'})"
        )
    return BUILTINS[name](**{k: v for k, v in values.items() if k in _KNOBS[name]})


def cached(policy: Policy, maxsize: int | None = 1024) -> Policy:
    """``policy`` memoised by ``(plan, step)``: valid because policies are pure and their inputs hashable."""
    memo: Policy = lru_cache(maxsize=maxsize)(policy)
    if isinstance(policy, Declared):
        return declare(memo, name=policy.name, index_free=policy.index_free)
    return memo
