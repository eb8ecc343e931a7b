"""`torchferry demo`: the bundled toy pipeline, resident and under every strategy, side by side.

The toy's weights are a function of a seed; they are written once to a safetensors checkpoint in a
cache folder and every run loads from it. Each strategy runs the same prompt the same number of
times; the first call warms up, the others are timed per DiT forward (one denoising step). The
table compares peak device bytes (weights the runtime holds on the device; all of them when
resident), time per step, the overhead over the resident run, and whether every output equals the
resident output bit for bit. With a timeline, one more call of the distributed run (or, without it,
of layerwise depth 1) traces one steady DiT step (`Session.trace`), drawn below the same step
simulated.
"""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch

import torchferry
from torchferry import policies, topology
from torchferry._auto import calibrate, measure
from torchferry._errors import OffloadError
from torchferry.cli._tables import table
from torchferry.cli._timeline import Panel, lanes_of, render_panels
from torchferry.runtime import StepTrace
from torchferry.testing import toy

__all__ = ["DEMO_TOY", "DemoRow", "cache_folder", "ensure_checkpoint", "format_table", "run", "timeline_svg"]

#: The demo's toy: big enough that streaming shows in the numbers, small enough for two CPU cores.
DEMO_TOY: dict[str, int] = {"hidden": 256, "blocks": 12, "encoder_blocks": 4}
_HIDDEN, _BLOCKS, _ENCODER_BLOCKS = DEMO_TOY["hidden"], DEMO_TOY["blocks"], DEMO_TOY["encoder_blocks"]
SEED = 0
PROMPT = "a lighthouse at dusk"
_FORMAT = 1
_COMPONENTS = frozenset({"dit", "text_encoder"})
#: Processes of the distributed row.
DISTRIBUTED_WORLD = 2


