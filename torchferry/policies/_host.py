"""The host planner: from a plan and the facts read once at open, the whole host figure (the budget
and where it came from, the tiers with every extra counted, the read mode, the refusals), and the
device budget of a device that shares host memory. Pure: tests give facts instead of a machine.

[Note: the host planner]
Facts first: `HostFacts` holds what the runtime read from the machine (every bound on host memory,
tightest first, each with its source; ``RLIMIT_MEMLOCK``; the pipeline's own CPU bytes; the read-mode
setting), `StoreFacts` (on the plan) what it read from the module and the checkpoint (kept and
widened buffers, strided tensors, components that keep their own weights). `host_plan` then decides:

- the budget: the caller's ``host_memory=``; else the tightest bound, plus the pipeline's own weights
  the store takes over (freed pack by pack as it fills), less the reserve, ``max(available + credit -
  reserve, 0)`` (the reserve is kept whatever is credited); else the least over a process group;
- whether a machine budget binds: a store that fits it whole is planned as without one (plans,
  digests and schedules stay as they were); one that does not is written into the plan;
- the tiers (`policies.tiers`, which counts every extra a pack holds in the file tier as it chooses,
  so one pass is exact and `check` [8] proves the whole figure); a refusal names the smallest budget
  that opens (`HostBudgetTooSmall`) and where the budget came from;
- pinned bytes against ``RLIMIT_MEMLOCK`` where the pinner is subject to it (`check` [10]);
- the read mode: ``O_DIRECT`` when the file tier's files are larger than the page cache can keep
  beside torchferry's buffers.

`torchferry plan` and the session both call it, so they choose the same tiers, host bytes and reads.
"""

from __future__ import annotations

import attrs

from torchferry._errors import CHECKPOINT, HOST_MEMORY, SPILL, Flag, PlanError
from torchferry.policies._ir import DEVICE, Policy, Schedule
from torchferry.policies._layout import pack_table, unit_packs
from torchferry.policies._refusal import HostBudgetTooSmall
from torchferry.policies._sim import steady_schedule
from torchferry.policies._tiers import (
    HEATS,
    Heat,
    Tiers,
    host_bytes,
    pack_heats,
    tiers,
    tiers_at,
    use_read_bytes,
)
from torchferry.policies._tokens import format_bytes
from torchferry.topology import Plan

__all__ = [
    "RESERVE_FRACTION",
    "RESERVE_MIN",
    "SHARED_DEVICES",
    "Bound",
    "HostBudget",
    "HostFacts",
    "HostFigure",
    "file_reads",
    "given_budget",
    "group_least",
    "host_plan",
    "machine_budget",
    "needs_source",
    "offered_budget",
    "policy_reads",
    "read_direct",
    "settled",
    "share_budget",
]

#: The share of the tightest bound kept back for what is not torchferry's.
RESERVE_FRACTION = 0.05
#: The least kept back (bytes): 256 MiB.
RESERVE_MIN = 256 << 20
#: Device types whose memory is host memory: their device budget comes from the host budget.
SHARED_DEVICES = frozenset({"cpu", "mps"})
#: The least grain a measured budget is rounded down to (`settled`): 1 MiB.
MEASURED_GRAIN_MIN = 1 << 20


def _size(n: int) -> str:
    return format_bytes(n, exact=False)


@attrs.frozen(kw_only=True)
class Bound:
    """One bound on host memory: ``available`` bytes it leaves now, ``what`` it is (``MemAvailable``,
    ``cgroup v2 /user.slice``), and ``source``: the files and the arithmetic it came from."""

    what: str
    available: int
    source: str


