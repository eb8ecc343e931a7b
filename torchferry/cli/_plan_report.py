"""What `torchferry plan` computes: a model's parts, which strategy fits a device budget, at what cost.

Everything here is pure planning: the model (`_plan_input` reads it from a known id's shipped
tensor specs or from a checkpoint's headers, never its data) is resolved into a plan per strategy,
its policy builds the schedules of one generation (encoders, each DiT twice so the second step is
the steady state, the VAE), and `simulate` replays them under a cost model. The peak is the largest
simulated peak of those steps; the step time is the steady DiT step times the forwards one
denoising step makes. `_plan_output` prints the `PlanReport` this builds.

With a host budget (``--host-memory``) every plan carries it, so `policies.tiers` puts the packs that
do not fit host memory in the file tier and every schedule reads them at the read rate assumed;
the report then says, per component, which tier its packs live in and how many host bytes they
take, and finds (by simulation) the slowest read rate the recommended step still hides.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import attrs

from torchferry import policies, topology
from torchferry._errors import OffloadError, OffloadWarning
from torchferry.cli._plan_host import HostTier, host_tier
from torchferry.policies import CostModel, Policy, Schedule, Step
from torchferry.topology import (
    KnownModel,
    OffloadConfig,
    ParallelLayout,
    Plan,
    Resolution,
    SelectableComponent,
    Strategy,
    Topology,
)

__all__ = [
    "STRATEGY_ORDER",
    "ComponentRow",
    "Options",
    "PlanReport",
    "StrategyRow",
    "build_report",
]

#: The strategies a report evaluates, in its rows' order.
STRATEGY_ORDER = (*policies.STRATEGIES, "auto")


@attrs.frozen(kw_only=True)
class Options:
    """What the user asked `torchferry plan` to assume.

    ``device`` supplies every figure not given here (a device class, a saved profile, or the
    default class); ``h2d_bytes_per_s``, ``collective_bytes_per_s`` and ``tflops`` override it.
    ``host_bytes`` is the host budget (``None``: none, every weight in host memory) and
    ``read_bytes_per_s`` the file tier's read rate (default: the profile's, else assumed).
    """

    budget_bytes: int
    h2d_bytes_per_s: float | None = None
    collective_bytes_per_s: float | None = None
    world_size: int | None = None
    depth: int = 1
    strategy: str | None = None
    resolution: Resolution | None = None
    tflops: float | None = None
    block_ms: float | None = None
    device: policies.DeviceProfile = policies.DEFAULT_DEVICE
    forwards_per_step: int | None = None
    text_tokens: int | None = None
    host_op_s: float = 0.0
    host_bytes: int | None = None
    #: The session's device type (``--device``): on ``cpu`` the file tier has no staging slot.
    device_type: str = "cuda"
    #: Plan as a session given ``spill=<a folder>`` (``--spill``): a file tier needs no checkpoint then.
    spill: bool = False
    read_bytes_per_s: float | None = None
    #: Where the device figures' read rates came from (``the saved profile PATH``), or, when they hold
    #: none, what to do to measure one; empty: say nothing beyond the device's ``source``.
    read_note: str = ""
    #: Store the DiTs' castable weights in this dtype (``--storage-dtype``; `OffloadConfig.storage_dtype`).
    storage_dtype: str | None = None
    #: The selection (``--components``; `OffloadConfig.components`): ``None`` is a session's default,
    #: so the plans are those `offload` resolves when given no ``components=``.
    components: frozenset[SelectableComponent] | None = None
    #: The checkpoint a session would open the model from (a folder or file given as MODEL), and the
    #: facts read of its pipeline: planned with both, the host figures are the session's.
    checkpoint: str | None = None
    facts: topology.StoreFacts = attrs.field(factory=topology.StoreFacts)
    #: The (source, pipeline class) of the topology a session opened from ``checkpoint`` discovers:
    #: plans are resolved against it, so their digests are the session's.
    opened_as: tuple[str, str] | None = None

    @property
    def read(self) -> float:
        """The file tier's read rate assumed: given, else the device profile's, else the default."""
        if self.read_bytes_per_s is not None:
            return self.read_bytes_per_s
        return self.device.file_read_bytes_per_s() or policies.DEFAULT_READ_BYTES_PER_S

    @property
    def read_source(self) -> str:
        """Where `read` comes from, in words."""
        if self.read_bytes_per_s is not None:
            return "given"
        if self.device.file_read_bytes_per_s() is not None:
            if self.read_note:
                return self.read_note
            origin = self.device.source or self.device.name
            return origin if origin.startswith("measured") else f"measured: {origin}"
        advice = self.read_note or "pass --read-bandwidth, or time the drive with torchferry probe CHECKPOINT"
        return f"assumed: a PCIe Gen3 NVMe drive; {advice}"

    @property
    def h2d(self) -> float:
        """The host-to-device bandwidth assumed: given, else the device's."""
        return self.h2d_bytes_per_s if self.h2d_bytes_per_s is not None else self.device.h2d_bytes_per_s

    @property
    def allgather(self) -> float:
        """The all-gather receive bandwidth assumed: given, else the device's."""
        given = self.collective_bytes_per_s
        return given if given is not None else self.device.collective_bytes_per_s

    @property
    def profile(self) -> policies.DeviceProfile:
        """The device with the given figures in place of its own."""
        flops = self.tflops * 1e12 if self.tflops is not None else self.device.flops_per_s
        return attrs.evolve(
            self.device, h2d_bytes_per_s=self.h2d, collective_bytes_per_s=self.allgather, flops_per_s=flops
        )


