"""`torchferry demo`: the bundled toy pipeline, resident and under every strategy, side by side.

The toy's weights are a function of a seed; they are written once to a safetensors checkpoint in a
cache folder and every run loads from it. Each strategy runs the same prompt the same number of
times; the first call warms up, the others are timed per DiT forward (one denoising step). The
table compares peak device bytes (weights the runtime holds on the device; all of them when
resident), time per step, the overhead over the resident run, and whether every output equals the
resident output bit for bit. With a timeline, one more call of the distributed run (or, without it,
of layerwise depth 1) traces one steady DiT step (`Session.trace`), drawn below the same step
simulated.

This module is the script (`run`): each run is `_demo_runs`, the table and timeline `_demo_output`.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch

from torchferry import policies, topology
from torchferry._errors import OffloadError
from torchferry.cli._demo_output import format_size, format_table, noise_notes, timeline_svg
from torchferry.cli._demo_runs import (
    DEMO_TOY,
    DISTRIBUTED_WORLD,
    DemoRow,
    cache_folder,
    empty_toy,
    ensure_checkpoint,
    figures,
    run_distributed,
    run_strategy,
    sync,
    time_calls,
    toy_skeleton,
    weight_bytes,
)
from torchferry.runtime import StepTrace
from torchferry.testing import toy

__all__ = ["run"]


class _Progress:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"torchferry demo [{elapsed:6.2f} s] {message}", file=self.stream, flush=True)


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 16 MiB host-to-device copy on this machine (best of five)."""
    src = torch.empty(1 << 24, dtype=torch.uint8)
    if device.type == "cuda":
        src = src.pin_memory()
    dst = torch.empty_like(src, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device.type == "cuda")
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / max(best, 1e-9)


