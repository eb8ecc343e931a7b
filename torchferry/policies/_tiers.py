"""Tiers: where each pack of a plan lives between its uses, in pinned host memory or in the *file
tier* (the checkpoint itself, read on demand into pinned staging slots), chosen within the host
budget by a pure function of the plan.

[Note: tiers]
Host bytes are what torchferry's own host buffers hold at once: the pinned store (one buffer per
pack in host memory, whole pages, an all-gathered block's shard only), the staging slots file
reads go through, and the reader's bounce buffers for direct I/O (`READ_BOUNCE_BYTES`, only when
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
"""

from __future__ import annotations

import mmap
from collections.abc import Collection, Mapping
from functools import lru_cache
from typing import Literal

import attrs

from torchferry._errors import PlanError
from torchferry.policies._ir import Slot
from torchferry.policies._layout import has_blocks, layout, pack_bytes, pack_table, swaps, unit_packs
from torchferry.policies._tokens import format_bytes
from torchferry.topology import FrozenMap, Plan

__all__ = [
    "HEATS",
    "PAGE",
    "READ_BOUNCE_BYTES",
    "STAGING_SLOTS",
    "Heat",
    "Tiers",
    "file_packs",
    "host_bytes",
    "pack_heats",
    "page_bytes",
    "read_nbytes",
    "tiers",
]

#: The host page size: host buffers start on a page and are counted (and pinned) in whole pages.
PAGE = mmap.PAGESIZE
#: Staging slots of a plan with a file tier: one being read into while the other is copied out.
STAGING_SLOTS = 2
#: Host bytes the reader keeps for direct I/O (two aligned 8 MiB bounce buffers), counted in the
#: host bytes whenever something is in the file tier.
READ_BOUNCE_BYTES = 2 * (8 << 20)

#: How often the file tier reads a pack: once a session, once a pipeline call, every DiT forward.
Heat = Literal["session", "call", "forward"]
HEATS: tuple[Heat, ...] = ("session", "call", "forward")


