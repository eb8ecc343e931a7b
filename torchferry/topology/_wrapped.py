"""Wrapper tensors as discovery sees them: the inner tensors that hold a wrapper's bytes, or why not.

A *wrapper tensor* is a tensor subclass whose own storage is empty and whose data lives in inner
tensors it names through torch's ``__tensor_flatten__`` / ``__tensor_unflatten__`` protocol:
torchao's quantized tensors (``Int8Tensor``: ``qdata``, ``scale``, ``zero_point``), optimum-quanto's
(``WeightQBytesTensor``: ``_data``, ``_scale``), a ``DTensor``'s local shard (``_local_tensor``).
Discovery replaces such a tensor by its inner tensors, each a `TensorSpec` of its own named
``<wrapper's name>.<attribute>`` (recursively, for wrappers of wrappers), so every byte count
(blocks, plans, schedules, the simulator) is the bytes that really move. The runtime re-points the
inner tensors and keeps the wrapper object the module holds (`torchferry.runtime.memory._wrappers`).

A wrapper whose inner tensors cannot be re-pointed safely is refused here, before anything moves,
with a `PlanError` naming its class and the reason: no flatten protocol, an inner tensor that is a
new object at each read, or an ``__tensor_unflatten__`` that does not rebuild the wrapper over the
very tensors it is given (the runtime builds the wrapper's device twin that way).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchferry._errors import PlanError
from torchferry.topology._reading import qualname

__all__ = ["inner_tensors", "is_wrapper"]


def is_wrapper(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` dispatches to inner tensors (a ``__torch_dispatch__`` subclass) rather than
    keeping storage of its own (``torch.Tensor``, ``nn.Parameter``, ``__torch_function__``-only
    subclasses such as diffusers' ``GGUFParameter``)."""
    cls = type(tensor)
    if cls in (torch.Tensor, nn.Parameter):
        return False
    return cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _refuse(name: str, cls: type, why: str) -> PlanError:
    return PlanError(
        f"Tensor {name!r} is a {qualname(cls)}, a tensor subclass that keeps its data in inner tensors, "
        f"and torchferry cannot re-point them safely: {why}; dequantize it (for a DTensor, full_tensor()) "
        "before offloading, or leave its component out of the offload (docs/quantized.md lists the forms "
        "that stream)"
    )


def inner_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors holding ``tensor``'s bytes, by qualified name, in flatten order.

    ``[(name, tensor)]`` for a tensor with storage of its own; for a wrapper, each inner tensor as
    ``name.<attribute>``, recursively; non-tensor inner values (a ``DTensor``'s device mesh) hold no
    bytes and are left out. Raises `PlanError` for a wrapper the runtime cannot re-point safely.
    """
    if not is_wrapper(tensor):
        return [(name, tensor)]
    cls = type(tensor)
    flatten = getattr(tensor, "__tensor_flatten__", None)
    unflatten = getattr(cls, "__tensor_unflatten__", None)
    if not callable(flatten) or not callable(unflatten):
        raise _refuse(
            name,
            cls,
            "it does not name them (it has no __tensor_flatten__ / __tensor_unflatten__, torch's protocol "
            "for a wrapper's inner tensors)",
        )
    attributes, context = flatten()
    values: dict[str, Any] = {}
    for attribute in attributes:
        value = getattr(tensor, attribute, None)
        if value is None:
            raise _refuse(name, cls, f"its __tensor_flatten__ names {attribute!r}, which it does not hold")
        if isinstance(value, torch.Tensor) and getattr(tensor, attribute) is not value:
            raise _refuse(
                name,
                cls,
                f"its inner tensor {attribute!r} is a new object at each read (a property), so pointing it "
                "at other bytes would not reach the wrapper",
            )
        values[attribute] = value
    inner = {a: v for a, v in values.items() if isinstance(v, torch.Tensor)}
    if not inner:
        raise _refuse(name, cls, "its __tensor_flatten__ names no inner tensor, so nothing holds its bytes")
    try:
        twin = unflatten(dict(values), context, tensor.size(), tensor.stride())
    except Exception as exc:
        raise _refuse(
            name, cls, f"its __tensor_unflatten__ cannot rebuild it over its own inner tensors ({exc})"
        ) from None
    kept = isinstance(twin, torch.Tensor) and all(getattr(twin, a, None) is v for a, v in inner.items())
    if type(twin) is not cls or not kept or twin.shape != tensor.shape or twin.dtype != tensor.dtype:
        raise _refuse(
            name,
            cls,
            "its __tensor_unflatten__ does not rebuild it over the very inner tensors it is given (it "
            "copies or converts them), which is how torchferry gives the wrapper the device its bytes "
            "are on",
        )
    found: list[tuple[str, torch.Tensor]] = []
    for attribute, value in inner.items():
        found.extend(inner_tensors(f"{name}.{attribute}", value))
    return found
