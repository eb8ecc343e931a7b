"""What `torchferry plan` reads: the model its argument names, and a resolution written as text.

A model is a known id, a hub id (its snapshot in the local cache), a diffusers pipeline folder or a
checkpoint, always read through headers, shipped specs or a pipeline built on the meta device, never
its data.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence

import attrs

from torchferry import topology
from torchferry._errors import PlanError
from torchferry.topology import KnownModel, Resolution, Topology

__all__ = ["load_model", "parse_resolution"]

_RESOLUTION = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?:x\s*(\d+)\s*f?)?\s*$", re.IGNORECASE)


def parse_resolution(text: str) -> Resolution:
    """``"1280x720x81"`` -> width 1280, height 720, 81 frames; ``"1024x1024"`` -> one frame."""
    match = _RESOLUTION.match(text)
    if match is None or any(int(g) < 1 for g in match.groups() if g is not None):
        raise ValueError(
            f"cannot read {text!r} as a resolution; write WIDTHxHEIGHT or WIDTHxHEIGHTxFRAMES, "
            "such as 1024x1024 or 1280x720x81"
        )
    width, height, frames = match.groups()
    return Resolution(height=int(height), width=int(width), frames=int(frames or 1))


def _looks_like_path(model: str) -> bool:
    return (
        os.path.exists(model)
        or model.endswith((".safetensors", ".json"))
        or (
            ("/" in model or os.sep in model)
            and topology.hub_snapshot(model) is None
            and topology.hub_model_id(model) is None
        )
    )


def _by_component(attrs_: Sequence[str], names: Sequence[str]) -> dict[str, tuple[str, ...]] | None:
    """A prefix mapping for a checkpoint of a whole pipeline, or ``None`` for a single model.

    A pipeline checkpoint names tensors ``<component>.<attr>.<i>…``: every guessed block attribute
    is dotted and they start with at least two different components (``transformer.blocks``,
    ``text_encoder.blocks``). Every first name part becomes a component, with the block attributes
    under it (none for, say, a VAE).
    """
    if not attrs_ or not all("." in a for a in attrs_):
        return None
    if len({a.split(".", 1)[0] for a in attrs_}) < 2 or not all("." in n for n in names):
        return None
    mapping: dict[str, list[str]] = {n.split(".", 1)[0]: [] for n in names}
    for a in attrs_:
        head, rest = a.split(".", 1)
        mapping[head].append(rest)
    return {k: tuple(v) for k, v in mapping.items()}


def _known_candidates() -> dict[str, Topology]:
    return {m: topology.known_topology(m) for m in (*topology.KNOWN_MODELS, *topology.KNOWN_ALIASES)}


#: Pipeline folder -> the `StoreFacts` of its pipeline built on the meta device (`store_facts`).
_FACTS: dict[str, topology.StoreFacts] = {}


#: Pipeline folder -> the (source, pipeline class) its topology has when a session discovers it.
_OPENED_AS: dict[str, tuple[str, str]] = {}


def opened_as(path: str) -> tuple[str, str] | None:
    """The ``(source, pipeline_class)`` a session's topology of the folder ``path`` planned last has
    (discovered from the pipeline), which its plan digest covers; ``None``: not built here."""
    return _OPENED_AS.get(path)


def store_facts(path: str) -> topology.StoreFacts:
    """What the host planner counts beyond the shapes of the folder ``path`` planned last (float32
    tensors its files store in 16 bits, strided tensors), as a session opened from it reads them."""
    return _FACTS.get(path, topology.StoreFacts())


def _read_facts(model: str, built: object, topo: Topology, checkpoint: str) -> None:
    """Read the `StoreFacts` of ``built`` (a pipeline or model on meta) opened from ``checkpoint`` as a
    session reads them, through the key map its library converts the checkpoint's names with
    (`topology.checkpoint_key_map`), and the identity its topology has there, for MODEL ``model``."""
    from torchferry.runtime import strided_names, widened_names

    paths = [c.path for c in topo.components]
    key_map = topology.checkpoint_key_map(built, paths, checkpoint)
    _FACTS[model] = topology.StoreFacts(
        widened=widened_names(built, topo, checkpoint, prefix_map=key_map), strided=strided_names(built, topo)
    )
    _OPENED_AS[model] = (topo.source, topo.pipeline_class)


def _built(path: str) -> Topology | None:
    """The topology of the folder's pipeline built on the meta device as `from_pretrained` builds it
    (what a session holds: non-persistent buffers included), or ``None`` when it cannot be built here
    (diffusers missing, a class it lacks, a component it cannot build on meta)."""
    from torchferry.load import pipeline_on_meta

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the models' own warnings while building; not the plan's
            pipeline = pipeline_on_meta(path)
        topo = topology.discover(pipeline)
        _read_facts(path, pipeline, topo, path)
    except Exception:  # planning falls back to the headers alone, and the report says so
        return None
    named = topology.read_pipeline_folder(path).pipeline_class
    return attrs.evolve(topo, source=f"pipeline:{path}", pipeline_class=named)


def _pipeline_folder(path: str, hub_id: str | None) -> tuple[Topology, KnownModel | None]:
    """A pipeline folder's topology, and the known model whose DiT shapes it has (or its hub id names).

    The topology is the pipeline built on the meta device (`_built`), so the plan counts what the
    session will hold byte for byte; when that cannot be built, the folder's headers alone, which
    lack the buffers a model computes instead of storing.
    """
    topo = _built(path) or topology.from_pipeline_folder(path)
    match = topology.known_match(topo, _known_candidates())
    if match is None and hub_id is not None:
        match = topology.hub_model_id(hub_id)
    return topo, None if match is None else topology.known_model(match)


def _gguf(model: str, compute_dtype: str | None = None) -> Topology | None:
    """The topology of the GGUF file ``model`` names (or the one ``.gguf`` of a folder), built on meta as
    diffusers' GGUF single-file load builds it (`torchferry.from_single_file`), from the header and
    the ``config.json`` beside it (or, without one, the class and configuration the header says:
    `topology.infer_gguf_model`), checked to fill it as the session checks (`topology.check_gguf_fits`),
    its layers computing in ``compute_dtype`` (default float32); ``None`` when ``model`` is neither."""
    import torch

    from torchferry.load import gguf_source, model_on_meta

    source = gguf_source(model)
    if source is None:
        return None
    file, model_class, config = source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the model's own warnings while building; not the plan's
        dtype = getattr(torch, compute_dtype or "float32")
        built = model_on_meta(model_class, file, config=config, compute_dtype=dtype)
        found = topology.discover(built)
        _read_facts(model, built, found, str(file))  # the session's facts and identity: not the path
    kind = "gguf" if config is not None else "gguf-inferred"  # no config.json: inferred from the file
    return attrs.evolve(found, source=f"{kind}:{file}", pipeline_class=model_class.__name__)


def load_model(
    model: str, block_attrs: Sequence[str] | None = None, *, compute_dtype: str | None = None
) -> tuple[Topology, KnownModel | None]:
    """The topology ``model`` names (a known id, a hub id, a pipeline folder or a checkpoint).

    - a diffusers pipeline folder (``model_index.json`` and a subfolder per component): its
      components from its headers (`topology.from_checkpoint`), with the known model whose DiT
      tensor names and shapes it has, for the compute estimate;
    - a hub id (``black-forest-labs/FLUX.1-dev``): its snapshot in the local Hugging Face cache when
      there is one (as a pipeline folder), else the known model it names;
    - a checkpoint file, folder or ``*.index.json``, read through its headers only; its block
      attributes are ``block_attrs`` or, when not given, guessed with `topology` ``guess_block_attrs`` (a
      checkpoint of a whole pipeline, its tensors named ``<component>.…``, becomes one component
      per name prefix);
    - a GGUF file (or a folder holding one, or a hub id whose snapshot in the cache holds one) with
      the model's ``config.json`` beside it, or its class and configuration inferred from its tensors
      without one: the model built on meta as diffusers loads it, so every
      quantized byte is counted (`_gguf`), its layers computing in ``compute_dtype`` (a GGUF
      model's only; default float32);
    - else a known id. Unknown ids and broken checkpoints raise `PlanError`.
    """
    snapshot = None if os.path.exists(model) else topology.hub_snapshot(model)
    local = model if snapshot is None else str(snapshot)  # a hub id: its snapshot in the cache
    found = _gguf(local, compute_dtype) if os.path.exists(local) else None
    if found is not None:
        return found, None
    if compute_dtype is not None:
        raise PlanError(
            f"{model}: --compute-dtype is the compute dtype of a GGUF model's layers, and this is no GGUF "
            "file nor a folder holding one; drop --compute-dtype"
        )
    folder = model if os.path.isdir(model) else (str(snapshot) if snapshot is not None else None)
    if folder is not None and topology.is_pipeline_folder(folder):
        if block_attrs is not None:
            raise PlanError(
                f"{folder}: --block-attrs is for a checkpoint of one model; a pipeline folder's block "
                "attributes come from each component's class (its config.json)"
            )
        return _pipeline_folder(folder, model if snapshot is not None else None)
    if not os.path.exists(model) and topology.is_hub_id(model) and topology.hub_model_id(model) is None:
        raise PlanError(
            f"{model}: no such checkpoint file or folder, nor a snapshot of that hub repository in "
            f"{topology.hub_cache_dir()}; torchferry downloads nothing, so fetch it first (hf download "
            f"{model}) or pass a known id (torchferry plan --list)"
        )
    if not _looks_like_path(model):
        return topology.known_topology(model), topology.known_model(model)
    if block_attrs is not None:
        return topology.from_checkpoint(model, block_attrs=tuple(block_attrs)), None
    flat = topology.from_checkpoint(model, block_attrs=())
    names = [t.name for c in flat.components for t in c.all_tensors()]
    guessed = topology.guess_block_attrs(names)
    if not guessed:
        return flat, None
    mapping = _by_component(guessed, names)
    if mapping is not None:
        return topology.from_checkpoint(model, block_attrs=mapping), None
    return topology.from_checkpoint(model, block_attrs=guessed), None
