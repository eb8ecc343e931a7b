"""`from_checkpoint`: topologies from safetensors headers, without reading a byte of tensor data."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchferry import PlanError
from torchferry.topology import Declaration, OffloadConfig, from_checkpoint, resolve
from torchferry.topology._safetensors import SAFETENSORS_DTYPES, read_header, show

SIZES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
GIB = 1024**3


def write(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], *, sparse: bool = False) -> int:
    """A safetensors file whose data region is garbage (or a sparse hole); returns the data bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (code, shape) in tensors.items():
        nbytes = math.prod(shape) * SIZES[code]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    write_raw(path, header, offset, sparse=sparse)
    return offset


def write_raw(path: Path, header: object, data_bytes: int, *, sparse: bool = False) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little"))
        handle.write(raw)
        if sparse:
            handle.truncate(8 + len(raw) + data_bytes)
        else:
            handle.write(b"\xff\xfe garbage, not tensor data " * (data_bytes // 28 + 1))
            handle.truncate(8 + len(raw) + data_bytes)


def dit_tensors(blocks: int, width: int = 4, code: str = "BF16") -> dict[str, tuple[str, tuple[int, ...]]]:
    tensors = {"embed.weight": (code, (width, width)), "norm_out.bias": (code, (width,))}
    for i in range(blocks):
        tensors[f"blocks.{i}.attn.weight"] = (code, (width, width))
        tensors[f"blocks.{i}.attn.bias"] = (code, (width,))
    return tensors


def test_single_file_groups_blocks_numerically(tmp_path: Path) -> None:
    """Tensors named blocks.<i>.* form one ring in numeric order; the rest is the remainder."""
    path = tmp_path / "model.safetensors"
    tensors = {f"blocks.{i}.w": torch.zeros(2, 3, dtype=torch.bfloat16) for i in (10, 2, 0, 1)}
    tensors["head.weight"] = torch.zeros(5)
    save_file(tensors, str(path))
    topology = from_checkpoint(path)
    (component,) = topology.components
    assert (component.path, component.kind) == ("", "dit")
    assert [b.path for b in component.blocks] == ["blocks.0", "blocks.1", "blocks.2", "blocks.10"]
    assert component.blocks[0].tensors[0].dtype == "bfloat16"
    assert component.blocks[0].nbytes == 12
    assert [t.name for t in component.tensors] == ["head.weight"]
    assert topology.source == f"checkpoint:{path}"


def test_several_attributes_make_one_ring(tmp_path: Path) -> None:
    """Block attributes are concatenated into one ring, in the order given."""
    path = tmp_path / "flux.safetensors"
    write(
        path,
        {
            "single_transformer_blocks.0.w": ("BF16", (2,)),
            "single_transformer_blocks.1.w": ("BF16", (2,)),
            "transformer_blocks.0.w": ("BF16", (2,)),
            "transformer_blocks.1.w": ("BF16", (2,)),
            "transformer_blocks.x.w": ("BF16", (2,)),
        },
    )
    topology = from_checkpoint(path, ("transformer_blocks", "single_transformer_blocks"))
    (stack,) = topology.components[0].stacks
    assert stack.attrs == ("transformer_blocks", "single_transformer_blocks")
    assert [b.path for b in stack.blocks] == [
        "transformer_blocks.0",
        "transformer_blocks.1",
        "single_transformer_blocks.0",
        "single_transformer_blocks.1",
    ]
    assert [t.name for t in topology.components[0].tensors] == ["transformer_blocks.x.w"]


def test_sharded_folder_and_index_agree(tmp_path: Path) -> None:
    """A folder of shards and its index describe the same topology as one file would."""
    tensors = dit_tensors(4)
    names = list(tensors)
    first, second = dict(list(tensors.items())[:5]), dict(list(tensors.items())[5:])
    write(tmp_path / "model-00001-of-00002.safetensors", first)
    write(tmp_path / "model-00002-of-00002.safetensors", second)
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {
        n: "model-00002-of-00002.safetensors" for n in second
    }
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single = tmp_path / "single"
    single.mkdir()
    write(single / "model.safetensors", tensors)

    folder, indexed, whole = from_checkpoint(tmp_path), from_checkpoint(index), from_checkpoint(single)
    assert folder.components == indexed.components == whole.components
    assert sorted(t.name for t in whole.components[0].all_tensors()) == sorted(names)
    assert [b.path for b in folder.components[0].blocks] == [f"blocks.{i}" for i in range(4)]


def test_index_naming_a_missing_tensor_is_rejected(tmp_path: Path) -> None:
    """An index that maps a tensor to a shard whose header lacks it is a PlanError."""
    write(tmp_path / "a.safetensors", {"x": ("F32", (1,))})
    index = tmp_path / "m.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}}))
    message = (
        f"{index}: the index maps tensor 'y' to 'a.safetensors', but that shard's header has no such tensor"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        from_checkpoint(index)


def test_tens_of_gigabytes_plan_without_reading_data(tmp_path: Path) -> None:
    """A 60 GiB checkpoint whose data region is a sparse hole plans in well under a second."""
    path = tmp_path / "huge.safetensors"
    width = 16384
    tensors = {f"blocks.{i}.w": ("BF16", (width, width)) for i in range(120)}
    data = write(path, tensors, sparse=True)
    assert data == 60 * GIB
    assert os.path.getsize(path) > 60 * GIB
    start = time.perf_counter()
    topology = from_checkpoint(path)
    elapsed = time.perf_counter() - start
    assert topology.nbytes == 60 * GIB
    assert len(topology.components[0].blocks) == 120
    assert elapsed < 10.0  # reading 60 GiB would take far longer; loose so a loaded machine passes


def test_garbage_data_region_still_plans(tmp_path: Path) -> None:
    """Planning never decodes tensor bytes: a data region of garbage plans like a real one."""
    path = tmp_path / "garbage.safetensors"
    write(path, dit_tensors(3))
    assert len(from_checkpoint(path).components[0].blocks) == 3


def test_multi_component_mapping(tmp_path: Path) -> None:
    """A prefix mapping splits one checkpoint into components; encoder paths are rings of their own."""
    path = tmp_path / "pipeline.safetensors"
    tensors = {f"transformer.{k}": v for k, v in dit_tensors(2).items()}
    tensors |= {f"text_encoder.encoder.block.{i}.w": ("F32", (2,)) for i in range(3)}
    tensors |= {"text_encoder.encoder.layers.0.w": ("F32", (2,)), "text_encoder.shared.weight": ("F32", (4,))}
    tensors |= {"vae.conv.weight": ("F32", (3,))}
    write(path, tensors)
    topology = from_checkpoint(
        path,
        {
            "vae": (),
            "text_encoder": ("encoder.block", "encoder.layers"),
            "transformer": "blocks",
        },
    )
    assert [(c.path, c.kind) for c in topology.components] == [
        ("transformer", "dit"),
        ("text_encoder", "encoder"),
        ("vae", "vae"),
    ]
    encoder = topology.component("text_encoder")
    assert [s.attrs for s in encoder.stacks] == [("encoder.block",)]
    assert encoder.problems == ("encoder block path 'encoder.layers' has 1 block(s) in the checkpoint",)
    assert sorted(t.name for t in encoder.tensors) == [
        "text_encoder.encoder.layers.0.w",
        "text_encoder.shared.weight",
    ]
    assert [b.path for b in topology.component("transformer").blocks] == [
        "transformer.blocks.0",
        "transformer.blocks.1",
    ]
    plan = resolve(topology, OffloadConfig(strategy="layerwise", components=("dit",)))
    assert len(plan.component("transformer").stacks[0].streaming) == 2


def test_unmatched_tensor_prefix_is_rejected(tmp_path: Path) -> None:
    """Every tensor must fall under one prefix of the mapping."""
    path = tmp_path / "p.safetensors"
    write(path, {"transformer.blocks.0.w": ("F32", (1,)), "unet.w": ("F32", (1,))})
    message = (
        f"{path}: 1 tensor(s) fall under none of the prefixes 'transformer' (e.g. 'unet.w'); add their "
        "prefix to block_attrs"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        from_checkpoint(path, {"transformer": ("blocks",)})


def test_checkpoint_resolves_with_a_declaration(tmp_path: Path) -> None:
    """A declaration passed along lets `resolve` keep resident blocks of the checkpoint's DiT."""
    path = tmp_path / "m.safetensors"
    write(path, dit_tensors(4))
    topology = from_checkpoint(path, declaration=Declaration(resident_dit_paths={""}))
    plan = resolve(topology, OffloadConfig(strategy="layerwise", components=("dit",), resident_layers=2))
    assert plan.components[0].stacks[0].resident_head == 2


def test_read_header_lists_entries_in_data_order(tmp_path: Path) -> None:
    """`read_header` returns every entry with its byte range and torch dtype name."""
    path = tmp_path / "m.safetensors"
    write(path, {"b": ("I64", (2,)), "a": ("F16", (3,))})
    assert [(e.name, e.dtype, e.shape, e.begin, e.end) for e in read_header(path)] == [
        ("b", "int64", (2,), 0, 16),
        ("a", "float16", (3,), 16, 22),
    ]


def _entry(dtype: str = "F32", shape: object = (2,), offsets: object = (0, 8)) -> dict[str, object]:
    return {
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "data_offsets": offsets,
    }


KNOWN = ", ".join(sorted(SAFETENSORS_DTYPES))
HEADER_ERRORS: list[tuple[object, int, str]] = [
    ([1, 2], 0, "{file}: the safetensors header is a list, not a JSON object"),
    ({"x": [1]}, 8, "{file}: tensor 'x' needs 'dtype', 'shape' and 'data_offsets' in the header, got [1]"),
    (
        {"x": _entry(dtype="F4")},
        8,
        f"{{file}}: tensor 'x' has dtype 'F4', which torchferry cannot stream; known dtypes: {KNOWN}",
    ),
    (
        {"x": _entry(shape=[2, -1])},
        8,
        "{file}: tensor 'x' has shape [2, -1]; a shape is a list of non-negative ints",
    ),
    ({"x": _entry(offsets=[0])}, 8, "{file}: tensor 'x' has data_offsets [0]; expected [begin, end]"),
    (
        {"x": _entry(offsets=[0, 16])},
        8,
        "{file}: tensor 'x' has data_offsets [0, 16] outside the file's 8-byte data region",
    ),
    (
        {"x": _entry(offsets=[0, 4])},
        8,
        "{file}: tensor 'x' spans 4 bytes, but shape (2,) of float32 needs 8",
    ),
    (
        {"x": _entry(offsets=[0, 8]), "y": _entry(offsets=[4, 12])},
        12,
        "{file}: tensors 'x' and 'y' overlap in the data region (bytes 0-8 and 4-12)",
    ),
    ({"__metadata__": [], "x": _entry()}, 8, "{file}: '__metadata__' is a list, not a JSON object"),
]


@pytest.mark.parametrize(("header", "data_bytes", "message"), HEADER_ERRORS)
def test_header_sanity(tmp_path: Path, header: object, data_bytes: int, message: str) -> None:
    """A broken header is a PlanError naming the file and the tensor."""
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data_bytes)
    with pytest.raises(PlanError, match=re.escape(message.format(file=path))):
        from_checkpoint(path)


def test_truncated_and_non_json_files(tmp_path: Path) -> None:
    """Files too short for their header, or with a header that is not JSON, are rejected."""
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(
        PlanError, match=re.escape(f"{short}: 2 bytes is too short for a safetensors file (no header length)")
    ):
        from_checkpoint(short)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(
        PlanError,
        match=re.escape(
            f"{cut}: header length 1000 does not fit a 10-byte file; the file is truncated or not safetensors"
        ),
    ):
        from_checkpoint(cut)
    text = tmp_path / "text.safetensors"
    text.write_bytes((4).to_bytes(8, "little") + b"nope")
    try:
        json.loads(b"nope")
    except json.JSONDecodeError as exc:
        reason = str(exc)
    with pytest.raises(
        PlanError, match=re.escape(f"{text}: the safetensors header is not valid JSON ({reason})")
    ):
        from_checkpoint(text)


def test_source_errors(tmp_path: Path) -> None:
    """Missing paths, empty folders, bad indexes and tensors stored twice are rejected."""
    with pytest.raises(PlanError, match=re.escape(f"{tmp_path / 'nope'}: no such checkpoint file or folder")):
        from_checkpoint(tmp_path / "nope")
    with pytest.raises(PlanError, match=re.escape(f"{tmp_path}: the folder holds no *.safetensors file")):
        from_checkpoint(tmp_path)
    index = tmp_path / "m.index.json"
    index.write_text(json.dumps({"weights": {}}))
    with pytest.raises(
        PlanError,
        match=re.escape(f"{index}: an index needs a 'weight_map' object of tensor name -> shard file"),
    ):
        from_checkpoint(index)
    index.write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(
        PlanError, match=re.escape(f"{index}: the index names shard 'gone.safetensors', which does not exist")
    ):
        from_checkpoint(index)
    index.unlink()
    write(tmp_path / "a.safetensors", {"x": ("F32", (1,))})
    write(tmp_path / "b.safetensors", {"x": ("F32", (1,))})
    message = f"tensor 'x' is stored twice, in {tmp_path / 'a.safetensors'} and {tmp_path / 'b.safetensors'}"
    with pytest.raises(PlanError, match=re.escape(message)):
        from_checkpoint(tmp_path)


def test_block_attrs_type_errors(tmp_path: Path) -> None:
    """block_attrs must be attribute names, or a mapping of str prefixes to them."""
    path = tmp_path / "m.safetensors"
    write(path, dit_tensors(2))
    with pytest.raises(
        TypeError,
        match=re.escape("from_checkpoint(block_attrs=...) must be a sequence of attribute names, got [1]"),
    ):
        from_checkpoint(path, [1])  # type: ignore[list-item]
    with pytest.raises(
        TypeError, match=re.escape("from_checkpoint(block_attrs=...) keys must be str prefixes, got 3")
    ):
        from_checkpoint(path, {3: ("blocks",)})  # type: ignore[dict-item]


# --------------------------------------------------------------------------------- hostile files


def _raw_file(path: Path, header: bytes, data: bytes = b"\0" * 8, length: int | None = None) -> Path:
    """A file with the given header bytes (not re-encoded), length prefix and data."""
    path.write_bytes((len(header) if length is None else length).to_bytes(8, "little") + header + data)
    return path


_W = '"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
_CAP = "safetensors caps headers at 100 MB"
RAW_HEADER_ERRORS: list[tuple[str, bytes, bytes, str]] = [
    (
        "deep",
        b"[" * 100_000 + b"]" * 100_000,
        b"",
        "{file}: the safetensors header nests JSON deeper than Python parses (a header is 3 levels deep); "
        "it is not safetensors",
    ),
    (
        "deep-index-like",
        b'{"w":' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001,
        b"",
        "{file}: the safetensors header nests JSON deeper than Python parses (a header is 3 levels deep); "
        "it is not safetensors",
    ),
    (
        "big-int",
        ('{"w":{"dtype":"F32","shape":[' + "9" * 5000 + '],"data_offsets":[0,8]}}').encode(),
        b"\0" * 8,
        "{file}: the safetensors header holds an integer of 5000 digits; sizes and offsets fit in 64 bits",
    ),
    (
        "dtype-list",
        b'{"w":{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}}',
        b"\0" * 8,
        f"{{file}}: tensor 'w' has dtype ['F32'], which torchferry cannot stream; known dtypes: {KNOWN}",
    ),
    (
        "dtype-dict",
        b'{"w":{"dtype":{"F32":1},"shape":[2],"data_offsets":[0,8]}}',
        b"\0" * 8,
        f"{{file}}: tensor 'w' has dtype {{'F32': 1}}, which torchferry cannot stream; known dtypes: {KNOWN}",
    ),
    (
        "bom",
        b"\xef\xbb\xbf{" + _W.encode() + b"}",
        b"\0" * 8,
        "{file}: the safetensors header begins with a byte-order mark; it must be UTF-8 without one",
    ),
    (
        "utf-16",
        ("{" + _W + "}").encode("utf-16"),
        b"\0" * 8,
        "{file}: the safetensors header is not UTF-8 (byte 0 is 0xff)",
    ),
    (
        "leading-space",
        b" {" + _W.encode() + b"}",
        b"\0" * 8,
        "{file}: the safetensors header must begin with '{' (it begins with whitespace)",
    ),
    (
        "duplicate",
        b'{"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},' + _W.encode() + b"}",
        b"\0" * 8,
        "{file}: the safetensors header names 'w' twice; keys must be unique",
    ),
    (
        "trailing",
        b"{" + _W.encode() + b"}",
        b"\0" * 12,
        "{file}: the tensors cover 8 of the data region's 12 bytes; the file has 4 trailing bytes no tensor "
        "names, so it is damaged or not safetensors",
    ),
    (
        "gap",
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        b'"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}',
        b"\0" * 12,
        "{file}: no tensor covers bytes 4-8 of the data region (before 'b'); safetensors data has no gaps, "
        "so the file is damaged",
    ),
    (
        "empty-inside",
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}}',
        b"\0" * 8,
        "{file}: empty tensor 'e' sits at offset 4, inside bytes another tensor holds (up to 8); "
        "safetensors offsets follow one another",
    ),
    (
        "nan",
        b'{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}',
        b"\0" * 8,
        "{file}: the safetensors header holds NaN, which is not JSON",
    ),
    (
        "surrogate",
        b'{"w\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
        b"\0" * 8,
        "{file}: tensor name 'w\\ud800' is not valid Unicode (a lone surrogate)",
    ),
    (
        "metadata-value",
        b'{"__metadata__":{"format":1},' + _W.encode() + b"}",
        b"\0" * 8,
        "{file}: '__metadata__' value 'format' is 1; metadata maps strings to strings",
    ),
    (
        "overflow",
        b'{"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}',
        b"\0" * 8,
        "{file}: tensor 'w' has shape [4294967296, 4294967296], whose size in bytes does not fit 64 bits",
    ),
    (
        "huge-length",
        b"{}",
        b"",
        "{file}: header length 100000001 does not fit a 10-byte file (" + _CAP + "); the file is truncated "
        "or not safetensors",
    ),
]


@pytest.mark.parametrize(
    ("case", "header", "data", "message"), RAW_HEADER_ERRORS, ids=[c[0] for c in RAW_HEADER_ERRORS]
)
def test_hostile_header_is_one_short_plan_error(
    tmp_path: Path, case: str, header: bytes, data: bytes, message: str
) -> None:
    """Each malformed header (nesting, huge ints, wrong types, encodings, duplicates, gaps) is a PlanError."""
    path = _raw_file(
        tmp_path / f"{case}.safetensors", header, data, 10**8 + 1 if case == "huge-length" else None
    )
    with pytest.raises(PlanError, match=re.escape(message.replace("{file}", str(path))) + r"\Z"):
        from_checkpoint(path)


def test_long_values_are_cut_in_messages(tmp_path: Path) -> None:
    """A value quoted from a file is cut to 200 characters, so a message stays short whatever the file."""
    long = "x" * 10**6
    path = _raw_file(tmp_path / "long.safetensors", json.dumps({long: {"dtype": long}}).encode())
    with pytest.raises(PlanError) as caught:
        from_checkpoint(path)
    assert str(caught.value) == (
        f"{path}: tensor {show(long)} needs 'dtype', 'shape' and 'data_offsets' in the header, got "
        f"{show({'dtype': long})}"
    )
    assert show(long) == repr(long)[:200] + "... (1000002 characters)"
    assert len(str(caught.value)) < 700


def test_unicode_digits_are_not_block_indices(tmp_path: Path) -> None:
    """'blocks.².w' is not a block (str.isdigit accepts '²'): it stays with the remainder, no crash."""
    path = tmp_path / "m.safetensors"
    write(path, {"blocks.0.w": ("F32", (1,)), "blocks.².w": ("F32", (1,))})
    component = from_checkpoint(path).components[0]
    assert [b.path for b in component.blocks] == ["blocks.0"]
    assert [t.name for t in component.tensors] == ["blocks.².w"]


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    """A folder named x.safetensors, a FIFO and a device are refused without opening them (no hang)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write(folder / "a.safetensors", {"w": ("F32", (1,))})
    (folder / "x.safetensors").mkdir()
    with pytest.raises(
        PlanError,
        match=re.escape(
            f"{folder / 'x.safetensors'}: is a folder, not a regular file; a checkpoint is read from files"
        ),
    ):
        from_checkpoint(folder)
    if not hasattr(os, "mkfifo"):
        return
    os.rmdir(folder / "x.safetensors")
    os.mkfifo(folder / "x.safetensors")
    started = time.monotonic()
    with pytest.raises(
        PlanError,
        match=re.escape(
            f"{folder / 'x.safetensors'}: is a FIFO, not a regular file; a checkpoint is read from files"
        ),
    ):
        from_checkpoint(folder)
    how = "point checkpoint at a .safetensors file, a folder of them, or a *.index.json"
    with pytest.raises(
        PlanError, match=re.escape(f"{folder / 'x.safetensors'}: is a FIFO, not a regular file; {how}")
    ):
        from_checkpoint(folder / "x.safetensors")
    if os.path.exists("/dev/null"):
        with pytest.raises(
            PlanError, match=re.escape(f"/dev/null: is a character device, not a regular file; {how}")
        ):
            from_checkpoint("/dev/null")
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "sub/../../outside.safetensors", "/dev/stdin", "ABS", ""]
)
def test_index_shards_must_stay_in_the_index_folder(tmp_path: Path, shard: str) -> None:
    """A weight map naming '..', an absolute path or a device is refused before any shard is opened."""
    write(tmp_path / "outside.safetensors", {"w": ("F32", (1,))})
    folder = tmp_path / "ckpt"
    folder.mkdir()
    name = str(tmp_path / "outside.safetensors") if shard == "ABS" else shard
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(
        PlanError,
        match=re.escape(
            f"{index}: the index names shard {name!r} for tensor 'w', which is not a file name inside the "
            "index's folder; shards must sit beside the index (no absolute paths, no '..')"
        ),
    ):
        from_checkpoint(index)


def test_index_symlinks_as_in_the_hugging_face_cache_still_work(tmp_path: Path) -> None:
    """Snapshot symlinks to ../../blobs (the Hugging Face cache) load: names are checked, not targets."""
    blobs = tmp_path / "blobs"
    snapshot = tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    write(blobs / "1111", {"blocks.0.w": ("F32", (2,))})
    write(blobs / "2222", {"blocks.1.w": ("F32", (2,))})
    weight_map = {"blocks.0.w": "model-1.safetensors", "blocks.1.w": "model-2.safetensors"}
    (blobs / "3333").write_text(json.dumps({"weight_map": weight_map}))
    for link, blob in [
        ("model-1.safetensors", "1111"),
        ("model-2.safetensors", "2222"),
        ("model.safetensors.index.json", "3333"),
    ]:
        (snapshot / link).symlink_to(Path("..") / ".." / "blobs" / blob)
    topology = from_checkpoint(snapshot / "model.safetensors.index.json")
    assert [b.path for b in topology.components[0].blocks] == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[" * 100_000 + "]" * 100_000,
            "{index}: the index nests JSON deeper than Python parses (a header is 3 levels deep); it is not "
            "safetensors",
        ),
        (
            '{"weight_map": {"w": ["a.safetensors"]}}',
            "{index}: the index maps tensor 'w' to ['a.safetensors']; shard names are strings",
        ),
        (
            '{"weight_map": {"w": 1' + "0" * 5000 + "}}",
            "{index}: the index holds an integer of 5001 digits; sizes and offsets fit in 64 bits",
        ),
        ('{"weight_map": {"w": "a", "w": "b"}}', "{index}: the index names 'w' twice; keys must be unique"),
        ('{"weight_map": []}', "{index}: an index needs a 'weight_map' object of tensor name -> shard file"),
    ],
)
def test_malformed_index_is_a_plan_error(tmp_path: Path, text: str, message: str) -> None:
    """Deep nesting, huge ints, duplicate keys and wrong types in an index are PlanErrors naming the index."""
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(PlanError, match=re.escape(message.replace("{index}", str(index))) + r"\Z"):
        from_checkpoint(index)