@attrs.frozen(kw_only=True)
class HostFacts:
    """What the runtime read from the machine, once, before planning.

    ``bounds``: every bound on host memory read, tightest first (empty: none could be read, and
    ``unread`` says where they were looked for). ``locked_bytes``: ``RLIMIT_MEMLOCK`` when it bounds
    this process (``None``: unlimited, or lifted), ``locked_source`` where it came from;
    ``pins_locked``: whether the device's pinner (the one its store would pin with) is held to it, a
    fact of the pinner whether or not the store pins (`open_plan` decides that). ``module_bytes``: the
    pipeline's own CPU bytes the store would take over. ``read_mode``: ``direct``, ``buffered`` or ``auto``.
    """

    bounds: tuple[Bound, ...] = ()
    unread: str = ""
    locked_bytes: int | None = None
    locked_source: str = ""
    pins_locked: bool = False
    module_bytes: int = 0
    read_mode: str = "auto"
    reserve_fraction: float = RESERVE_FRACTION
    reserve_min: int = RESERVE_MIN


@attrs.frozen(kw_only=True)
class HostBudget:
    """The most bytes of host memory torchferry's own buffers may hold, and where that came from.

    ``bytes`` is the budget (``None``: no limit, when the machine's figures could not be read);
    ``source`` says in a sentence which bound set it (or that it was given); ``given`` whether the
    caller named it (``host_memory=``) rather than the machine; ``bounds`` every bound read, tightest
    first; ``reserve`` what was kept back from the tightest; ``credit`` the pipeline's own bytes
    counted as free. ``locked_bytes`` is ``RLIMIT_MEMLOCK`` when it bounds this process (``None``:
    unlimited, or lifted by ``CAP_IPC_LOCK``), ``locked_source`` where that came from.
    """

    bytes: int | None
    source: str
    given: bool = False
    bounds: tuple[Bound, ...] = ()
    reserve: int = 0
    credit: int = 0
    locked_bytes: int | None = None
    locked_source: str = ""

    def describe(self) -> str:
        """Every bound read, one per line, tightest first (for reports and ``--verbose`` output)."""
        figure = "unlimited" if self.bytes is None else _size(self.bytes)
        lines = [f"host budget {figure}: {self.source}"]
        lines += [f"  {b.what}: {_size(b.available)} ({b.source})" for b in self.bounds]
        if self.locked_source:
            lines.append(f"  locked memory: {self.locked_source}")
        return "\n".join(lines)


def machine_budget(facts: HostFacts, credit: int = 0) -> HostBudget:
    """The machine's budget: the tightest bound plus ``credit`` (the pipeline's own weights the store
    takes over, freed as it fills) less the reserve, ``max(available + credit - reserve, 0)``; no
    limit when no bound was read."""
    if not facts.bounds:
        return HostBudget(
            bytes=None,
            source=facts.unread or "no machine limit",
            locked_bytes=facts.locked_bytes,
            locked_source=facts.locked_source,
        )
    tightest = facts.bounds[0]
    reserve = max(int(tightest.available * facts.reserve_fraction), facts.reserve_min)
    credit = max(credit, 0)
    budget = max(tightest.available + credit - reserve, 0)
    plus = f", plus {_size(credit)} of the pipeline's own weights the store takes over," if credit else ""
    source = (
        f"{tightest.what} {_size(tightest.available)} ({tightest.source}){plus} less a reserve of "
        f"{_size(reserve)}"
    )
    return HostBudget(
        bytes=budget,
        source=source,
        bounds=facts.bounds,
        reserve=reserve,
        credit=credit,
        locked_bytes=facts.locked_bytes,
        locked_source=facts.locked_source,
    )


def given_budget(nbytes: int, facts: HostFacts | None = None) -> HostBudget:
    """The budget the caller named (``host_memory=``)."""
    facts = facts or HostFacts()
    return HostBudget(
        bytes=nbytes,
        source="given as host_memory=",
        given=True,
        locked_bytes=facts.locked_bytes,
        locked_source=facts.locked_source,
    )


#: ``None`` (no machine limit) as the group's signed 64-bit figure: the largest.
NO_LIMIT = (1 << 63) - 1


