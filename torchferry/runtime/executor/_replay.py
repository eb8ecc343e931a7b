"""Replaying a steady step: the moves of a step that ran once, as a list of calls.

[Note: replay]
On a CPU session a streamed block's pack docks ([Note: docking] in
`torchferry.runtime.memory._pack`), so each op of a layerwise step over such packs comes down to one
call on the pack: a load copies its host bytes into its slot (`load_docked`), a wait docks it there
(`land`), an evict undocks it (`lift`). Everything else a handler does per op is bookkeeping whose
outcome is the same at every run of the same program from the same start: the checks that `check`
proved and the first run confirmed, the slot and the dock cache it looks up, and the engine's tables
(``placed``, ``transfers``, ``occupants``). So the first run of a program whose every op is such a
move (`plan_replay`) runs the handlers and records the tables at each point the hooks stopped
(``Mover._recording``); at its end `build_replay` turns it into a `Replay`: per stop, the calls to
the next stop, and the tables there. A later step of that program replays it when nothing it settled
has changed (`Replay.ready`: the slots hold the same memory, the packs it moves are at host memory
with nothing pending, no tracer, profiler or grad guard is watching), keeps the tables as the step
found them, and puts the recorded ones in place at its end, or at the stop where it must hand over
to the handlers (a hook reached out of order, grad switched on in a forward: ``Mover.unreplay``).
Each move is one C call on the pack's memory, mapped in C per stop (a load is the copy into the slot
from ``Pack.source``, a wait and an evict the exchange of the pack's storage with the slot's,
`SWAP`), so no signal lands inside a stop's moves, and the packs' own record of where they are
(``where``, ``docked``, ``arriving``) is left as the step found it: it is written where the replay
hands over (`Replay.settle`: what the moves up to that stop leave, a few packs at the end) and, when
a step fails mid-way, read back from the memory itself before the abort (`Replay.recover`: a pack
whose storage is not at its host memory is docked at its slot). A block's hook runs its own stop's moves
(``Mover.replaying``, the segments by the op each starts at; a component's hook goes through
``Mover.advance``, which does the same) and does not read its pack's record: the first run found it
ready there, and the replay made the same moves from the same start. Units the step finds in a
slot (loaded by the step before) keep their handlers, which read the tables the step began with, as
they would. A load for a later step
(the next step's first block, prefetched) copies nothing: on a CPU session a copy completes as it is
issued, so the wait, in that step, copies it (`Replay.later`, ``Mover.deferred``) from host bytes
any edit made meanwhile has reached, and neither the step's end nor the session guard reads its
tensors' version counters between steps (that read, of caches the forward left cold, was the largest
part of a step's end). When a program's slots are the same buffers grown again elsewhere (the
components of a pipeline share slots of different sizes, so each call frees and grows them), the
recorded tables still hold and only the views over the slots are made anew (`Replay.moved`): a
denoising loop replays every step but its first at every call. Slots that are other buffers need a
recording run again, made while the replays pay for it; a program recorded twice and never replayed
in between is left to the handlers (``Program.recorded``).
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from torchferry.policies import DEVICE, Schedule
from torchferry.runtime.memory import SWAP, Pack, PackState, Unit, land, lift, load_docked

if TYPE_CHECKING:
    from torchferry.runtime.device import DeviceBuffer, SlotPool

__all__ = [
    "GRAD_OFF",
    "INFERENCE_OFF",
    "Call",
    "Move",
    "Replay",
    "Segment",
    "Tables",
    "block_key",
    "build_replay",
    "call",
    "consume",
    "plan_replay",
    "restore",
]

#: The engine's tables at a stop: ``placed``, ``transfers``, ``occupants``.
Tables = tuple[dict[str, str], dict[str, "DeviceBuffer"], dict[str, Unit]]
#: One call of a replayed step: ``fn(a, b)`` (a handler with its unit and op, or a pack's move).
Call = tuple[Callable[[Any, Any], Any], Any, Any]
#: The calls from one stop to the next: (the next stop, functions, first arguments, second arguments,
#: the key of the block hook that stops there, ``"before <path>"``, interned, or ``None``: a block's
#: hook knows its stop by identity, `block_key`; whether every call is a move of memory alone, a copy
#: or an exchange, which makes no tensor and so runs in the caller's inference mode as it is).
Segment = tuple[int, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], str | None, bool]
#: ``fn(a, b)`` as a C function `map` can call (``operator.call`` from Python 3.11).
call: Callable[..., Any] = getattr(operator, "call", lambda fn, *args: fn(*args))
#: Inference mode off for the engine's own work ([Note: inference mode] in `_engine`), as torch's C
#: guard, with `GRAD_OFF` called first thing inside: leaving the guard gives back the caller's whole
#: autograd state, grad mode included. No Python frame, where ``torch.inference_mode(False)`` and
#: ``torch.no_grad()`` run eight between them (a block's hook pays it under inference mode).
INFERENCE_OFF: Callable[[bool], Any] = torch._C._InferenceMode
#: Grad mode off, one C call (inside `INFERENCE_OFF`, which turns it on).
GRAD_OFF: Callable[[], None] = functools.partial(torch._C._set_grad_enabled, False)
#: Runs an iterator to its end, in C (a segment's ``map(call, ...)``).
consume: Callable[[Any], None] = collections.deque[Any](maxlen=0).extend

_HOST = PackState.HOST
_IN_FLIGHT = PackState.IN_FLIGHT
_READY = PackState.READY
#: What `Replay.ready` reads of each pack it loads: the storage its moves exchange is among it.
_STATE = operator.attrgetter("where", "docked", "arriving", "rewatch", "bound", "watched")
_AGAIN = operator.attrgetter("rewatch", "bound")
#: The moves as C functions of two arguments: a load's copy into the slot, a dock's or undock's exchange.
_COPY: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.Tensor.copy_
#: One move of a replayed step, for `Replay.settle`: its op's index, its kind (`_LOAD`, `_WAIT`,
#: `_EVICT`, or `_LATER`: a load whose copy waits for its wait), the pack and the storage over its
#: bytes of the slot.
Move = tuple[int, int, Pack, torch.UntypedStorage]
_LOAD, _WAIT, _EVICT, _LATER = 0, 1, 2, 3
#: Where a replay leaves a pack: (pack, where, docked, arriving, whether its wait must copy it).
Left = tuple[Pack, PackState, Any, Any, bool]
#: A call of two arguments that does nothing (in C): a load whose copy waits for its wait.
_NOTHING: Callable[[Any, Any], Any] = operator.is_
#: The calls that only move memory (make no tensor): a segment of them alone runs under the caller's
#: inference mode, where the others turn it off first ([Note: inference mode] in `_engine`).
_PLAIN = frozenset({_COPY, SWAP, _NOTHING})


def plan_replay(schedule: Schedule, calls: tuple[tuple[Any, Unit, Any], ...]) -> tuple[bool, ...] | None:
    """Per op of ``schedule``, whether a replay runs it as a pack's move (else as its handler); ``None``
    when the step cannot be replayed: an op that is not a load, a wait or an evict, a load that is not
    of one pack that docks from host memory, a unit loaded again while a slot holds it, waited for
    twice, or evicted before its wait. The waits and evicts of units the step finds on the device run
    their handlers, which read only what those units left in the tables."""
    in_slot = {p.unit for p in schedule.entry if p.where != DEVICE}
    mine: set[str] = set()
    waited: set[str] = set()
    flags: list[bool] = []
    for _, unit, op in calls:
        packs = unit.packs
        name = op.unit
        if op.kind == "load":
            if op.src is not None or name in in_slot:
                return None
            if len(packs) != 1 or packs[0].bound is None:
                return None
            in_slot.add(name)
            mine.add(name)
            flags.append(True)
        elif op.kind == "wait":
            if name in waited:
                return None
            if name in mine:
                waited.add(name)
            flags.append(name in mine)
        elif op.kind == "evict":
            in_slot.discard(name)
            moved = name in mine
            if moved:
                if name not in waited:
                    return None
                mine.discard(name)
                waited.discard(name)
            flags.append(moved)
        else:
            return None
    return tuple(flags)


def restore(
    found: Tables, placed: dict[str, str], transfers: dict[str, DeviceBuffer], occupants: dict[str, Unit]
) -> None:
    """Put the recorded tables ``found`` in place, in the engine's own dicts (the grad guard holds
    ``placed``)."""
    placed.clear()
    placed.update(found[0])
    transfers.clear()
    transfers.update(found[1])
    occupants.clear()
    occupants.update(found[2])


def _columns(calls: list[Call]) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
    """``calls`` as three columns (functions, first arguments, second arguments), which
    `Replay.run` maps in C."""
    fns, firsts, seconds = zip(*calls, strict=True)  # in C
    return fns, firsts, seconds


def _load_watched(pack: Pack, at: tuple[torch.Tensor, torch.UntypedStorage]) -> None:
    """`load_docked` of a pack with buffers: they are watched while the copy is in flight (all of
    its tensors when the engine bumped their versions since), as `Mover._load` watches them."""
    load_docked(pack, at)
    if pack.rewatch:
        pack.rewatch = False
        pack.carry(range(len(pack.tensors)))
    else:
        pack.carry(pack.buffers)


def _land_watched(pack: Pack, at: tuple[torch.Tensor, torch.UntypedStorage]) -> None:
    """`land` of a pack with buffers, as `Mover._wait`: copied again if a watched tensor was written
    while its copy was in flight, and its buffers' versions remembered."""
    if pack.watched and pack.stale():
        at[0].copy_(pack.host)
    land(pack, at[1])
    pack.arrived()


