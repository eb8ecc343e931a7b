"""What a plan means for scheduling: forward order, units, their sizes and who keeps what, and the
packs the host store holds them in.

Pure helpers shared by the policies, `check`, `auto`, `tiers` and the runtime's host store. A
*unit* is a block path, a remainder (``rest_unit(path)``) or a whole component path; see
`torchferry.policies._ir`. A *pack* is the tensors that share one flat host buffer: a block, a
remainder, or ``<top>:extra`` (a top-level component's tensors no plan component names); a unit
is one pack, or (a whole component) all the packs under it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from functools import lru_cache

import attrs

from torchferry.policies._ir import rest_unit
from torchferry.topology import Block, Component, Plan, TensorSpec, Transfer, pack, packed_nbytes

__all__ = [
    "PlanFacts",
    "extra_pack",
    "forward_blocks",
    "group_specs",
    "has_blocks",
    "layout",
    "pack_bytes",
    "pack_table",
    "shard_nbytes",
    "swaps",
    "transfer_of",
    "unit_packs",
]

_ALIGN = 16


def shard_nbytes(block_nbytes: int, world: int) -> int:
    """Bytes of one rank's shard of a block: ``ceil(nbytes / world)`` rounded up to a multiple of 16.

    Rank ``r`` owns bytes ``[r * shard, (r + 1) * shard)`` of the block's flat buffer, zero-padded
    past its end, so a full slot holds ``shard * world`` bytes. Every rank computes the same value.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if block_nbytes < 0:
        raise ValueError(f"block_nbytes must be >= 0, got {block_nbytes}")
    per = -(-block_nbytes // world)
    return -(-per // _ALIGN) * _ALIGN


def forward_blocks(component: Component) -> tuple[Block, ...]:
    """Every block a forward of ``component`` runs, in order: its stacks, then its children's."""
    return tuple(b for c in component.walk() for s in c.stacks for b in s.blocks)


def has_blocks(component: Component) -> bool:
    """Whether ``component`` or one of its children has a block to stream or keep."""
    return any(s.blocks for c in component.walk() for s in c.stacks)


def swaps(component: Component) -> bool:
    """Whether model-level swapping moves ``component`` whole: a selected DiT or encoder that does
    not own its residency (on-demand components bring themselves)."""
    return component.selected and component.kind in ("dit", "encoder") and not component.on_demand


def transfer_of(plan: Plan, component: Component) -> Transfer:
    """``allgather`` when the distributed strategy shards ``component``'s blocks, else ``rank-local``."""
    kind = component.kind
    if kind == "dit":
        return plan.config.transfer("dit")
    if kind == "encoder":
        return plan.config.transfer("text_encoder")
    return "rank-local"


@attrs.frozen(kw_only=True)
class PlanFacts:
    """The scheduling facts of one plan under one resident-block choice (shared by a cache: read only).

    - ``sizes``: bytes of every unit the plan can name (blocks, remainders, whole components).
    - ``kept``: units that get their own device memory once and keep it (remainders, unstreamed
      components, resident blocks), in plan order.
    - ``acquired``: on-demand component -> bytes its own lifecycle brings to the device.
    - ``streamed``: component path -> the blocks its forward streams through the ring, in order.
    - ``resident``: block paths kept on the device for good.
    - ``covers``: unit -> the top-level component whose forward reads it.
    - ``allgather``: streamed block paths whose transfer is sharded and all-gathered.
    """

    sizes: Mapping[str, int]
    kept: tuple[str, ...]
    acquired: Mapping[str, int]
    streamed: Mapping[str, tuple[Block, ...]]
    resident: frozenset[str]
    covers: Mapping[str, str]
    allgather: frozenset[str]

    def top_kept(self, top: str) -> tuple[str, ...]:
        """Kept units read by the forward of top-level component ``top``."""
        return tuple(u for u in self.kept if self.covers.get(u) == top)

    def top_acquired(self, top: str) -> tuple[str, ...]:
        """On-demand units acquired for the forward of top-level component ``top``."""
        return tuple(u for u in self.acquired if self.covers.get(u) == top)


def _walk_units(top: Component, component: Component, extra: frozenset[str], out: _Units) -> None:
    if component.on_demand:
        streamed = sum(b.nbytes for b, head in _iter_blocks(component) if not head and b.path not in extra)
        out.acquired[component.path] = component.nbytes - streamed
        out.covers[component.path] = top.path
        return
    if not has_blocks(component):
        out.kept.append(component.path)
        out.sizes[component.path] = component.nbytes
        out.covers[component.path] = top.path
        return
    if component.tensors:
        unit = rest_unit(component.path)
        out.kept.append(unit)
        out.sizes[unit] = component.rest_bytes
        out.covers[unit] = top.path
    for stack in component.stacks:
        for i, block in enumerate(stack.blocks):
            if i < stack.resident_head or block.path in extra:
                out.kept.append(block.path)
                out.resident.add(block.path)
                out.covers[block.path] = top.path
    for child in component.children:
        _walk_units(top, child, extra, out)


@attrs.define
class _Units:
    kept: list[str] = attrs.field(factory=list)
    sizes: dict[str, int] = attrs.field(factory=dict)
    acquired: dict[str, int] = attrs.field(factory=dict)
    covers: dict[str, str] = attrs.field(factory=dict)
    resident: set[str] = attrs.field(factory=set)


def _iter_blocks(top: Component) -> Iterator[tuple[Block, bool]]:
    """Every block of ``top`` in forward order, with whether it is in its stack's resident head."""
    for c in top.walk():
        for s in c.stacks:
            for i, b in enumerate(s.blocks):
                yield b, i < s.resident_head


@lru_cache(maxsize=256)
def layout(plan: Plan, extra_resident: frozenset[str] = frozenset()) -> PlanFacts:
    """The `PlanFacts` of ``plan`` with ``extra_resident`` block paths kept on the device as well."""
    out = _Units()
    streamed: dict[str, tuple[Block, ...]] = {}
    allgather: set[str] = set()
    for top in plan.components:
        _walk_units(top, top, extra_resident, out)
        out.sizes[top.path] = top.nbytes
        blocks: list[Block] = []
        # dp_size > 1 only under the distributed strategy, the only one whose transfer may all-gather.
        gathers = plan.config.dp_size > 1 and transfer_of(plan, top) == "allgather"
        for c in top.walk():
            out.sizes.setdefault(c.path, c.nbytes)
            out.sizes[rest_unit(c.path)] = c.rest_bytes
        for b, head in _iter_blocks(top):
            out.sizes[b.path] = b.nbytes
            if not head and b.path not in extra_resident:
                blocks.append(b)
                out.covers[b.path] = top.path
                if gathers:
                    allgather.add(b.path)
        streamed[top.path] = tuple(blocks)
    return PlanFacts(
        sizes=out.sizes,
        kept=tuple(out.kept),
        acquired=out.acquired,
        streamed=streamed,
        resident=frozenset(out.resident),
        covers=out.covers,
        allgather=frozenset(allgather),
    )


# ------------------------------------------------------------------------------------------- packs


def extra_pack(top_path: str) -> str:
    """The pack of a top-level component's tensors that no component of the plan names."""
    return f"{top_path}:extra"


@lru_cache(maxsize=64)
def pack_table(plan: Plan) -> tuple[tuple[str, tuple[TensorSpec, ...]], ...]:
    """Pack name -> tensors, in plan order: each block, each component's remainder, then each
    top-level component's leftovers (``<top>:extra``); a tensor is in the first pack that names it.

    Tensors of on-demand components are left to the component's own lifecycle and get no pack, but
    for their blocks (an on-demand encoder with block stacks streams those in rings; its lifecycle
    moves the rest). The host store allocates one buffer per pack (`group_specs`), `tiers` places each in host
    memory or the file tier, so both read this one table.
    """
    table: list[tuple[str, tuple[TensorSpec, ...]]] = []
    covered: set[str] = set()

    def add(name: str, tensors: Iterable[TensorSpec]) -> None:
        fresh = tuple(t for t in tensors if t.name not in covered)
        covered.update(t.name for t in fresh)
        if fresh:
            table.append((name, fresh))

    for top in plan.components:
        if top.on_demand:
            for c in top.walk():
                for block in c.blocks:
                    add(block.path, block.tensors)
            continue
        for c in top.walk():
            add(rest_unit(c.path), c.tensors)
            for block in c.blocks:
                add(block.path, block.tensors)
        add(extra_pack(top.path), plan.topology.component(top.path).all_tensors())
    return tuple(table)


def group_specs(plan: Plan) -> dict[str, list[TensorSpec]]:
    """`pack_table` as a fresh dict of lists (the host store's shape of it)."""
    return {name: list(specs) for name, specs in pack_table(plan)}


@lru_cache(maxsize=64)
def _pack_sizes(plan: Plan) -> Mapping[str, int]:
    return {name: packed_nbytes(pack(specs)) for name, specs in pack_table(plan)}


def pack_bytes(plan: Plan, name: str) -> int:
    """Bytes of pack ``name``'s flat buffer this rank holds: the whole pack, or for an all-gathered
    block its shard (`shard_nbytes`), as the host store allocates it and a file-tier read moves it."""
    nbytes = _pack_sizes(plan)[name]
    if name in layout(plan).allgather:
        return shard_nbytes(nbytes, plan.config.dp_size)
    return nbytes


@lru_cache(maxsize=64)
def _unit_table(plan: Plan) -> Mapping[str, tuple[str, ...]]:
    packs = _pack_sizes(plan)
    units: dict[str, tuple[str, ...]] = {}
    for top in plan.components:
        for c in top.walk():
            for name in (rest_unit(c.path), *(b.path for b in c.blocks)):
                units[name] = (name,) if name in packs else ()
            inner = [rest_unit(d.path) for d in c.walk()] + [b.path for d in c.walk() for b in d.blocks]
            if c is top:
                inner.append(extra_pack(top.path))
            units[c.path] = tuple(n for n in inner if n in packs)
    return units


def unit_packs(plan: Plan, unit: str) -> tuple[str, ...]:
    """The packs unit ``unit`` moves (a whole component: every pack under it, its extras included);
    ``()`` for a name that is no unit of the plan or holds no pack (an on-demand component)."""
    return _unit_table(plan).get(unit, ())
