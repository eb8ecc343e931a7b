"""Quantized checkpoints in `from_pretrained`: a model built on meta as diffusers builds it to load one.

A folder that diffusers' ``save_pretrained`` wrote for a quantized model carries the quantization
config in the component's ``config.json`` (``quantization_config``) and the quantized tensors in its
safetensors files. `quantize_on_meta` gives the model `from_pretrained` built on the meta device
(`torchferry.load._pretrained`) the structure diffusers' own load gives it, with every byte still on meta,
so the host store and the file tier fill it from the files like any model (docs/quantized.md,
"Quantized checkpoints"):

- **torchao** (``TorchAoConfig``, saved by torchao 0.16 or newer as safetensors): diffusers keeps
  the ``nn.Linear`` layers and sets each quantized weight to the wrapper tensor torchao rebuilds from
  the file's metadata. Here torchao's own ``unflatten_tensor_state_dict`` rebuilds every wrapper over
  meta tensors of the header's shapes and dtypes, and the checkpoint reader reads its parts under
  discovery's names (`torchferry.topology._quantized`).
- **optimum-quanto** (``QuantoConfig``): diffusers' quantizer replaces the Linear layers by quanto's
  ``QLinear`` and freezes them on meta, then sets ``weight._data`` and ``weight._scale`` from the
  file. Here the same quantizer does the first step, and each inner tensor gets the header's shape
  and dtype; the file's names are already discovery's.

Every other quantization method, and quantized transformers components, are refused with a
`PlanError` naming the method and what to do instead, before anything is read.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from torchferry._errors import PlanError
from torchferry.topology import (
    FolderComponent,
    HeaderEntry,
    find_attr,
    flattened_names,
    header_metadata,
    load_json,
    locate,
    open_regular,
    parse_header,
)

__all__ = ["OPENED", "quantization_method", "quantize_on_meta"]

#: The quantization methods whose saved folders `from_pretrained` opens.
OPENED = ("torchao", "quanto")

#: Why each other method diffusers knows is refused, and what to do instead.
_REFUSED: Mapping[str, str] = {
    "bitsandbytes": (
        "bitsandbytes keeps its 8-bit and 4-bit weights in its own parameter classes (Int8Params, "
        "Params4bit) with quantization state beside them, not in tensor subclasses whose inner tensors "
        "torchferry can re-point, and its kernels need CUDA"
    ),
    "gguf": (
        "diffusers does not save GGUF models with save_pretrained; open the .gguf file itself "
        "(docs/quantized.md, GGUF)"
    ),
    "bfl": (
        "Black Forest Labs' FP8 and NVFP4 layers are loaded from BFL's own files and not saved by "
        "save_pretrained"
    ),
    "modelopt": "NVIDIA ModelOpt's quantized layers keep calibration state torchferry does not stream",
    "nunchaku_lite": "nunchaku's SVDQuant layers are fused CUDA kernels with packed weights of their own",
    "auto-round": "auto-round's packed weights are unpacked by its own kernels at load time",
    "sdnq": "SDNQ's packed weights are unpacked by its own layers at load time",
}


def quantization_method(comp: FolderComponent) -> str | None:
    """The ``quant_method`` of the component's ``config.json``, or ``None`` for a plain model."""
    file = comp.folder / "config.json"
    try:
        config = load_json(file.read_bytes())
    except (OSError, ValueError):
        return None  # building the model reports a missing or broken config
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quant, dict):
        return None
    method = quant.get("quant_method")
    return str(method) if method is not None else "unknown"


def _refuse(comp: FolderComponent, method: str, why: str) -> PlanError:
    return PlanError(
        f"component {comp.name!r} is a {method}-quantized checkpoint ({comp.folder}/config.json has "
        f"quantization_config with quant_method {method!r}), and torchferry cannot stream it: {why}; load "
        f"that component with its library ({comp.index_class}.from_pretrained(folder, "
        f"subfolder={comp.name!r})) and pass it as from_pretrained(..., {comp.name}=model), or save the "
        "model unquantized and quantize it after loading (docs/quantized.md lists the checkpoints that "
        "open)"
    )


