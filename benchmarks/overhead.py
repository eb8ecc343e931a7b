"""Per-block runtime overhead of torchferry versus the resident run and other offloaders, on CPU.

One model for everyone: diffusers' ``WanTransformer3DModel`` with 40 blocks and a tiny config
(hidden 64, 32 latent tokens), built locally from a seed. Each variant gets its own copy and runs
one transformer forward per round; the variants run round-robin so machine noise falls on all alike.
The overhead per block is ``(least forward - least resident forward) / blocks``: the least of the
repeats is the figure judged (noise from other work only ever adds time); the same from medians,
the min/median/max of every variant and the machine's load average before and after are shown.

Variants: resident; torchferry ``layerwise`` (depth 1) and ``model_level``; torchferry layerwise
with a policy that reuses one schedule for every steady step (what the session would cost if it
cached schedules without the step index, see benchmarks/README.md); diffusers group offloading
(``block_level``, one block per group, and ``leaf_level``) and accelerate's ``cpu_offload`` when
those import. The device is the CPU, so torchferry's slots are separate CPU tensors and every load
is a real copy; the others move nothing between a CPU "device" and the CPU, so one block's copy is
measured on its own and the overhead is also shown without it. Every variant's output is checked
against the resident one (``torch.equal``).

``--profile`` adds where torchferry's per-block time goes, timed inside live forwards (re-pointing
tensors, the copy, the rest of the op runs, the hooks), and a cProfile listing of torchferry's
functions. Prints a table and writes ``benchmarks/results/overhead.json``.

    python benchmarks/overhead.py [--repeats 30] [--blocks 40] [--threads 1] [--profile] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
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


def breakdown(
    session: Any, forward: Forward, blocks: int, per_block_s: float, *, repeats: int, clock: str = "wall"
) -> dict[str, Any]:
    """Where torchferry layerwise spends its per-block time, timed inside live forwards.

    Timers wrap the engine's op runs (``Engine.run``), the copies (``copy_in``) and the re-pointing
    (``Pack.point``) of ``repeats`` forwards; each figure is the least over those forwards, per
    block. ``hooks and the rest`` is the measured overhead minus the op runs: the hook calls
    themselves (torch's hook dispatch and ours). Schedules and compiled programs are cached (the
    built-in policies are index-free), so a steady forward builds and compiles nothing.
    """
    from torchferry.runtime import _host

    engine = session.engine
    spent = {"advance": 0.0, "copy": 0.0, "repoint": 0.0}
    run, copy_in, point = engine.run, engine.streams.copy_in, _host.Pack.point

    now = common.CLOCKS[clock]

    def timed(name: str, fn: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            start = now()
            fn(*args)
            spent[name] += now() - start

        return run

    engine.run = timed("advance", run)
    engine.streams.copy_in = timed("copy", copy_in)
    _host.Pack.point = timed("repoint", point)  # type: ignore[method-assign]
    per_forward: list[dict[str, float]] = []
    schedules = len(session.schedules)
    try:
        forward()
        for _ in range(repeats):
            for key in spent:
                spent[key] = 0.0
            forward()
            per_forward.append(dict(spent))
    finally:
        del engine.run
        del engine.streams.copy_in
        _host.Pack.point = point  # type: ignore[method-assign]
    least = {key: min(f[key] for f in per_forward) / blocks for key in spent}
    ops = least["advance"] - least["copy"] - least["repoint"]
    return {
        "copy_us": least["copy"] * 1e6,
        "repoint_us": least["repoint"] * 1e6,
        "tensors_per_block": len(
            next(g for n, g in engine.store.packs.items() if ".blocks." in f".{n}").tensors
        ),
        "ops_bookkeeping_us": ops * 1e6,
        "hooks_rest_us": (per_block_s - least["advance"]) * 1e6,
        "schedules_built_while_profiling": len(session.schedules) - schedules,
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
    parser.add_argument(
        "--clock",
        choices=sorted(common.CLOCKS),
        default="wall",
        help="wall time, or this thread's CPU time (steadier on a machine shared with other work)",
    )
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
        load_before = common.load_average()
        stats = common.round_robin(forwards, args.repeats, clock=args.clock)
        load_after = common.load_average()
        ours_name = "torchferry layerwise"
        extra: dict[str, Any] = {"load_average": {"before": load_before, "after": load_after}}
        resident = stats["resident"]
        ours_s = (stats[ours_name].min - resident.min) / blocks
        extra["block_copy_us"] = block_copy_s(sessions[ours_name], 20) * 1e6
        if args.profile:
            extra["breakdown"] = breakdown(
                sessions[ours_name],
                forwards[ours_name],
                blocks,
                ours_s,
                repeats=args.repeats,
                clock=args.clock,
            )
            extra["cprofile"] = cprofile(forwards[ours_name], 20)
        extra["schedules_cached"] = {n: len(s.schedules) for n, s in sessions.items()}

    rows: dict[str, dict[str, Any]] = {}
    theirs = theirs_median = None
    if "diffusers block_level" in stats:
        theirs = (stats["diffusers block_level"].min - resident.min) / blocks
        theirs_median = (stats["diffusers block_level"].median - resident.median) / blocks
    for name, s in stats.items():
        over = (s.min - resident.min) / blocks
        over_median = (s.median - resident.median) / blocks
        rows[name] = {
            **s.to_json(),
            "overhead_per_block_us": over * 1e6,
            "overhead_per_block_median_us": over_median * 1e6,
            "over_diffusers_block_level": over / theirs if theirs else None,
            "over_diffusers_block_level_median": over_median / theirs_median if theirs_median else None,
            "identical": bool(torch.equal(outputs[name], outputs["resident"])),
        }
    copy_us = extra["block_copy_us"]
    ours_us = rows[ours_name]["overhead_per_block_us"]
    title = (
        f"diffusers WanTransformer3DModel, {blocks} blocks, tiny config (hidden 64, 32 tokens), CPU, "
        f"{threads} thread(s), {args.repeats} round-robin rounds, {args.clock} clock; per block = "
        f"(min - resident min) / {blocks} (judged), and from medians; {common.fmt_load(load_before)} before, "
        f"{common.fmt_load(load_after)} after"
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
                "from medians",
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
                    None
                    if r["over_diffusers_block_level_median"] is None
                    else round(r["over_diffusers_block_level_median"], 3),
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
            f"{ratio:.3f} from the least of each ({met}; without the copy "
            f"{verdict['ours_without_copy_over_diffusers_block_level']:.3f}; from medians "
            f"{rows[ours_name]['over_diffusers_block_level_median']:.3f})"
        )
    if "breakdown" in extra:
        b = extra["breakdown"]
        print(
            f"where torchferry layerwise's {ours_us:.1f} us/block goes (timed inside live forwards, least of "
            f"{args.repeats}; {b['schedules_built_while_profiling']} schedules built meanwhile):"
        )
        print(
            common.table(
                ["piece", "us/block"],
                [
                    [
                        f"re-point {b['tensors_per_block']} tensors to the slot and back",
                        round(b["repoint_us"], 2),
                    ],
                    ["copy one block's bytes", round(b["copy_us"], 2)],
                    [
                        "op dispatch and bookkeeping (the rest of the op runs)",
                        round(b["ops_bookkeeping_us"], 2),
                    ],
                    ["hooks and the rest (overhead minus the op runs)", round(b["hooks_rest_us"], 2)],
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
        "clock": args.clock,
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
