"""`from_pretrained`: a diffusers pipeline built from its folder, every weight read once into the host store.

[Note: why Pipeline.from_pretrained under meta_parameters() still loads everything]
diffusers' ``ModelMixin.from_pretrained`` (``low_cpu_mem_usage=True``, its default) builds each model
under accelerate's ``init_empty_weights`` (parameters on meta), then *loads the state dict into it*:
``load_model_dict_into_meta`` reads every shard with ``safetensors.torch.load_file`` and assigns each
tensor into ``module._parameters[name]`` directly, bypassing ``register_parameter``. transformers'
``PreTrainedModel.from_pretrained`` likewise materialises every parameter from the files. So a
``torchferry.meta_parameters()`` block around ``Pipeline.from_pretrained`` sees parameters created
on meta and then replaced by loaded CPU tensors: nothing is left on meta, the whole model is in
memory, and ``offload(checkpoint=...)`` would then hold it a second time.

`from_pretrained` therefore never calls a model's ``from_pretrained``. Each model component is
built from its configuration alone under `meta_parameters` (diffusers: ``Cls.from_config(
Cls.load_config(subfolder))``; transformers: ``Cls(Cls.config_class.from_pretrained(subfolder))``),
its parameters given the dtypes the files store, and put in eval mode as ``from_pretrained`` leaves
it; the other components (schedulers, tokenizers) load with their own ``from_pretrained`` (they hold
no weights); the pipeline class is called with them and with the other values of
``model_index.json``; and `torchferry.offload(pipeline, checkpoint=folder)` fills the host store
straight from the files, one block at a time. Host memory is then about one copy of the model from
the start (measured by ``benchmarks/load.py``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from torchferry._errors import PlanError
from torchferry.load._prequantized import quantization_method, quantize_on_meta
from torchferry.runtime import meta_parameters
from torchferry.session import Session, offload, unknown_options
from torchferry.topology import (
    FolderComponent,
    OffloadConfig,
    from_checkpoint,
    hub_snapshot,
    is_pipeline_folder,
    kept_modules,
    library_key_map,
    library_module,
    locate,
    read_pipeline_folder,
    under_kept,
)

__all__ = ["build_on_meta", "from_pretrained", "pipeline_on_meta", "resolve_folder"]


def resolve_folder(model: str | os.PathLike[str]) -> Path:
    """The local pipeline folder ``model`` names: a path, or a hub id found in the local hub cache.

    Nothing is downloaded: a hub id that is not in the cache is a `PlanError` saying how to fetch it.
    """
    path = Path(os.fspath(model)).expanduser()
    if path.is_dir():
        return path
    text = os.fspath(model)
    snapshot = hub_snapshot(text)
    if snapshot is not None:
        return snapshot
    if path.exists():
        raise PlanError(f"{text}: a pipeline is a folder with a model_index.json, and this is a file")
    raise PlanError(
        f"{text}: no such folder, nor a hub id in the local Hugging Face cache; download it first "
        f"(hf download {text}, or Pipeline.from_pretrained once), or pass the folder's path"
    )


def _class(comp: FolderComponent) -> Any:
    module = _library(comp)
    cls = getattr(module, comp.index_class, None)
    if cls is None:
        raise PlanError(
            f"component {comp.name!r}: {comp.library} has no class {comp.index_class!r} (model_index.json "
            f"names it); upgrade {comp.library}"
        )
    return cls


def _library(comp: FolderComponent) -> Any:
    """The module ``comp``'s library names, resolved as diffusers resolves it (`library_module`)."""
    try:
        pipelines: Any = importlib.import_module("diffusers.pipelines")
    except ImportError:
        pipelines = None
    local = pipelines is not None and comp.library.isidentifier() and hasattr(pipelines, comp.library)
    name = library_module(comp.library, pipeline_local=local, imported=comp.library in sys.modules)
    if name is None:
        raise PlanError(
            f"component {comp.name!r} is a {comp.library}.{comp.index_class}, and {comp.library} is neither "
            "a library diffusers loads components from (diffusers, transformers) nor one of its pipeline "
            f"modules; import {comp.library} before from_pretrained if it is your own module, or pass the "
            f"component yourself (from_pretrained(..., {comp.name}=...))"
        )
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise PlanError(
            f"component {comp.name!r} is a {comp.library}.{comp.index_class}, and {name} cannot be "
            f"imported ({exc}); install it"
        ) from None


