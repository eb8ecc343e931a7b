"""What a plan means for scheduling: forward order, units, their sizes and who keeps what.

Pure helpers shared by the policies, `check` and `auto`. A *unit* is a block path, a remainder
(``rest_unit(path)``) or a whole component path; see `torchferry.policies._ir`.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import attrs

from torchferry.policies._ir import rest_unit
from torchferry.topology import Block, Component, Plan

__all__ = [
    "Layout",
    "forward_blocks",
    "layout",
    "shard_nbytes",
    "transfer_of",
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


def _has_blocks(component: Component) -> bool:
    return any(s.blocks for c in component.walk() for s in c.stacks)


def transfer_of(plan: Plan, component: Component) -> str:
    """``allgather`` when the distributed strategy shards ``component``'s blocks, else ``rank-local``."""
    kind = component.kind
    if kind == "dit":
        return plan.config.transfer("dit")
    if kind == "encoder":
        return plan.config.transfer("text_encoder")
    return "rank-local"


@attrs.frozen(kw_only=True)
class Layout:
    """The scheduling facts of one plan under one resident-block choice.

    - ``sizes``: bytes of every unit the plan can name (blocks, remainders, whole components).
    - ``kept``: units that get their own device memory once and keep it (remainders, unstreamed
      components, resident blocks), in plan order.
    - ``acquired``: on-demand component -> bytes its own lifecycle brings to the device.
    - ``streamed``: component path -> the blocks its forward streams through the ring, in order.
    - ``resident``: block paths kept on the device for good.
    - ``owner``: block path -> the top-level component it belongs to.
    - ``covers``: unit -> the top-level component whose forward reads it.
    - ``allgather``: streamed block paths whose transfer is sharded and all-gathered.
    """

    sizes: dict[str, int]
    kept: tuple[str, ...]
    acquired: dict[str, int]
    streamed: dict[str, tuple[Block, ...]]
    resident: frozenset[str]
    owner: dict[str, str]
    covers: dict[str, str]
    allgather: frozenset[str]

    def top_kept(self, top: str) -> tuple[str, ...]:
        """Kept units read by the forward of top-level component ``top``."""
        return tuple(u for u in self.kept if self.covers.get(u) == top)

    def top_acquired(self, top: str) -> tuple[str, ...]:
        return tuple(u for u in self.acquired if self.covers.get(u) == top)

    @property
    def largest_streamed(self) -> int:
        return max((b.nbytes for blocks in self.streamed.values() for b in blocks), default=0)


def _walk_units(
    plan: Plan,
    top: Component,
    component: Component,
    extra: frozenset[str],
    out: _Units,
) -> None:
    if component.on_demand:
        streamed = sum(b.nbytes for b in forward_blocks(component) if _streams(b, component, extra, plan))
        out.acquired[component.path] = component.nbytes - streamed
        out.covers[component.path] = top.path
        return
    if not _has_blocks(component):
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
        _walk_units(plan, top, child, extra, out)


def _streams(block: Block, component: Component, extra: frozenset[str], plan: Plan) -> bool:
    if block.path in extra:
        return False
    for c in component.walk():
        for s in c.stacks:
            if block in s.resident:
                return False
    return True


@attrs.define
class _Units:
    kept: list[str] = attrs.field(factory=list)
    sizes: dict[str, int] = attrs.field(factory=dict)
    acquired: dict[str, int] = attrs.field(factory=dict)
    covers: dict[str, str] = attrs.field(factory=dict)
    resident: set[str] = attrs.field(factory=set)


def _iter_blocks(top: Component) -> Iterator[tuple[Component, Block, bool]]:
    for c in top.walk():
        for s in c.stacks:
            for i, b in enumerate(s.blocks):
                yield c, b, i < s.resident_head


@lru_cache(maxsize=256)
def layout(plan: Plan, extra_resident: frozenset[str] = frozenset()) -> Layout:
    """The `Layout` of ``plan`` with ``extra_resident`` block paths kept on the device as well."""
    out = _Units()
    streamed: dict[str, tuple[Block, ...]] = {}
    owner: dict[str, str] = {}
    allgather: set[str] = set()
    for top in plan.components:
        _walk_units(plan, top, top, extra_resident, out)
        out.sizes[top.path] = top.nbytes
        blocks: list[Block] = []
        gathers = (
            plan.config.distributed and plan.config.dp_size > 1 and transfer_of(plan, top) == "allgather"
        )
        for c in top.walk():
            out.sizes.setdefault(c.path, c.nbytes)
            out.sizes[rest_unit(c.path)] = c.rest_bytes
        for _, b, head in _iter_blocks(top):
            owner[b.path] = top.path
            out.sizes[b.path] = b.nbytes
            if not head and b.path not in extra_resident:
                blocks.append(b)
                out.covers[b.path] = top.path
                if gathers:
                    allgather.add(b.path)
        streamed[top.path] = tuple(blocks)
    return Layout(
        sizes=out.sizes,
        kept=tuple(out.kept),
        acquired=out.acquired,
        streamed=streamed,
        resident=frozenset(out.resident),
        owner=owner,
        covers=out.covers,
        allgather=frozenset(allgather),
    )
