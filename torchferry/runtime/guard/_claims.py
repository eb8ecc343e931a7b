"""What a session will not share: modules another offloader drives, tensors another session serves.

torchferry moves a pipeline's weights itself, so it refuses, before anything is mutated, a pipeline
that something else moves too, instead of letting two movers fight over the same tensors:

- accelerate hooks (``module._hf_hook``), which diffusers' ``enable_model_cpu_offload()``,
  ``enable_sequential_cpu_offload()`` and ``device_map=`` loading install;
- diffusers hooks that move weights (``enable_group_offload``/``apply_group_offloading``), found in a
  module's ``_diffusers_hook`` registry; diffusers' layerwise casting runs under a session ([Note:
  layerwise casting] in `_casting`) unless its cast back would change the stored weights;
- tensors an open session already serves: a second session on ``pipe.transformer`` while ``pipe``
  is served, or on ``pipe`` while ``pipe.transformer`` is.

A block the pipeline calls outside its component's forward (``pipe.transformer.blocks[0](x)`` from
the pipeline's own code) runs when no step does, so nothing loads it: `called_outside` (in the
executor's hooks) is the `ExecutionError` its hook raises when its weights are not on the device,
instead of letting it run on host weights (a device mismatch on a GPU; silently unmanaged on the
CPU).

While a session is open, `Watch` notices tensors added to a component after it opened (a LoRA
adapter injected into a served transformer): they are not in the plan, so nothing moves them. On
the session's device they simply stay where they are; on another device the component's next
forward would mix devices, so it is an `ExecutionError` naming the tensors and the fix. It also
notices another offloader enabled on a served pipeline after opening (``enable_model_cpu_offload``,
``enable_sequential_cpu_offload``, ``enable_group_offload``): each installs its hook on the component
itself, so one look at the component when its forward begins finds it, and the step is refused,
naming the offloader, before that offloader's own hook runs (it would move weights the session holds).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from torchferry._errors import ExecutionError, PlanError
from torchferry.runtime.device import same_device
from torchferry.runtime.interop import diffusers_cast
from torchferry.topology import Topology, exact_cast, find_attr

__all__ = ["Claims", "Watch", "enabled_offloaders", "offloader_enabled", "refuse_foreign"]

#: diffusers hook names (``diffusers.hooks``) whose hooks move or re-cast a module's weights.
MOVING_HOOKS: dict[str, str] = {
    "group_offloading": "group offloading (enable_group_offload / apply_group_offloading)",
    "lazy_prefetch_group_offloading": "group offloading (enable_group_offload / apply_group_offloading)",
    "layer_execution_tracker": "group offloading (enable_group_offload / apply_group_offloading)",
}


#: What to do about another offloader enabled on a served component, by its kind.
_OFFLOADER_FIXES = {
    "model": "pipe.remove_all_hooks() removes diffusers' model CPU offload, and the session goes on",
    "sequential": (
        "sequential CPU offload has also swapped the weights it moves: close() the session (its host "
        "copies give every weight back), call pipe.remove_all_hooks(), then open a new one"
    ),
    "group": (
        "close() the session (diffusers has no call that removes group offloading) and use one of the two"
    ),
    "other": "remove those hooks, or close() the session and use that offloader alone",
}


def _accelerate_hook(hook: object) -> tuple[str, str]:
    """What installed the accelerate hook ``hook`` (a `SequentialHook` holds several): kind, words."""
    names = {type(h).__name__ for h in (*getattr(hook, "hooks", ()), hook)}
    if "CpuOffload" in names:
        return "model", "diffusers' model CPU offload (pipe.enable_model_cpu_offload())"
    if "AlignDevicesHook" in names:
        return "sequential", (
            "diffusers' sequential CPU offload (pipe.enable_sequential_cpu_offload()) or another "
            "accelerate device-alignment hook"
        )
    return "other", f"an accelerate hook ({type(hook).__name__})"


def _own_attr(module: torch.nn.Module, name: str) -> Any:
    """``getattr(module, name, None)`` for an attribute an offloader sets on the instance, without
    `nn.Module.__getattr__`'s miss (it formats an error), which every step start would pay."""
    found = vars(module).get(name)
    if found is None and hasattr(type(module), name):
        found = getattr(module, name, None)
    return found


def _may_hook(module: torch.nn.Module) -> bool:
    """Whether ``module`` has an attribute an offloader's hooks are kept in (two dictionary reads at
    every step start: `enabled_offloaders` itself looks at a module that has one)."""
    own, cls = vars(module), type(module)
    return (
        "_hf_hook" in own
        or "_diffusers_hook" in own
        or hasattr(cls, "_hf_hook")
        or hasattr(cls, "_diffusers_hook")
    )


