"""Layerwise casting under a session: weights stored in one dtype, cast to another around each forward.

[Note: layerwise casting]
diffusers' ``enable_layerwise_casting(storage_dtype, compute_dtype)`` stores the weights of each
supported layer (Linear, Conv, Embedding outside its skip patterns) in the storage dtype and hooks
the layer: before its forward ``layer.to(dtype=compute_dtype)``, after it ``layer.to(storage_dtype)``.
Under a session those ``.to`` calls reach the session's conversion (`_overrides`), which would
refuse them (they would replace tensors the session holds). So on a layer carrying diffusers' hook
the conversion is answered here instead: `Casting.up` points each of the layer's floating tensors at
a cast copy of the bytes it points at now (its view into a device slot, or its host copy on a CPU
session), and `Casting.down` points each back at that very view. What crosses the link, what host
memory holds and what the slot holds stay in the storage dtype; the forward computes in the compute
dtype, as without a session.

Pointing back instead of casting back gives diffusers' bits exactly when the compute dtype holds
every storage value (float8 in bfloat16, float16 or float32; bfloat16 and float16 in float32):
then diffusers' round trip is the identity too. Other pairs (float16 stored, bfloat16 computed)
would rewrite the stored weights at the first forward; torchferry keeps one host copy and refuses
them when the session opens (`torchferry.runtime.guard._claims`).

torchferry's own ``storage_dtype=`` request (`OffloadConfig.storage_dtype`) does the same without
diffusers: the plan stores the tensors diffusers' casting would cast (`TensorSpec.compute_dtype` set)
in the storage dtype, and forward hooks on their layers call `Casting.up` and `Casting.down`, the
post hook first among the layer's forward hooks, as diffusers' cast back runs inside the forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchferry.topology import Plan, find_attr

__all__ = ["Casting", "diffusers_cast"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def diffusers_cast(module: nn.Module) -> tuple[torch.dtype, torch.dtype] | None:
    """``(storage, compute)`` of the diffusers layerwise-casting hook on ``module`` itself, else ``None``."""
    registry = getattr(module, "_diffusers_hook", None)
    hook = getattr(registry, "hooks", {}).get("layerwise_casting")
    storage, compute = getattr(hook, "storage_dtype", None), getattr(hook, "compute_dtype", None)
    if isinstance(storage, torch.dtype) and isinstance(compute, torch.dtype):
        return storage, compute
    return None


def _floating(module: nn.Module) -> list[torch.Tensor]:
    """The floating and complex tensors ``module.to(dtype)`` converts (its own and its children's)."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen and (t.is_floating_point() or t.is_complex()):
            seen.add(id(t))
            out.append(t)
    return out


def _back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Point each tensor back at the view `Casting.up` kept of it."""
    with torch.no_grad():
        for t, view in saved:
            t.data = view


class Casting:
    """The layers a session casts around their forward, and what each cast layer pointed at before.

    ``layers`` maps each layer (by id) to its ``(storage, compute)`` dtypes: the layers diffusers'
    hook casts (answered through their ``.to``) and those torchferry's own request casts (through
    forward hooks set here).
    """

    def __init__(self, pipeline: Any, plan: Plan, modules: Iterable[nn.Module]) -> None:
        self.layers: dict[int, tuple[torch.dtype, torch.dtype]] = {}
        # Why: per layer cast up now, each tensor and the view it pointed at, to point it back there.
        self._saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._handles: list[RemovableHandle] = []
        for module in modules:
            pair = diffusers_cast(module)
            if pair is not None:
                self.layers[id(module)] = pair
        own: dict[int, tuple[nn.Module, torch.dtype, torch.dtype]] = {}
        for component in plan.topology.components:
            for spec in component.all_tensors():
                if spec.compute_dtype is None:
                    continue
                for name in (spec.name, *spec.aliases):  # a tied weight is cast in every layer using it
                    layer = find_attr(pipeline, name.rsplit(".", 1)[0]) if "." in name else None
                    if isinstance(layer, nn.Module):
                        own[id(layer)] = (layer, _dtype(spec.dtype), _dtype(spec.compute_dtype))
        for layer, storage, compute in own.values():
            self.layers[id(layer)] = (storage, compute)
            self._handles.append(layer.register_forward_pre_hook(self._pre))
            self._handles.append(layer.register_forward_hook(self._post, prepend=True, always_call=True))

    def _pre(self, module: nn.Module, args: Any) -> None:
        self.up(module, self.layers[id(module)][1])

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self.down(module)

    def up(self, module: nn.Module, dtype: torch.dtype) -> None:
        """Point each floating tensor of ``module`` at a ``dtype`` copy of what it points at now."""
        saved = [(t, t.data) for t in _floating(module) if t.dtype != dtype]
        with torch.no_grad():
            for t, view in saved:
                t.data = view.to(dtype)
        self._saved[id(module)] = saved  # one a forward that raised left is undone by the guard (`undo`)

    def down(self, module: nn.Module) -> bool:
        """Point ``module``'s tensors back at what they pointed at before `up`; whether it had been up."""
        saved = self._saved.pop(id(module), None)
        if saved is None:
            return False
        _back(saved)
        return True

    def undo(self) -> None:
        """`down` for every layer still cast up: a forward cut short by a KeyboardInterrupt left it so
        (torch runs a forward hook that is always called after an ``Exception``, not after that)."""
        while self._saved:
            _back(self._saved.popitem()[1])

    def convert(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Answer ``module.to(*args, **kwargs)`` from diffusers' casting hook: a cast to the layer's
        compute dtype is `up`, to its storage dtype `down`; whether it was such a call."""
        pair = self.layers.get(id(module))
        if pair is None:
            return False
        try:
            parsed: tuple[Any, ...] = torch._C._nn._parse_to(*args, **kwargs)  # None where not given
            device, dtype, _, memory_format = parsed
        except (TypeError, ValueError, RuntimeError):
            return False
        if device is not None or memory_format is not None or dtype not in pair:
            return False
        storage, compute = pair
        if dtype == compute:
            self.up(module, compute)
            return True
        # To the storage dtype: back at the views `up` left, or already there (nothing to change).
        return self.down(module) or all(t.dtype == storage for t in _floating(module))

    def remove(self) -> None:
        """Take the forward hooks off (the session closes) and forget every cast layer."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._saved.clear()
        self.layers.clear()