def group_least(budget: HostBudget, least: int) -> HostBudget:
    """``budget`` after a process group agreed on ``least``, the least of its ranks' budgets."""
    mine = NO_LIMIT if budget.bytes is None else budget.bytes
    if least == mine:
        return attrs.evolve(budget, source=f"{budget.source} (the least of the process group's ranks)")
    return attrs.evolve(
        budget, bytes=least, source=f"another rank's host budget, {_size(least)}, the least of the group"
    )


def read_direct(file_bytes: int, cache_bytes: int | None, mode: str = "auto") -> bool:
    """Whether the file tier reads with ``O_DIRECT``: when its files (``file_bytes``) are larger than
    the page cache can keep (``cache_bytes``; ``None``: unknown, so buffered), unless ``mode`` says
    ``direct`` or ``buffered``."""
    if mode in ("direct", "buffered"):
        return mode == "direct"
    if mode != "auto":
        raise PlanError(
            f"TORCHFERRY_READ={mode!r} is no read mode; set it to direct, buffered or auto, or unset it"
        )  # the environment variable that sets it
    return cache_bytes is not None and file_bytes > cache_bytes


@attrs.frozen(kw_only=True)
class HostFigure:
    """The whole host figure of a session: the plan it runs (carrying the budget when it binds, and
    its facts), the budget and its source, the tiers (every host byte), what the page cache can keep
    beside them (``None``: unknown), and the pinned bytes."""

    plan: Plan
    budget: HostBudget
    tiers: Tiers
    cache_bytes: int | None
    pinned_bytes: int
    #: On a device that shares host memory (``shared=True``): its budget, the other half of the one
    #: memory (``None``: not shared, or no host limit), and where it came from.
    device_bytes: int | None = None
    device_source: str = ""
    #: How the file tier's files are read: ``direct``, ``buffered`` or ``auto`` (`read_direct` decides
    #: per file at open, from their bytes); the read-mode setting as read once, checked here.
    read_mode: str = "auto"


def offered_budget(plan: Plan, facts: HostFacts) -> HostBudget:
    """The host budget this process offers before any group agrees: the caller's ``host_memory=``,
    else the machine's (`machine_budget`), credited with the pipeline's own weights the store takes
    over when it copies them (no checkpoint). Under a process group the runtime exchanges this figure
    and `host_plan` plans against the least (``least=``)."""
    given = plan.config.host_memory_bytes
    if given is not None:
        return given_budget(given, facts)
    return machine_budget(facts, facts.module_bytes if plan.config.checkpoint is None else 0)


def _with_budget(plan: Plan, nbytes: int | None) -> Plan:
    return attrs.evolve(plan, config=attrs.evolve(plan.config, host_memory_bytes=nbytes))


