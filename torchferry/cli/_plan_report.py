"""`torchferry plan`: what a model is made of, which strategy fits a device budget, and at what cost.

Everything here is pure planning: the model comes from a known id's shipped tensor specs or from a
checkpoint's headers (never its data), each strategy is resolved into a plan, its policy builds the
schedules of one generation (encoders, each DiT twice so the second step is the steady state, the
VAE), and `simulate` replays them under a cost model. The peak is the largest simulated peak of
those steps; the step time is the steady DiT step times the forwards one denoising step makes.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import attrs

from torchferry import policies, topology
from torchferry._errors import OffloadError, PlanError
from torchferry.cli._tables import table as _table
from torchferry.policies import CostModel, Policy, Schedule, Step
from torchferry.topology import (
    KnownModel,
    OffloadConfig,
    ParallelLayout,
    Plan,
    Resolution,
    SelectableComponent,
    Topology,
)

__all__ = [
    "JSON_VERSION",
    "ComponentRow",
    "Options",
    "PlanReport",
    "StrategyRow",
    "build_report",
    "format_list",
    "format_report",
    "list_document",
    "load_model",
    "parse_resolution",
    "report_document",
]

#: Version of the JSON documents `torchferry plan --format json` prints.
JSON_VERSION = 1
STRATEGY_ORDER = (*policies.STRATEGIES, "auto")

_RESOLUTION = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?:x\s*(\d+)\s*f?)?\s*$", re.IGNORECASE)


def parse_resolution(text: str) -> Resolution:
    """``"1280x720x81"`` -> width 1280, height 720, 81 frames; ``"1024x1024"`` -> one frame."""
    match = _RESOLUTION.match(text)
    if match is None or any(int(g) < 1 for g in match.groups() if g is not None):
        raise ValueError(
            f"cannot read {text!r} as a resolution; write WIDTHxHEIGHT or WIDTHxHEIGHTxFRAMES, "
            "such as 1024x1024 or 1280x720x81"
        )
    width, height, frames = match.groups()
    return Resolution(height=int(height), width=int(width), frames=int(frames or 1))


# ------------------------------------------------------------------------------------------ input


def _looks_like_path(model: str) -> bool:
    return os.path.exists(model) or model.endswith((".safetensors", ".json")) or (
        ("/" in model or os.sep in model)
        and topology.hub_snapshot(model) is None
        and topology.hub_model_id(model) is None
    )


def _by_component(attrs_: Sequence[str], names: Sequence[str]) -> dict[str, tuple[str, ...]] | None:
    """A prefix mapping for a checkpoint of a whole pipeline, or ``None`` for a single model.

    A pipeline checkpoint names tensors ``<component>.<attr>.<i>…``: every guessed block attribute
    is dotted and they start with at least two different components (``transformer.blocks``,
    ``text_encoder.blocks``). Every first name part becomes a component, with the block attributes
    under it (none for, say, a VAE).
    """
    if not attrs_ or not all("." in a for a in attrs_):
        return None
    if len({a.split(".", 1)[0] for a in attrs_}) < 2 or not all("." in n for n in names):
        return None
    mapping: dict[str, list[str]] = {n.split(".", 1)[0]: [] for n in names}
    for a in attrs_:
        head, rest = a.split(".", 1)
        mapping[head].append(rest)
    return {k: tuple(v) for k, v in mapping.items()}


def _known_candidates() -> dict[str, Topology]:
    return {m: topology.known_topology(m) for m in (*topology.KNOWN_MODELS, *topology.KNOWN_ALIASES)}


def _pipeline_folder(path: str, hub_id: str | None) -> tuple[Topology, KnownModel | None]:
    """A pipeline folder's topology, and the known model whose DiT shapes it has (or its hub id names)."""
    topo = topology.from_pipeline_folder(path)
    match = topology.known_match(topo, _known_candidates())
    if match is None and hub_id is not None:
        match = topology.hub_model_id(hub_id)
    return topo, None if match is None else topology.known_model(match)