@attrs.frozen(kw_only=True)
class ComponentRow:
    """One component: its bytes, and its blocks (count, smallest and largest) and the remainder."""

    path: str
    kind: str
    class_name: str
    nbytes: int
    blocks: int
    block_min_bytes: int
    block_max_bytes: int
    rest_bytes: int


@attrs.frozen(kw_only=True)
class StrategyRow:
    """One strategy under the budget: fit, simulated peak, steady step time, or why it does not apply.

    ``step_s`` and ``resident_step_s`` are one denoising step of the first DiT (all its forwards),
    with weights streaming and with every weight already on the device.
    """

    strategy: str
    policy: str = ""
    fits: bool = False
    peak_device_bytes: int = 0
    step_s: float = 0.0
    resident_step_s: float = 0.0
    host_bytes_per_rank: int = 0
    notes: tuple[str, ...] = ()
    error: str | None = None
    #: Why the chooser picked this (auto's row only): `policies.Choice.reason`.
    reason: str = ""

    @property
    def overhead(self) -> float:
        if self.resident_step_s <= 0:
            return 0.0
        return self.step_s / self.resident_step_s - 1.0


@attrs.frozen(kw_only=True)
class PlanReport:
    """Everything `torchferry plan` prints."""

    model: str
    source: str
    pipeline_class: str
    total_bytes: int
    components: tuple[ComponentRow, ...]
    options: Options
    compute: str
    block_s: float
    forwards_per_step: int
    world_size: int
    hf_repo: str
    rows: tuple[StrategyRow, ...]
    recommended: StrategyRow | None
    schedule: Schedule | None = None
    warnings: tuple[str, ...] = ()
    #: The known model the compute estimate comes from ("" for a checkpoint of unknown shapes).
    known_id: str = ""
    #: The recommended plan's host and file tiers (with a host budget only).
    host: HostTier | None = None
    #: Device bytes the largest weight dequantized per call takes beside the weights
    #: (`policies.dequantize_reserve`; 0: no layer dequantizes); every peak counts it.
    dequantize_bytes: int = 0


def _component_row(c: topology.Component) -> ComponentRow:
    sizes = [b.nbytes for b in c.blocks]
    return ComponentRow(
        path=c.path,
        kind=c.kind,
        class_name=c.class_name,
        nbytes=c.nbytes,
        blocks=len(sizes),
        block_min_bytes=min(sizes, default=0),
        block_max_bytes=max(sizes, default=0),
        rest_bytes=c.nbytes - sum(sizes),
    )


