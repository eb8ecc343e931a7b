"""Wrapper tensors in the runtime: the wrapper object a module holds follows its inner tensors around.

Discovery gives each inner tensor of a wrapper tensor (torchao's and quanto's quantized tensors, a
``DTensor``'s local shard; see `torchferry.topology._wrapped`) a `TensorSpec` of its own, so a pack
holds and re-points the inner tensors like any tensor. What is left is the wrapper itself.

[Note: wrapper tensors]
A wrapper was made by ``torch.Tensor._make_wrapper_subclass(cls, ..., device=...)``: its own
TensorImpl has no storage but does carry a device, and re-pointing only its inner tensors at a
device slot would leave ``weight.device`` saying ``cpu`` (a diffusers model reading
``self.weight.device``, torchao's kernels and ``DTensor``'s checks all read it). ``weight.data =
twin`` is refused across the meta device (torch's ``set_data`` finds the types incompatible), and
``torch.utils.swap_tensors`` swaps the Python objects' ``__dict__`` too, so the module's wrapper
would lose its own attributes (``_is_param``, anything a library set), and it refuses a tensor
that autograd still holds (quanto's weights keep ``requires_grad=True``: after a forward with grad
it raised on their use count).

So each wrapper gets one *twin*: a wrapper of the same class that its own ``__tensor_unflatten__``
builds over the wrapper's inner tensors once they first sit on the device (discovery checked that it
keeps the very tensors it is given). When the pack's tensors move to another device, the wrapper and
its twin exchange their TensorImpls only (``torch._C._swap_tensor_impl``, the last step of
``swap_tensors``): the wrapper the module holds keeps its identity, its ``__dict__`` (the same inner
tensor objects, re-pointed), its ties and attributes, and takes the twin's device; the twin keeps
the old impl for the way back, so each move is one impl exchange (about 1 us) and no allocation.
Packs on one device (a CPU session) never exchange anything. Wrappers of wrappers follow inner
ones first. `check_wrappers` builds a twin over meta copies before anything moves, so a class
whose ``__tensor_unflatten__`` does not take its device from its inner tensors is refused then.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from torchferry._errors import PlanError
from torchferry.topology import TensorSpec, find_attr, is_wrapper

__all__ = ["Wrapper", "check_wrappers", "find_wrappers", "holders", "on_host", "standalone"]

# Why: the impl exchange ``torch.utils.swap_tensors`` ends with, without its ``__dict__``/slot swaps.
_swap_impl: Any = torch._C._swap_tensor_impl


# Why: a wrapper's attributes read without its ``__torch_function__`` (2 us each on torchao's, 0.1 so).
_plain_access = torch._C.DisableTorchFunctionSubclass


def _rebuilt(tensor: torch.Tensor, inner: dict[str, Any]) -> torch.Tensor:
    """A wrapper of ``tensor``'s class over ``inner`` (its flatten names -> values), by its own unflatten."""
    _, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    twin: torch.Tensor = type(tensor).__tensor_unflatten__(  # type: ignore[attr-defined]
        inner, context, tensor.size(), tensor.stride()
    )
    return twin


def _inner(tensor: torch.Tensor) -> dict[str, Any]:
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return {n: getattr(tensor, n) for n in names}


@attrs.define(slots=True, eq=False)
class Wrapper:
    """A wrapper tensor of a pack, the device its own impl says it is on, and its twin for the other.

    See [Note: wrapper tensors].
    """

    tensor: torch.Tensor
    device: torch.device
    twin: torch.Tensor | None = None
    # Why: the device of the twin's impl (a wrapper's ``.device`` runs its ``__torch_function__``).
    twin_device: torch.device | None = None

    def follow(self, device: torch.device) -> None:
        """Give the wrapper ``device``, where its inner tensors are now (one impl exchange)."""
        tensor, twin = self.tensor, self.twin
        if twin is None or self.twin_device != device:
            twin = _rebuilt(tensor, _inner(tensor))
            self.twin = twin
        with _plain_access():  # the impl carries requires_grad: the twin takes the wrapper's own
            grad = tensor.requires_grad
            if twin.requires_grad is not grad:
                twin.requires_grad_(grad)
        _swap_impl(tensor, twin)
        self.twin_device, self.device = self.device, device


