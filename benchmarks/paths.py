"""torchferry's cost on the paths users run, per streamed block: whole pipeline calls, timed and counted.

The toy pipeline (`torchferry.testing.toy`: a text encoder, a DiT, a decoder) called as a user calls
it, ``pipe("a cat", steps=...)``, under: no offloading (``resident``, the baseline), ``layerwise``
(every block streamed), ``layerwise`` with part of the blocks in the file tier (the checkpoint is
opened with ``host_memory=`` at 70% of what the host store would hold, so those blocks are read from
it at every use), and ``model_level`` (components staged whole). The variants run round-robin so
machine noise falls on all alike; each row gives min/median/max per call, the cost over resident
per streamed block (``model_level`` streams none: per component forward), from the least of each and
from medians, and the deterministic count of torchferry's work per block
(`torchferry.testing._calls.count_calls`), the figure tests/test_hot_path.py budgets. On a CPU device
every load is a real host copy, so the per-block cost includes the copy.

    python benchmarks/paths.py [--repeats 20] [--blocks 24] [--hidden 64] [--steps 4] [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import _common as common  # first: puts the repository root on sys.path
import torch

import torchferry
from torchferry import policies, topology
from torchferry.testing import toy


@contextmanager
def _file_tier(blocks: int, hidden: int, folder: Path) -> Iterator[toy.ToyPipeline]:
    ref = toy.build(0, blocks=blocks, hidden=hidden)
    path = folder / "toy.safetensors"
    toy.save_checkpoint(ref, path)
    plan = topology.resolve(topology.discover(ref), topology.OffloadConfig(strategy="layerwise"))
    budget = int(policies.tiers(plan).host_bytes * 0.7)
    pipe = toy.build_empty(blocks=blocks, hidden=hidden)
    options: dict[str, Any] = {"checkpoint": str(path), "host_memory": budget}
    with torchferry.offload(pipe, strategy="layerwise", device="cpu", **options):
        yield pipe


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds (after 3 warm-up rounds)")
    parser.add_argument("--blocks", type=int, default=24, help="the DiT's blocks")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per pipeline call")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (pinned)")
    parser.add_argument("--quick", action="store_true", help="8 blocks, 2 steps, 3 rounds: a smoke run")
    parser.add_argument("--out", type=Path, default=common.RESULTS / "paths.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.steps, args.repeats = 8, 2, 3
    from torchferry.testing._calls import count_calls

    threads = common.pin_threads(args.threads)
    encoder_blocks = 2
    streamed = args.blocks * args.steps + encoder_blocks
    forwards = args.steps + 2  # component forwards a call: the encoder, each DiT step, the decoder
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    per = {"resident": 1, "layerwise": streamed, "file tier": streamed, "model_level": forwards}
    counts: dict[str, dict[str, float]] = {}
    outputs: dict[str, torch.Tensor] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as folder:
        stack.enter_context(torch.no_grad())
        for name, blocks in per.items():
            if name == "file tier":
                pipe = stack.enter_context(_file_tier(args.blocks, args.hidden, Path(folder)))
            else:
                pipe = toy.build(0, blocks=args.blocks, hidden=args.hidden)
                if name != "resident":
                    stack.enter_context(torchferry.offload(pipe, strategy=name, device="cpu"))

            def call(pipe: toy.ToyPipeline = pipe) -> torch.Tensor:
                out: torch.Tensor = pipe("a cat", steps=args.steps)
                return out

            calls[name] = call
            for _ in range(3):
                outputs[name] = call()
            if name != "resident":
                c = count_calls(call)
                counts[name] = {
                    "calls_per_block": c.calls / blocks,
                    "c_calls_per_block": c.c_calls / blocks,
                    "instructions_per_block": c.instructions / blocks,
                    "tensor_ops_per_block": c.tensor_ops / blocks,
                }
        load_before = common.load_average()
        stats = common.round_robin(calls, args.repeats)
        load_after = common.load_average()
    base = stats["resident"]
    rows: dict[str, dict[str, Any]] = {}
    for name, st in stats.items():
        rows[name] = {
            **st.to_json(),
            "per": "component forward" if name == "model_level" else "streamed block",
            "over_resident_us": (st.min - base.min) / per[name] * 1e6,
            "over_resident_median_us": (st.median - base.median) / per[name] * 1e6,
            "identical": bool(torch.equal(outputs[name], outputs["resident"])),
            **counts.get(name, {}),
        }
    print(
        f"toy pipeline, DiT of {args.blocks} blocks (hidden {args.hidden}), {args.steps} steps a call: "
        f"{streamed} streamed blocks, {forwards} component forwards; CPU, {threads} thread(s), "
        f"{args.repeats} round-robin rounds; {common.fmt_load(load_before)} before, "
        f"{common.fmt_load(load_after)} after"
    )
    print(
        common.table(
            [
                "variant",
                "median ms",
                "min ms",
                "max ms",
                "us over resident",
                "from medians",
                "per",
                "calls",
                "instructions",
                "tensor ops",
                "same",
            ],
            [
                [
                    name,
                    r["median_s"] * 1e3,
                    r["min_s"] * 1e3,
                    r["max_s"] * 1e3,
                    None if name == "resident" else round(r["over_resident_us"], 1),
                    None if name == "resident" else round(r["over_resident_median_us"], 1),
                    None if name == "resident" else r["per"],
                    None if name == "resident" else round(r["calls_per_block"], 1),
                    None if name == "resident" else round(r["instructions_per_block"]),
                    None if name == "resident" else round(r["tensor_ops_per_block"], 1),
                    "yes" if r["identical"] else "NO",
                ]
                for name, r in rows.items()
            ],
        )
    )
    result = {
        "model": "torchferry.testing.toy pipeline",
        "blocks": args.blocks,
        "hidden": args.hidden,
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": threads,
        "load_average": {"before": load_before, "after": load_after},
        "rows": rows,
    }
    out = common.write_json(args.out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
