"""The open planner: everything a session decides before its first byte moves, from a resolved plan
and the facts read once, in one pure function that `torchferry plan` calls too.

[Note: the open planner]
`Facts` holds what was read (the machine's `HostFacts`, the device's `DeviceFacts`, the store's
`topology.StoreFacts`); the session's runtime reads them (`runtime.read_facts`), `torchferry plan`
builds them from its flags. `open_plan` then decides, in this order:

1. the device budget when none is given: a device sharing host memory takes its share of the one
   host budget (`share_budget`), a CUDA device its free memory less the activation margin, settled
   (`default_device_budget`), a CPU with no host figure `CPU_BUDGET`;
2. the host figure (`host_plan`: the budget, the tiers, the refusals of a file tier with nothing to
   read it from and of pinned bytes over ``RLIMIT_MEMLOCK``); on a CPU device (`DIRECT_DEVICES`) the
   file tier's reader fills the device slots itself, so no staging slot is planned or counted
   (`StoreFacts.host_device`, `reads_direct`);
3. the weights' device budget: the budget less the largest dequantized weight (`weight_budget`),
   with where it came from in words;
4. whether the store pins (`store_pins`: asked for, and a CUDA device; decided first, as the
   locked-memory refusal of step 2 depends on it), auto's candidate strategies
   (`auto_candidates`), and what auto starts from (`auto_setup`: the device's figures by
   `device_profile`, the cost inputs, the components it measures).

Every refusal is raised here, before anything is read, pinned or moved.
"""

from __future__ import annotations

import attrs

from torchferry.policies._calibrate import Calibration
from torchferry.policies._dequantize import dequantize_reserve, weight_budget
from torchferry.policies._device import DeviceFacts, auto_setup
from torchferry.policies._host import SHARED_DEVICES, HostFacts, HostFigure, host_plan, settled
from torchferry.policies._tiers import DIRECT_DEVICES
from torchferry.policies._tokens import format_bytes
from torchferry.topology import Plan, StoreFacts

__all__ = [
    "ACTIVATION_MARGIN",
    "ACTIVATION_MARGIN_MIN",
    "CPU_BUDGET",
    "Facts",
    "OpenPlan",
    "auto_candidates",
    "default_device_budget",
    "open_plan",
    "store_pins",
]

#: Fraction of the device's free memory at open left to activations when no budget is given.
ACTIVATION_MARGIN = 0.10
#: The least left to activations (bytes): 1 GiB.
ACTIVATION_MARGIN_MIN = 1 << 30
#: The budget on a CPU "device" when none is given and no host figure could be read (bytes): 8 GiB.
CPU_BUDGET = 8 << 30


def _size(n: int) -> str:
    return format_bytes(n, exact=False)


@attrs.frozen(kw_only=True)
class Facts:
    """Every fact the open planner reads, read once: the machine's, the device's and the store's."""

    host: HostFacts = attrs.field(factory=HostFacts)
    device: DeviceFacts = attrs.field(factory=DeviceFacts)
    store: StoreFacts = attrs.field(factory=StoreFacts)


@attrs.frozen(kw_only=True)
class OpenPlan:
    """What `open_plan` decided: the plan the session runs (its budgets and facts in it), the host
    figure, where the device budget came from, whether the store pins, auto's candidates, and what
    auto chooses and calibrates from (`auto_setup`; ``None`` when auto does not choose)."""

    plan: Plan
    host: HostFigure
    device_source: str
    pin: bool
    candidates: tuple[str, ...] = ()
    setup: Calibration | None = None


def default_device_budget(device: DeviceFacts) -> tuple[int, str]:
    """The device budget when none is given, and a sentence saying where it came from: a device's free
    memory less ``max(ACTIVATION_MARGIN of it, ACTIVATION_MARGIN_MIN)`` for activations, `settled`
    (a measurement: two opens plan alike); `CPU_BUDGET` where no free figure was read."""
    if device.free_bytes is None:
        return CPU_BUDGET, f"the CPU default of {_size(CPU_BUDGET)}"
    free = device.free_bytes
    margin = max(ACTIVATION_MARGIN_MIN, int(free * ACTIVATION_MARGIN))
    return settled(max(free - margin, 0)), (
        f"free device memory at open {_size(free)} minus {_size(margin)} for activations, rounded down"
    )


def store_pins(pin_memory: bool, device_type: str) -> bool:
    """Whether the host store pins its buffers: asked for (``pin_memory=``), and only for a CUDA
    device (page-locked memory speeds copies to a GPU; elsewhere it would only hold memory)."""
    return pin_memory and device_type == "cuda"


def auto_candidates(world: int | None) -> tuple[str, ...]:
    """The strategies auto weighs: layerwise, and the distributed strategy over more than one rank."""
    return ("layerwise", "distributed_layerwise") if (world or 1) > 1 else ("layerwise",)


def open_plan(
    plan: Plan,
    facts: Facts,
    *,
    auto: bool = False,
    spill: bool = False,
    least: int | None = None,
    world: int | None = None,
) -> OpenPlan:
    """Everything decided before the first byte moves (see [Note: the open planner]): ``plan`` as
    resolved from the request, ``facts`` as read (or assumed); ``auto`` whether auto chooses the
    policy; ``spill`` whether a ``spill=`` folder is given; ``least`` the least host budget of a
    process group's ranks; ``world`` the ranks auto may spread over. Refusals are `PlanError` s
    (`HostBudgetTooSmall` for a host budget), worded with flags."""
    given = plan.config.device_memory_bytes
    shared = auto and given is None and facts.device.type in SHARED_DEVICES
    source = "given"
    if auto and given is None:
        default, source = default_device_budget(facts.device)
        plan = attrs.evolve(plan, config=attrs.evolve(plan.config, device_memory_bytes=default))
    host_device = facts.device.type in DIRECT_DEVICES
    plan = attrs.evolve(plan, facts=attrs.evolve(facts.store, host_device=host_device))
    pin = store_pins(plan.config.pin_memory, facts.device.type)
    figure = host_plan(plan, facts.host, least=least, shared=shared, spill=spill, pin=pin)
    plan = figure.plan
    if figure.device_bytes is not None:
        source = figure.device_source
        plan = attrs.evolve(plan, config=attrs.evolve(plan.config, device_memory_bytes=figure.device_bytes))
    budget = plan.config.device_memory_bytes
    if budget is not None and (reserve := dequantize_reserve(plan)):
        # The largest dequantized weight must fit beside the weights, as `torchferry plan` counts it.
        source = f"{source}, less {format_bytes(reserve)} for the largest dequantized weight"
        weights = weight_budget(plan, budget)
        plan = attrs.evolve(plan, config=attrs.evolve(plan.config, device_memory_bytes=weights))
    return OpenPlan(
        plan=plan,
        host=attrs.evolve(figure, plan=plan),
        device_source=source,
        pin=pin,
        candidates=auto_candidates(world) if auto else (),
        setup=auto_setup(plan, facts.device) if auto else None,
    )