def _build_model(comp: FolderComponent, cls: type[nn.Module]) -> nn.Module:
    """``cls`` built from the subfolder's configuration with its parameters on the meta device."""
    where = f"component {comp.name!r} ({cls.__module__.split('.')[0]}.{cls.__name__})"
    how = (
        f"load that component yourself ({cls.__name__}.from_pretrained(folder, subfolder={comp.name!r})) "
        f"and pass it as from_pretrained(..., {comp.name}=model)"
    )
    load_config = getattr(cls, "load_config", None)
    config_class = getattr(cls, "config_class", None)
    try:
        with meta_parameters():
            if load_config is not None and hasattr(cls, "from_config"):
                model = cls.from_config(load_config(str(comp.folder)))
            elif config_class is not None and hasattr(config_class, "from_pretrained"):
                model = cls(config_class.from_pretrained(str(comp.folder)))
            else:
                raise PlanError(
                    f"{where} is neither a diffusers ModelMixin nor a transformers PreTrainedModel, so "
                    f"torchferry cannot build it from its configuration; {how}"
                )
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError(
            f"{where} could not be built from its configuration with its parameters on the meta device "
            f"({type(exc).__name__}: {exc}); {how}"
        ) from None
    if not isinstance(model, nn.Module):
        raise PlanError(f"{where}: building it from its configuration gave a {type(model).__name__}; {how}")
    return model.eval()


def _kept_in_float32(model: nn.Module, dtype: torch.dtype) -> frozenset[str]:
    """The module names ``model``'s library keeps in float32 when it loads ``model`` in ``dtype``
    (`topology.kept_modules`: diffusers' and transformers' rules)."""
    return kept_modules(model, str(dtype).removeprefix("torch."))


#: What ``torch_dtype`` may be: one dtype, or diffusers' mapping of component name (or ``"default"``)
#: to a dtype.
TorchDtype = torch.dtype | Mapping[str, torch.dtype] | None


def _dtypes(torch_dtype: TorchDtype, names: set[str]) -> Mapping[str, torch.dtype] | torch.dtype | None:
    """``torch_dtype`` checked: a dtype, ``None``, or a mapping whose keys are component names (or
    ``"default"``) and whose values are dtypes."""
    if torch_dtype is None or isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    if not isinstance(torch_dtype, Mapping):
        raise PlanError(
            f"from_pretrained(torch_dtype={torch_dtype!r}): torch_dtype is a torch.dtype, or a mapping of "
            "component names (and 'default') to dtypes, as in diffusers"
        )
    wrong = [f"{k!r}: {v!r}" for k, v in torch_dtype.items() if not isinstance(v, torch.dtype)]
    unknown = sorted(repr(k) for k in torch_dtype if k != "default" and k not in names)
    if wrong or unknown:
        what = f"values that are not dtypes ({', '.join(wrong)})" if wrong else ""
        if unknown:
            what += (" and " if what else "") + f"names no component of the folder ({', '.join(unknown)})"
        raise PlanError(
            f"from_pretrained(torch_dtype=...) has {what}; map component names ({', '.join(sorted(names))}) "
            "or 'default' to torch dtypes"
        )
    return torch_dtype


def _dtype_of(dtypes: Mapping[str, torch.dtype] | torch.dtype | None, name: str) -> torch.dtype | None:
    """The dtype ``torch_dtype`` asks of component ``name`` (``None``: whatever the files store)."""
    if dtypes is None or isinstance(dtypes, torch.dtype):
        return dtypes
    return dtypes.get(name, dtypes.get("default"))


