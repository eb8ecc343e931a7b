"""Tiers: where each pack of a plan lives between its uses, in pinned host memory or in the *file
tier* (the checkpoint itself, read on demand into pinned staging slots), chosen within the host
budget by a pure function of the plan.

[Note: tiers]
Host bytes are what torchferry's own host buffers hold at once: the pinned store (one buffer per
pack in host memory, whole pages, an all-gathered block's shard only), the staging slots file
reads go through, and the reader's bounce buffers for direct I/O (`read_buffer_bytes`, only when
something is in the file tier). With no host budget (``config.host_memory_bytes is None``), or
when every pack fits it, nothing is in the file tier and every schedule is what it always was.

Otherwise packs leave host memory coldest first, by how often the file tier would read them:
packs the plan keeps on the device once staged (remainders, resident heads, whole components that
stay) are read once per session; encoder blocks and components swapped per call (model-level) once
per call; streamed DiT blocks every forward, so they go last. Within a class the last blocks go
first, the DiTs' in turn, so two experts share the reads. `STAGING_SLOTS` slots, each as large as
the largest pack in the file tier, carry the reads; since a larger slot costs host bytes, every
largest-pack size is tried and the choice that reads the fewest bytes per forward (then per call,
then per session; then the fewest host bytes) wins. The choice depends on the plan alone, so every
policy of a session, and auto's re-choices, name the same `Schedule.file`, and the runtime lays out
its host store once.

Where the device's memory is host memory (`reads_direct`: a CPU device, whose slots the reader can
fill itself) a staging slot would be a second host copy of what the device slot holds: such a plan
has none, its loads and stages name `FILE` as their source, and only the read buffers are counted
beside the store (`DIRECT_DEVICES`). A CUDA device keeps its pinned staging slots and copy stream.
"""

from __future__ import annotations

import mmap
from collections.abc import Collection, Iterable, Mapping
from functools import lru_cache
from typing import Literal

import attrs

from torchferry import topology
from torchferry._errors import Flag, Part, said
from torchferry.policies._ir import Slot
from torchferry.policies._layout import has_blocks, layout, pack_bytes, pack_table, swaps, unit_packs
from torchferry.policies._refusal import HostBudgetTooSmall
from torchferry.policies._tokens import format_bytes
from torchferry.topology import FrozenMap, Plan, TensorSpec

__all__ = [
    "BOUNCE_MAX",
    "DIRECT_ALIGN",
    "DIRECT_DEVICES",
    "HEATS",
    "PAGE",
    "READ_BOUNCE_BYTES",
    "READ_THREADS",
    "STAGING_SLOTS",
    "Heat",
    "Tiers",
    "bounce_bytes",
    "bounce_count",
    "file_packs",
    "host_bytes",
    "pack_heats",
    "page_bytes",
    "read_buffer_bytes",
    "read_nbytes",
    "reads_direct",
    "staging_count",
    "tiers",
    "tiers_at",
    "use_read_bytes",
]

#: The host page size: host buffers start on a page and are counted (and pinned) in whole pages.
PAGE = mmap.PAGESIZE
#: Staging slots of a plan with a file tier: one being read into while the other is copied out.
STAGING_SLOTS = 2
#: Device types whose slots are host memory the file tier's reader fills itself (no staging slot).
#: Not MPS: its memory is the host's, but its tensors are not the reader's to write.
DIRECT_DEVICES = frozenset({"cpu"})
#: Reader threads of the file tier, each with its own bounce buffer for direct I/O and its own
#: scratch for a read whose strides differ.
READ_THREADS = 4
#: The alignment ``O_DIRECT`` needs of offsets, lengths and buffers (the largest logical block size).
DIRECT_ALIGN = 4096
#: The most one reader thread's bounce buffer holds: its largest direct chunk and an aligned block at
#: each end.
BOUNCE_MAX = 4 << 20
#: The most host bytes the reader's bounce buffers take (`READ_THREADS` of `BOUNCE_MAX`: 16 MiB).
READ_BOUNCE_BYTES = READ_THREADS * BOUNCE_MAX

