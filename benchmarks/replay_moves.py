"""A replayed step's moves as C calls against the same moves as one Python function each.

On a CPU session a steady layerwise step is replayed ([Note: replay] in
`torchferry/runtime/executor/_replay.py`): each block's load is a copy into its slot and its wait
and evict exchange its storage with the slot's. Those moves run either as C calls alone (the copy,
`SWAP`; the packs' record of where they are is left as the step found it) or as one Python function
of the pack each (`load_docked`, `land`, `lift`, which also keep that record). This times both forms
side by side on one session over the 40-block Wan transformer of `overhead.py`, alternating every
forward, so the machine's noise and where the model's memory landed are the same for both:
min/median/max per forward and the difference per block. The profile of `overhead.py` cannot show
this difference: the timer it puts around a replayed copy is itself a Python call.

    python benchmarks/replay_moves.py [--repeats 150] [--quick]
"""

from __future__ import annotations

import argparse
from typing import Any

import _common as common
import torch
from overhead import build_wan, wan_inputs

import torchferry
from torchferry.runtime.executor._replay import _NOTHING
from torchferry.runtime.memory import _pack


def python_moves(replay: Any) -> dict[int, Any]:
    """``replay``'s segments with each move made by a Python function of the pack (the earlier form)."""
    kinds = {0: _pack.load_docked, 1: _pack.land, 2: _pack.lift}
    moves = iter(replay.moves)
    segments = {}
    for start, (stop, fns, firsts, seconds, *rest) in replay.segments.items():
        key = rest[:1]  # (its block's key, if this torchferry has one; its moves are Python calls now)
        made = []
        for fn, a, b in zip(fns, firsts, seconds, strict=True):
            if fn is torch.Tensor.copy_ or fn is _pack.SWAP:
                _, kind, pack, storage = next(moves)
                made.append((kinds[kind], pack, (a, storage) if kind == 0 else storage))
            else:
                if fn is _NOTHING:
                    next(moves)  # a load for the next step, its copy left to its wait in both forms
                made.append((fn, a, b))
        segments[start] = (stop, *map(tuple, zip(*made, strict=True)), *key, *([False] if key else []))
    return segments


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=150, help="timed forwards of each form")
    parser.add_argument("--quick", action="store_true", help="8 blocks, 5 forwards: a smoke run")
    parser.add_argument("--out", default=str(common.RESULTS / "replay_moves.json"))
    args = parser.parse_args(argv)
    blocks, repeats = (8, 5) if args.quick else (40, args.repeats)
    torch.set_num_threads(1)
    model = build_wan(blocks)
    inputs = wan_inputs()
    with torch.no_grad(), torchferry.offload(model, strategy="layerwise", device="cpu") as session:

        def forward() -> torch.Tensor:
            out: torch.Tensor = model(*inputs, return_dict=False)[0]
            return out

        expected = [forward() for _ in range(3)][-1]
        (replay,) = [p.replay for p in session.engine._programs.values() if p.replay is not None]
        forms = {"C calls": dict(replay.segments), "a Python function each": python_moves(replay)}
        same = {}
        for name, segments in forms.items():
            replay.segments.clear()
            replay.segments.update(segments)
            same[name] = torch.equal(forward(), expected)
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(repeats):
            for name, segments in forms.items():
                replay.segments.clear()
                replay.segments.update(segments)
                start = common.CLOCKS["wall"]()
                forward()
                times[name].append(common.CLOCKS["wall"]() - start)
        replay.segments.clear()
        replay.segments.update(forms["C calls"])
    stats = {name: common.Stats.of(t) for name, t in times.items()}
    before, now = stats["a Python function each"], stats["C calls"]
    rows = [
        [name, s.min * 1e3, s.median * 1e3, s.max * 1e3, "yes" if same[name] else "NO"]
        for name, s in stats.items()
    ]
    print(
        f"diffusers WanTransformer3DModel, {blocks} blocks, one layerwise session, the two forms of its "
        f"replayed moves alternating over {repeats} forwards each (wall clock, ms)"
    )
    print(common.table(["moves", "min ms", "median ms", "max ms", "exact"], rows))
    saved = {"from_least_us": (before.min - now.min) / blocks * 1e6}
    saved["from_medians_us"] = (before.median - now.median) / blocks * 1e6
    faster = sum(b > n for b, n in zip(times["a Python function each"], times["C calls"], strict=True))
    print(
        f"C calls save {saved['from_least_us']:.2f} us per block from the least of each, "
        f"{saved['from_medians_us']:.2f} us from the medians; faster in {faster} of {repeats} pairs"
    )
    result = {
        "blocks": blocks,
        "repeats": repeats,
        "forms": {name: s.to_json() for name, s in stats.items()},
        "exact": same,
        "saved_per_block_us": saved,
        "faster_pairs": faster,
    }
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