def cache_folder(override: str | os.PathLike[str] | None = None) -> Path:
    """``override``, else ``$TORCHFERRY_CACHE``, else ``~/.cache/torchferry``."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get("TORCHFERRY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "torchferry"


def _checkpoint_name() -> str:
    shape = "-".join(f"{k}{v}" for k, v in DEMO_TOY.items())
    return f"toy-v{_FORMAT}-{shape}-seed{SEED}.safetensors"


def _skeleton() -> toy.ToyPipeline:
    return toy.ToyPipeline(hidden=_HIDDEN, blocks=_BLOCKS, encoder_blocks=_ENCODER_BLOCKS).eval()


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def ensure_checkpoint(folder: Path) -> tuple[Path, bool]:
    """The demo checkpoint in ``folder`` and whether it was (re)written.

    A file already there is kept when it loads into the toy and equals the seeded weights; otherwise
    it is rewritten (through a temporary file, so an interrupted run never leaves half a checkpoint).
    """
    path = folder / _checkpoint_name()
    seeded = toy.build(SEED, hidden=_HIDDEN, blocks=_BLOCKS, encoder_blocks=_ENCODER_BLOCKS)
    if path.is_file():
        try:
            loaded = toy.load_checkpoint(_skeleton(), path)
        except Exception:  # any unreadable file is simply rewritten
            loaded = None
        if loaded is not None and _same_weights(loaded, seeded):
            return path, False
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{path.name}.{os.getpid()}.partial"
    toy.save_checkpoint(seeded, partial)
    os.replace(partial, path)
    return path, True


def _weight_bytes(module: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@attrs.frozen(kw_only=True)
class DemoRow:
    """One line of the demo's table; ``identical`` is ``None`` for the reference, ``error`` says why a
    strategy could not run."""

    strategy: str
    peak_device_bytes: int = 0
    #: The fastest steady step (the least disturbed by other work), and the median of the same steps.
    step_s: float = 0.0
    median_s: float = 0.0
    calls: int = 0
    identical: bool | None = None
    note: str = ""
    error: str | None = None


class _Progress:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"torchferry demo [{elapsed:6.2f} s] {message}", file=self.stream, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _step_timer(dit: torch.nn.Module, device: torch.device) -> Iterator[list[float]]:
    """Seconds of every forward of ``dit``, outermost around any hooks already installed."""
    times: list[float] = []
    started: list[float] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        _sync(device)
        started.append(time.perf_counter())

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        _sync(device)
        times.append(time.perf_counter() - started.pop())

    handles = [dit.register_forward_pre_hook(pre, prepend=True), dit.register_forward_hook(post)]
    try:
        yield times
    finally:
        for h in handles:
            h.remove()


def _calls(
    pipeline: toy.ToyPipeline, device: torch.device, steps: int, calls: int
) -> tuple[list[torch.Tensor], tuple[float, float]]:
    """Outputs of ``calls`` pipeline calls, and the fastest and the median step of all calls after
    the first (each call's first step, which stages what the text encoder left, is not counted)."""
    outputs: list[torch.Tensor] = []
    with _step_timer(pipeline.transformer, device) as times:
        for _ in range(calls):
            outputs.append(pipeline(PROMPT, steps=steps, seed=SEED, device=device).cpu())
    later = times[steps:] if calls > 1 else times
    steady = [t for i, t in enumerate(later) if i % steps != 0] or later
    return outputs, (min(steady), statistics.median(steady))


def _traced_call(session: torchferry.Session, pipeline: toy.ToyPipeline, device: torch.device) -> StepTrace:
    """The middle DiT step of a three-step call, traced: a steady step that prefetches the next one.

    An untraced call of the same length goes first, so the session has seen that a DiT step follows
    the traced one (what `policies.Step.next` says) whatever call length ran before.
    """
    pipeline(PROMPT, steps=3, seed=SEED, device=device)
    with session.trace("transformer", skip=1) as tracer:
        pipeline(PROMPT, steps=3, seed=SEED, device=device)
    return tracer.result


def _empty() -> toy.ToyPipeline:
    """The demo toy with its parameters on the meta device, for a session to fill from the checkpoint."""
    return toy.build_empty(hidden=_HIDDEN, blocks=_BLOCKS, encoder_blocks=_ENCODER_BLOCKS)


def _run_strategy(
    label: str,
    *,
    checkpoint: Path,
    reference: Sequence[torch.Tensor],
    device: torch.device,
    steps: int,
    calls: int,
    trace: bool = False,
    **options: Any,
) -> tuple[DemoRow, StepTrace | None]:
    """One strategy in this process: weights read from ``checkpoint`` straight into host buffers.

    With ``trace``, one steady step of an extra call after the timed ones is traced too.
    """
    pipeline = _empty()
    traced = None
    with torchferry.offload(
        pipeline, device=device, components=_COMPONENTS, checkpoint=str(checkpoint), **options
    ) as session:
        outputs, (step_s, median_s) = _calls(pipeline, device, steps, calls)
        peak = session.peak_device_bytes
        note = ""
        if "strategy" not in options:
            report = session.report()
            predicted = report.predicted_step_s.get("transformer")
            note = f"chose {report.policy} within {_bytes(report.budget or 0)}"
            if predicted is not None and report.calibrated:
                note += (
                    f"; its calibrated model predicts {predicted * 1e3:.2f} ms per step, measured here "
                    f"{step_s * 1e3:.2f} ms ({(predicted / step_s - 1) * 100:+.1f}%)"
                )
        if trace:
            traced = _traced_call(session, pipeline, device)
    identical = all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True))
    row = DemoRow(
        strategy=label, peak_device_bytes=peak, step_s=step_s, median_s=median_s, calls=calls,
        identical=identical, note=note,
    )
    return row, traced


#: What a rank sends back: its outputs as (raw float32 bytes, shape), its step time, peak bytes and
#: traced step (if asked). Plain bytes, not tensors: a tensor crosses a process boundary as a
#: shared-memory handle, which does not outlive the rank that made it.
_RankResult = tuple[list[tuple[bytes, tuple[int, ...]]], float, int, StepTrace | None]


