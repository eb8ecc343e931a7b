"""`auto`: pick strategy, prefetch depth and a fixed set of resident blocks for a budget and a cost model.

The choice depends on the plan alone (never on the step), so every step of a session streams
through the same ring with the same resident blocks. Candidates are scored by the simulated
*steady-state* step of each DiT that streams: the step whose entry is what the previous step of the
same component left, so the ring's wrap-around prefetch counts as it will at run time. A denoising
step runs one DiT (the two experts of Wan 2.2 take turns at the boundary), so a candidate's forward
is the mean of the streaming DiTs' steady forwards, never their sum.

Search: for each depth, the most resident blocks that fit, placed three ways (leading, spread
evenly, spread evenly from the first block); then the fewest resident blocks that keep the best
time (so memory is not spent where transfers already hide behind compute). Spread resident blocks
give the copy stream compute time to hide behind when transfers are slower than compute.

Whole-component strategies: a plan that fits the budget whole gets `none`, one that streams no
blocks gets `model_level`; otherwise model-level swapping competes with the best ring when it fits,
its transfers spread over ``CostModel.forwards_per_call``.

With a host budget some packs are in the file tier (`policies.tiers`, fixed by the plan): every
candidate's schedules read them, so the simulated step counts the io stream at
``CostModel.read_bytes_per_s``, and a fourth placement, ``file-first``, keeps file-tier blocks
resident first (a resident block is read once a session instead of every forward), which wins
where reads are slower than compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Literal

import attrs

from torchferry._errors import ScheduleError, plan_named, strategy_named
from torchferry.policies._builtin import builtin, compress_paths, distributed_layerwise, layerwise, ring_slots
from torchferry.policies._ir import Declared, Policy, Schedule, Step, declare
from torchferry.policies._layout import layout, swaps
from torchferry.policies._sim import DEFAULT_COST, CostModel, simulate, steady_schedule
from torchferry.policies._tiers import read_nbytes, tiers
from torchferry.policies._tokens import format_bytes
from torchferry.topology import FrozenMap, Plan, Strategy, memory_bytes

__all__ = [
    "Choice",
    "auto",
    "choose",
    "footprint",
    "least_device_bytes",
    "steady_step_s",
    "swap_per_forward_s",
    "whole_device_bytes",
]

_TIE = 1e-9
#: How resident blocks are spread over the streaming pool: the first ones, evenly from a half step
#: in, or evenly from the first block.
PlacementName = Literal["leading", "spread", "spread-first", "file-first"]
PLACEMENTS: tuple[PlacementName, ...] = ("leading", "spread", "spread-first")
#: The placements tried when the plan has a file tier: file-tier blocks first, then leading ones.
FILE_PLACEMENTS: tuple[PlacementName, ...] = (*PLACEMENTS, "file-first")


@attrs.frozen(kw_only=True)
class Choice:
    """What `choose` picked for a plan, a budget and a cost model, and why.

    ``strategy``, ``depth`` and ``resident`` (extra block paths kept on the device) name the policy
    (`policy`); ``step_s`` is the simulated steady forward (the mean over the streaming DiTs, of
    which a step runs one) and ``resident_step_s`` the same with every weight resident;
    ``forward_s`` holds each streaming DiT's own steady forward when a ring streams more than one
    (the experts of Wan 2.2); ``predicted_step_s`` is one denoising step (``forwards_per_step``
    forwards). ``footprint`` is the device bytes it holds at most,
    ``budget`` what it had to fit, ``candidates`` how many were simulated; ``reason`` says it in
    a sentence.
    """

    strategy: Strategy
    depth: int
    resident: tuple[str, ...]
    placement: PlacementName | Literal[""]
    step_s: float
    resident_step_s: float
    footprint: int
    candidates: int
    budget: int = 0
    forwards_per_step: int = 1
    forward_s: FrozenMap[str, float] = attrs.field(factory=FrozenMap)
    reason: str = ""

    @property
    def predicted_step_s(self) -> float:
        """Simulated seconds of one denoising step: the steady forward times the forwards per step."""
        return self.step_s * self.forwards_per_step

    @property
    def overhead(self) -> float:
        """``step / all-resident step - 1`` (0 when nothing computes)."""
        return self.step_s / self.resident_step_s - 1 if self.resident_step_s > 0 else 0.0

    def policy(self) -> Declared:
        """The built-in policy this choice names (`builtin`)."""
        if self.strategy in ("none", "model_level"):
            return builtin(self.strategy)
        return builtin(self.strategy, depth=self.depth, resident=self.resident)

    def explain(self) -> str:
        """The sentence `reason` holds: what was picked, against which budget, at what predicted cost."""
        name = self.policy().name
        used, budget = format_bytes(self.footprint, exact=False), format_bytes(self.budget, exact=False)
        fit = f"footprint {used} of {budget}"
        if self.strategy == "none":
            return f"{name}: every component fits whole ({fit}); nothing streams"
        if self.strategy == "model_level" and self.step_s == 0.0:
            return f"{name}: no block streams under this plan; whole components swap ({fit})"
        per_step = f", x{self.forwards_per_step} forwards = {self.predicted_step_s:.4f} s per step"
        return (
            f"{name}: the fastest of {self.candidates} simulated candidates that fit ({fit}); forward "
            f"{self.step_s:.4f} s{self._experts()} vs all-resident {self.resident_step_s:.4f} s "
            f"(+{self.overhead * 100:.2f}%){per_step if self.forwards_per_step > 1 else ''}"
        )

    def _experts(self) -> str:
        """What the forward of a ring over several DiTs is: one of them (a step runs one), each
        named with its own forward where they differ."""
        if len(self.forward_s) < 2:
            return ""
        times = list(self.forward_s.values())
        if max(times) <= min(times) * (1 + _TIE):
            return f" (one of {', '.join(self.forward_s.keys())}; a step runs one)"
        each = ", ".join(f"{c} {t:.4f} s" for c, t in self.forward_s.items())
        return f" (the mean of {each}; a step runs one)"


def footprint(plan: Plan, depth: int, resident: Sequence[str] = (), *, gather: bool = False) -> int:
    """Device bytes a ring policy holds at most over a session: kept units, slots, largest acquired."""
    lay = layout(plan, frozenset(resident))
    kept = sum(lay.sizes[u] for u in lay.kept)
    slots = sum(s.nbytes for s in ring_slots(plan, lay, depth, lay.allgather if gather else frozenset()))
    return kept + slots + max(lay.acquired.values(), default=0)


def steady_step_s(
    policy: Policy, plan: Plan, cost: CostModel, components: Sequence[str]
) -> tuple[float, float]:
    """Simulated (makespan, resident makespan) of one steady forward of ``components``.

    DiTs take turns: a denoising step runs one of them (the experts of Wan 2.2 switch at the
    boundary), so their forward is the mean of their steady forwards, never the sum, weighing the
    experts as though they share the steps evenly. Other components (the encoders that stream when
    no DiT does) all run in a call, and their times add up.
    """
    return _combine(plan, components, _steady_forwards(policy, plan, cost, components))


def _combine(
    plan: Plan, components: Sequence[str], forwards: tuple[tuple[float, float], ...]
) -> tuple[float, float]:
    """``forwards`` (one per component) as one forward: the mean over DiTs, the sum otherwise."""
    count = len(forwards) if forwards and all(plan.component(c).kind == "dit" for c in components) else 1
    return sum(t for t, _ in forwards) / count, sum(r for _, r in forwards) / count


def _steady_forwards(
    policy: Policy, plan: Plan, cost: CostModel, components: Sequence[str]
) -> tuple[tuple[float, float], ...]:
    """Simulated (makespan, resident makespan) of a steady forward of each of ``components``."""
    reports = [simulate(steady_schedule(policy, plan, c), cost) for c in components]
    return tuple((r.makespan_s, r.resident_makespan_s) for r in reports)


def _place(pool: Sequence[str], count: int, how: PlacementName, first: Sequence[str] = ()) -> tuple[str, ...]:
    """``count`` blocks of ``pool`` placed ``how``; ``file-first`` takes ``first`` (in its order),
    then the leading others."""
    n = len(pool)
    if count <= 0:
        return ()
    if how == "file-first":
        ahead = set(first)
        picked = set([*first, *(b for b in pool if b not in ahead)][:count])
        return tuple(b for b in pool if b in picked)
    if how == "leading":
        idx = list(range(count))
    elif how == "spread":
        idx = [int((i + 0.5) * n / count) for i in range(count)]
    else:
        idx = [int(i * n / count) for i in range(count)]
    return tuple(pool[i] for i in sorted(set(idx)))


def choose(
    plan: Plan, device_memory: int | str, cost: CostModel = DEFAULT_COST, max_depth: int = 4
) -> Choice:
    """The strategy, depth and resident set that fit ``device_memory`` (bytes or ``"24GiB"``) with the
    least simulated steady step under ``cost``: the one chooser behind `auto`, ``torchferry plan``
    and the session. Pure; cached by its arguments. `ScheduleError` when nothing fits.

    Search (see the module notes): a plan that fits whole gets `none`; otherwise, for each depth
    1..``max_depth``, the most resident blocks that fit placed three ways, then the fewest that keep
    the best time; model-level swapping competes when it fits. Ties (within 1e-9) go to the smaller
    footprint. The `Choice` carries its predicted step and a ``reason``.
    """
    budget = memory_bytes(device_memory, "choose(device_memory=...)")
    choice = attrs.evolve(
        _choose(plan, budget, cost, max_depth), budget=budget, forwards_per_step=cost.forwards_per_step
    )
    return attrs.evolve(choice, reason=choice.explain())


@lru_cache(maxsize=64)
def _choose(plan: Plan, budget_bytes: int, cost: CostModel, max_depth: int) -> Choice:
    lay = layout(plan)
    total = sum(c.nbytes for c in plan.components if not c.on_demand) + max(lay.acquired.values(), default=0)
    streaming = [c.path for c in plan.components if lay.streamed.get(c.path)]
    if total <= budget_bytes or not streaming:
        whole: Strategy = "none" if total <= budget_bytes else "model_level"
        need = total if whole == "none" else _model_level_bytes(plan)
        if need > budget_bytes:
            raise ScheduleError.worded(
                f"auto(budget={format_bytes(budget_bytes)}): ",
                plan_named(plan.digest),
                f" streams no blocks and model-level swapping needs {format_bytes(need)}; raise the budget "
                "or resolve the plan with ",
                strategy_named("layerwise"),
            )
        return Choice(
            strategy=whole,
            depth=1,
            resident=(),
            placement="",
            step_s=0.0,
            resident_step_s=0.0,
            footprint=need,
            candidates=1,
        )
    gather = plan.config.distributed
    strategy: Strategy = "distributed_layerwise" if gather else "layerwise"
    factory = distributed_layerwise if gather else layerwise
    dits = [c for c in streaming if plan.component(c).kind == "dit"] or streaming
    pool = [b.path for c in dits for b in lay.streamed[c]]
    file = tiers(plan).file
    placements = FILE_PLACEMENTS if any(b in file for b in pool) else PLACEMENTS
    # File-tier blocks in the order `tiers` chose them: the last of each DiT first, in turn.
    ends = {b.path: (k, i) for i, c in enumerate(dits) for k, b in enumerate(reversed(lay.streamed[c]))}
    first = sorted((b for b in pool if b in file), key=ends.__getitem__)
    sizes = lay.sizes
    scored: dict[tuple[int, tuple[str, ...]], tuple[tuple[float, float], ...]] = {}

    def score(depth: int, resident: tuple[str, ...]) -> tuple[float, float]:
        """The mean steady forward of the streaming DiTs (a step runs one) and its resident baseline."""
        key = (depth, resident)
        if key not in scored:
            scored[key] = _steady_forwards(factory(depth, resident), plan, cost, dits)
        return _combine(plan, dits, scored[key])

    best: Choice | None = None
    smallest = footprint(plan, 1, gather=gather)
    for depth in range(1, max_depth + 1):
        base = footprint(plan, depth, gather=gather)
        if base > budget_bytes:
            break
        free = budget_bytes - base

        def fits(resident: tuple[str, ...], free: int = free) -> bool:
            return sum(sizes[b] for b in resident) <= free

        most = 0
        for count in range(len(pool), -1, -1):
            if any(fits(_place(pool, count, how, first)) for how in placements):
                most = count
                break

        def best_at(
            count: int, depth: int = depth, fits: Callable[[tuple[str, ...]], bool] = fits
        ) -> tuple[float, float, tuple[str, ...], PlacementName]:
            options = []
            for how in placements:
                resident = _place(pool, count, how, first)
                if fits(resident):
                    t, r = score(depth, resident)
                    options.append((t, r, resident, how))
            return min(options, key=lambda o: (o[0], placements.index(o[3])))

        top = best_at(most)
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi) // 2
            if best_at(mid)[0] <= top[0] * (1 + _TIE):
                hi = mid
            else:
                lo = mid + 1
        t, r, resident, how = best_at(lo)
        size = base + sum(sizes[b] for b in resident)
        candidate = Choice(
            strategy=strategy,
            depth=depth,
            resident=resident,
            placement=how if resident else "",
            step_s=t,
            resident_step_s=r,
            footprint=size,
            candidates=0,
            forward_s=_each(plan, dits, scored[depth, resident]),
        )
        if (
            best is None
            or t < best.step_s * (1 - _TIE)
            or (t <= best.step_s * (1 + _TIE) and size < best.footprint)
        ):
            best = candidate
    swapping = _model_level_choice(plan, budget_bytes, cost, dits, best)
    if swapping is not None:
        best = swapping
    if best is None:
        raise ScheduleError.worded(
            f"auto(budget={format_bytes(budget_bytes)}): even depth 1 with no resident blocks needs "
            f"{format_bytes(smallest)} on ",
            plan_named(plan.digest),
            "; raise the budget to at least that",
        )
    return attrs.evolve(best, candidates=len(scored) + (best.strategy == "model_level"))


def _each(
    plan: Plan, dits: Sequence[str], forwards: tuple[tuple[float, float], ...]
) -> FrozenMap[str, float]:
    """Each streaming DiT's steady forward, where a ring streams more than one (else empty)."""
    if len(dits) < 2 or any(plan.component(c).kind != "dit" for c in dits):
        return FrozenMap()
    return FrozenMap(tuple(zip(dits, (t for t, _ in forwards), strict=True)))