def _one_line(error: Exception) -> str:
    """``error`` on one line, in the command line's words (`OffloadError.message`)."""
    text = error.message("cli") if isinstance(error, OffloadError) else str(error)
    if isinstance(error, policies.HostBudgetTooSmall):
        return text
    lines = [line.strip().lstrip("- ").strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines = lines[1:]
    return "; ".join(lines)


class _Planner:
    """Resolves, schedules and simulates the strategies of one topology under one set of options."""

    def __init__(
        self, topo: Topology, known: KnownModel | None, options: Options, planned: Topology | None = None
    ) -> None:
        self.topo = topo
        self.known = known
        self.options = options
        #: The topology plans are resolved against: the session's identity of it when known.
        self.planned = topo if planned is None else planned
        if options.opened_as is not None:
            source, named = options.opened_as
            self.planned = attrs.evolve(self.planned, source=source, pipeline_class=named)
        self.warnings: list[str] = []
        self.selection = options.components
        dits = topo.of_kind("dit")
        self.dit = dits[0].path if dits else None
        self.forwards = options.forwards_per_step or (known.forwards_per_step if known is not None else 1)
        # Distributed rows need ranks: 2 unless the user said how many; only then may auto pick them.
        self.world = options.world_size or 2
        self.cost, self.compute, self.block_s = self._cost()
        #: The largest dequantize temporary: it must fit beside the weights (`policies.weight_budget`).
        self.reserve = policies.dequantize_reserve(topo)
        #: strategy row -> the plan and policy behind it, and its steady DiT step
        self.made: dict[str, tuple[Plan, Schedule | None, Policy]] = {}

    def _cost(self) -> tuple[CostModel, str, float]:
        o = self.options
        block_s = o.block_ms / 1e3 if o.block_ms is not None else None
        cost = policies.estimate_cost(
            self.topo,
            self.known,
            device=o.profile,
            resolution=o.resolution,
            text_tokens=o.text_tokens,
            forwards_per_step=self.forwards,
            block_s=block_s,
            host_op_s=o.host_op_s,
            read_bytes_per_s=o.read,
        )
        if o.block_ms is not None:
            return cost, f"{o.block_ms:g} ms per block (given)", cost.block_s
        known = self.known
        dequantize = ""
        if cost.compute_s and (paths := policies.dequantize_paths(self.topo)):
            blocks = [s for s, block in paths.values() if block]
            mean = sum(blocks) / max(1, len(blocks))
            dequantize = (
                f" + dequantize {mean * 1e3:.3g} ms per block (GGUF weights, at CPU rates measured "
                "by benchmarks/gguf_dequantize.py)"
            )
        if known is None:
            s = cost.block_s
            return (
                cost,
                f"{s * 1e3:g} ms per block (assumed: a checkpoint's FLOPs are unknown; pass --block-ms)"
                + dequantize,
                s,
            )
        res = o.resolution or known.resolution
        text = known.text_tokens if o.text_tokens is None else o.text_tokens
        per_block = known.block_flops(res, text_tokens=text)
        mean = sum(per_block) / len(per_block)
        tflops = o.profile.flops_per_s / 1e12
        if o.tflops is not None:
            assumed = "given"
        elif o.device.name == policies.DEFAULT_DEVICE.name:
            assumed = "assumed: RTX 4090-class bf16; pass --tflops"
        else:
            assumed = o.device.source
        batch = f" x batch {known.batch_per_forward}" if known.batch_per_forward > 1 else ""
        description = (
            f"{mean / 1e12:.2f} TFLOP per block{batch} at {res} "
            f"({known.tokens(res)} latent + {text} text tokens) "
            f"on {tflops:g} TFLOP/s ({assumed})"
        ) + dequantize
        return cost, description, cost.block_s

    def config(self, strategy: str) -> OffloadConfig:
        return attrs.evolve(self._config(strategy), device_memory_bytes=self.options.budget_bytes)

    def _config(self, strategy: str) -> OffloadConfig:
        # As a session's request: the selection, host budget, checkpoint and storage dtype given.
        common: dict[str, Any] = {
            "components": self.selection,
            "host_memory_bytes": self.options.host_bytes,
            "checkpoint": self.options.checkpoint,
            "storage_dtype": self.options.storage_dtype,
        }
        if strategy != "distributed_layerwise":
            return OffloadConfig(strategy=cast("Strategy", strategy), **common)
        return OffloadConfig(
            strategy="distributed_layerwise",
            dit_transfer="allgather",
            encoder_transfer="rank-local",
            parallel=ParallelLayout(data_parallel_size=self.world),
            **common,
        )

    def resolve(self, strategy: str) -> Plan:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = topology.resolve(self.planned, self.config(strategy))
        for w in caught:
            said = w.message.message("cli") if isinstance(w.message, OffloadWarning) else str(w.message)
            text = f"{strategy}: {said}"
            if text not in self.warnings:
                self.warnings.append(text)
        # The session's open planner on the facts assumed (the budgets given, the store's facts read of
        # the folder): the same tiers, host bytes, device budget and refusals.
        device = policies.DeviceFacts(type=self.options.device_type)
        facts = policies.Facts(store=self.options.facts, device=device)
        return policies.open_plan(plan, facts, spill=self.options.spill).plan

    def generation(self, policy: Policy, plan: Plan) -> tuple[list[Schedule], Schedule | None]:
        """The schedules of one generation in order, and the steady step of the first DiT."""
        order: list[tuple[str, int]] = []
        for c in plan.components:
            if c.kind == "encoder":
                order.append((c.path, 0))
        for c in plan.components:
            if c.kind == "dit":
                order += [(c.path, 0), (c.path, 1)]
        for c in plan.components:
            if c.kind not in ("encoder", "dit"):
                order.append((c.path, 0))
        schedules: list[Schedule] = []
        steady: Schedule | None = None
        entry: tuple[policies.Placement, ...] = ()
        for i, (path, index) in enumerate(order):
            following = order[i + 1][0] if i + 1 < len(order) else None
            nxt = None if following == path else following
            schedule = policy(plan, Step(component=path, index=index, entry=entry, next=nxt))
            schedules.append(schedule)
            entry = schedule.exit
            if path == self.dit and index == 1:
                # The steady state repeats this component: its next step is itself again.
                steady = policies.steady_schedule(policy, plan, path, schedules[-2].step.entry)
        return schedules, steady

    def resident_forward_s(self) -> float:
        """Compute seconds of one forward of the first DiT with every weight on the device."""
        if self.dit is None:
            return 0.0
        dit = self.topo.component(self.dit)
        blocks = sum(self.cost.compute_seconds(b.path, block=True) for c in dit.walk() for b in c.blocks)
        return blocks + self.cost.compute_seconds(dit.path, block=False)

    def host_bytes(self, plan: Plan) -> int:
        if plan.config.host_memory_bytes is not None:
            return policies.tiers(plan).host_bytes
        world = plan.config.dp_size
        total = self.topo.nbytes
        if world <= 1 or not plan.config.uses_allgather("dit"):
            return total
        for c in plan.components:
            if c.kind == "dit" and c.selected:
                for s in c.stacks:
                    for b in s.streaming:
                        total += policies.shard_nbytes(b.nbytes, world) - b.nbytes
        return total

    def row(
        self, strategy: str, policy: Policy, plan: Plan, notes: Sequence[str] = ()
    ) -> tuple[StrategyRow, Schedule | None]:
        """One strategy's row, and its steady schedule (``None``: no DiT step)."""
        schedules, steady = self.generation(policy, plan)
        peak = max((policies.simulate(s, self.cost).peak_device_bytes for s in schedules), default=0)
        peak += self.reserve  # the largest layer's dequantized weight, beside the weights
        step_s = resident_s = 0.0
        if steady is not None:
            # A whole-component schedule anchors no block, so `simulate` implies no block computes:
            # the resident forward is summed here, and the schedule adds what its transfers cost.
            report = policies.simulate(steady, self.cost)
            resident_s = self.resident_forward_s() * self.forwards
            step_s = resident_s + max(report.makespan_s - report.resident_makespan_s, 0.0) * self.forwards
            if strategy == "model_level":  # its swaps happen once a call, outside the steady step
                step_s += policies.swap_per_forward_s(plan, self.cost) * self.forwards
        return StrategyRow(
            strategy=strategy,
            policy=(steady or schedules[0]).policy if schedules else "",
            fits=peak <= self.options.budget_bytes,
            peak_device_bytes=peak,
            step_s=step_s,
            resident_step_s=resident_s,
            host_bytes_per_rank=self.host_bytes(plan),
            notes=tuple(notes),
        ), steady

    def fixed(self, strategy: str) -> tuple[StrategyRow, Schedule | None]:
        try:
            plan = self.resolve(strategy)
            ring = strategy in ("layerwise", "distributed_layerwise")
            policy = policies.builtin(strategy, depth=self.options.depth if ring else 1)
            notes = []
            if strategy == "distributed_layerwise":
                notes.append(f"per rank of {self.world}")
            if strategy == "model_level" and len(self.topo.of_kind("dit")) > 1:
                notes.append("swaps experts at the boundary")
            row, steady = self.row(strategy, policy, plan, notes)
            self.made[strategy] = (plan, steady, policy)
            return row, steady
        except OffloadError as exc:
            return StrategyRow(strategy=strategy, error=_one_line(exc)), None

    def auto(self) -> tuple[StrategyRow, Schedule | None]:
        candidates = policies.auto_candidates(self.options.world_size)  # the session's rule
        best: tuple[StrategyRow, Schedule | None] | None = None
        problems: list[str] = []
        for strategy in candidates:
            try:
                plan = self.resolve(strategy)
                budget = plan.config.device_memory_bytes  # less the dequantize reserve, as in a session
                assert budget is not None
                choice = policies.choose(plan, budget, self.cost)
            except OffloadError as exc:
                problems.append(_one_line(exc))
                continue
            policy = choice.policy()
            notes = []
            if choice.resident:
                notes.append(f"{len(choice.resident)} resident blocks ({choice.placement})")
            if choice.strategy == "distributed_layerwise":
                notes.append(f"per rank of {self.world}")
            # The row is timed as what auto chose (a model-level choice pays its swaps), named auto.
            chosen, steady = self.row(choice.strategy, policy, plan, notes)
            row = attrs.evolve(chosen, strategy="auto", reason=choice.reason)
            if best is None or row.step_s < best[0].step_s * (1 - 1e-9):
                best = (row, steady)
                self.made["auto"] = (plan, steady, policy)
        if best is None:
            return StrategyRow(strategy="auto", error=problems[0] if problems else "nothing to plan"), None
        return best


def _host(planner: _Planner, strategy: str) -> HostTier | None:
    """The host tier of row ``strategy``'s plan, with a host budget only."""
    if planner.options.host_bytes is None or strategy not in planner.made:
        return None
    plan, steady, policy = planner.made[strategy]
    budget, source = planner.options.host_bytes, planner.options.read_source
    return host_tier(budget, plan, steady, planner.cost, source, policy=policy)


def build_report(model: str, topo: Topology, known: KnownModel | None, options: Options) -> PlanReport:
    """Evaluate the requested strategies (all, by default) and auto's choice for ``topo``."""
    planned = topo  # resolved with storage_dtype=, as a session's request is
    if options.storage_dtype is not None:
        topo = topology.stored_as(topo, options.storage_dtype)  # every figure in the stored bytes
    planner = _Planner(topo, known, options, planned)
    wanted = [options.strategy] if options.strategy else list(STRATEGY_ORDER)
    rows: list[StrategyRow] = []
    schedules: dict[str, Schedule | None] = {}
    for strategy in wanted:
        row, steady = planner.auto() if strategy == "auto" else planner.fixed(strategy)
        rows.append(row)
        schedules[strategy] = steady
    recommended = next((r for r in rows if r.strategy == "auto" and r.error is None), None)
    shown = "auto" if recommended is not None else wanted[0]
    return PlanReport(
        model=model,
        source=topo.source,
        pipeline_class=topo.pipeline_class,
        total_bytes=topo.nbytes,
        components=tuple(_component_row(c) for c in topo.components),
        options=options,
        compute=planner.compute,
        block_s=planner.block_s,
        forwards_per_step=planner.forwards,
        world_size=planner.world,
        hf_repo=known.hf_repo if known is not None else "",
        known_id=known.id if known is not None else "",
        rows=tuple(rows),
        recommended=recommended,
        schedule=schedules.get(shown),
        warnings=tuple(planner.warnings),
        host=_host(planner, shown),
        dequantize_bytes=planner.reserve,
    )
