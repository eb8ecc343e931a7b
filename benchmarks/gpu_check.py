"""The GPU check: does layerwise streaming hide behind compute, at full link speed, in predicted memory?

One command, no network, under 8 minutes on one GPU:

    python benchmarks/gpu_check.py --out DIR [--quick] [--cpu]

On CUDA it measures, in this order:

1. pinned versus pageable host-to-device bandwidth (1 GiB and one block's bytes, median of 5), and
   ``runtime.probe``'s pinned bandwidth and bf16 matmul rate beside the figures of the device class
   the chooser would otherwise assume (``policies.match_device_class``);
2. a compute-heavy DiT-like model in bf16 (hidden 4096, 32 heads, 24 blocks of 12 x hidden^2 weights,
   batch 2 x 16384 tokens, so a block's compute outweighs its transfer) run resident, then under
   torchferry ``layerwise`` at prefetch depth 1 and 2, then under diffusers' group offloading
   (``block_level``, one block per group, ``use_stream=True``) when diffusers imports. For each: time
   per step (CUDA events, median of back-to-back steps), overhead over resident, and whether the
   output is bit-identical to the resident one (``torch.equal``);
3. device memory. torchferry's prediction (``policies.simulate`` on the steady step's schedule)
   counts only what the runtime holds (slots and staged remainders), not activations or inputs. So
   the measured figure is ``max_memory_allocated`` over one steady step minus the step's activation
   peak (measured on the resident run as its ``max_memory_allocated`` minus its starting
   ``memory_allocated``) minus the input bytes; the runtime's own ledger is shown beside it;
4. one instrumented steady step per torchferry run: CUDA events around every weight copy (on the
   copy stream) and around every block's compute (on the compute stream) give the achieved H2D
   bandwidth of the copies (bytes over copy time) and the fraction of copy time that overlapped
   compute.

Targets, printed beside the results: layerwise step time within 5% of resident when a block's
compute time exceeds its transfer time at the pinned peak; achieved H2D at least 90% of the pinned
peak; measured peak within 2% of predicted. Without CUDA (or with ``--cpu``) the same logic runs on a
tiny model on the CPU and the CUDA-only parts are skipped with a message; ``--quick`` shrinks every
size (a GPU smoke run, or the CPU test). Prints one table; writes ``DIR/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import _common as common  # first: puts the repository root on sys.path
import torch
from torch import nn

import torchferry
from torchferry import policies, runtime

STEP_TARGET = 0.05
H2D_TARGET = 0.90
PEAK_TARGET = 0.02


@dataclass(frozen=True)
class Size:
    """The model and how long to run it."""

    hidden: int
    heads: int
    blocks: int
    tokens: int
    batch: int
    warmup: int
    steps: int
    bandwidth_bytes: int


GPU_FULL = Size(
    hidden=4096, heads=32, blocks=24, tokens=16384, batch=2, warmup=2, steps=6, bandwidth_bytes=1 << 30
)
GPU_QUICK = Size(
    hidden=1024, heads=8, blocks=8, tokens=2048, batch=1, warmup=2, steps=3, bandwidth_bytes=1 << 28
)
CPU_SIZE = Size(hidden=64, heads=4, blocks=6, tokens=32, batch=1, warmup=2, steps=5, bandwidth_bytes=0)
CPU_QUICK = Size(hidden=64, heads=4, blocks=4, tokens=16, batch=1, warmup=2, steps=2, bandwidth_bytes=0)


class Block(nn.Module):
    """Pre-norm attention and a 4x MLP, modulated by the timestep (shift, scale, gate), as in a DiT."""

    def __init__(self, hidden: int, heads: int, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6, **kw)
        self.qkv = nn.Linear(hidden, 3 * hidden, **kw)
        self.out = nn.Linear(hidden, hidden, **kw)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6, **kw)
        self.fc1 = nn.Linear(hidden, 4 * hidden, **kw)
        self.fc2 = nn.Linear(4 * hidden, hidden, **kw)
        self.table = nn.Parameter(0.1 * torch.randn(6, hidden, **kw))

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        mod = (self.table[None] + temb[:, None]).unsqueeze(2)  # (B, 6, 1, H)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(1)
        y = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(y).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + gate1 * self.out(a.transpose(1, 2).reshape(b, t, h))
        y = self.norm2(x) * (1 + scale2) + shift2
        out: torch.Tensor = x + gate2 * self.fc2(nn.functional.gelu(self.fc1(y), approximate="tanh"))
        return out


class DiT(nn.Module):
    """Input projection, timestep projection, ``blocks`` blocks, output norm and projection."""

    _layerwise_offload_blocks_attrs: ClassVar[tuple[str, ...]] = ("blocks",)

    def __init__(self, size: Size, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.proj_in = nn.Linear(size.hidden, size.hidden, **kw)
        self.time = nn.Linear(size.hidden, size.hidden, **kw)
        self.blocks = nn.ModuleList(
            Block(size.hidden, size.heads, device=device, dtype=dtype) for _ in range(size.blocks)
        )
        self.norm_out = nn.LayerNorm(size.hidden, elementwise_affine=False, eps=1e-6, **kw)
        self.proj_out = nn.Linear(size.hidden, size.hidden, **kw)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        t = self.time(temb)
        h = self.proj_in(x)
        for block in self.blocks:
            h = block(h, t)
        out: torch.Tensor = self.proj_out(self.norm_out(h))
        return out


def say(text: str) -> None:
    print(text, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------- bandwidth
def h2d_bandwidth(nbytes: int, device: torch.device, repeats: int = 5) -> dict[str, float]:
    """Median bytes per second of one ``nbytes`` host-to-device copy, from pinned and pageable memory."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for kind in ("pinned", "pageable"):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        src.fill_(7)
        samples = []
        for i in range(repeats + 1):
            sync(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=kind == "pinned")
            sync(device)
            if i:
                samples.append(nbytes / (time.perf_counter() - start))
        result[kind] = common.Stats.of(samples).median
        del src
    return result


