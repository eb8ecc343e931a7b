"""`from_checkpoint`: a topology from a checkpoint's safetensors headers alone, without reading data.

A file, a folder of shards or an ``*.index.json`` is described here, its components named by
tensor-name prefixes; a diffusers pipeline folder (``model_index.json``) goes to
`from_pipeline_folder`, which reads the components from the folder itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from torchferry._errors import PlanError
from torchferry.topology._folder import from_pipeline_folder, is_pipeline_folder
from torchferry.topology._grouping import by_kind, component_from_entries
from torchferry.topology._locate import locate, shard_header
from torchferry.topology._model import ComponentKind, Declaration, Topology
from torchferry.topology._safetensors import HeaderEntry, read_header, show

__all__ = ["from_checkpoint"]

_ENCODER_HINTS = ("encoder", "mllm")
_VAE_HINTS = ("vae",)


def _normalise(block_attrs: Sequence[str] | Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    def attrs_of(where: str, value: object) -> tuple[str, ...]:
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, Sequence) or not all(isinstance(a, str) for a in value):
            raise TypeError(f"{where} must be a sequence of attribute names, got {value!r}")
        return tuple(value)

    if isinstance(block_attrs, Mapping):
        for key in block_attrs:
            if not isinstance(key, str):
                raise TypeError(f"from_checkpoint(block_attrs=...) keys must be str prefixes, got {key!r}")
        return {k: attrs_of(f"from_checkpoint(block_attrs[{k!r}])", v) for k, v in block_attrs.items()}
    return {"": attrs_of("from_checkpoint(block_attrs=...)", block_attrs)}


def _kind(prefix: str, multi: bool) -> ComponentKind:
    if not multi:
        return "dit"
    leaf = prefix.rsplit(".", 1)[-1]
    if any(h in leaf for h in _ENCODER_HINTS):
        return "encoder"
    if any(h in leaf for h in _VAE_HINTS):
        return "vae"
    return "dit"


def from_checkpoint(
    path: str | os.PathLike[str],
    block_attrs: Sequence[str] | Mapping[str, Sequence[str]] = ("blocks",),
    *,
    declaration: Declaration | None = None,
    variant: str | None = None,
) -> Topology:
    """Describe a safetensors checkpoint (file, shard folder or ``*.index.json``) without reading data.

    A diffusers pipeline folder (``model_index.json`` and a subfolder per component) is described by
    `from_pipeline_folder`: components and block attributes come from the folder itself, and a
    mapping ``block_attrs`` overrides them per component name.

    ``block_attrs`` is either a sequence of block attributes (``("transformer_blocks",
    "single_transformer_blocks")``): the checkpoint is one DiT with path ``""`` and tensors named
    ``<attr>.<i>.…`` form its one ring, attributes in order and indices numerically; or a mapping
    from a tensor-name prefix to such attributes (``{"transformer": ("blocks",), "text_encoder":
    ("encoder.block",)}``) for a checkpoint that holds several components, each named by its
    prefix. A prefix whose last part contains ``encoder``/``mllm`` is an encoder (each attribute its
    own ring), one containing ``vae`` a VAE, anything else a DiT; every tensor must fall under one
    prefix (the longest wins; ``""`` matches everything). ``declaration`` is attached to the
    topology for `resolve` (resident DiT paths, encoder types and so on). ``variant`` (``"fp16"``)
    picks a pipeline folder's files of that weight variant; any other checkpoint names its files.
    """
    if is_pipeline_folder(path):
        by_component = _normalise(block_attrs) if isinstance(block_attrs, Mapping) else None
        return from_pipeline_folder(Path(path), by_component, declaration=declaration, variant=variant)
    if variant is not None:
        raise PlanError(
            f"{path}: variant={variant!r} picks the files of a diffusers pipeline folder, and this is "
            "not one (no model_index.json); point checkpoint= at the variant's own file instead"
        )
    components = _normalise(block_attrs)
    sources = locate(path)
    source = sources.path
    entries: list[HeaderEntry] = []
    owner_file: dict[str, str] = {}
    for file in sources.files:
        for entry in read_header(file) if sources.weight_map is None else shard_header(source, file):
            if entry.name in owner_file:
                raise PlanError(
                    f"tensor {show(entry.name)} is stored twice, in {owner_file[entry.name]} and {entry.file}"
                )
            owner_file[entry.name] = entry.file
            entries.append(entry)
    for name, shard in (sources.weight_map or {}).items():
        if owner_file.get(name) != shard:
            raise PlanError(
                f"{source}: the index maps tensor {show(name)} to {show(os.path.basename(shard))}, but that "
                "shard's header has no such tensor"
            )

    prefixes = sorted(components, key=len, reverse=True)
    grouped: dict[str, list[HeaderEntry]] = {p: [] for p in components}
    unmatched: list[str] = []
    for entry in entries:
        for prefix in prefixes:
            if not prefix or entry.name.startswith(prefix + "."):
                grouped[prefix].append(entry)
                break
        else:
            unmatched.append(entry.name)
    if unmatched:
        shown = ", ".join(show(n) for n in unmatched[:3])
        raise PlanError(
            f"{source}: {len(unmatched)} tensor(s) fall under none of the prefixes "
            f"{', '.join(repr(p) for p in components)} (e.g. {shown}); add their prefix to block_attrs"
        )
    multi = isinstance(block_attrs, Mapping)
    built = [component_from_entries(p, _kind(p, multi), components[p], grouped[p]) for p in components]
    return Topology(
        pipeline_class="",
        components=by_kind(built),
        declaration=declaration,
        declares_components=True,
        source=f"checkpoint:{source}",
    )
