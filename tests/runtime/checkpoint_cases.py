"""Generated hostile safetensors files and indexes, for the parser fuzz test (and nothing else).

`cases(seed, n)` yields ``n`` cases from a seeded generator, spread over three categories:

- ``header``: one safetensors file, a valid one mutated: a field replaced by a hostile JSON value
  (deep nesting, integers of thousands of digits, digits such as '²', lists where a string goes,
  NaN, lone surrogates, long strings), bytes flipped, the file cut short, the length prefix
  rewritten, the header re-encoded (BOM, UTF-16, invalid UTF-8), keys duplicated, offsets shifted
  into gaps, overlaps or past the data, bytes added after the data.
- ``index``: a folder with one good shard and an ``*.index.json`` naming shards that escape the folder
  (``..``, absolute paths, devices), that are missing or folders, or an index mangled as above.
- ``folder``: a folder of shards where one ``*.safetensors`` entry is mangled as in ``header``.

Each case writes its files under a given folder and returns the path to hand to a reader.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs

_DATA = bytes(range(1, 23))  # 22 bytes: blocks.0.w (F32 [2]), blocks.1.w (F32 [2]), head (BF16 [3])
_GOOD: dict[str, object] = {
    "__metadata__": {"format": "pt"},
    "blocks.0.w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "blocks.1.w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
    "head": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
}

#: JSON texts (not Python values: some cannot be written by `json.dumps`) put where a field goes.
HOSTILE: tuple[str, ...] = (
    "[" * 100_000 + "]" * 100_000,
    "{" + '"a":{' * 50_000 + "}" * 50_001,
    "9" * 5000,
    "-" + "9" * 4301,
    "-1",
    "1.5",
    "1e400",
    "NaN",
    "Infinity",
    "true",
    "null",
    "{}",
    "[]",
    '"F32"',
    '["F32"]',
    '{"F32": 1}',
    '"²"',
    '["²"]',
    '"\\ud800"',
    '"' + "x" * 20_000 + '"',
    "[1, 2]",
    "[0, 18446744073709551616]",
    "[18446744073709551615, 18446744073709551616]",
    "[2, -1]",
    "[2, 1.0]",
    "[true, 2]",
    '"blocks"',
)


@attrs.frozen
class Case:
    """One generated input: its category, what was done to it, and how to write it."""

    category: str
    what: str
    write: Callable[[Path], Path]


def _file(header: bytes, data: bytes = _DATA, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _good_text() -> str:
    return _dumps(_GOOD)


def _replace_field(rng: random.Random) -> tuple[str, str]:
    """The good header with one field (or entry, or the metadata, or the root) replaced by hostile text."""
    hostile = rng.choice(HOSTILE)
    target = rng.choice(["dtype", "shape", "data_offsets", "entry", "metadata", "meta_value", "root", "dim"])
    if target == "root":
        return f"root={hostile[:20]}", hostile
    parts: list[str] = []
    name = rng.choice(["blocks.0.w", "blocks.1.w", "head"])
    for key, info in _GOOD.items():
        if key == "__metadata__":
            if target == "metadata":
                parts.append(f'"__metadata__":{hostile}')
            elif target == "meta_value":
                parts.append(f'"__metadata__":{{"format":{hostile}}}')
            else:
                parts.append(f'"__metadata__":{_dumps(info)}')
            continue
        assert isinstance(info, dict)
        if key != name or target in ("metadata", "meta_value"):
            parts.append(f"{_dumps(key)}:{_dumps(info)}")
        elif target == "entry":
            parts.append(f"{_dumps(key)}:{hostile}")
        elif target == "dim":
            fields = {k: _dumps(v) for k, v in info.items()}
            fields["shape"] = f"[{hostile}]"
            parts.append(f"{_dumps(key)}:{{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}")
        else:
            fields = {k: _dumps(v) for k, v in info.items()}
            fields[target] = hostile
            parts.append(f"{_dumps(key)}:{{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}")
    return f"{target} of {name}={hostile[:20]}", "{" + ",".join(parts) + "}"


def _header_bytes(rng: random.Random) -> tuple[str, bytes]:
    """A whole mangled safetensors file, and what was done to it."""
    kind = rng.choice(
        ["field", "field", "field", "flip", "cut", "length", "encoding", "duplicate", "offsets", "trailing"]
    )
    good = _good_text().encode()
    if kind == "field":
        what, text = _replace_field(rng)
        return what, _file(text.encode("utf-8", "surrogatepass"))
    if kind == "flip":
        raw = bytearray(_file(good))
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return "flipped bytes", bytes(raw)
    if kind == "cut":
        raw = _file(good)
        return "cut short", raw[: rng.randrange(len(raw))]
    if kind == "length":
        length = rng.choice([0, 1, 7, len(good) - 1, len(good) + 1, 10**8, 10**8 + 1, 2**63, 2**64 - 1])
        return f"length {length}", _file(good, length=length)
    if kind == "encoding":
        encoded = rng.choice(
            [
                b"\xef\xbb\xbf" + good,
                _good_text().encode("utf-16"),
                _good_text().encode("utf-16-le"),
                _good_text().encode("utf-32"),
                good.replace(b"head", b"h\xff\xfed"),
                b" " + good,
                b"\n" + good,
                good + b"\0",
            ]
        )
        return "encoding", _file(encoded)
    if kind == "duplicate":
        dup = good[:-1] + b',"head":{"dtype":"U8","shape":[6],"data_offsets":[16,22]}}'
        return "duplicate key", _file(dup)
    if kind == "offsets":
        header = json.loads(good)
        name = rng.choice(["blocks.0.w", "blocks.1.w", "head"])
        begin, end = header[name]["data_offsets"]
        shift = rng.choice([-2, -1, 1, 2, 8, 100])
        header[name]["data_offsets"] = rng.choice([[begin + shift, end + shift], [begin, end + shift]])
        return f"offsets of {name} shifted {shift}", _file(_dumps(header).encode())
    extra = rng.choice([b"\0", b"\0" * 8, b"junk" * 100])
    return "trailing bytes", _file(good) + extra


def _header_case(rng: random.Random) -> Case:
    what, raw = _header_bytes(rng)

    def write(folder: Path) -> Path:
        path = folder / "model.safetensors"
        path.write_bytes(raw)
        return path

    return Case(category="header", what=what, write=write)


def _folder_case(rng: random.Random) -> Case:
    what, raw = _header_bytes(rng)

    def write(folder: Path) -> Path:
        shards = folder / "shards"
        shards.mkdir()
        (shards / "a.safetensors").write_bytes(_file(_good_text().encode()))
        (shards / "b.safetensors").write_bytes(raw)
        return shards

    return Case(category="folder", what=what, write=write)


_SHARD_NAMES: tuple[str, ...] = (
    "../outside.safetensors",
    "sub/../../outside.safetensors",
    "/dev/stdin",
    "/dev/zero",
    "/dev/null",
    "/etc/passwd",
    "{outside}",
    "",
    ".",
    "..",
    "sub",
    "missing.safetensors",
    "sub/../model.safetensors",
    "./model.safetensors",
    "model.safetensors",
    "model.safetensors\0",
    "C:\\model.safetensors",
)


def _index_case(rng: random.Random) -> Case:
    kind = rng.choice(["name", "name", "name", "value", "bytes"])
    names = ["blocks.0.w", "blocks.1.w", "head"]
    if kind == "name":
        shard = rng.choice(_SHARD_NAMES)
        what = f"shard {shard!r}"
    else:
        shard = "model.safetensors"
        what = ""

    def write(folder: Path) -> Path:
        outside = folder / "outside.safetensors"
        outside.write_bytes(_file(_good_text().encode()))
        inner = folder / "ckpt"
        inner.mkdir()
        (inner / "sub").mkdir()
        (inner / "model.safetensors").write_bytes(_file(_good_text().encode()))
        index = inner / "model.safetensors.index.json"
        weight_map = {n: "model.safetensors" for n in names}
        text: bytes
        if kind == "name":
            weight_map[rng_name] = shard.replace("{outside}", str(outside))
            text = _dumps({"metadata": {}, "weight_map": weight_map}).encode()
        elif kind == "value":
            hostile = hostile_value
            where = place
            if where == "root":
                text = hostile.encode("utf-8", "surrogatepass")
            elif where == "weight_map":
                text = f'{{"weight_map":{hostile}}}'.encode("utf-8", "surrogatepass")
            elif where == "shard":
                text = f'{{"weight_map":{{"head":{hostile}}}}}'.encode("utf-8", "surrogatepass")
            else:
                text = f'{{"metadata":{hostile},"weight_map":{_dumps(weight_map)}}}'.encode(
                    "utf-8", "surrogatepass"
                )
        else:
            good = _dumps({"weight_map": weight_map}).encode()
            text = encoded(good)
        index.write_bytes(text)
        return index

    rng_name = rng.choice(names)
    hostile_value = rng.choice(HOSTILE)
    place = rng.choice(["root", "weight_map", "shard", "metadata"])
    variants: list[Callable[[bytes], bytes]] = [
        lambda g: b"\xef\xbb\xbf" + g,
        lambda g: g.decode().encode("utf-16"),
        lambda g: g.replace(b"head", b"h\xffd"),
        lambda g: g[: len(g) // 2],
        lambda g: g[:-1] + b',"weight_map":{}}',
    ]
    encoded = rng.choice(variants)
    if kind == "value":
        what = f"{place}={hostile_value[:20]}"
    elif kind == "bytes":
        what = f"bytes variant {variants.index(encoded)}"
    return Case(category="index", what=what, write=write)


def cases(seed: int, n: int) -> Iterator[Case]:
    """``n`` generated cases, the same for the same seed: half headers, a quarter each folders and indexes."""
    rng = random.Random(seed)
    makers = [_header_case, _header_case, _folder_case, _index_case]
    for i in range(n):
        yield makers[i % len(makers)](rng)
