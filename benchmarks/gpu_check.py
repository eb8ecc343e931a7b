"""The GPU check: is torchferry's CUDA path correct and fast? One run settles it.

One command, no network, on torch 2.11 or later, at most 7 minutes on one GPU (one deadline for
the whole run, subprocesses included: a row still running then fails, the rows after it are
skipped; ``--deadline S`` changes it):

    python benchmarks/gpu_check.py --out DIR [--quick] [--cpu] [--only ROW,ROW]

Every row below runs in its own ``try``/``except`` (a failing row keeps its traceback and the run
goes on), ``DIR/gpu_check.json`` is rewritten after every row, and one table is printed at the end:

- ``environment``: torch, CUDA, NCCL, driver, GPU, PCIe generation and width (``nvidia-smi``);
- ``bandwidth``: pinned versus pageable host-to-device copies (a large buffer and one block);
- ``cuda path``: the stream context's type, copy/comm streams distinct from compute, every host
  buffer pinned (``is_pinned()``, the truth), pinned bytes versus host-store bytes, and, from a
  forward pre hook of a block registered before the session opened (torchferry's own runs first,
  so the probe sees the block after its wait), that its parameters are CUDA views inside a slot,
  256-byte aligned, and that every streamed block is re-pointed tensor by tensor there (CUDA) or
  docked (the CPU: one storage exchange per move, see [Note: docking] in
  ``torchferry/runtime/memory/_pack.py``); the row fails if the probe never fired;
- per variant (``resident``, ``torchferry layerwise d1``/``d2``, ``torchferry model_level``,
  ``torchferry resident set``): bit identity with resident (max abs diff otherwise), ms/step and
  overhead, from `Session.trace` the stall time, copy busy time and per-block stalls, achieved H2D
  against the pinned peak, measured versus predicted (``policies.simulate``) versus ledger peak,
  and ``max_memory_reserved``;
- ``transfer bound``: a few tokens, so copies dominate: step time / (blocks x transfer time) and
  the copy stream's busy fraction (the compute-bound size is the variants' own);
- ``host syncs``: steady steps under ``torch.cuda.set_sync_debug_mode("error")``, and host enqueue
  time per step versus GPU time;
- ``host per block``: the host time torchferry's own code adds per streamed block (layerwise less
  resident, least host time to issue a steady forward, alternating rounds: on CUDA the copies are
  queued, so this is all bookkeeping) and its deterministic count of calls and instructions per block;
- ``uva dock``: could a CUDA session dock its packs as a CPU session does (``uva_dock.py``, in a child
  process)? A block's two moves re-pointed tensor by tensor (CUDA's path now) against one storage
  exchange each, with the block's tensors CUDA tensors over their pinned host buffers between uses:
  host time per block bare and in place, bit identity, every block read from its slot, and whether
  such a weight reads right between forwards (a kernel, ``.cpu()``, a device copy), with the rates;
- ``ordering stress``: bit identity with ``torch.cuda._sleep`` on the copy stream before each copy
  and on compute before each evict, depth 1 and 2, and the bytes compute reads: inside every
  block's forward (after its wait) a checksum of each weight's bits, on the compute stream, must be
  that weight's own; ``cuda sanitizer``: one pass in a subprocess under ``TORCH_CUDA_SANITIZER=1``,
  whose copies also write each tensor's first byte again before their ``ready`` event, because
  torch's sanitizer keys every access on a tensor's start address (a slot is filled by one flat
  copy): so it checks every copy against the reads of every tensor it fills, and every evict
  against the next copy into its slot;
- ``open close``: open time, RSS and pinned bytes after ``close()``;
- other paths: ``demo`` (``python -m torchferry demo`` on cuda), ``wan pipeline`` (a tiny
  diffusers WanPipeline called as a user calls it), ``inference mode``, ``pageable``
  (``pin_memory=False``), ``exception mid-step`` (then ``close()``: weights identical, allocated
  memory back to the inputs only);
- ``diffusers record_stream False`` / ``True``: diffusers group offloading, ``use_stream=True``;
- ``quantized``: ``quant.py``'s transfer-bound schedule at bf16, float8 storage, torchao int8 and
  float8, quanto qint8 (bytes moved per step, host bytes, step min/median/max, bit identity);
- ``gguf``: the same transformer as GGUF Q8_0 and Q4_K files opened with ``from_single_file`` under a
  host budget of 80% of the file (bytes moved, host bytes, file tier reads per step, step times,
  bit identity with diffusers' GGUF load run resident).

The rows run correctness first, since a first run at full size may not reach the end: environment,
bandwidth, resident, cuda path, the four variants, ordering stress, cuda sanitizer, exception
mid-step, file tier (``host_tier.py``'s file tier on this device), pageable, inference mode; then host
time: host syncs, host per block, uva dock; then open close, demo, wan pipeline, auto (strategy auto
under a budget about half the blocks short), transfer bound, quantized, gguf, vllm-omni (the engine's
tests on this device) and diffusers record_stream False and True.

Only torch and torchferry are needed; diffusers (and transformers for the WanPipeline row) are
optional: without them those rows say how to bring them and the others run. Without CUDA (or with
``--cpu``) the same logic runs on a tiny model on the CPU (the ``cuda path`` and ``ordering stress``
probes included, without sleeps) and the CUDA-only rows are skipped with a message; ``--quick``
shrinks every size (a GPU smoke run, or the CPU test).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import importlib.util
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import _common as common  # first: puts the repository root on sys.path
import torch
from torch import nn

import torchferry
from torchferry import policies
from torchferry.runtime import same_device, stream_factory
from torchferry.runtime.device._streams import CudaStreams
from torchferry.testing import toy
from torchferry.topology import PACK_ALIGN, Declaration, find_attr

#: The whole run ends within this many seconds, subprocesses included (`Check.row` stops a row that
#: runs past it and skips the rows after): 7 minutes, so a lent GPU machine's 15 minutes, its start
#: included, leave time for a rerun of a few rows (``--only``).
DEADLINE_S = 420.0
STEP_TARGET = 0.05
H2D_TARGET = 0.90
PEAK_TARGET = 0.02
#: GPU cycles one injected ``torch.cuda._sleep`` spins (about a millisecond).
SLEEP_CYCLES = 2_000_000
BRING_DIFFUSERS = (
    "pip install 'diffusers>=0.42' 'transformers>=5.0' 'accelerate>=1.0' (or copy wheels over: "
    "pip download them elsewhere, then pip install --no-index --find-links DIR ...)"
)


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
#: The block the ``cuda path`` row looks inside: one a step loads (not the ring's first, which a
#: steady step finds in its slot already).
LOOKED_AT = "transformer.blocks.2"

CPU_SIZE = Size(hidden=64, heads=4, blocks=6, tokens=32, batch=1, warmup=2, steps=5, bandwidth_bytes=0)
CPU_QUICK = Size(hidden=64, heads=4, blocks=4, tokens=16, batch=1, warmup=2, steps=2, bandwidth_bytes=0)
#: Tokens of the transfer-bound run: so few that a block's copy outlasts its compute.
FEW_TOKENS = 64


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
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()  # the pinned test buffer stays in the caching host allocator otherwise (and in RSS)
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


def host_enqueue_per_block(run: Callable[[], object], blocks: int, device: torch.device) -> float:
    """Host seconds per block to issue one steady forward (least of 5): on CUDA the host-side cost
    that stays exposed once transfers overlap (the queue is drained before each, not inside it)."""
    samples = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        run()
        samples.append(time.perf_counter() - began)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return min(samples) / blocks


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


class Pipe(nn.Module):
    """The DiT as a declared one-component pipeline (so a resident set of blocks may be asked for)."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []
    _offload_plan: ClassVar[Declaration] = Declaration(resident_dit_paths={"transformer"})

    def __init__(self, dit: DiT) -> None:
        super().__init__()
        self.transformer = dit

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.transformer(x, temb)
        return out


