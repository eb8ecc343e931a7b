"""`simulate`: replay a schedule's copy, comm, compute and io streams under a cost model.

[Note: the stream model]
Ops run in listed order; each stream is a FIFO, so an op starts when its stream is free and its
dependencies are done. The forward's computes are implied by the anchors: the component computes
(``CostModel`` component time) after its ``before <component>`` ops, and each block computes after
its ``before <block>`` ops and before its ``after <block>`` ops. Dependencies:

- ``load``/``gather`` into a slot wait until the slot is free: the compute time at the ``evict`` of
  its previous occupant, or for a shard slot the end of the gather that read it;
- ``gather`` chunk k waits for the copy of shard chunk k (so it overlaps the copy of chunk k+1);
- ``wait`` holds the compute stream until the unit's last load, gather or stage ends; the delay is
  the stall charged to the anchor it sits at;
- ``acquire`` runs a blocking host-to-device copy on the compute stream; ``evict``, ``unstage`` and
  ``release`` take no time on the device;
- ``read`` (the io stream: file-tier bytes from the checkpoint into a staging slot, at
  ``CostModel.read_bytes_per_s``) waits until its staging slot was drained: the end of the load or
  stage that copied the slot's previous read out; a load or stage ``from`` a staging slot waits for
  the end of the read into it.

Host cost: the runtime's hooks run on the host between the kernels they launch, so every op costs
``CostModel.host_op_s`` and every block's hooks ``CostModel.host_block_s`` on the compute stream
(drawn as ``host`` stretches). The resident baseline runs no hooks and pays neither: host cost is
what tells a well-overlapped ring's +0.3% from a host-synchronising one's +7% when transfers hide.

``SimReport.timeline`` records every busy stretch of every stream (each transfer chunk, each
compute, each stall) so a step can be drawn; it takes no part in any other figure.

Device bytes are counted in op order, as a runtime allocating on the host would measure them: a slot
is allocated once, at its first use (already allocated if the entry names it; the ``gather`` slot at
the first gather in more than one chunk, whose chunks land there); a staged or acquired
unit holds its bytes until it is unstaged or released; entry units in their own memory hold their
placement's ``nbytes``. Staging slots are host memory and count nowhere here (`policies.tiers`
counts host bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import attrs

from torchferry.policies._ir import DEVICE, FILE, Op, Placement, Policy, Schedule, Step, StreamName
from torchferry.policies._tokens import format_bytes
from torchferry.topology import FrozenMap, Plan

__all__ = ["DEFAULT_COST", "CostModel", "SimReport", "Span", "simulate", "steady_schedule"]


def _fmap(value: Mapping[str, float]) -> FrozenMap[str, float]:
    return FrozenMap(tuple((str(k), float(v)) for k, v in value.items()))


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"CostModel.{attribute.name} must be > 0 (math.inf for free), got {value!r}")


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ValueError(f"CostModel.{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen(kw_only=True, cache_hash=True)
class CostModel:
    """How long things take: link bandwidths, compute per block, and a per-op launch overhead.

    - ``h2d_bytes_per_s``: host-to-device bandwidth of the copy stream (``math.inf``: free).
    - ``collective_bytes_per_s``: bytes per second one rank receives during an all-gather.
    - ``read_bytes_per_s``: bytes per second the io stream reads file-tier packs from the checkpoint
      (``math.inf``, the default: free, so a schedule without reads is timed as before); the figure
      of the method the runtime will use (buffered, or direct I/O for a checkpoint larger than the
      page cache keeps).
    - ``block_s`` / ``component_s``: default compute seconds of a block, and of a component's own
      (non-block) forward; ``compute_s`` overrides either per path.
    - ``flops`` (per path) or ``block_flops`` (any block) with ``device_flops_per_s``: compute time as
      FLOPs over the device's achieved FLOP/s, used where ``compute_s`` names no time.
    - ``launch_s``: seconds added to every compute and every transfer chunk.
    - ``host_op_s`` / ``host_block_s``: host seconds the runtime spends per op it issues and per
      block it hooks, on the compute stream (see the stream model); the resident baseline has none.
    - ``forwards_per_step``: DiT forwards one denoising step makes (2 for classifier-free guidance
      run as two forwards); a step's time is the forward's times this.
    - ``forwards_per_call``: DiT forwards in one pipeline call (denoising steps x guidance
      forwards); a per-call cost such as a model-level swap is spread over them when policies are
      compared per step.
    - ``source``: where the figures come from (``measured ...``, ``assumed: ...``), for reports; it
      takes no part in equality.
    """

    h2d_bytes_per_s: float = attrs.field(default=25e9, validator=_positive)
    collective_bytes_per_s: float = attrs.field(default=100e9, validator=_positive)
    read_bytes_per_s: float = attrs.field(default=math.inf, validator=_positive)
    block_s: float = attrs.field(default=0.01, validator=_non_negative)
    component_s: float = attrs.field(default=0.0, validator=_non_negative)
    compute_s: FrozenMap[str, float] = attrs.field(factory=FrozenMap, converter=_fmap)
    flops: FrozenMap[str, float] = attrs.field(factory=FrozenMap, converter=_fmap)
    block_flops: float | None = None
    device_flops_per_s: float | None = None
    launch_s: float = attrs.field(default=0.0, validator=_non_negative)
    forwards_per_call: int = attrs.field(default=50, validator=attrs.validators.ge(1))
    host_op_s: float = attrs.field(default=0.0, validator=_non_negative)
    host_block_s: float = attrs.field(default=0.0, validator=_non_negative)
    forwards_per_step: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    source: str = attrs.field(default="", eq=False)

    @classmethod
    def calibrated(
        cls,
        *,
        h2d_bytes_per_s: float,
        block_s: float | None = None,
        compute_s: Mapping[str, float] | None = None,
        component_s: float = 0.0,
        host_op_s: float = 0.0,
        host_block_s: float = 0.0,
        collective_bytes_per_s: float = 100e9,
        forwards_per_step: int = 1,
        steps: int = 50,
        source: str = "measured",
        read_bytes_per_s: float = math.inf,
    ) -> CostModel:
        """A cost model from measured figures: the pinned host-to-device bandwidth, compute seconds
        per block (``block_s`` for every block, ``compute_s`` per path; at least one), the
        non-block remainder's compute (``component_s``), the host cost per op and per block, and
        the forwards of a denoising step and of a call (``steps x forwards_per_step``), and the
        file tier's read rate (``read_bytes_per_s``, free unless given).
        """
        if block_s is None and not compute_s:
            raise ValueError(
                "CostModel.calibrated needs the measured compute: block_s (seconds per block) or "
                "compute_s (seconds per block path)"
            )
        return cls(
            h2d_bytes_per_s=h2d_bytes_per_s,
            collective_bytes_per_s=collective_bytes_per_s,
            read_bytes_per_s=read_bytes_per_s,
            block_s=block_s if block_s is not None else 0.0,
            component_s=component_s,
            compute_s=dict(compute_s or {}),
            host_op_s=host_op_s,
            host_block_s=host_block_s,
            forwards_per_step=forwards_per_step,
            forwards_per_call=max(1, steps * forwards_per_step),
            source=source,
        )

    def compute_seconds(self, path: str, *, block: bool) -> float:
        """Compute seconds of block (or component) ``path`` under this model, launch included."""
        if path in self.compute_s:
            return self.compute_s[path] + self.launch_s
        if self.device_flops_per_s:
            f = self.flops.get(path, self.block_flops if block else None)
            if f is not None:
                return f / self.device_flops_per_s + self.launch_s
        return (self.block_s if block else self.component_s) + self.launch_s

    def h2d_seconds(self, nbytes: float) -> float:
        return 0.0 if math.isinf(self.h2d_bytes_per_s) else nbytes / self.h2d_bytes_per_s

    def collective_seconds(self, nbytes: float) -> float:
        return 0.0 if math.isinf(self.collective_bytes_per_s) else nbytes / self.collective_bytes_per_s

    def read_seconds(self, nbytes: float) -> float:
        """Seconds the io stream takes to read ``nbytes`` of file-tier packs (launch not included)."""
        return 0.0 if math.isinf(self.read_bytes_per_s) else nbytes / self.read_bytes_per_s


#: The cost model behind every ``# sim:`` line: 25 GB/s host-to-device (practical pinned PCIe Gen4
#: x16), 100 GB/s all-gather receive, 10 ms per block, components' own compute free, no launch cost.
DEFAULT_COST = CostModel()


@attrs.frozen(kw_only=True, slots=True)
class Span:
    """One busy stretch of one stream, in seconds from the step's start: simulated or measured.

    `simulate` predicts them (`SimReport.timeline`) and `runtime.Tracer` measures them
    (`runtime.StepTrace`), so the two line up span for span. ``kind`` is the op kind that kept the
    stream busy (``load``, ``gather``, ``stage``, ``acquire``), ``compute`` for a block's or
    component's forward, ``read`` for a file-tier read on the io stream, ``stall`` for compute
    waiting on a transfer, or ``host`` for the
    runtime's host work (`CostModel.host_op_s`, `CostModel.host_block_s`). ``label`` names the unit
    (or the computing anchor); ``op`` is the index of the op in the schedule (``None`` for a
    compute); a simulated transfer in several chunks has one span per chunk and ``chunk`` numbers
    it from 0; ``nbytes`` is the bytes a measured copy moved (0 otherwise).
    """

    stream: StreamName
    kind: str
    label: str
    start_s: float
    end_s: float
    op: int | None = None
    chunk: int = 0
    nbytes: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@attrs.frozen(kw_only=True)
class SimReport:
    """What `simulate` predicts for one schedule.

    ``stall_s`` maps every computing anchor (blocks, and the component itself) to the seconds compute
    waited there for transfers; ``resident_makespan_s`` is the same forward with every weight already
    on the device, so ``overhead`` is the price of streaming.
    """

    peak_device_bytes: int
    makespan_s: float
    resident_makespan_s: float
    stall_s: FrozenMap[str, float]
    peak_op: int | None = None
    #: Every stream's busy stretches in replay order (see `Span`); not part of equality or repr.
    timeline: tuple[Span, ...] = attrs.field(default=(), eq=False, repr=False)

    @property
    def overhead(self) -> float:
        """``makespan / resident makespan - 1`` (0 when nothing computes)."""
        if self.resident_makespan_s <= 0:
            return 0.0 if self.makespan_s <= 0 else math.inf
        return self.makespan_s / self.resident_makespan_s - 1.0

    @property
    def total_stall_s(self) -> float:
        return sum(self.stall_s.values())

    def summary(self) -> str:
        """The ``# sim:`` line of the canonical text."""
        return (
            f"# sim: peak {format_bytes(self.peak_device_bytes, exact=False)}"
            f" · makespan {self.makespan_s:.4f} s · resident {self.resident_makespan_s:.4f} s"
            f" · overhead {self.overhead * 100:.2f}% · stall {self.total_stall_s:.4f} s"
        )