def _stored_dtypes(
    model: nn.Module,
    name: str,
    stored: Mapping[str, str],
    torch_dtype: torch.dtype | None,
    problems: list[str],
) -> None:
    """Give every meta parameter the dtype its file stores (loading copies bytes, never converts),
    except under a module the library keeps in float32 at that dtype (`_kept_in_float32`): those are
    float32 and read widened from their 16-bit files, as diffusers and transformers load them.

    A tied parameter (one object under several names) is stored under any one of its names; it is
    given that name's dtype under every name, so the tie holds.
    """
    places: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                full = f"{name}.{module_name}.{attr}" if module_name else f"{name}.{attr}"
                places.setdefault(id(param), (param, []))[1].append((module, attr, full))
    for param, where in places.values():
        found = next(((full, stored[full]) for _, _, full in where if full in stored), None)
        if found is None:
            continue  # not in the files: validated (and reported) when the session opens
        full, dtype_name = found
        dtype = getattr(torch, dtype_name)
        keep = _kept_in_float32(model, torch_dtype or dtype)
        if dtype.is_floating_point and under_kept(full.split(".", 1)[1], keep):
            dtype = torch.float32  # stored float32, or widened from 16 bits as it is read
        elif torch_dtype is not None and dtype.is_floating_point and dtype != torch_dtype:
            asked = str(torch_dtype).removeprefix("torch.")
            problems.append(f"{full} is stored as {dtype_name}, not {asked}")
        if param.is_meta and param.dtype != dtype:
            replaced = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="meta"), param.requires_grad)
            for module, attr, _ in where:
                module._parameters[attr] = replaced
    for module_name, module in model.named_modules():
        for attr, buf in list(module._buffers.items()):
            full = f"{name}.{module_name}.{attr}" if module_name else f"{name}.{attr}"
            stored_as = stored.get(full)
            if buf is not None and stored_as is not None and str(buf.dtype) != f"torch.{stored_as}":
                module._buffers[attr] = buf.to(getattr(torch, stored_as))


def _by_module_names(model: nn.Module, comp: FolderComponent, stored: Mapping[str, str]) -> Mapping[str, str]:
    """``stored`` (checkpoint key -> dtype) with the model's own names added where its library saves
    them under others (`topology.library_key_map`: transformers 5 writes Qwen2.5-VL's language model
    as ``model.layers.*``, for one); a tensor it converts on load has its first source's dtype."""
    assert comp.source is not None
    sharded = (comp.name,) if len(locate(comp.source).files) > 1 else ()
    keys = library_key_map({comp.name: model}, stored, sharded=sharded)
    if not keys.renames and not keys.conversions:
        return stored
    made = {t: stored[c.sources[0]] for c in keys.conversions for t in c.targets if c.sources[0] in stored}
    return {**stored, **made, **{name: stored[key] for name, key in keys.renames.items() if key in stored}}


def from_pretrained(
    pipeline_class: Any,
    pretrained_model_name_or_path: str | os.PathLike[str],
    *,
    torch_dtype: TorchDtype = None,
    dtype: TorchDtype = None,
    variant: str | None = None,
    **kwargs: Any,
) -> Session:
    """Build ``pipeline_class`` from a diffusers pipeline folder, its weights read straight into host buffers.

    Reads like ``pipeline_class.from_pretrained(folder, ...)``: ``pretrained_model_name_or_path`` is a
    pipeline folder (``model_index.json`` and a subfolder per component) or a hub id already in the
    local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``);
    keyword arguments named after components (``text_encoder=model``, ``tokenizer=None``) replace them
    as in diffusers, and every other keyword goes to `torchferry.offload` (``strategy=``,
    ``device=``, ``device_memory=``, ``host_memory=``, any `OffloadConfig` field). Model components
    are built on the meta device from their configurations and filled from the files once, so host
    memory holds about one copy of the model (see the Note at the top of this module). Parameters
    take the dtypes the files store; ``dtype`` (or its older name ``torch_dtype``), when given, must
    be that dtype (weights are copied, never converted); as in diffusers it may map component names
    (and ``"default"``) to dtypes. One exception, as in diffusers and transformers: the modules a
    model class keeps in float32 (``_keep_in_fp32_modules``) are float32, widened exactly from
    16-bit files, under the same rule as their library's load (diffusers: always; transformers: for
    float16, and its strict list for bfloat16 too), so the result equals
    ``Pipeline.from_pretrained(folder, dtype=...)`` bit for bit; without ``dtype`` the rule applies
    to the stored dtype. ``variant`` (``"fp16"``) reads each component's files of that weight
    variant, as diffusers' ``variant=`` does. Other diffusers keywords are refused with their
    torchferry equivalent (``low_cpu_mem_usage`` has none: loading is always low in host memory).
    ``pipeline_class`` may be ``diffusers.DiffusionPipeline``, which builds the class
    ``model_index.json`` names. Returns the open `Session`; its ``pipeline`` is the pipeline,
    called as usual::

        with torchferry.from_pretrained(FluxPipeline, "black-forest-labs/FLUX.1-dev", device="cuda") as s:
            image = s.pipeline("a ferry at dawn").images[0]

    A component diffusers saved quantized with torchao or optimum-quanto is built as diffusers builds
    it to load one and filled with its quantized bytes; other quantization methods are refused with
    the reason (docs/quantized.md, Quantized checkpoints). A component diffusers or transformers
    cannot build under meta, a folder without safetensors weights, or a request ``offload`` rejects
    is a `PlanError`, raised before anything is read.
    """
    if dtype is not None and torch_dtype is not None:
        raise PlanError(
            "from_pretrained() got both dtype= and torch_dtype=, two names for one dtype; pass dtype="
        )
    folder = resolve_folder(pretrained_model_name_or_path)
    asked = dtype if dtype is not None else torch_dtype
    pipeline, options, built = build_on_meta(pipeline_class, folder, asked, kwargs, variant)
    _refuse_unknown(options)
    return offload(
        pipeline, checkpoint=str(folder), checkpoint_variant=variant, checkpoint_components=built, **options
    )


