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
each model tensor is still one byte range of the file. A ``torch.cat`` along rows (FLUX's copies
``torch.cat([q])``, its ``swap_scale_shift``) is recorded by a torch function mode as the ranges it
joins: adjacent ranges merge into one, and a tensor left with several (`GGUFEntry.pieces`) is read
once when the reader opens and held in memory. A tensor the conversion *computes* (a sum, a cast)
is no byte range, and is refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from torchferry._errors import PlanError
from torchferry.runtime.files._checkpoint_reader import CheckpointReader, Headers
from torchferry.runtime.files._spans import FileSpan
from torchferry.topology import (
    GGUF_TYPES,
    FrozenMap,
    GGUFEntry,
    HeaderEntry,
    TensorSpec,
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
    *,
    convert: Any = None,
) -> dict[str, GGUFEntry]:
    """The file's ``entries`` under the model's names (see the Note above).

    Names that already are the model's (diffusers' ``_should_convert_state_dict_to_diffusers`` is
    false) are kept; otherwise ``convert`` (default: ``model_class``'s single-file conversion, called
    with ``checkpoint=`` and ``config=``) maps them. A file whose names are not the model's and no
    conversion applies is a `PlanError`.
    """
    by_name = {e.name: e for e in entries}
    if set(model_names) == set(by_name) or (model_class is None and convert is None):
        return dict(by_name)
    class_name = "the model" if model_class is None else model_class.__name__
    what = "the conversion" if convert is not None else f"diffusers' conversion for {class_name}"
    convert = convert or (None if model_class is None else mapping_function(model_class))
    if convert is None:
        raise PlanError(
            f"{file}: its tensor names are not {class_name}'s and diffusers has no single-file "
            "conversion for that class; write the file under the model's own names"
        )
    inputs = {name: _meta(e) for name, e in by_name.items()}
    owner = {id(t): by_name[name] for name, t in inputs.items()}
    kwargs: dict[str, Any] = {"checkpoint": dict(inputs)}
    if config is not None:
        kwargs["config"] = dict(config)
    joins = _Joins()
    try:
        with joins:
            converted = convert(**kwargs)
    except Exception as exc:  # a conversion's own failure: it did not recognise these names or shapes
        roots = [t if t._base is None else t._base for t in joins.failed]
        names = list(dict.fromkeys(owner[id(t)].name for t in roots if id(t) in owner))
        at = f" at {', '.join(repr(n) for n in names)}" if names else " on this file's names"
        raise PlanError(
            f"{file}: {what} failed{at} ({type(exc).__name__}: {exc}); the file is not a checkpoint of "
            f"this {class_name} configuration, or the conversion assumes another one (torchferry runs "
            "diffusers' conversion unchanged, as from_single_file does)"
        ) from None
    out: dict[str, GGUFEntry] = {}
    computed: list[str] = []
    for name, tensor in converted.items():
        ranges = joins.ranges(tensor, owner)
        if ranges is None or len({e.quant_type for e, _, _ in ranges}) != 1:
            computed.append(name)
            continue
        entry = ranges[0][0]
        shape = tuple(tensor.shape)
        block, size = _BLOCKS[entry.quant_type]
        logical = shape if not entry.quantized else (*shape[:-1], shape[-1] // size * block)
        nbytes = tensor.numel() * tensor.element_size()
        if len(ranges) == 1:
            begin = ranges[0][1]
            out[name] = attrs.evolve(
                entry, name=name, shape=shape, begin=begin, end=begin + nbytes, logical_shape=logical
            )
        else:
            pieces = tuple((e.data_start + b, e.data_start + end) for e, b, end in ranges)
            out[name] = attrs.evolve(
                entry, name=name, shape=shape, begin=0, end=nbytes, data_start=0, logical_shape=logical,
                pieces=pieces,
            )  # fmt: skip
    if computed:
        shown = ", ".join(repr(n) for n in computed[:3]) + (", ..." if len(computed) > 3 else "")
        raise PlanError(
            f"{file}: {what} computes {len(computed)} tensor(s) ({shown}) from the file's data rather "
            "than renaming, slicing or joining rows of them, so they are no byte ranges of the file; "
            "torchferry streams the file's bytes only"
        )
    return out


class _Joins(TorchFunctionMode):
    """Records what each ``torch.cat`` along the first dimension joins while a conversion runs, so a
    joined tensor is known as the byte ranges it is made of (rows are contiguous bytes)."""

    def __init__(self) -> None:
        super().__init__()
        #: id of a cat's result -> (the result, kept alive so the id stays its own; what it joined).
        self.joined: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        #: The tensors given to the operation that raised, if one did (the file's, for the message).
        self.failed: list[torch.Tensor] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        try:
            result = func(*args, **kwargs)
        except Exception:
            self.failed = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            raise
        if func in (torch.cat, torch.concat, torch.concatenate) and isinstance(result, torch.Tensor):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if dim in (0, -result.dim()) and isinstance(args[0], (list, tuple)):
                self.joined[id(result)] = (result, list(args[0]))
        return result

    def ranges(
        self, tensor: torch.Tensor, owner: Mapping[int, GGUFEntry]
    ) -> list[tuple[GGUFEntry, int, int]] | None:
        """``tensor`` as byte ranges of the file's tensors (entry, begin, end), adjacent ones merged;
        ``None`` when it is not made of whole rows of them."""
        if id(tensor) in self.joined:
            found: list[tuple[GGUFEntry, int, int]] = []
            for part in self.joined[id(tensor)][1]:
                more = self.ranges(part, owner)
                if more is None:
                    return None
                for entry, begin, end in more:
                    if found and found[-1][0] is entry and found[-1][2] == begin:
                        found[-1] = (entry, found[-1][1], end)
                    else:
                        found.append((entry, begin, end))
            return found
        root = tensor if tensor._base is None else tensor._base
        source = owner.get(id(root))
        if source is None or not tensor.is_contiguous():
            return None
        first = source.begin + int(tensor.storage_offset()) * tensor.element_size()
        return [(source, first, first + tensor.numel() * tensor.element_size())]


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

    _parse = staticmethod(parse_gguf)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        module: nn.Module | None,
        prefix_map: Mapping[str, str] | None = None,
        widen: Collection[str] = (),
        module_prefix: str = "",
        convert: Any = None,
    ) -> None:
        #: The model the file fills, and the conversion naming its tensors (read by `_headers`).
        self._module, self._convert, self._module_prefix = module, convert, module_prefix
        #: Model names (before ``prefix_map``) of F32/F16 tensors loaded in another float dtype.
        self.casts: dict[str, torch.dtype] = {}
        super().__init__(path, prefix_map=prefix_map, widen=widen)
        self._cast_by_key = {self.key(n): d for n, d in self.casts.items()}
        #: Tensors joined from several ranges of the file (`GGUFEntry.pieces`), read once at open.
        self._joined: dict[str, torch.Tensor] = {}
        try:
            for key, entry in self.entries.items():
                if isinstance(entry, GGUFEntry) and entry.pieces:
                    joined = torch.empty(entry.nbytes, dtype=torch.uint8)
                    at = 0
                    for begin, end in entry.pieces:
                        self._copy(self.files[0], begin, joined[at : at + end - begin])
                        at += end - begin
                    self._joined[key] = joined
        except BaseException:
            self.close()
            raise

    def _headers(self, path: str, variant: str | None) -> Headers:
        """The one GGUF file's entries under the model's names (see the Note at the top)."""
        module = self._module
        state = module.state_dict(keep_vars=True) if module is not None else {}
        handle = open_regular(path)
        self._handles[path] = handle  # the header's descriptor is the one the data is read from
        self.stats[path] = os.fstat(handle.fileno())
        found = self._parsed[path] = parse_gguf(path, handle)
        config = getattr(module, "config", None)
        entries = model_entries(
            path, found, None if module is None else type(module), list(state),
            config if isinstance(config, Mapping) else None, convert=self._convert,
        )  # fmt: skip
        for name, entry in entries.items():
            tensor = state.get(name)
            if entry.quantized or not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
                continue
            if str(tensor.dtype).removeprefix("torch.") != entry.dtype:
                self.casts[self._module_prefix + name] = tensor.dtype
        return Headers(files=(path,), entries=FrozenMap[str, HeaderEntry](dict(entries)))

    def spans(
        self,
        layout: Iterable[tuple[TensorSpec, int]],
        start: int,
        end: int,
        prefix_map: Mapping[str, str] | None = None,
    ) -> list[FileSpan]:
        """`CheckpointReader.spans`, a joined tensor's bytes coming from memory (read at open)."""
        found = super().spans(layout, start, end, prefix_map)
        out: list[FileSpan] = []
        for span in found:
            joined = self._joined.get(self.key(span.name, prefix_map)) if span.file is not None else None
            out.append(span if joined is None else attrs.evolve(span, file=None, source=joined))
        return out

    def _stored(self, entry: HeaderEntry) -> torch.Tensor:
        joined = self._joined.get(entry.name)
        if joined is None:
            return super()._stored(entry)
        return joined.clone().view(getattr(torch, entry.dtype)).view(entry.shape)

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
