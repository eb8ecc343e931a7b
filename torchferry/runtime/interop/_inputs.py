"""Inputs on the session device: a component's tensor arguments, and a pipeline's execution device.

Between steps every managed weight points at host memory, so a pipeline that asks its modules
where to compute gets the CPU: diffusers pipelines take ``device = self._execution_device``, which
falls back to the first parameter's device, and would build latents, timesteps and token ids on the
CPU for weights that run on the GPU. While a session is open, `Inputs`:

- moves every tensor argument (positional and keyword, nested in tuples, lists and dicts) of each
  top-level component's forward to the session device, in a forward pre hook that runs before the
  engine's (a call whose tensors are already there passes through untouched, nothing is copied);
- makes a pipeline whose class defines ``_execution_device`` (a diffusers ``DiffusionPipeline``)
  report the session device: the instance's class is swapped for a subclass that overrides the
  property (isinstance, the class name and everything else are unchanged), and put back at close.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from torchferry.runtime.device import resolved
from torchferry.topology import find_attr

__all__ = ["Inputs", "to_device"]


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it on ``device``; the same object when nothing had to move."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, (list, tuple)):
        moved = [to_device(v, device) for v in value]
        if all(m is v for m, v in zip(moved, value, strict=True)):
            return value
        if isinstance(value, list):
            return moved
        fields = getattr(value, "_fields", None)  # a named tuple is rebuilt field by field
        return type(value)(*moved) if fields is not None else type(value)(moved)
    if type(value) is dict:
        items = {k: to_device(v, device) for k, v in value.items()}
        return value if all(items[k] is value[k] for k in value) else items
    return value


class Inputs:
    """The session's input hooks on its top-level components and its pipeline's execution device."""

    def __init__(self, pipeline: Any, components: Iterable[str], device: torch.device) -> None:
        self.pipeline = pipeline
        self.device = resolved(device)  # as tensors report it, so comparing it is exact
        self._handles: list[RemovableHandle] = []
        # Why: the pipeline's own class, restored at `remove`; ``None`` when it was not swapped.
        self._class: type | None = None
        for path in components:
            module = find_attr(pipeline, path)
            if isinstance(module, torch.nn.Module):
                handle = module.register_forward_pre_hook(self._move, with_kwargs=True, prepend=True)
                self._handles.append(handle)
        cls = type(pipeline)
        if isinstance(getattr(cls, "_execution_device", None), property):
            here = self.device
            self._class = cls
            pipeline.__class__ = type(
                cls.__name__,
                (cls,),
                {
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    "_execution_device": property(lambda self: here),
                },
            )

    @property
    def count(self) -> int:
        """Forward pre hooks installed (one per top-level component)."""
        return len(self._handles)

    def _move(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        moved_args, moved_kwargs = to_device(args, self.device), to_device(kwargs, self.device)
        if moved_args is args and moved_kwargs is kwargs:
            return None
        return moved_args, moved_kwargs

    def remove(self) -> None:
        """Remove the hooks and give the pipeline its own class back."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._class is not None:
            self.pipeline.__class__ = self._class
            self._class = None
