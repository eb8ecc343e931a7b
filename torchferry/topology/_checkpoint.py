"""`from_checkpoint`: a topology from safetensors headers alone; the one header parser and locator.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range, then the raw data. Only the first two are read here, so planning a
checkpoint of tens of GB reads a few kilobytes. The runtime's `CheckpointReader` uses the same
`locate`, `open_regular`, `parse_header` and `HeaderEntry`, so planning and loading agree on what a
checkpoint holds and on every way it can be broken.

[Note: how strict the header parser is]
Every malformed file is a `PlanError` naming the file and the problem, and a checkpoint is held to
the format as its reference implementation reads it (huggingface/safetensors, ``safetensors/src/
tensor.rs``: ``SafeTensors::read_metadata`` and ``Metadata::validate``) and as its README states it:

- the header length is at most 100,000,000 bytes (``HeaderTooLarge``) and fits the file
  (``InvalidHeaderLength``); the header is UTF-8 (``InvalidHeader``), so a byte-order mark or
  UTF-16 is refused, and it is JSON whose first character is ``{`` (README: "MUST begin with a
  ``{``"; trailing spaces are allowed padding);
- every value has its type (``InvalidHeaderDeserialization``): ``__metadata__`` maps strings to
  strings, dtypes are strings, shapes and offsets are lists of unsigned 64-bit integers, and the
  product of a shape times its dtype's size fits 64 bits (``ValidationOverflow``);
- sorted by offset, each tensor begins where the previous one ended (``InvalidOffset``), its byte
  count matches shape and dtype (``TensorInvalidInfo``), and the last one ends at the end of the
  file (``MetadataIncompleteBuffer``): no gaps, no overlaps, no trailing bytes (README: "The byte
  buffer needs to be entirely indexed, and cannot contain holes");
- duplicate keys are refused (README: "Duplicate keys are disallowed"; the reference reader keeps
  the last one silently, and an auditor reading the first would see another tensor);
- the JSON itself is refused when it nests deeper than a header can (a header is three levels deep:
  the object, an entry, its shape) instead of recursing, and an integer with more digits than
  2**64 has is refused before Python converts it.

Only regular files are opened (`open_regular`: a FIFO, a device or a folder named ``*.safetensors``
would block or fail mid-read), each once: the header and the data come from the same descriptor, so
a file replaced on disk meanwhile yields the old file's tensors or an error, never a mix. An index's
shards must be named inside the index's folder (no absolute paths, no ``..``); a shard that is a
symlink to elsewhere (the Hugging Face cache's ``snapshots/<rev>/x -> ../../blobs/<hash>``) is fine,
since the name is what is checked, not where the link points. Quoted values in messages are cut to
`SHOWN_CHARS`, so a message stays short whatever the file holds.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import BinaryIO, NoReturn

import attrs

from torchferry._errors import PlanError
from torchferry.topology._frozen import FrozenMap
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

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SHOWN_CHARS",
    "HeaderEntry",
    "Sources",
    "from_checkpoint",
    "locate",
    "open_regular",
    "parse_header",
    "read_header",
    "show",
]

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
#: The format's cap on the header (``MAX_HEADER_SIZE`` of the reference reader); indexes get the same.
MAX_HEADER_BYTES = 100_000_000
#: The most characters of a value from a file that a message quotes.
SHOWN_CHARS = 200
_U64 = 2**64
_U64_DIGITS = len(str(_U64 - 1))
# A shard name in an index is a file name beside the index; this bounds the paths messages quote.
_MAX_SHARD_NAME = 512
HOW = "point checkpoint at a .safetensors file, a folder of them, or a *.index.json"
_ENCODER_HINTS = ("encoder", "mllm")
_VAE_HINTS = ("vae",)


@attrs.frozen(kw_only=True)
class Sources:
    """What a checkpoint path names: the shard files to read and, for an index, its weight map.

    ``files`` are path strings in the order they are read (sorted); ``weight_map`` maps each tensor
    the index lists to one of them (``None`` for a file or a folder). Files are not opened here.
    """

    path: str
    files: tuple[str, ...]
    weight_map: FrozenMap[str, str] | None = None


@attrs.frozen(kw_only=True)
class HeaderEntry:
    """One tensor of a safetensors header, as planning and loading both see it.

    ``begin``/``end`` are the header's ``data_offsets`` (relative to the data region, which starts at
    file offset ``data_start``); ``name`` is the checkpoint's key; ``dtype`` the torch dtype name.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    file: str
    data_start: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data in its file (``end - begin``)."""
        return self.end - self.begin


def show(value: object) -> str:
    """``repr(value)`` cut to `SHOWN_CHARS` characters, for quoting what a file holds in a message."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_u64(value: object) -> bool:
    return _is_int(value) and 0 <= value < _U64  # type: ignore[operator]


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (a symlink to one is fine), else `PlanError`.

    The kind is checked with ``os.stat`` before opening, so a FIFO or a device is refused without
    being opened (opening a FIFO blocks until a writer comes), and again on the open descriptor,
    which is opened non-blocking in case the path was swapped in between. A missing file raises
    `FileNotFoundError` for the caller to word.
    """
    file = os.fspath(path)
    try:
        kind = os.stat(file).st_mode
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise PlanError(f"{file}: cannot be read ({_reason(exc)})") from None
    if not stat.S_ISREG(kind):
        raise PlanError(f"{file}: is {_kind_of(kind)}, not a regular file; a checkpoint is read from files")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(file, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise PlanError(f"{file}: cannot be read ({_reason(exc)})") from None
    kind = os.fstat(fd).st_mode
    if not stat.S_ISREG(kind):
        os.close(fd)
        raise PlanError(f"{file}: is {_kind_of(kind)}, not a regular file; a checkpoint is read from files")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


class _Refused(Exception):
    """A JSON document the parser stops reading (the message completes "<file>: <what> ...")."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _U64_DIGITS:
        raise _Refused(
            f"holds an integer of {len(text.lstrip('-'))} digits; sizes and offsets fit in 64 bits"
        )
    return int(text)