def quantize_on_meta(model: nn.Module, comp: FolderComponent, method: str) -> None:
    """Give ``model`` (built on meta from ``comp``'s configuration) the quantized structure diffusers'
    load of ``comp``'s folder gives it, each quantized weight a wrapper over meta inner tensors of the
    shapes and dtypes the files store; refuse a method or library it does not open (`PlanError`)."""
    if method not in OPENED:
        why = _REFUSED.get(method, f"torchferry opens only {' and '.join(OPENED)} checkpoints")
        raise _refuse(comp, method, why)
    if type(model).__module__.split(".")[0] != "diffusers":
        raise _refuse(
            comp,
            method,
            "torchferry opens the quantized checkpoints of diffusers models only; transformers rebuilds "
            "its quantized layers with loading code of its own",
        )
    quantizers: Any = importlib.import_module("diffusers.quantizers")
    config: Any = model.config
    try:
        quantizer = quantizers.DiffusersAutoQuantizer.from_config(
            dict(config.quantization_config), pre_quantized=True
        )
    except (ImportError, ValueError) as exc:
        raise _refuse(comp, method, f"diffusers cannot load its quantization config ({exc})") from None
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    entries = _header(comp)
    quantizer.preprocess_model(model=model, device_map=None, keep_in_fp32_modules=keep)
    if method == "quanto":
        _quanto_parts(model, entries)
    else:
        _torchao_wrappers(model, comp, entries)
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer


def _header(comp: FolderComponent) -> dict[str, HeaderEntry]:
    """The component's header entries, under discovery's names (torchao's parts renamed)."""
    assert comp.source is not None
    found: dict[str, HeaderEntry] = {}
    for file in locate(comp.source).files:
        with open_regular(file) as handle:
            renamed = flattened_names(header_metadata(file, handle))
            for entry in parse_header(file, handle):
                found[renamed.get(entry.name, entry.name)] = entry
    return found


def _meta(entry: HeaderEntry) -> torch.Tensor:
    return torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device="meta")


def _quanto_parts(model: nn.Module, entries: Mapping[str, HeaderEntry]) -> None:
    """Each frozen quanto weight's inner tensors as the file stores them (diffusers sets each one from
    the file with ``setattr``; a part the file lacks is reported when the session validates it)."""
    tensors: Any = importlib.import_module("optimum.quanto")
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, tensors.QTensor):
            continue
        names, _ = weight.__tensor_flatten__()
        for part in names:
            entry = entries.get(f"{name}.weight.{part}" if name else f"weight.{part}")
            if entry is not None:
                setattr(weight, part, _meta(entry))


def _torchao_wrappers(model: nn.Module, comp: FolderComponent, entries: Mapping[str, HeaderEntry]) -> None:
    """Each torchao wrapper the files describe, rebuilt by torchao over meta tensors of its parts and
    set as its module's parameter, as diffusers sets it (``nn.Parameter(wrapper)``)."""
    support: Any = importlib.import_module("torchao.prototype.safetensors.safetensors_support")
    assert comp.source is not None
    metadata: dict[str, str] = {}
    listed: list[str] = []
    for file in locate(comp.source).files:
        with open_regular(file) as handle:
            found = header_metadata(file, handle)
        metadata.update(found)
        try:
            names = load_json(found.get("tensor_names", "[]"))
        except ValueError as exc:
            names = exc
        if not isinstance(names, list):
            raise PlanError(
                f"{file}: its 'tensor_names' metadata is not a JSON list ({names}); re-save the "
                "checkpoint with torchao's save_pretrained"
            )
        listed.extend(names)
    flat = {v: k for k, v in flattened_names(metadata).items()}  # discovery's name -> the file's
    wrappers = [n for n in dict.fromkeys(listed) if "." in n and any(k.startswith(n + ".") for k in flat)]
    parts = {flat[k]: _meta(e) for k, e in entries.items() if k in flat}
    described = {"tensor_names": json.dumps(wrappers), **{n: metadata[n] for n in wrappers}}
    try:
        rebuilt, _ = support.unflatten_tensor_state_dict(parts, described)
    except Exception as exc:
        raise _refuse(
            comp, "torchao", f"torchao cannot rebuild its tensors from the files' metadata ({exc})"
        ) from None
    for name, wrapper in rebuilt.items():
        owner, attr = name.rsplit(".", 1)
        try:
            module = find_attr(model, owner)
        except AttributeError:
            continue  # a tensor the model lacks: the session's validation names it
        if isinstance(module, nn.Module) and attr in module._parameters:
            module._parameters[attr] = nn.Parameter(wrapper)