def page_bytes(nbytes: int) -> int:
    """Bytes of host memory a buffer of ``nbytes`` occupies: whole pages, none when empty."""
    return -(-nbytes // PAGE) * PAGE


@attrs.frozen(kw_only=True)
class Tiers:
    """Which packs of a plan are in the file tier, the staging slots their reads use, and the host
    bytes that leaves (see [Note: tiers]).

    - ``file``: the packs with no host copy, read from the checkpoint when needed (`Schedule.file`).
    - ``staging``: the staging slots (``t0``, ``t1``; kind ``staging``), empty without a file tier.
    - ``host_bytes``: the host bytes `check` proves against the budget ([8]): ``store_bytes`` plus
      the staging slots and `READ_BOUNCE_BYTES` (both only with a file tier), whole pages.
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


def file_packs(plan: Plan, file: Collection[str], unit: str) -> tuple[str, ...]:
    """The packs of ``unit`` that are in the file tier ``file``."""
    return tuple(p for p in unit_packs(plan, unit) if p in file)


def read_nbytes(plan: Plan, file: Collection[str], unit: str) -> int:
    """Bytes a read of ``unit`` moves from the checkpoint: its file-tier packs (shards when
    all-gathered); 0 when none of its packs is in the file tier."""
    return sum(pack_bytes(plan, p) for p in file_packs(plan, file, unit))


def host_bytes(plan: Plan, file: Collection[str], staging: Collection[Slot]) -> tuple[int, int]:
    """(host bytes, store bytes) of ``plan`` with ``file`` in the file tier and ``staging`` slots."""
    store = sum(page_bytes(pack_bytes(plan, name)) for name, _ in pack_table(plan) if name not in file)
    extra = sum(page_bytes(s.nbytes) for s in staging) + (READ_BOUNCE_BYTES if file else 0)
    return store + extra, store


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

    def cost(self) -> tuple[int, ...]:
        return (self.read["forward"], self.read["call"], self.read["session"], self.host)


@lru_cache(maxsize=64)
def tiers(plan: Plan) -> Tiers:
    """The tier of every pack of ``plan`` within ``config.host_memory_bytes`` (see [Note: tiers]).

    Pure and cached: it depends on the plan alone. A budget that even the smallest host footprint
    the file tier allows does not fit is a `PlanError` naming the bytes and the remedies.
    """
    budget = plan.config.host_memory_bytes
    sizes = {name: pack_bytes(plan, name) for name, _ in pack_table(plan)}
    whole, _ = host_bytes(plan, (), ())
    if budget is None or whole <= budget:
        return Tiers(file=frozenset(), staging=(), host_bytes=whole, store_bytes=whole, budget=budget)
    heats = _heats(plan)
    ranked = sorted(sizes, key=lambda n: (HEATS.index(heats[n][0]), heats[n][1], heats[n][2]))
    best: _Option | None = None
    least: tuple[int, int, int] | None = None  # (host bytes, store bytes, slot) at the smallest
    for largest in sorted(set(sizes.values())):
        fixed = STAGING_SLOTS * page_bytes(largest) + READ_BOUNCE_BYTES
        store = whole
        chosen: list[str] = []
        for name in (n for n in ranked if sizes[n] <= largest):
            if store + fixed <= budget:
                break
            chosen.append(name)
            store -= page_bytes(sizes[name])
        if least is None or store + fixed < least[0]:
            least = (store + fixed, store, largest)
        if store + fixed > budget:
            continue
        slot = max(sizes[n] for n in chosen)
        read = {h: sum(sizes[n] for n in chosen if heats[n][0] == h) for h in HEATS}
        option = _Option(
            file=tuple(chosen),
            slot=slot,
            host=store + STAGING_SLOTS * page_bytes(slot) + READ_BOUNCE_BYTES,
            store=store,
            read=read,
        )
        if best is None or option.cost() < best.cost():
            best = option
    if best is None:
        assert least is not None
        raise PlanError(_too_small(plan, budget, *least))
    staging = tuple(Slot(name=f"t{i}", nbytes=best.slot, kind="staging") for i in range(STAGING_SLOTS))
    return Tiers(
        file=frozenset(best.file),
        staging=staging,
        host_bytes=best.host,
        store_bytes=best.store,
        budget=budget,
        read_bytes=FrozenMap(tuple(best.read.items())),
        notes=_notes(best, len(sizes), budget),
    )


def _notes(best: _Option, packs: int, budget: int) -> tuple[str, ...]:
    def b(n: int) -> str:
        return format_bytes(n, exact=False)

    kept = packs - len(best.file)
    how: dict[Heat, str] = {
        "forward": "every DiT forward",
        "call": "once a call",
        "session": "once a session",
    }
    reads = ", ".join(f"{b(best.read[h])} {how[h]}" for h in reversed(HEATS) if best.read[h])
    return (
        f"host {b(best.host)} of {b(budget)}: {kept} packs pinned ({b(best.store)}), {STAGING_SLOTS} staging "
        f"slots of {b(best.slot)}, {b(READ_BOUNCE_BYTES)} read buffers",
        f"file tier: {len(best.file)} packs read from the checkpoint, {reads}",
    )


def _too_small(plan: Plan, budget: int, need: int, store: int, largest: int) -> str:
    def b(n: int) -> str:
        return format_bytes(n, exact=False)

    biggest = max((name for name, _ in pack_table(plan)), key=lambda n: pack_bytes(plan, n))
    remedy = ""
    holder = biggest.partition(":")[0]
    whole = plan.block_owner(biggest) is None and not has_blocks(plan.component(holder))
    if whole:  # a component kept whole: streaming its blocks would make the largest pack a block
        remedy = (
            f", or stream the blocks of {holder!r} (strategy='layerwise' with it "
            f"selected) so the largest pack read is a block, not {biggest} ({b(pack_bytes(plan, biggest))})"
        )
    return (
        f"host budget {b(budget)} (config.host_memory_bytes) is too small for plan {plan.digest}: even "
        f"with packs read from the checkpoint (the file tier) its host buffers need {b(need)} "
        f"({STAGING_SLOTS} staging slots of {b(largest)}, the largest pack read; {b(READ_BOUNCE_BYTES)} "
        f"of read buffers; {b(store)} of packs in host memory); raise host_memory= to {b(need)}{remedy}"
    )