def _refuse_unknown(options: Mapping[str, Any]) -> None:
    """Refuse, naming from_pretrained, a keyword neither a component nor an option of `offload`."""
    fields = {f.name for f in attrs.fields(OffloadConfig)}
    named = set(inspect.signature(offload).parameters) - {"pipeline", "config", "config_options"}
    unknown = set(options) - fields - named - {"device_memory", "host_memory"}
    if unknown:
        raise PlanError(unknown_options("from_pretrained", unknown, fields))


def pipeline_on_meta(folder: str | os.PathLike[str]) -> Any:
    """The pipeline ``model_index.json`` names, built from ``folder`` as `from_pretrained` builds it
    (every model on the meta device, in its stored dtypes), so a plan sees what a session would hold:
    non-persistent buffers (RoPE tables) that no checkpoint stores included. Reads no weight data."""
    path = resolve_folder(folder)
    found = read_pipeline_folder(path)
    try:
        diffusers = importlib.import_module("diffusers")
    except ImportError as exc:
        raise PlanError(
            f"{path}: building {found.pipeline_class} needs diffusers ({exc}); install it"
        ) from None
    cls = getattr(diffusers, found.pipeline_class, None)
    if not isinstance(cls, type):
        raise PlanError(
            f"{path}: model_index.json names the pipeline class {found.pipeline_class!r}, which diffusers "
            "does not have; upgrade diffusers"
        )
    pipeline, _, _ = build_on_meta(cls, path, None, {})
    return pipeline


def _why(folder: Path, exc: Exception) -> str:
    """Why a component's own ``from_pretrained`` failed on ``folder``, in a few words."""
    if not folder.is_dir():
        return "the subfolder does not exist"
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    said = said if len(said) <= 200 else said[:197] + "..."
    return f"the subfolder is broken: {type(exc).__name__}: {said}"


def _pipeline_class(given: Any, named: str, folder: Path) -> Any:
    """The class to build: ``given``, or, for a base class of the one ``model_index.json`` names
    (``DiffusionPipeline``), that one."""
    if not isinstance(given, type):
        raise PlanError(
            f"from_pretrained({given!r}, {str(folder)!r}): the first argument is the pipeline class to "
            f"build; {folder}'s model_index.json names {named} (pass diffusers.{named}, or "
            "diffusers.DiffusionPipeline to build the class the folder names)"
        )
    if given.__name__ == named:
        return given
    try:
        found = getattr(importlib.import_module("diffusers"), named, None)
    except ImportError:
        return given
    return found if isinstance(found, type) and issubclass(found, given) else given