def _rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: its own GPU when ``device`` names CUDA without an index."""
    if device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(device)


@attrs.frozen(kw_only=True)
class _RankJob:
    """What every rank of the distributed row needs (pickled to each process)."""

    checkpoint: str
    device: str
    steps: int
    calls: int
    trace: bool = False


def _distributed_rank(rank: int, world: int, job: _RankJob) -> _RankResult:
    """One rank of the distributed row (runs in a process `run_ranks` spawned, gloo group joined)."""
    target = _rank_device(job.device, rank)
    pipeline = _empty()
    session = torchferry.offload(
        pipeline,
        strategy="distributed_layerwise",
        device=target,
        components=_COMPONENTS,
        checkpoint=job.checkpoint,
        dit_transfer="allgather",
    )
    try:
        outputs, (step_s, _median) = _calls(pipeline, target, job.steps, job.calls)
        peak = session.peak_device_bytes
        # Every rank runs the traced call (its gathers are collectives); each traces its own step.
        traced = _traced_call(session, pipeline, target) if job.trace else None
    except BaseException:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            session.close()
        raise
    session.close(gather=True)
    raw = [(_raw_bytes(o), tuple(o.shape)) for o in outputs]
    return raw, step_s, peak, traced


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes for the trip back from a rank (no NumPy: a bare install has none)."""
    flat = tensor.detach().to("cpu").contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def _distributed(
    checkpoint: Path,
    reference: Sequence[torch.Tensor],
    *,
    device: torch.device,
    steps: int,
    calls: int,
    world: int,
    trace: bool = False,
) -> tuple[DemoRow, StepTrace | None]:
    """Distributed layerwise over ``world`` local processes joined by a gloo group (and rank 0's trace)."""
    from torchferry.testing import run_ranks

    label = f"distributed_layerwise(depth=1), {world} ranks" + (", gloo" if device.type == "cuda" else "")
    threads = max(1, torch.get_num_threads() // world)
    job = _RankJob(checkpoint=str(checkpoint), device=str(device), steps=steps, calls=calls, trace=trace)
    results = run_ranks(_distributed_rank, world, job, threads=threads, timeout=300.0)
    identical = True
    for raw, _, _, _ in results:
        outputs = [torch.frombuffer(bytearray(b), dtype=torch.float32).reshape(shape) for b, shape in raw]
        identical = identical and all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True))
    per = "thread" if threads == 1 else "threads"
    row = DemoRow(
        strategy=label,
        peak_device_bytes=max(peak for _, _, peak, _ in results),
        step_s=max(step for _, step, _, _ in results),
        calls=calls,
        identical=identical,
        note=f"per rank (the slowest); the {world} processes share this machine, {threads} {per} each"
        + (
            "; gloo on CUDA: every all-gather blocks the host until it completes (no overlap), use NCCL "
            "to measure overlap"
            if device.type == "cuda"
            else ""
        ),
    )
    return row, results[0][3]


def _bytes(n: int) -> str:
    return policies.format_bytes(n, exact=False)


def _spread(row: DemoRow) -> float:
    """How far the median step is above the fastest: the noise a figure carries."""
    return row.median_s / row.step_s - 1 if row.step_s > 0 and row.median_s > 0 else 0.0


def overhead_cell(row: DemoRow, resident: DemoRow) -> str:
    """The overhead over resident from the fastest steps, or ``within noise`` when the spread of
    either run is larger than the difference (offloading is never faster than resident; a negative
    figure is noise)."""
    if resident.step_s <= 0:
        return "-"
    overhead = row.step_s / resident.step_s - 1
    noise = max(_spread(row), _spread(resident))
    if overhead <= 0 or overhead < noise:
        return f"within noise ({noise * 100:.0f}%)"
    return f"{overhead * 100:+.1f}%"