def swap_per_forward_s(plan: Plan, cost: CostModel) -> float:
    """What model-level swapping's transfers cost per DiT forward: every swapped component moved to
    the device (its file-tier packs read first) once per pipeline call, over ``cost.forwards_per_call``."""
    swapped = [c for c in plan.components if swaps(c)]
    file = tiers(plan).file
    moved = cost.h2d_seconds(sum(c.nbytes for c in swapped))
    moved += cost.read_seconds(sum(read_nbytes(plan, file, c.path) for c in swapped))  # file-tier packs
    return moved / cost.forwards_per_call


def _model_level_choice(
    plan: Plan, budget_bytes: int, cost: CostModel, dits: Sequence[str], ring: Choice | None
) -> Choice | None:
    """Model-level swapping, when it fits and beats the best ring per forward.

    A swap moves every selected DiT and encoder once per pipeline call, so its cost per forward is
    that transfer spread over ``cost.forwards_per_call``; within a forward it streams nothing.
    """
    need = _model_level_bytes(plan)
    swapped = [c for c in plan.components if swaps(c)]
    if need > budget_bytes or not any(c.kind == "encoder" for c in swapped):
        return None
    # The all-resident time of a forward, from the ring's baseline (a whole-component schedule has
    # no block points to time).
    resident = ring.resident_step_s if ring is not None else steady_step_s(layerwise(1), plan, cost, dits)[1]
    step = resident + swap_per_forward_s(plan, cost)
    if ring is not None and step >= ring.step_s * (1 - _TIE):
        return None
    return Choice(
        strategy="model_level",
        depth=1,
        resident=(),
        placement="",
        step_s=step,
        resident_step_s=resident,
        footprint=need,
        candidates=0,
    )


