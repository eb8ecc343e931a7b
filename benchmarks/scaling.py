"""How torchferry's costs grow with the number of blocks and the size of a block, on CPU.

A synthetic DiT of N blocks, each of 8 float32 tensors totalling S bytes, for N in (10, 40, 160) and
S in (1, 16, 128) MiB. For every (N, S) the plan comes from the model built on the meta device, and
these are timed: building a steady-step layerwise schedule (a fresh policy each call), `check` on it
and `simulate` on it. Where the model fits under ``--max-bytes`` it is also built for real and these
are timed: opening and closing an offload session (the host store: one flat buffer per block, filled
and given back), and one runtime pass (a forward that streams every block through the slots; the
blocks compute almost nothing, so the pass is the runtime's own cost plus the copies).

The growth exponent is the least-squares slope of log(time) against log(N) at the smallest S, and
against log(S) at the smallest N, over all points and over the two largest: 1 is linear, below 1
better than linear. The target (<= 1.1, a little noise allowed) applies to the two largest, since the
smallest sizes fit in the CPU caches and run faster per byte than any size that does not. Every time
is the minimum of its repeats, the figure least disturbed by other work on the machine. Prints the
timings and the slopes and writes
``benchmarks/results/scaling.json``. ``--quick`` uses N in (4, 8, 16) and S in (64, 256, 1024) KiB.

    python benchmarks/scaling.py [--max-bytes 3e9] [--seconds 0.2] [--quick]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import _common as common  # first: puts the repository root on sys.path
import torch
from torch import nn

import torchferry
from torchferry import policies, topology
from torchferry.policies import Step
from torchferry.topology import OffloadConfig, Plan

TENSORS_PER_BLOCK = 8
SLOPE_TARGET = 1.1
MIB = 1 << 20


class ScaleBlock(nn.Module):
    """A block of ``TENSORS_PER_BLOCK`` float32 tensors totalling ``nbytes``, reading one value of each."""

    def __init__(self, nbytes: int, device: str) -> None:
        super().__init__()
        n = nbytes // (4 * TENSORS_PER_BLOCK)
        for i in range(TENSORS_PER_BLOCK):
            w = torch.empty(n, device=device)
            if device != "meta":
                w.fill_(0.5 + i)
            self.register_parameter(f"w{i}", nn.Parameter(w, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(TENSORS_PER_BLOCK):
            x = x + getattr(self, f"w{i}")[:1]
        return x


class ScaleDiT(nn.Module):
    """``blocks`` blocks of ``nbytes`` each and a small remainder, discovered as one DiT ring."""

    _layerwise_offload_blocks_attrs: ClassVar[tuple[str, ...]] = ("blocks",)

    def __init__(self, blocks: int, nbytes: int, device: str = "cpu") -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4, device=device), requires_grad=False)
        self.blocks = nn.ModuleList(ScaleBlock(nbytes, device) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.bias
        for block in self.blocks:
            x = block(x)
        return x


def layerwise_plan(model: nn.Module) -> Plan:
    return topology.resolve(topology.discover(model), OffloadConfig(strategy="layerwise"))


def steady_step(plan: Plan) -> Step:
    first = policies.layerwise(1)(plan, Step(component=""))
    return Step(component="", index=1, entry=first.exit)


def timed(fn: Callable[[], object], repeats: int) -> common.Stats:
    """Statistics of ``repeats`` single calls (for calls too slow to batch)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return common.Stats.of(samples)


def plan_costs(blocks: int, nbytes: int, seconds: float) -> dict[str, common.Stats]:
    plan = layerwise_plan(ScaleDiT(blocks, nbytes, device="meta"))
    step = steady_step(plan)
    schedule = policies.layerwise(1)(plan, step)
    return {
        "schedule": common.per_call(lambda: policies.layerwise(1)(plan, step), seconds=seconds),
        "check": common.per_call(lambda: policies.check(schedule, plan), seconds=seconds),
        "simulate": common.per_call(lambda: policies.simulate(schedule), seconds=seconds),
    }


def runtime_costs(blocks: int, nbytes: int, repeats: int) -> dict[str, common.Stats]:
    model = ScaleDiT(blocks, nbytes)
    x = torch.zeros(4)
    open_close = timed(lambda: torchferry.offload(model, strategy="layerwise", device="cpu").close(), repeats)
    with torch.no_grad(), torchferry.offload(model, strategy="layerwise", device="cpu"):
        expected = model(x)
        model(x)
        runtime = timed(lambda: model(x), repeats)
        assert torch.equal(model(x), expected)
    return {"session open+close": open_close, "runtime pass": runtime}