def _no_constant(text: str) -> NoReturn:
    raise _Refused(f"holds {text}, which is not JSON")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise _Refused(f"names {show(key)} twice; keys must be unique")
        result[key] = value
    return result


def _parse_json(file: str, raw: bytes, what: str) -> object:
    """``raw`` as strict JSON: UTF-8 without a BOM, bounded integers, unique keys, bounded nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(f"{file}: {what} is not UTF-8 (byte {exc.start} is {raw[exc.start]:#04x})") from None
    if text.startswith("\ufeff"):
        raise PlanError(f"{file}: {what} begins with a byte-order mark; it must be UTF-8 without one")
    try:
        return json.loads(
            text, object_pairs_hook=_no_duplicates, parse_int=_bounded_int, parse_constant=_no_constant
        )
    except _Refused as exc:
        raise PlanError(f"{file}: {what} {exc}") from None
    except RecursionError:
        raise PlanError(
            f"{file}: {what} nests JSON deeper than Python parses (a header is 3 levels deep); "
            "it is not safetensors"
        ) from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{file}: {what} is not valid JSON ({exc})") from None


def _check_text(file: str, what: str, value: str) -> None:
    """Refuse a string holding a lone surrogate (JSON ``\\ud800``): no file system or terminal takes it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PlanError(f"{file}: {what} {show(value)} is not valid Unicode (a lone surrogate)") from None


def read_header(path: str | os.PathLike[str]) -> tuple[HeaderEntry, ...]:
    """The checked tensor entries of one safetensors file, in data order; reads the header only."""
    file = os.fspath(path)
    try:
        handle = open_regular(file)
    except FileNotFoundError:
        raise PlanError(f"{file}: no such checkpoint file or folder") from None
    with handle:
        return parse_header(file, handle)