class _Replay:
    def __init__(self, schedule: Schedule, cost: CostModel) -> None:
        self.cost = cost
        self.component = schedule.step.component
        self.slot_size = {s.name: s.nbytes for s in schedule.slots}
        self.slot_kind = {s.name: s.kind for s in schedule.slots}
        # Why: the slot chunked gathers land their chunks in (``None``: the schedule has none).
        self.gather_slot = next((s.name for s in schedule.slots if s.kind == "gather"), None)
        self.copy = 0.0
        self.comm = 0.0
        self.compute = 0.0
        self.io = 0.0
        # staging slot -> when the read into it ends, and when the copy that drained it ends
        self.read_end: dict[str, float] = {}
        self.drained: dict[str, float] = {}
        self.resident = 0.0
        self.ready: dict[str, float] = {}
        self.slot_free: dict[str, float] = {}
        self.slot_of: dict[str, str] = {}
        self.shard_ends: dict[str, list[float]] = {}
        self.shard_bytes: dict[str, int] = {}
        self.stall: dict[str, float] = {}
        self.allocated: set[str] = set()
        self.held: dict[str, int] = {}
        self.current = 0
        for p in schedule.entry:
            self.ready[p.unit] = 0.0
            if p.where == DEVICE:
                self.held[p.unit] = p.nbytes
                self.current += p.nbytes
            elif self.slot_kind.get(p.where) != "staging":
                self.slot_of[p.unit] = p.where
                if p.where not in self.allocated:
                    self.allocated.add(p.where)
                    self.current += self.slot_size.get(p.where, p.nbytes)
        self.peak = self.current
        self.peak_op: int | None = None
        self.timeline: list[Span] = []

    def _busy(
        self,
        stream: StreamName,
        start: float,
        end: float,
        *,
        kind: str,
        label: str,
        op: int | None,
        chunk: int = 0,
    ) -> None:
        self.timeline.append(
            Span(stream=stream, start_s=start, end_s=end, kind=kind, label=label, op=op, chunk=chunk)
        )

    def _grow(self, nbytes: int, index: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            self.peak_op = index

    def _use_slot(self, slot: str, nbytes: int, index: int) -> None:
        if slot not in self.allocated and self.slot_kind.get(slot) != "staging":
            self.allocated.add(slot)
            self._grow(self.slot_size.get(slot, nbytes), index)

    def _host(self, seconds: float, label: str, op: int | None) -> None:
        """The host spends ``seconds`` in the runtime before the compute stream can go on."""
        if seconds > 0:
            self._busy("compute", self.compute, self.compute + seconds, kind="host", label=label, op=op)
            self.compute += seconds

    def computes(self, anchor: str) -> None:
        block = anchor != self.component
        if block:
            self._host(self.cost.host_block_s, anchor, None)
        d = self.cost.compute_seconds(anchor, block=block)
        self._busy("compute", self.compute, self.compute + d, kind="compute", label=anchor, op=None)
        self.compute += d
        self.resident += d
        self.stall.setdefault(anchor, 0.0)

    def op(self, index: int, op: Op) -> None:
        self._host(self.cost.host_op_s, op.unit, index)
        _REPLAYS[op.kind](self, index, op)

    def _wait(self, index: int, op: Op) -> None:
        start = max(self.compute, self.ready.get(op.unit, 0.0))
        key = op.anchor
        self.stall[key] = self.stall.get(key, 0.0) + (start - self.compute)
        if start > self.compute:
            self._busy("compute", self.compute, start, kind="stall", label=op.unit, op=index)
        self.compute = start

    def _evict(self, index: int, op: Op) -> None:
        slot = self.slot_of.pop(op.unit, None)
        if slot is not None:
            self.slot_free[slot] = self.compute

    def _acquire(self, index: int, op: Op) -> None:
        self.compute = self._whole(index, op, "compute", self.compute)

    def _drop(self, index: int, op: Op) -> None:
        """A release or unstage: the unit's own device bytes are given back."""
        self.current -= self.held.pop(op.unit, 0)

    def _stage(self, index: int, op: Op) -> None:
        self.copy = self._whole(index, op, "copy", max(self.copy, self._read_ready(op)))
        self._drain(op, self.copy)

    def _staged_from(self, op: Op) -> str | None:
        """The staging slot ``op`` copies from, or ``None`` when its bytes come from host memory."""
        return op.src if op.src is not None and self.slot_kind.get(op.src) == "staging" else None

    def _read_ready(self, op: Op) -> float:
        """When the read that ``op`` copies from has ended (0 when it reads host memory)."""
        src = self._staged_from(op)
        return self.read_end.get(src, 0.0) if src is not None else 0.0

    def _drain(self, op: Op, end: float) -> None:
        """``op``'s copy out of its staging slot ends at ``end``: the slot may be read into again."""
        src = self._staged_from(op)
        if src is not None:
            self.drained[src] = end

    def _move_seconds(self, op: Op, nbytes: float) -> float:
        """Seconds ``op`` moves ``nbytes`` on its stream: a read from the checkpoint when the reader
        fills the device's memory itself (`FILE`), else a host-to-device copy."""
        if op.src == FILE:
            return self.cost.read_seconds(nbytes)
        return self.cost.h2d_seconds(nbytes)

    def _read(self, index: int, op: Op) -> None:
        slot = op.slot or ""
        start = max(self.io, self.drained.get(slot, 0.0))
        end = start + self.cost.read_seconds(op.nbytes) + self.cost.launch_s
        self._busy("io", start, end, kind="read", label=op.unit, op=index)
        self.io = end
        self.read_end[slot] = end

    def _whole(self, index: int, op: Op, stream: StreamName, start: float) -> float:
        """A whole unit's host-to-device copy on ``stream`` from ``start`` (a stage or an acquire): the
        unit is ready and holds its bytes from its end, which is returned."""
        end = start + (self._move_seconds(op, op.nbytes) + self.cost.launch_s)
        self._busy(stream, start, end, kind=op.kind, label=op.unit, op=index)
        self.ready[op.unit] = end
        self.held[op.unit] = op.nbytes
        self._grow(op.nbytes, index)
        return end

    def _load(self, index: int, op: Op) -> None:
        slot = op.slot or ""
        self._use_slot(slot, op.nbytes, index)
        k = max(op.chunks, 1)
        t = max(self.copy, self.slot_free.get(slot, 0.0), self._read_ready(op))
        ends = []
        for chunk in range(k):
            begin = t
            t += self._move_seconds(op, op.nbytes / k) + self.cost.launch_s
            ends.append(t)
            self._busy("copy", begin, t, kind="load", label=op.unit, op=index, chunk=chunk)
        self.copy = t
        self.ready[op.unit] = t
        self._drain(op, t)
        if op.src == "shard" or self.slot_kind.get(slot) == "shard":
            self.shard_ends[op.unit] = ends
            self.shard_bytes[op.unit] = op.nbytes
        else:
            self.slot_of[op.unit] = slot

    def _gather(self, index: int, op: Op) -> None:
        slot = op.slot or ""
        self._use_slot(slot, op.nbytes, index)
        if op.chunks > 1 and self.gather_slot is not None:
            self._use_slot(self.gather_slot, 0, index)
        k = max(op.chunks, 1)
        ends = self.shard_ends.get(op.unit, [0.0])
        received = max(op.nbytes - self.shard_bytes.get(op.unit, 0), 0)
        t = max(self.comm, self.slot_free.get(slot, 0.0))
        for j in range(k):
            dep = ends[min(len(ends) - 1, ((j + 1) * len(ends) + k - 1) // k - 1)]
            begin = max(t, dep)
            t = begin + self.cost.collective_seconds(received / k) + self.cost.launch_s
            self._busy("comm", begin, t, kind="gather", label=op.unit, op=index, chunk=j)
        self.comm = t
        self.ready[op.unit] = t
        self.slot_of[op.unit] = slot
        if op.src is not None:
            self.slot_free[op.src] = t


#: One replay per op kind (the engine and `check` dispatch the same way: a table keyed by kind).
_REPLAYS: dict[str, Callable[[_Replay, int, Op], None]] = {
    "load": _Replay._load,
    "gather": _Replay._gather,
    "wait": _Replay._wait,
    "evict": _Replay._evict,
    "stage": _Replay._stage,
    "unstage": _Replay._drop,
    "acquire": _Replay._acquire,
    "release": _Replay._drop,
    "read": _Replay._read,
}


def simulate(schedule: Schedule, cost: CostModel = DEFAULT_COST) -> SimReport:
    """Replay ``schedule`` under ``cost``: peak device bytes, makespan, stall per anchor, baseline.

    Total over any schedule (it never raises); `check` is what says whether a schedule is valid.
    """
    r = _Replay(schedule, cost)
    group: tuple[str, str] | None = None
    for index, op in enumerate(schedule.ops):
        key = (op.when, op.anchor)
        if group is not None and key != group and group[0] == "before":
            r.computes(group[1])
        group = key
        r.op(index, op)
    if group is not None and group[0] == "before":
        r.computes(group[1])
    makespan = max(r.copy, r.comm, r.compute, r.io)
    return SimReport(
        peak_device_bytes=r.peak,
        makespan_s=makespan,
        resident_makespan_s=r.resident,
        stall_s=FrozenMap(tuple(r.stall.items())),
        peak_op=r.peak_op,
        timeline=tuple(r.timeline),
    )


def steady_schedule(
    policy: Policy, plan: Plan, component: str, entry: tuple[Placement, ...] = ()
) -> Schedule:
    """The steady-state schedule of ``component``: its second step, entered from the first's exit.

    The first step starts from ``entry`` (what an earlier component left on the device); every later
    step of a run starts where the one before it ended, which is what a denoising loop repeats.
    """
    first = policy(plan, Step(component=component, entry=entry))
    return policy(plan, Step(component=component, index=1, entry=first.exit))
