"""What `offload` checks in its arguments before anything else, and the keywords it does not take.

A strategy name may stand where the config goes (``offload(pipe, "layerwise")``), and a CUDA device
this process cannot use is refused with that reason rather than torch's error from deep in a copy.
People also arrive with diffusers' offloading and loading options in their fingers; refusing them
with the list of valid options says nothing about what to write instead, so each familiar one gets
its torchferry equivalent (or the reason it has none) in the refusal.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from torchferry._errors import PlanError
from torchferry.policies import Policy
from torchferry.topology import OffloadConfig, memory_bytes

__all__ = [
    "DEVICE_TYPES",
    "EQUIVALENTS",
    "RING_KNOBS",
    "budget_options",
    "check_pipeline",
    "check_variant",
    "default_device",
    "is_auto",
    "offload_config",
    "positional",
    "require_cuda",
    "target_device",
    "unknown_options",
]

#: A diffusers or accelerate keyword -> what torchferry does instead, as a sentence.
EQUIVALENTS: dict[str, str] = {
    "variant": (
        "variant= picks a pipeline folder's weight files (diffusion_pytorch_model.fp16.safetensors): "
        "pass it to torchferry.from_pretrained(..., variant='fp16'), or give offload "
        "checkpoint=FOLDER and checkpoint_variant='fp16'"
    ),
    "low_cpu_mem_usage": (
        "low_cpu_mem_usage= has no equivalent because torchferry always loads that way: "
        "torchferry.from_pretrained builds every model on the meta device and reads each weight once; drop it"
    ),
    "onload_device": "onload_device= is device= here (where the weights compute)",
    "offload_device": "offload_device= has no equivalent: weights wait in host memory; drop it",
    "num_blocks_per_group": (
        "num_blocks_per_group= has no equivalent because torchferry moves one block per slot; how many "
        "load ahead is prefetch_depth= (or leave strategy to auto, which picks it)"
    ),
    "use_stream": (
        "use_stream= has no equivalent because torchferry always copies on its own CUDA stream, "
        "overlapped with compute; drop it"
    ),
    "record_stream": "record_stream= has no equivalent: torchferry orders its streams with events; drop it",
    "non_blocking": "non_blocking= has no equivalent: torchferry's copies never block compute; drop it",
    "offload_type": (
        "offload_type= is strategy= here: 'layerwise' streams blocks (diffusers' block_level), "
        "'model_level' swaps whole models"
    ),
    "device_map": "device_map= has no equivalent: torchferry places every weight itself; drop it",
    "max_memory": "max_memory= is device_memory= here (the device budget, such as '24GiB')",
    "torch_dtype": (
        "torch_dtype= is not offload's: offload never converts weights, so cast the pipeline before "
        "opening (pipe.to(dtype)), or pass torch_dtype= (or dtype=) to torchferry.from_pretrained"
    ),
    "dtype": (
        "dtype= is not offload's: offload never converts weights, so cast the pipeline before "
        "opening (pipe.to(dtype)), or pass dtype= to torchferry.from_pretrained"
    ),
}


def unknown_options(caller: str, unknown: Iterable[str], valid: Iterable[str]) -> str:
    """The refusal of the keywords ``unknown`` by ``caller``: each familiar one with its equivalent,
    then the valid options."""
    names = sorted(unknown)
    hints = [EQUIVALENTS[n] for n in names if n in EQUIVALENTS]
    message = f"{caller}() got unknown option(s) {', '.join(map(repr, names))}; "
    if hints:
        message += "; ".join(hints) + "; "
    return message + f"the options are the OffloadConfig fields: {', '.join(sorted(valid))}"


def require_cuda(target: torch.device, given: object) -> None:
    """Refuse a CUDA device this process cannot use, before torch's own error deep in a copy."""
    if target.type != "cuda":
        return
    if not torch.cuda.is_available():
        built = torch.version.cuda is not None
        why = "no CUDA device is visible" if built else "this torch is built without CUDA"
        raise PlanError(
            f"offload(device={given!r}): no CUDA device is available ({why}); run where a GPU is "
            "visible, or pass device='cpu'"
        )
    count = torch.cuda.device_count()
    if target.index is not None and target.index >= count:
        raise PlanError(
            f"offload(device={given!r}): this machine has {count} CUDA device(s), numbered 0 to "
            f"{count - 1}; pass one of those"
        )


def positional(config: object, strategy: str | None) -> tuple[OffloadConfig | None, str | None]:
    """The config and strategy of ``offload(pipe, X)``: a strategy name in the config's place is the
    strategy; anything else but a config is a `PlanError`."""
    if isinstance(config, str):
        if strategy is not None:
            raise PlanError(
                f"offload(pipe, {config!r}, strategy={strategy!r}): two strategies; pass one of them"
            )
        return None, config
    if config is not None and not isinstance(config, OffloadConfig):
        raise PlanError(
            f"offload(pipe, {type(config).__name__}): the second argument is an OffloadConfig or a "
            "strategy name ('auto', 'layerwise', ...); pass options as keywords (offload(pipe, "
            "strategy='layerwise', prefetch_depth=2))"
        )
    return config, strategy