def run(
    *,
    device: str | None = None,
    steps: int = 8,
    calls: int = 3,
    cache_dir: str | os.PathLike[str] | None = None,
    timeline: str | os.PathLike[str] | None = None,
    distributed: bool = True,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run the demo; 0 when every output equals the resident one, 1 when any differs or fails.

    On the CPU every process computes on one thread, so the resident run, the single-process
    strategies and each rank of the distributed row are timed alike (and steadier on a busy machine).
    """
    target = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if target.type == "cuda" and not torch.cuda.is_available():
        raise OffloadError(f"--device {device}: CUDA is not available here; use --device cpu")
    threads = torch.get_num_threads()
    if target.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _run(
            target,
            steps=steps,
            calls=calls,
            cache_dir=cache_dir,
            timeline=timeline,
            distributed=distributed,
            stdout=out if out is not None else sys.stdout,
            progress=_Progress(err if err is not None else sys.stderr),
        )
    finally:
        torch.set_num_threads(threads)


def _run(
    target: torch.device,
    *,
    steps: int,
    calls: int,
    cache_dir: str | os.PathLike[str] | None,
    timeline: str | os.PathLike[str] | None,
    distributed: bool,
    stdout: TextIO,
    progress: _Progress,
) -> int:
    on = f"{target}, 1 compute thread per process" if target.type == "cpu" else str(target)
    progress(f"device {on}; toy pipeline {DEMO_TOY}, {steps} steps x {calls} calls per strategy")

    folder = cache_folder(cache_dir)
    checkpoint, written = ensure_checkpoint(folder)
    size = checkpoint.stat().st_size
    progress(f"checkpoint {'written' if written else 'reused'}: {checkpoint} ({format_size(size)})")

    resident = toy.load_checkpoint(toy_skeleton(), checkpoint).to(target)
    assert isinstance(resident, toy.ToyPipeline)
    reference, first = time_calls(resident, target, steps, calls)
    resident_step_s, resident_median_s, timed = figures(first)
    rows = [
        DemoRow(
            strategy="resident (no offload)",
            peak_device_bytes=weight_bytes(resident),
            step_s=resident_step_s,
            median_s=resident_median_s,
            timed=timed,
            calls=calls,
        )
    ]
    # auto's budget: everything but half the DiT's blocks, so it must choose what to stream.
    block = max(b.nbytes for b in topology.discover(resident).component("transformer").blocks)
    auto_budget = weight_bytes(resident) - (DEMO_TOY["blocks"] // 2) * block
    progress(f"resident: {resident_step_s * 1e3:.2f} ms per step")
    del resident

    runs: list[tuple[str, dict[str, Any]]] = [
        ("model_level", {"strategy": "model_level"}),
        ("layerwise(depth=1)", {"strategy": "layerwise", "prefetch_depth": 1}),
        ("layerwise(depth=2)", {"strategy": "layerwise", "prefetch_depth": 2}),
    ]
    # Why: the measured step of the timeline, by world size: distributed, else layerwise depth 1.
    traces: dict[int, StepTrace] = {}
    run = functools.partial(
        run_strategy, checkpoint=checkpoint, reference=reference, device=target, steps=steps, calls=calls
    )
    for name, options in runs:
        t0 = time.perf_counter()
        row, traced = run(name, trace=timeline is not None and name == "layerwise(depth=1)", **options)
        if traced is not None:
            traces[1] = traced
        rows.append(row)
        progress(
            f"{row.strategy}: {row.step_s * 1e3:.2f} ms per step, peak {format_size(row.peak_device_bytes)}, "
            f"outputs {'identical' if row.identical else 'DIFFER'} ({time.perf_counter() - t0:.2f} s)"
        )
    if distributed:
        t0 = time.perf_counter()
        progress(f"distributed_layerwise: starting {DISTRIBUTED_WORLD} local processes (gloo)")
        try:
            row, traced = run_distributed(
                checkpoint,
                reference,
                device=target,
                steps=steps,
                calls=calls,
                world=DISTRIBUTED_WORLD,
                trace=timeline is not None,
            )
            if traced is not None:
                traces[DISTRIBUTED_WORLD] = traced
        except OffloadError as exc:
            line = str(exc).splitlines()[0]
            row = DemoRow(strategy=f"distributed_layerwise(depth=1), {DISTRIBUTED_WORLD} ranks", error=line)
        rows.append(row)
        progress(
            f"{row.strategy}: {row.step_s * 1e3:.2f} ms per step, peak {format_size(row.peak_device_bytes)} "
            f"per rank, outputs {'identical' if row.identical else 'DIFFER'} "
            f"({time.perf_counter() - t0:.2f} s)"
        )

    t0 = time.perf_counter()
    row, _ = run(f"auto (device_memory={format_size(auto_budget)})", device_memory=auto_budget)
    rows.append(row)
    progress(
        f"auto: {row.note or 'no note'}; outputs {'identical' if row.identical else 'DIFFER'} "
        f"({time.perf_counter() - t0:.2f} s)"
    )

    # The resident run again, last: how far this machine drifted between runs is noise too.
    again = toy.load_checkpoint(toy_skeleton(), checkpoint).to(target)
    assert isinstance(again, toy.ToyPipeline)
    _, later = time_calls(again, target, steps, calls)
    del again
    step_s, median_s, both = figures(first + later)
    rows[0] = attrs.evolve(
        rows[0],
        step_s=step_s,
        median_s=median_s,
        timed=both,
        drift=abs(min(later) / resident_step_s - 1),
        note=f"timed first and again last: fastest {resident_step_s * 1e3:.2f} ms, then "
        f"{min(later) * 1e3:.2f} ms",
    )
    progress(f"resident again: {min(later) * 1e3:.2f} ms per step")

    if timeline is not None:
        per_block = resident_step_s / DEMO_TOY["blocks"]
        bandwidth = _copy_bandwidth(target)
        cost = policies.CostModel(
            h2d_bytes_per_s=bandwidth, collective_bytes_per_s=bandwidth, block_s=per_block
        )
        provenance = "measured here; all-gather assumed at the H2D rate"
        world = max(traces, default=DISTRIBUTED_WORLD)
        svg = timeline_svg(empty_toy(), cost, world=world, provenance=provenance, measured=traces.get(world))
        Path(timeline).write_text(svg)
        progress(f"timeline written to {timeline}")

    stdout.write(format_table(rows, rows[0].step_s))
    where = "host memory standing in for a device" if target.type == "cpu" else str(target)
    which = f"calls 2-{calls}" if calls > 2 else "call 2" if calls == 2 else "the only call (no warm-up)"
    stdout.write(
        f"peak device: weight bytes held on {target} ({where}). fastest, median: the steady DiT "
        f"forwards of {which} ({timed} per strategy); the further the median is above the fastest, the "
        "busier the machine was. overhead: fastest over the resident run's fastest (timed before and "
        "after the others); '(noise)' marks a difference no larger than either run's spread or the "
        "resident run's drift between its two timings, which this machine could not tell apart\n"
    )
    stdout.writelines(f"{line}\n" for line in noise_notes(rows, rows[0].step_s))
    stdout.writelines(f"{r.strategy}: {r.note}\n" for r in rows if r.note and r.error is None)
    differ = [r.strategy for r in rows if r.identical is False]
    failed = [r.strategy for r in rows if r.error is not None]
    if differ:
        stdout.write(f"outputs differ from the resident run under: {', '.join(differ)}\n")
    if failed:
        stdout.write(f"could not run: {', '.join(failed)}\n")
    if differ or failed:
        return 1
    return 0
