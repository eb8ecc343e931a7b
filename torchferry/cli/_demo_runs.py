"""The demo's runs: the seeded toy and its checkpoint, each strategy in this process or over local
ranks, and the time of its steps; `_demo` runs them in turn and `_demo_output` shows the rows."""

from __future__ import annotations

import ctypes
import os
import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch

import torchferry
from torchferry import policies
from torchferry.runtime import StepTrace
from torchferry.testing import toy

__all__ = [
    "COMPONENTS",
    "DEMO_TOY",
    "DISTRIBUTED_WORLD",
    "DemoRow",
    "cache_folder",
    "empty_toy",
    "ensure_checkpoint",
    "figures",
    "run_distributed",
    "run_strategy",
    "sync",
    "time_calls",
    "toy_skeleton",
    "weight_bytes",
]

#: The demo's toy: big enough that streaming shows in the numbers, small enough for two CPU cores.
DEMO_TOY: dict[str, int] = {"hidden": 256, "blocks": 12, "encoder_blocks": 4}
_HIDDEN, _BLOCKS, _ENCODER_BLOCKS = DEMO_TOY["hidden"], DEMO_TOY["blocks"], DEMO_TOY["encoder_blocks"]
SEED = 0
PROMPT = "a lighthouse at dusk"
_FORMAT = 1
#: What every run offloads (and the timeline plans for).
COMPONENTS = frozenset({"dit", "text_encoder"})
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


def toy_skeleton() -> toy.ToyPipeline:
    """The demo toy with weights of its own, for the checkpoint to be loaded into."""
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
            loaded = toy.load_checkpoint(toy_skeleton(), path)
        except Exception:  # any unreadable file is simply rewritten
            loaded = None
        if loaded is not None and _same_weights(loaded, seeded):
            return path, False
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{path.name}.{os.getpid()}.partial"
    toy.save_checkpoint(seeded, partial)
    os.replace(partial, path)
    return path, True


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s parameters and buffers, each storage counted once."""
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
    #: How many steady steps the two figures come from.
    timed: int = 0
    #: The reference only: how far its fastest step moved between a run before the others and one
    #: after them (the machine's drift, a noise the spread of one run cannot show).
    drift: float = 0.0
    calls: int = 0
    identical: bool | None = None
    note: str = ""
    error: str | None = None


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so the host clock reads what it took (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _step_timer(dit: torch.nn.Module, device: torch.device) -> Iterator[list[float]]:
    """Seconds of every forward of ``dit``, outermost around any hooks already installed."""
    times: list[float] = []
    started: list[float] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        sync(device)
        started.append(time.perf_counter())

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        sync(device)
        times.append(time.perf_counter() - started.pop())

    handles = [dit.register_forward_pre_hook(pre, prepend=True), dit.register_forward_hook(post)]
    try:
        yield times
    finally:
        for h in handles:
            h.remove()


def figures(steady: Sequence[float]) -> tuple[float, float, int]:
    """The fastest and the median of ``steady`` step times, and how many there are."""
    return min(steady), statistics.median(steady), len(steady)


def time_calls(
    pipeline: toy.ToyPipeline, device: torch.device, steps: int, calls: int
) -> tuple[list[torch.Tensor], list[float]]:
    """Outputs of ``calls`` pipeline calls, and the steady step times of all calls after the first
    (each call's first step, which stages what the text encoder left, is not counted)."""
    outputs: list[torch.Tensor] = []
    with _step_timer(pipeline.transformer, device) as times:
        for _ in range(calls):
            outputs.append(pipeline(PROMPT, steps=steps, seed=SEED, device=device).cpu())
    later = times[steps:] if calls > 1 else times
    steady = [t for i, t in enumerate(later) if i % steps != 0] or later
    return outputs, steady


def _traced_call(session: torchferry.Session, pipeline: toy.ToyPipeline, device: torch.device) -> StepTrace:
    """The middle DiT step of a three-step call, traced: a steady step that prefetches the next one.

    An untraced call of the same length goes first, so the session has seen that a DiT step follows
    the traced one (what `policies.Step.next` says) whatever call length ran before.
    """
    pipeline(PROMPT, steps=3, seed=SEED, device=device)
    with session.trace("transformer", skip=1) as tracer:
        pipeline(PROMPT, steps=3, seed=SEED, device=device)
    return tracer.result


def empty_toy() -> toy.ToyPipeline:
    """The demo toy with its parameters on the meta device, for a session to fill from the checkpoint."""
    return toy.build_empty(hidden=_HIDDEN, blocks=_BLOCKS, encoder_blocks=_ENCODER_BLOCKS)


def run_strategy(
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
    pipeline = empty_toy()
    traced = None
    with torchferry.offload(
        pipeline, device=device, components=COMPONENTS, checkpoint=str(checkpoint), **options
    ) as session:
        outputs, steady = time_calls(pipeline, device, steps, calls)
        step_s, median_s, timed = figures(steady)
        peak = session.peak_device_bytes
        note = ""
        if "strategy" not in options:
            report = session.report()
            check = report.checked_step_s.get("transformer")
            note = f"chose {report.policy} within {policies.format_bytes(report.budget or 0, exact=False)}"
            if check is not None:
                before, then = check
                note += (
                    f"; its model, fitted to the steps before, predicted {before * 1e3:.2f} ms for a step "
                    f"that then took {then * 1e3:.2f} ms ({(before / then - 1) * 100:+.1f}%)"
                )
        if trace:
            traced = _traced_call(session, pipeline, device)
    identical = all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True))
    row = DemoRow(
        strategy=label, peak_device_bytes=peak, step_s=step_s, median_s=median_s, timed=timed,
        calls=calls, identical=identical, note=note,
    )
    return row, traced


#: What a rank sends back: its outputs as (raw float32 bytes, shape), its step times (fastest,
#: median, how many), peak bytes and traced step (if asked). Plain bytes, not tensors: a tensor
#: crosses a process boundary as a shared-memory handle, which does not outlive the rank that made it.
_RankResult = tuple[list[tuple[bytes, tuple[int, ...]]], tuple[float, float, int], int, StepTrace | None]


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
    """One rank of the distributed row (runs in a process `run_ranks` started, gloo group joined)."""
    target = _rank_device(job.device, rank)
    pipeline = empty_toy()
    session = torchferry.offload(
        pipeline,
        strategy="distributed_layerwise",
        device=target,
        components=COMPONENTS,
        checkpoint=job.checkpoint,
        dit_transfer="allgather",
    )
    try:
        outputs, steady = time_calls(pipeline, target, job.steps, job.calls)
        times = figures(steady)
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
    return raw, times, peak, traced


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes for the trip back from a rank (no NumPy: a bare install has none)."""
    flat = tensor.detach().to("cpu").contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def run_distributed(
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
    slowest = max((times for _, times, _, _ in results), key=lambda t: t[0])
    row = DemoRow(
        strategy=label,
        peak_device_bytes=max(peak for _, _, peak, _ in results),
        step_s=slowest[0],
        median_s=slowest[1],
        timed=slowest[2],
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
