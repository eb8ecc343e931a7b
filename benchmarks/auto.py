"""Does ``offload(pipe, device_memory=B)`` pick the fastest schedule that fits B? (CPU, one run)

For device budgets from just above the smallest ring (depth 1, nothing resident) to one that holds
everything, this opens ``torchferry.offload(pipe, device="cpu", device_memory=B)`` (strategy auto) and,
over the same budget, every hand-picked ``(strategy, prefetch depth, leading resident count)`` that
fits: ``none`` when everything fits, and layerwise for each depth 1..``--max-depth`` and each count of
leading resident blocks. Every configuration has its own copy of the toy pipeline and its own
session, all open at once, and the calls run round-robin (one call of each per round), so machine
noise falls on all alike. A step is one DiT forward, timed around the session's hooks; the first
forward of each call (which stages what the text encoder left) is not counted.

Verdicts use the minimum over repeats (min-based), so a noisy machine does not flip them: auto within
5% of the best hand-picked configuration at every budget, and auto's own predicted step (its
calibrated cost model, `Session.report`) within 10% of its measured minimum. The spread (max/min) is
printed beside each figure; a row whose spread exceeds 25% is marked noisy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _common import RESULTS, Stats, fmt_bytes, pin_threads, table, write_json

import torchferry
from torchferry import topology
from torchferry.policies._auto import footprint
from torchferry.testing import toy

#: The toy: as the demo's, with streaming worth choosing about on two CPU cores.
TOY = {"hidden": 256, "blocks": 12, "encoder_blocks": 2}
QUICK_TOY = {"hidden": 64, "blocks": 6, "encoder_blocks": 2}
COMPONENTS = frozenset({"dit"})
#: Within this of the best hand-picked configuration (min-based) counts as "picked the best".
WITHIN_BEST = 0.05
#: Auto's predicted step within this of its measured one.
WITHIN_PREDICTED = 0.10
#: A median more than this above the min marks a figure as noisy: its verdict is not judged.
NOISY = 0.25


def _timer(dit: torch.nn.Module, into: list[float]) -> Callable[[], None]:
    """Record every forward of ``dit`` (outside the session's hooks) into ``into``; returns a remover."""
    started: list[float] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        started.append(time.perf_counter())

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        into.append(time.perf_counter() - started.pop())

    handles = [dit.register_forward_pre_hook(pre, prepend=True), dit.register_forward_hook(post)]

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove


class Config:
    """One configuration: its own pipeline copy, its open session, its step times."""

    def __init__(self, name: str, shape: dict[str, int], steps: int, **options: Any) -> None:
        self.name = name
        self.steps = steps
        self.pipeline = toy.build(0, **shape)
        self.session = torchferry.offload(self.pipeline, device="cpu", components=COMPONENTS, **options)
        self.times: list[float] = []
        self._remove = _timer(self.pipeline.transformer, self.times)
        self.samples: list[float] = []

    def call(self, record: bool) -> None:
        self.times.clear()
        with torch.no_grad():
            self.pipeline("a lighthouse at dusk", steps=self.steps, seed=0)
        if record:
            self.samples.extend(self.times[1:])

    def close(self) -> None:
        self._remove()
        self.session.close()


def candidates(plan: topology.Plan, budget: int, max_depth: int) -> list[tuple[str, dict[str, Any]]]:
    """Every hand-picked configuration that fits ``budget``: none, and layerwise(depth, leading r)."""
    out: list[tuple[str, dict[str, Any]]] = []
    total = sum(c.nbytes for c in plan.components)
    if total <= budget:
        out.append(("none", {"strategy": "none"}))
    blocks = [b.path for b in plan.component("transformer").blocks]
    for depth in range(1, max_depth + 1):
        for r in range(len(blocks) + 1):
            if r > len(blocks) - 2:
                break  # resolve keeps at least two blocks streaming
            if footprint(plan, depth, blocks[:r]) > budget:
                break
            options: dict[str, Any] = {"strategy": "layerwise", "prefetch_depth": depth}
            if r:
                options["resident_layers"] = r
            out.append((f"layerwise(d={depth}, r={r})", options))
    return out


def budgets(plan: topology.Plan, quick: bool) -> list[tuple[str, int]]:
    """From just above the smallest ring to everything on the device."""
    blocks = plan.component("transformer").blocks
    block = max(b.nbytes for b in blocks)
    smallest = footprint(plan, 1)
    total = sum(c.nbytes for c in plan.components)
    n = len(blocks)
    steps = [0.5, n // 2 + 0.5] if quick else [0.5, 2.5, n // 2 + 0.5, n - 2.5]
    out = [(f"ring + {k:g} blocks", int(smallest + k * block)) for k in steps]
    out.append(("everything fits", total + block))
    return out


def run(quick: bool, rounds: int, warmup: int, max_depth: int) -> dict[str, Any]:
    shape = QUICK_TOY if quick else TOY
    steps = 3 if quick else 5
    probe = toy.build(0, **shape)
    plan = topology.resolve(topology.discover(probe), topology.OffloadConfig(components=COMPONENTS))
    rows: list[dict[str, Any]] = []
    for label, budget in budgets(plan, quick):
        configs = [Config("auto", shape, steps, device_memory=budget)]
        for name, options in candidates(plan, budget, max_depth):
            configs.append(Config(name, shape, steps, device_memory=budget, **options))
        try:
            for round_ in range(warmup + rounds):
                for c in configs:
                    c.call(record=round_ >= warmup)
            auto = configs[0]
            report = auto.session.report()
            stats = {c.name: Stats.of(c.samples) for c in configs}
        finally:
            for c in configs:
                c.close()
        hand = {k: v for k, v in stats.items() if k != "auto"}
        best = min(hand, key=lambda k: hand[k].min)
        a = stats["auto"]
        predicted = report.predicted_step_s.get("transformer", 0.0)
        rows.append(
            {
                "budget": label,
                "budget_bytes": budget,
                "auto_policy": report.policy,
                "auto": a,
                "predicted_s": predicted,
                "prediction_error": predicted / a.min - 1,
                "best": best,
                "best_stats": hand[best],
                "auto_vs_best": a.min / hand[best].min - 1,
                "candidates": len(hand),
                "switches": list(report.switches),
                "spread": max(a.median / a.min - 1, hand[best].median / hand[best].min - 1),
                "noisy": max(a.median / a.min - 1, hand[best].median / hand[best].min - 1) > NOISY,
            }
        )
        print(f"  {label}: {len(hand)} hand-picked, auto {report.policy}", file=sys.stderr, flush=True)
    return {"toy": shape, "steps_per_call": steps, "rounds": rounds, "rows": rows}


def _spread(s: Stats) -> str:
    return f"{s.min * 1e3:.2f}/{s.median * 1e3:.2f}/{s.max * 1e3:.2f}"


def render(result: dict[str, Any]) -> str:
    body: list[Sequence[object]] = []
    for r in result["rows"]:
        body.append(
            [
                f"{r['budget']} ({fmt_bytes(r['budget_bytes'])})",
                r["auto_policy"],
                _spread(r["auto"]),
                f"{r['predicted_s'] * 1e3:.2f}",
                f"{r['prediction_error'] * 100:+.1f}%",
                f"{r['best']} of {r['candidates']}",
                _spread(r["best_stats"]),
                f"{r['auto_vs_best'] * 100:+.1f}%" + (" (noisy)" if r["noisy"] else ""),
            ]
        )
    head = [
        "budget",
        "auto chose",
        "auto ms min/med/max",
        "predicted ms",
        "pred vs min",
        "best hand-picked",
        "best ms min/med/max",
        "auto vs best (min)",
    ]
    return table(head, body)


def verdict(result: dict[str, Any]) -> list[str]:
    """What fails its target, among rows whose spread lets them be judged."""
    problems = []
    for r in result["rows"]:
        if r["noisy"]:
            continue
        if r["auto_vs_best"] > WITHIN_BEST:
            problems.append(
                f"{r['budget']}: auto {r['auto_vs_best'] * 100:+.1f}% over the best ({r['best']})"
            )
        if abs(r["prediction_error"]) > WITHIN_PREDICTED:
            problems.append(f"{r['budget']}: prediction off by {r['prediction_error'] * 100:+.1f}%")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller toy, two budgets, depth 1 (for CI)")
    parser.add_argument("--rounds", type=int, default=None, help="timed calls per configuration")
    parser.add_argument("--max-depth", type=int, default=None, help="deepest hand-picked ring (default 2)")
    parser.add_argument("--out", default=None, help="where the JSON goes (default benchmarks/results)")
    args = parser.parse_args(argv)
    pin_threads(1)
    rounds = args.rounds or (2 if args.quick else 6)
    depth = args.max_depth or (1 if args.quick else 2)
    start = time.perf_counter()
    result = run(args.quick, rounds, warmup=3, max_depth=depth)
    result["seconds"] = time.perf_counter() - start
    result["load_average"] = os.getloadavg()
    print(render(result))
    problems = verdict(result)
    load = ", ".join(f"{x:.1f}" for x in result["load_average"])
    noisy = [r["budget"] for r in result["rows"] if r["noisy"]]
    print(f"\n{result['seconds']:.0f} s, load average {load}; verdicts from the min over {rounds} calls")
    if noisy:
        print(
            f"not judged, the median more than {NOISY:.0%} above the min (the machine was busy): "
            + ", ".join(noisy)
        )
    judged = len(result["rows"]) - len(noisy)
    verdict_text = "yes" if not problems else "NO"
    print(f"auto within 5% of the best, prediction within 10% ({judged} rows judged): {verdict_text}")
    for p in problems:
        print(f"  {p}")
    out = write_json(
        os.path.join(args.out or str(RESULTS), "auto.json"),
        {**result, "problems": problems, "not_judged": noisy},
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
