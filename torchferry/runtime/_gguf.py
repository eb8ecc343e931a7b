"""A GGUF file as a checkpoint: its tensors under the model's names, read as their stored bytes.

`model_entries` maps a GGUF file's tensors to the names of the model it fills, with diffusers' own
single-file conversion for the model's class (``SINGLE_FILE_LOADABLE_CLASSES[...]
["checkpoint_mapping_fn"]``, as ``from_single_file`` uses it), and `GGUFCheckpointReader` is the
`CheckpointReader` over those entries: the host store and the file tier read the quantized bytes
from the ``.gguf`` itself, with every check, budget and refusal of a safetensors checkpoint.

[Note: running diffusers' conversion on the header alone]
The conversion is run on meta tensors shaped as the header says (see topology's GGUF Note), so no
byte is read. What it returns for each model name is either one of the file's tensors renamed, or
a view of one (FLUX's fused qkv split by rows): a view's ``_base`` is the file's tensor and its
storage offset is where its bytes begin, and rows of a block-quantized tensor are contiguous, so
each model tensor is still one byte range of the file. A tensor the conversion *computes* (a
``cat``, a sum) is no byte range, and is refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from torchferry._errors import PlanError
from torchferry.runtime._checkpoint import CheckpointReader
from torchferry.topology import (
    GGUF_TYPES,
    FrozenMap,
    GGUFEntry,
    HeaderEntry,
    is_gguf,
    open_regular,
    parse_gguf,
)

__all__ = ["GGUFCheckpointReader", "mapping_function", "model_entries", "open_checkpoint"]

_BLOCKS = {name: (block, size) for name, block, size in GGUF_TYPES.values()}


def mapping_function(model_class: type) -> Any:
    """diffusers' single-file conversion for ``model_class`` (``None``: diffusers has none for it)."""
    try:
        from diffusers.loaders.single_file_model import (
            SINGLE_FILE_LOADABLE_CLASSES,
            _get_single_file_loadable_mapping_class,
        )
    except ImportError:
        return None
    name = _get_single_file_loadable_mapping_class(model_class)  # type: ignore[no-untyped-call]
    table: Any = SINGLE_FILE_LOADABLE_CLASSES
    return None if name is None else table[name]["checkpoint_mapping_fn"]


def _meta(entry: GGUFEntry) -> torch.Tensor:
    return torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device="meta")


