"""The engine's hooks: a forward pre hook at every anchor, post hooks where ops need one, the grad guard.

A schedule's ops are keyed to anchors (``before``/``after`` a block or component). Each anchor's
hooks are built once, when it is anchored, with everything that does not change between calls
bound in (its stop keys, its pack, whether it is a block or a top-level component), so a steady
call does one dictionary lookup, one comparison and, when ops are due, one run of the program. In a
replayed step ([Note: replay] in `_replay`) a block's hook runs its stop's moves itself, mapped in C
(`Runner.replaying`), with no Python call of the engine between.

- A *block* has a pre hook only, run from the block's forward ([Note: block forwards]): it runs
  every pending op up to its ``before`` stop (which includes
  the ``after`` ops of the block before it: ops run in schedule order whatever anchor reaches them)
  and checks that the block is resident. Ops keyed after the last block run when the component's
  post hook is reached, or at the next anchor.
- A *component* has a pre hook and a post hook; the post hook runs the ops keyed after it.
- A *top-level* component also tells the `Driver` (the session) that its forward starts and ends,
  which starts and finishes a step. Failure is decided from the forward itself: the post hook runs
  only when the forward returned (it marks the call done), and a third hook, registered with
  ``always_call=True`` after it, abandons the step when the call was not done. So a pipeline called
  inside an ``except`` block runs normally (nothing reads `sys.exc_info`).

The hooks are opaque to `torch.compile` (see `torchferry.runtime.executor._compile`): Dynamo traces
none of the engine's code, so a compiled block stays one graph, the hooks run eagerly around it,
and nothing recompiles per block; an eager call pays one flag read for it (`torch.compiler.disable`'s
own wrapper, which switches Dynamo's frame callback off and on at every call, is kept for the first
compiled call).

[Note: block forwards]
A forward pre hook puts every call of its module on the slow path of `torch.nn.Module.__call__` (a
closure, the hook tables walked, the compile state asked: about a hundred bytecodes in four Python
frames), which after a block's compute has left the caches cold costs more than all of torchferry's
work at that block: an empty pre hook on each block of a 40-block Wan model costs 8.6-12.2 us a
block against none (median of 100 forwards paired on one model, a 2-core EPYC guest), a `forward`
set on the instance that calls the module's own 0.2 us (`benchmarks/README.md`). So a block's hook
runs from the block's forward: the block's ``forward`` becomes a function that runs the hook, then
the forward it replaced (an instance forward another library set before, or the class's, looked up
at each call so a patch of the class counts). The hook keeps its place, before the block computes
and after every pre hook, of which a wrapped block has none: a block with a pre hook when it is
anchored keeps torchferry's as a pre hook, first; and the first pre hook registered on a wrapped
block later (its table of pre hooks notices the insertion, `_Noticing`) turns torchferry's back into
a pre hook, first, before the new one lands, so the newcomer sees the weights the block runs with,
as before. Code that sets a block's ``forward`` itself during a session (a library putting back a
forward it kept from before, as diffusers' hook registry does when a cache is disabled) would leave
the block unmanaged, so every step start checks, in one C-level pass, that each wrapped block's
forward is still ours (`Hooks.check`), and one that is not runs torchferry's as a pre hook from
then on. Under `torch.compile` Dynamo traces the wrapper, breaks the graph at the hook (opaque, see
`_compile`), and compiles the block's own forward. At close the block gets its forward back (one set
over ours since is left), ours passes through wherever it is still called from, and the block's
plain table of pre hooks is back when nothing was registered in it (a table that stays pickles and
copies as a plain `OrderedDict`).

[Note: gradients]
torchferry serves inference; gradients through streamed weights are not supported, and they fail
loudly rather than come out wrong. A block in a ring slot shares that slot with the blocks after it,
and autograd keeps what a forward with grad saved (the weights, and views such as ``weight.t()``)
pointing into the slot; re-pointing a tensor (``tensor.data = ...``) bumps no version counter, so
a backward would read whichever block the slot holds by then. So a block that runs with grad
enabled (its pre hook sees `torch.is_grad_enabled`) while its unit sits in a slot is remembered
(``graded``), and when that unit leaves the slot (evict, or `abort`) every tensor of it has its
version counter bumped, frozen ones (``requires_grad=False``) included: autograd also saves the
frozen weights a forward multiplied by when the gradient flows to the input or to other trainable
tensors, so a later backward through that forward raises autograd's "modified by an inplace
operation" error whatever requires grad. The first such block of a session warns
(`OffloadWarning`). A component whose own remainder sits in a slot (a custom policy may stream one)
is checked the same way around its forward. Staged units (``device`` placements, and every unit of
the none and model_level strategies) keep device memory of their own that nothing else overwrites:
unstaging only drops the engine's reference, what autograd saved stays valid, and their gradients
are right. Under ``torch.no_grad()`` or inference mode this costs one grad-mode check per block.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from torchferry._errors import ExecutionError, OffloadWarning
from torchferry.policies import DEVICE, rest_unit
from torchferry.runtime.executor._compile import COMPILE, Hook, compiled_call, marked, opaque
from torchferry.runtime.executor._program import Program, listing
from torchferry.runtime.executor._replay import GRAD_OFF, INFERENCE_OFF, Segment, block_key, call, consume
from torchferry.runtime.executor._step_cache import step_name
from torchferry.runtime.memory import Pack, PackState, Unit
from torchferry.topology import Plan, find_attr, order_mismatch

if TYPE_CHECKING:
    from torchferry.runtime.executor._trace import Tracer

__all__ = ["Driver", "GradGuard", "Hooks", "Runner"]

_READY = PackState.READY
_grad_enabled = torch.is_grad_enabled
_inference = torch.is_inference_mode_enabled
_FORWARD = itertools.repeat("forward")


class Driver(Protocol):
    """What the engine tells about top-level component forwards (the session picks steps from it)."""

    def enter(self, component: str) -> None:
        """A top-level component's forward begins."""

    def leave(self, component: str, failing: bool) -> None:
        """A top-level component's forward ended (``failing``: it raised)."""


