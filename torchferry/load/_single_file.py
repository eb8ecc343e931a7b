"""`from_single_file`: a diffusers model from one GGUF file, built on meta and filled from the file.

[Note: the model diffusers builds, without holding the file]
diffusers' ``ModelMixin.from_single_file(path, quantization_config=GGUFQuantizationConfig(
compute_dtype=...))`` reads every tensor of the file into memory, converts the names with the
class's ``checkpoint_mapping_fn``, swaps each ``nn.Linear`` whose weight is quantized (BF16
included) for a ``GGUFLinear``, keeps those weights as ``GGUFParameter`` bytes with their quant
type, casts F32/F16 tensors to ``compute_dtype`` (float32 in ``_keep_in_fp32_modules``), and
puts the model in eval mode. `model_on_meta` builds the same model from the header alone, every
parameter on the meta device with the dtype and shape diffusers would give it, and
`from_single_file` hands it to `torchferry.offload` with ``checkpoint=`` the file: the host store
fills from the file's aligned tensor data one block at a time, and the file tier reads the
quantized bytes from the ``.gguf`` itself. Host memory never holds the whole file unless the host
budget keeps every pack there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchferry._errors import PlanError
from torchferry.runtime import meta_parameters, model_entries
from torchferry.session import Session, offload
from torchferry.topology import (
    GGUF_CONFIG_FIX,
    GIVE_CONFIG,
    GGUFEntry,
    InferredModel,
    check_gguf_counts,
    check_gguf_fits,
    infer_gguf_model,
    is_gguf,
    kept_modules,
    read_gguf,
    read_json_object,
    under_kept,
)

__all__ = ["from_single_file", "gguf_source", "model_on_meta"]


def _config(model_class: Any, config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    where = Path(os.fspath(config))
    file = where / "config.json" if where.is_dir() else where
    if file.exists():  # read in torchferry's words first: a list, a deep nesting, not JSON at all
        read_json_object(
            file, "configuration given", "pass the model's folder (its config.json) or a dict as config="
        )
    try:
        loaded: dict[str, Any] = model_class.load_config(os.fspath(config))
    except Exception as exc:
        raise PlanError(
            f"from_single_file(config={os.fspath(config)!r}): no {model_class.__name__} configuration there "
            f"({type(exc).__name__}: {exc}); pass the model's folder (its config.json) or a dict"
        ) from None
    return loaded


def _diffusers_class(name: str, where: str) -> Any:
    """The diffusers model class named ``name`` (inferred from the file ``where``)."""
    import diffusers

    found = getattr(diffusers, name, None)
    if not isinstance(found, type):
        raise PlanError(
            f"{where}: is a {name} file, and this diffusers ({diffusers.__version__}) has no {name}"
        )
    return found


def _inferred(
    file: str, found: tuple[GGUFEntry, ...], model_class: Any
) -> tuple[Any, dict[str, Any], InferredModel]:
    """The class and configuration the header ``found`` says (`topology.infer_gguf_model`); a class
    other than ``model_class`` (when given) is a `PlanError`."""
    inferred = infer_gguf_model(file, found)
    if model_class is not None and model_class.__name__ != inferred.class_name:
        raise PlanError(
            f"{file}: its tensors are those of a {inferred.layout}, not of "
            f"{model_class.__name__}; pass {inferred.class_name}, or config= of the {model_class.__name__} "
            "the file was made from"
        )
    return model_class or _diffusers_class(inferred.class_name, file), inferred.config, inferred


def gguf_source(path: str | os.PathLike[str]) -> tuple[str, Any, dict[str, Any] | None] | None:
    """The GGUF file ``path`` names (itself, or the one ``*.gguf`` in a folder), the diffusers class
    its ``config.json`` (beside it) names, and that configuration; ``None`` if ``path`` holds no GGUF
    file. Without a ``config.json`` beside it the class is inferred from the file's tensors
    (`topology.infer_gguf_model`) and the configuration is ``None`` (`model_on_meta` infers it); a
    ``config.json`` that cannot be read or names no diffusers class is a `PlanError`."""
    where = Path(os.fspath(path))
    files = sorted(where.glob("*.gguf")) if where.is_dir() else [where]
    files = [f for f in files if f.is_file() and is_gguf(f)]
    if not files:
        return None
    if len(files) > 1:
        raise PlanError(f"{where}: holds {len(files)} GGUF files; name the one to plan")
    file = files[0]
    config_file = file.parent / "config.json"
    fix = (
        "put the model's config.json (from its diffusers folder, e.g. transformer/config.json) beside it, "
        "or remove it to infer the class and configuration from the file"
    )
    if not config_file.exists() and not config_file.is_symlink():
        model_class, _, _ = _inferred(str(file), read_gguf(file), None)
        return str(file), model_class, None
    config = read_json_object(config_file, f"config.json beside {file.name}", fix)
    import diffusers

    named = config.get("_class_name")
    model_class = getattr(diffusers, named, None) if isinstance(named, str) else None
    if not isinstance(model_class, type):
        raise PlanError(f"{config_file}: names no diffusers model class ('_class_name' is {named!r}); {fix}")
    return str(file), model_class, config


def model_on_meta(
    model_class: Any,
    path: str | os.PathLike[str],
    *,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """``model_class`` as diffusers' GGUF single-file load builds it, every parameter on meta.

    See the Note at the top of this module. ``config`` is the model's folder (its ``config.json``)
    or its configuration as a dict; nothing is downloaded. Without one, the class and configuration
    are inferred from the file's tensor names and shapes (`topology.infer_gguf_model`; a file of
    another class than ``model_class``, or of none torchferry recognises, is refused), and
    ``model_class`` may be ``None``. A file that is not GGUF, whose names
    diffusers' conversion cannot map, that does not fill the model the configuration builds (a
    tensor missing, of another shape, or one the model has no place for:
    `topology.check_gguf_fits`), or that quantizes a weight diffusers would dequantize at load (one
    of ``_keep_in_fp32_modules``) is a `PlanError`, raised before anything is read.
    """
    from diffusers.quantizers.gguf.utils import GGUFParameter, _replace_with_gguf_linear
    from gguf import GGMLQuantizationType

    file = os.fspath(path)
    if not is_gguf(file):
        raise PlanError(f"{file}: not a GGUF file (no GGUF magic); from_single_file reads .gguf files")
    found = read_gguf(file)
    inferred = None
    if config is None:
        model_class, values, inferred = _inferred(file, found, model_class)
    else:
        values = _config(model_class, config)
        check_gguf_counts(file, model_class.__name__, found, values)
    try:
        with meta_parameters():
            model: nn.Module = model_class.from_config(values)
    except Exception as exc:
        if inferred is None:  # a config.json of wrong types or values: diffusers' own error, worded
            raise PlanError.worded(
                f"{file}: the configuration given does not build {model_class.__name__} "
                f"({type(exc).__name__}: {exc}); ",
                GGUF_CONFIG_FIX,
            ) from None
        raise PlanError.worded(
            f"{file}: the {inferred.class_name} configuration inferred from its tensors ({inferred.layout}) "
            f"does not build ({type(exc).__name__}: {exc}); ",
            GIVE_CONFIG,
        ) from None
    state = model.state_dict(keep_vars=True)
    entries = model_entries(file, found, model_class, list(state), values)
    check_gguf_fits(
        file,
        model_class.__name__,
        {n: e.logical_shape for n, e in entries.items()},
        {n: tuple(t.shape) for n, t in state.items()},
        values,
        inferred=None if inferred is None else inferred.layout,
    )
    kept = sorted(kept_modules(model_class))  # every module the class keeps in float32
    dequantized = [n for n, e in entries.items() if e.quantized and under_kept(n, kept)]
    if dequantized:
        raise PlanError(
            f"{file}: {len(dequantized)} quantized tensor(s) ({', '.join(map(repr, dequantized[:3]))}) are "
            f"in modules {model_class.__name__} keeps in float32, which diffusers dequantizes at load; "
            "torchferry streams stored bytes only: store those tensors as F32 or F16"
        )
    parameter: Any = GGUFParameter
    quantized = {
        n: parameter(
            torch.empty(e.shape, dtype=torch.uint8, device="meta"),
            quant_type=GGMLQuantizationType[e.quant_type],
        )
        for n, e in entries.items()
        if e.quantized
    }
    replace: Any = _replace_with_gguf_linear
    replace(model, compute_dtype, quantized, modules_to_not_convert=kept)
    for name, entry in entries.items():
        if name not in state:
            continue  # (none: check_gguf_fits refuses a tensor the model has no place for)
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if name in quantized:
            value: torch.Tensor = quantized[name]
        else:
            dtype = torch.float32 if any(m in name.split(".") for m in kept) else compute_dtype
            old = state[name]
            value = torch.empty(
                entry.shape, dtype=dtype if old.dtype.is_floating_point else old.dtype, device="meta"
            )
            if leaf in module._parameters:
                value = nn.Parameter(value, requires_grad=old.requires_grad)
        if leaf in module._parameters:
            module._parameters[leaf] = value  # type: ignore[assignment]
        else:
            module._buffers[leaf] = value
    return model.eval()


def from_single_file(
    model_class: Any,
    path: str | os.PathLike[str],
    *,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    compute_dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> Session:
    """Open a session over ``model_class`` loaded from the GGUF file ``path`` as diffusers loads it.

    Reads like ``model_class.from_single_file(path, config=..., quantization_config=
    GGUFQuantizationConfig(compute_dtype=...))``, and gives that model, bit for bit: it is built on
    meta from the header (`model_on_meta`) and every other keyword goes to `torchferry.offload`
    (``host_memory=``, ``strategy=``, ``device=``...), which fills it from the file, never the whole
    file at once. Without ``config=`` the class and configuration are inferred from the file's tensor
    names and shapes, offline (`topology.infer_gguf_model`: Wan and FLUX, under their original names
    or diffusers'), and ``model_class`` may be ``None``; a configuration the file does not fill, given
    or inferred, is a `PlanError` naming each tensor that differs (`topology.check_gguf_fits`).
    Returns the open `Session`; its ``pipeline`` is the model::

        with torchferry.from_single_file(WanTransformer3DModel, "wan2.2-q4_k.gguf", config=folder,
                                         compute_dtype=torch.bfloat16, device="cuda") as session:
            pipe.transformer = session.pipeline
    """
    model = model_on_meta(model_class, path, config=config, compute_dtype=compute_dtype)
    return offload(model, checkpoint=os.fspath(path), **kwargs)