#: How often the file tier reads a pack: once a session, once a pipeline call, every DiT forward.
Heat = Literal["session", "call", "forward"]
HEATS: tuple[Heat, ...] = ("session", "call", "forward")


def reads_direct(plan: Plan) -> bool:
    """Whether ``plan``'s file tier reads straight into device slots (see [Note: tiers]): its device
    is host memory (`StoreFacts.host_device`) and no block is all-gathered (a shard is read into a
    staging slot, then loaded into its shard slot and gathered, as on any device)."""
    return plan.facts.host_device and not layout(plan).allgather


def staging_count(plan: Plan) -> int:
    """How many staging slots a file tier of ``plan`` reads through: `STAGING_SLOTS`, or none where
    the reader fills the device slots itself (`reads_direct`)."""
    return 0 if reads_direct(plan) else STAGING_SLOTS


def page_bytes(nbytes: int) -> int:
    """Bytes of host memory a buffer of ``nbytes`` occupies: whole pages, none when empty."""
    return -(-nbytes // PAGE) * PAGE


def bounce_bytes(largest: int) -> int:
    """One reader thread's bounce buffer when the largest pack the file tier reads is ``largest``
    bytes: that pack's span aligned out to `DIRECT_ALIGN` at both ends (one chunk reads it whole),
    at most `BOUNCE_MAX` (a larger pack reads in chunks), in whole pages."""
    aligned = -(-largest // DIRECT_ALIGN) * DIRECT_ALIGN + 2 * DIRECT_ALIGN
    return page_bytes(min(BOUNCE_MAX, aligned))


def bounce_count(largest: int) -> int:
    """How many bounce buffers the reader keeps when the largest pack the file tier reads is
    ``largest`` bytes: one per chunk that can be in flight (the `STAGING_SLOTS` reads at once, each in
    as many chunks as a bounce buffer cuts it into), at most one per reader thread. A thread waits for
    a free buffer, so fewer buffers than threads only serialize reads that one chunk each does not
    spread over threads anyway."""
    chunk = bounce_bytes(largest) - 2 * DIRECT_ALIGN
    return min(READ_THREADS, STAGING_SLOTS * -(-largest // chunk))


def read_buffer_bytes(largest: int) -> int:
    """Host bytes of the reader's bounce buffers for a file tier whose largest pack read is
    ``largest`` bytes (`bounce_count` x `bounce_bytes`: two of a small pack's span, 16 MiB for packs
    of 4 MiB and over); none without a file tier (``largest`` 0). A small model's file tier takes
    no more than it reads."""
    return bounce_count(largest) * bounce_bytes(largest) if largest > 0 else 0


@attrs.frozen(kw_only=True)
class Tiers:
    """Which packs of a plan are in the file tier, the staging slots their reads use, and the host
    bytes that leaves (see [Note: tiers]).

    - ``file``: the packs with no host copy, read from the checkpoint when needed (`Schedule.file`).
    - ``staging``: the staging slots (``t0``, ``t1``; kind ``staging``), empty without a file tier
      and where the reader fills device slots itself (`reads_direct`).
    - ``host_bytes``: the host bytes `check` proves against the budget ([8]), the whole host figure:
      ``store_bytes`` plus the staging slots and the read buffers (`read_buffer_bytes`; both only with a
      file tier), and
      what the plan's `StoreFacts` add (``kept_bytes``, ``transient_bytes``), whole pages.
    - ``store_bytes``: the pinned store, the packs in host memory.
    - ``budget``: ``config.host_memory_bytes`` (``None``: no host budget).
    - ``read_bytes``: bytes the file tier reads, by how often (`Heat`).
    - ``notes``: what was chosen and what it costs, in words (schedules carry them).
    """

    file: frozenset[str]
    staging: tuple[Slot, ...]
    host_bytes: int
    store_bytes: int
    budget: int | None
    read_bytes: FrozenMap[str, int] = attrs.field(factory=FrozenMap)
    notes: tuple[str, ...] = ()
    #: Of ``host_bytes``: the kept, widened and scratch buffers of file-tier packs (`extra_bytes`).
    kept_bytes: int = 0
    #: Of ``host_bytes``: the open's copy of one pack while the store copies the pipeline's weights in.
    transient_bytes: int = 0
    #: The least budget that chooses these very tiers (``budget`` may be larger): the plan of a budget
    #: measured on the machine carries this, so free memory that moves a little plans the same.
    least_budget: int = 0
    #: The largest pack the file tier reads (each staging slot's size; 0 without a file tier): it
    #: sizes the reader's bounce buffers, staging slots or none.
    largest: int = 0

    @property
    def read_buffer_bytes(self) -> int:
        """Of ``host_bytes``: the reader's bounce buffers (`read_buffer_bytes` of the largest pack
        read; 0 without a file tier)."""
        return read_buffer_bytes(self.largest) if self.file else 0


def file_packs(plan: Plan, file: Collection[str], unit: str) -> tuple[str, ...]:
    """The packs of ``unit`` that are in the file tier ``file``."""
    return tuple(p for p in unit_packs(plan, unit) if p in file)


def read_nbytes(plan: Plan, file: Collection[str], unit: str) -> int:
    """Bytes a read of ``unit`` moves from the checkpoint: its file-tier packs (shards when
    all-gathered); 0 when none of its packs is in the file tier."""
    return sum(pack_bytes(plan, p) for p in file_packs(plan, file, unit))


def host_bytes(plan: Plan, file: Collection[str], staging: Collection[Slot]) -> tuple[int, int]:
    """(host bytes, store bytes) of ``plan`` with ``file`` in the file tier and ``staging`` slots: the
    store, the slots, the read buffers (sized by the largest slot, or with none by the largest
    file-tier pack), and what the plan's `StoreFacts` add (`extra_bytes`)."""
    store = sum(page_bytes(pack_bytes(plan, name)) for name, _ in pack_table(plan) if name not in file)
    slot = read_size(plan, file, (s.nbytes for s in staging))
    extra = sum(page_bytes(s.nbytes) for s in staging) + (read_buffer_bytes(slot) if file else 0)
    return store + extra + sum(extra_bytes(plan, file)), store


def largest_read(plan: Plan, file: Collection[str]) -> int:
    """The largest pack in the file tier ``file`` (0: none), which sizes staging slots and read buffers."""
    return max((pack_bytes(plan, name) for name in file), default=0)


def read_size(plan: Plan, file: Collection[str], staging: Iterable[int]) -> int:
    """The read the reader's buffers are cut for: the largest staging slot (``staging``: their bytes),
    or with none (the reader fills device slots itself, `reads_direct`) the largest file-tier pack."""
    return max(staging, default=0) or largest_read(plan, file)


def kept_bytes(plan: Plan, name: str) -> int:
    """Host bytes pack ``name`` still holds in the file tier: its non-persistent buffers (no checkpoint
    holds them) and its tensors widened to float32 (`StoreFacts.widened`), whole pages each."""
    widened = plan.facts.widened
    return sum(
        page_bytes(s.nbytes)
        for s in _specs(plan)[name]
        if (s.buffer and not s.persistent) or s.name in widened
    )


def use_read_bytes(plan: Plan, name: str) -> int:
    """Bytes a use of file-tier pack ``name`` reads from the files: the pack less the tensors it keeps
    in host memory for the session (`kept_bytes`: non-persistent buffers, widened tensors)."""
    widened = plan.facts.widened
    kept = sum(s.nbytes for s in _specs(plan)[name] if (s.buffer and not s.persistent) or s.name in widened)
    return pack_bytes(plan, name) - kept


def scratch_bytes(largest: int) -> int:
    """The reader's scratch for a tensor of ``largest`` bytes stored with other strides than the file's
    (per reader thread, twice the tensor); none when ``largest`` is 0."""
    return READ_THREADS * page_bytes(2 * largest) if largest else 0


def extra_bytes(plan: Plan, file: Collection[str]) -> tuple[int, int, int]:
    """Host bytes beyond the store, slots and read buffers, with ``file`` in the file tier: (kept and
    widened buffers of file-tier packs, the reader's scratch, the open's copy of the largest pack in host
    memory when the store copies the pipeline's own weights in)."""
    facts = plan.facts
    kept = sum(kept_bytes(plan, n) for n in file)
    strided = max((_strided(plan, n) for n in file), default=0)
    transient = 0
    if facts.copied:
        held = (page_bytes(pack_bytes(plan, n)) for n, _ in pack_table(plan) if n not in file)
        transient = max(held, default=0)
    return kept, scratch_bytes(strided), transient


def _specs(plan: Plan) -> Mapping[str, tuple[TensorSpec, ...]]:
    return dict(pack_table(plan))


def _strided(plan: Plan, name: str) -> int:
    strided = plan.facts.strided
    return max((s.nbytes for s in _specs(plan)[name] if s.name in strided), default=0)


def unfiled(plan: Plan) -> dict[str, tuple[Part, ...]]:
    """Pack -> why it cannot be in the file tier, in parts naming the request's fields: held in
    ``storage_dtype=`` (the file tier reads bytes as stored), or of a component that keeps its own
    weights (`StoreFacts.own`)."""
    out: dict[str, tuple[Part, ...]] = {}
    specs = _specs(plan)
    for top in plan.components:
        for name in unit_packs(plan, top.path):
            if top.path in plan.facts.own:
                out[name] = (
                    f"{top.path!r} keeps its own weights (passed by keyword, or left out of "
                    "checkpoint_components=), which are not the checkpoint's",
                )
            elif cast := [t.dtype for t in specs[name] if t.compute_dtype is not None]:
                held = Flag(f"storage_dtype={cast[0]!r}", f"--storage-dtype {cast[0]}")
                out[name] = ("packs held in ", held, " would be read back in the model's own dtypes")
    return out


def pack_heats(plan: Plan) -> dict[str, Heat]:
    """Pack -> how often the file tier would read it (see [Note: tiers]), for reports."""
    return {name: heat for name, (heat, _, _) in _heats(plan).items()}


def _heats(plan: Plan) -> dict[str, tuple[Heat, int, int]]:
    """Pack -> (how often the file tier would read it, place from the end within its class, top)."""
    lay = layout(plan)
    out: dict[str, tuple[Heat, int, int]] = {}
    for index, top in enumerate(plan.components):
        if top.on_demand:
            continue
        streamed = lay.streamed.get(top.path, ())
        hot: Heat = "forward" if top.kind == "dit" else "call"
        for k, block in enumerate(reversed(streamed)):
            out[block.path] = (hot, k, index)
        cold: Heat = "call" if plan.config.strategy == "model_level" and swaps(top) else "session"
        rest = [p for p in unit_packs(plan, top.path) if p not in out]
        for k, name in enumerate(reversed(rest)):
            out[name] = (cold, k, index)
    return out


@attrs.frozen
class _Option:
    file: tuple[str, ...]
    slot: int
    host: int
    store: int
    read: Mapping[Heat, int]
    extras: tuple[int, int, int]

    def cost(self) -> tuple[int, ...]:
        return (self.read["forward"], self.read["call"], self.read["session"], self.host)


@attrs.frozen
class _Least:
    """The smallest host figure any tiering reaches, and what makes it up."""

    need: int
    store: int
    largest: int
    extras: tuple[int, int, int]


@lru_cache(maxsize=64)
def tiers(plan: Plan) -> Tiers:
    """The tier of every pack of ``plan`` within ``config.host_memory_bytes`` (see [Note: tiers]).

    Pure and cached: it depends on the plan alone (its `StoreFacts` included: every extra a pack
    holds in the file tier is counted as that pack is chosen, so the figure is the whole host figure).
    A budget that no tiering fits is a `HostBudgetTooSmall` naming the smallest budget that opens.
    """
    return tiers_at(plan, plan.config.host_memory_bytes)


def tiers_at(plan: Plan, budget: int | None) -> Tiers:
    """`tiers` of ``plan`` within ``budget`` instead of its own, not cached: the host planner probes a
    budget measured on the machine with it, so no cache keeps a plan per measurement."""
    sizes = {name: pack_bytes(plan, name) for name, _ in pack_table(plan)}
    whole, whole_store = host_bytes(plan, (), ())
    if budget is None or whole <= budget:
        transient = extra_bytes(plan, ())[2]
        return Tiers(
            file=frozenset(), staging=(), host_bytes=whole, store_bytes=whole_store, budget=budget,
            transient_bytes=transient, least_budget=whole,
        )  # fmt: skip
    heats = _heats(plan)
    barred = unfiled(plan)
    order = {n: (HEATS.index(heats[n][0]), heats[n][1], heats[n][2]) for n in sizes if n not in barred}
    ranked = sorted(order, key=order.__getitem__)
    by_size = sorted(sizes, key=lambda n: -page_bytes(sizes[n]))
    kept_of = {n: kept_bytes(plan, n) for n in ranked}
    strided_of = {n: _strided(plan, n) for n in ranked}
    best: _Option | None = None
    # The largest total any fitting pass stopped at: every budget from it up stops each pass where
    # this one did, so it chooses the same tiers.
    floor = 0
    least = _Least(need=whole, store=whole_store, largest=0, extras=extra_bytes(plan, ()))
    slots = staging_count(plan)
    for largest in sorted({sizes[n] for n in ranked}):
        fixed = slots * page_bytes(largest) + read_buffer_bytes(largest)
        store = whole_store
        kept = strided = 0
        chosen: list[str] = []
        filed: set[str] = set()
        top = 0  # the first pack of `by_size` still in host memory: the open's transient copy
        total, extras = 0, (0, 0, 0)
        fits = False
        for name in (n for n in ranked if sizes[n] <= largest):
            chosen.append(name)
            filed.add(name)
            store -= page_bytes(sizes[name])
            kept += kept_of[name]
            strided = max(strided, strided_of[name])
            while top < len(by_size) and by_size[top] in filed:
                top += 1
            copy = page_bytes(sizes[by_size[top]]) if plan.facts.copied and top < len(by_size) else 0
            extras = (kept, scratch_bytes(strided), copy)
            total = store + fixed + sum(extras)
            if total < least.need or (total == least.need and not least.largest):
                least = _Least(need=total, store=store, largest=largest, extras=extras)
            if total <= budget:
                fits = True
                floor = max(floor, total)
                break
        if not fits:
            continue
        slot = max(sizes[n] for n in chosen)
        read = {h: sum(sizes[n] for n in chosen if heats[n][0] == h) for h in HEATS}
        option = _Option(
            file=tuple(chosen),
            slot=slot,
            host=total
            - slots * (page_bytes(largest) - page_bytes(slot))
            - (read_buffer_bytes(largest) - read_buffer_bytes(slot)),
            store=store,
            read=read,
            extras=extras,
        )
        if best is None or option.cost() < best.cost():
            best = option
    if best is None:
        raise _too_small(plan, budget, least, barred)
    staging = tuple(Slot(name=f"t{i}", nbytes=best.slot, kind="staging") for i in range(slots))
    kept, scratch, transient = best.extras
    return Tiers(
        file=frozenset(best.file),
        staging=staging,
        host_bytes=best.host,
        store_bytes=best.store,
        budget=budget,
        read_bytes=FrozenMap(tuple(best.read.items())),
        notes=_notes(best, len(sizes), budget, slots),
        kept_bytes=kept + scratch,
        transient_bytes=transient,
        least_budget=floor,
        largest=best.slot,
    )


def _notes(best: _Option, packs: int, budget: int, slots: int) -> tuple[str, ...]:
    def b(n: int) -> str:
        return format_bytes(n, exact=False)

    kept = packs - len(best.file)
    how: dict[Heat, str] = {
        "forward": "every DiT forward",
        "call": "once a call",
        "session": "once a session",
    }
    reads = ", ".join(f"{b(best.read[h])} {how[h]}" for h in reversed(HEATS) if best.read[h])
    staging = f"{slots} staging slots of {b(best.slot)}" if slots else "read straight into device slots"
    return (
        f"host {b(best.host)} of {b(budget)}: {kept} packs pinned ({b(best.store)}), {staging}, "
        f"{b(read_buffer_bytes(best.slot))} read buffers",
        f"file tier: {len(best.file)} packs read from the checkpoint, {reads}",
    )


def _selection(plan: Plan, holder: str) -> tuple[str, ...]:
    """The selection under which ``holder`` streams, when the request's leaves it out (else none)."""
    kind = plan.component(holder).kind
    selector = "dit" if kind == "dit" else topology.encoder_type(holder, plan.topology.declaration)
    if kind == "vae":
        selector = None  # a VAE streams no blocks: nothing to select
    if selector is None or plan.config.offloads(selector):  # type: ignore[arg-type]
        return ()
    # A selected VAE stays only where it can be staged (its lifecycle declared); else it is dropped.
    declared = plan.topology.declaration
    lifecycles = () if declared is None else declared.on_demand_component_paths
    vaes = plan.of_kind("vae")
    staged = bool(vaes) and all(v.path in lifecycles for v in vaes)
    current = [c for c in topology.COMPONENT_NAMES if plan.config.offloads(c) and (c != "vae" or staged)]
    return tuple(c for c in topology.COMPONENT_NAMES if c in current or c == selector)


def _too_small(
    plan: Plan, budget: int, least: _Least, barred: Mapping[str, tuple[Part, ...]]
) -> HostBudgetTooSmall:
    biggest = max((name for name, _ in pack_table(plan)), key=lambda n: pack_bytes(plan, n))
    holder: str | None = biggest.partition(":")[0]
    if plan.block_owner(biggest) is not None or has_blocks(plan.component(holder or "")):
        holder = None  # only a component kept whole is helped by streaming its blocks
    elif not any(c.stacks for c in plan.topology.component(holder or "").walk()):
        holder = None  # and only one that has blocks to stream (a VAE has none)
    kept, scratch, transient = least.extras
    filed = least.largest > 0
    own = tuple(c.path for c in plan.components if c.path in plan.facts.own and any(
        n in barred for n in unit_packs(plan, c.path)
    ))  # fmt: skip
    cast = any(
        isinstance(p, Flag) and p.api.startswith("storage_dtype=") for why in barred.values() for p in why
    )
    why: tuple[Part, ...] = ()
    if barred:
        reasons: list[Part] = []
        for reason in sorted(set(barred.values()), key=said):
            reasons += [*(("; ",) if reasons else ()), *reason]
        why = (
            f"{len(barred)} pack(s) cannot be in the file tier, so they stay in host memory (",
            *reasons,
            ")",
        )
    return HostBudgetTooSmall(
        budget=budget,
        minimum=least.need,
        file_tier=filed,
        store=least.store,
        slots=staging_count(plan),
        largest=least.largest,
        bounce=read_buffer_bytes(least.largest),
        kept=kept + scratch,
        transient=transient,
        digest=plan.digest,
        holder=holder,
        select=() if holder is None else _selection(plan, holder),
        biggest=biggest,
        biggest_bytes=pack_bytes(plan, biggest),
        unfiled=why,
        own=own,
        cast=cast,
    )
