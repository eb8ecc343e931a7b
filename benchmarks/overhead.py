"""Per-block runtime overhead of torchferry versus the resident run and other offloaders, on CPU.

The toy pipeline with a 40-block DiT runs one call (encoder, ``--steps`` DiT forwards, decoder)
per repeat under each strategy, round-robin so machine noise falls on all alike; the overhead per
block is ``(median call time - median resident time) / (blocks * steps)``. Only the DiT is
offloaded. With ``device="cpu"`` torchferry's slots are separate CPU tensors, so every load is a
real copy and the figure is the runtime's whole cost (hooks, op dispatch, re-pointing, copies); the
others move nothing between a CPU "device" and the CPU, so the copy of one block is measured and
reported alongside. diffusers group offloading (block_level, leaf_level) and
accelerate's ``cpu_offload`` run on the same model when those packages import; their rows are
skipped with a note otherwise. Prints a table and writes ``overhead.json`` next to this file.

    python benchmarks/overhead.py [--repeats 200] [--blocks 40] [--hidden 64] [--steps 4]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

import torchferry
from torchferry import toy


def _pipeline(blocks: int, hidden: int) -> toy.ToyPipeline:
    return toy.build(0, blocks=blocks, hidden=hidden)


def _round_robin(forwards: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, dict[str, Any]]:
    """Time every forward once per round, in turn, so machine noise falls on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in forwards}
    for round_ in range(repeats + 3):
        for name, forward in forwards.items():
            start = time.perf_counter()
            forward()
            if round_ >= 3:
                samples[name].append(time.perf_counter() - start)
    return {
        name: {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s)}
        for name, s in samples.items()
    }


@contextmanager
def _torchferry(p: toy.ToyPipeline, strategy: str) -> Iterator[None]:
    with torchferry.offload(p, strategy=strategy, device="cpu", components={"dit"}):
        yield


@contextmanager
def _diffusers(p: toy.ToyPipeline, kind: str) -> Iterator[None]:
    from diffusers.hooks import apply_group_offloading

    apply_group_offloading(
        p.transformer,
        onload_device=torch.device("cpu"),
        offload_device=torch.device("cpu"),
        offload_type=kind,
        num_blocks_per_group=1 if kind == "block_level" else None,
    )
    yield


@contextmanager
def _accelerate(p: toy.ToyPipeline) -> Iterator[None]:
    from accelerate import cpu_offload

    cpu_offload(p.transformer, execution_device=torch.device("cpu"))
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = _pipeline(args.blocks, args.hidden)

    rows: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    setups: dict[str, Callable[[toy.ToyPipeline], AbstractContextManager[None]]] = {
        "resident": lambda p: nullcontext(),
        "torchferry layerwise": lambda p: _torchferry(p, "layerwise"),
        "torchferry model_level": lambda p: _torchferry(p, "model_level"),
        "diffusers block_level": lambda p: _diffusers(p, "block_level"),
        "diffusers leaf_level": lambda p: _diffusers(p, "leaf_level"),
        "accelerate cpu_offload": _accelerate,
    }
    forwards: dict[str, Callable[[], torch.Tensor]] = {}
    with ExitStack() as stack:
        for name, setup in setups.items():
            p = copy.deepcopy(base)
            try:
                stack.enter_context(setup(p))
            except ImportError as error:
                notes.append(f"{name}: skipped ({error})")
                continue
            forwards[name] = lambda p=p: p("a cat", steps=args.steps)  # type: ignore[misc]
        stack.enter_context(torch.no_grad())
        rows.update(_round_robin(forwards, args.repeats))

    resident = rows["resident"]["median_s"]
    for row in rows.values():
        row["per_block_overhead_us"] = (row["median_s"] - resident) / (args.blocks * args.steps) * 1e6
    ours = rows["torchferry layerwise"]["per_block_overhead_us"]
    print(
        f"{args.blocks}-block toy DiT (hidden {args.hidden}), {args.steps} DiT steps per pipeline call, CPU, "
        f"{args.repeats} repeats, medians"
    )
    print(
        f"{'strategy':<26}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'overhead/block us':>20}{'vs ours':>9}"
    )
    for name, row in rows.items():
        ratio = row["per_block_overhead_us"] / ours if ours > 0 else float("nan")
        print(
            f"{name:<26}{row['median_s'] * 1e3:>11.3f}{row['min_s'] * 1e3:>9.3f}{row['max_s'] * 1e3:>9.3f}"
            f"{row['per_block_overhead_us']:>20.1f}{ratio:>9.1f}"
        )
    for note in notes:
        print(note)
    result = {
        "blocks": args.blocks,
        "hidden": args.hidden,
        "repeats": args.repeats,
        "threads": args.threads,
        "rows": rows,
        "notes": notes,
    }
    block_bytes = max(b.nbytes for b in torchferry.topology.discover(base).component("transformer").blocks)
    src, dst = torch.empty(block_bytes, dtype=torch.uint8), torch.empty(block_bytes, dtype=torch.uint8)
    copy_us = _round_robin({"copy": lambda: dst.copy_(src)}, 2000)["copy"]["median_s"] * 1e6
    bookkeeping = ours - copy_us
    result["block_copy_us"] = copy_us
    result["ours_without_copy_us"] = bookkeeping
    print(
        f"one block's copy ({block_bytes} bytes, CPU to CPU, which the others skip here): {copy_us:.1f} us; "
        f"torchferry layerwise per-block overhead without it: {bookkeeping:.1f} us"
    )
    if "diffusers block_level" in rows:
        theirs = rows["diffusers block_level"]["per_block_overhead_us"]
        result["ours_over_diffusers_block_level"] = ours / theirs if theirs > 0 else None
        result["ours_without_copy_over_diffusers_block_level"] = bookkeeping / theirs if theirs > 0 else None
        print(
            f"torchferry layerwise / diffusers block_level per-block overhead: {ours / theirs:.3f} "
            f"(without the copy: {bookkeeping / theirs:.3f})"
        )
    out = Path(__file__).with_name("overhead.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
