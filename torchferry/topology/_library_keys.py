"""`library_key_map`: the checkpoint names a model's own library reads it by, asked of that library.

transformers keeps, per model class (and per ``model_type``), the renames and conversions its
``from_pretrained`` applies to a checkpoint's keys (``conversion_mapping.get_model_conversion_mapping``
collects them for a model and its sub-models; ``core_model_loading.rename_source_key`` applies
them to one key). diffusers renames the attention blocks of old single-file checkpoints
(``ModelMixin._fix_state_dict_keys_on_load``). Both are asked here, with the keys the files hold,
so torchferry reads a folder exactly as the library that wrote it loads it, for whatever version
of the library is installed; nothing is listed by hand. See [Note: names in the files and names in
the modules] in `torchferry.topology._keymap`.

The models are only read (their class, configuration, module tree and state-dict names; meta
tensors are fine) and the libraries are imported only when a model of theirs is given.
"""

from __future__ import annotations

import copy
import importlib
import os
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from torchferry._errors import PlanError
from torchferry.topology._folder import pipeline_sources
from torchferry.topology._keymap import Conversion, KeyMap
from torchferry.topology._locate import locate
from torchferry.topology._safetensors import read_header

__all__ = ["checkpoint_key_map", "library_key_map"]


def _library(model: Any) -> str:
    return type(model).__module__.split(".")[0]


def library_key_map(
    models: Mapping[str, Any],
    file_keys: Iterable[str],
    prefix_map: Mapping[str, str] | None = None,
    *,
    sharded: Collection[str] = (),
) -> KeyMap:
    """``prefix_map`` (a `KeyMap`) with the renames and conversions the models' libraries apply
    when they load a checkpoint holding ``file_keys``.

    ``models`` maps a path from the pipeline root (``"text_encoder"``; ``""`` for a model that is
    the whole pipeline) to the model there; its keys in the checkpoint are those under the
    checkpoint prefix ``prefix_map`` gives its path. A key is renamed only where the library's
    name for it is one of the model's tensors and the file does not already hold that name, so a
    checkpoint already saved under the module's names reads as before. ``sharded`` names the paths
    whose weights are split over several files (diffusers renames legacy keys of one file only).
    """
    base = KeyMap.of(prefix_map)
    keys = frozenset(file_keys)
    renames: dict[str, str] = {}
    conversions: list[Conversion] = []
    for path, model in models.items():
        lead = f"{path}." if path else ""
        stored = base.key(lead)
        local = {k[len(stored) :]: k for k in keys if k.startswith(stored)}
        if not local:
            continue
        names = _state_names(model)
        if _library(model) == "transformers":
            found, converted = _transformers(model, local, names)
        elif _library(model) == "diffusers" and path not in sharded:
            found, converted = _diffusers(model, local, names), []
        else:
            continue
        for name, key in found.items():
            if name not in local:  # a file already naming the module's tensor is read as it is
                renames[lead + name] = key
        for c in converted:
            conversions.append(
                Conversion(
                    library=c.library,
                    component=path,
                    model_class=c.model_class,
                    operation=c.operation,
                    sources=c.sources,
                    targets=tuple(lead + t for t in c.targets),
                    apply=None if c.apply is None else _prefixed(c.apply, lead),
                )
            )
    if not renames and not conversions:
        return base
    return base.with_library(renames, conversions)


def _state_names(model: Any) -> frozenset[str]:
    """The names ``model.state_dict()`` would have (persistent tensors; meta is fine)."""
    return frozenset(model.state_dict(keep_vars=True))


def _transformers(
    model: Any, local: Mapping[str, str], names: frozenset[str]
) -> tuple[dict[str, str], list[Conversion]]:
    """transformers' renames (model name -> checkpoint key) and conversions for ``model``, applied to
    the checkpoint's keys ``local`` (model-relative key -> full key) as its ``from_pretrained`` does."""
    try:
        mapping = importlib.import_module("transformers.conversion_mapping")
        loading = importlib.import_module("transformers.core_model_loading")
        transforms = mapping.get_model_conversion_mapping(model)
    except (ImportError, AttributeError):  # a transformers without conversion mappings renames nothing
        return {}, []
    renamings = [t for t in transforms if isinstance(t, loading.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, loading.WeightConverter)]
    known = dict.fromkeys(names, True)
    prefix = getattr(model, "base_model_prefix", None)
    renames: dict[str, str] = {}
    groups: dict[tuple[int, str], tuple[Any, list[tuple[str, str, str]], list[str]]] = {}
    for rel in sorted(local, key=loading.dot_natural_key):  # the order transformers collects them in
        renamed, pattern = loading.rename_source_key(rel, renamings, converters, prefix, known)
        if renamed not in names and rel in names:
            renamed, pattern = rel, None  # as transformers: a key the model already has stays
        if renamed not in names:
            continue
        if pattern is None:
            if renamed != rel:
                renames[renamed] = local[rel]
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        group = groups.setdefault((id(converter), renamed), (converter, [], []))
        group[1].append((rel, local[rel], pattern))
        if not group[2]:
            first = converter.target_patterns[0]
            group[2].extend(renamed.replace(first, t) for t in converter.target_patterns)
    conversions = [
        Conversion(
            library="transformers",
            component="",
            model_class=type(model).__name__,
            operation=_operation(converter),
            sources=[full for _, full, _ in sources],
            targets=targets,
            apply=_converting(model, converter, targets[0], sources),
        )
        for converter, sources, targets in groups.values()
    ]
    return renames, conversions


