"""What a session sets on the objects it serves, and takes off at close: refusals of moves, copies and
pickling, conversions that answer a no-op themselves, standalone ``state_dict`` copies, and
write-through wrappers of weight-editing methods (rules 3-5 of [Note: the session contract] in
`torchferry.runtime.guard._guard`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchferry._errors import ExecutionError
from torchferry.runtime.interop import Casting
from torchferry.runtime.memory import standalone
from torchferry.topology import is_wrapper

__all__ = ["Overrides"]

#: Instance attributes set on every served module as refusals (taken off by `Overrides.remove`, with
#: the conversions of `_CONVERSIONS`).
_REFUSED = ("_apply", "__deepcopy__", "__reduce_ex__")

#: Methods that write weights in place through ``.data`` (rule 5), wrapped on any object that has them;
#: ``merge``/``unmerge`` only on peft's layers, where they are a LoRA merge.
_WRITE_THROUGH = ("fuse_lora", "unfuse_lora", "merge_adapter", "unmerge_adapter")
_PEFT_WRITE_THROUGH = ("merge", "unmerge")


class _WriteThrough:
    """A weight-editing method of a served object, run by the guard with every weight at its host
    copy (rule 5)."""

    def __init__(self, method: Callable[..., Any], run: Callable[..., Any], what: str) -> None:
        self.method = method
        #: The guard's `SessionGuard.write_through`, which runs ``method`` at the host copies.
        self.run = run
        self.what = what

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.method, self.what, *args, **kwargs)


class _Refusal:
    """A callable that raises `ExecutionError` with a fixed message (set on a module instance)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ExecutionError(self.message)


@attrs.define
class _Moving:
    """How many lifecycle calls (``load_to_device``/``offload_to_cpu``) of served components run now."""

    depth: int = 0