COSTS = ("schedule", "check", "simulate", "session open+close", "runtime pass")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--max-bytes", type=float, default=3e9, help="largest model built for real")
    parser.add_argument("--seconds", type=float, default=0.2, help="timing budget per fast measurement")
    parser.add_argument("--repeats", type=int, default=5, help="single calls per slow measurement")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--out", type=Path, default=common.RESULTS / "scaling.json")
    args = parser.parse_args(argv)
    threads = common.pin_threads(args.threads)
    if args.quick:
        counts, sizes, seconds = (4, 8, 16), (64 << 10, 256 << 10, 1 << 20), 0.02
    else:
        counts, sizes, seconds = (10, 40, 160), (1 * MIB, 16 * MIB, 128 * MIB), args.seconds

    started = time.perf_counter()
    runtime_costs(counts[0], sizes[0], 1)  # warm-up: first-call costs stay out of the first cell
    grid: dict[tuple[int, int], dict[str, common.Stats]] = {}
    skipped: list[str] = []
    for n in counts:
        for s in sizes:
            cell = plan_costs(n, s, seconds)
            if n * s <= args.max_bytes:
                cell.update(runtime_costs(n, s, args.repeats))
            else:
                skipped.append(f"{n} x {common.fmt_bytes(s)}")
            grid[n, s] = cell
    elapsed = time.perf_counter() - started

    rows = []
    for (n, s), cell in grid.items():
        rows.append(
            [n, common.fmt_bytes(s), *(common.fmt_seconds(cell[c].min) if c in cell else None for c in COSTS)]
        )
    print(
        f"torchferry costs by blocks and block size (min over repeats), CPU, {threads} thread(s), "
        f"{elapsed:.0f} s in all, {common.fmt_load(common.load_average())}"
    )
    print(common.table(["blocks", "block", *COSTS], rows))
    if skipped:
        print(
            f"runtime costs skipped above --max-bytes {common.fmt_bytes(args.max_bytes)}: "
            + ", ".join(skipped)
        )

    def fit(points: list[tuple[int, common.Stats]]) -> float | None:
        if len(points) < 2:
            return None
        return common.loglog_slope([x for x, _ in points], [y.min for _, y in points])

    def noise(points: list[tuple[int, common.Stats]]) -> float | None:
        """How far the spread (max / min) of the two end cells can move their slope."""
        if len(points) < 2:
            return None
        (x0, a), (x1, b) = points[0], points[-1]
        return (math.log(a.max / a.min) + math.log(b.max / b.min)) / math.log(x1 / x0)

    slopes: dict[str, dict[str, float | None]] = {}
    for cost in COSTS:
        by_n = [(n, grid[n, sizes[0]][cost]) for n in counts if cost in grid[n, sizes[0]]]
        by_s = [(s, grid[counts[0], s][cost]) for s in sizes if cost in grid[counts[0], s]]
        slopes[cost] = {
            "blocks": fit(by_n),
            "blocks_top": fit(by_n[-2:]),
            "blocks_top_noise": noise(by_n[-2:]),
            "block_bytes": fit(by_s),
            "block_bytes_top": fit(by_s[-2:]),
            "block_bytes_top_noise": noise(by_s[-2:]),
        }

    def shown(slope: float | None) -> float | None:
        return None if slope is None else round(slope, 2) + 0.0

    def verdict(slope: float | None, spread: float | None) -> str:
        """yes: within the target on the min-based slope; noise: above it by less than the spread."""
        if slope is None:
            return "-"
        if slope <= SLOPE_TARGET:
            return "yes"
        return "noise" if spread is not None and slope - spread <= SLOPE_TARGET else "NO"

    print(
        f"fitted log-log slopes (1 = linear), over all points and over the two largest; the target, "
        f"linear or better, is <= {SLOPE_TARGET} over the two largest (small sizes fit in the CPU caches), "
        "judged on the min-based slope; 'noise': above it by less than the cells' spread (max / min) allows"
    )
    print(
        common.table(
            [
                "cost",
                f"vs blocks @ {common.fmt_bytes(sizes[0])}",
                "largest two",
                "ok",
                f"vs block size @ {counts[0]}",
                "largest two",
                "ok",
            ],
            [
                [
                    cost,
                    shown(v["blocks"]),
                    shown(v["blocks_top"]),
                    verdict(v["blocks_top"], v["blocks_top_noise"]),
                    shown(v["block_bytes"]),
                    shown(v["block_bytes_top"]),
                    verdict(v["block_bytes_top"], v["block_bytes_top_noise"]),
                ]
                for cost, v in slopes.items()
            ],
        )
    )
    ok = all(
        verdict(v[key], v[f"{key}_noise"]) != "NO"
        for v in slopes.values()
        for key in ("blocks_top", "block_bytes_top")
    )
    result = {
        "blocks": list(counts),
        "block_bytes": list(sizes),
        "tensors_per_block": TENSORS_PER_BLOCK,
        "threads": threads,
        "seconds": [
            {"blocks": n, "block_bytes": s, **{c: v.min for c, v in cell.items()}}
            for (n, s), cell in grid.items()
        ],
        "spread": [
            {"blocks": n, "block_bytes": s, **{c: v.to_json() for c, v in cell.items()}}
            for (n, s), cell in grid.items()
        ],
        "skipped_runtime": skipped,
        "slopes": slopes,
        "slope_target": SLOPE_TARGET,
        "linear_or_better": ok,
        "elapsed_s": elapsed,
    }
    out = common.write_json(args.out, result)
    print(f"all costs linear or better: {'yes' if ok else 'NO'}; wrote {out}")
    return result


if __name__ == "__main__":
    main()
