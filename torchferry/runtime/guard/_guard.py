"""The session's guard: one caller at a time, weight edits adopted, moves and copies refused.

A session owns the pipeline's weights from open to close: its host buffers are the truth and its
hooks re-point tensors at device slots. What a user may do to the pipeline meanwhile is checked
here, at the step boundaries the session already has (`SessionGuard.entering`, `left`), and on
the managed modules themselves, by the methods `torchferry.runtime.guard._overrides` sets on them. See
docs/contract.md.

[Note: the session contract]
1. Threads. A session serves one step at a time. A top-level component's forward that starts on
   one thread while another thread's step is running raises `ExecutionError` on the second thread
   (its call fails, nothing of the running step is touched). Steps of different threads that do not
   overlap are each exact; serialise whole pipeline calls with a lock of your own to keep each
   call's steps together.
2. Weight edits. An edit that keeps a tensor's object, shape, dtype and device (``load_state_dict``,
   ``p.mul_(2)``, ``p.copy_(...)``, ``p.data = other`` of the same shape and dtype) made between
   steps is adopted at the next step start (and at close): its values are written to the host copy,
   device copies are dropped, and every later step and the pipeline after ``close()`` hold the new
   values. The check compares with what the last step left the data pointer of each tensor the
   engine re-points (a ``.data =`` edit), the version counter of each tensor the device holds a copy
   of between steps (an in-place edit of a tensor at host memory needs nothing: the next load copies
   its new bytes), and, when any module registered a parameter, buffer or submodule since the last
   check (torch's global registration hooks count them), each tensor's module slots (another object
   there): one pass per step, about 0.1-0.15 us per tensor (1,097 tensors of a 40-block Wan
   transformer: 0.13-0.2 ms per step on a 2-core CPU box). A pack that docks (every host-memory pack
   of a CPU session, [Note: docking] in `torchferry.runtime.memory._pack`) is never re-pointed by a
   step, so a ``.data =`` edit of its tensor is not looked for at step starts: the tensor runs with
   what it was given, shares its memory and keeps it, as in a plain run; ``everything`` checks
   (close, the end of a write-through) compare each such tensor with its place in its pack's storage
   (`_docked_pointers`), adopt what the host copy can take and leave the rest as given
   (`HostStore.give_back` keeps them too). At a step's end nothing is read again but the tensors
   still on the device: a pack the engine re-pointed back to host memory points at its known host
   views. Anything else (a tensor of another shape, dtype or device, or another object in the
   module), and any edit of a tensor in the file tier (which has no host copy to take it), raises
   `ExecutionError` at the next step start, naming the tensor. A tensor written straight into a
   module's ``_parameters`` or ``_buffers`` dict (no ``setattr``, no ``register_*``, so no
   registration hook) is seen only at a step after some registration, and at close: replace weights
   through ``setattr`` or ``load_state_dict`` during a session.
   2b. A replacement made *during* a step (a forward's own ``self.inv_freq = ...``, as OmniGen's
   rotary embedding does on every call) is the model's state, as in a plain run: when a step that
   registered or assigned anything ends, its module slots are looked at, and a slot holding another
   object is followed (`SessionGuard._follow`): the module keeps that object where the forward made
   it, the tensor it replaced is no longer looked for there, and close moves the object to host.
3. Moves and conversions. ``module.to(...)``, ``.half()``, ``.cuda()``, ``.to("meta")`` and every
   other conversion through ``nn.Module._apply`` on the pipeline or a managed module raise
   `ExecutionError` before anything is converted; close the session first. A ``.to()``, ``.cpu()``,
   ``.float()``, ``.double()``, ``.half()`` or ``.bfloat16()`` that would change no tensor returns
   the module, as in plain torch (diffusers' ``from_pipe`` calls ``.to(dtype)``); arguments torch
   rejects (``.to(torch.int64)``, ``.half(x)``) raise its own error.
4. Saving and copying. ``state_dict()`` of a managed module returns standalone CPU tensors (own
   storage, contiguous, ties kept) that every saver accepts; ``keep_vars=True`` still returns the
   live objects. Pickling a managed module (``torch.save(pipe)``), ``copy.copy`` and ``copy.deepcopy``
   raise `ExecutionError`: the hooks and buffers belong to the session. After ``close()`` all work.
5. Edits that hide from the version counter. Fusing or merging a LoRA (diffusers' ``fuse_lora`` and
   ``unfuse_lora`` on a pipeline or model, peft's ``merge_adapter``/``unmerge_adapter`` and a
   ``LoraLayer``'s ``merge``/``unmerge``) writes ``weight.data`` in place, which bumps no version
   counter, so rule 2 cannot see it, and a block a device slot holds would take the edit in the slot
   only. These methods are wrapped while the session is open: between steps they first point every
   weight at its host copy (dropping device copies), so the edit lands in the host copy, and rule 2
   then adopts whatever they re-assigned. Called inside a step, or in a session with a file tier
   (whose weights have no host copy to take the edit), they raise `ExecutionError`. Other
   writes through ``.data`` of a tensor a slot holds are outside this contract: edit through the
   tensor itself (``p.mul_(2)``, ``p.copy_``), or close the session first.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchferry._errors import ExecutionError
from torchferry.runtime.device import same_device
from torchferry.runtime.guard._claims import REGISTRATIONS
from torchferry.runtime.guard._overrides import Overrides
from torchferry.runtime.guard._records import (
    Record,
    address_ranges,
    offsets_of,
    pointer,
    shard_of,
    under,
    under_any,
    write_back,
)
from torchferry.runtime.interop import Casting
from torchferry.runtime.memory import Pack, PackState, holders
from torchferry.topology import Plan, find_attr

if TYPE_CHECKING:
    from torchferry.runtime.executor import Engine

__all__ = ["SessionGuard"]

_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr
_MOVES = operator.attrgetter("moves")
_BUMPS = operator.attrgetter("bumps")
_WHERE = operator.attrgetter("where")
_HOST = operator.attrgetter("host")
_READY = PackState.READY


class SessionGuard:
    """Enforces the session contract (see [Note: the session contract]) for one engine."""

    def __init__(self, pipeline: Any, plan: Plan, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        # Why: the thread whose step is running now (``None`` between steps), so another is refused.
        self._owner: threading.Thread | None = None
        self._component = ""
        # Why: an edit the host copy cannot take is refused at every step start until close.
        self._refusal: str | None = None
        managed: dict[int, tuple[Pack, int]] = {}
        for pack in engine.store.packs.values():
            for i, t in enumerate(pack.tensors):
                managed[id(t)] = (pack, i)
        # Why: module tables hold a wrapper tensor, not the inner tensors its pack re-points (`_wrappers`).
        holder = holders([w.tensor for pack in engine.store.packs.values() for w in pack.wrappers])
        wrapped = {id(w) for w in holder.values()}
        places: dict[int, list[tuple[str, dict[str, Any], str]]] = {}
        # Every module whose conversions, copies and pickling are refused, with its path.
        modules: list[tuple[str, nn.Module]] = []
        seen: set[int] = set()
        roots: list[tuple[str, nn.Module]] = []
        on_demand = [c.path for c in plan.components if c.on_demand]
        # The blocks of an on-demand component stream like any (its lifecycle moves the rest).
        streamed = [b.path for top in plan.components if top.on_demand for c in top.walk() for b in c.blocks]
        if isinstance(pipeline, nn.Module):
            roots.append(("", pipeline))
        for top in plan.components:
            module = find_attr(pipeline, top.path)
            if not top.on_demand and isinstance(module, nn.Module):
                roots.append((top.path, module))
        roots.extend((path, find_attr(pipeline, path)) for path in streamed)
        lifecycle: set[int] = set()
        for prefix, root in roots:
            for path, module in root.named_modules(prefix=prefix):
                if id(module) in seen:
                    continue
                if under(path, on_demand):
                    if not under(path, streamed):
                        continue  # an on-demand component moves itself (load_to_device, offload_to_cpu)
                    lifecycle.add(id(module))
                seen.add(id(module))
                modules.append((path, module))
                for table in (module._parameters, module._buffers):
                    for key, t in table.items():
                        if t is not None and (id(t) in managed or id(t) in wrapped):
                            places.setdefault(id(t), []).append((f"{path}.{key}".lstrip("."), table, key))
        self._records: list[Record] = []
        # Packs that dock come last (a stable sort): their tensors' pointers are read only when the
        # session looks at everything (rule 2 of the Note), the others' at every step start.
        for pack in sorted(engine.store.packs.values(), key=lambda g: g.bound is not None):
            for i, t in enumerate(pack.tensors):
                held = holder.get(id(t), t)
                where = places.get(id(held), [])
                name = where[0][0] if where else f"{pack.name}[{i}]"
                self._records.append(
                    Record(name, t, pack, i, tuple((table, key) for _, table, key in where), held)
                )
        self._tensors = [r.tensor for r in self._records]
        # Why: each pack's records are one run of the lists, so a pack that moved is re-read alone.
        self._spans: dict[Pack, tuple[int, int]] = {}
        for i, r in enumerate(self._records):
            start, _ = self._spans.get(r.pack, (i, i))
            self._spans[r.pack] = (start, i + 1)
        # Why: the tensors the engine re-points (each step start reads them), offsets of those that dock.
        self._free = [r.tensor for r in self._records if r.pack.bound is None]
        self._free_packs = [pack for pack in self._spans if pack.bound is None]
        self._docks = self._tensors[len(self._free) :]
        self._docking = [(pack, offsets_of(pack)) for pack in self._spans if pack.bound is not None]
        slots = [(table, key, r.holder) for r in self._records for table, key in r.places]
        # Why: every module slot of a managed tensor as three parallel lists (C-level maps per step).
        self._place_tables = [table for table, _, _ in slots]
        self._place_keys = [key for _, key, _ in slots]
        self._place_tensors = [t for _, _, t in slots]
        # Why: what the last step left: every tensor's version, the pointer of each in `_free`.
        self._versions: list[int] = []
        self._pointers: list[int] = []
        # Why: the packs, with their ``moves`` and ``bumps`` as the last step left them (`_refresh`).
        self._packs = list(self._spans)
        self._moves: list[int] = []
        self._bumps: list[int] = []
        # Why: per pack, (its host buffer, its tensors' data pointers when they point at it).
        self._at_host: dict[Pack, tuple[torch.Tensor, list[int]]] = {}
        # Why: per pack, the host buffer whose pointers `_pointers` holds for it, set by `_refresh`
        # (so a pack back at host memory at every step's end is not written there again).
        self._hosted: dict[Pack, torch.Tensor] = {}
        # Why: the registration count when the module slots were last seen in place (see `_changed`).
        REGISTRATIONS.install()
        self._registered = -1
        # Why: the registration count when the running step began (``None`` between steps), so a
        # step whose forward registered or assigned something has its module slots looked at.
        self._began: int | None = None
        # Why: the module slots a forward gave an object of its own (`_follow`), moved to host at close.
        self._followed: list[tuple[dict[str, Any], str]] = []
        # Why: per residency (the units on the device between steps), their records' indices and tensors.
        self._resident: dict[Any, tuple[list[int], list[torch.Tensor]]] = {}
        # Why: what the session set on the objects it serves (rules 3-5), taken off at close.
        casting = Casting(pipeline, plan, [m for _, m in modules])  # layerwise casts (`_casting`)
        self._overrides = Overrides(engine.device, self.write_through, casting)
        self._overrides.install(modules, set(managed) | wrapped, frozenset(lifecycle))
        self._overrides.lifecycles(
            [find_attr(pipeline, c.path) for c in plan.components if c.on_demand and under_any(c, streamed)]
        )
        objects: list[tuple[str, object]] = [(p, m) for p, m in modules]
        if not isinstance(pipeline, nn.Module):
            objects.insert(0, ("", pipeline))
        self._overrides.wrap(objects)
        self.snapshot()

    # ------------------------------------------------------------------------------ threads
    def entering(self, component: str) -> None:
        """A top-level step of ``component`` starts on this thread: refuse it if another's runs."""
        me = threading.current_thread()
        with self._lock:
            owner, running = self._owner, self._component
            if owner is not None and owner is not me and owner.is_alive():
                raise ExecutionError(
                    f"a forward of {component!r} started on thread {me.name!r} while thread {owner.name!r} "
                    f"runs a step of {running!r} on this torchferry session; a session serves one step at "
                    "a time (its device slots hold one step's weights), so serialise calls on the pipeline "
                    "(one threading.Lock around each call) or give each thread a pipeline and session "
                    "of its own"
                )
            self._owner, self._component = me, component
        if self._began is not None:
            self._follow()  # the step before never ended (a KeyboardInterrupt): its forward's own
        self._began = REGISTRATIONS.count
        if self._refusal is not None:
            raise ExecutionError(self._refusal)

    def owns(self) -> bool:
        """Whether this thread's step is the running one (false for a step refused at its start)."""
        return self._owner is threading.current_thread()

    def left(self) -> None:
        """This thread's step is over (finished or aborted): record what it left, free the session."""
        if self._began is not None and self._began != REGISTRATIONS.count:
            self._follow()
        self._began = None
        self._refresh()
        with self._lock:
            self._owner = None

    def _follow(self) -> None:
        """Module slots the step's forward gave another object (``self.inv_freq = ...`` on each call,
        as OmniGen's rotary embedding does) hold the model's state from now on, as in a plain run: the
        session stops managing the tensor that was there (rule 2b of the Note)."""
        if self._in_place():
            return
        followed: dict[tuple[int, str], tuple[dict[str, Any], str]] = {}
        for r in self._records:
            held = [table.get(key) is r.holder for table, key in r.places]
            if not all(held):
                for (table, key), here in zip(r.places, held, strict=True):
                    if not here:
                        followed[id(table), key] = (table, key)  # once, for a wrapper's inner tensors
                r.places = tuple(place for place, here in zip(r.places, held, strict=True) if here)
        self._followed.extend(followed.values())
        slots = [(table, key, r.holder) for r in self._records for table, key in r.places]
        self._place_tables = [table for table, _, _ in slots]
        self._place_keys = [key for _, key, _ in slots]
        self._place_tensors = [t for _, _, t in slots]
        self._registered = REGISTRATIONS.count

    # ------------------------------------------------------------------------------------ ranks
    def drain(self) -> None:
        """The running step is about to end: issue the all-gathers it still owes the other ranks.

        See [Note: ranks out of step] in `torchferry.runtime.device._comm`; a no-op when the step ran every
        op, and on one rank. A collective that fails here is not raised (the step's own failure is
        what the caller sees; the peers time out).
        """
        engine = self.engine
        program, comm = engine.program, engine.comm
        if program is None or comm is None or program.pc >= len(program.calls):
            return
        owed = [
            (unit.name, shard_of(unit.packs[0]), op.chunks)
            for _, unit, op in program.calls[program.pc :]
            if op.kind == "gather"
        ]
        with contextlib.suppress(ExecutionError):
            comm.drain(owed)

    # ---------------------------------------------------------------------------- weight edits
    def restart(self) -> None:
        """Start clean between steps: pay what the last step owes the ranks, keep what was written in
        place into a device copy since the last step (a step that never ended, a KeyboardInterrupt
        say, left tensors pointing into slots), drop device copies, and remember the tensors as the
        abort leaves them (so the abort is not taken for an edit)."""
        self.drain()
        self.keep_device_writes()
        assigned = self._assigned()
        for r, _ in assigned:  # at host memory, as the engine leaves them, for the abort and snapshot
            r.tensor.data = (r.pack.rest_views or r.pack.host_views)[r.index]
        self.engine.abort()
        self.snapshot()
        for r, given in assigned:
            r.tensor.data = given  # an edit between steps again, which the step start's `adopt` takes

    def _assigned(self) -> list[tuple[Record, torch.Tensor]]:
        """The re-pointed tensors that point neither at their host copy nor into device memory the engine
        holds, each with what it points at: given by ``.data =`` after a step was cut short (a
        KeyboardInterrupt), which the abort would re-point, or the snapshot after it take for the
        engine's own, and so lose. Docked tensors are never re-pointed: they keep what they were given."""
        ranges = address_ranges(self.engine.buffers())
        found = []
        for pack in self._free_packs:
            start, end = self._spans[pack]
            for r, at, home in zip(
                self._records[start:end],
                map(_DATA_PTR, self._tensors[start:end]),
                self._host_pointers(pack),
                strict=True,
            ):
                if at != home and at and not any(low <= at < high for low, high in ranges):
                    found.append((r, r.tensor.data))
        return found

    def keep_device_writes(self) -> None:
        """Copy into the host copy every tensor that points at device memory and was written in
        place since the last step (a step ends abnormally: its device copies are about to go); a layer
        the step left cast up (diffusers' casting hook casts down only after a forward that returned,
        torchferry's own not after a KeyboardInterrupt) points at its own weights again first."""
        if (casting := self._overrides.casting) is not None:
            casting.undo()
        (engine := self.engine).unreplay()  # the packs' record, exact ([Note: replay])
        if engine.broken:
            return  # a failed collective may still write the slots: nothing in them is trusted
        versions = map(_VERSION, self._tensors)
        changed = [
            r
            for r, version, then in zip(self._records, versions, self._versions, strict=True)
            if version != then and r.pack.shard is None
        ]
        if not changed or not engine.synchronize():
            return  # a device that failed to synchronize holds nothing that can be read back
        for r in changed:
            if self._problem(r) is None:
                write_back(r)

    def snapshot(self) -> None:
        """Remember each managed tensor's version and data pointer as the engine leaves them now."""
        self._versions = list(map(_VERSION, self._tensors))
        self._pointers = list(map(_DATA_PTR, self._free))
        self._hosted.clear()
        self._moves = list(map(_MOVES, self._packs))
        self._bumps = list(map(_BUMPS, self._packs))

    def _in_place(self) -> bool:
        """Whether every managed tensor is still the object in each module slot it had."""
        found = map(dict.get, self._place_tables, self._place_keys)
        return all(map(operator.is_, found, self._place_tensors))

    def _refresh(self) -> None:
        """`snapshot`, for what the engine changed since: the pointers of packs it re-pointed (a pack
        back at host memory points at its host views, known without reading a tensor), the versions
        of packs whose counters it bumped."""
        packs = self._packs
        moves, bumps = list(map(_MOVES, packs)), list(map(_BUMPS, packs))
        if moves != self._moves or bumps != self._bumps:  # else nothing moved (docked blocks undock)
            self._refresh_packs(moves, bumps)
        self._keep_resident_writes()

    def _refresh_packs(self, moves: list[int], bumps: list[int]) -> None:
        """`_refresh` for the packs whose ``moves`` or ``bumps`` are not what was remembered."""
        tensors, hosted, spans = self._tensors, self._hosted, self._spans
        if bumps == self._bumps:
            # A steady step of re-pointed packs (CUDA's): each one it moved is back at the host buffer
            # whose pointers are remembered already. Found in C, with no Python loop over the packs.
            moved = list(itertools.compress(self._packs, map(operator.ne, moves, self._moves)))
            if _READY not in map(_WHERE, moved) and all(
                map(operator.is_, map(hosted.get, moved), map(_HOST, moved))
            ):
                self._moves = moves
                return
        for pack, move, bump, move_then, bump_then in zip(
            self._packs, moves, bumps, self._moves, self._bumps, strict=True
        ):
            start, end = spans[pack]
            if move != move_then and pack.bound is None:  # a pack that docks: see `_docked_pointers`
                if pack.where is not PackState.READY:  # at host memory (a copy in flight, or none)
                    if hosted.get(pack) is not pack.host:  # else they are remembered there already
                        self._pointers[start:end] = self._host_pointers(pack)
                        hosted[pack] = pack.host
                else:
                    self._pointers[start:end] = map(_DATA_PTR, tensors[start:end])
                    hosted.pop(pack, None)
            if bump != bump_then:
                self._versions[start:end] = map(_VERSION, tensors[start:end])
        self._moves, self._bumps = moves, bumps

    def _keep_resident_writes(self) -> None:
        """A step ended: what its forwards wrote in place into the device copies of the units the
        device keeps (a counter buffer of a staged component, say) goes to the host copy now, and is
        remembered, so the next step start does not take it for an edit (and restart everything); a
        write to a unit whose copy is in flight (a hook of the last block editing the next step's
        first) makes that unit's wait copy it again."""
        if self.engine.broken:
            return
        indices, tensors = self._on_device()
        then = self._versions
        now = list(map(_VERSION, tensors))
        if now == list(map(then.__getitem__, indices)):  # the usual case, in two C-level passes
            return
        written = [(i, v) for i, v in zip(indices, now, strict=True) if v != then[i]]
        records = self._records
        for i, version in written:
            r = records[i]
            if r.pack.shard is not None or self._problem(r) is not None:
                continue
            # A unit whose copy is in flight points at its host copy, which holds the write already:
            # its wait copies it again, rather than the next step start restarting everything.
            flying = r.pack.where is PackState.IN_FLIGHT
            if write_back(r) or flying:
                if flying:
                    r.pack.recopy(r.index)
                then[i] = version

    def _host_pointers(self, pack: Pack) -> list[int]:
        """The data pointers of ``pack``'s tensors when they point at its host views (cached per buffer)."""
        cached = self._at_host.get(pack)
        if cached is None or cached[0] is not pack.host:
            cached = (pack.host, [pointer(v) for v in self._host_views(pack)])
            self._at_host[pack] = cached
        return cached[1]

    def _host_views(self, pack: Pack) -> list[torch.Tensor]:
        """``pack.host_views`` in record order (a record per tensor, in the pack's order)."""
        start, end = self._spans[pack]
        return [pack.host_views[r.index] for r in self._records[start:end]]

    def _on_device(self) -> tuple[list[int], list[torch.Tensor]]:
        """The records (indices, tensors) whose version counters the per-step check reads: those of
        the units the device holds between steps, and those of packs this rank holds only a shard of
        (their tensors are placeholders between steps, so an in-place edit changes nothing but the
        counter, and must be refused)."""
        self.engine.unreplay()  # a step that never ended (a KeyboardInterrupt) left its tables behind
        key = (tuple(self.engine.placed), self.engine.deferred)  # a deferred unit's wait copies it
        found = self._resident.get(key)
        if found is None:
            units = self.engine.store.units
            packs = {pack for name in key[0] if name not in key[1] for pack in units[name].packs}
            # Sharded and file-tier packs: an in-place edit there can reach no host copy (refused).
            packs.update(pack for pack in self._spans if pack.shard is not None or pack.in_file)
            indices = [i for pack in packs for i in range(*self._spans.get(pack, (0, 0)))]
            found = (indices, [self._tensors[i] for i in indices])
            if len(self._resident) >= 64:
                self._resident.clear()
            self._resident[key] = found
        return found

    def _changed(self, *, everything: bool = False) -> list[Record]:
        # Why: one pass over flat lists; this runs at every step start (see the Note for its cost). A
        # version bump matters only where a device copy would go stale (a tensor at host memory was
        # written in place: the next load copies the new bytes), so only those records' versions are
        # read when nothing else changed.
        # The tensors of packs that dock are read only with ``everything`` (see rule 2 of the Note).
        indices, tensors = self._on_device()
        then = self._versions
        registered = REGISTRATIONS.count
        free = self._free
        if (
            list(map(_DATA_PTR, free)) == self._pointers
            and list(map(_VERSION, tensors)) == list(map(then.__getitem__, indices))
            and ((registered == self._registered and not everything) or self._in_place())
            and not (everything and list(map(_DATA_PTR, self._docks)) != self._docked_pointers())
        ):
            self._registered = registered
            return []
        pointers = list(map(_DATA_PTR, self._tensors))
        for pack in self._free_packs:  # a tensor at its own host view is no edit (a step end cut short)
            start, end = self._spans[pack]
            if pointers[start:end] == self._host_pointers(pack):
                self._pointers[start:end] = pointers[start:end]
        expected = self._pointers + (self._docked_pointers() if everything else pointers[len(free) :])
        versions = list(map(_VERSION, self._tensors))
        return [
            r
            for r, v, p, tv, tp in zip(self._records, versions, pointers, then, expected, strict=True)
            if v != tv or p != tp or any(table.get(key) is not r.holder for table, key in r.places)
        ]

    def _docked_pointers(self) -> list[int]:
        """Where each tensor of the packs that dock points while no edit moved it: inside its pack's
        storage, wherever that storage's memory is now (host memory, or a slot it is docked at)."""
        found: list[int] = []
        for pack, offsets in self._docking:
            if pack.bound is None:  # given back (close): its tensors own their memory now
                found.extend(map(pointer, pack.tensors))
            else:
                found.extend(0 if at is None else pack.bound.data_ptr() + at for at in offsets)
        return found

    def adopt(self, *, strict: bool = True) -> None:
        """Write edits made since the last step into the host copy and drop device copies.

        Edits the host copy cannot take (another object, shape, dtype or device) raise
        `ExecutionError` when ``strict``; otherwise (at close) they are left as they are, and every
        module slot is looked at, registrations or not.
        """
        changed = self._changed(everything=not strict)
        if not changed:
            return
        checked = [(r, self._problem(r)) for r in changed]
        problems = [p for _, p in checked if p is not None]
        if problems and strict:
            shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
            self._refusal = (
                f"{len(problems)} managed tensor(s) were changed during the torchferry session in a way its "
                f"host copy cannot take ({shown}); an edit during a session must keep each tensor's object, "
                "shape, dtype and device (load_state_dict, copy_, in-place ops); close() the session "
                "before replacing, moving or converting weights, then open a new one"
            )
            raise ExecutionError(self._refusal)
        with torch.no_grad():
            for r, problem in checked:
                # A docked pack's tensor goes back into its pack's storage even on the device: the
                # abort below undocks that storage to host memory, which holds the edit now.
                ready = r.pack.where is PackState.READY and r.pack.bound is None
                if problem is None and write_back(r) and not ready:
                    r.tensor.data = (r.pack.rest_views or r.pack.host_views)[r.index]
        self.engine.abort()
        self.snapshot()

    def _problem(self, r: Record) -> str | None:
        t = r.tensor
        if any(table.get(key) is not r.holder for table, key in r.places):
            return f"{r.name} is another tensor object now"
        piece = r.pack.pieces[r.index]
        if r.pack.in_file:
            return (
                f"{r.name} is in the file tier (read from the checkpoint at every use), so an edit of it "
                "cannot be kept; raise host_memory= so its block stays in host memory, or edit the weights "
                "before opening the session"
            )
        if r.pack.shard is not None:
            return f"{r.name} belongs to a block this rank holds only a shard of"
        if (
            tuple(t.shape) != piece.shape
            or t.dtype != piece.dtype
            or not (same_device(t.device, r.pack.host.device) or same_device(t.device, self.engine.device))
        ):
            return (
                f"{r.name} holds {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}, "
                f"the session {piece.shape} {str(piece.dtype).removeprefix('torch.')}"
            )
        return None

    # ------------------------------------------------------------------------------ write-through
    def write_through(self, method: Callable[..., Any], what: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` (a weight edit through ``.data``) with every weight at its host copy (rule 5)."""
        if self.engine.running:
            raise ExecutionError(
                f"{what}() was called inside a step of the torchferry session (from a forward); fuse or "
                "merge adapters between pipeline calls"
            )
        if self.engine.store.tier is not None:
            raise ExecutionError(
                f"{what}() writes weights through .data, and this session keeps packs in the file tier "
                "(read from the checkpoint at every use), where such a write cannot be kept nor seen; "
                f"call {what}() before opening the session, or raise host_memory= so nothing is in the "
                "file tier"
            )
        self.adopt()
        self.engine.abort()  # every weight now points at its host copy: the edit lands there
        self.snapshot()
        try:
            return method(*args, **kwargs)
        finally:
            self.adopt(strict=False)

    def close(self) -> None:
        """Adopt what can be adopted, then take every refusal and state_dict hook off the modules; a
        tensor a forward assigned that is on the session device comes back to host memory, as every
        weight does."""
        try:
            self.adopt(strict=False)
            with torch.no_grad():
                for table, key in self._followed:
                    value = table.get(key)
                    if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta"):
                        value.data = value.data.to("cpu")
        finally:
            self._followed.clear()
            self._overrides.remove()
            # The caches hold each pack's host buffer: a closed session keeps none of them alive.
            self._at_host.clear()
            self._hosted.clear()
            self._resident.clear()
