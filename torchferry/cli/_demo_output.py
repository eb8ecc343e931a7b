"""What the demo shows: its result table, and one DiT step's streams drawn simulated and measured."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchferry import policies, topology
from torchferry.cli._demo_runs import COMPONENTS, DemoRow
from torchferry.cli._tables import table
from torchferry.cli._timeline import Panel, lanes_of, render_panels
from torchferry.runtime import StepTrace

__all__ = ["format_size", "format_table", "noise_notes", "overhead_cell", "timeline_svg"]


def format_size(nbytes: int) -> str:
    """A byte count as the demo prints it (``1.5 MiB``)."""
    return policies.format_bytes(nbytes, exact=False)


def _spread(row: DemoRow) -> float:
    """How far the median step is above the fastest: the noise a figure carries."""
    return row.median_s / row.step_s - 1 if row.step_s > 0 and row.median_s > 0 else 0.0


def _percent(fraction: float) -> str:
    return f"{fraction * 100:+.0f}%" if abs(fraction) >= 0.1 else f"{fraction * 100:+.1f}%"


def _overhead(row: DemoRow, resident: DemoRow) -> tuple[float, float] | None:
    """The overhead over resident from the fastest steps, and the noise: the larger spread of the two
    runs, or the machine's drift between the resident run's two timings when that is larger."""
    if resident.step_s <= 0 or row.step_s <= 0:
        return None
    return row.step_s / resident.step_s - 1, max(_spread(row), _spread(resident), resident.drift)


def overhead_cell(row: DemoRow, resident: DemoRow) -> str:
    """The overhead over resident from the fastest steps, marked ``(noise)`` when the noise (either
    run's spread, the drift between runs) is as large as the difference, or when it is negative
    (offloading only adds work)."""
    found = _overhead(row, resident)
    if found is None:
        return "-"
    overhead, noise = found
    return _percent(overhead) + (" (noise)" if overhead < 0 or abs(overhead) <= noise else "")


def _resident(rows: Sequence[DemoRow], resident_step_s: float) -> DemoRow:
    resident = next((r for r in rows if r.identical is None and r.error is None), None)
    if resident is None or resident.step_s != resident_step_s:
        resident = DemoRow(strategy="resident", step_s=resident_step_s, median_s=resident_step_s)
    return resident


def format_table(rows: Sequence[DemoRow], resident_step_s: float) -> str:
    """The demo's result table: the fastest and the median steady step of each strategy (the gap
    between them is how sure the figure is), the overhead over resident judged from the fastest."""
    header = ["strategy", "peak device", "fastest", "median", "overhead", "outputs identical"]
    body: list[list[str]] = []
    resident = _resident(rows, resident_step_s)
    for r in rows:
        if r.error is not None:
            body.append([r.strategy, "-", "-", "-", "-", f"FAILED: {r.error}"])
            continue
        if r.identical is None:
            overhead, same = "-", "(reference)"
        else:
            overhead = overhead_cell(r, resident)
            same = "yes" if r.identical else "NO"
        median = f"{r.median_s * 1e3:.2f} ms" if r.median_s > 0 else "-"
        size = format_size(r.peak_device_bytes)
        body.append([r.strategy, size, f"{r.step_s * 1e3:.2f} ms", median, overhead, same])
    return "\n".join(table(header, body, right={1, 2, 3, 4})) + "\n"


def noise_notes(rows: Sequence[DemoRow], resident_step_s: float) -> list[str]:
    """A sentence for each row whose overhead is marked ``(noise)``: why it cannot be read as a cost."""
    resident = _resident(rows, resident_step_s)
    notes = []
    for r in rows:
        found = None if r.identical is None or r.error is not None else _overhead(r, resident)
        if found is None:
            continue
        overhead, noise = found
        spreads = (
            f"the resident run's median is {_spread(resident) * 100:.0f}% above its fastest, this run's "
            f"{_spread(r) * 100:.0f}%, and the resident run moved {resident.drift * 100:.0f}% between its "
            "two timings"
        )
        if overhead < 0:
            notes.append(
                f"{r.strategy}: measured {-overhead * 100:.1f}% faster than resident, which offloading "
                f"cannot be (it only adds work): noise ({spreads})"
            )
        elif overhead <= noise:
            notes.append(
                f"{r.strategy}: {_percent(overhead)} is within the noise ({spreads}): this machine could "
                "not tell its cost from none"
            )
    return notes


def _measured_note(trace: StepTrace, ranks: str) -> str:
    """The measured panel's figures: step time, and each stream's busy time and op count."""
    copies, comms = trace.on("copy"), trace.on("comm")
    blocks = [s for s in trace.on("compute") if s.kind == "compute"]
    moved = sum(s.nbytes for s in copies)
    stalls = (
        f"stalls {trace.stall_s * 1e3:.3f} ms"
        if trace.clock == "cuda events"
        else "no stalls to see: each copy ran on the compute thread, in a gap between blocks"
    )
    return (
        f"{trace.schedule.policy}{ranks}, steady step, {trace.clock}: {trace.wall_s * 1e3:.2f} ms; "
        f"copy {trace.busy_s('copy') * 1e3:.3f} ms in {len(copies)} copies ({format_size(moved)}), "
        + (f"comm {trace.busy_s('comm') * 1e3:.3f} ms in {len(comms)} all-gathers, " if comms else "")
        + f"compute {sum(s.duration_s for s in blocks) * 1e3:.3f} ms in {len(blocks)} blocks; {stalls}"
    )


def timeline_svg(
    pipeline: torch.nn.Module,
    cost: policies.CostModel,
    *,
    world: int = 2,
    depth: int = 1,
    provenance: str = "",
    measured: StepTrace | None = None,
) -> str:
    """An SVG of the copy, comm and compute streams of one steady DiT step, simulated and measured.

    The step is distributed layerwise over ``world`` ranks (so all three streams are busy), or
    layerwise when ``world`` is 1, planned for the pipeline's own topology and replayed under
    ``cost``; ``provenance`` says where the cost model's figures came from. ``measured``, a trace of
    the same step (`Session.trace`), is drawn below it to the same time scale.
    """
    topo = topology.discover(pipeline)
    distributed = world > 1
    config = topology.OffloadConfig(
        strategy="distributed_layerwise" if distributed else "layerwise",
        components=COMPONENTS,
        prefetch_depth=depth,
        dit_transfer="allgather" if distributed else "rank-local",
        parallel=topology.ParallelLayout(data_parallel_size=world),
    )
    plan = topology.resolve(topo, config)
    policy = policies.distributed_layerwise(depth) if distributed else policies.layerwise(depth)
    steady = policies.steady_schedule(policy, plan, "transformer")
    report = policies.simulate(steady, cost)
    block_ms = cost.compute_seconds("transformer.blocks.0", block=True) * 1e3
    ranks = f" x {world} ranks" if distributed else ""
    gather = f", all-gather {cost.collective_bytes_per_s / 1e9:.1f} GB/s" if distributed else ""
    simulated = Panel(
        heading="simulated (policies.simulate under a cost model)",
        lanes=lanes_of(report.timeline),
        note=(
            f"{steady.policy}{ranks}, steady step: {block_ms:.3f} ms/block, "
            f"H2D {cost.h2d_bytes_per_s / 1e9:.1f} GB/s{gather}"
            f"{f' ({provenance})' if provenance else ''}; {report.makespan_s * 1e3:.2f} ms vs "
            f"{report.resident_makespan_s * 1e3:.2f} ms resident"
        ),
    )
    panels = [simulated]
    if measured is not None:
        how = (
            "measured with CUDA events"
            if measured.clock == "cuda events"
            else f"measured on {measured.device} (synchronous copies)"
        )
        rank = ", rank 0" if distributed else ""
        figures = policies.measure(measured, plan)
        calibrated = policies.calibrate([figures], h2d_bytes_per_s=cost.h2d_bytes_per_s)
        again = policies.simulate(measured.schedule, calibrated).makespan_s
        note = (
            f"{_measured_note(measured, ranks)}; calibrated on it (runtime figures, "
            f"{calibrated.host_op_s * 1e6:.1f} us/op host): simulated {again * 1e3:.2f} ms "
            f"({(again / measured.wall_s - 1) * 100:+.1f}%)"
        )
        panels.append(Panel(heading=how + rank, lanes=lanes_of(measured.spans), note=note))
    subtitle = "simulated above, measured below, to one time scale" if measured is not None else ""
    return render_panels(
        panels, title="torchferry demo: one denoising step, stream by stream", subtitle=subtitle
    )
