"""The engine's hooks: forward pre/post hooks at every anchor, the `Driver` they tell, the grad guard.

A schedule's ops are keyed to anchors (``before``/``after`` a block or component). The pre hook of
an anchor runs every pending op up to its stop and checks that a block about to run is resident;
the post hook runs the ops keyed after it. At a top-level component the hooks also tell the
`Driver` (the session) that its forward starts and ends, which starts and finishes a step.

[Note: gradients]
torchferry serves inference; gradients through streamed weights are not supported, and they fail
loudly rather than come out wrong. A block in a ring slot shares that slot with the blocks after it,
and autograd keeps what a forward with grad saved (the weights, and views such as ``weight.t()``)
pointing into the slot; re-pointing a tensor (``tensor.data = ...``) bumps no version counter, so
a backward would read whichever block the slot holds by then. So a block that runs with grad
enabled (its pre hook sees `torch.is_grad_enabled`) while its unit sits in a slot is remembered
(``graded``), and when that unit leaves the slot (evict, or `abort`) every tensor of it that
requires grad has its version counter bumped: a later backward raises autograd's "modified by an
inplace operation" error. The first such block of a session warns (`OffloadWarning`). A component
whose own remainder sits in a slot (a custom policy may stream one) is checked the same way around
its forward. Staged units (``device`` placements, and every unit of the none and model_level
strategies) keep device memory of their own that nothing else overwrites: unstaging only drops
the engine's reference, what autograd saved stays valid, and their gradients are right. Under
``torch.no_grad()`` or inference mode this costs one grad-mode check per block.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from torchferry._errors import ExecutionError, OffloadWarning
from torchferry.policies import DEVICE, rest_unit
from torchferry.runtime._claims import called_outside
from torchferry.runtime._host import Pack, PackState, Unit
from torchferry.topology import find_attr

if TYPE_CHECKING:
    from torchferry.runtime._engine import Engine

__all__ = ["Driver", "GradGuard", "Hooks"]


class Driver(Protocol):
    """What the engine tells about top-level component forwards (the session picks steps from it)."""

    def enter(self, component: str) -> None:
        """A top-level component's forward begins."""

    def leave(self, component: str, failing: bool) -> None:
        """A top-level component's forward ended (``failing``: it raised)."""


class GradGuard:
    """Remembers units that ran with grad in a shared slot, and spoils them when they leave it.

    See [Note: gradients].
    """

    def __init__(self) -> None:
        # Why: units that sat in a slot while a forward with grad ran them; bumped when they leave it.
        self.graded: set[Unit] = set()
        self._warned = False

    def ran(self, path: str, block: bool, placed: Mapping[str, str], units: Mapping[str, Unit]) -> None:
        """A forward with grad runs at ``path``: remember its units in slots."""
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
                    stacklevel=2,
                )

    def leaving(self, unit: Unit) -> None:
        """``unit`` leaves its slot: make what autograd saved of it unusable."""
        if unit not in self.graded:
            return
        self.graded.discard(unit)
        torch.autograd.graph.increment_version(
            [t for pack in unit.packs for t in pack.tensors if t.requires_grad]
        )

    def leaving_all(self) -> None:
        """Every unit leaves its slot (the engine aborts)."""
        for unit in list(self.graded):
            self.leaving(unit)


class Hooks:
    """The forward hooks one engine installs on its pipeline, at most one pre/post pair per path."""

    def __init__(self, engine: Engine, driver: Driver | None) -> None:
        self.engine = engine
        self.driver = driver
        self._hooks: dict[str, tuple[RemovableHandle, RemovableHandle]] = {}
        # Why: each anchor's module and hook functions, so `forward` can fire them around other calls.
        self._calls: dict[str, tuple[torch.nn.Module, Callable[..., None], Callable[..., None]]] = {}
        self._tops = frozenset(c.path for c in engine.plan.components)
        self._blocks = frozenset(
            b.path for top in engine.plan.components for c in top.walk() for b in c.blocks
        )

    @property
    def count(self) -> int:
        """Forward hooks installed on the pipeline."""
        return 2 * len(self._hooks)

    def anchor(self, paths: Iterable[str]) -> None:
        """Install forward pre/post hooks at each block or component path (once per path)."""
        engine = self.engine
        for path in paths:
            if path in self._hooks:
                continue
            try:
                module = find_attr(engine.pipeline, path)
            except AttributeError:
                raise ExecutionError(
                    f"schedule anchor {path!r} is not a module of this pipeline; the plan and the pipeline "
                    "disagree (discover the topology of this pipeline again)"
                ) from None
            if not isinstance(module, torch.nn.Module):
                raise ExecutionError(
                    f"schedule anchor {path!r} is a {type(module).__name__}, not a torch module"
                )
            unit = engine.store.units.get(path)
            pack = (
                unit.packs[0]
                if unit is not None and len(unit.packs) == 1 and path not in self._tops
                else None
            )
            block = path in self._blocks
            before, after = self._pre_hook(path, pack, block), self._post_hook(path, block)
            pre = module.register_forward_pre_hook(before)
            post = module.register_forward_hook(after, always_call=True)
            self._hooks[path] = (pre, post)
            self._calls[path] = (module, before, after)

    @contextlib.contextmanager
    def forward(self, path: str) -> Iterator[None]:
        """Treat the body as a forward of the anchored module at ``path``: its hooks fire around it."""
        module, before, after = self._calls[path]
        try:
            before(module, ())
            yield
        except BaseException:
            after(module, (), None)
            raise
        after(module, (), None)

    def remove(self) -> None:
        """Remove every hook from the pipeline."""
        for pre, post in self._hooks.values():
            pre.remove()
            post.remove()
        self._hooks.clear()
        self._calls.clear()

    def _pre_hook(self, path: str, pack: Pack | None, block: bool) -> Callable[..., None]:
        key = f"before {path}"
        driver = self.driver if path in self._tops else None
        engine = self.engine

        def pre(module: torch.nn.Module, args: Any) -> None:
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False), torch.no_grad():
                    return pre(module, args)
            if driver is not None:
                driver.enter(path)
            program = engine.program
            if program is None and block and pack is not None and pack.where is not PackState.READY:
                raise called_outside(engine.plan, path, pack.where.value)
            if program is not None:
                if block:
                    engine.ran.append(path)
                stop = program.stops.get(key)
                if stop is not None and stop > program.pc:
                    engine.run(program, stop)
                if pack is not None and pack.where is not PackState.READY:
                    engine.not_resident(path, pack, program)
                if block and engine.tracer is not None:
                    engine.tracer.block_begin(path)
            if torch.is_grad_enabled():
                engine.guard.ran(path, block, engine.placed, engine.store.units)

        return pre

    def _post_hook(self, path: str, block: bool) -> Callable[..., None]:
        key = f"after {path}"
        driver = self.driver if path in self._tops else None
        engine = self.engine

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False), torch.no_grad():
                    return post(module, args, output)
            if not block and torch.is_grad_enabled():
                engine.guard.ran(path, block, engine.placed, engine.store.units)
            failing = sys.exc_info()[1] is not None
            program = engine.program
            if program is not None and not failing:
                if block and engine.tracer is not None:
                    engine.tracer.block_end(path)
                stop = program.stops.get(key)
                if stop is not None and stop > program.pc:
                    engine.run(program, stop)
            if driver is not None:
                driver.leave(path, failing)

        return post