def format_table(rows: Sequence[DemoRow], resident_step_s: float) -> str:
    """The demo's result table: time/step is the fastest steady step, with the median's distance
    above it (the spread); the overhead is judged from the fastest."""
    header = ["strategy", "peak device", "time/step", "overhead", "outputs identical"]
    body: list[list[str]] = []
    resident = next((r for r in rows if r.identical is None and r.error is None), None)
    if resident is None or resident.step_s != resident_step_s:
        resident = DemoRow(strategy="resident", step_s=resident_step_s, median_s=resident_step_s)
    for r in rows:
        if r.error is not None:
            body.append([r.strategy, "-", "-", "-", f"FAILED: {r.error}"])
            continue
        if r.identical is None:
            overhead, same = "-", "(reference)"
        else:
            overhead = overhead_cell(r, resident)
            same = "yes" if r.identical else "NO"
        spread = f" (+{_spread(r) * 100:.0f}%)" if r.median_s > 0 else ""
        body.append(
            [r.strategy, _bytes(r.peak_device_bytes), f"{r.step_s * 1e3:.2f} ms{spread}", overhead, same]
        )
    return "\n".join(table(header, body, right={1, 2, 3})) + "\n"


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
        f"copy {trace.busy_s('copy') * 1e3:.3f} ms in {len(copies)} copies ({_bytes(moved)}), "
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
        components=_COMPONENTS,
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
        calibrated = calibrate([measure(measured, plan)], h2d_bytes_per_s=cost.h2d_bytes_per_s)
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


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 16 MiB host-to-device copy on this machine (best of five)."""
    src = torch.empty(1 << 24, dtype=torch.uint8)
    if device.type == "cuda":
        src = src.pin_memory()
    dst = torch.empty_like(src, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device.type == "cuda")
        _sync(device)
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
    progress(f"checkpoint {'written' if written else 'reused'}: {checkpoint} ({_bytes(size)})")

    resident = toy.load_checkpoint(_skeleton(), checkpoint).to(target)
    assert isinstance(resident, toy.ToyPipeline)
    reference, (resident_step_s, resident_median_s) = _calls(resident, target, steps, calls)
    rows = [
        DemoRow(
            strategy="resident (no offload)",
            peak_device_bytes=_weight_bytes(resident),
            step_s=resident_step_s,
            median_s=resident_median_s,
            calls=calls,
        )
    ]
    # auto's budget: everything but half the DiT's blocks, so it must choose what to stream.
    block = max(b.nbytes for b in topology.discover(resident).component("transformer").blocks)
    auto_budget = _weight_bytes(resident) - (_BLOCKS // 2) * block
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
        _run_strategy, checkpoint=checkpoint, reference=reference, device=target, steps=steps, calls=calls
    )
    for name, options in runs:
        t0 = time.perf_counter()
        row, traced = run(name, trace=timeline is not None and name == "layerwise(depth=1)", **options)
        if traced is not None:
            traces[1] = traced
        rows.append(row)
        progress(
            f"{row.strategy}: {row.step_s * 1e3:.2f} ms per step, peak {_bytes(row.peak_device_bytes)}, "
            f"outputs {'identical' if row.identical else 'DIFFER'} ({time.perf_counter() - t0:.2f} s)"
        )
    if distributed:
        t0 = time.perf_counter()
        progress(f"distributed_layerwise: starting {DISTRIBUTED_WORLD} local processes (gloo)")
        try:
            row, traced = _distributed(
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
            first = str(exc).splitlines()[0]
            row = DemoRow(strategy=f"distributed_layerwise(depth=1), {DISTRIBUTED_WORLD} ranks", error=first)
        rows.append(row)
        progress(
            f"{row.strategy}: {row.step_s * 1e3:.2f} ms per step, peak {_bytes(row.peak_device_bytes)} "
            f"per rank, outputs {'identical' if row.identical else 'DIFFER'} "
            f"({time.perf_counter() - t0:.2f} s)"
        )

    t0 = time.perf_counter()
    row, _ = run(f"auto (device_memory={_bytes(auto_budget)})", device_memory=auto_budget)
    rows.append(row)
    progress(
        f"auto: {row.note or 'no note'}; outputs {'identical' if row.identical else 'DIFFER'} "
        f"({time.perf_counter() - t0:.2f} s)"
    )

    if timeline is not None:
        per_block = resident_step_s / _BLOCKS
        bandwidth = _copy_bandwidth(target)
        cost = policies.CostModel(
            h2d_bytes_per_s=bandwidth, collective_bytes_per_s=bandwidth, block_s=per_block
        )
        provenance = "measured here; all-gather assumed at the H2D rate"
        world = max(traces, default=DISTRIBUTED_WORLD)
        svg = timeline_svg(_empty(), cost, world=world, provenance=provenance, measured=traces.get(world))
        Path(timeline).write_text(svg)
        progress(f"timeline written to {timeline}")

    stdout.write(format_table(rows, resident_step_s))
    where = "host memory standing in for a device" if target.type == "cpu" else str(target)
    timed = f"calls 2-{calls}" if calls > 2 else "call 2" if calls == 2 else "the only call (no warm-up)"
    stdout.write(
        f"peak device: weight bytes held on {target} ({where}); time/step: the fastest steady DiT "
        f"forward of {timed}, {steps} steps each (in brackets: how far the median is above it); "
        "overhead from the fastest, 'within noise' when the spread is larger\n"
    )
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