def _lift_kept(pack: Pack, docked: torch.UntypedStorage) -> None:
    """`lift` of a pack with buffers, as `Mover._evict`: what a forward wrote to them is kept first."""
    pack.keep_written()
    lift(pack, docked)


@attrs.define(slots=True, eq=False, repr=False)
class Replay:
    """A program's steady step as calls: ``segments`` per stop (the next stop, the calls to it),
    ``tables`` the engine's tables at each stop, ``slots`` the slot memory the calls write (name,
    buffer, its tensor, its regrowth count), ``fresh`` the packs it loads (at host memory at the start),
    ``moves`` its moves in order and ``end`` the index past its last op."""

    segments: dict[int, Segment]
    tables: dict[int, Tables]
    slots: tuple[tuple[str, DeviceBuffer, torch.Tensor, int], ...]
    fresh: tuple[Pack, ...]
    moves: tuple[Move, ...]
    end: int
    #: The packs it loads after evicting them first (the step found them in a slot): their evict's
    #: handler leaves them at host memory; only a re-watch the engine asked for must not be pending.
    again: tuple[Pack, ...] = ()
    #: What `_STATE` reads of each of ``fresh`` at host memory with nothing pending (and ``again``'s
    #: `_AGAIN`): the storages its moves exchange are among it.
    rested: list[tuple[Any, ...]] = attrs.field(init=False)
    rested_again: list[tuple[Any, ...]] = attrs.field(init=False)
    #: The packs its whole run leaves other than at host memory (the next step's first block, loaded):
    #: what `settle` writes at the end.
    final: list[Left] = attrs.field(factory=list)
    #: The units it loads for a later step without copying them: their wait, in that step, copies
    #: (the session guard need not watch them between steps: `Mover.deferred`).
    later: frozenset[str] = frozenset()
    #: Steps that replayed it (a replay never used is not recorded again: see `Engine.begin`).
    used: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self.rested = [(_HOST, None, None, False, p.bound, {}) for p in self.fresh]
        self.rested_again = [(False, p.bound) for p in self.again]

    def __repr__(self) -> str:
        return f"Replay({len(self.segments)} stops, {len(self.fresh) + len(self.again)} packs moved)"

    def ready(self, pool: SlotPool) -> bool:
        """Whether a step can replay now: every slot holds the memory it did, and every pack it loads
        is at host memory with nothing pending (no copy in flight, no watch, no re-watch), over the
        storage its moves exchange."""
        held = pool.slots
        for name, buffer, data, grown in self.slots:
            entry = held.get(name)
            if entry is None or entry[1] is not buffer or buffer.data is not data or buffer.grown != grown:
                return False
        rested, again = self.rested, self.rested_again  # in C: the states (watches too) as one list
        return list(map(_STATE, self.fresh)) == rested and list(map(_AGAIN, self.again)) == again

    def moved(self, pool: SlotPool) -> bool:
        """Whether its slots are the same buffers and some hold other memory now (freed and grown
        again, as when another component used the slot between): the recorded tables still hold,
        and `build_replay` over them makes the views anew, with no recording run."""
        held = pool.slots
        same = all(held.get(name, (None, None))[1] is buffer for name, buffer, _, _ in self.slots)
        return same and not all(b.data is d and b.grown == g for _, b, d, g in self.slots)

    def settle(self, pc: int) -> None:
        """Write into the packs it moved where its moves up to op ``pc`` (a stop it reached) left them."""
        states = self.final if pc >= self.end else _walk(self.moves, pc)
        for pack, where, docked, arriving, later in states:
            pack.where, pack.docked, pack.arriving = where, docked, arriving
            if later:
                pack.recopy(0)  # its slot holds no copy of it yet: its wait copies it

    def recover(self) -> None:
        """A step failed mid-way (anywhere, a signal inside a stop's moves included): write into each
        pack it moved what its memory says, a pack whose storage is not at its host memory docked at
        its slot, before the abort reads them. A pack recorded ready (a handler's wait, its entry's
        dock) is exact already; the others' record says host memory."""
        for _, _, pack, storage in self.moves:
            if pack.where is not _HOST or pack.bound is None:
                continue
            at = pack.host.data_ptr()
            if pack.bound.data_ptr() != at and storage.data_ptr() == at:  # exchanged with this slot's
                pack.where, pack.docked, pack.arriving = _READY, storage, None