class Runner(Protocol):
    """What the hooks need of the engine that installs them: the step running now, and its ops run.

    `Engine` is the one runner; the hooks read nothing else of it, so they sit below it.
    """

    @property
    def program(self) -> Program | None:
        """The program of the step running now (``None`` between steps)."""

    @property
    def tracer(self) -> Tracer | None:
        """The tracer of the step running now, when it is traced."""

    @property
    def replaying(self) -> dict[int, Segment] | None:
        """The segments of the replay the running step follows, by the op each starts at (``None``:
        not replayed): a block's hook runs its stop's moves itself ([Note: replay] in `_replay`)."""

    def abort(self) -> None:
        """Drop every device copy and point all weights at host memory (a replayed stop failed)."""

    def advance(self, program: Program, stop: int) -> bool:
        """Run ``program``'s ops up to op ``stop``; whether a replay ran them (the packs it moved
        keep the record the step found: a block's own is read only when a handler ran)."""

    def unreplay(self) -> None:
        """Stop replaying the running step: the tables the grad guard reads are exact from here on."""


class GradGuard:
    """Remembers units that ran with grad in a shared slot, and spoils them when they leave it.

    See [Note: gradients].
    """

    def __init__(self, placed: Mapping[str, str], units: Mapping[str, Unit]) -> None:
        # Why: the engine's own tables (unit -> where it is on the device; unit name -> unit), read live.
        self._placed, self._units = placed, units
        # Why: units that sat in a slot while a forward with grad ran them; bumped when they leave it.
        self.graded: set[Unit] = set()
        self._warned = False

    def ran(self, path: str, block: bool) -> None:
        """A forward with grad runs at ``path``: remember its units in slots."""
        placed, units = self._placed, self._units
        names = (path,) if block else (path, rest_unit(path))
        for name in names:
            where = placed.get(name)
            if where is None or where == DEVICE or units[name] in self.graded:
                continue
            self.graded.add(units[name])
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"torchferry: {name} ran with gradients enabled while its weights stream through a "
                    f"shared device slot ({where}); gradients through streamed weights are not supported, "
                    "and a backward through this forward will raise (the slot is reused for the blocks "
                    "that follow). Run the pipeline under torch.no_grad() or torch.inference_mode(), or "
                    "use strategy='none' or 'model_level' if you need gradients",
                    OffloadWarning,
                    stacklevel=3,
                )

    def leaving(self, unit: Unit) -> None:
        """``unit`` leaves its slot: make what autograd saved of it unusable (frozen tensors too)."""
        if unit not in self.graded:
            return
        self.graded.discard(unit)
        tensors = [t for pack in unit.packs for t in pack.tensors if not t.is_inference()]
        for pack in unit.packs:
            pack.bumps += 1  # the versions moved: the session guard must look at this pack again
            pack.rewatch = True  # and its next load watches every tensor (see `Pack.rewatch`)
        if tensors:
            torch.autograd.graph.increment_version(tensors)

    def leaving_all(self) -> None:
        """Every unit leaves its slot (the engine aborts)."""
        for unit in list(self.graded):
            self.leaving(unit)


