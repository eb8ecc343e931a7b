"""The host side of a session's open: the facts the open planner reads, read once; the one exchange
of host budgets a process group needs; the file tier laid out as the open plan decided it (its spill
written); and the host figures a report shows.

[Note: the host side]
Nothing here decides (see [Note: the open planner]). `read_facts` reads what the machine, the device,
the module and the checkpoint are (`runtime.machine.host_facts`: every bound on host memory, the
locked-memory limit and whether this device's pinner is held to it, the pipeline's own CPU bytes, the
read mode; `store_facts`: float32 tensors the checkpoint stores in 16 bits, tensors stored with other
strides, components that keep their own weights). `policies.open_plan` decides the budgets, the tiers,
whether the store pins, and every refusal. Under a process group the ranks exchange the budget each
offers (`policies.offered_budget`) with `exchange_budgets`, the only collective before planning, and
every rank plans against the least. `open_tier` then carries the decided tiers out: it makes the spill
folder and writes a pipeline built in memory's file-tier packs there once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from torchferry import policies
from torchferry._errors import PlanError
from torchferry.policies import HostBudget, Tiers
from torchferry.runtime.files import WIDENED_FROM, agreed, open_checkpoint, spill, spill_folder
from torchferry.runtime.interop import kept_in_float32
from torchferry.runtime.machine import host_facts
from torchferry.runtime.memory import CudaPinner, contiguous_strides, dense_strides
from torchferry.runtime.store._file_tier import READ_MODE_ENV, TierLayout
from torchferry.runtime.store._store import HostStore
from torchferry.topology import KeyMap, Plan, StoreFacts, Topology, find_attr

if TYPE_CHECKING:
    from torchferry.runtime.device import Comm

__all__ = [
    "HostPlan",
    "exchange_budgets",
    "host_figures",
    "host_side",
    "module_bytes",
    "open_tier",
    "read_facts",
    "store_facts",
    "strided_names",
    "widened",
    "widened_names",
]


def module_bytes(pipeline: Any, topology: Topology) -> int:
    """Bytes of the pipeline's own CPU tensors the store would take over (each storage once): the
    memory that is freed as the store fills from the module."""
    seen: set[int] = set()
    total = 0
    for c in topology.components:
        if c.on_demand:
            continue
        for spec in c.all_tensors():
            try:
                t = find_attr(pipeline, spec.name)
            except AttributeError:
                continue
            if not isinstance(t, torch.Tensor) or t.is_meta or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


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


def store_facts(
    pipeline: Any,
    plan: Plan,
    *,
    prefix_map: Mapping[str, str] | None = None,
    variant: str | None = None,
    own: frozenset[str] = frozenset(),
) -> StoreFacts:
    """The `StoreFacts` of ``pipeline`` under ``plan``, read once from the module and the checkpoint's
    headers: widened and strided tensors, and the components ``own`` that keep their own weights."""
    return StoreFacts(
        widened=widened(pipeline, plan, prefix_map, variant),
        strided=strided_names(pipeline, plan.topology),
        own=own,
    )


def read_facts(
    pipeline: Any,
    plan: Plan,
    *,
    device: torch.device | None = None,
    prefix_map: Mapping[str, str] | None = None,
    variant: str | None = None,
    own: frozenset[str] = frozenset(),
) -> policies.Facts:
    """Read every fact the open planner needs, once (see [Note: the open planner]): the machine's
    (`runtime.machine.host_facts`, with the read mode `READ_MODE_ENV` sets, and whether this device's
    pinner, CUDA's page-locking, is held to ``RLIMIT_MEMLOCK``), the device's (its free memory), the
    module's and the checkpoint's (`store_facts`, through the key map ``prefix_map``)."""
    target = torch.device("cpu") if device is None else device
    copied = plan.config.checkpoint is None
    host = host_facts(
        module_bytes=module_bytes(pipeline, plan.topology) if copied and pipeline is not None else 0,
        pins_locked=target.type == "cuda" and CudaPinner.memlock,
        read_mode=os.environ.get(READ_MODE_ENV, "auto").strip().lower(),
    )
    free = torch.cuda.mem_get_info(target)[0] if target.type == "cuda" else None
    facts = policies.Facts(
        host=host,
        device=policies.DeviceFacts(type=target.type, free_bytes=free),
        store=store_facts(pipeline, plan, prefix_map=prefix_map, variant=variant, own=own),
    )
    return facts


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


def widened(
    pipeline: Any, plan: Plan, prefix_map: Mapping[str, str] | None, variant: str | None
) -> frozenset[str]:
    """The float32 model tensors the plan's checkpoint stores in 16 bits (`widened_names`)."""
    path = plan.config.checkpoint
    if path is None or pipeline is None:
        return frozenset()
    return widened_names(pipeline, plan.topology, path, prefix_map=prefix_map, variant=variant)


def widened_names(
    pipeline: Any,
    topo: Topology,
    checkpoint: str,
    *,
    prefix_map: Mapping[str, str] | None = None,
    variant: str | None = None,
) -> frozenset[str]:
    """The float32 model tensors that ``checkpoint`` stores in 16 bits (those a model keeps in
    float32, and any other the file holds narrower, as a GGUF file its biases), and the tensors its
    library makes from other stored tensors on load (`topology.KeyMap`): a file-tier pack keeps each
    in host memory for the session and reads none of them per use (a spill writes them as float32,
    so none there). ``pipeline`` may be built on the meta device (`torchferry plan`)."""
    made = frozenset(t for c in KeyMap.of(prefix_map).conversions for t in c.targets)
    kept = kept_in_float32(pipeline, topo)
    specs = [s for c in topo.components for s in c.all_tensors()]
    floats = {s.name for s in specs if s.dtype == "float32" and s.persistent}
    try:
        with open_checkpoint(checkpoint, pipeline=pipeline, prefix_map=prefix_map, variant=variant) as reader:
            stored = {n: reader.entries.get(reader.key(n)) for n in kept | floats}
            # Beyond the kept ones, those the reader widens as it reads (a GGUF file's 16-bit biases).
            read = frozenset(
                n for n in floats - kept if (e := stored[n]) is not None and reader.widens(n, e.dtype)
            )
    except (PlanError, OSError):
        return kept | made  # the engine names the checkpoint's problem; count every candidate meanwhile
    return made | read | frozenset(n for n in kept if (e := stored[n]) is None or e.dtype in WIDENED_FROM)


def strided_names(pipeline: Any, topo: Topology) -> frozenset[str]:
    """Tensors of ``pipeline`` stored with other strides than row-major (a transposed weight): a
    file-tier read of one goes through the reader's scratch."""
    if pipeline is None:
        return frozenset()
    found: set[str] = set()
    for c in topo.components:
        for spec in c.all_tensors():
            try:
                t = find_attr(pipeline, spec.name)
            except AttributeError:
                continue
            if isinstance(t, torch.Tensor) and tuple(dense_strides(t)) != contiguous_strides(t.shape):
                found.add(spec.name)
    return frozenset(found)


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
