"""The schedule IR: steps, slots, placements, ops and schedules, all frozen data.

A schedule is the complete program for one forward of one component (a *step*): which units move
where, on which stream, keyed to which point of the forward. Ops run in listed order; each is anchored
``before`` or ``after`` a block or a component, and the runtime runs every op up to and including an
anchor's ops when execution reaches that anchor (so a block the model skips still has its ops run).

Units are named by path:
- a block: its path (``transformer.blocks.3``);
- a component's non-block remainder: ``<component>:rest``;
- a whole component: its path (``text_encoder``).

Op kinds (stream in brackets; `OP_STREAM` maps each kind to it):
- ``load`` [copy]: copy a unit's host bytes into ``slot`` (with ``src="shard"`` only this rank's shard
  of the block goes into a shard slot);
- ``gather`` [comm]: all-gather the shards held in slot ``src`` into the full block slot ``slot``,
  in ``chunks`` pieces;
- ``wait`` [compute]: compute waits until the unit's last load or gather is done;
- ``evict`` [compute]: the unit's tensors point back at host memory; its slot is reusable once compute
  has passed this point;
- ``stage`` / ``unstage`` [copy]: give a unit its own device memory and copy it there, or drop it (no
  device-to-host copy: host weights are never modified);
- ``acquire`` / ``release`` [compute]: call the component's own ``load_to_device`` / ``offload_to_cpu``;
- ``read`` [io]: read a unit's packs that are in the *file tier* (`Schedule.file`: not in host memory,
  read from the checkpoint) into staging slot ``slot``, a pinned host buffer (``src="shard"``: only
  this rank's shard of an all-gathered block). A ``load`` or ``stage`` of such a unit then names that
  slot as its ``src`` (``load U -> s1 from t0``; into a shard slot, ``load U -> h0 from t0``, the
  shard), which frees the slot for the next read. A unit of several packs (a whole component) is
  read and staged pack by pack through the slot. Where the device's memory is host memory (a CPU
  device, `reads_direct`) there is no staging slot and no ``read``: the ``load`` or ``stage`` names
  `FILE` as its ``src`` (``load U -> s1 from file``) and the reader fills the device slot itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Literal, Protocol

import attrs

from torchferry.policies._tokens import format_bytes, format_name, natural_key
from torchferry.topology import Plan

__all__ = [
    "DEVICE",
    "FILE",
    "OP_KINDS",
    "OP_STREAM",
    "Declared",
    "Op",
    "OpKind",
    "Placement",
    "Policy",
    "Schedule",
    "Slot",
    "SlotKind",
    "Step",
    "StreamName",
    "When",
    "declare",
    "gather_nbytes",
    "index_free",
    "is_index_free",
    "op_columns",
    "rest_unit",
]

When = Literal["before", "after"]
StreamName = Literal["copy", "comm", "compute", "io"]
OpKind = Literal["load", "gather", "wait", "evict", "stage", "unstage", "acquire", "release", "read"]
#: ``block`` and ``shard`` slots are device memory; ``staging`` slots are pinned host memory that
#: file-tier reads fill (`Schedule.file`); a ``gather`` slot is the device memory a chunked
#: all-gather lands each chunk of every rank in (`gather_nbytes`), one per schedule.
SlotKind = Literal["block", "shard", "staging", "gather"]

OP_KINDS: tuple[OpKind, ...] = (
    "load",
    "gather",
    "wait",
    "evict",
    "stage",
    "unstage",
    "acquire",
    "release",
    "read",
)
#: The stream each op kind runs on (see the list above).
OP_STREAM: Mapping[OpKind, StreamName] = MappingProxyType(
    {
        "load": "copy",
        "gather": "comm",
        "wait": "compute",
        "evict": "compute",
        "stage": "copy",
        "unstage": "copy",
        "acquire": "compute",
        "release": "compute",
        "read": "io",
    }
)

#: The placement of a unit that has device memory of its own (staged), rather than a shared slot.
DEVICE = "device"
#: The ``src`` of a load or stage the file tier's reader fills straight from the checkpoint, with no
#: staging slot between: the device's memory is host memory (`policies.reads_direct`).
FILE = "file"


def rest_unit(component_path: str) -> str:
    """The unit name of a component's non-block remainder."""
    return f"{component_path}:rest"


@attrs.frozen(kw_only=True, cache_hash=True)
class Placement:
    """A unit resident on the device: in shared slot ``where`` or in its own memory (``DEVICE``).

    ``nbytes`` is the device memory the unit occupies (informational: it takes no part in equality or
    hashing, so placements compare by unit and place alone); `simulate` uses it to count the bytes of
    units that were staged before the schedule starts.
    """

    unit: str
    where: str
    nbytes: int = attrs.field(default=0, eq=False)

    def __str__(self) -> str:
        return f"{self.unit}@{self.where}"

    @classmethod
    def parse(cls, text: str) -> Placement:
        unit, sep, where = text.rpartition("@")
        if not sep or not unit or not where:
            raise ValueError(f"placement {text!r} is not of the form unit@where")
        return cls(unit=unit, where=where)


def _placements(value: Iterable[Placement]) -> tuple[Placement, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True, cache_hash=True)
class Step:
    """What the pipeline is about to run: everything a policy may depend on besides the plan.

    ``component`` is the path of the component whose forward runs now, ``index`` counts its forwards,
    ``entry`` is the device residency the previous step left, and ``next`` is the component expected
    to run after this one (``None``: the same one again), so a policy can prefetch across a switch.
    """

    component: str
    index: int = 0
    entry: tuple[Placement, ...] = attrs.field(default=(), converter=_placements)
    next: str | None = None


