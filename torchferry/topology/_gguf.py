"""`read_gguf`: the tensors of a GGUF file from its header alone, as diffusers' GGUF loader sees them.

A GGUF file (llama.cpp's ``ggml/docs/gguf.md``, version 2 or 3, little-endian) is the magic
``GGUF``, a ``uint32`` version, a ``uint64`` tensor count and key-value count, the key-value
metadata (typed values, arrays and strings), one info per tensor (its name, its dimensions
innermost first, its ``ggml_type`` and an offset into the data region), then the data region,
which starts at the next multiple of ``general.alignment`` (32 unless the metadata says so) and
holds every tensor at an aligned offset. Only the header is read here, so planning a 20 GB file
reads kilobytes.

[Note: the torch shape of a GGUF tensor]
diffusers (``load_gguf_checkpoint``, through the ``gguf`` package's reader) gives each tensor the
shape of its dimensions reversed (outermost first). F32 and F16 tensors stay plain tensors of
that dtype. Every other type, BF16 included, is a ``GGUFParameter`` of ``uint8`` whose last
dimension is the bytes of one row: ``ne0 // block_size * type_size``. The entries here carry that
torch shape and dtype, the logical shape and the type's name, so the bytes a plan counts are the
stored bytes, and rows of a block-quantized tensor are contiguous byte ranges.
"""

from __future__ import annotations

import itertools
import os
import stat
import struct
from collections.abc import Mapping
from typing import BinaryIO

import attrs

from torchferry._errors import PlanError
from torchferry.topology._safetensors import HeaderEntry, error_reason, open_regular, show

__all__ = ["GGUF_TYPES", "GGUFEntry", "is_gguf", "parse_gguf", "read_gguf"]

#: ggml types diffusers loads (its ``SUPPORTED_GGUF_QUANT_TYPES`` plus F32 and F16): id -> (name,
#: elements per block, bytes per block).
GGUF_TYPES: Mapping[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
    30: ("BF16", 1, 2),
}
#: The types that load as plain tensors of this torch dtype (the rest are ``uint8`` bytes).
_PLAIN = {"F32": "float32", "F16": "float16"}
_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
#: Sizes of the fixed-size metadata value types (ids of ``gguf_type``); 8 is a string, 9 an array.
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_MAX_DIMS = 8
#: How deep metadata arrays may nest (an array of arrays is 2). Real files nest at most 2 deep; a
#: bound keeps a hostile header from exhausting the stack.
MAX_ARRAY_NESTING = 16


