"""Preflight: the facts the host planner needs, read once before planning, and the proof, before
anything is read, pinned or moved, that what the session holds in host memory fits its budget.

[Note: preflight]
`host_plan` reads the facts, and `policies.host_plan` decides (see [Note: the host planner]): the
machine's `HostFacts` (`runtime.machine.host_facts`: every bound on host memory, the locked-memory
limit, the pipeline's own CPU bytes, the read mode) and the plan's `StoreFacts` (`store_facts`:
float32 tensors the checkpoint stores in 16 bits, tensors stored with other strides, components
that keep their own weights). Every byte the host holds is then counted by `policies.tiers` as it
chooses (no budget is lowered after the fact), so `preflight` only proves the same figure and the
locked-memory limit of a pinner held to it, and names the budget's source in a refusal. Under a
process group the ranks exchange their budgets first and every rank plans against the least.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from torchferry import policies
from torchferry._errors import PlanError
from torchferry.policies import (
    HostBudget,
    HostBudgetTooSmall,
    Tiers,
    format_bytes,
    group_specs,
    tiers,
)
from torchferry.runtime.files import WIDENED_FROM, agreed, open_checkpoint, spill, spill_folder
from torchferry.runtime.interop import kept_in_float32
from torchferry.runtime.machine import host_facts
from torchferry.runtime.memory import CudaPinner, HostPinner, contiguous_strides, dense_strides
from torchferry.runtime.store._file_tier import READ_MODE_ENV, TierLayout
from torchferry.runtime.store._store import HostStore
from torchferry.topology import KeyMap, Plan, StoreFacts, Topology, find_attr

if TYPE_CHECKING:
    from torchferry.runtime.device import Comm

__all__ = [
    "HostPlan",
    "host_figures",
    "host_side",
    "module_bytes",
    "open_tier",
    "preflight",
    "read_facts",
    "store_facts",
    "strided_names",
    "widened",
    "widened_names",
]


def _size(n: int) -> str:
    return format_bytes(n, exact=False)


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


def _group_least(budget: HostBudget, group: Any, device: torch.device, plan: Plan) -> int:
    """The least budget of the ranks of ``group``, once they are found to ask for the same plan
    (`Comm.agree_request`, the session's first collective), so every rank plans the same tiers;
    ``None`` (no machine limit) counts as the largest."""
    from torchferry.runtime.device import Comm

    mine = policies.NO_LIMIT if budget.bytes is None else min(budget.bytes, policies.NO_LIMIT)
    # What the plan is (its digest's options), and the two runtime options that shape the collectives;
    # the others (budgets, the checkpoint's path, pinning) may differ between ranks.
    asked = plan.config.request
    request = {f.name: _text(getattr(asked, f.name)) for f in attrs.fields(type(asked))}
    request.update((k, _text(getattr(plan.config, k))) for k in ("prefetch_depth", "chunk_bytes"))
    return min(Comm(group, device).agree_request(request, mine))


@attrs.frozen(kw_only=True)
class HostPlan:
    """The host side of a session: the budget (and where it came from), what the page cache can keep
    beside torchferry's buffers (for choosing direct I/O; ``None``: unknown), the spill folder, and
    the tiers the host planner chose (the whole host figure)."""

    budget: HostBudget
    cache_bytes: int | None
    spill: str | None = None
    tiers: Tiers | None = None
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
    group: Any = None,
    device: torch.device | None = None,
    prefix_map: Mapping[str, str] | None = None,
    variant: str | None = None,
    own: frozenset[str] = frozenset(),
) -> tuple[policies.Facts, int | None]:
    """Read every fact the open planner needs, once (see [Note: the open planner]): the machine's
    (`runtime.machine.host_facts`, with the read mode `READ_MODE_ENV` sets), the device's (its free
    memory), the module's and the checkpoint's (`store_facts`, through the key map ``prefix_map``);
    and under a process group the least host budget of its ranks (a collective), else ``None``."""
    target = torch.device("cpu") if device is None else device
    copied = plan.config.checkpoint is None
    host = host_facts(
        module_bytes=module_bytes(pipeline, plan.topology) if copied and pipeline is not None else 0,
        pins_locked=plan.config.pin_memory and target.type == "cuda" and CudaPinner.memlock,
        read_mode=os.environ.get(READ_MODE_ENV, "auto").strip().lower(),
    )
    free = torch.cuda.mem_get_info(target)[0] if target.type == "cuda" else None
    facts = policies.Facts(
        host=host,
        device=policies.DeviceFacts(type=target.type, free_bytes=free),
        store=store_facts(pipeline, plan, prefix_map=prefix_map, variant=variant, own=own),
    )
    least = None
    if group is not None:  # every rank plans against the least budget: only the exchange is here
        given = plan.config.host_memory_bytes
        machine = policies.machine_budget(host, host.module_bytes) if given is None else None
        mine = policies.given_budget(given) if given is not None else machine
        assert mine is not None
        least = _group_least(mine, group, target, plan)
    return facts, least


def host_side(figure: policies.HostFigure, spill: str | os.PathLike[str] | None) -> HostPlan:
    """The session's `HostPlan` from the open planner's host figure and the spill folder given."""
    return HostPlan(
        budget=figure.budget,
        cache_bytes=figure.cache_bytes,
        spill=None if spill is None else os.fspath(spill),
        tiers=figure.tiers,
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


def preflight(plan: Plan, host: HostPlan, *, pin: bool, memlock: bool, pipeline: Any = None) -> Tiers:
    """The tiers the store is laid out from, proven (see [Note: the host planner]): every host byte
    within the budget, pinned bytes within ``RLIMIT_MEMLOCK`` where the pinner (``memlock``:
    `HostPinner.memlock`) is held to it. ``pipeline`` is unused (the facts are on the plan)."""
    budget = host.budget
    try:
        chosen = tiers(plan)
    except HostBudgetTooSmall as exc:
        raise exc.with_source(budget.source) from None
    if budget.bytes is not None and chosen.host_bytes > budget.bytes:
        raise PlanError(
            f"torchferry would hold {_size(chosen.host_bytes)} of host memory, over the host budget of "
            f"{_size(budget.bytes)} ({budget.source}); " + _remedies(plan)
        )
    pinned = chosen.host_bytes - chosen.kept_bytes - chosen.transient_bytes
    if pin and memlock and budget.locked_bytes is not None and pinned > budget.locked_bytes:
        raise PlanError(
            f"torchferry would pin {_size(pinned)} of host memory, over the locked-memory limit "
            f"of {_size(budget.locked_bytes)} ({budget.locked_source}); raise it (ulimit -l, or the "
            "container's memlock limit), pass pin_memory=False, or lower host_memory= so fewer bytes are "
            "pinned"
        )
    return chosen


def _remedies(plan: Plan) -> str:
    fixes = ["pass a larger host_memory= if the machine has it"]
    if plan.config.checkpoint is None:
        fixes.append(
            "open from the checkpoint (checkpoint=, or from_pretrained) or pass spill=<a folder>, so the "
            "file tier can keep packs out of host memory"
        )
    fixes.append("keep fewer units resident (resident_layers=0) or stream more components")
    fixes.append("close other sessions or processes holding host memory")
    return "remedies: " + "; ".join(fixes)


def open_tier(
    pipeline: Any,
    plan: Plan,
    host: HostPlan,
    *,
    pin: bool,
    comm: Comm | None = None,
    pinner: type[HostPinner] | HostPinner = CudaPinner,
) -> TierLayout:
    """`preflight` (held to ``RLIMIT_MEMLOCK`` when ``pinner`` is subject to it), then the file tier's
    layout for the engine: for a pipeline built in memory, its file-tier packs spilled once into
    ``host.spill`` (the host planner refused one without it: `policies.needs_source`). With
    ``comm``, every rank learns whether every other could do each part before any goes on, so a rank
    that fails here fails all (each its own error) instead of leaving them waiting in a later
    collective."""

    def check() -> Tiers:
        chosen = preflight(plan, host, pin=pin, memlock=pinner.memlock, pipeline=pipeline)
        if chosen.file and plan.config.checkpoint is None:
            # `policies.host_plan` refused a file tier with nothing to read it from (`needs_source`).
            assert host.spill is not None, "a torchferry bug: a file tier with no checkpoint nor spill="
            specs = group_specs(plan)
            cast = sorted(n for n in chosen.file if any(t.compute_dtype is not None for t in specs[n]))
            if cast:  # refused before a byte is spilled: the file tier reads bytes as they are stored
                raise PlanError(
                    f"spill= with storage_dtype={plan.config.storage_dtype!r}: the host budget leaves "
                    f"{len(cast)} pack(s) held in the storage dtype ({', '.join(cast[:3])}"
                    f"{', ...' if len(cast) > 3 else ''}) in the file tier, which would read the spilled "
                    "bytes in the model's own dtypes; pass a larger host_memory= so they stay in host "
                    "memory, or drop storage_dtype="
                )
            spill_folder(host.spill)
        return chosen

    chosen = agreed(comm, "check the host budget", check)
    source = None
    if chosen.file and plan.config.checkpoint is None:
        assert host.spill is not None
        source = spill(pipeline, plan, chosen.file, host.spill, comm=comm)
    return TierLayout(cache_bytes=host.cache_bytes, source=source, read_mode=host.read_mode)


def host_figures(store: HostStore, host: HostPlan | None, plan: Plan | None = None) -> dict[str, Any]:
    """A session's host memory figures for its report, beside its bytes: the budget in force and
    where it came from, the ``RLIMIT_MEMLOCK`` that bounds pinning (when finite), the file tier's
    packs and the bytes read from it so far; with ``plan``, the host bytes planned (the tiers', and
    the kept and scratch buffers preflight counted beside them), the direct-I/O buffers they
    reserved and how the reads ran (buffered when no file was opened for direct I/O, so those
    buffers were never allocated)."""
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
    if plan is not None and host is not None:
        chosen = tiers(plan)
        figures["planned_host_bytes"] = chosen.host_bytes
        if tier is not None and chosen.file:
            modes = {m.split(" ", 1)[0] for m in tier.reader.modes.values()}
            figures.update(
                read_buffer_bytes=chosen.read_buffer_bytes,
                read_mode=" and ".join(sorted(modes)) or "buffered",
            )
    return figures