def whole_device_bytes(plan: Plan) -> int:
    """Device bytes of every weight resident (and the largest acquired unit): the most any choice of
    `choose` holds, so a budget beyond it chooses as it does."""
    lay = layout(plan)
    return sum(c.nbytes for c in plan.components if not c.on_demand) + max(lay.acquired.values(), default=0)


def least_device_bytes(plan: Plan) -> int:
    """The least device budget `choose` opens ``plan`` with (its weights; one byte less is a
    `ScheduleError`): every weight, else depth 1 with no resident blocks, else model-level swapping
    where it applies, whichever is smallest."""
    lay = layout(plan)
    total = whole_device_bytes(plan)
    streaming = [c.path for c in plan.components if lay.streamed.get(c.path)]
    if not streaming:
        return min(total, _model_level_bytes(plan))
    least = min(total, footprint(plan, 1, gather=plan.config.distributed))
    if any(c.kind == "encoder" for c in plan.components if swaps(c)):
        least = min(least, _model_level_bytes(plan))
    return least


def _model_level_bytes(plan: Plan) -> int:
    """Device bytes of model-level swapping: what stays, the largest swapped component, the largest
    acquired one."""
    swap = [c.nbytes for c in plan.components if swaps(c)]
    kept = sum(c.nbytes for c in plan.components if not swaps(c) and not c.on_demand)
    acquired = max((c.nbytes for c in plan.components if c.on_demand), default=0)
    return kept + max(swap, default=0) + acquired