@attrs.frozen(kw_only=True, cache_hash=True)
class Slot:
    """A fixed region of memory, allocated once and reused by many units: device memory (``block``,
    ``shard``), or a pinned host buffer file-tier reads fill (``staging``)."""

    name: str
    nbytes: int
    kind: SlotKind = "block"


@attrs.frozen(kw_only=True, cache_hash=True)
class Op:
    """One action of a schedule, anchored ``when`` (before/after) the block or component ``anchor``."""

    when: When
    anchor: str
    stream: StreamName
    kind: OpKind
    unit: str
    slot: str | None = None
    src: str | None = None
    nbytes: int = 0
    chunks: int = 1

    def __repr__(self) -> str:
        """The op's canonical text line (unaligned)."""
        return f"Op<{' '.join(c for c in op_columns(self) if c)}>"


def op_columns(op: Op) -> list[str]:
    """An op's columns in text order, its line in a schedule's text; a field at its default is empty."""
    slot = f"-> {format_name(op.slot)}" if op.slot is not None else ""
    src = f"from {format_name(op.src)}" if op.src is not None else ""
    chunks = f"chunks {op.chunks}" if op.chunks != 1 else ""
    size = format_bytes(op.nbytes) if op.nbytes else ""
    anchor, unit = format_name(op.anchor), format_name(op.unit)
    return [op.when, anchor, op.stream, op.kind, unit, slot, src, chunks, size]


def _ops(value: Iterable[Op]) -> tuple[Op, ...]:
    return tuple(value)


def _slots(value: Iterable[Slot]) -> tuple[Slot, ...]:
    return tuple(value)


def _notes(value: Iterable[object]) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def _file(value: Iterable[str]) -> tuple[str, ...]:
    """Pack names, once each, in natural order (``blocks.2`` before ``blocks.10``)."""
    return tuple(sorted({str(v) for v in value}, key=lambda name: (natural_key(name), name)))


@attrs.frozen(kw_only=True, cache_hash=True)
class Schedule:
    """The program for one step: slots, entry residency, ordered ops, exit residency, provenance.

    ``policy`` names the policy and its parameters (``layerwise(depth=2)``), ``plan`` is the plan's
    digest, and ``notes`` are free-text header lines a policy uses to explain its choice. ``file``
    names the packs (blocks, remainders ``<c>:rest``, ``<top>:extra``) in the file tier: they have
    no host copy and are read from the checkpoint into the ``staging`` slots (`policies.tiers`);
    empty (every pack in host memory) for a plan without a host budget.
    """

    policy: str
    plan: str
    step: Step
    slots: tuple[Slot, ...] = attrs.field(converter=_slots)
    entry: tuple[Placement, ...] = attrs.field(converter=_placements)
    ops: tuple[Op, ...] = attrs.field(converter=_ops)
    exit: tuple[Placement, ...] = attrs.field(converter=_placements)
    notes: tuple[str, ...] = attrs.field(default=(), converter=_notes)
    file: tuple[str, ...] = attrs.field(default=(), converter=_file)

    def slot(self, name: str) -> Slot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"schedule has no slot {name!r}; slots: {', '.join(s.name for s in self.slots)}")


class Policy(Protocol):
    """A pure function from a plan and a step to a schedule, identical on every rank.

    It must read nothing but its arguments, so schedules can be cached by ``(plan, step)``, hashed and
    compared across ranks. Build policies with factories (``layerwise(depth=2)``), not subclasses.
    """

    def __call__(self, plan: Plan, step: Step, /) -> Schedule: ...


@attrs.frozen(kw_only=True, eq=False)
class Declared:
    """A policy function with the properties a session reads from it (see `declare`).

    It is a `Policy` (calling it calls ``fn``); ``name`` is how reports and ``repr`` show it, and
    ``index_free`` says its schedules ignore ``Step.index``. Equal only to itself, like a function.
    """

    fn: Policy
    name: str
    index_free: bool = False

    def __call__(self, plan: Plan, step: Step, /) -> Schedule:
        return self.fn(plan, step)

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


def declare(fn: Policy, *, name: str | None = None, index_free: bool = False) -> Declared:
    """``fn`` with its declared properties attached: a ``name`` for reports (default: the function's
    name) and ``index_free``.

    ``index_free=True`` says ``fn``'s schedules depend on nothing in a `Step` but its component,
    entry and next. A session then builds one schedule for all forwards of a component that start
    from the same residency, instead of one per ``Step.index`` (a model called in a loop would
    otherwise build and compile a new schedule every forward); such a schedule's header shows index
    0. Every built-in policy is index-free; a user policy that reads ``step.index`` must not say so.
    A plain function is a `Policy` too: undeclared, it is not index-free.
    """
    if isinstance(fn, Declared):
        fn = fn.fn
    label = name if name is not None else getattr(fn, "__name__", type(fn).__name__)
    return Declared(fn=fn, name=label, index_free=index_free)


def index_free(policy: Policy) -> Policy:
    """``declare(policy, index_free=True)``, keeping a declared name (kept for existing callers)."""
    name = policy.name if isinstance(policy, Declared) else None
    return declare(policy, name=name, index_free=True)


def is_index_free(policy: Policy) -> bool:
    """Whether ``policy`` was declared index-free (`declare`)."""
    return isinstance(policy, Declared) and policy.index_free


def gather_nbytes(shard: int, chunks: int, world: int) -> int:
    """Device bytes a gather of ``shard``-byte shards in ``chunks`` chunks lands one chunk of every rank
    in, its ``gather`` slot: ``world x ceil(shard / chunks)``; 0 for a gather in one piece, which
    lands in its block slot directly."""
    return world * -(-shard // chunks) if chunks > 1 and shard else 0