def _walk(moves: tuple[Move, ...], pc: int) -> list[Left]:
    """Where ``moves`` up to op ``pc`` leave each pack they moved."""
    found: dict[int, Left] = {}
    for index, kind, pack, storage in moves:
        if index >= pc:
            break
        if kind in (_LOAD, _LATER):
            found[id(pack)] = (pack, _IN_FLIGHT, None, storage, kind == _LATER)
        elif kind == _WAIT:
            found[id(pack)] = (pack, _READY, storage, None, False)
        else:
            found[id(pack)] = (pack, _HOST, None, None, False)
    return list(found.values())


def block_key(path: str) -> str:
    """The stop key of block ``path``'s hook, interned: a `Segment` names the block hook that stops at
    its end by this very object, so the hook compares identities, reading no dict."""
    return sys.intern(f"before {path}")


def build_replay(
    calls: tuple[tuple[Any, Unit, Any], ...],
    flags: tuple[bool, ...] | None,
    entry: Mapping[str, str],
    recording: dict[int, Tables],
    pool: SlotPool,
    *,
    ends: Mapping[int, str],
) -> Replay | None:
    """The `Replay` of a program (its ``calls``, `plan_replay`'s ``flags`` for them, its ``entry``
    residency, the block hooks its stops are, ``ends``) from a whole run's ``recording`` (the tables
    at each stop the hooks reached) over the slots of ``pool``, or ``None`` when that run did not
    stop at its end or a slot is gone."""
    if flags is None or len(calls) not in recording:
        return None
    storages: dict[str, torch.UntypedStorage] = {}
    docks: dict[str, torch.Tensor] = {}
    slots: dict[str, tuple[str, DeviceBuffer, torch.Tensor, int]] = {}
    fresh: dict[int, Pack] = {}
    again: dict[int, Pack] = {}
    made: list[Call] = []
    moves: list[Move] = []
    left: dict[str, Left] = {}  # where the whole run leaves them
    copies: dict[str, tuple[int, int]] = {}  # per unit, its load's place in ``made`` and ``moves``
    for index, ((handler, unit, op), moved) in enumerate(zip(calls, flags, strict=True)):
        if not moved:
            made.append((handler, unit, op))
            continue
        pack = unit.packs[0]
        bound = pack.bound
        if op.kind == "load":
            slot = op.slot
            held = None if slot is None else pool.slots.get(slot)
            source = pack.source
            if slot is None or held is None or source is None:
                return None
            buffer = held[1]
            dst, storage = pack.dock_at(slot, buffer)  # the views the run made, or new ones if it moved
            storages[op.unit] = storage
            docks[op.unit] = dst
            slots[slot] = (slot, buffer, buffer.data, buffer.grown)
            (again if op.unit in entry else fresh).setdefault(id(pack), pack)
            moves.append((index, _LOAD, pack, storage))
            left[op.unit] = (pack, _IN_FLIGHT, None, storage, False)
            if pack.buffers:
                made.append((_load_watched, pack, (dst, storage)))
            else:
                copies[op.unit] = (index, len(moves) - 1)
                made.append((_COPY, dst, source))  # ``bound``'s bytes: at host memory when a load runs
        elif op.kind == "wait":
            storage = storages[op.unit]
            moves.append((index, _WAIT, pack, storage))
            left[op.unit] = (pack, _READY, storage, None, False)
            if pack.buffers:
                made.append((_land_watched, pack, (docks[op.unit], storage)))
            else:
                made.append((SWAP, bound, storage))
        else:
            storage = storages[op.unit]
            moves.append((index, _EVICT, pack, storage))
            del left[op.unit]
            if pack.buffers:
                made.append((_lift_kept, pack, storage))
            else:
                made.append((SWAP, bound, storage))
    # A load for a later step (the next step's first block) copies nothing: on a CPU session the copy
    # completes as it is issued, so its wait, in that step, copies as early as any could run, from
    # host bytes any edit made meanwhile reached (no watch of its tensors between steps).
    later = frozenset(u for u, state in left.items() if state[1] is _IN_FLIGHT and u in copies)
    for u in later:
        index, at = copies[u]
        made[index] = (_NOTHING, None, None)
        moves[at] = (index, _LATER, *moves[at][2:])
        left[u] = (*left[u][:4], True)
    marks = sorted(recording)
    segments = {
        a: (b, *_columns(made[a:b]), ends.get(b), all(fn in _PLAIN for fn, _, _ in made[a:b]))
        for a, b in itertools.pairwise(marks)
    }
    return Replay(
        segments=segments,
        tables=recording,
        slots=tuple(slots.values()),
        fresh=tuple(fresh.values()),
        moves=tuple(moves),
        end=len(calls),
        again=tuple(again.values()),
        final=list(left.values()),
        later=later,
    )
