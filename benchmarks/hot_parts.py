"""Where torchferry's own time at a streamed block goes, measured in place on one session.

`overhead.py --profile` times torchferry's hooks inside live forwards; this takes them apart, on one
layerwise session over the 40-block Wan transformer of `overhead.py` (so one model's memory, none of
the spread between model instances), with the caches a block's compute leaves.

Per block, each block's hook is swapped, forward by forward, for one of three forms (the order
swapped every round), and only the time inside it is taken, by one timer in every form:

- *the hook*: torchferry's, as the session runs it (a replayed step's: [Note: replay]);
- *its moves*: the moves of its stop alone (the copy into the slot and the two storage exchanges,
  mapped in C) and the program counter: the hook's checks and bookkeeping left out;
- *the exchanges*: the same less the copy. That forward's output is not the model's (each slot
  still holds the bytes of the block two before); the forward after it, with torchferry's hook,
  is checked exact.

Their differences of medians are the hook's checks and bookkeeping (the hook less its moves) and the
copy (the moves less the exchanges); the exchanges' row is the two exchanges, the map and the timer.

Per step, each part of the step's start and end is timed where it runs (after a forward's compute
has left the caches cold), and the parts that only read are timed again at once (warm): how much of
a step boundary is memory the compute evicted. The parts nest (`Session.enter` holds the guard's,
the step's and `Engine.begin`, which holds `Hooks.check` and `Replay.ready`...): a row includes the
rows inside it, their timers and their runs again, so the rows do not add up.

    python benchmarks/hot_parts.py [--repeats 40] [--quick] [--inference-mode]
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from typing import Any

import _common as common
import torch
from overhead import build_wan, wan_inputs

import torchferry
from torchferry.runtime.executor._replay import call, consume

FORMS = ("the hook", "its moves", "the exchanges")

#: The parts of a step's start and end: (what holds it, attribute), named by the class that defines
#: it. Those marked True only read, and are timed again at once.
STEP_PARTS: tuple[tuple[str, str, bool], ...] = (
    ("session", "enter", False),
    ("session._watch", "check", True),
    ("session._guard", "entering", False),
    ("session._guard", "adopt", False),
    ("session._steps", "next", False),
    ("session._steps", "schedule", False),
    ("engine", "begin", False),
    ("engine", "compile", False),
    ("engine.slots", "prepare", False),
    ("engine.hooks", "check", True),
    ("engine._casts", "step_begins", False),
    ("session", "leave", False),
    ("session._guard", "owns", False),
    ("session._guard", "drain", False),
    ("engine", "finish", False),
    ("engine", "unreplay", False),
    ("engine._casts", "step_ends", False),
    ("session._steps", "finished", False),
    ("session._guard", "left", False),
)


def _resolve(session: Any, where: str) -> Any:
    first, *rest = where.split(".")
    holder = {"session": session, "engine": session.engine}[first]
    for name in rest:
        holder = getattr(holder, name)
    return holder


def _us(stats: common.Stats) -> dict[str, float]:
    """Microsecond figures (``Stats.to_json`` names seconds)."""
    return {"min": stats.min, "median": stats.median, "max": stats.max, "n": stats.n}


def block_forms(session: Any, blocks: int) -> tuple[list[Any], dict[str, list[Any]], Any]:
    """Each block's box (its hook, [Note: block forwards]) and the three forms of it, untimed."""
    engine = session.engine
    (program,) = [p for p in engine._programs.values() if p.replay is not None]
    segments = program.replay.segments
    by_stop = {segment[0]: segment for segment in segments.values()}
    boxes: list[Any] = []
    forms: dict[str, list[Any]] = {name: [] for name in FORMS}
    for i in range(blocks):
        _, _, _, box, _ = engine.hooks._wrapped[f"blocks.{i}"]
        stop, fns, firsts, seconds, *_ = by_stop[program.stops[f"before blocks.{i}"]]
        kept = [j for j, fn in enumerate(fns) if fn is not torch.Tensor.copy_]

        def moves(module: Any, args: Any, s: Any = (stop, fns, firsts, seconds)) -> None:
            consume(map(call, s[1], s[2], s[3]))
            program.pc = s[0]

        exchanges = (stop, *(tuple(column[j] for j in kept) for column in (fns, firsts, seconds)))

        def exchanged(module: Any, args: Any, s: Any = exchanges) -> None:
            consume(map(call, s[1], s[2], s[3]))
            program.pc = s[0]

        boxes.append(box)
        forms["the hook"].append(box[0])
        forms["its moves"].append(moves)
        forms["the exchanges"].append(exchanged)
    return boxes, forms, program


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40, help="timed forwards of each form")
    parser.add_argument("--quick", action="store_true", help="8 blocks, 4 forwards: a smoke run")
    parser.add_argument(
        "--inference-mode", action="store_true", help="under torch.inference_mode(), not torch.no_grad()"
    )
    parser.add_argument("--out", default=str(common.RESULTS / "hot_parts.json"))
    args = parser.parse_args(argv)
    blocks, repeats = (8, 4) if args.quick else (40, args.repeats)
    torch.set_num_threads(1)
    now = common.CLOCKS["wall"]
    model = build_wan(blocks)
    inputs = wan_inputs()
    load_before = common.load_average()
    mode = torch.inference_mode() if args.inference_mode else torch.no_grad()
    with mode, torchferry.offload(model, strategy="layerwise", device="cpu") as session:

        def forward() -> torch.Tensor:
            out: torch.Tensor = model(*inputs, return_dict=False)[0]
            return out

        expected = [forward() for _ in range(3)][-1]
        boxes, forms, program = block_forms(session, blocks)
        inside = [0.0]

        def timed(hook: Callable[..., None]) -> Callable[..., None]:
            def run(module: Any, args: Any) -> None:
                start = now()
                hook(module, args)
                inside[0] += now() - start

            return run

        timed_forms = {name: [timed(h) for h in hooks] for name, hooks in forms.items()}
        per_block: dict[str, list[float]] = {name: [] for name in FORMS}
        exact = True
        try:
            for round_ in range(repeats):
                for name in FORMS if round_ % 2 else FORMS[::-1]:
                    for box, hook in zip(boxes, timed_forms[name], strict=True):
                        box[0] = hook
                    forward()  # (untimed: the form's first forward after another's)
                    inside[0] = 0.0
                    out = forward()
                    per_block[name].append(inside[0] / blocks * 1e6)
                    if name != "the exchanges":
                        exact = torch.equal(out, expected) and exact
        finally:
            for box, hook in zip(boxes, forms["the hook"], strict=True):
                box[0] = hook
        exact = torch.equal(forward(), expected) and exact

        # The step's start and end, part by part.
        spent: dict[str, float] = collections.defaultdict(float)
        names: list[str] = []
        restore: list[tuple[Any, str]] = []

        def step_timer(name: str, fn: Callable[..., Any], again: bool) -> Callable[..., Any]:
            def run(*a: Any, **k: Any) -> Any:
                start = now()
                try:
                    return fn(*a, **k)
                finally:
                    spent[name] += now() - start
                    if again:
                        start = now()
                        fn(*a, **k)
                        spent[f"{name}, again at once"] += now() - start

            return run

        for where, attr, again in STEP_PARTS:
            holder = _resolve(session, where)
            name = f"{type(holder).__name__}.{attr}"
            try:
                setattr(holder, attr, step_timer(name, getattr(holder, attr), again))
            except AttributeError:  # (an attribute a slotted class does not let be set: left out)
                continue
            restore.append((holder, attr))
            names += [name, f"{name}, again at once"] if again else [name]
        replay_class = type(program.replay)
        ready = replay_class.ready
        replay_class.ready = step_timer("Replay.ready", ready, True)
        names += ["Replay.ready", "Replay.ready, again at once"]
        per_step: dict[str, list[float]] = collections.defaultdict(list)
        try:
            forward()
            for _ in range(repeats):
                spent.clear()
                exact = torch.equal(forward(), expected) and exact  # (the forward runs whatever)
                for name in names:
                    per_step[name].append(spent[name] * 1e6)
        finally:
            for holder, attr in restore:
                delattr(holder, attr)
            replay_class.ready = ready
    stats = {name: common.Stats.of(v) for name, v in per_block.items()}
    median = {name: s.median for name, s in stats.items()}
    parts = {
        "checks and bookkeeping (the hook less its moves)": median["the hook"] - median["its moves"],
        "the copy (the moves less the exchanges)": median["its moves"] - median["the exchanges"],
        "the two exchanges, the map and the timer": median["the exchanges"],
    }
    print(
        f"diffusers WanTransformer3DModel, {blocks} blocks, one layerwise session (replayed), CPU, 1 thread, "
        f"{'inference_mode' if args.inference_mode else 'no_grad'}; "
        f"{repeats} rounds; {common.fmt_load(load_before)} before, "
        f"{common.fmt_load(common.load_average())} after"
    )
    print("\ntime inside each block's hook, per form (us a block; one timer in each):")
    print(
        common.table(
            ["form", "min", "median", "max"], [[n, s.min, s.median, s.max] for n, s in stats.items()]
        )
    )
    print("\nof the hook, from the medians (us a block):")
    print(common.table(["part", "us a block"], [[n, v] for n, v in parts.items()]))
    step_stats = {name: common.Stats.of(per_step[name]) for name in names}
    print(f"\nthe step's start and end, part by part, nested (us a step; per block: / {blocks}):")
    print(
        common.table(
            ["part", "min", "median", "median per block"],
            [[n, s.min, s.median, s.median / blocks] for n, s in step_stats.items()],
        )
    )
    print(f"every output torchferry gave equal to the first: {'yes' if exact else 'NO'}")
    result = {
        "machine": common.machine(),
        "blocks": blocks,
        "repeats": repeats,
        "mode": "inference_mode" if args.inference_mode else "no_grad",
        "per_block_us": {n: _us(s) for n, s in stats.items()},
        "hook_parts_us": parts,
        "step_parts_us": {n: _us(s) for n, s in step_stats.items()},
        "exact": exact,
    }
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