def _ordinary_call(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` with inference mode off (and grad off with it) when the caller runs under it:
    the driver starts and ends steps, which make and re-point tensors ([Note: inference mode] in
    `_engine`)."""
    if _inference():
        with INFERENCE_OFF(False):
            GRAD_OFF()
            fn(*args)
    else:
        fn(*args)


def _passing(module: torch.nn.Module, args: Any) -> None:
    """What a block's forward runs before its own once the session is gone (see `Hooks._unwrap`)."""


class _Noticing(collections.OrderedDict[int, Any]):
    """A wrapped block's table of forward pre hooks: the first hook inserted calls ``notify`` first
    (once), which makes torchferry's a pre hook ahead of it ([Note: block forwards]). It pickles and
    copies as a plain `OrderedDict` (it may stay on a block after close: a handle can hold it)."""

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.notify = notify

    def __setitem__(self, key: int, value: Any) -> None:
        notify, self.notify = self.notify, None
        if notify is not None:
            notify()
        super().__setitem__(key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return collections.OrderedDict, (list(self.items()),)


class Hooks:
    """The forward hooks one engine installs on its pipeline, built once per anchored path.

    ``engine`` runs the ops the hooks reach; ``pipeline``, ``plan``, ``units`` (the host store's) and
    ``guard`` are the engine's, fixed for its life.
    """

    def __init__(
        self,
        engine: Runner,
        driver: Driver | None,
        *,
        pipeline: Any,
        plan: Plan,
        units: Mapping[str, Unit],
        guard: GradGuard,
    ) -> None:
        self.engine = engine
        self.driver = driver
        self._pipeline, self._plan, self._units, self._guard = pipeline, plan, units, guard
        self._handles: dict[str, tuple[RemovableHandle, ...]] = {}
        # Why: each anchor's module and hook bodies (pre, post, failed), so `forward` can fire them.
        self._calls: dict[str, tuple[torch.nn.Module, Hook, Hook | None, Hook | None]] = {}
        self._tops = frozenset(c.path for c in plan.components)
        self._blocks = frozenset(b.path for top in plan.components for c in top.walk() for b in c.blocks)
        # Why: per top-level path, whether its latest forward returned (its post hook ran), so the
        # always-called hook knows a failure from the forward itself.
        self._done: dict[str, bool] = {}
        # Why: per block run from its own forward, (the block, that forward, the instance forward it
        # replaced or ``None``, the box holding what it runs first, the block's pre-hook table).
        self._wrapped: dict[str, tuple[torch.nn.Module, Hook, Any, list[Hook], _Noticing]] = {}
        # Why: the wrapped blocks' instance dicts and our forwards in them, for `check`'s C-level pass.
        self._forward_dicts: list[dict[str, Any]] = []
        self._forwards: list[Hook] = []
        # Why: the blocks the running step's forward reached, in order, to report a ring it does not
        # follow; the engine clears it when a step begins.
        self.ran: list[str] = []

    @property
    def count(self) -> int:
        """Forward hooks installed on the pipeline."""
        return sum(len(h) for h in self._handles.values())

    def anchor(self, paths: Iterable[str]) -> None:
        """Install the hooks of each block or component path (once per path)."""
        for path in paths:
            if path in self._handles:
                continue
            try:
                module = find_attr(self._pipeline, path)
            except AttributeError:
                raise ExecutionError(
                    f"schedule anchor {path!r} is not a module of this pipeline; the plan and the pipeline "
                    "disagree (discover the topology of this pipeline again)"
                ) from None
            if not isinstance(module, torch.nn.Module):
                raise ExecutionError(
                    f"schedule anchor {path!r} is a {type(module).__name__}, not a torch module"
                )
            top = path in self._tops
            unit = self._units.get(path)
            pack = unit.packs[0] if unit is not None and len(unit.packs) == 1 and not top else None
            handles: list[RemovableHandle] = []
            post: Callable[..., None] | None = None
            failed: Callable[..., None] | None = None
            # Pre hooks go first (``prepend``): a user's pre hook, registered before the session opened
            # or after, then sees the weights the module runs with (its wait has run), not its host copy
            # while a copy is still in flight.
            if path in self._blocks and not top:
                pre = marked(self._block_hook(path, pack))  # opaque itself (`compiled_call`)
                table = module._forward_pre_hooks
                if type(table) in (collections.OrderedDict, _Noticing) and not table:
                    self._wrap(path, module, pre)  # [Note: block forwards]
                else:
                    handles.append(module.register_forward_pre_hook(pre, prepend=True))
                    handles.extend(self._graded_hook(path, module))
            else:
                pre, post = self._component_hooks(path, top)
                handles.append(module.register_forward_pre_hook(opaque(pre), prepend=True))
                handles.append(module.register_forward_hook(opaque(post)))
                if top:
                    failed = self._failed_hook(path)
                    handles.append(module.register_forward_hook(opaque(failed), always_call=True))
            self._handles[path] = tuple(handles)
            self._calls[path] = (module, pre, post, failed)

    @contextlib.contextmanager
    def forward(self, path: str) -> Iterator[None]:
        """Treat the body as a forward of the anchored module at ``path``: its hooks fire around it."""
        module, pre, post, failed = self._calls[path]
        try:
            pre(module, ())
            yield
        except BaseException:
            if failed is not None:
                failed(module, (), None)
            raise
        if post is not None:
            post(module, (), None)

    def remove(self) -> None:
        """Remove every hook from the pipeline, and give each wrapped block its forward back."""
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()
        for path in list(self._wrapped):
            module, noticing = self._unwrap(path)
            if not noticing and module._forward_pre_hooks is noticing:  # (else a handle may hold it)
                module._forward_pre_hooks = collections.OrderedDict()
        self._calls.clear()

    def check(self) -> None:
        """At a step's start: a wrapped block whose ``forward`` is no longer ours runs torchferry's hook
        as a pre hook from now on ([Note: block forwards]); one C-level pass while all are ours."""
        if not all(map(operator.is_, map(dict.get, self._forward_dicts, _FORWARD), self._forwards)):
            for path, (module, forward, *_) in list(self._wrapped.items()):
                if vars(module).get("forward") is not forward:
                    self._to_hook(path)

    def _wrap(self, path: str, module: torch.nn.Module, pre: Hook) -> None:
        """Run ``pre`` from ``module``'s forward, not as a forward pre hook ([Note: block forwards])."""
        own = vars(module).get("forward")  # an instance forward set before (another library's wrapper)
        box = [pre]
        if own is None:

            def forward(*args: Any, **kwargs: Any) -> Any:
                box[0](module, args)
                # The class's, looked up at each call: a patch of it counts.
                return type(module).forward(module, *args, **kwargs)

        else:

            def forward(*args: Any, **kwargs: Any) -> Any:
                box[0](module, args)
                return own(*args, **kwargs)

        table = module._forward_pre_hooks
        noticing = table if isinstance(table, _Noticing) else _Noticing()  # (an earlier session's: kept)
        noticing.notify = lambda: self._to_hook(path)
        module._forward_pre_hooks = noticing  # empty: no handle holds the table it replaces
        module.forward = forward
        self._wrapped[path] = (module, forward, own, box, noticing)
        self._forward_dicts = [vars(w[0]) for w in self._wrapped.values()]
        self._forwards = [w[1] for w in self._wrapped.values()]

    def _unwrap(self, path: str) -> tuple[torch.nn.Module, _Noticing]:
        """Give ``path``'s block its forward back (one set over ours since is left), and make ours
        pass through wherever it is still called from; the block and its table of pre hooks."""
        module, forward, own, box, noticing = self._wrapped.pop(path)
        self._forward_dicts = [vars(w[0]) for w in self._wrapped.values()]
        self._forwards = [w[1] for w in self._wrapped.values()]
        noticing.notify = None
        box[0] = _passing
        if vars(module).get("forward") is forward:
            if own is None:
                del module.forward
            else:
                module.forward = own
        return module, noticing

    def _to_hook(self, path: str) -> None:
        """Run torchferry's hook of ``path``'s wrapped block as a pre hook, first, from now on (a pre hook
        is being registered on it, or its forward is no longer ours: `check`)."""
        module = self._unwrap(path)[0]
        self._handles[path] = (
            module.register_forward_pre_hook(self._calls[path][1], prepend=True),
            *self._graded_hook(path, module),
        )

    def _graded_hook(self, path: str, module: torch.nn.Module) -> tuple[RemovableHandle, ...]:
        """A forward hook, first when set, on block ``path`` whose hook runs as a pre hook: a pre hook
        of the user's runs after torchferry's, and may switch grad on for the block's forward (and its
        own forward hook off again), which torchferry's saw off; the block's end sees it on, and its
        units are remembered as run with grad, so leaving the slot spoils what autograd saved of them
        ([Note: gradients]). None for a block whose packs all dock: what autograd saved follows them
        back to host memory. A block run from its forward has no pre hook to switch grad on."""
        unit = self._units.get(path)
        if unit is not None and all(pack.bound is not None for pack in unit.packs):
            return ()
        engine, guard = self.engine, self._guard

        def ended(module: torch.nn.Module, args: Any, output: Any) -> None:
            if _grad_enabled():
                engine.unreplay()
                guard.ran(path, True)

        return (module.register_forward_hook(opaque(ended), prepend=True),)

    def _block_hook(self, path: str, pack: Pack | None) -> Callable[..., None]:
        key = block_key(path)
        engine, plan, guard, ran = self.engine, self._plan, self._guard, self.ran

        def pre(module: torch.nn.Module, args: Any, eager: bool = False) -> None:
            if COMPILE._is_compiling_flag and not eager:  # `torch.compiler.is_compiling()`, read
                compiled_call(pre, module, args)  # (which calls back with ``eager``)
                return
            program = engine.program
            if program is None:
                if pack is not None and pack.where is not _READY:
                    raise called_outside(plan, path, pack.where.value)
            elif (segments := engine.replaying) is not None and (
                (segment := segments.get(program.pc)) is not None and segment[4] is key  # (`block_key`)
            ):
                # The hot path of a steady step: the replay's moves up to this block, mapped in C, and
                # the block where its first run had it ([Note: replay]; no tracer runs in a replay).
                ran.append(path)
                try:
                    if segment[5] or not _inference():  # (moves of memory alone: in any mode)
                        consume(map(call, segment[1], segment[2], segment[3]))
                    else:
                        with INFERENCE_OFF(False):
                            GRAD_OFF()
                            consume(map(call, segment[1], segment[2], segment[3]))
                    program.pc = segment[0]
                except BaseException:
                    engine.abort()  # the packs' record read from their memory (`Replay.recover`)
                    raise
            else:
                ran.append(path)
                tracer = engine.tracer
                if tracer is not None:
                    tracer.block_end()
                stop = program.stops.get(key, 0)
                if stop > program.pc:
                    # A replay brought the block where its first run had it, ready ([Note: replay]).
                    if not engine.advance(program, stop) and pack is not None and pack.where is not _READY:
                        self._not_resident(path, pack, program)
                elif pack is not None:
                    engine.unreplay()  # the packs' record, exact from here on
                    if pack.where is not _READY:
                        self._not_resident(path, pack, program)
                if tracer is not None:
                    tracer.block_begin(path)
            if _grad_enabled():
                engine.unreplay()  # grad switched on inside a forward ([Note: replay] in `_replay`)
                guard.ran(path, True)

        return pre

    def _not_resident(self, path: str, pack: Pack, program: Program) -> None:
        """Raise: block ``path`` was reached while ``pack`` was not ready on the device."""
        owner = self._plan.block_owner(path)
        order = None if owner is None else order_mismatch(owner[1], self.ran)
        if order is not None:
            raise ExecutionError(
                f"block {path} was reached out of its ring's order in step "
                f"{step_name(program.schedule.step)}: {order}"
            )
        raise ExecutionError(
            f"block {path} was reached while its weights were {pack.where.value}: step "
            f"{step_name(program.schedule.step)} had not made it resident by then (the mark is the next op "
            "to run); the schedule must load and wait for a block before it runs\n"
            + listing(program.schedule, program.pc)
        )

    def _component_hooks(self, path: str, top: bool) -> tuple[Callable[..., None], Callable[..., None]]:
        before, after = f"before {path}", f"after {path}"
        driver = self.driver if top else None
        engine, guard = self.engine, self._guard
        done = self._done
        done[path] = True

        def pre(module: torch.nn.Module, args: Any) -> None:
            if top:
                done[path] = False
            if driver is not None:
                _ordinary_call(driver.enter, path)
            program = engine.program
            if program is not None:
                stop = program.stops.get(before, 0)
                if stop > program.pc:
                    engine.advance(program, stop)
            if _grad_enabled():
                engine.unreplay()
                guard.ran(path, False)

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if top:
                done[path] = True
            if _grad_enabled():
                engine.unreplay()
                guard.ran(path, False)
            program = engine.program
            if program is not None:
                tracer = engine.tracer
                if tracer is not None:
                    tracer.block_end()
                if (stop := program.stops.get(after, 0)) > program.pc:
                    engine.advance(program, stop)
            if driver is not None:
                _ordinary_call(driver.leave, path, False)

        return pre, post

    def _failed_hook(self, path: str) -> Callable[..., None]:
        """The always-called hook of a top-level component: abandons the step when the forward raised."""
        done = self._done
        driver = self.driver

        def failed(module: torch.nn.Module, args: Any, output: Any) -> None:
            if done[path]:
                return
            done[path] = True
            if driver is not None:
                with INFERENCE_OFF(False):
                    GRAD_OFF()
                    driver.leave(path, True)

        return failed


def called_outside(plan: Plan, path: str, where: str) -> ExecutionError:
    """The error for block ``path`` run while no step runs and its weights are ``where``."""
    owner = plan.block_owner(path)
    name = (path if owner is None else owner[0].path) or "the model"
    return ExecutionError(
        f"block {path} ran outside the forward of its component {name!r} while its weights were {where}: "
        f"torchferry loads the blocks of {name!r} only while its forward runs, and this block was called "
        f"directly (by the pipeline's own code?); call it from inside the forward of {name!r}, or keep "
        f"{name!r} on the device (leave it out with components=[...], or use strategy='none')"
    )