def on_host(tensor: torch.Tensor) -> Wrapper:
    """The `Wrapper` of a pack's wrapper tensor whose inner tensors now sit in host memory. A wrapper
    built on the meta device (a quantized model filled from a checkpoint, docs/quantized.md) takes the
    CPU at once, so ``weight.device`` says where its bytes are."""
    with _plain_access():
        device = tensor.device
    wrapper = Wrapper(tensor=tensor, device=device)
    if device.type != "cpu":
        wrapper.follow(torch.device("cpu"))
    return wrapper


def find_wrappers(pipeline: Any, specs: Iterable[TensorSpec]) -> list[torch.Tensor]:
    """The wrapper tensors whose inner tensors ``specs`` name (under any of their names), each once,
    wrappers inside other wrappers first."""
    found: dict[int, tuple[int, torch.Tensor]] = {}
    for spec in specs:
        for name in (spec.name, *spec.aliases):
            path = name
            while "." in path:
                path = path.rsplit(".", 1)[0]
                try:
                    parent = find_attr(pipeline, path)
                except AttributeError:
                    break
                if not isinstance(parent, torch.Tensor):
                    break
                found.setdefault(id(parent), (path.count("."), parent))
    return [t for _, t in sorted(found.values(), key=lambda e: -e[0])]


def check_wrappers(packs: dict[str, list[torch.Tensor]]) -> None:
    """Refuse, before anything moves, wrappers the runtime could not carry (`PlanError`).

    ``packs`` maps each pack to its wrappers. A wrapper must lie in one pack (its inner tensors move
    together), and its class must build a wrapper on the device its inner tensors are on (tried with
    copies of them on the meta device, which costs no memory).
    """
    seen: dict[int, str] = {}
    for name, wrappers in packs.items():
        for w in wrappers:
            other = seen.setdefault(id(w), name)
            if other != name:
                raise PlanError(
                    f"a {type(w).__qualname__} wrapper tensor has inner tensors in two packs ({other} and "
                    f"{name}): one of them is shared with a tensor of another block, so its parts would sit "
                    "on different devices; give each wrapper inner tensors of its own"
                )
            try:
                device = _on_meta(w).device.type
            except Exception as exc:
                device = f"nowhere ({type(exc).__name__}: {exc})"
            if device != "meta":
                raise PlanError(
                    f"a {type(w).__module__}.{type(w).__qualname__} wrapper tensor of pack {name}, rebuilt "
                    f"by its __tensor_unflatten__ over inner tensors on the meta device, is on {device}: its "
                    "class does not take its device from its inner tensors, so torchferry cannot give it the "
                    "device its bytes are on; dequantize it before offloading"
                )


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` rebuilt over meta copies of its inner tensors (a wrapper's by its own unflatten)."""
    if not is_wrapper(tensor):
        return tensor.to("meta")
    inner = _inner(tensor)
    return _rebuilt(tensor, {k: _on_meta(v) if isinstance(v, torch.Tensor) else v for k, v in inner.items()})


def standalone(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of wrapper ``tensor`` over fresh CPU copies of its inner tensors (``state_dict`` during a
    session returns these, as it returns standalone copies of plain tensors)."""
    inner = {
        k: (standalone(v) if is_wrapper(v) else v.detach().to("cpu", copy=True))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in _inner(tensor).items()
    }
    return _rebuilt(tensor, inner)


def holders(wrappers: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The id of every plain inner tensor of ``wrappers`` (recursively) -> the outermost of them holding
    it, the object module tables hold (``wrappers`` inner ones first, as `find_wrappers` lists them)."""
    out: dict[int, torch.Tensor] = {}
    for w in wrappers:
        for v in _inner(w).values():
            if not isinstance(v, torch.Tensor):
                continue
            if is_wrapper(v):
                out.update({k: w for k, held in out.items() if held is v})
            else:
                out[id(v)] = w
    return out
