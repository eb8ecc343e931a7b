"""The one safetensors header parser: `parse_header`, `read_header`, `HeaderEntry` and `open_regular`.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range, then the raw data. Only the first two are read here, so planning a
checkpoint of tens of GB reads a few kilobytes. `from_checkpoint`, `from_pipeline_folder` and the
runtime's `CheckpointReader` all read headers through this module, so planning and loading agree
on what a checkpoint holds and on every way it can be broken.

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
a file replaced on disk meanwhile yields the old file's tensors or an error, never a mix. Quoted
values in messages are cut to `SHOWN_CHARS`, so a message stays short whatever the file holds.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import BinaryIO, NoReturn

import attrs

from torchferry._errors import PlanError
from torchferry.topology._model import dtype_size

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SHOWN_CHARS",
    "HeaderEntry",
    "check_text",
    "error_reason",
    "file_kind",
    "open_regular",
    "parse_header",
    "read_header",
    "show",
    "strict_json",
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


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, for a message: "a folder", "a FIFO", ... or "not a regular file"."""
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
        raise PlanError(f"{file}: cannot be read ({error_reason(exc)})") from None
    if not stat.S_ISREG(kind):
        raise PlanError(f"{file}: is {file_kind(kind)}, not a regular file; a checkpoint is read from files")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(file, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise PlanError(f"{file}: cannot be read ({error_reason(exc)})") from None
    kind = os.fstat(fd).st_mode
    if not stat.S_ISREG(kind):
        os.close(fd)
        raise PlanError(f"{file}: is {file_kind(kind)}, not a regular file; a checkpoint is read from files")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def error_reason(exc: BaseException) -> str:
    """The operating system's words for why ``exc`` happened (its ``strerror``), else its text."""
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


def strict_json(file: str, raw: bytes, what: str) -> object:
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


def check_text(file: str, what: str, value: str) -> None:
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
    header = strict_json(file, raw, "the safetensors header")
    if not isinstance(header, dict):
        raise PlanError(f"{file}: the safetensors header is a {type(header).__name__}, not a JSON object")
    if not raw.startswith(b"{"):
        raise PlanError(f"{file}: the safetensors header must begin with '{{' (it begins with whitespace)")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise PlanError(f"{file}: '__metadata__' is a {type(metadata).__name__}, not a JSON object")
    for key, value in metadata.items():
        check_text(file, "'__metadata__' key", key)
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
    check_text(file, "tensor name", name)
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
