"""Spilling: the file-tier packs of a pipeline built in memory, written once as safetensors into a
folder the caller names (``spill=``), so the file tier can read them back like a checkpoint.

Each pack is one file (``spill-<pack>.safetensors``), its tensors in the file back to back, widest
dtype first (so every tensor starts at a multiple of its element size and can be viewed in place),
and ``spill.safetensors.index.json`` maps every tensor to its file. A pack is then one run of the
file: one ``preadv`` reads it. Tensors are written one at a time straight from their memory (a
non-contiguous one through a contiguous copy of itself), so spilling holds no second copy of the
model; each file is written under a temporary name and renamed into place once complete. The files
stay after the session closes: the pipeline's file-tier tensors then view them (delete the folder
once the pipeline is gone).
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from torchferry._errors import PlanError
from torchferry.policies import group_specs
from torchferry.topology import SAFETENSORS_DTYPES, Plan, find_attr

__all__ = ["INDEX_NAME", "spill"]

#: The index file of a spill folder (what the file tier opens).
INDEX_NAME = "spill.safetensors.index.json"
_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}


def _file_name(pack: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in pack)
    return f"spill-{safe}.safetensors"


def spill(pipeline: Any, plan: Plan, packs: Collection[str], folder: str | os.PathLike[str]) -> str:
    """Write the tensors of ``packs`` (file-tier pack names of ``plan``) from ``pipeline`` into
    ``folder``; returns the index path to read them from. Non-persistent buffers are not written (the
    file tier keeps the module's own bytes for them)."""
    where = Path(folder).expanduser()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlanError(
            f"spill={os.fspath(folder)!r}: cannot create the folder ({exc}); name a writable one"
        ) from None
    specs = group_specs(plan)
    weight_map: dict[str, str] = {}
    total = 0
    for name in sorted(packs):
        tensors: list[tuple[str, torch.Tensor]] = []
        for spec in specs[name]:
            if spec.buffer and not spec.persistent:
                continue
            t = find_attr(pipeline, spec.name)
            assert isinstance(t, torch.Tensor)
            if t.is_meta:
                raise PlanError(
                    f"spill: {spec.name} is on the meta device, so there is nothing to write; fill the "
                    "pipeline first, or open it from its checkpoint (checkpoint=) instead of spilling"
                )
            tensors.append((spec.name, t))
        file = _file_name(name)
        total += _write(where / file, tensors)
        weight_map.update(dict.fromkeys((n for n, _ in tensors), file))
    index = where / INDEX_NAME
    tmp = index.with_name(index.name + ".tmp")
    tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    tmp.replace(index)
    return str(index)


def _write(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> int:
    """One safetensors file of ``tensors`` (widest element first, no gaps); returns its data bytes."""
    ordered = sorted(tensors, key=lambda nt: -nt[1].element_size())
    header: dict[str, Any] = {}
    offset = 0
    for name, t in ordered:
        code = _CODES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise PlanError(
                f"spill: {name} is {t.dtype}, which safetensors cannot hold; keep it in host memory"
            )
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts on an 8-byte boundary
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, t in ordered:
            data = t.detach()
            if not data.is_contiguous():
                data = data.contiguous()
            n = data.numel() * data.element_size()
            if n:
                f.write((ctypes.c_char * n).from_address(data.data_ptr()))
    os.replace(tmp, path)
    return offset