def load_model(model: str, block_attrs: Sequence[str] | None = None) -> tuple[Topology, KnownModel | None]:
    """The topology ``model`` names (a known id, a hub id, a pipeline folder or a checkpoint).

    - a diffusers pipeline folder (``model_index.json`` and a subfolder per component): its
      components from its headers (`topology.from_checkpoint`), with the known model whose DiT
      tensor names and shapes it has, for the compute estimate;
    - a hub id (``black-forest-labs/FLUX.1-dev``): its snapshot in the local Hugging Face cache when
      there is one (as a pipeline folder), else the known model it names;
    - a checkpoint file, folder or ``*.index.json``, read through its headers only; its block
      attributes are ``block_attrs`` or, when not given, guessed with `topology` ``guess_block_attrs`` (a
      checkpoint of a whole pipeline, its tensors named ``<component>.…``, becomes one component
      per name prefix);
    - else a known id. Unknown ids and broken checkpoints raise `PlanError`.
    """
    snapshot = None if os.path.exists(model) else topology.hub_snapshot(model)
    folder = model if os.path.isdir(model) else (str(snapshot) if snapshot is not None else None)
    if folder is not None and topology.is_pipeline_folder(folder):
        if block_attrs is not None:
            raise PlanError(
                f"{folder}: --block-attrs is for a checkpoint of one model; a pipeline folder's block "
                "attributes come from each component's class (its config.json)"
            )
        return _pipeline_folder(folder, model if snapshot is not None else None)
    if not os.path.exists(model) and topology.is_hub_id(model) and topology.hub_model_id(model) is None:
        raise PlanError(
            f"{model}: no such checkpoint file or folder, nor a snapshot of that hub repository in "
            f"{topology.hub_cache_dir()}; torchferry downloads nothing, so fetch it first (huggingface-cli "
            f"download {model}) or pass a known id (torchferry plan --list)"
        )
    if not _looks_like_path(model):
        return topology.known_topology(model), topology.known_model(model)
    if block_attrs is not None:
        return topology.from_checkpoint(model, block_attrs=tuple(block_attrs)), None
    flat = topology.from_checkpoint(model, block_attrs=())
    names = [t.name for c in flat.components for t in c.all_tensors()]
    guessed = topology.guess_block_attrs(names)
    if not guessed:
        return flat, None
    mapping = _by_component(guessed, names)
    if mapping is not None:
        return topology.from_checkpoint(model, block_attrs=mapping), None
    return topology.from_checkpoint(model, block_attrs=guessed), None


# ------------------------------------------------------------------------------------------ model