def parse_header(file: str, handle: BinaryIO) -> tuple[HeaderEntry, ...]:
    """The checked entries of the safetensors file open as ``handle`` (named ``file`` in messages).

    Reads the header from ``handle`` (from its start) and nothing else; see the Note at the top of
    this module for what is checked.
    """
    size = os.fstat(handle.fileno()).st_size
    handle.seek(0)
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise PlanError(f"{file}: {size} bytes is too short for a safetensors file (no header length)")
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise PlanError(
            f"{file}: header length {length} does not fit a {size}-byte file"
            f"{'' if length <= MAX_HEADER_BYTES else ' (safetensors caps headers at 100 MB)'}; "
            "the file is truncated or not safetensors"
        )
    raw = handle.read(length)
    if len(raw) != length:
        raise PlanError(f"{file}: the file shrank while its header was read; do not rewrite it while reading")
    header = _parse_json(file, raw, "the safetensors header")
    if not isinstance(header, dict):
        raise PlanError(f"{file}: the safetensors header is a {type(header).__name__}, not a JSON object")
    if not raw.startswith(b"{"):
        raise PlanError(f"{file}: the safetensors header must begin with '{{' (it begins with whitespace)")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise PlanError(f"{file}: '__metadata__' is a {type(metadata).__name__}, not a JSON object")
    for key, value in metadata.items():
        _check_text(file, "'__metadata__' key", key)
        if not isinstance(value, str):
            raise PlanError(
                f"{file}: '__metadata__' value {show(key)} is {show(value)}; metadata maps strings to strings"
            )
    data_start = 8 + length
    data_bytes = size - data_start
    entries = [
        _entry(file, name, info, data_bytes, data_start)
        for name, info in header.items()
        if name != "__metadata__"
    ]
    entries.sort(key=lambda e: (e.begin, e.end, e.name))
    reach: HeaderEntry | None = None
    for current in entries:  # overlaps first: two tensors claiming the same bytes is the worse lie
        if current.begin == current.end:
            continue
        if reach is not None and current.begin < reach.end:
            raise PlanError(
                f"{file}: tensors {show(reach.name)} and {show(current.name)} overlap in the data region "
                f"(bytes {reach.begin}-{reach.end} and {current.begin}-{current.end})"
            )
        if reach is None or current.end > reach.end:
            reach = current
    cursor = 0
    for current in entries:
        if current.begin < cursor:  # only an empty tensor gets here: overlaps were refused above
            raise PlanError(
                f"{file}: empty tensor {show(current.name)} sits at offset {current.begin}, inside bytes "
                f"another tensor holds (up to {cursor}); safetensors offsets follow one another"
            )
        if current.begin > cursor:
            raise PlanError(
                f"{file}: no tensor covers bytes {cursor}-{current.begin} of the data region (before "
                f"{show(current.name)}); safetensors data has no gaps, so the file is damaged"
            )
        cursor = max(cursor, current.end)
    if cursor != data_bytes:
        raise PlanError(
            f"{file}: the tensors cover {cursor} of the data region's {data_bytes} bytes; the file has "
            f"{data_bytes - cursor} trailing bytes no tensor names, so it is damaged or not safetensors"
        )
    return tuple(entries)


