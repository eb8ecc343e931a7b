"""Helpers the benchmarks share: timing statistics, tables, JSON results and the machine they ran on.

Importing this module also puts the repository root on ``sys.path``, so every benchmark runs from a
bare checkout (``python benchmarks/<name>.py``) where torchferry is not installed, as on a lent GPU
machine. Torch is imported lazily, so a parent process that must stay light (``load.py``) can use the
helpers too.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = [
    "CLOCKS",
    "HERE",
    "RESULTS",
    "ROOT",
    "Stats",
    "fmt_bytes",
    "fmt_load",
    "fmt_seconds",
    "load_average",
    "loglog_slope",
    "machine",
    "per_call",
    "pin_threads",
    "round_robin",
    "table",
    "write_json",
]


@dataclass(frozen=True)
class Stats:
    """Median, minimum and maximum of repeated timings, in seconds, and how many there were."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        if not samples:
            raise ValueError("Stats.of needs at least one sample")
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def scaled(self, factor: float) -> Stats:
        """These statistics with every time multiplied by ``factor`` (per block, per byte...)."""
        return Stats(self.median * factor, self.min * factor, self.max * factor, self.n)

    def to_json(self) -> dict[str, float]:
        return {"median_s": self.median, "min_s": self.min, "max_s": self.max, "n": self.n}


def pin_threads(threads: int) -> int:
    """Fix torch's intra-op (and, when still possible, inter-op) thread count; returns it."""
    import torch

    torch.set_num_threads(threads)
    # Inter-op threads can only be set before the first parallel work; intra-op is what matters.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(threads)
    return torch.get_num_threads()


#: The clocks a benchmark may time with: wall time, or this thread's CPU time (which time spent
#: waiting for a core while other work runs on the machine does not inflate).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def round_robin(
    calls: Mapping[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 3,
    clock: str = "wall",
    samples: dict[str, list[float]] | None = None,
) -> dict[str, Stats]:
    """Time each call once per round, in turn, so machine noise falls on all of them alike; each
    call's timings, round by round, go into ``samples`` when given (for differences per round)."""
    now = CLOCKS[clock]
    if samples is None:
        samples = {}
    samples.update({name: [] for name in calls})
    for round_ in range(warmup + repeats):
        for name, call in calls.items():
            start = now()
            call()
            elapsed = now() - start
            if round_ >= warmup:
                samples[name].append(elapsed)
    return {name: Stats.of(s) for name, s in samples.items()}


def per_call(fn: Callable[[], object], *, seconds: float = 0.2, rounds: int = 5) -> Stats:
    """Seconds per call of a fast ``fn``: batches sized to ``seconds / rounds`` each, ``rounds`` of them."""
    fn()
    n = 1
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed > seconds / (rounds * 4) or n >= 1 << 20:
            break
        n *= 2
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n)
    return Stats.of(samples)


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x``: 1 is linear growth, 0 constant."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"loglog_slope needs two or more (x, y) pairs, got {len(xs)} x and {len(ys)} y")
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-12)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den


def fmt_seconds(seconds: float) -> str:
    """``12.3 us``, ``4.56 ms`` or ``1.23 s``."""
    if not math.isfinite(seconds):
        return str(seconds)
    a = abs(seconds)
    if a < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if a < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(nbytes: float) -> str:
    """``512 B``, ``1.5 MiB``, ``2.00 GiB``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return (
            f"{value:.3g}"
            if abs(value) < 0.01 or abs(value) >= 1e5
            else f"{value:.3f}".rstrip("0").rstrip(".")
        )
    return str(value)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> tuple[float, float, float] | None:
    """The machine's 1, 5 and 15 minute load averages (``None`` where the OS does not say)."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def fmt_load(load: tuple[float, float, float] | None) -> str:
    """``load average 1.2, 0.8, 0.5 (2 cores)``, or that it is unknown."""
    if load is None:
        return "load average unknown"
    return f"load average {load[0]}, {load[1]}, {load[2]} ({os.cpu_count()} cores)"


def machine() -> dict[str, Any]:
    """Where and when a benchmark ran: date, CPU, cores, Python, torch, threads and CUDA device."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": load_average(),
    }
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def write_json(path: str | Path, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` plus the machine description to ``path`` (folders made as needed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"machine": machine(), **payload}
    out.write_text(json.dumps(body, indent=2, default=_json_default) + "\n")
    return out


def _json_default(value: object) -> object:
    if isinstance(value, Stats):
        return value.to_json()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)  # type: ignore[call-overload]
    return str(value)