@attrs.frozen(kw_only=True)
class Options:
    """What the user asked `torchferry plan` to assume.

    ``device`` supplies every figure not given here (a device class, a saved profile, or the
    default class); ``h2d_bytes_per_s``, ``collective_bytes_per_s`` and ``tflops`` override it.
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
    lines = [line.strip().lstrip("- ").strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines = lines[1:]
    return "; ".join(lines)


class _Planner:
    """Resolves, schedules and simulates the strategies of one topology under one set of options."""

    def __init__(self, topo: Topology, known: KnownModel | None, options: Options) -> None:
        self.topo = topo
        self.known = known
        self.options = options
        self.warnings: list[str] = []
        selection: list[SelectableComponent] = []
        if topo.of_kind("dit"):
            selection.append("dit")
        if topo.of_kind("encoder"):
            selection.append("text_encoder")
        self.selection = frozenset(selection)
        dits = topo.of_kind("dit")
        self.dit = dits[0].path if dits else None
        self.forwards = options.forwards_per_step or (known.forwards_per_step if known is not None else 1)
        # Distributed rows need ranks: 2 unless the user said how many; only then may auto pick them.
        self.world = options.world_size or 2
        self.cost, self.compute, self.block_s = self._cost()

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
        )
        if o.block_ms is not None:
            return cost, f"{o.block_ms:g} ms per block (given)", cost.block_s
        known = self.known
        if known is None:
            s = cost.block_s
            return (
                cost,
                f"{s * 1e3:g} ms per block (assumed: a checkpoint's FLOPs are unknown; pass --block-ms)",
                s,
            )
        res = o.resolution or known.resolution
        text = known.text_tokens if o.text_tokens is None else o.text_tokens
        per_block = known.block_flops(res, text_tokens=text)
        mean = sum(per_block) / len(per_block)
        tflops = o.profile.flops_per_s / 1e12
        if o.tflops is not None:
            assumed = "given"
        elif o.device is policies.DEFAULT_DEVICE:
            assumed = "assumed: RTX 4090-class bf16; pass --tflops"
        else:
            assumed = o.device.source
        batch = f" x batch {known.batch_per_forward}" if known.batch_per_forward > 1 else ""
        description = (
            f"{mean / 1e12:.2f} TFLOP per block{batch} at {res} "
            f"({known.tokens(res)} latent + {text} text tokens) "
            f"on {tflops:g} TFLOP/s ({assumed})"
        )
        return cost, description, cost.block_s

    def config(self, strategy: str) -> OffloadConfig:
        if strategy == "none":
            return OffloadConfig(strategy="none")
        if strategy == "model_level":
            return OffloadConfig(strategy="model_level", components=self.selection)
        if strategy == "layerwise":
            return OffloadConfig(strategy="layerwise", components=self.selection)
        return OffloadConfig(
            strategy="distributed_layerwise",
            components=self.selection,
            dit_transfer="allgather",
            encoder_transfer="rank-local",
            parallel=ParallelLayout(data_parallel_size=self.world),
        )

    def resolve(self, strategy: str) -> Plan:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = topology.resolve(self.topo, self.config(strategy))
        for w in caught:
            text = f"{strategy}: {w.message}"
            if text not in self.warnings:
                self.warnings.append(text)
        return plan

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

    def row(self, strategy: str, policy: Policy, plan: Plan, notes: Sequence[str] = ()) -> StrategyRow:
        schedules, steady = self.generation(policy, plan)
        peak = max((policies.simulate(s, self.cost).peak_device_bytes for s in schedules), default=0)
        step_s = resident_s = 0.0
        if steady is not None:
            # A whole-component schedule anchors no block, so `simulate` implies no block computes:
            # the resident forward is summed here, and the schedule adds what its transfers cost.
            report = policies.simulate(steady, self.cost)
            resident_s = self.resident_forward_s() * self.forwards
            step_s = resident_s + max(report.makespan_s - report.resident_makespan_s, 0.0) * self.forwards
        return StrategyRow(
            strategy=strategy,
            policy=(steady or schedules[0]).policy if schedules else "",
            fits=peak <= self.options.budget_bytes,
            peak_device_bytes=peak,
            step_s=step_s,
            resident_step_s=resident_s,
            host_bytes_per_rank=self.host_bytes(plan),
            notes=tuple(notes),
        )

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
            row = self.row(strategy, policy, plan, notes)
            return row, self.generation(policy, plan)[1]
        except OffloadError as exc:
            return StrategyRow(strategy=strategy, error=_one_line(exc)), None

    def auto(self) -> tuple[StrategyRow, Schedule | None]:
        candidates = ["layerwise"]
        if (self.options.world_size or 1) > 1:
            candidates.append("distributed_layerwise")
        best: tuple[StrategyRow, Schedule | None] | None = None
        problems: list[str] = []
        for strategy in candidates:
            try:
                plan = self.resolve(strategy)
                choice = policies.choose(plan, self.options.budget_bytes, self.cost)
            except OffloadError as exc:
                problems.append(_one_line(exc))
                continue
            policy = choice.policy()
            notes = []
            if choice.resident:
                notes.append(f"{len(choice.resident)} resident blocks ({choice.placement})")
            if choice.strategy == "distributed_layerwise":
                notes.append(f"per rank of {self.world}")
            row = attrs.evolve(self.row("auto", policy, plan, notes), strategy="auto", reason=choice.reason)
            candidate = (row, self.generation(policy, plan)[1])
            if best is None or row.step_s < best[0].step_s * (1 - 1e-9):
                best = candidate
        if best is None:
            return StrategyRow(strategy="auto", error=problems[0] if problems else "nothing to plan"), None
        return best


def build_report(model: str, topo: Topology, known: KnownModel | None, options: Options) -> PlanReport:
    """Evaluate the requested strategies (all, by default) and auto's choice for ``topo``."""
    planner = _Planner(topo, known, options)
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
    )


