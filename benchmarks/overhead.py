"""Per-block runtime overhead of torchferry versus the resident run and other offloaders, on CPU.

One model for everyone: diffusers' ``WanTransformer3DModel`` with 40 blocks and a tiny config
(hidden 64, 32 latent tokens), built locally from a seed. Each variant gets its own copy and runs
one transformer forward per round; the variants run round-robin so machine noise falls on all alike.
The overhead per block is ``(least forward - least resident forward) / blocks``: the least of the
repeats is the figure judged (noise from other work only ever adds time); the same from medians,
the min/median/max of every variant and the machine's load average before and after are shown.
How fast a model instance runs depends on where its memory landed, so the resident model is built
three times, spread over the build order; the baseline is the median of the three, and their spread
(the noise floor of every figure) is printed.

Variants: resident (three instances); torchferry ``layerwise`` (depth 1) and ``model_level``;
``layerwise, CUDA's path``: the same session running the code a CUDA session runs
(`torchferry.testing.cuda_path`: tensors re-pointed rather than docked, every wait and release issued,
no replay), the GPU user's bookkeeping less the CUDA runtime's own; the
*copy floor* (the resident model plus, before each block, a copy of as many bytes as torchferry's
pack of it into one of two ring buffers, run from the block's forward as torchferry's hooks are: what
any offloader that moves bytes pays on this device); *empty pre hooks* (the resident model with a
forward pre hook that does nothing on each block: torch's slow call path, which any pre hook turns on);
diffusers group offloading (``block_level``, one block per group, and ``leaf_level``) and
accelerate's ``cpu_offload`` when those import. The device is the CPU, so torchferry's slots are
separate CPU tensors and every load is a real copy; the others move nothing between a CPU "device"
and the CPU. Every variant's output is checked against the resident one (``torch.equal``).

``--profile`` adds where torchferry's own time goes, timed inside live forwards (every hook it
installed, the step start and end, the op runs, the copies, re-pointing tensors at the slot; each
less the cost of the timers nested in it), and a cProfile listing of torchferry's functions.
Targets: layerwise at most 0.05 x diffusers block_level per block; torchferry's own code, the copy
left out, at most 5 us per block. Beside the timings, the deterministic count of torchferry's work
per block (`torchferry.testing._calls.count_calls`: its Python calls, the C functions they call, the
instructions they execute, the tensor operations they issue), the same on every machine, which
tests/test_hot_path.py budgets. Prints a table and writes ``benchmarks/results/overhead.json``.

    python benchmarks/overhead.py [--repeats 30] [--blocks 40] [--threads 1] [--profile] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import pstats
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import _common as common  # first: puts the repository root on sys.path
import torch

import torchferry

TARGET_RATIO = 0.05  # torchferry layerwise per-block overhead over diffusers block_level
BOOKKEEPING_US = 5.0  # torchferry layerwise's own code per block, the copy left out

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


@contextmanager
def _torchferry(model: torch.nn.Module, strategy: str) -> Iterator[Any]:
    with torchferry.offload(model, strategy=strategy, device="cpu") as session:
        yield session


@contextmanager
def _cuda_path(model: torch.nn.Module) -> Iterator[Any]:
    """torchferry layerwise as a CUDA session runs it, on the CPU (`torchferry.testing.cuda_path`: each
    tensor re-pointed, every wait and release issued, no replay); only its engine is built so."""
    cuda_path = getattr(importlib.import_module("torchferry.testing"), "cuda_path", None)
    if cuda_path is None:
        raise ImportError("this torchferry has no torchferry.testing.cuda_path")
    with cuda_path():
        session = torchferry.offload(model, strategy="layerwise", device="cpu")
    with session:
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


@contextmanager
def _copy_floor(model: torch.nn.Module) -> Iterator[None]:
    """The resident model, plus what any offloader that moves bytes pays on this device: before each
    block, a copy of as many bytes as torchferry's pack of it (every tensor on a 256-byte boundary)
    from a buffer of its own into one of two ring buffers. Nothing else."""
    blocks = list(model.blocks)
    sizes = [sum(-(-t.nbytes // 256) * 256 for t in (*b.parameters(), *b.buffers())) for b in blocks]
    ring = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(2)]
    for i, (block, nbytes) in enumerate(zip(blocks, sizes, strict=True)):
        host, slot = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), ring[i % 2][:nbytes]
        inner = block.forward

        # Run from the block's forward, as torchferry's hooks are (a forward pre hook would add torch's
        # slow call path to the floor: see the pre-hook row).
        def forward(
            *args: Any,
            inner: Any = inner,
            host: torch.Tensor = host,
            slot: torch.Tensor = slot,
            **kwargs: Any,
        ) -> Any:
            slot.copy_(host)
            return inner(*args, **kwargs)

        block.forward = forward
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


@contextmanager
def _pre_hooks(model: torch.nn.Module) -> Iterator[None]:
    """The resident model with an empty forward pre hook on each block: what torch's slow call path,
    which any pre hook turns on, costs by itself."""

    def nothing(module: torch.nn.Module, args: Any) -> None:
        return None

    handles = [block.register_forward_pre_hook(nothing) for block in model.blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


RESIDENTS = ("resident", "resident (2)", "resident (3)")

#: Built and run in this order; the resident model is built three times, spread over the order: how
#: fast a model instance runs depends on where its memory landed (instances differ by up to ~20 us
#: per block here), so the baseline is the median of the three and their spread is printed.
SETUPS: dict[str, Callable[[torch.nn.Module], AbstractContextManager[Any]]] = {
    "resident": lambda m: nullcontext(),
    "torchferry layerwise": lambda m: _torchferry(m, "layerwise"),
    "copy floor": _copy_floor,
    "torchferry layerwise, CUDA's path": _cuda_path,
    "empty pre hooks": _pre_hooks,
    "torchferry model_level": lambda m: _torchferry(m, "model_level"),
    "resident (2)": lambda m: nullcontext(),
    "diffusers block_level": lambda m: _diffusers(m, "block_level"),
    "diffusers leaf_level": lambda m: _diffusers(m, "leaf_level"),
    "resident (3)": lambda m: nullcontext(),
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


#: What `breakdown` can time: the hooks, the step start and end, the ops, the copies, re-pointing.
PARTS = frozenset({"hooks", "step", "ops", "copy", "repoint"})


def breakdown(
    session: Any,
    forward: Forward,
    blocks: int,
    *,
    repeats: int,
    clock: str = "wall",
    parts: frozenset[str] = PARTS,
) -> dict[str, Any]:
    """Where torchferry layerwise spends its own time, timed inside live forwards.

    Timers wrap every hook torchferry installed (so the sum is all of torchferry's code a forward
    runs, step start and end included), the session's step start and end (`Session.enter`/``leave``),
    the op runs (``Engine.advance``; a replayed step's block hooks run their moves themselves, so
    theirs count as the hooks'), the copies (``copy_in``, or a replayed step's ``load_docked``),
    and re-pointing tensors at a slot and back (``Pack.arrive`` and ``Pack.to_host``, which re-point
    or dock, or a replayed step's ``land`` and ``lift``; ``Pack.point`` in a checkout without them).
    Each figure is the least over ``repeats`` forwards, per block, less the
    timers nested in it. Torch's own hook dispatch is outside every timer. Only the ``parts`` named are
    timed: each timer is itself code that runs between a block's compute, with caches the compute left
    cold, and one around a replayed step's copy puts a Python call back among its C calls, so the
    judged figure is the hooks timed alone less the copies timed alone, in forwards of their own,
    round by round (`paired_alone`).
    """
    from torchferry.runtime.memory import _pack

    engine = session.engine
    # ("moved": the copies and re-pointing a replayed step's block hooks run themselves, outside ``ops``)
    names = ("hooks", "step", "ops", "copy", "repoint", "moved")
    spent = dict.fromkeys(names, 0.0)
    calls = dict.fromkeys(names, 0)
    now = common.CLOCKS[clock]
    in_ops = [0]

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = now()
            in_ops[0] += name == "ops"
            try:
                return fn(*args, **kwargs)
            finally:
                in_ops[0] -= name == "ops"
                elapsed = now() - start
                spent[name] += elapsed
                calls[name] += 1
                if name in ("copy", "repoint") and not in_ops[0]:
                    spent["moved"] += elapsed
                    calls["moved"] += 1

        return run

    # What one timer adds to the figure of the timer around it: a timed no-op against a bare one.
    def nothing() -> None:
        return None

    timed_nothing = timed("copy", nothing)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            timed_nothing()
        middle = time.perf_counter()
        for _ in range(2000):
            nothing()
        samples.append((2 * middle - start - time.perf_counter()) / 2000)
    timer_s = max(0.0, min(samples))

    saved_hooks: list[tuple[dict[int, Any], int, Any]] = []
    for module in session.pipeline.modules():
        for table in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in list(table.items()):
                if "hooks" in parts and getattr(hook, "_torchdynamo_disable", False):  # see `_compile.opaque`
                    saved_hooks.append((table, key, hook))
                    OrderedDict.__setitem__(
                        table, key, timed("hooks", hook)
                    )  # (a block's table notices none)
    # A block whose hook runs from its forward ([Note: block forwards]) holds it in a box.
    boxes = [w[3] for w in getattr(engine.hooks, "_wrapped", {}).values()] if "hooks" in parts else []
    saved_boxes = [(box, box[0]) for box in boxes]
    for box, hook in saved_boxes:
        box[0] = timed("hooks", hook)
    # Re-pointing (or docking) happens where a pack takes its slot and where it leaves it.
    moves = ("arrive", "to_host") if hasattr(_pack.Pack, "arrive") else ("point",)
    pack_methods = {m: getattr(_pack.Pack, m) for m in moves} if "repoint" in parts else {}
    if "ops" in parts:
        engine.advance = timed("ops", engine.advance)  # the hooks run ops through it (`Mover.advance`)
    # A replayed step copies in `load_docked`, timed below; shadowing the copy would stop the replay.
    programs = getattr(engine, "_programs", {}).values()
    replaying = any(getattr(p, "replay", None) is not None for p in programs)
    if not replaying and "copy" in parts:
        engine.streams.copy_in = timed("copy", engine.streams.copy_in)
    if "step" in parts:
        session.enter, session.leave = timed("step", session.enter), timed("step", session.leave)
    for m, fn in pack_methods.items():
        setattr(_pack.Pack, m, timed("repoint", fn))
    # A replayed step ([Note: replay]) calls the packs' moves from its recorded segments: the load's
    # copy (with the two attributes it sets, about 0.05 us) is timed as the copy, a dock and an
    # undock as re-pointing.
    replayed = {
        getattr(_pack, "load_docked", None): "copy",
        getattr(_pack, "land", None): "repoint",
        getattr(_pack, "lift", None): "repoint",
    }
    if hasattr(_pack, "SWAP"):  # replayed moves as C calls: the copy, and the exchange of storages
        replayed = {torch.Tensor.copy_: "copy", _pack.SWAP: "repoint"}
    replayed = {f: name for f, name in replayed.items() if name in parts}
    replayed.pop(None, None)
    saved_segments: list[tuple[dict[int, Any], int, Any]] = []
    for program in getattr(engine, "_programs", {}).values():
        replay = getattr(program, "replay", None)
        if replay is None:
            continue
        for key, segment in list(replay.segments.items()):
            saved_segments.append((replay.segments, key, segment))
            fns = tuple(timed(replayed[f], f) if f in replayed else f for f in segment[1])
            replay.segments[key] = (segment[0], fns, *segment[2:])
    per_forward: list[dict[str, float]] = []
    schedules = len(session.schedules)
    try:
        forward()
        for _ in range(repeats):
            for key in spent:
                spent[key], calls[key] = 0.0, 0
            forward()
            # Each figure less the timers nested inside it: copy and re-point inside ops (and step) or
            # right inside a block's hook (a replayed step), those and ops and step inside the hooks.
            inner = timer_s * (calls["copy"] + calls["repoint"])
            moved = spent["moved"] + timer_s * calls["moved"]  # in the hooks, outside ops
            per_forward.append(
                {
                    "own": spent["hooks"] - spent["copy"] - inner - timer_s * (calls["ops"] + calls["step"]),
                    "copy": spent["copy"],
                    "repoint": spent["repoint"],
                    "ops": spent["ops"]
                    - (spent["copy"] + spent["repoint"] - spent["moved"])
                    - timer_s * (calls["copy"] + calls["repoint"] - calls["moved"]),
                    "step": spent["step"],
                    "total": spent["hooks"],
                    "hooks": spent["hooks"]
                    - spent["ops"]
                    - spent["step"]
                    - moved
                    - timer_s * (calls["ops"] + calls["step"]),
                }
            )
    finally:
        for table, key, hook in saved_hooks:
            OrderedDict.__setitem__(table, key, hook)
        for box, hook in saved_boxes:
            box[0] = hook
        for segments, key, segment in saved_segments:
            segments[key] = segment
        if "ops" in parts:
            del engine.advance
        if "step" in parts:
            del session.enter, session.leave
        if not replaying and "copy" in parts:
            del engine.streams.copy_in
        for m, fn in pack_methods.items():
            setattr(_pack.Pack, m, fn)
    least = {key: min(f[key] for f in per_forward) / blocks * 1e6 for key in per_forward[0]}
    return {
        "own_code_without_copy_us": least["own"],
        "copy_us": least["copy"],
        "repoint_us": least["repoint"],
        "ops_us": least["ops"],
        "step_us": least["step"],
        "hooks_rest_us": least["hooks"],
        "hooks_total_us": least["total"],
        "timer_us": timer_s * 1e6,
        "schedules_built_while_profiling": len(session.schedules) - schedules,
    }


def paired_alone(session: Any, forward: Forward, blocks: int, *, repeats: int, clock: str) -> dict[str, Any]:
    """Torchferry's own code per block, the copy left out, as judged: in each of ``repeats`` rounds, a
    forward with only its hooks timed, then one with only its copies timed (each after a forward
    with the same timers, untimed), and the difference of the two; their min, median and max over
    the rounds (the median is judged), and the least of each part beside them."""
    differences, hooks, copies = [], [], []
    for _ in range(repeats):
        h = breakdown(session, forward, blocks, repeats=1, clock=clock, parts=frozenset({"hooks"}))
        c = breakdown(session, forward, blocks, repeats=1, clock=clock, parts=frozenset({"copy"}))
        hooks.append(h["hooks_total_us"])
        copies.append(c["copy_us"])
        differences.append(h["hooks_total_us"] - c["copy_us"])
    paired = common.Stats.of(differences)
    return {
        "own_code_without_copy_us": paired.median,
        "own_code_without_copy_min_us": paired.min,
        "own_code_without_copy_max_us": paired.max,
        "least_hooks_less_least_copy_us": min(hooks) - min(copies),
        "hooks_total_us": min(hooks),
        "copy_us": min(copies),
    }


def hook_forms(session: Any, forward: Forward, blocks: int, *, repeats: int, clock: str) -> dict[str, Any]:
    """What running the block hooks from the blocks' forwards ([Note: block forwards]) saves over
    running them as forward pre hooks, on one session (so one model's memory, none of the spread
    between instances): its steady forward in each form in turn, the order swapped every round, each
    timed after one untimed; min, median and max per block of the pre hooks' less the forwards'.
    Empty where this torchferry runs every hook as a pre hook (an older checkout)."""
    hooks = session.engine.hooks
    forms = [(w[0], w[1], w[2], w[4], hooks._calls[p][1]) for p, w in getattr(hooks, "_wrapped", {}).items()]
    if not forms:
        return {}
    now = common.CLOCKS[clock]

    def use(pre_hooks: bool) -> None:
        for module, wrapper, own, table, pre in forms:
            if pre_hooks:
                vars(module).pop("forward", None)
                if own is not None:
                    module.forward = own
                OrderedDict.__setitem__(table, -1, pre)  # (a key no handle has: taken out below)
                table.move_to_end(-1, last=False)
            else:
                table.pop(-1, None)
                module.forward = wrapper

    taken: dict[bool, list[float]] = {True: [], False: []}
    hooks.check = lambda: None  # (the step start would take a block in its pre-hook form for good)
    try:
        for round_ in range(repeats):
            for pre_hooks in (True, False) if round_ % 2 else (False, True):
                use(pre_hooks)
                forward()
                start = now()
                forward()
                taken[pre_hooks].append(now() - start)
    finally:
        use(False)
        del hooks.check
    saved = common.Stats.of([(a - b) / blocks * 1e6 for a, b in zip(taken[True], taken[False], strict=True)])
    return {"pre_hooks_less_forwards_us": {"min": saved.min, "median": saved.median, "max": saved.max}}


def counts(sessions: dict[str, Any], forwards: dict[str, Forward], blocks: int) -> dict[str, Any]:
    """torchferry's work per block in one steady forward of each of its variants, counted (the same on
    every machine); ``None`` where this torchferry has no counter."""
    try:
        from torchferry.testing._calls import count_calls
    except ImportError:  # an older checkout, run beside this one
        return {}
    found = {}
    for name in sessions:
        c = count_calls(forwards[name])
        found[name] = {
            "calls_per_block": c.calls / blocks,
            "c_calls_per_block": c.c_calls / blocks,
            "instructions_per_block": c.instructions / blocks,
            # (an older checkout, run beside this one, counts no tensor operations)
            "tensor_ops_per_block": getattr(c, "tensor_ops", float("nan")) / blocks,
        }
    return found


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
        timings: dict[str, list[float]] = {}
        stats = common.round_robin(forwards, args.repeats, clock=args.clock, samples=timings)
        load_after = common.load_average()
        ours_name = "torchferry layerwise"
        extra: dict[str, Any] = {"load_average": {"before": load_before, "after": load_after}}
        extra["block_copy_us"] = block_copy_s(sessions[ours_name], 20) * 1e6
        if args.profile:
            extra["breakdown"] = breakdown(
                sessions[ours_name], forwards[ours_name], blocks, repeats=args.repeats, clock=args.clock
            )
            extra["breakdown_alone"] = paired_alone(
                sessions[ours_name], forwards[ours_name], blocks, repeats=args.repeats, clock=args.clock
            )
            extra["hook_forms"] = hook_forms(
                sessions[ours_name], forwards[ours_name], blocks, repeats=2 * args.repeats, clock=args.clock
            )
            extra["cprofile"] = cprofile(forwards[ours_name], 20)
        extra["schedules_cached"] = {n: len(s.schedules) for n, s in sessions.items()}
        extra["counts"] = counts(sessions, forwards, blocks)

    residents = sorted((stats[n] for n in RESIDENTS if n in stats), key=lambda r: r.min)
    base_min = residents[len(residents) // 2].min
    base_median = sorted(r.median for r in residents)[len(residents) // 2]
    spread_us = (residents[-1].min - residents[0].min) / blocks * 1e6
    rows: dict[str, dict[str, Any]] = {}
    theirs = theirs_median = None
    if "diffusers block_level" in stats:
        theirs = (stats["diffusers block_level"].min - base_min) / blocks
        theirs_median = (stats["diffusers block_level"].median - base_median) / blocks
    for name, st in stats.items():
        over = (st.min - base_min) / blocks
        over_median = (st.median - base_median) / blocks
        rows[name] = {
            **st.to_json(),
            "overhead_per_block_us": over * 1e6,
            "overhead_per_block_median_us": over_median * 1e6,
            "over_diffusers_block_level": over / theirs if theirs else None,
            "over_diffusers_block_level_median": over_median / theirs_median if theirs_median else None,
            "identical": bool(torch.equal(outputs[name], outputs["resident"])),
        }
    ours_us = rows[ours_name]["overhead_per_block_us"]
    floor_us = rows["copy floor"]["overhead_per_block_us"]
    # Torchferry's forward less the copy floor's of the same round (the two run one after the other, so
    # what drifts between rounds falls on both), per block.
    beyond = common.Stats.of(
        [(a - b) / blocks * 1e6 for a, b in zip(timings[ours_name], timings["copy floor"], strict=True)]
    )
    title = (
        f"diffusers WanTransformer3DModel, {blocks} blocks, tiny config (hidden 64, 32 tokens), CPU, "
        f"{threads} thread(s), {args.repeats} round-robin rounds, {args.clock} clock; per block = "
        f"(min - resident min) / {blocks} (judged; resident = the median of {len(residents)} instances), "
        f"and from medians; {common.fmt_load(load_before)} before, {common.fmt_load(load_after)} after"
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
        f"resident instances differ by {spread_us:.1f} us/block among themselves (the noise floor of every "
        f"figure above); one block's copy alone, cycling over blocks: {extra['block_copy_us']:.1f} us; the "
        f"copy floor (that copy before each block of a resident model) adds {floor_us:.1f} us/block"
    )
    verdict: dict[str, Any] = {
        "resident_spread_us": spread_us,
        "beyond_copy_floor_paired_us": {"min": beyond.min, "median": beyond.median, "max": beyond.max},
    }
    print(
        f"torchferry layerwise less the copy floor, round by round: min {beyond.min:.1f}, median "
        f"{beyond.median:.1f}, max {beyond.max:.1f} us/block (not the judged figure: the floor's blocks "
        "compute from their own weights, not from the bytes its copy just wrote, as torchferry's do)"
    )
    if theirs:
        ratio = ours_us / (theirs * 1e6)
        verdict.update(
            ours_over_diffusers_block_level=ratio,
            copy_floor_over_diffusers_block_level=floor_us / (theirs * 1e6),
            ours_beyond_copy_floor_us=ours_us - floor_us,
            target=TARGET_RATIO,
            met=ratio <= TARGET_RATIO,
        )
        met = "met" if ratio <= TARGET_RATIO else "NOT met"
        print(
            f"target: torchferry layerwise <= {TARGET_RATIO} x diffusers block_level per block: {ratio:.3f} "
            f"from the least of each ({met}; from medians "
            f"{rows[ours_name]['over_diffusers_block_level_median']:.3f}); the copy floor alone is "
            f"{verdict['copy_floor_over_diffusers_block_level']:.3f}; torchferry beyond the copy floor: "
            f"{ours_us - floor_us:.1f} us/block"
        )
    if "breakdown" in extra:
        b = extra["breakdown"]
        light = extra["breakdown_alone"]
        verdict["bookkeeping_us"] = light["own_code_without_copy_us"]
        verdict["bookkeeping_broken_down_us"] = b["own_code_without_copy_us"]
        verdict["bookkeeping_met"] = light["own_code_without_copy_us"] <= BOOKKEEPING_US
        print(
            f"torchferry layerwise's own code, timed inside live forwards (least of {args.repeats}, per "
            f"block, less {b['timer_us']:.2f} us per nested timer; {b['schedules_built_while_profiling']} "
            "schedules built meanwhile):"
        )
        print(
            common.table(
                ["piece", "us/block"],
                [
                    [
                        "all of it but the copy: the hooks timed alone less the copies timed alone, "
                        "round by round: median (judged)",
                        round(light["own_code_without_copy_us"], 2),
                    ],
                    ["  min over the rounds", round(light["own_code_without_copy_min_us"], 2)],
                    ["  max over the rounds", round(light["own_code_without_copy_max_us"], 2)],
                    [
                        "  the least of the hooks timed alone less the least of the copies",
                        round(light["least_hooks_less_least_copy_us"], 2),
                    ],
                    [
                        "all of it but the copy, every piece below timed too",
                        round(b["own_code_without_copy_us"], 2),
                    ],
                    ["  the modules read the slot and back (re-pointing)", round(b["repoint_us"], 2)],
                    [
                        "  the ops' other work (load, wait, evict; in the hooks' when replayed)",
                        round(b["ops_us"], 2),
                    ],
                    ["  step start and end (guard check, schedule pick), per block", round(b["step_us"], 2)],
                    ["  the hooks themselves", round(b["hooks_rest_us"], 2)],
                    ["the copy (inside the hooks)", round(b["copy_us"], 2)],
                ],
            )
        )
        met = "met" if verdict["bookkeeping_met"] else "NOT met"
        print(f"target: bookkeeping (all but the copy) <= {BOOKKEEPING_US} us/block: {met}")
        forms = extra["hook_forms"].get("pre_hooks_less_forwards_us")
        if forms is not None:
            print(
                "the same session's block hooks as forward pre hooks, less run from the blocks' forwards "
                f"(alternating forwards, torch's slow call path included): min {forms['min']:.1f}, median "
                f"{forms['median']:.1f}, max {forms['max']:.1f} us/block"
            )
        print(extra["cprofile"])
    for name, c in extra["counts"].items():
        print(
            f"{name}: {c['calls_per_block']:.1f} Python calls, {c['c_calls_per_block']:.1f} C calls, "
            f"{c['instructions_per_block']:.0f} instructions, {c['tensor_ops_per_block']:.1f} tensor ops of "
            "torchferry's per block (counted, any machine)"
        )
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
