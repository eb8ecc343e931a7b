"""What `torchferry plan --host-memory` adds: where each component's packs live under the host
budget (`policies.tiers`), the host bytes they take, and the slowest read rate the step hides."""

from __future__ import annotations

import math

import attrs

from torchferry import policies
from torchferry.policies import CostModel, Policy, Schedule
from torchferry.topology import Plan

__all__ = ["HostTier", "TierRow", "hidden_down_to", "host_tier"]


@attrs.frozen(kw_only=True)
class TierRow:
    """Where one component's packs live under the host budget: host bytes, file-tier bytes, blocks."""

    path: str
    host_bytes: int
    file_bytes: int
    blocks: int
    file_blocks: int
    rest_in_file: bool
    #: Bytes of its file-tier packs by how often they are read (`policies.tiers` heats).
    reads: tuple[tuple[str, int], ...] = ()

    @property
    def tier(self) -> str:
        """``host``, ``file``, or which part is in the file tier (``19 of 40 blocks in file``)."""
        if not self.file_bytes:
            return "host"
        if not self.host_bytes:
            return "file"
        parts = [f"{self.file_blocks} of {self.blocks} blocks"] if self.file_blocks else []
        if self.rest_in_file:
            parts.append("remainder")
        return f"{' + '.join(parts)} in file" if parts else "part in file"


@attrs.frozen(kw_only=True)
class HostTier:
    """The recommended plan's tiers: per component, the staging slots, the host bytes in all, and the
    slowest read rate at which the simulated step stays within 1% of one with free reads."""

    budget: int
    read_bytes_per_s: float
    read_source: str
    rows: tuple[TierRow, ...]
    staging: tuple[int, ...]
    host_bytes: int
    #: Of ``host_bytes``: the reader's bounce buffers (`policies.Tiers.read_buffer_bytes`).
    read_buffer_bytes: int
    store_bytes: int
    read_bytes: tuple[tuple[str, int], ...]
    #: Of ``host_bytes``: kept, widened and scratch buffers of file-tier packs; the open's copy of a pack.
    kept_bytes: int = 0
    transient_bytes: int = 0
    #: The plan's digest and its file-tier packs, as the session that runs it reports them.
    digest: str = ""
    file_packs: tuple[str, ...] = ()
    hidden_down_to: float | None = None
    #: The steady DiT forward simulated with free reads, and at ``read_bytes_per_s``.
    forward_free_reads_s: float = 0.0
    forward_s: float = 0.0
    #: The component that steady step runs, and the bytes one of its forwards reads from the file.
    forward_component: str = ""
    forward_read_bytes: int = 0


def host_tier(
    budget: int, plan: Plan, steady: Schedule | None, cost: CostModel, source: str, *, policy: Policy
) -> HostTier:
    """The tiers of ``plan`` under host budget ``budget``, and how slow reads may get before
    ``steady`` (its steady DiT step under ``policy``, read rate from ``cost``, named by ``source``)
    slows."""
    t = policies.tiers(plan)
    # What the policy keeps on the device once staged (none(), auto's resident blocks) is read once a
    # session: the same function the session's report reads its frequencies from.
    reads = policies.policy_reads(policy, plan, t)
    rows = []
    for c in plan.components:
        packs = policies.unit_packs(plan, c.path)
        blocks = {b.path for cc in c.walk() for b in cc.blocks}
        infile = [p for p in packs if p in t.file]
        pinned = sum(policies.page_bytes(policies.pack_bytes(plan, p)) for p in packs if p not in t.file)
        rows.append(
            TierRow(
                path=c.path,
                host_bytes=pinned,
                file_bytes=sum(policies.pack_bytes(plan, p) for p in infile),
                blocks=len(blocks),
                file_blocks=sum(p in blocks for p in infile),
                rest_in_file=any(p not in blocks for p in infile),
                reads=tuple((h, reads[c.path][h]) for h in ("forward", "call", "session")),
            )
        )
    floor, free = hidden_down_to(steady, cost) if steady is not None else (None, 0.0)
    forward = policies.simulate(steady, cost).makespan_s if steady is not None else 0.0
    return HostTier(
        budget=budget,
        read_bytes_per_s=cost.read_bytes_per_s,
        read_source=source,
        rows=tuple(rows),
        staging=tuple(s.nbytes for s in t.staging),
        host_bytes=t.host_bytes,
        read_buffer_bytes=t.read_buffer_bytes,
        store_bytes=t.store_bytes,
        read_bytes=tuple((h, sum(r[h] for r in reads.values())) for h in policies.HEATS),
        kept_bytes=t.kept_bytes,
        transient_bytes=t.transient_bytes,
        digest=plan.digest,
        file_packs=tuple(sorted(t.file)),
        hidden_down_to=floor,
        forward_free_reads_s=free,
        forward_s=forward,
        forward_component=steady.step.component if steady is not None else "",
        forward_read_bytes=policies.file_read_bytes(steady) if steady is not None else 0,
    )


def hidden_down_to(steady: Schedule, cost: CostModel) -> tuple[float | None, float]:
    """The slowest read rate at which ``steady`` simulates within 1% of its time with free reads
    (``None`` when it reads nothing), and that time."""
    free = policies.simulate(steady, attrs.evolve(cost, read_bytes_per_s=math.inf)).makespan_s
    if not policies.file_read_bytes(steady):
        return None, free

    def hidden(rate: float) -> bool:
        return policies.simulate(steady, attrs.evolve(cost, read_bytes_per_s=rate)).makespan_s <= free * 1.01

    lo, hi = 1e6, 1e13  # bytes per second: lo hides nothing worth planning, hi hides everything
    if not hidden(hi):
        return None, free
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi, free