# ---------------------------------------------------------------------------------------- measuring
def time_steps(
    fn: Callable[[], torch.Tensor], size: Size, device: torch.device
) -> tuple[common.Stats, torch.Tensor]:
    """Warm up, then time ``size.steps`` back-to-back steps (CUDA events on CUDA, else the host clock).

    Returns the last output copied to the host, so no output stays in device memory afterwards.
    """
    out = fn()
    for _ in range(size.warmup - 1):
        out = fn()
    sync(device)
    samples = []
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(size.steps + 1)]  # type: ignore[no-untyped-call]
        marks[0].record()
        for i in range(size.steps):
            out = fn()
            marks[i + 1].record()
        torch.cuda.synchronize(device)
        samples = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(size.steps)]
    else:
        for _ in range(size.steps):
            start = time.perf_counter()
            out = fn()
            samples.append(time.perf_counter() - start)
    return common.Stats.of(samples), out.to("cpu")


def allocated(device: torch.device) -> int | None:
    """Bytes the CUDA allocator has handed out now; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    sync(device)
    return torch.cuda.memory_allocated(device)


def peak_of_step(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[int, int] | None:
    """(bytes allocated at the start, most bytes allocated during) one step; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return start, peak


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def overlap_fraction(copies: list[tuple[float, float]], computes: list[tuple[float, float]]) -> float:
    """Fraction of total copy time during which some compute interval ran."""
    busy = _union(computes)
    total = sum(b - a for a, b in copies)
    hidden = 0.0
    for a, b in copies:
        for c, d in busy:
            hidden += max(0.0, min(b, d) - max(a, c))
    return hidden / total if total > 0 else math.nan