def enabled_offloaders(module: torch.nn.Module) -> list[tuple[str, str]]:
    """The other offloaders whose hooks sit on ``module`` itself: (kind, in words) each."""
    found = []
    hook = _own_attr(module, "_hf_hook")
    if hook is not None:
        found.append(_accelerate_hook(hook))
    names = getattr(_own_attr(module, "_diffusers_hook"), "hooks", {})
    for words in sorted({MOVING_HOOKS[n] for n in names if n in MOVING_HOOKS}):
        found.append(("group" if "group" in words else "other", f"diffusers {words}"))
    return found


def offloader_enabled(component: str, found: list[tuple[str, str]]) -> ExecutionError:
    """The error for another offloader found on served ``component`` at the start of its step."""
    what = " and ".join(words for _, words in found)
    fixes = "; ".join(dict.fromkeys(_OFFLOADER_FIXES[kind] for kind, _ in found))
    return ExecutionError(
        f"{component or 'the model'!r} has hooks of {what}, enabled after the torchferry session opened: "
        f"two offloaders would move the same weights, so this step was refused; {fixes}"
    )


def _modules(pipeline: Any, topo: Topology) -> Iterator[tuple[str, torch.nn.Module]]:
    """Every module of every component of ``topo``, with its dotted path under ``pipeline``."""
    for component in topo.components:
        root = find_attr(pipeline, component.path)
        if not isinstance(root, torch.nn.Module):
            continue
        for name, module in root.named_modules():
            yield ".".join(p for p in (component.path, name) if p), module


def refuse_foreign(pipeline: Any, topo: Topology) -> None:
    """Raise `PlanError` if another offloader's hooks sit on a module of ``topo``'s components."""
    found: list[str] = []
    kinds: set[str] = set()
    for path, module in _modules(pipeline, topo):
        where = repr(path) if path else "the model"
        hook = getattr(module, "_hf_hook", None)
        if hook is not None:
            found.append(f"{where}: an accelerate hook ({type(hook).__name__})")
            kinds.add("accelerate")
        registry = getattr(module, "_diffusers_hook", None)
        names = getattr(registry, "hooks", {})
        moving = sorted({MOVING_HOOKS[n] for n in names if n in MOVING_HOOKS})
        if moving:
            found.append(f"{where}: diffusers {' and '.join(moving)} hooks")
            kinds.add("diffusers")
        cast = diffusers_cast(module)
        storage, compute = (str(d).removeprefix("torch.") for d in cast) if cast is not None else ("", "")
        if cast is not None and not exact_cast(storage, compute):
            found.append(
                f"{where}: diffusers layerwise casting from {storage} to {compute}, whose cast back "
                "rewrites the stored weights at each forward"
            )
            kinds.add("casting")
    if not found:
        return
    fixes = []
    if "accelerate" in kinds:
        fixes.append(
            "pipe.remove_all_hooks() undoes enable_model_cpu_offload() and enable_sequential_cpu_offload(), "
            "accelerate.hooks.remove_hook_from_module(module, recurse=True) any other accelerate hook "
            "(and load without device_map=)"
        )
    if "diffusers" in kinds:
        fixes.append(
            "build the model without diffusers' group offloading (torchferry streams the blocks itself)"
        )
    if "casting" in kinds:
        fixes.append(
            "cast layerwise to a compute dtype that holds every stored value (float8 to bfloat16, float16 "
            "or float32; bfloat16 or float16 to float32), or pass storage_dtype= to torchferry.offload "
            "instead"
        )
    shown = found[:4] + ([f"... and {len(found) - 4} more"] if len(found) > 4 else [])
    raise PlanError(
        "torchferry.offload cannot serve a pipeline that another offloader also moves or re-casts "
        "(torchferry moves every weight itself):\n  "
        + "\n  ".join(shown)
        + "\nRemove them first: "
        + "; ".join(fixes)
    )


def _tensors(pipeline: Any, topo: Topology) -> Iterator[tuple[str, torch.Tensor]]:
    for component in topo.components:
        for spec in component.all_tensors():
            try:
                t = find_attr(pipeline, spec.name)
            except AttributeError:
                continue
            if isinstance(t, torch.Tensor):
                yield spec.name, t


@attrs.define(eq=False)
class Claim:
    """What one session claimed: its tensors, held while it is open (so their ids stay theirs)."""

    owner: str
    tensors: list[torch.Tensor]


