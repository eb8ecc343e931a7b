"""Preflight: the host budget a session plans against, and the proof, before anything is read,
pinned or moved, that what it will hold in host memory fits it.

[Note: preflight]
Every byte torchferry holds in host memory is a number known before the session opens: the pinned
store and the file tier's staging slots and bounce buffers (`policies.tiers`, whose ``host_bytes``
`check` proves against the plan's budget as [8]), the non-persistent buffers a file-tier pack keeps,
and the transient peak of the open itself (one pack while the store copies a pipeline's own weights
in; from a checkpoint the bytes go straight to their buffers, through file-backed windows that are
not anonymous memory). `host_plan` sets the budget: the caller's ``host_memory=``, else the machine's
(`host_budget`), credited with the pipeline's own CPU weights when the store takes them over (their
memory is freed pack by pack as it fills), and the minimum over the ranks of a process group (every
rank plans the same tiers and schedules). A machine budget that the whole store fits is not written
into the plan (nothing is chosen, so plans, digests and schedules stay exactly as without it); one
that binds is, and `policies.tiers` moves the coldest packs to the file tier. What the tiers do not
count (kept buffers, the reader's scratch, the open's peak) is taken off the plan's budget first, so
the tiers chosen leave the whole budget met. `preflight` then adds
the transient figures (against a machine budget: a given one bounds torchferry's own buffers); over
the budget is a `PlanError` naming the bytes, the budget's source and the remedies, raised before
the engine touches anything. Pinned bytes are held to
``RLIMIT_MEMLOCK`` only where the pinner is subject to it (see [Note: the host budget]).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from torchferry._errors import PlanError
from torchferry.policies import READ_BOUNCE_BYTES, Tiers, format_bytes, group_specs, pack_bytes, tiers
from torchferry.runtime._budget import HostBudget, given_budget, host_budget
from torchferry.runtime._checkpoint import WIDENED_FROM
from torchferry.runtime._gguf import open_checkpoint
from torchferry.runtime._host import HostStore
from torchferry.runtime._pack import contiguous_strides, dense_strides
from torchferry.runtime._pinning import CudaPinner, HostPinner, page_bytes
from torchferry.runtime._reader import READ_THREADS
from torchferry.runtime._spill import agreed, spill, spill_folder
from torchferry.runtime._tiers import TierLayout
from torchferry.runtime._widen import kept_in_float32
from torchferry.topology import KeyMap, Plan, Topology, find_attr

if TYPE_CHECKING:
    from torchferry.runtime._comm import Comm

__all__ = ["HostPlan", "host_figures", "host_plan", "module_bytes", "open_tier", "preflight"]


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


def _group_minimum(budget: HostBudget, group: Any, device: torch.device) -> HostBudget:
    """The least budget of the ranks of ``group`` (a collective, on the device `Comm` agrees on: the
    group's CPU backend when it has one, else the session's ``device``), so every rank plans the same
    tiers; ``None`` (no machine limit) counts as the largest."""
    import torch.distributed as dist

    from torchferry.runtime._comm import Comm

    where = Comm(group, device).agree_device
    mine = _NO_LIMIT if budget.bytes is None else budget.bytes
    figure = torch.tensor([mine], dtype=torch.int64, device=where)
    dist.all_reduce(figure, op=dist.ReduceOp.MIN, group=group)
    least = int(figure.item())
    if least == mine:
        return attrs.evolve(budget, source=f"{budget.source} (the least of the process group's ranks)")
    return attrs.evolve(
        budget, bytes=least, source=f"another rank's host budget, {_size(least)}, the least of the group"
    )


_NO_LIMIT = (1 << 63) - 1


@attrs.frozen(kw_only=True)
class HostPlan:
    """The host side of a session: the budget (and where it came from), what the page cache can keep
    beside torchferry's buffers (for choosing direct I/O; ``None``: unknown), the spill folder, and
    the model tensors the file tier keeps widened to float32 in host memory (``widened``)."""

    budget: HostBudget
    cache_bytes: int | None
    spill: str | None = None
    widened: frozenset[str] = frozenset()


def host_plan(
    pipeline: Any,
    plan: Plan,
    *,
    group: Any = None,
    spill: str | os.PathLike[str] | None = None,
    device: torch.device | None = None,
    prefix_map: Mapping[str, str] | None = None,
    variant: str | None = None,
) -> tuple[Plan, HostPlan]:
    """The budget the session plans against and the plan carrying it when it binds (see [Note:
    preflight]); a machine budget the whole store fits leaves ``plan`` as it is. A budget of 0 bytes
    (nothing left after the reserve) is a `PlanError` naming where it came from."""
    machine = host_budget()
    given = plan.config.host_memory_bytes
    if given is not None:
        budget = given_budget(given)
    else:
        budget = machine
        if plan.config.checkpoint is None:
            taken = module_bytes(pipeline, plan.topology)
            budget = budget.credited(taken, "of the pipeline's own weights the store takes over")
    if group is not None:
        budget = _group_minimum(budget, group, torch.device("cpu") if device is None else device)
    if budget.bytes is not None and budget.bytes <= 0:
        raise PlanError(
            f"the host budget is {_size(budget.bytes)} ({budget.source}): no host memory is left for "
            "torchferry's buffers; free host memory (close other processes or sessions), raise the "
            "memory cgroup's limit, or pass host_memory=<bytes> to name what torchferry may hold"
        )
    if given is not None and budget.bytes is not None and budget.bytes != given:  # the group's least
        plan = _with_budget(plan, budget.bytes)
    tightest = machine.bounds[0].available if machine.bounds else None
    cache = None
    if tightest is not None and budget.bytes is not None:
        cache = max(tightest - min(budget.bytes, tightest), 0)
    host = HostPlan(
        budget=budget,
        cache_bytes=cache,
        spill=None if spill is None else os.fspath(spill),
        widened=_widened(pipeline, plan, prefix_map, variant),
    )
    if given is None and budget.bytes is not None:
        bound = _with_budget(plan, budget.bytes)
        try:
            binds = bool(tiers(bound).file)
        except PlanError:
            binds = True  # too small even for the file tier: `preflight` says so with the budget's source
        if binds:
            plan = bound
    return _leave_room(pipeline, plan, host), host


def _widened(
    pipeline: Any, plan: Plan, prefix_map: Mapping[str, str] | None, variant: str | None
) -> frozenset[str]:
    """The float32 model tensors the checkpoint stores in 16 bits: a file-tier pack keeps each widened
    in host memory for the session (a spill writes them as float32, so none there)."""
    path = plan.config.checkpoint
    if path is None or pipeline is None:
        return frozenset()
    # A tensor its library makes from other stored tensors on load is kept as made, too (KeyMap).
    made = frozenset(t for c in KeyMap.of(prefix_map).conversions for t in c.targets)
    kept = kept_in_float32(pipeline, plan.topology)
    if not kept:
        return made
    try:
        with open_checkpoint(path, pipeline=pipeline, prefix_map=prefix_map, variant=variant) as reader:
            stored = {n: reader.entries.get(reader.key(n)) for n in kept}
    except (PlanError, OSError):
        return kept | made  # the engine names the checkpoint's problem; count every candidate meanwhile
    return made | frozenset(n for n, e in stored.items() if e is None or e.dtype in WIDENED_FROM)


def _with_budget(plan: Plan, nbytes: int) -> Plan:
    return attrs.evolve(plan, config=attrs.evolve(plan.config, host_memory_bytes=nbytes))


def _leave_room(pipeline: Any, plan: Plan, host: HostPlan) -> Plan:
    """``plan`` with its host budget lowered by what the tiers do not count (kept, widened and scratch
    buffers, the open's peak), so tiers chosen within it leave the whole host budget met; a few
    rounds, since what is left out depends on which packs go to the file tier."""
    budget = host.budget.bytes
    if budget is None:
        return plan
    for _ in range(4):
        try:
            chosen = tiers(plan)
        except PlanError:
            return plan  # `preflight` says so, with the budget's source
        if not chosen.file:
            return plan
        room = budget - sum(_extras(pipeline, plan, host, chosen))
        if chosen.host_bytes <= room or room <= 0 or room == plan.config.host_memory_bytes:
            return plan
        plan = _with_budget(plan, room)
    return plan


def _extras(pipeline: Any, plan: Plan, host: HostPlan, chosen: Tiers) -> tuple[int, int, int]:
    """Host bytes `policies.tiers` does not count: (kept non-persistent buffers and float32-widened
    tensors, the reader's scratch, the open's transient peak) for ``chosen``."""
    specs = group_specs(plan)
    kept = sum(
        page_bytes(s.nbytes)
        for name in chosen.file
        for s in specs[name]
        if (s.buffer and not s.persistent) or s.name in host.widened
    )
    scratch = _scratch_bytes(pipeline, plan, chosen.file)
    transient = 0
    if plan.config.checkpoint is None and not host.budget.given:  # the module's copy of one pack too
        transient = max((page_bytes(pack_bytes(plan, n)) for n in specs if n not in chosen.file), default=0)
    return kept, scratch, transient


def preflight(plan: Plan, host: HostPlan, *, pin: bool, memlock: bool, pipeline: Any = None) -> Tiers:
    """Prove, before anything is read, pinned or moved, that the session's host memory fits its budget
    (see [Note: preflight]); the tiers the store is laid out from. ``memlock``: whether the pinner is
    subject to ``RLIMIT_MEMLOCK`` (`HostPinner.memlock`)."""
    budget = host.budget
    try:
        chosen = tiers(plan)
    except PlanError as exc:
        raise PlanError(_with_source(str(exc), budget)) from None
    kept, scratch, transient = _extras(pipeline, plan, host, chosen)
    kept += scratch
    need = chosen.host_bytes + kept + transient
    if budget.bytes is not None and need > budget.bytes:
        raise PlanError(
            f"torchferry would hold {_size(need)} of host memory ({_size(chosen.host_bytes)} of host "
            f"buffers, {_size(kept)} of kept, widened and scratch buffers, {_size(transient)} while the "
            f"store copies the pipeline's own weights in), over the host budget of {_size(budget.bytes)} "
            f"({budget.source}); " + _remedies(plan)
        )
    if pin and memlock and budget.locked_bytes is not None and chosen.host_bytes > budget.locked_bytes:
        raise PlanError(
            f"torchferry would pin {_size(chosen.host_bytes)} of host memory, over the locked-memory limit "
            f"of {_size(budget.locked_bytes)} ({budget.locked_source}); raise it (ulimit -l, or the "
            "container's memlock limit), pass pin_memory=False, or lower host_memory= so fewer bytes are "
            "pinned"
        )
    return chosen


def _with_source(message: str, budget: HostBudget) -> str:
    """`policies.tiers`'s refusal with where the budget came from: in place of the config field it
    names (once, not a second sentence repeating the budget), else added at the end."""
    field = "(config.host_memory_bytes)"
    if field in message:
        return message.replace(field, f"({budget.source})", 1)
    return f"{message}. The host budget is {_size(budget.bytes or 0)}: {budget.source}"


def _scratch_bytes(pipeline: Any, plan: Plan, file: frozenset[str]) -> int:
    """The reader's scratch for file-tier tensors stored with other strides than the file's (a
    transposed weight): per reader thread, twice the largest (see `FileReader.reserve`)."""
    if pipeline is None or not file:
        return 0
    largest = 0
    for name, specs in group_specs(plan).items():
        if name not in file:
            continue
        for spec in specs:
            try:
                t = find_attr(pipeline, spec.name)
            except AttributeError:
                continue
            if isinstance(t, torch.Tensor) and tuple(dense_strides(t)) != contiguous_strides(t.shape):
                largest = max(largest, spec.nbytes)
    return READ_THREADS * page_bytes(2 * largest) if largest else 0


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
    ``host.spill`` (without one: `PlanError` naming the remedy). With ``comm``, every rank learns
    whether every other could do each part before any goes on, so a rank that fails here fails all
    (each its own error) instead of leaving them waiting in a later collective."""

    def check() -> Tiers:
        chosen = preflight(plan, host, pin=pin, memlock=pinner.memlock, pipeline=pipeline)
        if chosen.file and plan.config.checkpoint is None:
            if host.spill is None:
                raise PlanError(
                    f"the host budget of {_size(host.budget.bytes or 0)} ({host.budget.source}) leaves "
                    f"{len(chosen.file)} pack(s) in the file tier, read on demand from a checkpoint, and "
                    "this pipeline was built in memory with no checkpoint; pass spill=<a folder> (those "
                    "packs are written there once as safetensors and read back), open it from its "
                    "checkpoint (checkpoint=, or from_pretrained), or pass a larger host_memory= if the "
                    "machine has it"
                )
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
    return TierLayout(cache_bytes=host.cache_bytes, source=source)


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
        extra = 0 if tier is None else tier.kept_bytes + tier.reader.scratch_bytes
        figures["planned_host_bytes"] = chosen.host_bytes + extra
        if tier is not None and chosen.file:
            modes = {m.split(" ", 1)[0] for m in tier.reader.modes.values()}
            figures.update(
                read_buffer_bytes=READ_BOUNCE_BYTES,
                read_mode=" and ".join(sorted(modes)) or "buffered",
            )
    return figures
