"""Per-block runtime overhead of torchferry versus the resident run and other offloaders, on CPU.

One model for everyone: diffusers' ``WanTransformer3DModel`` with 40 blocks and a tiny config
(hidden 64, 32 latent tokens), built locally from a seed. Each variant gets its own copy and runs
one transformer forward per round; the variants run round-robin so machine noise falls on all alike.
The overhead per block is ``(median forward - median resident forward) / blocks``.

Variants: resident; torchferry ``layerwise`` (depth 1) and ``model_level``; torchferry layerwise
with a policy that reuses one schedule for every steady step (what the session would cost if it
cached schedules without the step index, see benchmarks/README.md); diffusers group offloading
(``block_level``, one block per group, and ``leaf_level``) and accelerate's ``cpu_offload`` when
those import. The device is the CPU, so torchferry's slots are separate CPU tensors and every load
is a real copy; the others move nothing between a CPU "device" and the CPU, so one block's copy is
measured on its own and the overhead is also shown without it. Every variant's output is checked
against the resident one (``torch.equal``).

``--profile`` adds where torchferry's per-block time goes, measured piece by piece on the live
session (schedule building, compiling, re-pointing tensors, the copy, the rest), and a cProfile
listing of torchferry's functions. Prints a table and writes ``benchmarks/results/overhead.json``.

    python benchmarks/overhead.py [--repeats 30] [--blocks 40] [--threads 1] [--profile] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import itertools
import pstats
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import _common as common  # first: puts the repository root on sys.path
import attrs
import torch

import torchferry
from torchferry import policies
from torchferry.policies import Schedule, Step
from torchferry.topology import Plan

TARGET_RATIO = 0.1  # torchferry layerwise per-block overhead over diffusers block_level

Forward = Callable[[], torch.Tensor]


def build_wan(blocks: int, seed: int = 0) -> torch.nn.Module:
    """A tiny 40-block (by default) diffusers Wan transformer, weights a function of ``seed``."""
    wan: Any = importlib.import_module("diffusers").WanTransformer3DModel
    torch.manual_seed(seed)
    model: torch.nn.Module = wan(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=128,
        num_layers=blocks,
        rope_max_seq_len=32,
    )
    return model.eval()


def wan_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latents (1, 4, 2, 8, 8) (32 tokens after patching), a timestep and 8 text tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, 2, 8, 8, generator=g), torch.tensor([500]), torch.randn(1, 8, 32, generator=g)


def index_free(policy: policies.Policy) -> policies.Policy:
    """``policy`` cached by step without its index: one schedule object serves every steady step."""
    inner = policies.cached(policy)

    def reuse(plan: Plan, step: Step, /) -> Schedule:
        return inner(plan, attrs.evolve(step, index=0))

    return reuse


@contextmanager
def _torchferry(
    model: torch.nn.Module, strategy: str, policy: policies.Policy | None = None
) -> Iterator[Any]:
    with torchferry.offload(model, strategy=strategy, device="cpu", policy=policy) as session:
        yield session


@contextmanager
def _diffusers(model: torch.nn.Module, kind: str) -> Iterator[None]:
    apply_group_offloading: Any = importlib.import_module("diffusers.hooks").apply_group_offloading
    apply_group_offloading(
        model,
        onload_device=torch.device("cpu"),
        offload_device=torch.device("cpu"),
        offload_type=kind,
        num_blocks_per_group=1 if kind == "block_level" else None,
    )
    yield


@contextmanager
def _accelerate(model: torch.nn.Module) -> Iterator[None]:
    from accelerate import cpu_offload

    cpu_offload(model, execution_device=torch.device("cpu"))
    yield


SETUPS: dict[str, Callable[[torch.nn.Module], AbstractContextManager[Any]]] = {
    "resident": lambda m: nullcontext(),
    "torchferry layerwise": lambda m: _torchferry(m, "layerwise"),
    "torchferry model_level": lambda m: _torchferry(m, "model_level"),
    "torchferry layerwise, schedule reused": lambda m: _torchferry(
        m, "layerwise", index_free(policies.layerwise(1))
    ),
    "diffusers block_level": lambda m: _diffusers(m, "block_level"),
    "diffusers leaf_level": lambda m: _diffusers(m, "leaf_level"),
    "accelerate cpu_offload": _accelerate,
}


def block_copy_s(session: Any, repeats: int) -> float:
    """Median seconds to copy one block's host bytes into a slot-sized buffer, cycling over blocks.

    Cycling over every block's buffer keeps the source out of the fastest caches, as in a forward.
    """
    packs = [g for name, g in session.engine.store.packs.items() if ".blocks." in f".{name}"]
    dst = torch.empty(max(g.nbytes for g in packs), dtype=torch.uint8)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for g in packs:
            dst[: g.nbytes].copy_(g.host)
        samples.append((time.perf_counter() - start) / len(packs))
    return common.Stats.of(samples).median


def breakdown(session: Any, forward: Forward, blocks: int, per_block_s: float) -> dict[str, float]:
    """Where torchferry layerwise spends its per-block time, each piece timed on the live session.

    ``schedule``: the policy building the step's schedule (the session asks once per forward, since
    the step index is part of the cache key); ``compile``: the engine compiling it; ``re-point``:
    pointing one block's tensors at device views and back; ``copy``: one block's bytes; the rest is
    hooks, op dispatch and bookkeeping.
    """
    engine = session.engine
    forward()
    last = next(reversed(session.schedules.values()))
    counter = itertools.count(10**6)

    def policy_call() -> object:
        return session.policy(session.plan, attrs.evolve(last.step, index=next(counter)))

    schedule_s = common.per_call(policy_call).median / blocks
    fresh = [policy_call() for _ in range(64)]
    cycle = itertools.cycle(fresh)

    def compile_call() -> None:
        s = next(cycle)
        engine.compile(s)
        engine._programs.pop(s, None)

    compile_s = common.per_call(compile_call).median / blocks
    name = next(n for n in engine.store.packs if n.endswith(f"blocks.{blocks // 2}"))
    pack = engine.store.packs[name]
    scratch = torch.empty(pack.nbytes, dtype=torch.uint8)
    views = tuple(p.view(scratch) for p in pack.pieces)

    def repoint() -> None:
        pack.point(views)
        pack.point(pack.host_views)

    repoint_s = common.per_call(repoint).median
    copy_s = block_copy_s(session, 50)
    rest = per_block_s - schedule_s - compile_s - repoint_s - copy_s
    return {
        "schedule_us": schedule_s * 1e6,
        "compile_us": compile_s * 1e6,
        "repoint_us": repoint_s * 1e6,
        "tensors_per_block": len(pack.tensors),
        "copy_us": copy_s * 1e6,
        "hooks_dispatch_rest_us": rest * 1e6,
    }


def cprofile(forward: Forward, n: int) -> str:
    """cProfile of ``n`` forwards, torchferry's functions by cumulative time."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        forward()
    profile.disable()
    buffer = io.StringIO()
    pstats.Stats(profile, stream=buffer).sort_stats("cumtime").print_stats("torchferry", 12)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds (after 3 warm-up rounds)")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (pinned)")
    parser.add_argument("--profile", action="store_true", help="also break torchferry's per-block time down")
    parser.add_argument("--quick", action="store_true", help="8 blocks, 3 rounds: a smoke run")
    parser.add_argument("--out", type=Path, default=common.RESULTS / "overhead.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.repeats = 8, 3
    threads = common.pin_threads(args.threads)
    blocks: int = args.blocks
    inputs = wan_inputs()

    notes: list[str] = []
    forwards: dict[str, Forward] = {}
    sessions: dict[str, Any] = {}
    outputs: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        for name, setup in SETUPS.items():
            model = build_wan(blocks)
            try:
                handle = stack.enter_context(setup(model))
            except ImportError as error:
                notes.append(f"{name}: skipped ({error})")
                continue
            if handle is not None:
                sessions[name] = handle

            def forward(model: torch.nn.Module = model) -> torch.Tensor:
                out: torch.Tensor = model(*inputs, return_dict=False)[0]
                return out

            forwards[name] = forward
            outputs[name] = forward()
        stats = common.round_robin(forwards, args.repeats)
        ours_name = "torchferry layerwise"
        extra: dict[str, Any] = {}
        resident = stats["resident"].median
        ours_s = (stats[ours_name].median - resident) / blocks
        extra["block_copy_us"] = block_copy_s(sessions[ours_name], 20) * 1e6
        if args.profile:
            extra["breakdown"] = breakdown(sessions[ours_name], forwards[ours_name], blocks, ours_s)
            extra["cprofile"] = cprofile(forwards[ours_name], 20)
        extra["schedules_cached"] = {n: len(s.schedules) for n, s in sessions.items()}

    rows: dict[str, dict[str, Any]] = {}
    theirs = None
    if "diffusers block_level" in stats:
        theirs = (stats["diffusers block_level"].median - resident) / blocks
    for name, s in stats.items():
        over = (s.median - resident) / blocks
        rows[name] = {
            **s.to_json(),
            "overhead_per_block_us": over * 1e6,
            "over_diffusers_block_level": over / theirs if theirs else None,
            "identical": bool(torch.equal(outputs[name], outputs["resident"])),
        }
    copy_us = extra["block_copy_us"]
    ours_us = rows[ours_name]["overhead_per_block_us"]
    title = (
        f"diffusers WanTransformer3DModel, {blocks} blocks, tiny config (hidden 64, 32 tokens), CPU, "
        f"{threads} thread(s), {args.repeats} round-robin rounds; per block = (median - resident) / {blocks}"
    )
    print(title)
    print(
        common.table(
            [
                "variant",
                "median ms",
                "min ms",
                "max ms",
                "us/block over resident",
                "vs diffusers block",
                "same",
            ],
            [
                [
                    name,
                    r["median_s"] * 1e3,
                    r["min_s"] * 1e3,
                    r["max_s"] * 1e3,
                    round(r["overhead_per_block_us"], 1),
                    None
                    if r["over_diffusers_block_level"] is None
                    else round(r["over_diffusers_block_level"], 3),
                    "yes" if r["identical"] else "NO",
                ]
                for name, r in rows.items()
            ],
        )
    )
    print(
        f"one block's copy ({copy_us:.1f} us, CPU to CPU, which the others skip here); "
        f"torchferry layerwise without it: {ours_us - copy_us:.1f} us/block"
    )
    verdict: dict[str, Any] = {}
    if theirs:
        ratio = ours_us / (theirs * 1e6)
        verdict = {
            "ours_over_diffusers_block_level": ratio,
            "ours_without_copy_over_diffusers_block_level": (ours_us - copy_us) / (theirs * 1e6),
            "target": TARGET_RATIO,
            "met": ratio <= TARGET_RATIO,
        }
        met = "met" if ratio <= TARGET_RATIO else "NOT met"
        print(
            f"target: torchferry layerwise <= {TARGET_RATIO} x diffusers block_level per block: "
            f"{ratio:.3f} ({met}; without the copy "
            f"{verdict['ours_without_copy_over_diffusers_block_level']:.3f})"
        )
    if "breakdown" in extra:
        b = extra["breakdown"]
        print(f"where torchferry layerwise's {ours_us:.1f} us/block goes (each piece timed on its own):")
        print(
            common.table(
                ["piece", "us/block"],
                [
                    ["schedule built by the policy (once per forward, / blocks)", round(b["schedule_us"], 2)],
                    [
                        "schedule compiled by the engine (once per forward, / blocks)",
                        round(b["compile_us"], 2),
                    ],
                    [
                        f"re-point {b['tensors_per_block']} tensors to the slot and back",
                        round(b["repoint_us"], 2),
                    ],
                    ["copy one block's bytes", round(b["copy_us"], 2)],
                    ["hooks, op dispatch, the rest", round(b["hooks_dispatch_rest_us"], 2)],
                ],
            )
        )
        print(extra["cprofile"])
    for note in notes:
        print(note)
    result = {
        "model": "diffusers WanTransformer3DModel (tiny config)",
        "blocks": blocks,
        "repeats": args.repeats,
        "threads": threads,
        "rows": rows,
        "verdict": verdict,
        "notes": notes,
        **{k: v for k, v in extra.items() if k != "cprofile"},
    }
    out = common.write_json(args.out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