def auto(device_memory: int | str, cost: CostModel = DEFAULT_COST, max_depth: int = 4) -> Declared:
    """A policy that picks strategy, depth (1..``max_depth``) and a fixed resident-block set fitting
    ``device_memory`` (bytes or ``"24GiB"``) with the least simulated steady-state step time under
    ``cost`` (`choose`); ties go to the smaller footprint. Its schedule's notes explain the choice.
    """
    budget_bytes = memory_bytes(device_memory, "auto(device_memory=...)")
    name = f"auto(budget={format_bytes(budget_bytes, exact=False)})"

    def auto_policy(plan: Plan, step: Step, /) -> Schedule:
        choice = choose(plan, budget_bytes, cost, max_depth)
        schedule = choice.policy()(plan, step)
        chosen = schedule.policy
        notes = [
            f"auto chose {chosen}: footprint {format_bytes(choice.footprint, exact=False)} of "
            f"{format_bytes(budget_bytes, exact=False)}"
        ]
        overhead = choice.step_s / choice.resident_step_s - 1 if choice.resident_step_s else 0.0
        if choice.strategy == "model_level":
            notes.append(
                f"step {choice.step_s:.4f} s vs all-resident {choice.resident_step_s:.4f} s "
                f"(+{overhead * 100:.2f}%), the swap spread over {cost.forwards_per_call} forwards a call; "
                f"best of {choice.candidates} candidates"
            )
        if choice.strategy in ("layerwise", "distributed_layerwise"):
            notes.append(
                f"steady step {choice.step_s:.4f} s vs all-resident {choice.resident_step_s:.4f} s "
                f"(+{overhead * 100:.2f}%), best of {choice.candidates} simulated candidates"
            )
            placement = f" ({choice.placement})" if choice.resident else ""
            paths = compress_paths(choice.resident)
            notes.append(f"resident blocks{placement}: {paths}")
        return attrs.evolve(schedule, policy=name, notes=(*notes, *tiers(plan).notes))

    return declare(auto_policy, name=name, index_free=True)