class _Lifecycle:
    """An on-demand component's ``load_to_device`` or ``offload_to_cpu``, run with `_Moving` raised, so
    the blocks the session streams for it stay where the session keeps them (`_SkippedApply`)."""

    def __init__(self, method: Callable[..., Any], moving: _Moving) -> None:
        self.method = method
        self.moving = moving

    @property
    def __signature__(self) -> inspect.Signature:
        """The method's own signature (the engine asks whether ``load_to_device`` takes a device)."""
        return inspect.signature(self.method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.moving.depth += 1
        try:
            return self.method(*args, **kwargs)
        finally:
            self.moving.depth -= 1


class _SkippedApply(_Refusal):
    """``_apply`` of a block the session streams for an on-demand component: inside that component's
    own lifecycle call (its ``.to(device)``) the block is left as it is, since the session moves its
    weights; anywhere else the conversion is refused, as on every served module."""

    def __init__(self, message: str, module: nn.Module, moving: _Moving) -> None:
        super().__init__(message)
        self.module = module
        self.moving = moving

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.moving.depth:
            return self.module
        raise ExecutionError(self.message)


def _same_device(have: torch.device, want: torch.device) -> bool:
    """Whether ``Tensor.to(want)`` keeps a tensor on ``have`` (an index-less CUDA device: the current).

    torch's own rule for returning the tensor itself, not `runtime.same_device` (where a tensor is):
    ``Tensor.to("cpu:0")`` copies a tensor on ``cpu``.
    """
    index: int | None = want.index
    if have.type != want.type:
        return False
    if index is None:
        return have.type != "cuda" or have.index == torch.cuda.current_device()
    return have.index == index


@attrs.frozen
class _Target:
    """What a conversion asks of each tensor, as ``nn.Module``'s method applies it."""

    device: torch.device | None = None
    dtype: torch.dtype | None = None
    memory_format: torch.memory_format | None = None
    #: ``.to(dtype)`` converts complex tensors too; ``.float()`` and its kin floating ones only.
    complex_too: bool = True

    def changes(self, t: torch.Tensor) -> bool:
        """Whether the conversion would give ``t`` another tensor (torch's own rule)."""
        if self.device is not None and not _same_device(t.device, self.device):
            return True
        converts = t.is_floating_point() or (self.complex_too and t.is_complex())
        if self.dtype is not None and t.dtype != self.dtype and converts:
            return True
        if self.memory_format is None or t.dim() not in (4, 5):
            return False
        # Why: ``Tensor.to`` keeps a tensor when its suggested layout is the one asked for, which its
        # ``is_contiguous(memory_format)`` does not say (a contiguous 1x1 conv weight is both, and is
        # still copied to channels_last): a meta tensor of its strides answers by the same rule, free.
        twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return twin.to(memory_format=self.memory_format) is not twin


#: The shorthand conversions a served module answers itself when they change no tensor.
_SHORTHANDS = {
    "cpu": _Target(device=torch.device("cpu")),
    "float": _Target(dtype=torch.float32, complex_too=False),
    "double": _Target(dtype=torch.float64, complex_too=False),
    "half": _Target(dtype=torch.float16, complex_too=False),
    "bfloat16": _Target(dtype=torch.bfloat16, complex_too=False),
}
#: Every conversion method a served module answers itself when it would be a no-op (`_Conversion`).
_CONVERSIONS = ("to", *_SHORTHANDS)


def _target(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Target | None:
    """What conversion ``name`` called with these arguments asks, or ``None`` where ``nn.Module``'s
    method rejects them without converting (a ``.half(x)``, a ``.to(torch.int64)``): the method then
    says so itself. Arguments ``Tensor.to`` cannot parse raise here."""
    if name != "to":
        return None if args or kwargs else _SHORTHANDS[name]
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        return None
    return _Target(device=device, dtype=dtype, memory_format=memory_format)


#: Where a conversion method may be defined for `_Conversion` to answer a no-op itself: torch's own,
#: and diffusers' and transformers' model bases, which check quantization and call torch's.
_PLAIN_OWNERS = frozenset(
    {
        "torch.nn.modules.module.Module",
        "diffusers.models.modeling_utils.ModelMixin",
        "transformers.modeling_utils.PreTrainedModel",
    }
)


def _plain(module: nn.Module, name: str) -> bool:
    """Whether ``module.name`` is one of the plain conversions (`_PLAIN_OWNERS`) and no module under
    it converts its tensors its own way (a class ``_apply``): then a no-op is a no-op."""
    owner = next(c for c in type(module).__mro__ if name in vars(c))
    if f"{owner.__module__}.{owner.__qualname__}" not in _PLAIN_OWNERS:
        return False
    if getattr(module, "is_quantized", False):
        return False  # diffusers' and transformers' own checks refuse casts of quantized models
    return all(type(m)._apply is nn.Module._apply for m in module.modules())


class _Conversion:
    """A conversion method of a served module (`_CONVERSIONS`): a plain one (`_plain`) that changes no
    tensor returns the module, as plain torch does; any other goes on to the module's own method, which
    reaches the refused ``_apply`` before anything is converted (rule 3)."""

    def __init__(self, module: nn.Module, name: str, device: torch.device, casting: Casting | None) -> None:
        self.module = module
        self.name = name
        self.device = device
        self.__name__ = name
        #: The session's layerwise casts, which answer a cast layer's ``.to(dtype)`` (`Casting.convert`).
        self.casting = casting

    @property
    def __self__(self) -> nn.Module:
        """The module, as a bound method's (tools that read it, ``inspect``)."""
        return self.module

    @property
    def __signature__(self) -> inspect.Signature:
        """The signature of the module's own method (``.half()`` takes no argument)."""
        return inspect.signature(getattr(type(self.module), self.name).__get__(self.module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, name = self.module, self.name
        casting = self.casting
        if casting is not None and name == "to" and casting.convert(module, args, kwargs):
            return module
        # A move to a device of another type than the session's is never a no-op: between steps a
        # streamed block is at host memory, yet the session goes on serving it on its device.
        try:
            target = _target(name, args, kwargs)
            keeps = (
                target is not None
                and (target.device is None or target.device.type == self.device.type)
                and _plain(module, name)
                and not any(target.changes(t) for t in (*module.parameters(), *module.buffers()))
            )
        except (TypeError, ValueError, RuntimeError):
            keeps = False  # arguments the method itself rejects: let it say so
        if keeps:
            return module
        return getattr(type(module), name)(module, *args, **kwargs)


class Overrides:
    """The instance attributes and hooks a session sets on the objects it serves (rules 3-5), kept
    so that `remove` takes every one off again."""

    def __init__(
        self, device: torch.device, write_through: Callable[..., Any], casting: Casting | None = None
    ) -> None:
        #: The session device: a conversion to a device of another type is never a no-op.
        self.device = device
        #: The layers cast around their forward ([Note: layerwise casting] in `_casting`).
        self.casting = casting
        #: The guard's `SessionGuard.write_through`, which each wrapped method runs through.
        self.write_through = write_through
        # Why: every module whose conversions, copies and pickling are refused, with its path.
        self._modules: list[tuple[str, nn.Module]] = []
        self._handles: list[RemovableHandle] = []
        # Why: the objects given write-through methods (rule 5) and the names, removed at close.
        self._wrapped: list[tuple[object, str]] = []
        # Why: raised while an on-demand component's own lifecycle call runs (see `_SkippedApply`).
        self._moving = _Moving()

    def install(
        self, modules: list[tuple[str, nn.Module]], managed: set[int], lifecycle: frozenset[int] = frozenset()
    ) -> None:
        """Set the refusals and conversions on every served module (``modules``, with their paths),
        and a ``state_dict`` hook on each that holds a managed tensor (an ``id`` in ``managed``).
        Modules whose ``id`` is in ``lifecycle`` (the streamed blocks of on-demand components) are
        left alone by their component's own lifecycle calls (see `lifecycles`)."""
        self._modules.extend(modules)
        for path, module in modules:
            where = f"{path!r}" if path else "the pipeline"
            refusals = {
                "_apply": (
                    f".to()/.half()/.float()/.cuda()/.to('meta') of {where} (a conversion through "
                    "nn.Module._apply) while a torchferry session serves it would replace weights the "
                    "session holds; close() the session first, then move or convert the pipeline"
                ),
                "__deepcopy__": self._copy_message(where, "copy.deepcopy"),
                "__reduce_ex__": (
                    f"pickling or copying {where} (torch.save, copy.copy) while a torchferry session serves "
                    "it: its hooks and weight buffers belong to the session; save its state_dict() instead "
                    "(it returns standalone tensors during a session), or close() the session first"
                ),
            }
            for attr, message in refusals.items():
                refusal = _Refusal(message)
                if attr == "_apply" and id(module) in lifecycle:
                    refusal = _SkippedApply(message, module, self._moving)
                object.__setattr__(module, attr, refusal)
            for name in _CONVERSIONS:
                object.__setattr__(module, name, _Conversion(module, name, self.device, self.casting))
            owned = [
                (key, table)
                for table in (module._parameters, module._buffers)
                for key, t in table.items()
                if t is not None and id(t) in managed
            ]
            if owned:
                hook = self._state_dict_hook(owned)
                self._handles.append(module.register_state_dict_post_hook(hook))  # type: ignore[no-untyped-call]

    @staticmethod
    def _copy_message(where: str, what: str) -> str:
        return (
            f"{what} of {where} while a torchferry session serves it: the copy would share the session's "
            "hooks and weight buffers and fail once it closes; copy after close(), or build the copy "
            "from state_dict() (standalone tensors during a session)"
        )

    def _state_dict_hook(self, owned: list[tuple[str, dict[str, Any]]]) -> Callable[..., None]:
        def hook(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
            copies: dict[int, torch.Tensor] = getattr(state, "_torchferry_copies", None) or {}
            for key, table in owned:
                name = prefix + key
                t = table.get(key)
                value = state.get(name)
                if t is None or value is None or value is t:
                    continue  # keep_vars=True: the caller asked for the live objects
                copy = copies.get(id(t))
                if copy is None and is_wrapper(t):
                    copy = copies[id(t)] = standalone(t)
                elif copy is None:
                    copy = torch.empty(tuple(t.shape), dtype=t.dtype)
                    copy.copy_(t.detach())
                    copies[id(t)] = copy
                state[name] = copy
            # A plain dict passed as the destination takes no attribute: ties are then copied twice.
            with contextlib.suppress(AttributeError):
                state._torchferry_copies = copies  # type: ignore[attr-defined]

        return hook

    def lifecycles(self, components: list[nn.Module]) -> None:
        """Wrap ``load_to_device``/``offload_to_cpu`` of each on-demand component whose blocks the
        session streams: whoever calls them (the pipeline around its encode, or the session's own
        acquire and release), its streamed blocks stay where the session keeps them."""
        for module in components:
            for name in ("load_to_device", "offload_to_cpu"):
                method = getattr(module, name, None)
                if callable(method) and not isinstance(method, _Lifecycle):
                    object.__setattr__(module, name, _Lifecycle(method, self._moving))
                    self._wrapped.append((module, name))

    def wrap(self, objects: list[tuple[str, object]]) -> None:
        """Wrap the weight-editing methods (rule 5) of each of ``objects`` (with their paths)."""
        for path, obj in objects:
            names: tuple[str, ...] = _WRITE_THROUGH
            if type(obj).__module__.split(".")[0] == "peft":
                names = names + _PEFT_WRITE_THROUGH
            for name in names:
                method = getattr(obj, name, None)
                if not callable(method) or isinstance(method, _WriteThrough):
                    continue
                what = f"{path or 'pipeline'}.{name}"
                try:
                    object.__setattr__(obj, name, _WriteThrough(method, self.write_through, what))
                except (AttributeError, TypeError):
                    continue  # an object without an instance dict keeps its method (none such in diffusers)
                self._wrapped.append((obj, name))

    def remove(self) -> None:
        """Take every refusal, conversion, wrapper and ``state_dict`` hook off the served objects."""
        for obj, name in self._wrapped:
            vars(obj).pop(name, None)
        self._wrapped.clear()
        for _, module in self._modules:
            for attr in (*_REFUSED, *_CONVERSIONS):
                module.__dict__.pop(attr, None)
        self._modules.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.casting is not None:
            self.casting.remove()
