"""`from_checkpoint`: a topology from safetensors headers alone.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range, then the raw data. Only the first two are read here, so planning a
checkpoint of tens of GB reads a few kilobytes; the header is checked for sanity (offsets inside
the file, known dtypes, sizes consistent with shapes, no overlapping tensors) so a broken
checkpoint fails at planning time, naming the tensor and the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from torchferry._errors import PlanError
from torchferry.topology._model import (
    Block,
    Component,
    ComponentKind,
    Declaration,
    Stack,
    TensorSpec,
    Topology,
    dtype_size,
    join_path,
)

__all__ = ["SAFETENSORS_DTYPES", "HeaderEntry", "from_checkpoint", "read_header"]

#: safetensors dtype codes -> torch dtype names (without the ``torch.`` prefix).
SAFETENSORS_DTYPES: Mapping[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
# The safetensors format caps its header at 100 MB.
_MAX_HEADER_BYTES = 100 * 1000 * 1000
_ENCODER_HINTS = ("encoder", "mllm")
_VAE_HINTS = ("vae",)


@attrs.frozen(kw_only=True)
class HeaderEntry:
    """One tensor of a safetensors header: where its bytes are (relative to the data region)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    file: str


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(path: str | os.PathLike[str]) -> tuple[HeaderEntry, ...]:
    """The checked tensor entries of one safetensors file, in data order; reads the header only."""
    file = os.fspath(path)
    size = os.path.getsize(file)
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise PlanError(f"{file}: {size} bytes is too short for a safetensors file (no header length)")
        length = int.from_bytes(prefix, "little")
        if length > _MAX_HEADER_BYTES or 8 + length > size:
            raise PlanError(
                f"{file}: header length {length} does not fit a {size}-byte file; "
                "the file is truncated or not safetensors"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{file}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise PlanError(f"{file}: the safetensors header is a {type(header).__name__}, not a JSON object")
    data_bytes = size - 8 - length
    entries = [
        _entry(file, name, info, data_bytes) for name, info in header.items() if name != "__metadata__"
    ]
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise PlanError(f"{file}: '__metadata__' is a {type(metadata).__name__}, not a JSON object")
    entries.sort(key=lambda e: (e.begin, e.end, e.name))
    reach: HeaderEntry | None = None
    for current in entries:
        if current.begin == current.end:
            continue
        if reach is not None and current.begin < reach.end:
            raise PlanError(
                f"{file}: tensors {reach.name!r} and {current.name!r} overlap in the data region "
                f"(bytes {reach.begin}-{reach.end} and {current.begin}-{current.end})"
            )
        if reach is None or current.end > reach.end:
            reach = current
    return tuple(entries)


def _entry(file: str, name: str, info: object, data_bytes: int) -> HeaderEntry:
    where = f"{file}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise PlanError(f"{where} needs 'dtype', 'shape' and 'data_offsets' in the header, got {info!r}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if code not in SAFETENSORS_DTYPES:
        known = ", ".join(sorted(SAFETENSORS_DTYPES))
        raise PlanError(f"{where} has dtype {code!r}, which torchferry cannot stream; known dtypes: {known}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise PlanError(f"{where} has shape {shape!r}; a shape is a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise PlanError(f"{where} has data_offsets {offsets!r}; expected [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise PlanError(
            f"{where} has data_offsets [{begin}, {end}] outside the file's {data_bytes}-byte data region"
        )
    dtype = SAFETENSORS_DTYPES[code]
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * dtype_size(dtype)
    if end - begin != expected:
        raise PlanError(
            f"{where} spans {end - begin} bytes, but shape {tuple(shape)} of {dtype} needs {expected}"
        )
    return HeaderEntry(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end, file=file)


def _sources(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files ``path`` names, and the index's weight map when it is an index."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise PlanError(f"{path}: the folder holds no *.safetensors file")
        return files, None
    if not path.is_file():
        raise PlanError(f"{path}: no such checkpoint file or folder")
    if path.name.endswith(".json"):
        try:
            index = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"{path}: the index is not valid JSON ({exc})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise PlanError(f"{path}: an index needs a 'weight_map' object of tensor name -> shard file")
        files = [path.parent / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise PlanError(f"{path}: the index names shard {file.name!r}, which does not exist")
        return files, weight_map
    return [path], None


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


def _spec(entry: HeaderEntry) -> TensorSpec:
    return TensorSpec(name=entry.name, shape=entry.shape, dtype=entry.dtype)


def _component(
    prefix: str, kind: ComponentKind, attrs_: tuple[str, ...], entries: list[HeaderEntry]
) -> Component:
    blocks: dict[tuple[str, int], list[HeaderEntry]] = {}
    rest: list[HeaderEntry] = []
    by_length = sorted(attrs_, key=len, reverse=True)
    for entry in entries:
        relative = entry.name[len(prefix) + 1 :] if prefix else entry.name
        for attr in by_length:
            if relative.startswith(attr + "."):
                index, dot, _ = relative[len(attr) + 1 :].partition(".")
                if dot and index.isdigit():
                    blocks.setdefault((attr, int(index)), []).append(entry)
                    break
        else:
            rest.append(entry)

    def block(attr: str, index: int) -> Block:
        tensors = [_spec(e) for e in blocks[attr, index]]
        return Block(path=join_path(prefix, f"{attr}.{index}"), tensors=tensors)

    def ring(names: tuple[str, ...]) -> Stack:
        keys = sorted((k for k in blocks if k[0] in names), key=lambda k: (names.index(k[0]), k[1]))
        used = tuple(a for a in names if any(k[0] == a for k in keys))
        return Stack(attrs=used, blocks=[block(a, i) for a, i in keys])

    stacks: list[Stack] = []
    problems: list[str] = []
    if kind == "encoder":
        for attr in attrs_:
            count = sum(1 for k in blocks if k[0] == attr)
            if count > 1:
                stacks.append(ring((attr,)))
            else:
                problems.append(f"encoder block path {attr!r} has {count} block(s) in the checkpoint")
                rest.extend(e for k, es in blocks.items() if k[0] == attr for e in es)
    elif blocks:
        stacks.append(ring(attrs_))
    rest.sort(key=lambda e: (e.file, e.begin))
    return Component(
        path=prefix,
        kind=kind,
        tensors=[_spec(e) for e in rest],
        stacks=stacks,
        problems=problems,
    )


def from_checkpoint(
    path: str | os.PathLike[str],
    block_attrs: Sequence[str] | Mapping[str, Sequence[str]] = ("blocks",),
    *,
    declaration: Declaration | None = None,
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
    topology for `resolve` (resident DiT paths, encoder types and so on).
    """
    source = Path(os.fspath(path))
    if source.is_dir() and (source / "model_index.json").is_file():
        from torchferry.topology._folder import from_pipeline_folder

        by_component = _normalise(block_attrs) if isinstance(block_attrs, Mapping) else None
        return from_pipeline_folder(source, by_component, declaration=declaration)
    components = _normalise(block_attrs)
    files, weight_map = _sources(source)
    entries: list[HeaderEntry] = []
    owner_file: dict[str, str] = {}
    for file in files:
        for entry in read_header(file):
            if entry.name in owner_file:
                raise PlanError(
                    f"tensor {entry.name!r} is stored twice, in {owner_file[entry.name]} and {entry.file}"
                )
            owner_file[entry.name] = entry.file
            entries.append(entry)
    if weight_map is not None:
        for name, shard in weight_map.items():
            expected = os.fspath(source.parent / shard)
            if owner_file.get(name) != expected:
                raise PlanError(
                    f"{source}: the index maps tensor {name!r} to {shard!r}, but that shard's header has no "
                    "such tensor"
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
        shown = ", ".join(repr(n) for n in unmatched[:3])
        raise PlanError(
            f"{source}: {len(unmatched)} tensor(s) fall under none of the prefixes "
            f"{', '.join(repr(p) for p in components)} (e.g. {shown}); add their prefix to block_attrs"
        )
    multi = isinstance(block_attrs, Mapping)
    built = [_component(p, _kind(p, multi), components[p], grouped[p]) for p in components]
    order: dict[ComponentKind, int] = {"dit": 0, "encoder": 1, "vae": 2, "resident": 3}
    built.sort(key=lambda c: order[c.kind])
    return Topology(
        pipeline_class="",
        components=built,
        declaration=declaration,
        declares_components=True,
        source=f"checkpoint:{source}",
    )
