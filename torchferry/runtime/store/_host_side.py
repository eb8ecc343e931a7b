"""The host side of a session's open: the one exchange of host budgets a process group needs; the file
tier laid out as the open plan decided it (its spill written); and the host figures a report shows.

[Note: the host side]
Nothing here decides (see [Note: the open planner]). `runtime.read_facts` reads what the machine, the
device, the module and the checkpoint are (`runtime/machine/_facts.py`: every bound on host memory,
the locked-memory limit and whether this device's pinner is held to it, the pipeline's own CPU bytes,
the read mode; float32 tensors the checkpoint stores in 16 bits, tensors stored with other strides,
components that keep their own weights). `policies.open_plan` decides the budgets, the tiers,
whether the store pins, and every refusal. Under a process group the ranks exchange the budget each
offers (`policies.offered_budget`) with `exchange_budgets`, the only collective before planning, and
every rank plans against the least. `open_tier` then carries the decided tiers out: it makes the spill
folder and writes a pipeline built in memory's file-tier packs there once.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs
import torch

from torchferry import policies
from torchferry.policies import HostBudget, Tiers
from torchferry.runtime.files import agreed, spill, spill_folder
from torchferry.runtime.store._file_tier import TierLayout
from torchferry.runtime.store._store import HostStore
from torchferry.topology import Plan

if TYPE_CHECKING:
    from torchferry.runtime.device import Comm

__all__ = [
    "HostPlan",
    "exchange_budgets",
    "host_figures",
    "host_side",
    "open_tier",
]


def _text(value: Any) -> str:
    """``repr`` of an option's value, the same in every process (a set's members sorted)."""
    if isinstance(value, (set, frozenset)):
        return repr(sorted(value))
    return repr(value)


def exchange_budgets(offered: HostBudget, group: Any, device: torch.device | None, plan: Plan) -> int:
    """The least host budget the ranks of ``group`` offer (each its `policies.offered_budget`), once
    they are found to ask for the same plan (`Comm.agree_request`, the session's first collective), so
    every rank plans the same tiers; ``None`` (no machine limit) counts as the largest."""
    from torchferry.runtime.device import Comm

    mine = policies.NO_LIMIT if offered.bytes is None else min(offered.bytes, policies.NO_LIMIT)
    # What the plan is (its digest's options), and the two runtime options that shape the collectives;
    # the others (budgets, the checkpoint's path, pinning) may differ between ranks.
    asked = plan.config.request
    request = {f.name: _text(getattr(asked, f.name)) for f in attrs.fields(type(asked))}
    request.update((k, _text(getattr(plan.config, k))) for k in ("prefetch_depth", "chunk_bytes"))
    target = torch.device("cpu") if device is None else device
    return min(Comm(group, target).agree_request(request, mine))


@attrs.frozen(kw_only=True)
class HostPlan:
    """The host side of a session as `policies.open_plan` decided it: the budget (and where it came
    from), the tiers (the whole host figure), what the page cache can keep beside torchferry's buffers
    (for choosing direct I/O; ``None``: unknown), whether the store pins, and the spill folder."""

    budget: HostBudget
    tiers: Tiers
    cache_bytes: int | None = None
    #: Whether the host store pins its buffers (`OpenPlan.pin`): the engine and the pinner read it.
    pin: bool = False
    spill: str | None = None
    #: On a device that shares host memory, the device budget taken from the host's, and its source.
    device_bytes: int | None = None
    device_source: str = ""
    #: How the file tier reads its files (`policies.HostFigure.read_mode`, read once with the facts).
    read_mode: str | None = None


def host_side(opened: policies.OpenPlan, spill: str | os.PathLike[str] | None) -> HostPlan:
    """The session's `HostPlan` from what the open planner decided and the spill folder given."""
    figure = opened.host
    return HostPlan(
        budget=figure.budget,
        tiers=figure.tiers,
        cache_bytes=figure.cache_bytes,
        pin=opened.pin,
        spill=None if spill is None else os.fspath(spill),
        device_bytes=figure.device_bytes,
        device_source=figure.device_source,
        read_mode=figure.read_mode,
    )


def open_tier(pipeline: Any, plan: Plan, host: HostPlan, *, comm: Comm | None = None) -> TierLayout:
    """The file tier's layout for the engine, as the open planner decided it (``host.tiers``): for a
    pipeline built in memory, its file-tier packs spilled once into ``host.spill`` (`open_plan`
    refused a file tier with nothing to read it from: `policies.needs_source`). With ``comm``, every
    rank learns whether every other could make its spill folder before any writes, so a rank that
    fails here fails all (each its own error) instead of leaving them waiting in a later collective."""
    chosen = host.tiers
    spilled = bool(chosen.file) and plan.config.checkpoint is None
    if spilled:
        assert host.spill is not None, (
            "a torchferry bug: the open plan has a file tier with no checkpoint nor spill= (needs_source)"
        )

    def prepare() -> None:
        if spilled and host.spill is not None:
            spill_folder(host.spill)

    agreed(comm, "prepare the spill folder", prepare)
    source = None
    if spilled:
        assert host.spill is not None
        source = spill(pipeline, plan, chosen.file, host.spill, comm=comm)
    return TierLayout.of(chosen, cache_bytes=host.cache_bytes, source=source, read_mode=host.read_mode)


def host_figures(store: HostStore, host: HostPlan | None) -> dict[str, Any]:
    """A session's host memory figures for its report, beside its bytes: the file tier's packs and
    the bytes read from it so far; with ``host``, the budget in force and where it came from, the
    ``RLIMIT_MEMLOCK`` that bounds pinning (when finite), the host bytes planned (the tiers', with
    the kept and scratch buffers counted beside them), the direct-I/O buffers they reserved and how
    the reads ran (buffered when no file was opened for direct I/O, so those buffers were never
    allocated)."""
    tier = store.tier
    figures: dict[str, Any] = {
        "file_packs": 0 if tier is None else len(tier.reads),
        "file_read_bytes": 0 if tier is None else tier.reader.bytes_read,
    }
    if host is not None:
        figures.update(
            host_budget=host.budget.bytes,
            host_budget_source=host.budget.source,
            memlock_bytes=host.budget.locked_bytes,
            memlock_source=host.budget.locked_source,
        )
    if host is not None:
        chosen = host.tiers
        figures["planned_host_bytes"] = chosen.host_bytes
        if tier is not None and chosen.file:
            modes = {m.split(" ", 1)[0] for m in tier.reader.modes.values()}
            figures.update(
                read_buffer_bytes=chosen.read_buffer_bytes,
                read_mode=" and ".join(sorted(modes)) or "buffered",
            )
    return figures