def check_variant(variant: object, checkpoint: str | None) -> None:
    """Refuse a ``checkpoint_variant`` that is not a short name, or that comes without a checkpoint."""
    if variant is None:
        return
    if not isinstance(variant, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", variant):
        raise PlanError(
            f"offload(checkpoint_variant={variant!r}): a weight variant is a short name such as 'fp16' "
            "or 'bf16', the infix of diffusion_pytorch_model.fp16.safetensors"
        )
    if checkpoint is None:
        raise PlanError(
            f"offload(checkpoint_variant={variant!r}) picks which files of the checkpoint to read, and "
            "no checkpoint= is given; pass the pipeline folder as checkpoint="
        )


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


#: Device types a session streams to; ``meta`` only for tests (see docs/contract.md).
DEVICE_TYPES = ("cpu", "cuda", "meta")


def check_pipeline(pipeline: Any) -> None:
    """Refuse what cannot be a pipeline before anything else looks at it."""
    from torch import nn

    if isinstance(pipeline, nn.Module):
        return
    attributes = getattr(pipeline, "__dict__", None)
    if isinstance(attributes, dict) and any(isinstance(v, nn.Module) for v in attributes.values()):
        return
    shown = repr(pipeline)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise PlanError(
        f"torchferry.offload(pipeline): got {type(pipeline).__name__} {shown}, which is not a pipeline; "
        "pass a torch.nn.Module or an object whose attributes are modules (a diffusers pipeline)"
    )


def target_device(device: torch.device | str | None) -> torch.device:
    """The session's device, refused at `offload` unless its type is one torchferry streams to."""
    if device is None:
        return default_device()
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        target = None
    if target is None or target.type not in DEVICE_TYPES:
        raise PlanError(
            f"offload(device={device!r}): torchferry streams weights to 'cpu' or 'cuda' (with an index, "
            "'cuda:1'); 'meta' is accepted for tests only (nothing is computed there); pass one of those"
        )
    require_cuda(target, device)
    return target


def offload_config(
    config: OffloadConfig | None, strategy: str | None, options: Mapping[str, Any]
) -> OffloadConfig:
    """``config`` (defaults if none) with the strategy and keyword options applied; unknown ones refused."""
    changes = dict(options)
    if strategy is not None:
        changes["strategy"] = strategy
    fields = {f.name for f in attrs.fields(OffloadConfig)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise PlanError(unknown_options("offload", unknown, fields))
    base = config if config is not None else OffloadConfig()
    return attrs.evolve(base, **changes) if changes else base


def is_auto(
    config: OffloadConfig | None, strategy: str | None, policy: Policy | None, options: Mapping[str, Any]
) -> bool:
    """Whether the session chooses (``strategy="auto"``, the default when nothing else names a policy).

    A config, a strategy, a policy or a ring knob (`RING_KNOBS`) names one; ``strategy="auto"`` with
    a policy or a ring knob is a `PlanError` (auto picks the depth and resident blocks itself).
    """
    if strategy == "auto":
        named = [k for k in RING_KNOBS if k in options]
        if policy is not None:
            named.insert(0, "policy")
        if named:
            raise PlanError(
                f"offload(strategy='auto') with {' and '.join(f'{k}=' for k in named)}: auto picks the "
                "policy, its depth and its resident blocks itself; drop them, or name the strategy "
                "(strategy='layerwise')"
            )
        return True
    chosen = config is not None or policy is not None or any(k in options for k in RING_KNOBS)
    return strategy is None and not chosen


#: What a request may set that names a ring policy rather than leave the choice to auto (a resident
#: head given to auto would raise the budget its choice needs and then not be what it chose).
RING_KNOBS = ("prefetch_depth", "chunk_bytes", "resident_layers")


def budget_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with ``device_memory=`` and ``host_memory=`` as the config's byte fields
    (``"24GiB"`` or bytes; ``None`` is the default, left out); a budget named both ways is refused."""
    out = dict(options)
    for name, what in (("device_memory", "device"), ("host_memory", "host")):
        if name in out and out[name] is None:
            del out[name]  # the default
        if name not in out:
            continue
        if f"{name}_bytes" in out:
            raise PlanError(
                f"offload() got both {name}= and {name}_bytes=, two names for the {what} budget; pass "
                f"{name}= alone"
            )
        out[f"{name}_bytes"] = memory_bytes(out.pop(name), name)
    return out