# ------------------------------------------------------------------------------------------ output


def _b(nbytes: int) -> str:
    return policies.format_bytes(nbytes, exact=False)


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def _blocks(c: ComponentRow) -> str:
    if not c.blocks:
        return "-"
    if c.block_min_bytes == c.block_max_bytes:
        return f"{c.blocks} x {_b(c.block_max_bytes)}"
    return f"{c.blocks} x {_b(c.block_min_bytes)}-{_b(c.block_max_bytes)}"


def format_report(report: PlanReport, *, show_schedule: bool = False) -> str:
    """The readable report `torchferry plan` prints."""
    o = report.options
    kind, _, where = report.source.partition(":")
    if kind == "known":
        where = f"known model; tensor shapes from the published config of {report.hf_repo}"
    elif kind == "checkpoint":
        where = f"safetensors headers of {where}"
    elif kind == "folder":
        where = f"safetensors headers of the pipeline folder {where}"
        if report.known_id:
            where += f"\n(its DiT has the shapes of the known model {report.known_id}, whose FLOPs are known)"
    title = f"{report.model}" + (f" ({report.pipeline_class})" if report.pipeline_class else "")
    lines = [title, where, f"total: {_b(report.total_bytes)} ({report.total_bytes} bytes)", ""]
    lines += _table(
        ["component", "kind", "class", "bytes", "blocks", "remainder"],
        [
            [c.path or "(root)", c.kind, c.class_name or "-", _b(c.nbytes), _blocks(c), _b(c.rest_bytes)]
            for c in report.components
        ],
        {3, 5},
    )
    forwards = (
        f", {report.forwards_per_step} DiT forwards per denoising step (guidance)"
        if report.forwards_per_step > 1
        else ""
    )
    ranks = (
        f"{report.world_size} ranks (given; auto considers them)"
        if o.world_size
        else f"{report.world_size} ranks (assumed; pass --world-size to set it and let auto use them)"
    )
    lines += [
        "",
        f"device memory {_b(o.budget_bytes)} · host-to-device {o.h2d / 1e9:.3g} GB/s · "
        f"all-gather {o.allgather / 1e9:.3g} GB/s · ring depth {o.depth}",
        f"device: {o.device.name} ({o.device.source})",
        f"distributed rows: {ranks}",
        f"compute: {report.compute}",
    ]
    if o.block_ms is None and report.hf_repo:  # derived from FLOPs: say what it comes to
        lines.append(f"         = {_seconds(report.block_s)} per block{forwards}")
    elif forwards:
        lines.append(f"         {forwards.lstrip(', ')}")
    lines.append("")
    table: list[list[str]] = []
    for r in report.rows:
        if r.error is not None:
            table.append([r.strategy, "n/a", "-", "-", "-", r.error])
            continue
        name = r.policy if r.strategy != "auto" else f"auto: {r.policy}"
        table.append(
            [
                name,
                "yes" if r.fits else "no",
                _b(r.peak_device_bytes),
                _seconds(r.step_s),
                f"+{r.overhead * 100:.1f}%",
                "; ".join(r.notes),
            ]
        )
    lines += _table(["strategy", "fits", "peak device", "step", "overhead", "notes"], table, {2, 3, 4})
    lines.append("(fits and peak device count weights only: leave room for activations and the VAE decode)")
    lines.append("")
    rec = report.recommended
    if rec is not None:
        lines.append(
            f"recommended: {rec.policy} — peak {_b(rec.peak_device_bytes)} of {_b(o.budget_bytes)}, "
            f"step {_seconds(rec.step_s)} (+{rec.overhead * 100:.1f}% over all-resident "
            f"{_seconds(rec.resident_step_s)})"
        )
        if rec.reason:
            lines.append(f"why: {rec.reason}")
    elif any(r.strategy == "auto" for r in report.rows):
        lines.append(f"recommended: nothing fits {_b(o.budget_bytes)}")
    lines.extend(f"warning: {w}" for w in report.warnings)
    if show_schedule and report.schedule is not None:
        lines += ["", policies.format_schedule(report.schedule).rstrip("\n")]
    return "\n".join(lines) + "\n"