class Skip(Exception):
    """A row that cannot run here; its message says why and what would bring it."""


class Deadline(BaseException):
    """The run reached its deadline (`DEADLINE_S`) while a row ran. A `BaseException`, as
    `KeyboardInterrupt` is: the code a row runs may catch ``Exception`` (a refused pin, a device that
    fails to synchronize) and carry on, which would take the deadline for its own failure."""


def _past_deadline(signum: int, frame: Any) -> None:
    raise Deadline("the run reached its deadline (--deadline) while this row ran")


#: auto's calibrated predicted step within this of the measured one (issue 11).
AUTO_PREDICTION_TARGET = 0.10

VARIANTS: dict[str, dict[str, Any]] = {
    "torchferry layerwise d1": {"strategy": "layerwise", "prefetch_depth": 1},
    "torchferry layerwise d2": {"strategy": "layerwise", "prefetch_depth": 2},
    "torchferry model_level": {"strategy": "model_level"},
    "torchferry resident set": {"strategy": "layerwise", "prefetch_depth": 1, "resident_layers": 2},
}


def rss_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc``), else ``None``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def nvidia_smi() -> dict[str, str]:
    """Driver, GPU and PCIe link facts from ``nvidia-smi`` when it is installed."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"nvidia_smi": "not found"}
    fields = [
        "driver_version",
        "name",
        "pcie.link.gen.current",
        "pcie.link.gen.max",
        "pcie.link.width.current",
        "pcie.link.width.max",
        "memory.total",
    ]
    done = subprocess.run(
        [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    first = done.stdout.strip().splitlines()[:1]
    if done.returncode != 0 or not first:
        return {"nvidia_smi": f"failed: {done.stderr.strip()[:200]}"}
    return dict(zip(fields, (v.strip() for v in first[0].split(",")), strict=False))


class Check:
    """The run: the device, the model and inputs, the rows so far, and the JSON written after each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.cuda = torch.cuda.is_available() and not args.cpu
        self.device = torch.device("cuda") if self.cuda else torch.device("cpu")
        size = (
            (GPU_QUICK if args.quick else GPU_FULL) if self.cuda else (CPU_QUICK if args.quick else CPU_SIZE)
        )
        if args.tokens or args.blocks:
            size = replace(size, tokens=args.tokens or size.tokens, blocks=args.blocks or size.blocks)
        self.size = size
        self.quick = bool(args.quick)
        self.only = set(args.only.split(",")) if args.only else None
        self.out = Path(args.out) / "gpu_check.json"
        self.started = time.perf_counter()
        self.deadline = self.started + float(getattr(args, "deadline", None) or DEADLINE_S)
        self.rows: dict[str, dict[str, Any]] = {}
        #: The row after which the CUDA context failed (the rows after it are skipped), or ``None``.
        self.broken: str | None = None
        self.notes: list[str] = []
        self.bandwidth: dict[str, Any] = {}
        self.dtype = torch.bfloat16
        torch.manual_seed(0)
        self.model = Pipe(DiT(size, device=torch.device("cpu"), dtype=self.dtype)).eval()
        self.block_bytes = sum(
            p.numel() * p.element_size() for p in self.model.transformer.blocks[0].parameters()
        )
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.inputs = self.make_inputs(size.tokens)
        self.reference: torch.Tensor | None = None
        self.resident_s: float | None = None
        self.activation: int | None = None

    # ------------------------------------------------------------------------------------ plumbing
    def make_inputs(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=self.device).manual_seed(1)
        kw: dict[str, Any] = {"generator": g, "device": self.device, "dtype": self.dtype}
        s = self.size
        return torch.randn(s.batch, tokens, s.hidden, **kw), torch.randn(s.batch, s.hidden, **kw)

    def fn(self, inputs: tuple[torch.Tensor, torch.Tensor] | None = None) -> Callable[[], torch.Tensor]:
        args = self.inputs if inputs is None else inputs

        def run() -> torch.Tensor:
            out: torch.Tensor = self.model(*args)
            return out

        return run

    def needs_cuda(self) -> None:
        if not self.cuda:
            raise Skip("needs CUDA")

    def remaining(self) -> float:
        """Seconds left before the run's deadline."""
        return self.deadline - time.perf_counter()

    def budget(self, seconds: float) -> float:
        """A subprocess's timeout: ``seconds``, or less to end before the deadline (`Skip`: none left)."""
        left = self.remaining() - 5.0
        if left <= 0:
            raise Skip("no time left before the deadline")
        return min(seconds, left)

    def row(self, name: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one row: its figures, or why it was skipped, or its traceback; then rewrite the JSON.

        A row that would start past the deadline is skipped; one still running at the deadline is
        stopped there (a timer signal, where the platform has one) and fails with `Deadline`.
        """
        if self.only is not None and name not in self.only:
            return {}
        begin = time.perf_counter()
        timer = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        try:
            try:
                left = self.remaining()
                if left <= 0:
                    raise Skip("past the run's deadline (--deadline)")
                if self.broken is not None:
                    raise Skip(f"the CUDA context failed after row {self.broken!r}")
                if timer:
                    signal.signal(signal.SIGALRM, _past_deadline)
                    # Again every 5 s until the row ends: a signal raised where Python drops the
                    # exception (a ``__del__``, a weakref callback) comes back.
                    signal.setitimer(signal.ITIMER_REAL, left, 5.0)
                entry: dict[str, Any] = {"status": "ok", **body()}
            finally:
                if timer:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except Skip as why:
            entry = {"status": "skipped", "why": str(why)}
        except (Exception, Deadline) as exc:
            entry = {
                "status": "FAILED",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        if timer:  # (again: a signal between the row's end and the inner disarming left it armed)
            signal.setitimer(signal.ITIMER_REAL, 0)
        gc.collect()
        if self.cuda and self.broken is None:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.set_sync_debug_mode(0)
            except Exception as exc:  # a sticky error (an illegal address): the context is gone
                entry["cleanup_error"] = f"{type(exc).__name__}: {exc}"
                self.broken = name
        entry["seconds"] = time.perf_counter() - begin
        self.rows[name] = entry
        self.write()
        say(f"[{time.perf_counter() - self.started:6.1f} s] {name}: {entry['status']} {_brief(entry)}")
        return entry

    def write(self) -> None:
        payload = {
            "device": str(self.device),
            "size": asdict(self.size),
            "bandwidth": self.bandwidth,
            "rows": self.rows,
            "notes": self.notes,
            "elapsed_s": time.perf_counter() - self.started,
        }
        common.write_json(self.out, payload)

    def identity(self, out: torch.Tensor) -> dict[str, Any]:
        assert self.reference is not None, "the resident row must run first"
        same = bool(torch.equal(out, self.reference))
        diff = 0.0 if same else float((out.float() - self.reference.float()).abs().max())
        return {"identical": same, "max_abs_diff": diff}

    # --------------------------------------------------------------------------------------- rows
    def environment(self) -> dict[str, Any]:
        info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
        try:
            nccl = torch.cuda.nccl.version() if self.cuda else None  # type: ignore[no-untyped-call]
            info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
        except Exception as exc:
            info["nccl"] = f"unavailable ({exc})"
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            info.update(
                gpu=props.name, gpu_memory=props.total_memory, capability=f"{props.major}.{props.minor}"
            )
            info.update(nvidia_smi())
        info["diffusers"] = _version("diffusers")
        info["transformers"] = _version("transformers")
        return info

    def measure_bandwidth(self) -> dict[str, Any]:
        self.needs_cuda()
        self.bandwidth = {
            "buffer": h2d_bandwidth(self.size.bandwidth_bytes, self.device),
            "block": h2d_bandwidth(self.block_bytes, self.device),
        }
        self.bandwidth["pinned_peak"] = max(
            self.bandwidth["buffer"]["pinned"], self.bandwidth["block"]["pinned"]
        )
        return {**self.bandwidth}

    def resident(self) -> dict[str, Any]:
        self.model.to(self.device)
        try:
            with torch.no_grad():
                stats, out = time_steps(self.fn(), self.size, self.device)
                memory = peak_of_step(self.fn(), self.device)
        finally:
            self.model.to("cpu")
        self.reference = out
        self.resident_s = stats.median
        self.activation = None if memory is None else memory[1] - memory[0]
        return {**stats.to_json(), "identical": True, "max_abs_diff": 0.0, "overhead": 0.0}

    def cuda_path(self) -> dict[str, Any]:
        """The CUDA path ran (on the CPU: the same checks of the CPU path): the stream context's type,
        distinct copy and comm streams, every host buffer pinned, every streamed block re-pointed
        tensor by tensor on CUDA and docked on the CPU (``blocks_docked``), and, from a forward pre hook of a
        block a step loads, registered before the session opened as a user's would be (it runs after
        torchferry's own, so after the block's wait), that the block's parameters are device views
        inside a slot, 256-byte aligned. The probe must fire, or the row fails."""
        seen: dict[str, Any] = {}
        engines: list[Any] = []

        def inside(module: nn.Module, args: Any) -> None:
            if seen or not engines:
                return
            engine = engines[0]
            # A re-pointed block views a slot's storage; a docked one (CPU) one from the slot's bytes on.
            buffers = [t.data for _, t in engine.slots.slots.values()]
            slots = {t.untyped_storage().data_ptr() for t in buffers} | {t.data_ptr() for t in buffers}
            params = list(module.parameters())
            seen["block_params_on_device"] = all(same_device(p.device, engine.device) for p in params)
            seen["block_params_in_a_slot"] = all(p.untyped_storage().data_ptr() in slots for p in params)
            seen["block_params_256_aligned"] = all(p.data_ptr() % PACK_ALIGN == 0 for p in params)

        handle = find_attr(self.model, LOOKED_AT).register_forward_pre_hook(inside)
        try:
            with (
                torch.no_grad(),
                torchferry.offload(self.model, strategy="layerwise", device=self.device) as session,
            ):
                engines.append(session.engine)
                self.fn()()
                streams: Any = session.engine.streams
                store = session.engine.store
                buffers = [g.host for g in store.packs.values() if g.nbytes]
                # How a streamed block reaches its slot: docked (one storage exchange, host and slot
                # one kind of memory: the CPU) or re-pointed tensor by tensor (CUDA: a CPU tensor
                # cannot read device memory). See [Note: docking] in torchferry/runtime/memory/_pack.py.
                blocks = [g for name, g in store.packs.items() if ".blocks." in f".{name}"]
                docked = sum(g.bound is not None for g in blocks)
                result = {
                    "stream_context": type(streams).__name__,
                    "blocks_docked": docked,
                    "blocks_repointed": len(blocks) - docked,
                    "blocks_move_as_expected": docked == (0 if self.cuda else len(blocks)) and bool(blocks),
                    "probe_fired": bool(seen),
                    "pinned_bytes": store.pinned_bytes,
                    "host_store_bytes": store.nbytes,
                    **seen,
                }
                if self.cuda:
                    result.update(
                        copy_stream_distinct=streams.copy != streams.compute,
                        comm_stream_distinct=streams.comm not in (streams.compute, streams.copy),
                        store_pinned_flag=store.pinned,
                        every_buffer_is_pinned=all(b.is_pinned() for b in buffers),
                        pinned_over_store=store.pinned_bytes / store.nbytes if store.nbytes else None,
                    )
        finally:
            handle.remove()
        problems = [k for k, v in result.items() if v is False]
        expected = "CudaStreams" if self.cuda else "CpuStreams"
        if problems or result["stream_context"] != expected:
            path = "CUDA" if self.cuda else "CPU"
            raise AssertionError(f"the {path} path did not hold: {problems or result}")
        return result

    def variant(self, name: str, options: dict[str, Any]) -> dict[str, Any]:
        before = allocated(self.device)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with torch.no_grad(), torchferry.offload(self.model, device=self.device, **options) as session:
            stats, out = time_steps(self.fn(), self.size, self.device)
            memory = peak_of_step(self.fn(), self.device)
            schedule = session.engine.last
            assert schedule is not None, "the session ran no step"
            predicted = policies.simulate(schedule).peak_device_bytes
            ledger = session.step_peaks.get(schedule.step)
            with session.trace("transformer") as tracer:
                self.fn()()
            trace = tracer.result
            copy = copy_figures(self.fn(), session, self.model.transformer, self.device)
            enqueue = host_enqueue_per_block(self.fn(), self.size.blocks, self.device)
            reserved = torch.cuda.max_memory_reserved(self.device) if self.cuda else None
            pinned = session.engine.store.pinned
        measured = None
        if memory is not None and before is not None and self.activation is not None:
            measured = memory[1] - before - self.activation
        copies = trace.on("copy")
        copy_s = sum(s.duration_s for s in copies)
        moved = sum(s.nbytes for s in copies)
        achieved = moved / copy_s if copy_s > 0 else None
        stalls = [(s.label, s.duration_s) for s in trace.spans if s.kind == "stall"]
        row: dict[str, Any] = {
            **stats.to_json(),
            **self.identity(out),
            "overhead": stats.median / self.resident_s - 1 if self.resident_s else None,
            "predicted_peak_bytes": predicted,
            "ledger_peak_bytes": ledger,
            "measured_peak_bytes": measured,
            "max_memory_reserved": reserved,
            "trace_wall_s": trace.wall_s,
            "stall_s": trace.stall_s,
            "copy_busy_s": trace.busy_s("copy"),
            "block_stalls": stalls,
            "achieved_h2d_bytes_per_s": achieved,
            "h2d_fraction_of_peak": achieved / self.bandwidth["pinned_peak"]
            if achieved and self.bandwidth.get("pinned_peak")
            else None,
            "copy": copy,
            "host_pinned": pinned,
            "enqueue_per_block_s": enqueue,
        }
        row["verdict"] = "; ".join(self.verdicts(row))
        return row

    def auto_choice(self) -> dict[str, Any]:
        """``offload(model, device_memory=...)`` (strategy auto) under a budget about half the blocks short of
        everything: what it chose, and its calibrated predicted step against the measured one."""
        budget = self.weight_bytes - max(self.size.blocks // 2 - 1, 0) * self.block_bytes
        with (
            torch.no_grad(),
            torchferry.offload(self.model, device=self.device, device_memory=budget) as session,
        ):
            stats, out = time_steps(self.fn(), self.size, self.device)
            report = session.report()
        predicted = report.predicted_step_s.get("transformer")
        error = predicted / stats.min - 1 if predicted else None
        said = "not calibrated" if error is None else f"{error:+.1%} vs the measured min"
        met = error is not None and abs(error) <= AUTO_PREDICTION_TARGET
        return {
            **stats.to_json(),
            **self.identity(out),
            "budget_bytes": budget,
            "policy": report.policy,
            "h2d_bytes_per_s": report.h2d_bytes_per_s,
            "host_op_s": report.host_op_s,
            "host_block_s": report.host_block_s,
            "predicted_step_s": predicted,
            "traced_step_s": report.measured_step_s.get("transformer"),
            "prediction_error": error,
            "switches": list(report.switches),
            "reason": report.reason,
            "verdict": f"auto chose {report.policy}; predicted {said}: "
            + ("met" if met else "NOT met")
            + f" (target {AUTO_PREDICTION_TARGET:.0%})",
        }

    def verdicts(self, row: dict[str, Any]) -> list[str]:
        """The targets a variant is held to: ledger == prediction, and on CUDA step time, H2D and peak."""
        said = []
        if row["ledger_peak_bytes"] is not None and row["ledger_peak_bytes"] != row["predicted_peak_bytes"]:
            said.append(f"ledger {row['ledger_peak_bytes']} != predicted {row['predicted_peak_bytes']}")
        peak = self.bandwidth.get("pinned_peak")
        if not self.cuda or not peak or self.resident_s is None:
            return said
        compute, transfer = self.resident_s / self.size.blocks, self.block_bytes / peak
        if row["overhead"] is not None and compute > transfer:
            met = row["overhead"] <= STEP_TARGET
            said.append(f"step within {STEP_TARGET:.0%} of resident: {'met' if met else 'NOT met'}")
        elif row["overhead"] is not None:
            said.append(
                f"step target n/a (transfer {transfer * 1e3:.2f} ms >= compute {compute * 1e3:.2f} ms)"
            )
        fraction = row["h2d_fraction_of_peak"]
        if fraction is not None:
            said.append(
                f"H2D {fraction:.0%} of pinned peak: {'met' if fraction >= H2D_TARGET else 'NOT met'}"
            )
        if row["measured_peak_bytes"] is not None and row["predicted_peak_bytes"]:
            off = row["measured_peak_bytes"] / row["predicted_peak_bytes"] - 1
            row["peak_error"] = off
            said.append(f"peak {off:+.1%} vs predicted: {'met' if abs(off) <= PEAK_TARGET else 'NOT met'}")
        return said

    def transfer_bound(self) -> dict[str, Any]:
        few = self.make_inputs(FEW_TOKENS)
        with (
            torch.no_grad(),
            torchferry.offload(
                self.model, strategy="layerwise", prefetch_depth=2, device=self.device
            ) as session,
        ):
            stats, _ = time_steps(self.fn(few), self.size, self.device)
            with session.trace("transformer") as tracer:
                self.fn(few)()
        trace = tracer.result
        peak = self.bandwidth.get("pinned_peak")
        transfer = self.block_bytes / peak if peak else None
        return {
            **stats.to_json(),
            "tokens": FEW_TOKENS,
            "block_transfer_s": transfer,
            "step_over_blocks_x_transfer": stats.median / (self.size.blocks * transfer) if transfer else None,
            "copy_busy_fraction": trace.busy_s("copy") / trace.wall_s if trace.wall_s > 0 else None,
        }

    def host_syncs(self) -> dict[str, Any]:
        self.needs_cuda()
        with torch.no_grad(), torchferry.offload(self.model, strategy="layerwise", device=self.device):
            run = self.fn()
            for _ in range(2):
                run()
            torch.cuda.synchronize()
            enqueue = []
            gpu = []
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    start_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    end_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    start_event.record()
                    began = time.perf_counter()
                    run()
                    enqueue.append(time.perf_counter() - began)
                    end_event.record()
                    gpu.append((start_event, end_event))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        gpu_s = [a.elapsed_time(b) / 1e3 for a, b in gpu]
        return {
            "steady_steps_without_a_host_sync": len(enqueue),
            "enqueue_s_per_step": common.Stats.of(enqueue).median,
            "gpu_s_per_step": common.Stats.of(gpu_s).median,
            "enqueue_per_block_s": common.Stats.of(enqueue).median / self.size.blocks,
        }

    def host_per_block(self) -> dict[str, Any]:
        """Host time torchferry's own code adds per streamed block on this device (issue 40): the
        least host time to issue a steady forward, per block, layerwise (depth 1) less resident, in
        alternating rounds; and the deterministic count of its work per block
        (`torchferry.testing._calls.count_calls`), the figure tests/test_hot_path.py budgets. On
        CUDA the copies are queued, so the difference is all bookkeeping; on the CPU it holds the
        copies too."""
        from torchferry.testing._calls import count_calls

        blocks = self.size.blocks
        resident: list[float] = []
        ours: list[float] = []
        with torch.no_grad():
            for _ in range(3):
                self.model.to(self.device)
                try:
                    self.fn()()
                    resident.append(host_enqueue_per_block(self.fn(), blocks, self.device))
                finally:
                    self.model.to("cpu")
                with torchferry.offload(self.model, strategy="layerwise", device=self.device):
                    run = self.fn()
                    for _ in range(3):
                        run()
                    ours.append(host_enqueue_per_block(run, blocks, self.device))
                    count = count_calls(run)
        host = min(ours) - min(resident)
        return {
            "resident_enqueue_per_block_s": min(resident),
            "enqueue_per_block_s": min(ours),
            "host_per_block_s": host,
            "calls_per_block": count.calls / blocks,
            "c_calls_per_block": count.c_calls / blocks,
            "instructions_per_block": count.instructions / blocks,
            "tensor_ops_per_block": count.tensor_ops / blocks,
            "verdict": (
                f"torchferry adds {host * 1e6:.1f} us of host time per block ({min(resident) * 1e6:.1f} -> "
                f"{min(ours) * 1e6:.1f}, least of 3 rounds{'' if self.cuda else ', the copy included'}); "
                f"{count.calls / blocks:.1f} calls, {count.instructions / blocks:.0f} instructions, "
                f"{count.tensor_ops / blocks:.1f} tensor ops per block"
            ),
        }

    def ordering_stress(self) -> dict[str, Any]:
        """Bit identity with ``torch.cuda._sleep`` on the copy stream before each copy and on compute
        before each evict's release (a missing wait would then let a copy overwrite bytes a block still
        reads, or a block read a slot still being written), and the bytes compute reads: a forward pre
        hook of every block (after torchferry's, so after the block's wait) sums each weight's bits on
        the compute stream, right where the block's own kernels read them, and every sum must be the
        block's own. On the CPU the same runs without sleeps (copies are synchronous there)."""
        result: dict[str, Any] = {}
        blocks = list(self.model.transformer.blocks)
        own = [[int(_bits(p)) for p in b.parameters()] for b in blocks]
        for depth in (1, 2):
            outs: list[torch.Tensor] = []
            read: list[tuple[int, list[torch.Tensor]]] = []
            with (
                torch.no_grad(),
                torchferry.offload(
                    self.model, strategy="layerwise", prefetch_depth=depth, device=self.device
                ) as session,
                delayed(session.engine.streams) if self.cuda else contextlib.nullcontext(),
            ):
                handles = [b.register_forward_pre_hook(_reader(i, read)) for i, b in enumerate(blocks)]
                try:
                    for _ in range(3):
                        outs.append(self.fn()().cpu())
                finally:
                    for h in handles:
                        h.remove()
            same = [bool(torch.equal(o, self.reference)) for o in outs]
            exact = [all(int(x) == y for x, y in zip(sums, own[i], strict=True)) for i, sums in read]
            result[f"d{depth}_identical"] = all(same)
            result[f"d{depth}_block_reads_checked"] = len(read)
            result[f"d{depth}_block_reads_exact"] = bool(read) and all(exact)
        if not all(v for k, v in result.items() if not k.endswith("_checked")):
            raise AssertionError(
                f"outputs or the bytes blocks read changed when copies and evicts were delayed: {result}"
            )
        return result

    def sanitizer(self) -> dict[str, Any]:
        self.needs_cuda()
        env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
        done = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--sanitizer-child",
                "--out",
                str(self.out.parent),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=self.budget(300),
            check=False,
        )
        tail = (done.stdout + done.stderr).strip().splitlines()[-20:]
        if done.returncode != 0:
            raise AssertionError("the CUDA sanitizer pass failed:\n" + "\n".join(tail))
        return {"returncode": done.returncode, "tail": tail[-3:]}

    def open_close(self) -> dict[str, Any]:
        gc.collect()
        rss_before = rss_bytes()
        began = time.perf_counter()
        session = torchferry.offload(self.model, strategy="layerwise", device=self.device)
        opened = time.perf_counter() - began
        rss_open = rss_bytes()
        store = session.engine.store
        pinned_open, store_bytes = store.pinned_bytes, store.nbytes
        try:
            with torch.no_grad():
                self.fn()()
        finally:
            began = time.perf_counter()
            session.close()  # (also when the step failed: the rows after use the model)
            closed = time.perf_counter() - began
        gc.collect()
        rss_after = rss_bytes()
        host_stats: dict[str, Any] = {}
        if self.cuda and hasattr(torch.cuda, "host_memory_stats"):
            stats = torch.cuda.host_memory_stats()
            host_stats = {k: v for k, v in stats.items() if "allocated_bytes" in k or "reserved_bytes" in k}
        return {
            "open_s": opened,
            "close_s": closed,
            "rss_before_open": rss_before,
            "rss_open": rss_open,
            "rss_after_close": rss_after,
            "weights_bytes": self.weight_bytes,
            "pinned_bytes_open": pinned_open,
            "host_store_bytes": store_bytes,
            "pinned_over_store": pinned_open / store_bytes if store_bytes else None,
            "pinned_bytes_after_close": store.pinned_bytes,
            "caching_host_allocator": host_stats,
        }

    def demo(self) -> dict[str, Any]:
        self.needs_cuda()
        done = subprocess.run(
            [sys.executable, "-m", "torchferry", "demo", "--device", "cuda", "--calls", "2", "--steps", "4"],
            capture_output=True,
            text=True,
            timeout=self.budget(180),
            check=False,
            cwd=str(Path(__file__).resolve().parents[1]),
        )
        warned = [line for line in done.stderr.splitlines() if "OffloadWarning" in line]
        if done.returncode != 0 or warned:
            raise AssertionError(
                f"demo rc {done.returncode}, warnings {warned}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        return {"returncode": done.returncode, "table": done.stdout.strip().splitlines()[-12:]}

    def wan_pipeline(self) -> dict[str, Any]:
        self.needs_cuda()
        try:
            importlib.import_module("diffusers")
            importlib.import_module("transformers")
        except ImportError as exc:
            raise Skip(f"{exc}; bring them with {BRING_DIFFUSERS}") from None
        pipe = toy.wan_pipeline()
        pipe.set_progress_bar_config(disable=True)
        ids = torch.tensor([[3, 7, 1, 9, 2, 5, 0, 0]])
        call = {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 3, "output_type": "pt"}
        with torch.no_grad():
            embeds = pipe.text_encoder(ids).last_hidden_state
        with torchferry.offload(pipe, strategy="layerwise", device="cuda"), torch.no_grad():
            frames = pipe(
                prompt_embeds=embeds,
                negative_prompt_embeds=embeds.flip(1),
                generator=torch.Generator().manual_seed(0),
                **call,
            ).frames
        return {"frames_shape": list(frames.shape), "finite": bool(torch.isfinite(frames).all())}

    def inference_mode(self) -> dict[str, Any]:
        with torch.inference_mode(), torchferry.offload(self.model, strategy="layerwise", device=self.device):
            outs = [self.fn()().cpu() for _ in range(2)]
        return self.identity(outs[-1])

    def pageable(self) -> dict[str, Any]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with (
                torch.no_grad(),
                torchferry.offload(
                    self.model, strategy="layerwise", device=self.device, pin_memory=False
                ) as session,
            ):
                stats, out = time_steps(self.fn(), self.size, self.device)
                pinned = session.engine.store.pinned
        said = [str(w.message) for w in caught if issubclass(w.category, torchferry.OffloadWarning)]
        if self.cuda and len(said) != 1:
            raise AssertionError(f"pin_memory=False on CUDA should warn once, got {said}")
        return {**stats.to_json(), **self.identity(out), "host_pinned": pinned, "warnings": said}

    def exception_mid_step(self) -> dict[str, Any]:
        before_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        allocated_before = allocated(self.device)
        target = self.model.transformer.blocks[len(self.model.transformer.blocks) // 2]

        def boom(module: nn.Module, args: Any) -> None:
            raise RuntimeError("injected failure mid-step")

        session = torchferry.offload(self.model, strategy="layerwise", prefetch_depth=2, device=self.device)
        handle = target.register_forward_pre_hook(boom)
        raised = False
        try:
            with torch.no_grad():
                self.fn()()
        except RuntimeError:
            raised = True
        finally:
            handle.remove()
            session.close()  # (whatever was raised: the rows after use the model)
        after = self.model.state_dict()
        same = all(torch.equal(before_weights[k], after[k]) for k in before_weights)
        allocated_after = allocated(self.device)
        back = allocated_before is None or allocated_after == allocated_before
        if not (raised and same and back):
            raise AssertionError(
                f"raised {raised}, weights identical {same}, "
                f"allocated {allocated_before} -> {allocated_after}"
            )
        return {
            "raised": raised,
            "weights_identical": same,
            "allocated_before": allocated_before,
            "allocated_after": allocated_after,
        }

    def diffusers_offload(self, record_stream: bool) -> dict[str, Any]:
        self.needs_cuda()
        try:
            hooks = importlib.import_module("diffusers.hooks")
        except ImportError as exc:
            raise Skip(f"{exc}; bring diffusers with {BRING_DIFFUSERS}") from None
        torch.manual_seed(0)
        model = DiT(self.size, device=torch.device("cpu"), dtype=self.dtype).eval()
        model.load_state_dict(self.model.transformer.state_dict())
        before = allocated(self.device)
        hooks.apply_group_offloading(
            model,
            onload_device=self.device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=True,
            record_stream=record_stream,
        )

        def run() -> torch.Tensor:
            out: torch.Tensor = model(*self.inputs)
            return out

        with torch.no_grad():
            stats, out = time_steps(run, self.size, self.device)
            memory = peak_of_step(run, self.device)
        measured = None
        if memory is not None and before is not None and self.activation is not None:
            measured = memory[1] - before - self.activation
        return {
            **stats.to_json(),
            **self.identity(out),
            "overhead": stats.median / self.resident_s - 1 if self.resident_s else None,
            "measured_peak_bytes": measured,
        }


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bits read as integers (exact: a checksum of its bytes), on ``t``'s device and
    stream, so a read of other bytes than its own shows."""
    flat = t.detach().reshape(-1)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[flat.element_size()]
    return flat.view(ints).sum(dtype=torch.int64)


def _reader(index: int, read: list[tuple[int, list[torch.Tensor]]]) -> Callable[..., None]:
    """A forward pre hook recording block ``index``'s weight checksums (`_bits`) as its forward reads them."""

    def hook(module: nn.Module, args: Any) -> None:
        read.append((index, [_bits(p) for p in module.parameters()]))

    return hook


@contextlib.contextmanager
def delayed(streams: Any) -> Iterator[None]:
    """``torch.cuda._sleep`` on the copy stream before each copy and on compute before each evict's
    release: a missing wait between them would now let a copy overwrite bytes a block still reads."""
    copy_in, release = streams.copy_in, streams.release

    def slow_copy(dst: Any, dst_bytes: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(streams.copy):
            torch.cuda._sleep(SLEEP_CYCLES)
        copy_in(dst, dst_bytes, src)

    def slow_release(transfer: Any) -> None:
        with torch.cuda.stream(streams.compute):
            torch.cuda._sleep(SLEEP_CYCLES)
        release(transfer)

    streams.copy_in, streams.release = slow_copy, slow_release
    try:
        yield
    finally:
        del streams.copy_in, streams.release


def _version(name: str) -> str | None:
    try:
        return str(importlib.import_module(name).__version__)
    except ImportError:
        return None


def _brief(entry: dict[str, Any]) -> str:
    if entry["status"] == "skipped":
        return f"({entry['why']})"
    if entry["status"] == "FAILED":
        return entry["error"]
    parts = []
    if "median_s" in entry:
        parts.append(f"{entry['median_s'] * 1e3:.2f} ms/step")
    if entry.get("overhead") is not None:
        parts.append(f"{entry['overhead'] * 100:+.1f}%")
    if "identical" in entry:
        parts.append("identical" if entry["identical"] else f"DIFFERS (max {entry['max_abs_diff']:.3g})")
    return ", ".join(parts)


#: Figures shown in the table's note column for rows that are not timed variants: key -> format.
_FIGURES: dict[str, Callable[[Any], str]] = {
    "pinned_over_store": lambda v: f"pinned/store {v:.4f}",
    "open_s": lambda v: f"open {v:.2f} s",
    "rss_after_close": lambda v: f"RSS after close {v / (1 << 30):.2f} GiB",
    "pinned_bytes_after_close": lambda v: f"pinned after close {v} B",
    "step_over_blocks_x_transfer": lambda v: f"step/(blocks x transfer) {v:.2f}",
    "copy_busy_fraction": lambda v: f"copy busy {v:.0%}",
    "enqueue_per_block_s": lambda v: f"enqueue {v * 1e6:.0f} us/block",
    "gpu_s_per_step": lambda v: f"GPU {v * 1e3:.2f} ms/step",
    "d1_identical": lambda v: f"d1 identical {v}",
    "d2_identical": lambda v: f"d2 identical {v}",
    "d1_block_reads_exact": lambda v: f"d1 block reads exact {v}",
    "d2_block_reads_exact": lambda v: f"d2 block reads exact {v}",
    "probe_fired": lambda v: f"probe fired {v}",
    "block_params_in_a_slot": lambda v: f"params in a slot {v}",
    "blocks_docked": lambda v: f"blocks docked {v}",
    "blocks_repointed": lambda v: f"re-pointed {v}",
    "weights_identical": lambda v: f"weights identical {v}",
    "dock_verdict": str,
    "gpu": str,
    "pcie.link.gen.current": lambda v: f"PCIe gen {v}",
    "pcie.link.width.current": lambda v: f"x{v}",
}


def _figures(entry: dict[str, Any]) -> str | None:
    shown = [fmt(entry[key]) for key, fmt in _FIGURES.items() if entry.get(key) is not None]
    return ", ".join(shown) or None


def _mib(x: float | None) -> str | None:
    return None if x is None else f"{x / (1 << 20):.1f}"


def _gbs(x: float | None) -> str | None:
    return None if x is None or not math.isfinite(x) else f"{x / 1e9:.1f}"


def summary(check: Check) -> str:
    """The one table: every row with its status and the figures that say whether it is right and fast."""
    lines = []
    for name, e in check.rows.items():
        ok = e["status"] == "ok"
        lines.append(
            [
                name,
                e["status"],
                f"{e['median_s'] * 1e3:.2f}" if ok and "median_s" in e else None,
                f"{e['overhead'] * 100:+.1f}%" if ok and e.get("overhead") is not None else None,
                ("yes" if e["identical"] else "NO") if ok and "identical" in e else None,
                f"{e['stall_s'] * 1e3:.2f}" if ok and "stall_s" in e else None,
                _gbs(e.get("achieved_h2d_bytes_per_s")) if ok else None,
                _mib(e.get("measured_peak_bytes")) if ok else None,
                _mib(e.get("predicted_peak_bytes")) if ok else None,
                _mib(e.get("ledger_peak_bytes")) if ok else None,
                f"{e['enqueue_per_block_s'] * 1e6:.1f}" if ok and "enqueue_per_block_s" in e else None,
                _brief(e) if not ok else (e.get("verdict") or _figures(e)),
            ]
        )
    headers = [
        "row",
        "status",
        "ms/step",
        "vs resident",
        "same",
        "stall ms",
        "H2D GB/s",
        "peak MiB",
        "predicted",
        "ledger",
        "enqueue us/block",
        "note",
    ]
    return common.table(headers, lines)


def quantized_row(check: Check) -> dict[str, Any]:
    """``quant.py``'s comparison on this GPU (issue 23): one transfer-bound layerwise schedule (depth 1)
    over the same bf16 Wan transformer at full width, float8 storage, torchao int8 and float8, quanto
    qint8: bytes moved per step, host bytes, step min/median/max, and each form bit-identical to itself
    run resident. A form whose package or kernels are missing is skipped with why."""
    check.needs_cuda()
    for package in ("diffusers", "torchao", "optimum.quanto"):
        if importlib.util.find_spec(package.split(".")[0]) is None:
            raise Skip(f"{package} is not installed; pip install 'torchferry[diffusers,quant]'")
    quant: Any = importlib.import_module("quant")
    result: dict[str, Any] = quant.compare(check.device, quick=check.quick)
    say(quant.report(result))
    forms = result["forms"]
    wrong = [name for name, f in forms.items() if "skipped" not in f and not f["identical"]]
    if wrong:
        raise AssertionError(f"not bit-identical to the resident run: {', '.join(wrong)}")
    full = forms.get("full", {})
    for f in forms.values():
        if "step" in f and "step" in full:
            f["step_over_full"] = f["step"]["median_s"] / full["step"]["median_s"]
    return result


def uva_dock_row(check: Check) -> dict[str, Any]:
    """Could a CUDA session dock its packs as a CPU session does (issue 40)? `uva_dock.py`'s experiment,
    in a child process on CUDA: a block's two moves re-pointed (CUDA's path now) and as one storage
    exchange each, with the block's tensors CUDA tensors over their pinned host buffers between uses
    (bare and in place, us per block), bit identity of both with resident, and reads of such a weight
    between forwards (a kernel, ``.cpu()``, a device copy) right or not, with their rates. It fails
    only when it could not measure, or a form is not bit-identical; what it finds decides the design."""
    uva: Any = importlib.import_module("uva_dock")
    out = check.out.parent / "uva_dock.json"
    result: dict[str, Any] = uva.isolated(check.device, quick=check.quick, out=out, timeout=check.budget(120))
    say(uva.report(result))
    if "bare_moves_per_block_us" not in result:
        raise AssertionError(result.get("failed", "uva_dock measured nothing"))
    wrong = [name for name, same in result["bit_identical"].items() if not same]
    wrong += [f"{name} (not read from its slot)" for name, there in result["in_slot"].items() if not there]
    if wrong:
        raise AssertionError(f"not bit-identical to the resident run, or not moved: {', '.join(wrong)}")
    moves = result["in_place_per_block_us"]
    reads = result.get("weights_between_forwards", {}).get("read", {})
    right = reads and all(ok is True for ok in reads.values())
    result["dock_verdict"] = (
        f"moves in place re-pointed {moves['re-pointed']:.1f} us/block, docked {moves['docked']:.1f}; "
        f"reads between forwards {'right' if right else 'NOT ALL RIGHT: ' + str(reads)}"
        + (f"; then the child FAILED: {result['failed']}" if "failed" in result else "")
    )  # (a read that fails is an answer, not a failed row: the figures stay in the row)
    return result


def gguf_row(check: Check) -> dict[str, Any]:
    """A GGUF model on this GPU (issue 33): ``quant.py``'s bf16 Wan transformer written as GGUF Q8_0 and
    Q4_K files, opened with ``torchferry.from_single_file`` under a host budget of 80% of the file
    (layerwise depth 1): bytes moved per step, host bytes, the file tier's reads per step, step
    min/median/max, and each bit-identical to diffusers' GGUF load of the same file run resident."""
    check.needs_cuda()
    for package in ("diffusers", "gguf"):
        if importlib.util.find_spec(package) is None:
            raise Skip(f"{package} is not installed; pip install 'torchferry[diffusers,gguf]'")
    quant: Any = importlib.import_module("quant")
    forms_of: Any = importlib.import_module("_gguf_forms")
    size = dict(quant.QUICK_SIZE if check.quick else quant.GPU_SIZE)
    x = quant.inputs(check.device, torch.bfloat16)
    forms: dict[str, Any] = {}
    calls: dict[str, Callable[[], object]] = {}
    with contextlib.ExitStack() as stack:
        forms_of.add(
            forms, calls, stack, model=lambda: quant.build(size, torch.float32), dtype=torch.bfloat16,
            device=check.device, forward=lambda m: quant._forward(m, x, check.device), counted=quant._counted,
        )  # fmt: skip
        if calls:
            for name, stats in common.round_robin(calls, 2 if check.quick else 10, warmup=1).items():
                forms[name]["step"] = stats.to_json()
    wrong = [name for name, f in forms.items() if "skipped" not in f and not f["identical"]]
    if wrong:
        raise AssertionError(f"not bit-identical to diffusers' GGUF load run resident: {', '.join(wrong)}")
    return {"size": size, "forms": forms}


def vllm_omni_row(check: Check) -> dict[str, Any]:
    """torchferry inside vLLM-Omni on this GPU (issue 37): tests/engines/ with the worker's device CUDA,
    the same tests tools/vllm_omni_env.sh runs on a CPU (the diffusers backend on Wan 2.2 and FLUX,
    a native pipeline, refusals, regional compile) plus one generation through a whole ``Omni(...)``
    engine with torchferry selected, each bit-identical to the engine with no offload."""
    check.needs_cuda()
    if importlib.util.find_spec("vllm_omni") is None:
        raise Skip(
            "vLLM-Omni is not installed: install vllm-omni 0.30.0 and its vllm, then pip install "
            "'torchferry[vllm-omni]' (docs/engines.md); on a CPU, tools/vllm_omni_env.sh runs the same tests"
        )
    env = {**os.environ, "TORCHFERRY_ENGINE_TESTS": "1", "TORCHFERRY_ENGINE_DEVICE": str(check.device)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::FutureWarning",
         "-W", "ignore::DeprecationWarning", "-W", "ignore::UserWarning", "tests/engines"],
        check=False, cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=check.budget(240),
    )  # fmt: skip
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode != 0:
        raise AssertionError(f"tests/engines on {check.device}: {last}\n{done.stdout[-4000:]}")
    return {"tests": last}


def _offsets(engine: Any, src: torch.Tensor) -> list[int]:
    """The byte offsets of the tensors of the pack whose host buffer is ``src`` (none if no pack's is)."""
    for pack in engine.store.packs.values():
        if pack.host.data_ptr() == src.data_ptr() and pack.host.numel() == src.numel():
            return [piece.offset for piece in pack.pieces if piece.nbytes]
    return []


def every_tensor_written(engine: Any) -> Any:
    """``engine``'s CUDA stream context, each of whose copies also writes the first byte of every tensor
    it fills again (the same byte, from the host copy, on the copy stream) before its ``ready`` event.

    torch's CUDA sanitizer keys each access on a tensor's start address, and a slot is filled by one
    flat copy: without these writes it would check a copy against the reads of each block's first
    tensor only. With them, every tensor's reads by the block's kernels meet the copy that filled it.
    """
    streams = CudaStreams(engine.device)
    copy_in = streams.copy_in

    def touching(dst: Any, dst_bytes: torch.Tensor, src: torch.Tensor) -> None:
        offsets = _offsets(engine, src)
        ready = dst.ready
        record = ready.record

        def after_touches(stream: Any = None) -> None:
            with torch.cuda.stream(streams.copy):
                for at in offsets:
                    dst_bytes.narrow(0, at, 1).copy_(src.narrow(0, at, 1), non_blocking=True)
            TOUCHED[0] += len(offsets)
            record(stream)

        ready.record = after_touches
        try:
            copy_in(dst, dst_bytes, src)
        finally:
            del ready.record

    streams.copy_in = touching  # type: ignore[method-assign]
    return streams


#: Tensor starts the sanitizer child's copies wrote again (see `every_tensor_written`).
TOUCHED = [0]


def sanitizer_child(out: Path) -> int:
    """One small layerwise pass (depth 1 and 2) checked against resident; run under TORCH_CUDA_SANITIZER=1.

    Every copy also writes each tensor's first byte again before its ``ready`` event
    (`every_tensor_written`), so the sanitizer checks the order of every copy against the reads of
    every tensor it fills, and of every evict against the next copy into its slot.
    """
    size = GPU_QUICK
    torch.manual_seed(0)
    model = Pipe(
        DiT(replace(size, blocks=4, tokens=256), device=torch.device("cpu"), dtype=torch.bfloat16)
    ).eval()
    x = torch.randn(1, 256, size.hidden, device="cuda", dtype=torch.bfloat16)
    temb = torch.randn(1, size.hidden, device="cuda", dtype=torch.bfloat16)
    before = stream_factory(every_tensor_written)
    try:
        with torch.no_grad():
            model.to("cuda")
            reference = model(x, temb).cpu()
            model.to("cpu")
            for depth in (1, 2):
                with torchferry.offload(model, strategy="layerwise", prefetch_depth=depth, device="cuda"):
                    for _ in range(3):
                        if not torch.equal(model(x, temb).cpu(), reference):
                            say(f"sanitizer child: depth {depth} output differs")
                            return 1
    finally:
        stream_factory(before)
    torch.cuda.synchronize()
    if TOUCHED[0] == 0:
        say("sanitizer child: no copy wrote any tensor start again: the check covered first tensors only")
        return 1
    say(f"sanitizer child: no race reported over {TOUCHED[0]} tensor starts, outputs identical")
    return 0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is present")
    parser.add_argument("--tokens", type=int, help="override the sequence length")
    parser.add_argument("--blocks", type=int, help="override the number of blocks")
    parser.add_argument("--only", help="comma-separated row names to run (resident always runs)")
    parser.add_argument(
        "--deadline", type=float, default=DEADLINE_S, help="seconds the whole run may take (default 420)"
    )
    parser.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sanitizer_child:
        sys.exit(sanitizer_child(args.out))
    check = Check(args)
    if not check.cuda:
        common.pin_threads(1)  # tiny CPU sizes: one thread, so machine load does not swamp the figures
        check.notes.append(
            "no CUDA device (or --cpu): skipped the CUDA-only rows (bandwidth, host syncs, the sanitizer, "
            "the demo and WanPipeline on cuda, diffusers with streams); ran the same logic on a tiny model "
            "on the CPU (copies there are synchronous host copies, so ordering stress runs without sleeps)"
        )
        say(f"gpu_check: {check.notes[-1]}")
    else:
        say(f"gpu_check on {torch.cuda.get_device_name(check.device)}, torch {torch.__version__}")
    s = check.size
    say(
        f"model: {s.blocks} blocks of {common.fmt_bytes(check.block_bytes)} "
        f"({common.fmt_bytes(check.weight_bytes)} in all), hidden {s.hidden}, "
        f"{s.batch} x {s.tokens} tokens, bf16"
    )
    check.row("environment", check.environment)
    check.row("bandwidth", check.measure_bandwidth)
    only, check.only = check.only, None
    check.row("resident", check.resident)
    check.only = only
    if check.reference is None:
        say("the resident run failed, so nothing can be compared; see the JSON")
        return {"rows": check.rows}
    check.row("cuda path", check.cuda_path)
    # Correctness on CUDA first (a first run may not reach the end: each session opens gigabytes),
    # then host time, then the other paths and the comparisons.
    for name, options in VARIANTS.items():
        check.row(name, functools.partial(check.variant, name, options))
    check.row("ordering stress", check.ordering_stress)
    check.row("cuda sanitizer", check.sanitizer)
    check.row("exception mid-step", check.exception_mid_step)
    check.row("file tier", functools.partial(importlib.import_module("host_tier").gpu_row, check))
    check.row("pageable", check.pageable)
    check.row("inference mode", check.inference_mode)
    check.row("host syncs", check.host_syncs)
    check.row("host per block", check.host_per_block)
    check.row("uva dock", functools.partial(uva_dock_row, check))
    check.row("open close", check.open_close)
    check.row("demo", check.demo)
    check.row("wan pipeline", check.wan_pipeline)
    check.row("auto", check.auto_choice)
    check.row("transfer bound", check.transfer_bound)
    check.row("quantized", functools.partial(quantized_row, check))
    check.row("gguf", functools.partial(gguf_row, check))
    check.row("vllm-omni", functools.partial(vllm_omni_row, check))
    for flag in (False, True):
        check.row(f"diffusers record_stream {flag}", functools.partial(check.diffusers_offload, flag))
    say("")
    say(summary(check))
    say(
        "peak MiB: max_memory_allocated over a steady step - bytes allocated before the offloader opened "
        "(inputs) - the resident run's activation peak; predicted: policies.simulate on the same schedule; "
        "ledger: the runtime's own count; stall ms: compute waiting on transfers in one traced steady step"
    )
    for line in check.notes:
        say(line)
    check.write()
    say(f"wrote {check.out} in {time.perf_counter() - check.started:.0f} s")
    return {"rows": check.rows}


if __name__ == "__main__":
    main()