def host_plan(
    plan: Plan,
    facts: HostFacts,
    *,
    least: int | None = None,
    shared: bool = False,
    spill: bool = False,
    pin: bool = True,
) -> HostFigure:
    """The whole host figure of ``plan`` (see [Note: the host planner]); ``least``: the least budget
    of a process group's ranks (`group_least`). ``shared``: the device's memory is host memory and its
    budget is not given: the one budget is split in halves, one the device budget (`shared_device_budget`),
    one the host's, so both are proven against the memory there is. A budget too small for every tiering is a
    `HostBudgetTooSmall` naming its source and the smallest budget that opens; 0 bytes, or pinned
    bytes over ``RLIMIT_MEMLOCK`` where that binds (``pin``: the store pins, `open_plan`'s decision, and
    the pinner is held to the limit), a `PlanError` naming the remedies, as is a file tier of a pipeline
    built in memory when ``spill`` (a ``spill=`` folder given) is false (`needs_source`)."""
    given = plan.config.host_memory_bytes
    copied = plan.config.checkpoint is None
    budget = offered_budget(plan, facts)
    if least is not None:
        budget = group_least(budget, least)
    if budget.bytes is not None and budget.bytes <= 0:
        raise PlanError.worded(
            f"the host budget is {_size(budget.bytes)} ({budget.source}): no host memory is left for "
            "torchferry's buffers; free host memory (close other processes or sessions), raise the "
            "memory cgroup's limit, or pass ",
            HOST_MEMORY,
            " to name what torchferry may hold",
        )
    locked = facts.locked_bytes if pin and facts.pins_locked else None
    plan = attrs.evolve(
        plan, facts=attrs.evolve(plan.facts, copied=copied and given is None, locked_bytes=locked)
    )
    device: tuple[int | None, str] = (None, "")
    one = budget
    if shared and budget.bytes is not None:  # one memory: the device's share first, the host's the rest
        device, budget = share_budget(plan, budget)
    bound = _with_budget(plan, budget.bytes)
    if (given is not None and not shared) or budget.bytes is None:
        plan = bound
    else:
        # A budget worked out from the machine (or from a share of one) is a measurement: the plan
        # carries the least budget that chooses the same tiers (`Tiers.least_budget`), or none when
        # every pack fits, so free memory that moves a little plans the same plan.
        try:
            found = tiers_at(plan, budget.bytes)  # a probe at the measured figure: no plan carries it
        except HostBudgetTooSmall:
            found = None
        floor = None if found is None or not found.file else found.least_budget
        plan = bound if found is None else _with_budget(plan, floor)
    try:
        chosen = tiers(plan)
    except HostBudgetTooSmall as exc:
        if device[0] is None or one.bytes is None:
            raise exc.with_source(budget.source) from None
        # One memory: the refusal names the one budget and the least that opens both halves.
        raise exc.with_device(one.bytes, device[0], one.source) from None
    needs_source(plan, chosen, budget, spill=spill, device=device[0] or 0)
    if chosen.file:
        read_direct(0, None, facts.read_mode)  # a read mode no reader knows is refused before any read
    pinned = chosen.host_bytes - chosen.kept_bytes - chosen.transient_bytes
    if locked is not None and pinned > locked:
        raise PlanError.worded(
            f"torchferry would pin {_size(pinned)} of host memory, over the locked-memory limit of "
            f"{_size(locked)} ({facts.locked_source}); raise it (ulimit -l, or the container's memlock "
            "limit), pass pin_memory=False, or lower ",
            HOST_MEMORY,
            " so fewer bytes are pinned",
        )
    cache = None
    if facts.bounds and budget.bytes is not None:
        tightest = facts.bounds[0].available
        cache = max(tightest - min(budget.bytes, tightest), 0)
    return HostFigure(
        plan=plan,
        budget=budget,
        tiers=chosen,
        cache_bytes=cache,
        pinned_bytes=pinned,
        device_bytes=device[0],
        device_source=device[1],
        read_mode=facts.read_mode,
    )


def needs_source(plan: Plan, chosen: Tiers, budget: HostBudget, *, spill: bool, device: int = 0) -> None:
    """`PlanError` when ``chosen`` has a file tier and nothing to read it from: the pipeline was built
    in memory (no checkpoint) and no ``spill=`` folder was given to write those packs to once. It
    names the host budget that keeps every pack in host memory (no file tier, so it opens), with the
    ``device`` bytes of a device sharing that budget."""
    if not chosen.file or plan.config.checkpoint is not None or spill:
        return
    shown = [name for name, _ in pack_table(plan) if name in chosen.file]
    listed = ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")
    whole = host_bytes(plan, (), ())[0] + device
    source: tuple[str | Flag, ...] = ("given as ", HOST_MEMORY) if budget.given else (budget.source,)
    raise PlanError.worded(
        f"the host budget of {_size(budget.bytes or 0)} (",
        *source,
        f") leaves {len(shown)} pack(s) ({listed}) in the file tier, read on demand from a checkpoint, "
        "and this pipeline is built in memory with no checkpoint; pass ",
        SPILL,
        " (those packs are written there once as safetensors and read back), ",
        CHECKPOINT,
        ", or raise ",
        HOST_MEMORY,
        f" to {format_bytes(whole)} so every pack stays in host memory",
    )


