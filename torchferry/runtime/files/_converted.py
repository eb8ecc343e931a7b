"""Model tensors a library makes from other stored tensors when it loads (`topology.Conversion`: a
fused or split weight), checked on meta tensors before anything is read and made by the library's
own function when the checkpoint reader fills a pack or the file tier reads one.

Such a tensor's bytes are not anywhere in a file, so the reader hands them over as bytes in memory
(a `FileSpan` with a ``source``), as it does a 16-bit float it widens. See [Note: names in the files and
names in the modules] in `torchferry.topology._keymap`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from torchferry.topology import Conversion, HeaderEntry, KeyMap, TensorSpec

__all__ = ["bytes_of", "conversion_problems", "converted"]


class CheckpointReader(Protocol):
    """What of `torchferry.runtime.CheckpointReader` a conversion reads (its path, key map, entries
    and stored tensors)."""

    @property
    def path(self) -> str: ...
    @property
    def prefix_map(self) -> KeyMap: ...
    @property
    def entries(self) -> Mapping[str, HeaderEntry]: ...
    def _stored(self, entry: HeaderEntry) -> torch.Tensor: ...


def _conversion(
    reader: CheckpointReader, name: str, prefix_map: Mapping[str, str] | None
) -> Conversion | None:
    keys = reader.prefix_map if prefix_map is None else KeyMap.of(prefix_map)
    return keys.converted(name) if keys.conversions else None


def conversion_problems(
    reader: CheckpointReader,
    spec: TensorSpec,
    prefix_map: Mapping[str, str] | None,
    claimed: set[str] | None,
) -> list[str] | None:
    """``None`` when no conversion makes ``spec``; else every reason the one that does cannot make it
    from ``reader``'s files as the model holds it (empty: it can), found by running it on meta
    tensors of the stored shapes and dtypes, so nothing is read. Its sources go to ``claimed``."""
    conversion = _conversion(reader, spec.name, prefix_map)
    if conversion is None:
        return None
    if claimed is not None:
        claimed.update(conversion.sources)
    if conversion.apply is None:
        return [conversion.problem(reader.path)]
    missing = [repr(k) for k in conversion.sources if k not in reader.entries]
    if missing:
        return [conversion.problem(reader.path, f"and the checkpoint lacks {', '.join(missing[:3])}")]
    stored = {
        k: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device="meta")
        for k in conversion.sources
        if (e := reader.entries[k]) is not None
    }
    try:
        made = conversion.apply(stored).get(spec.name)
    except Exception as exc:  # the library's own error, named in the refusal
        return [
            conversion.problem(reader.path, f"which fails on these tensors ({type(exc).__name__}: {exc})")
        ]
    if not isinstance(made, torch.Tensor):
        return [conversion.problem(reader.path, f"which does not make {spec.name!r} from these tensors")]
    wanted = spec.compute_dtype or spec.dtype
    if tuple(made.shape) != spec.shape or str(made.dtype).removeprefix("torch.") != wanted:
        got = f"{list(made.shape)} of {str(made.dtype).removeprefix('torch.')}"
        why = f"which makes {got} where the model holds {list(spec.shape)} of {wanted}"
        return [conversion.problem(reader.path, why)]
    return []


def converted(
    reader: CheckpointReader, name: str, prefix_map: Mapping[str, str] | None
) -> torch.Tensor | None:
    """Model tensor ``name`` made by its conversion from the stored tensors (read now), or ``None``
    when no conversion makes it; checked beforehand by `conversion_problems`."""
    conversion = _conversion(reader, name, prefix_map)
    if conversion is None or conversion.apply is None:
        return None
    stored = {k: reader._stored(reader.entries[k]) for k in conversion.sources}
    with torch.no_grad():
        made: torch.Tensor = conversion.apply(stored)[name]
    return made.contiguous()


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``tensor`` as one flat ``uint8`` view (a `FileSpan`'s ``source``)."""
    return tensor.reshape(-1).view(torch.uint8)