class Clock:
    """Timestamps: CUDA events on a stream (read after a synchronize), or the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self, stream: Any = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def seconds(self, ref: Any, mark: Any) -> float:
        """Seconds from ``ref`` to ``mark`` (both from `mark`; CUDA ones after a synchronize)."""
        if not self.cuda:
            return float(mark - ref)
        return float(ref.elapsed_time(mark)) / 1e3


@contextlib.contextmanager
def probe(session: Any, model: DiT, clock: Clock) -> Iterator[dict[str, list[Any]]]:
    """Timestamp every weight copy of ``session`` (on its copy stream) and every block's compute.

    On CUDA the copy wrapper repeats the runtime's own ordering wait (a no-op the second time) so the
    start mark is when the copy can begin, not when it was queued. On the CPU copies are synchronous
    and the same code measures host timestamps.
    """
    streams = session.engine.streams
    original = streams.copy_in
    seen: dict[str, list[Any]] = {"copies": [], "computes": []}

    def copy_in(dst: Any, dst_bytes: torch.Tensor, src: torch.Tensor) -> None:
        stream = None
        if clock.cuda:
            stream = streams.copy
            if dst.free is None:
                stream.wait_stream(streams.compute)
            else:
                stream.wait_event(dst.free)
        start = clock.mark(stream)
        original(dst, dst_bytes, src)
        seen["copies"].append((start, clock.mark(stream), dst_bytes.numel() * dst_bytes.element_size()))

    open_: list[Any] = []

    def pre(module: nn.Module, args: Any) -> None:
        open_.append(clock.mark())

    def post(module: nn.Module, args: Any, output: Any) -> None:
        seen["computes"].append((open_.pop(), clock.mark()))

    handles = [
        h for b in model.blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))
    ]
    setattr(streams, "copy_in", copy_in)  # noqa: B010 (shadows the method on this instance only)
    try:
        yield seen
    finally:
        delattr(streams, "copy_in")
        for h in handles:
            h.remove()


def copy_figures(
    fn: Callable[[], torch.Tensor], session: Any, model: DiT, device: torch.device
) -> dict[str, Any]:
    """Achieved H2D bandwidth and copy/compute overlap over one instrumented steady step."""
    clock = Clock(device)
    sync(device)
    with probe(session, model, clock) as seen:
        ref = clock.mark()
        out = fn()
        end = clock.mark()
        sync(device)
    del out
    copies = [(clock.seconds(ref, a), clock.seconds(ref, b), n) for a, b, n in seen["copies"]]
    computes = [(clock.seconds(ref, a), clock.seconds(ref, b)) for a, b in seen["computes"]]
    copy_s = sum(b - a for a, b, _ in copies)
    moved = sum(n for _, _, n in copies)
    return {
        "copies": len(copies),
        "bytes": moved,
        "copy_s": copy_s,
        "step_s": clock.seconds(ref, end),
        "achieved_h2d_bytes_per_s": moved / copy_s if copy_s > 0 else math.nan,
        "overlap_fraction": overlap_fraction([(a, b) for a, b, _ in copies], computes),
    }


# ------------------------------------------------------------------------------------------ variants
def layerwise_run(
    model: DiT, inputs: tuple[torch.Tensor, torch.Tensor], size: Size, device: torch.device, depth: int
) -> dict[str, Any]:
    """One torchferry layerwise session: timing, output, memory, ledger, prediction, copy figures."""
    row: dict[str, Any] = {"before": allocated(device)}
    with (
        torch.no_grad(),
        torchferry.offload(model, strategy="layerwise", prefetch_depth=depth, device=device) as session,
    ):

        def fn() -> torch.Tensor:
            out: torch.Tensor = model(*inputs)
            return out

        row["stats"], row["output"] = time_steps(fn, size, device)
        row["memory"] = peak_of_step(fn, device)
        schedule = session.engine.last
        assert schedule is not None, "the session ran no step"
        row["predicted_peak"] = policies.simulate(schedule).peak_device_bytes
        row["ledger_peak"] = session.step_peaks.get(schedule.step)
        row["schedule"] = schedule
        row["host_pinned"] = session.engine.store.pinned
        row["copy"] = copy_figures(fn, session, model, device)
    return row


def diffusers_run(
    model: DiT, inputs: tuple[torch.Tensor, torch.Tensor], size: Size, device: torch.device
) -> dict[str, Any]:
    """diffusers group offloading, one block per group, with a stream on CUDA (none exists on CPU)."""
    apply_group_offloading: Any = importlib.import_module("diffusers.hooks").apply_group_offloading
    before = allocated(device)
    apply_group_offloading(
        model,
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=device.type == "cuda",
    )

    def fn() -> torch.Tensor:
        out: torch.Tensor = model(*inputs)
        return out

    with torch.no_grad():
        stats, out = time_steps(fn, size, device)
        memory = peak_of_step(fn, device)
    return {"stats": stats, "output": out, "memory": memory, "before": before}


# -------------------------------------------------------------------------------------------- report
def _gbs(x: float | None) -> str | None:
    return None if x is None or not math.isfinite(x) else f"{x / 1e9:.1f}"


def _mib(x: float | None) -> str | None:
    return None if x is None else f"{x / (1 << 20):.1f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is present")
    parser.add_argument("--tokens", type=int, help="override the sequence length")
    parser.add_argument("--blocks", type=int, help="override the number of blocks")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda") if cuda else torch.device("cpu")
    size = (GPU_QUICK if args.quick else GPU_FULL) if cuda else (CPU_QUICK if args.quick else CPU_SIZE)
    if args.tokens or args.blocks:
        size = Size(
            **{**asdict(size), "tokens": args.tokens or size.tokens, "blocks": args.blocks or size.blocks}
        )
    dtype = torch.bfloat16
    if not cuda:
        common.pin_threads(1)  # tiny CPU sizes: one thread, so machine load does not swamp the figures
    notes: list[str] = []
    if not cuda:
        notes.append(
            "no CUDA device (or --cpu): skipped the H2D bandwidth test, allocator peaks and the GPU targets; "
            "ran the same logic on a tiny model on the CPU (copies there are synchronous host copies, so the "
            "H2D column is memcpy speed and overlap is 0)"
        )
        say(f"gpu_check: {notes[-1]}")
    else:
        say(f"gpu_check on {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    result: dict[str, Any] = {"device": str(device), "size": asdict(size), "notes": notes}
    out_path = Path(args.out) / "gpu_check.json"

    # 1. the model, resident ---------------------------------------------------------------------
    torch.manual_seed(0)
    model = DiT(size, device=device, dtype=dtype).eval()
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(size.batch, size.tokens, size.hidden, generator=g, device=device, dtype=dtype)
    temb = torch.randn(size.batch, size.hidden, generator=g, device=device, dtype=dtype)
    inputs = (x, temb)
    say(
        f"model: {size.blocks} blocks of {common.fmt_bytes(block_bytes)} "
        f"({common.fmt_bytes(weight_bytes)} in all), "
        f"hidden {size.hidden}, {size.batch} x {size.tokens} tokens, bf16"
    )

    # 2. bandwidth ---------------------------------------------------------------------------------
    bandwidth: dict[str, Any] = {}
    if cuda:
        bandwidth = {
            "buffer": h2d_bandwidth(size.bandwidth_bytes, device),
            "block": h2d_bandwidth(block_bytes, device),
        }
        bandwidth["pinned_peak"] = max(bandwidth["buffer"]["pinned"], bandwidth["block"]["pinned"])
        say(
            f"H2D {common.fmt_bytes(size.bandwidth_bytes)}: "
            f"pinned {_gbs(bandwidth['buffer']['pinned'])} GB/s, "
            f"pageable {_gbs(bandwidth['buffer']['pageable'])} GB/s; one block "
            f"({common.fmt_bytes(block_bytes)}): pinned {_gbs(bandwidth['block']['pinned'])} GB/s, pageable "
            f"{_gbs(bandwidth['block']['pageable'])} GB/s"
        )
    if cuda:
        # `torchferry probe`'s figures next to the device class the chooser would assume without them.
        measured = runtime.probe(device)
        assumed = policies.match_device_class(measured.name) or policies.DEFAULT_DEVICE
        bandwidth["probe"] = {"measured": measured.to_json(), "assumed": assumed.to_json()}
        say(
            f"probe: pinned H2D {_gbs(measured.h2d_bytes_per_s)} GB/s and bf16 matmul "
            f"{measured.flops_per_s / 1e12:.0f} TFLOP/s, against the {assumed.name} class's assumed "
            f"{_gbs(assumed.h2d_bytes_per_s)} GB/s and {assumed.flops_per_s / 1e12:.0f} TFLOP/s"
        )
    result["bandwidth"] = bandwidth

    def resident_fn() -> torch.Tensor:
        out: torch.Tensor = model(*inputs)
        return out

    rows: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        stats, reference = time_steps(resident_fn, size, device)
        memory = peak_of_step(resident_fn, device)
    finite = bool(torch.isfinite(reference).all())
    if not finite:
        notes.append("the resident output has non-finite values, so torch.equal cannot show identity")
    rows["resident"] = {"stats": stats, "output": reference, "memory": memory}
    activation = None if memory is None else memory[1] - memory[0]
    say(f"resident: {common.fmt_seconds(stats.median)} per step")
    t_c = stats.median / size.blocks
    block_flops = (
        2 * size.batch * size.tokens * 12 * size.hidden**2 + 4 * size.batch * size.tokens**2 * size.hidden
    )
    say(f"resident: about {block_flops / t_c / 1e12:.3g} TFLOP/s ({block_flops / 1e12:.3g} TFLOP per block)")
    t_x = block_bytes / bandwidth["pinned_peak"] if cuda else None
    result["block"] = {"bytes": block_bytes, "compute_s": t_c, "transfer_s": t_x, "flops": block_flops}

    # 3. torchferry ------------------------------------------------------------------------------
    model.to("cpu")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    for depth in (1, 2):
        name = f"torchferry layerwise d{depth}"
        rows[name] = layerwise_run(model, inputs, size, device, depth)
        say(f"{name}: {common.fmt_seconds(rows[name]['stats'].median)} per step")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    # 4. diffusers -------------------------------------------------------------------------------
    try:
        rows["diffusers block_level" + (" stream" if cuda else "")] = diffusers_run(
            model, inputs, size, device
        )
    except ImportError as error:
        notes.append(f"diffusers group offloading skipped: {error}")
        say(notes[-1])

    # 5. figures, targets, table -----------------------------------------------------------------
    resident_s = rows["resident"]["stats"].median
    table_rows = []
    verdicts: list[str] = []
    report: dict[str, Any] = {}
    for name, row in rows.items():
        s: common.Stats = row["stats"]
        overhead = s.median / resident_s - 1
        identical = bool(torch.equal(row["output"].to(reference.device), reference))
        measured = None
        if row.get("memory") is not None and activation is not None and row.get("before") is not None:
            # what the offloader held at its peak: the step's peak less what was there before it
            # opened (the inputs) and less the activations the same step needs when resident
            measured = row["memory"][1] - row["before"] - activation
        predicted = row.get("predicted_peak")
        copy = row.get("copy")
        achieved = None if copy is None else copy["achieved_h2d_bytes_per_s"]
        entry = {
            **s.to_json(),
            "overhead": overhead,
            "identical": identical,
            "measured_peak_bytes": measured,
            "predicted_peak_bytes": predicted,
            "ledger_peak_bytes": row.get("ledger_peak"),
            "copy": copy,
            "host_pinned": row.get("host_pinned"),
        }
        report[name] = entry
        table_rows.append(
            [
                name,
                f"{s.median * 1e3:.2f}",
                f"{s.min * 1e3:.2f}",
                f"{s.max * 1e3:.2f}",
                f"{overhead * 100:+.2f}%",
                "yes" if identical else "NO",
                _mib(measured),
                _mib(predicted),
                _mib(row.get("ledger_peak")),
                _gbs(achieved),
                None if copy is None else f"{copy['overlap_fraction'] * 100:.1f}%",
            ]
        )
        if name.startswith("torchferry"):
            if not identical:
                verdicts.append(f"{name}: output NOT bit-identical to resident")
            if (
                row.get("ledger_peak") is not None
                and predicted is not None
                and row["ledger_peak"] != predicted
            ):
                verdicts.append(f"{name}: ledger peak {row['ledger_peak']} != predicted {predicted}")
            if cuda:
                x_ms = (t_x or 0.0) * 1e3
                c_ms = t_c * 1e3
                if t_x is not None and t_c > t_x:
                    entry["step_target_met"] = overhead <= STEP_TARGET
                    status = f"compute {c_ms:.2f} ms > transfer {x_ms:.2f} ms per block, so it applies: " + (
                        "met" if overhead <= STEP_TARGET else "NOT met"
                    )
                else:
                    status = f"not applicable: transfer {x_ms:.2f} ms >= compute {c_ms:.2f} ms per block"
                verdicts.append(
                    f"{name}: step time {overhead * 100:+.2f}% vs resident "
                    f"(target <= {STEP_TARGET:.0%}; {status})"
                )
                if achieved is not None and math.isfinite(achieved):
                    fraction = achieved / bandwidth["pinned_peak"]
                    entry["h2d_fraction_of_peak"] = fraction
                    verdicts.append(
                        f"{name}: achieved H2D {fraction:.1%} of the pinned peak "
                        f"(target >= {H2D_TARGET:.0%}): " + ("met" if fraction >= H2D_TARGET else "NOT met")
                    )
                if measured is not None and predicted:
                    off = measured / predicted - 1
                    entry["peak_error"] = off
                    verdicts.append(
                        f"{name}: measured peak {off:+.2%} vs predicted (target within {PEAK_TARGET:.0%}): "
                        + ("met" if abs(off) <= PEAK_TARGET else "NOT met")
                    )
    say("")
    say(
        f"gpu_check, {device}: {size.blocks} blocks x {common.fmt_bytes(block_bytes)}, "
        f"{size.batch} x {size.tokens} tokens; per block: compute {common.fmt_seconds(t_c)}"
        + (f", transfer at the pinned peak {common.fmt_seconds(t_x)}" if t_x is not None else "")
    )
    if cuda:
        say(
            f"H2D pinned peak {_gbs(bandwidth['pinned_peak'])} GB/s, pageable "
            f"{_gbs(bandwidth['buffer']['pageable'])} GB/s"
        )
    say(
        common.table(
            [
                "variant",
                "ms/step",
                "min",
                "max",
                "vs resident",
                "same",
                "peak MiB",
                "predicted",
                "ledger",
                "H2D GB/s",
                "overlap",
            ],
            table_rows,
        )
    )
    say(
        "peak MiB: max_memory_allocated over a steady step - bytes allocated before the offloader opened "
        "(inputs) - the resident run's activation peak (= weight bytes the offloader held); predicted: "
        "policies.simulate on the same schedule; ledger: the runtime's own count"
    )
    for line in [*verdicts, *notes]:
        say(line)
    result.update(
        {
            "rows": report,
            "activation_peak_bytes": activation,
            "verdicts": verdicts,
            "elapsed_s": time.perf_counter() - started,
        }
    )
    written = common.write_json(out_path, result)
    say(f"wrote {written} in {time.perf_counter() - started:.0f} s")
    return result


if __name__ == "__main__":
    main()