def settled(nbytes: int) -> int:
    """A budget measured on the machine rounded down to its grain (a 64th to a 128th of it, at least
    1 MiB), so two opens a few bytes of free memory apart plan the same plan."""
    if nbytes < MEASURED_GRAIN_MIN:
        return nbytes
    grain = max(1 << (nbytes.bit_length() - 7), MEASURED_GRAIN_MIN)
    return nbytes // grain * grain


def share_budget(plan: Plan, one: HostBudget) -> tuple[tuple[int, str], HostBudget]:
    """A device whose memory is host memory (`SHARED_DEVICES`: the CPU, Apple's MPS) and the host
    store share ``one`` budget (given as ``host_memory=``, or the machine's): the device's share (its
    budget, with where it came from) and the host's budget.

    The device takes the least its schedules open with (`least_device_bytes`, with the largest
    dequantized weight beside it) and the host the rest, unless the host can hold every pack: then
    the host takes that and the device the rest (more of the model resident, nothing read from the
    files), at most every weight (`whole_device_bytes`: more would choose the same, so a roomy
    machine plans one plan whatever its free memory). A measured share below that is `settled`. A
    host share too small for every tiering is refused by `tiers` with the least of both
    (`HostBudgetTooSmall.with_device`)."""
    assert one.bytes is not None
    from torchferry.policies._auto import least_device_bytes, whole_device_bytes
    from torchferry.policies._dequantize import dequantize_reserve

    reserve = dequantize_reserve(plan)
    need = least_device_bytes(plan) + reserve
    most = whole_device_bytes(plan) + reserve
    whole = host_bytes(plan, (), ())[0]
    figure = _size(one.bytes)
    if one.bytes - need >= whole and one.bytes - whole >= most:
        device = most  # every weight resident: more would choose the same
        said = f"every weight resident, {_size(most)}, within the host budget of {figure} beside every pack"
    elif one.bytes - need >= whole:
        left = one.bytes - whole
        device = left if one.given else settled(left)
        said = f"the host budget of {figure} less {_size(whole)} for every pack in host memory"
    else:
        device = need
        said = f"the least the device's schedules need, {_size(need)}, of the host budget of {figure}"
    source = f"{said} (the device's memory is host memory): {one.source}"
    host = attrs.evolve(
        one,
        bytes=max(one.bytes - device, 1),
        source=f"{one.source}, less {_size(device)} for the device (its memory is host memory)",
    )
    return (device, source), host


def file_reads(plan: Plan, chosen: Tiers, steady: Schedule | None) -> dict[str, dict[Heat, int]]:
    """Component -> bytes its file-tier packs are read, by how often (`HEATS`), as the policy behind
    ``steady`` (its steady DiT step; ``None``: none) runs: a pack it keeps on the device once staged
    (its exit holds it, as ``none()`` and resident blocks do) is read once a session, whatever the
    plan's streaming would read; a use reads the pack less what it keeps in host memory
    (`use_read_bytes`). `torchferry plan` and the session's report both say this."""
    heats = pack_heats(plan)
    kept = {p.unit for p in (steady.exit if steady is not None else ()) if p.where == DEVICE}
    for unit in kept:
        for name in unit_packs(plan, unit):
            if name in heats:
                heats[name] = "session"
    out: dict[str, dict[Heat, int]] = {}
    for top in plan.components:
        infile = [p for p in unit_packs(plan, top.path) if p in chosen.file]
        out[top.path] = {h: sum(use_read_bytes(plan, p) for p in infile if heats[p] == h) for h in HEATS}
    return out


def policy_reads(policy: Policy, plan: Plan, chosen: Tiers) -> dict[str, dict[Heat, int]]:
    """`file_reads` as ``policy`` runs ``plan``: judged by the steady step of its first DiT (entered
    from nothing; ``None`` without a DiT)."""
    dits = [c.path for c in plan.components if c.kind == "dit" and not c.on_demand]
    steady = steady_schedule(policy, plan, dits[0]) if dits and chosen.file else None
    return file_reads(plan, chosen, steady)