def _entry(file: str, name: str, info: object, data_bytes: int, data_start: int) -> HeaderEntry:
    _check_text(file, "tensor name", name)
    where = f"{file}: tensor {show(name)}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise PlanError(f"{where} needs 'dtype', 'shape' and 'data_offsets' in the header, got {show(info)}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in SAFETENSORS_DTYPES:
        known = ", ".join(sorted(SAFETENSORS_DTYPES))
        raise PlanError(
            f"{where} has dtype {show(code)}, which torchferry cannot stream; known dtypes: {known}"
        )
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise PlanError(f"{where} has shape {show(shape)}; a shape is a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(o) for o in offsets)):
        raise PlanError(f"{where} has data_offsets {show(offsets)}; expected [begin, end]")
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
    if expected >= _U64:
        raise PlanError(f"{where} has shape {show(shape)}, whose size in bytes does not fit 64 bits")
    if end - begin != expected:
        raise PlanError(
            f"{where} spans {end - begin} bytes, but shape {show(tuple(shape))} of {dtype} needs {expected}"
        )
    return HeaderEntry(
        name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end, file=file, data_start=data_start
    )


def _shard_name(index: str, tensor: str, name: object) -> str:
    """The weight map's shard ``name`` if it names a file inside the index's folder, else `PlanError`."""
    if not isinstance(name, str):
        raise PlanError(
            f"{index}: the index maps tensor {show(tensor)} to {show(name)}; shard names are strings"
        )
    _check_text(index, "shard name", name)
    parts = PurePath(name).parts
    escapes = PurePath(name).is_absolute() or PurePath(name).drive or ".." in parts or "\0" in name
    if len(name) > _MAX_SHARD_NAME or any(len(part) > 255 for part in parts):
        raise PlanError(
            f"{index}: the index names shard {show(name)} for tensor {show(tensor)}, longer than a file "
            f"name can be (at most {_MAX_SHARD_NAME} characters, 255 per folder or file name)"
        )
    if escapes or not parts or os.path.isabs(name):
        raise PlanError(
            f"{index}: the index names shard {show(name)} for tensor {show(tensor)}, which is not a file "
            "name inside the index's folder; shards must sit beside the index (no absolute paths, no '..')"
        )
    return name


def locate(path: str | os.PathLike[str]) -> Sources:
    """The shard files a checkpoint path names: a ``.safetensors`` file, a folder, or an index.

    A folder's shards are its ``*.safetensors`` entries, sorted. An ``*.json`` file is an index whose
    ``weight_map`` maps tensor names to shard names inside the index's folder. Raises `PlanError`
    for a missing path, a folder without shards, a path that is not a regular file or folder, and
    any malformed index; shards are not opened (nor checked for existence) here.
    """
    source = os.fspath(path)
    try:
        mode = os.stat(source).st_mode
    except FileNotFoundError:
        raise PlanError(f"{source}: no such checkpoint file or folder") from None
    except (OSError, ValueError) as exc:
        raise PlanError(f"{source}: cannot be read ({_reason(exc)}); {HOW}") from None
    if stat.S_ISDIR(mode):
        files = sorted(str(p) for p in Path(source).glob("*.safetensors"))
        if not files:
            raise PlanError(f"{source}: the folder holds no *.safetensors file; {HOW}")
        return Sources(path=source, files=tuple(files))
    if not stat.S_ISREG(mode):
        raise PlanError(f"{source}: is {_kind_of(mode)}, not a regular file; {HOW}")
    if not source.endswith(".json"):
        return Sources(path=source, files=(source,))
    with open_regular(source) as handle:
        raw = handle.read(MAX_HEADER_BYTES + 1)
    if len(raw) > MAX_HEADER_BYTES:
        raise PlanError(f"{source}: the index is larger than {MAX_HEADER_BYTES} bytes; it is not an index")
    index = _parse_json(source, raw, "the index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise PlanError(f"{source}: an index needs a 'weight_map' object of tensor name -> shard file")
    if not weight_map:
        raise PlanError(f"{source}: the index's 'weight_map' is empty; an index names every tensor's shard")
    folder = Path(source).parent
    resolved: dict[str, str] = {}
    for tensor, shard in weight_map.items():
        _check_text(source, "tensor name", tensor)
        resolved[tensor] = str(folder / _shard_name(source, tensor, shard))
    return Sources(path=source, files=tuple(sorted(set(resolved.values()))), weight_map=FrozenMap(resolved))


def _shard_header(index: str, file: str) -> tuple[HeaderEntry, ...]:
    try:
        handle = open_regular(file)
    except FileNotFoundError:
        raise PlanError(
            f"{index}: the index names shard {show(os.path.basename(file))}, which does not exist"
        ) from None
    with handle:
        return parse_header(file, handle)


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
                if dot and index.isascii() and index.isdigit():  # not '²', which isdigit() accepts
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
    source_path = Path(os.fspath(path))
    if source_path.is_dir() and (source_path / "model_index.json").is_file():
        from torchferry.topology._folder import from_pipeline_folder

        by_component = _normalise(block_attrs) if isinstance(block_attrs, Mapping) else None
        return from_pipeline_folder(source_path, by_component, declaration=declaration)
    components = _normalise(block_attrs)
    sources = locate(path)
    source = sources.path
    entries: list[HeaderEntry] = []
    owner_file: dict[str, str] = {}
    for file in sources.files:
        for entry in read_header(file) if sources.weight_map is None else _shard_header(source, file):
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