def build_on_meta(
    pipeline_class: Any,
    folder: Path,
    torch_dtype: TorchDtype,
    kwargs: Mapping[str, Any],
    variant: str | None = None,
) -> tuple[Any, dict[str, Any], list[str]]:
    """The pipeline with every model parameter on meta, the keywords left for `offload`, and the
    components built here (to fill from the folder; a component given by keyword keeps its weights):
    the first half of `from_pretrained`, public for an engine that opens the session later on its own
    device (``offload(..., checkpoint=folder, checkpoint_components=built)`` fills them)."""
    if not is_pipeline_folder(folder):
        raise PlanError(
            f"{folder}: no model_index.json, so this is not a diffusers pipeline folder; pass the folder "
            "save_pretrained wrote (or a hub snapshot), or load a bare model and use torchferry.offload"
        )
    found = read_pipeline_folder(folder, variant)
    pipeline_class = _pipeline_class(pipeline_class, found.pipeline_class, folder)
    dtypes = _dtypes(torch_dtype, {c.name for c in found.components})
    signature = inspect.signature(pipeline_class.__init__)
    accepted = {
        n
        for n, p in signature.parameters.items()
        if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    names = {c.name for c in found.components} | set(found.absent) | {k for k, _ in found.init_values}
    given = {k: v for k, v in kwargs.items() if k in names or k in accepted}
    options = {k: v for k, v in kwargs.items() if k not in given}
    if "checkpoint" in options:
        raise PlanError(
            "from_pretrained(checkpoint=...): the checkpoint is the pipeline folder itself; drop checkpoint="
        )
    if "checkpoint_components" in options:
        raise PlanError(
            "from_pretrained(checkpoint_components=...): the components built from the folder fill from "
            "it, and those given by keyword keep their own weights; drop checkpoint_components="
        )
    stored = {
        t.name: t.dtype for c in from_checkpoint(folder, variant=variant).components for t in c.all_tensors()
    }
    values: dict[str, Any] = {}
    problems: list[str] = []
    for comp in found.components:
        if comp.name in given or comp.name not in accepted:
            continue
        cls = _class(comp)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            if comp.source is None:
                raise PlanError(
                    f"component {comp.name!r} ({comp.index_class}): {comp.folder} holds no *.safetensors "
                    "weights, and torchferry reads safetensors only; re-save the pipeline with "
                    "save_pretrained (safetensors is its default) or pass the component yourself"
                )
            model = _build_model(comp, cls)
            method = quantization_method(comp)
            if method is not None:
                quantize_on_meta(model, comp, method)  # docs/quantized.md, Quantized checkpoints
            named = _by_module_names(model, comp, stored)
            _stored_dtypes(model, comp.name, named, _dtype_of(dtypes, comp.name), problems)
            values[comp.name] = model
        else:
            loader = getattr(cls, "from_pretrained", None)
            if loader is None:
                raise PlanError(
                    f"component {comp.name!r}: {comp.library}.{comp.index_class} has no from_pretrained; "
                    f"pass it yourself as from_pretrained(..., {comp.name}=...)"
                )
            try:
                values[comp.name] = loader(str(comp.folder))
            except Exception as exc:
                raise PlanError(
                    f"component {comp.name!r} ({comp.library}.{comp.index_class}) could not be loaded from "
                    f"{comp.folder} ({_why(comp.folder, exc)}); re-save or re-download the pipeline (nothing "
                    f"is downloaded here), or pass the component yourself (from_pretrained(..., "
                    f"{comp.name}=...), or {comp.name}=None to leave it out)"
                ) from None
    if problems:
        shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
        raise PlanError(
            f"from_pretrained(dtype={torch_dtype}): {len(problems)} tensor(s) of {folder} are stored in "
            f"another dtype than it asks ({shown}); torchferry copies the stored bytes and never converts, "
            "so save the pipeline in that dtype first (pipe.to(dtype).save_pretrained(...)) or drop dtype="
        )
    for name in found.absent:
        if name in accepted and name not in given:
            values[name] = None
    for name, value in found.init_values:
        if name in accepted and name not in given:
            values[name] = value
    values.update(given)
    try:
        pipeline = pipeline_class(**values)
    except Exception as exc:
        raise PlanError(
            f"{pipeline_class.__name__}(...) could not be built from {folder} ({type(exc).__name__}: {exc}); "
            "pass the missing components as keywords, as to its own from_pretrained"
        ) from None
    built = [name for name, value in values.items() if name not in given and isinstance(value, nn.Module)]
    return pipeline, options, built

