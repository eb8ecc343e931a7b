"""Quantized safetensors checkpoints: the names torchao gives a wrapper tensor's parts in a file.

torchao (0.16 and newer; diffusers' and transformers' ``save_pretrained`` of a model quantized with
torchao use it) saves a wrapper tensor ``<module>.<param>`` (an ``Int8Tensor``, a ``Float8Tensor``)
as one safetensors entry per inner tensor, named ``<module>._<param>_<attribute>``
(``blocks.0.attn1.to_q._weight_qdata``), and describes the wrapper in the file's ``__metadata__``:
``tensor_names`` lists every tensor of the state dict, and each wrapper's name maps to a JSON object
with its class (``_type``) and the attributes holding its bytes (``_tensor_data_names``).

Discovery names the same inner tensors ``<module>.<param>.<attribute>`` (`torchferry.topology.
_wrapped`), and so does optimum-quanto's own format (``weight._data``, ``weight._scale``). The
checkpoint reader renames torchao's entries with `flattened_names`, so one name serves the model,
the plan and the file, and each inner tensor is read from the file as its stored bytes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import BinaryIO

import attrs

from torchferry.topology._json import load_json
from torchferry.topology._safetensors import MAX_HEADER_BYTES, HeaderEntry, strict_json

__all__ = ["flattened_names", "header_metadata", "quantized_names"]

#: The metadata key torchao writes, listing every tensor of the saved state dict.
_TENSOR_NAMES = "tensor_names"


def header_metadata(file: str, handle: BinaryIO) -> dict[str, str]:
    """The string entries of the ``__metadata__`` of the safetensors file open as ``handle`` when they
    hold torchao's ``tensor_names`` (``{}`` otherwise, without parsing the header a second time).

    Call it after `parse_header` checked the same header; a header it cannot read gives ``{}``.
    """
    size = os.fstat(handle.fileno()).st_size
    handle.seek(0)
    length = int.from_bytes(handle.read(8), "little")
    if length > MAX_HEADER_BYTES or 8 + length > size:
        return {}
    raw = handle.read(length)
    if f'"{_TENSOR_NAMES}"'.encode() not in raw:
        return {}
    header = strict_json(file, raw, "the safetensors header")
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        return {}
    return {k: v for k, v in metadata.items() if isinstance(k, str) and isinstance(v, str)}


def flattened_names(metadata: Mapping[str, str]) -> dict[str, str]:
    """torchao's file name of each inner tensor of a wrapper -> discovery's name for it.

    ``{"blocks.0.attn1.to_q._weight_qdata": "blocks.0.attn1.to_q.weight.qdata", ...}`` for every
    wrapper ``metadata`` describes (an entry of ``tensor_names`` whose description has
    ``_tensor_data_names``); plain tensors keep their names and are not listed. Metadata that is not
    torchao's gives ``{}``.
    """
    try:
        names = load_json(metadata.get(_TENSOR_NAMES, "[]"))
    except ValueError:
        return {}
    if not isinstance(names, list):
        return {}
    renamed: dict[str, str] = {}
    for name in names:
        if not isinstance(name, str) or "." not in name or name not in metadata:
            continue
        try:
            described = load_json(metadata[name])
        except ValueError:
            continue
        parts = described.get("_tensor_data_names") if isinstance(described, dict) else None
        if not isinstance(parts, list):
            continue
        module, param = name.rsplit(".", 1)
        for part in parts:
            if isinstance(part, str):
                renamed[f"{module}._{param}_{part}"] = f"{name}.{part}"
    return renamed


def quantized_names(
    file: str,
    handle: BinaryIO,
    entries: Sequence[HeaderEntry],
    index: Mapping[str, str] | None,
    prefix: str = "",
) -> tuple[tuple[HeaderEntry, ...], Mapping[str, str] | None]:
    """``entries`` of ``file`` (open as ``handle``, checked by `parse_header`) and the shard ``index``
    (its keys under ``prefix``), torchao's names for a wrapper's parts renamed to discovery's."""
    renamed = flattened_names(header_metadata(file, handle))
    if not renamed:
        return tuple(entries), index
    found = tuple(attrs.evolve(e, name=renamed.get(e.name, e.name)) for e in entries)
    if index is not None:
        names = {prefix + k: prefix + v for k, v in renamed.items()}
        index = {names.get(k, k) if f == file else k: f for k, f in index.items()}
    return found, index