class Claims:
    """The tensors open sessions serve, so a second session over any of them is refused."""

    def __init__(self) -> None:
        # Why: id(tensor) -> a weak reference to the `Claim` holding it. The claim (kept by its session)
        # holds the tensor, so the id cannot be reused while the claim lives; weak, so a session dropped
        # without close() leaves nothing here. (Not a weak reference to the tensor itself: a tensor with
        # one cannot be swapped, which crossing to the meta device needs.)
        self._held: dict[int, weakref.ref[Claim]] = {}

    def check(self, pipeline: Any, topo: Topology) -> None:
        """Raise `ExecutionError` if an open session serves a tensor of ``topo``."""
        for name, t in _tensors(pipeline, topo):
            ref = self._held.get(id(t))
            claim = None if ref is None else ref()
            if claim is not None:  # a live claim holds its tensors: no other tensor has this id
                raise ExecutionError(
                    f"tensor {name!r} of this {type(pipeline).__name__} is already served by the open "
                    f"torchferry session on a {claim.owner}: a module can be served by one session at a "
                    "time; close() that session first, or offload the whole pipeline in one session"
                )

    def claim(self, pipeline: Any, topo: Topology) -> Claim:
        """Mark every tensor of ``topo`` as served; returns the claim for `release`."""
        claim = Claim(owner=type(pipeline).__name__, tensors=[t for _, t in _tensors(pipeline, topo)])
        ref = weakref.ref(claim)
        for t in claim.tensors:
            self._held[id(t)] = ref
        return claim

    def release(self, claim: Claim | None) -> None:
        """Unmark the tensors of ``claim`` (their session closed)."""
        if claim is not None:
            for t in claim.tensors:
                if (ref := self._held.get(id(t))) is not None and ref() is claim:
                    del self._held[id(t)]
            claim.tensors = []
        for key in [k for k, ref in self._held.items() if ref() is None]:
            del self._held[key]


#: The tensors of every open session in this process.
CLAIMS = Claims()


class _Registrations:
    """Counts parameters, buffers and submodules registered on any module in this process.

    The count lets `Watch.check` skip its walk over a component's tensors when nothing was added
    since the last step: that walk costs milliseconds per step on a large model, the count one
    comparison. Torch's global registration hooks see ``register_parameter``, ``register_buffer``,
    ``add_module`` and every attribute assignment of a parameter, buffer or module (how adapters are
    injected); a tensor written straight into ``module._parameters`` bypasses them and is not seen.
    """

    def __init__(self) -> None:
        self.count = 0
        self._installed = False

    def install(self) -> None:
        """Install the three hooks (once per process; they only count)."""
        if self._installed:
            return
        self._installed = True
        from torch.nn.modules import module as nn_module

        nn_module.register_module_parameter_registration_hook(self._bump)
        nn_module.register_module_buffer_registration_hook(self._bump)
        nn_module.register_module_module_registration_hook(self._bump)

    def _bump(self, module: torch.nn.Module, name: str, value: object) -> None:
        self.count += 1


REGISTRATIONS = _Registrations()


class Watch:
    """The tensors of each top-level component when the session opened, to notice ones added later."""

    def __init__(self, pipeline: Any, topo: Topology, device: torch.device) -> None:
        REGISTRATIONS.install()
        # Why: the registration count when each component was last walked; equal now means nothing added.
        self._walked: dict[str, int] = {}
        self._device = device
        self._roots: dict[str, torch.nn.Module] = {}
        # Why: ids of each component's tensors at opening (and of those accepted since), held below.
        self._known: dict[str, set[int]] = {}
        # Why: keeps those tensors alive, so their ids cannot be reused by a new tensor.
        self._held: list[torch.Tensor] = []
        for component in topo.components:
            root = find_attr(pipeline, component.path)
            if isinstance(root, torch.nn.Module):
                self._roots[component.path] = root
                tensors = list(_own(root))
                self._held.extend(tensors)
                self._known[component.path] = {id(t) for t in tensors}
                self._walked[component.path] = REGISTRATIONS.count

    def clear(self) -> None:
        """Forget every component (the session closed): hold no tensor any longer."""
        self._walked.clear()
        self._roots.clear()
        self._known.clear()
        self._held.clear()

    def check(self, component: str) -> None:
        """Raise `ExecutionError` if another offloader was enabled on ``component`` after opening, or
        if it gained tensors on another device since opening."""
        root = self._roots.get(component)
        if root is None:
            return
        if _may_hook(root) and (others := enabled_offloaders(root)):
            raise offloader_enabled(component, others)
        if self._walked.get(component) == REGISTRATIONS.count:
            return
        known = self._known[component]
        added = [t for t in _own(root) if id(t) not in known]
        if not added:
            self._walked[component] = REGISTRATIONS.count
            return
        elsewhere = {id(t) for t in added if not _on(t, self._device)}
        if not elsewhere:
            self._held.extend(added)  # on the session's device already: they run where they are
            known.update(id(t) for t in added)
            self._walked[component] = REGISTRATIONS.count
            return
        names = [
            ".".join(p for p in (component, n) if p)
            for n, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers())
            if id(t) in elsewhere
        ]
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        raise ExecutionError(
            f"{len(names)} tensor(s) of {component or 'the model'!r} were added after the torchferry "
            f"session opened and are on another device than its {self._device} ({shown}; a LoRA adapter "
            "loaded into a served model?): the session moves only the tensors it planned; close() the "
            "session, add the adapters, then open a new one (adapters loaded before opening stream "
            "with their blocks)"
        )


def _own(root: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from root.parameters()
    yield from root.buffers()


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return same_device(t.device, device)