def _row_document(r: StrategyRow) -> dict[str, Any]:
    if r.error is not None:
        return {"strategy": r.strategy, "applicable": False, "error": r.error}
    return {
        "strategy": r.strategy,
        "applicable": True,
        "policy": r.policy,
        "fits": r.fits,
        "peak_device_bytes": r.peak_device_bytes,
        "host_bytes_per_rank": r.host_bytes_per_rank,
        "step_s": r.step_s,
        "resident_step_s": r.resident_step_s,
        "overhead": r.overhead if math.isfinite(r.overhead) else None,
        "notes": list(r.notes),
        **({"reason": r.reason} if r.reason else {}),
    }


def report_document(report: PlanReport, *, show_schedule: bool = False) -> dict[str, Any]:
    """The stable JSON document of a report (``"torchferry_plan": 1``)."""
    o = report.options
    res = o.resolution
    doc: dict[str, Any] = {
        "torchferry_plan": JSON_VERSION,
        "model": report.model,
        "source": report.source,
        "hf_repo": report.hf_repo or None,
        "pipeline_class": report.pipeline_class,
        "total_bytes": report.total_bytes,
        "components": [attrs.asdict(c) for c in report.components],
        "assumptions": {
            "device_memory_bytes": o.budget_bytes,
            "h2d_bytes_per_s": o.h2d,
            "collective_bytes_per_s": o.allgather,
            "device": attrs.asdict(o.device),
            "host_op_s": o.host_op_s,
            "text_tokens": o.text_tokens,
            "world_size": report.world_size,
            "world_size_given": o.world_size is not None,
            "depth": o.depth,
            "resolution": None if res is None else attrs.asdict(res),
            "tflops": o.tflops,
            "block_ms": o.block_ms,
            "compute": report.compute,
            "block_s": report.block_s,
            "forwards_per_step": report.forwards_per_step,
            "fits_counts": "weights only (no activations, no VAE decode)",
        },
        "strategies": [_row_document(r) for r in report.rows],
        "recommended": None if report.recommended is None else _row_document(report.recommended),
        "warnings": list(report.warnings),
    }
    if show_schedule:
        doc["schedule"] = None if report.schedule is None else policies.format_schedule(report.schedule)
    return doc


def list_document() -> list[dict[str, Any]]:
    """Every known model id with its pipeline class and sizes."""
    names: list[tuple[str, dict[str, Any]]] = [(model_id, {}) for model_id in topology.KNOWN_MODELS]
    names += [(alias, {"alias_of": base}) for alias, base in topology.KNOWN_ALIASES.items()]
    out = []
    for name, extra in names:
        topo = topology.known_topology(name)
        out.append(
            {
                "id": name,
                **extra,
                "pipeline_class": topo.pipeline_class,
                "hf_repo": topology.known_model(name).hf_repo,
                "hub_ids": [repo for repo, m in topology.HUB_IDS.items() if m == name],
                "total_bytes": topo.nbytes,
                "components": {c.path: c.nbytes for c in topo.components},
            }
        )
    return out


def format_list() -> str:
    """The table `torchferry plan --list` prints."""
    rows = []
    for entry in list_document():
        comps = entry["components"]
        dits = sum(n for p, n in comps.items() if p.startswith("transformer"))
        name = entry["id"] + (f" (= {entry['alias_of']}, other VAE)" if "alias_of" in entry else "")
        rows.append([name, entry["pipeline_class"], _b(entry["total_bytes"]), _b(dits), str(len(comps))])
    lines = _table(["id", "pipeline", "total", "DiT(s)", "components"], rows, {2, 3, 4})
    lines += ["", "hub ids (a snapshot in the local Hugging Face cache is planned from its files):"]
    lines += _table(
        ["hub id", "id"], [[repo, model] for repo, model in topology.HUB_IDS.items()], set()
    )[1:]
    return "\n".join(lines) + "\n"