def model_entries(
    file: str,
    entries: tuple[GGUFEntry, ...],
    model_class: type | None,
    model_names: Collection[str],
    config: Mapping[str, Any] | None = None,
) -> dict[str, GGUFEntry]:
    """The file's ``entries`` under the model's names (see the Note above).

    Names that already are the model's (diffusers' ``_should_convert_state_dict_to_diffusers`` is
    false) are kept; otherwise ``model_class``'s single-file conversion maps them. A file whose names
    are not the model's and no conversion applies is a `PlanError`.
    """
    by_name = {e.name: e for e in entries}
    if set(model_names) == set(by_name) or model_class is None:
        return dict(by_name)
    convert = mapping_function(model_class)
    if convert is None:
        raise PlanError(
            f"{file}: its tensor names are not {model_class.__name__}'s and diffusers has no single-file "
            "conversion for that class; write the file under the model's own names"
        )
    inputs = {name: _meta(e) for name, e in by_name.items()}
    owner = {id(t): by_name[name] for name, t in inputs.items()}
    kwargs: dict[str, Any] = {"checkpoint": dict(inputs)}
    if config is not None:
        kwargs["config"] = dict(config)
    try:
        converted = convert(**kwargs)
    except Exception as exc:  # a conversion's own failure: it did not recognise these names
        raise PlanError(
            f"{file}: diffusers' conversion for {model_class.__name__} failed on this file's names "
            f"({type(exc).__name__}: {exc}); is it a {model_class.__name__} checkpoint?"
        ) from None
    out: dict[str, GGUFEntry] = {}
    computed: list[str] = []
    for name, tensor in converted.items():
        root = tensor if tensor._base is None else tensor._base
        entry = owner.get(id(root))
        if entry is None or not tensor.is_contiguous():
            computed.append(name)
            continue
        begin = entry.begin + tensor.storage_offset() * tensor.element_size()
        shape = tuple(tensor.shape)
        block, size = _BLOCKS[entry.quant_type]
        logical = shape if not entry.quantized else (*shape[:-1], shape[-1] // size * block)
        out[name] = attrs.evolve(
            entry, name=name, shape=shape, begin=begin, end=begin + tensor.numel() * tensor.element_size(),
            logical_shape=logical,
        )  # fmt: skip
    if computed:
        shown = ", ".join(repr(n) for n in computed[:3]) + (", ..." if len(computed) > 3 else "")
        raise PlanError(
            f"{file}: diffusers' conversion for {model_class.__name__} computes {len(computed)} tensor(s) "
            f"({shown}) from the file's data rather than renaming or slicing them, so they are no byte "
            "range of the file; torchferry streams renamed and row-split tensors only"
        )
    return out


def _described(pipeline: Any, prefix_map: Mapping[str, str] | None) -> tuple[str, nn.Module | None]:
    """The prefix of the module a single file fills (``prefix_map`` ``{"transformer.": ""}``), and it."""
    prefixes = [p for p, to in (prefix_map or {}).items() if to == ""]
    prefix = prefixes[0] if len(prefixes) == 1 else ""
    module = pipeline
    if prefix and isinstance(pipeline, nn.Module):
        module = pipeline.get_submodule(prefix.rstrip("."))
    elif prefix:
        module = getattr(pipeline, prefix.rstrip("."), None)
    return prefix, module if isinstance(module, nn.Module) else None


class GGUFCheckpointReader(CheckpointReader):
    """A `CheckpointReader` over one GGUF file, its tensors under the model's names.

    ``module`` is the model the file fills (it names the conversion, and the dtype each F32/F16
    tensor is loaded in: as diffusers casts it to ``compute_dtype``, or keeps it in float32, on the
    way in). Quantized and BF16 tensors are copied as the file's bytes.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        module: nn.Module | None,
        prefix_map: Mapping[str, str] | None = None,
        widen: Collection[str] = (),
        module_prefix: str = "",
    ) -> None:
        self.path = str(path)
        self.prefix_map = FrozenMap(dict(prefix_map or {}))
        self.widen = frozenset(widen)
        self._handles = {}
        self._closed = False
        self._broken = {}
        self.files = (self.path,)
        self.components = ()
        self.problems = ()
        self.unreadable = ()
        state = module.state_dict(keep_vars=True) if module is not None else {}
        handle = open_regular(self.path)
        try:
            found = parse_gguf(self.path, handle)
        except BaseException:
            handle.close()
            raise
        self._handles[self.path] = handle  # the header's descriptor is the one the data is read from
        config = getattr(module, "config", None)
        try:
            entries = model_entries(
                self.path, found, None if module is None else type(module), list(state),
                config if isinstance(config, Mapping) else None,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        #: Model names (before ``prefix_map``) of F32/F16 tensors loaded in another float dtype.
        self.casts: dict[str, torch.dtype] = {}
        for name, entry in entries.items():
            tensor = state.get(name)
            if entry.quantized or not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
                continue
            if str(tensor.dtype).removeprefix("torch.") != entry.dtype:
                self.casts[module_prefix + name] = tensor.dtype
        self.entries = FrozenMap[str, HeaderEntry](dict(entries))
        self._cast_by_key = {self.key(n): d for n, d in self.casts.items()}

    def _widens(self, name: str, stored: str, wanted: str) -> bool:
        cast = self.casts.get(name)
        return cast is not None and str(cast).removeprefix("torch.") == wanted

    def _widened(self, entry: HeaderEntry) -> torch.Tensor:
        wanted = self._cast_by_key.get(entry.name, torch.float32)
        return self._stored(entry).to(wanted).reshape(-1).view(torch.uint8)

    def read_tensor(self, name: str, *, prefix_map: Mapping[str, str] | None = None) -> torch.Tensor:
        """The checkpoint's ``name`` in the dtype the model holds it in (see the class)."""
        cast = self.casts.get(name)
        if cast is None:
            return super().read_tensor(name, prefix_map=prefix_map)
        entry = self.entries[self.key(name, prefix_map)]
        return self._stored(entry).to(cast)


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    pipeline: Any = None,
    prefix_map: Mapping[str, str] | None = None,
    variant: str | None = None,
    widen: Collection[str] = (),
) -> CheckpointReader:
    """The reader of checkpoint ``path``: a `GGUFCheckpointReader` for a GGUF file (naming its tensors
    after the module of ``pipeline`` it fills), else a `CheckpointReader`."""
    if variant is None and os.path.isfile(path) and is_gguf(path):
        prefix, module = _described(pipeline, prefix_map)
        return GGUFCheckpointReader(
            path, module=module, prefix_map=prefix_map, widen=widen, module_prefix=prefix
        )
    return CheckpointReader(path, prefix_map=prefix_map, variant=variant, widen=widen)