@attrs.frozen(kw_only=True)
class GGUFEntry(HeaderEntry):
    """A tensor of a GGUF file: `HeaderEntry`'s torch view (see the Note above) plus its ggml type
    (``"Q4_K"``, ``"BF16"``, ``"F32"``) and its logical shape (outermost first)."""

    quant_type: str = "F32"
    logical_shape: tuple[int, ...] = ()
    #: For a model tensor joined from several byte ranges of the file (a conversion's ``cat`` of row
    #: ranges in another order): those ranges as file offsets, in order; ``begin``/``end`` then span
    #: the joined bytes (``data_start`` 0). Empty for a tensor that is one range of the file.
    pieces: tuple[tuple[int, int], ...] = ()

    @property
    def quantized(self) -> bool:
        """Whether diffusers loads it as a ``GGUFParameter`` (every type but F32 and F16)."""
        return self.quant_type not in _PLAIN


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file that begins with the GGUF magic (a FIFO is never opened)."""
    try:
        if not stat.S_ISREG(os.stat(os.fspath(path)).st_mode):
            return False
        with open(os.fspath(path), "rb") as handle:
            return handle.read(4) == _MAGIC
    except (OSError, ValueError):
        return False


def read_gguf(path: str | os.PathLike[str]) -> tuple[GGUFEntry, ...]:
    """The checked tensor entries of one GGUF file, in data order; reads the header only."""
    file = os.fspath(path)
    try:
        handle = open_regular(file)
    except FileNotFoundError:
        raise PlanError(f"{file}: no such checkpoint file or folder") from None
    with handle:
        return parse_gguf(file, handle)


class _Cursor:
    """Sequential little-endian reads of a header, each checked against the file's size."""

    def __init__(self, file: str, handle: BinaryIO, size: int) -> None:
        self.file, self.handle, self.size, self.pos = file, handle, size, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise PlanError(
                f"{self.file}: {what} at byte {self.pos} runs past the end of the {self.size}-byte file; "
                "the file is truncated or not GGUF"
            )
        raw = self.handle.read(n)
        if len(raw) != n:
            raise PlanError(f"{self.file}: the file shrank while its header was read; do not rewrite it")
        self.pos += n
        return raw

    def u32(self, what: str) -> int:
        value: int = struct.unpack("<I", self.take(4, what))[0]
        return value

    def u64(self, what: str) -> int:
        value: int = struct.unpack("<Q", self.take(8, what))[0]
        return value

    def text(self, what: str) -> str:
        raw = self.take(self.u64(f"the length of {what}"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PlanError(f"{self.file}: {what} at byte {self.pos - len(raw)} is not UTF-8") from None

    def value(self, kind: int, key: str, depth: int = 0) -> object:
        """One metadata value of type ``kind``: an int for the scalars read (alignment), else skipped.
        ``depth`` is how many arrays hold it; more than `MAX_ARRAY_NESTING` is refused."""
        if kind == 8:
            return self.text(f"metadata value {show(key)}")
        if kind == 9:
            if depth >= MAX_ARRAY_NESTING:
                raise PlanError(
                    f"{self.file}: metadata {show(key)} nests arrays more than {MAX_ARRAY_NESTING} deep (at "
                    f"byte {self.pos}); GGUF files nest at most 2, so the header is damaged or hostile"
                )
            item, count = self.u32(f"the item type of {show(key)}"), self.u64(f"the length of {show(key)}")
            if item in _SCALAR:
                self.take(_SCALAR[item] * count, f"metadata array {show(key)}")
            else:
                for _ in range(count):
                    self.value(item, key, depth + 1)
            return None
        if kind not in _SCALAR:
            raise PlanError(
                f"{self.file}: metadata {show(key)} has value type {kind}, which GGUF does not define"
            )
        raw = self.take(_SCALAR[kind], f"metadata value {show(key)}")
        return int.from_bytes(raw, "little") if kind in (4, 10) else None


def parse_gguf(file: str, handle: BinaryIO) -> tuple[GGUFEntry, ...]:
    """The checked entries of the GGUF file open as ``handle`` (named ``file`` in messages).

    Checked: the magic and version (2 or 3), every length against the file's size, the alignment (a
    power of two), each tensor's type (one diffusers loads), dimensions (1 to 8, the innermost a
    whole number of blocks), offset (aligned) and bytes (inside the file), and no two tensors with
    one name or overlapping bytes.
    """
    try:
        size = os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise PlanError(f"{file}: cannot be read ({error_reason(exc)})") from None
    handle.seek(0)
    cursor = _Cursor(file, handle, size)
    if cursor.take(4, "the magic") != _MAGIC:
        raise PlanError(f"{file}: does not begin with the GGUF magic; it is not a GGUF file")
    version = cursor.u32("the version")
    if version not in (2, 3):
        raise PlanError(f"{file}: GGUF version {version}; torchferry reads versions 2 and 3")
    count, kv_count = cursor.u64("the tensor count"), cursor.u64("the metadata count")
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = cursor.text("a metadata key")
        value = cursor.value(cursor.u32(f"the type of metadata {show(key)}"), key)
        if key == "general.alignment":
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise PlanError(f"{file}: general.alignment is {show(value)}; it must be a power of two")
            alignment = value
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(count):
        name = cursor.text("a tensor name")
        n_dims = cursor.u32(f"the rank of tensor {show(name)}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise PlanError(
                f"{file}: tensor {show(name)} has {n_dims} dimensions; GGUF allows 1 to {_MAX_DIMS}"
            )
        dims = tuple(cursor.u64(f"the dimensions of {show(name)}") for _ in range(n_dims))
        infos.append(
            (name, dims, cursor.u32(f"the type of {show(name)}"), cursor.u64(f"the offset of {show(name)}"))
        )
    data_start = -(-cursor.pos // alignment) * alignment
    data_bytes = size - data_start
    entries: list[GGUFEntry] = []
    seen: set[str] = set()
    for name, dims, kind, offset in infos:
        where = f"{file}: tensor {show(name)}"
        if name in seen:
            raise PlanError(f"{where} appears twice in the header; tensor names must be unique")
        seen.add(name)
        if kind not in GGUF_TYPES:
            known = ", ".join(t[0] for t in GGUF_TYPES.values())
            raise PlanError(
                f"{where} has ggml type {kind}, which diffusers does not load; known types: {known}"
            )
        quant, block, type_size = GGUF_TYPES[kind]
        if dims[0] % block:
            raise PlanError(
                f"{where} has rows of {dims[0]} values, not a whole number of {quant} blocks of {block}"
            )
        logical = tuple(reversed(dims))
        numel = 1
        for d in dims:
            numel *= d
        nbytes = numel // block * type_size
        if offset % alignment:
            raise PlanError(
                f"{where} has offset {offset}, which is not {alignment}-byte aligned; the file is damaged"
            )
        if offset + nbytes > data_bytes:
            raise PlanError(
                f"{where} needs bytes {offset}-{offset + nbytes} of the data region, which holds "
                f"{data_bytes}; the file is truncated"
            )
        plain = _PLAIN.get(quant)
        shape = logical if plain else (*logical[:-1], logical[-1] // block * type_size)
        entries.append(
            GGUFEntry(
                name=name,
                dtype=plain or "uint8",
                shape=shape,
                begin=offset,
                end=offset + nbytes,
                file=file,
                data_start=data_start,
                quant_type=quant,
                logical_shape=logical,
            )
        )
    entries.sort(key=lambda e: (e.begin, e.end))
    for before, after in itertools.pairwise(entries):
        if after.begin < before.end and after.begin != after.end:
            raise PlanError(
                f"{file}: tensors {show(before.name)} and {show(after.name)} overlap in the data region "
                f"(bytes {before.begin}-{before.end} and {after.begin}-{after.end})"
            )
    return tuple(entries)