def _converting(
    model: Any, converter: Any, first: str, sources: list[tuple[str, str, str]]
) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    """transformers' own conversion of ``sources`` ((model-relative key, checkpoint key, pattern)) into
    the tensors named from ``first`` on, as its loader runs it: a fresh copy of ``converter`` is
    given each stored tensor, in the loader's order, and its ``convert`` makes the targets."""

    def apply(stored: Mapping[str, Any]) -> Mapping[str, Any]:
        fresh = copy.deepcopy(converter)
        for rel, full, pattern in sources:
            fresh.add_tensor(first, rel, pattern, (lambda t=stored[full]: t))
        made = fresh.convert(first, model=model, config=model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in made.items()}

    return apply


def _prefixed(
    apply: Callable[[Mapping[str, Any]], Mapping[str, Any]], lead: str
) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    """``apply`` with its tensors named from the pipeline root (under ``lead``)."""
    return lambda stored: {lead + k: v for k, v in apply(stored).items()}


def _operation(converter: Any) -> str:
    """A converter's operations in a few words (``Concatenate(dim=0)``, ``Chunk(dim=0)``)."""
    ops = getattr(converter, "operations", ()) or ()
    words = []
    for op in ops:
        fields = (
            {k: v for k, v in vars(op).items() if not k.startswith("_")} if hasattr(op, "__dict__") else {}
        )
        words.append(f"{type(op).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})")
    return " then ".join(words) or type(converter).__name__


def _diffusers(model: Any, local: Mapping[str, str], names: frozenset[str]) -> dict[str, str]:
    """diffusers' legacy renames of one file's keys (model name -> checkpoint key), from the model."""
    fix = getattr(model, "_fix_state_dict_keys_on_load", None)
    if fix is None:
        return {}
    state: dict[str, str] = {rel: rel for rel in local}
    fix(state)  # renames keys in place; the values travel with them, so they say where each came from
    return {name: local[rel] for name, rel in state.items() if name != rel and name in names}


def checkpoint_key_map(
    pipeline: Any,
    paths: Iterable[str],
    checkpoint: str | os.PathLike[str],
    variant: str | None = None,
    prefix_map: Mapping[str, str] | None = None,
) -> KeyMap:
    """`library_key_map` for the models at ``paths`` of ``pipeline`` (top-level component paths;
    ``""`` for the pipeline itself) over the keys ``checkpoint`` holds (a pipeline folder's
    ``<component>.<key>``, or a file, folder or index), read from its headers alone.

    A file whose header cannot be read is left out here: the reader reports it with every other
    problem of the checkpoint.
    """
    models = {}
    for path in paths:
        model: Any = pipeline
        for part in path.split(".") if path else ():
            model = getattr(model, part, None)
        if _library(model) in ("transformers", "diffusers"):
            models[path] = model
    if not models:
        return KeyMap.of(prefix_map)
    try:
        folder = pipeline_sources(checkpoint, variant)
        if folder is not None:
            files, _, prefixes = folder
        else:
            files, prefixes = list(locate(checkpoint).files), {}
    except PlanError:
        return KeyMap.of(prefix_map)  # the reader names what is wrong with the checkpoint
    keys: list[str] = []
    for file in files:
        try:
            keys.extend(prefixes.get(file, "") + e.name for e in read_header(file))
        except PlanError:
            continue
    per_component = Counter(prefixes.values()) if prefixes else Counter({"": len(files)})
    sharded = {p.removesuffix(".") for p, n in per_component.items() if n > 1}
    return library_key_map(models, keys, prefix_map, sharded=sharded)
