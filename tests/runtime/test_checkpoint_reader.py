"""The safetensors checkpoint reader: header checks, validation against the model, packed reads."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torchferry.runtime.files._checkpoint_reader as checkpoint_module
from torchferry import ExecutionError, PlanError
from torchferry.runtime.files._checkpoint_reader import MAX_LISTED, CheckpointReader
from torchferry.topology import (
    Block,
    Component,
    OffloadConfig,
    Plan,
    Stack,
    TensorSpec,
    Topology,
    pack,
    packed_nbytes,
)
from torchferry.topology._safetensors import HeaderEntry


class _Layer(nn.Module):
    """A block mixing bf16, fp32, int64 and int8 tensors of odd sizes, plus a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 3).to(torch.bfloat16)
        self.norm = nn.LayerNorm(7)
        self.register_buffer("positions", torch.randint(-(2**40), 2**40, (3,), dtype=torch.int64))
        self.register_buffer("mask", torch.randint(-128, 127, (5,), dtype=torch.int8))
        self.register_buffer("rope", torch.randn(4), persistent=False)


class _Model(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(_Layer() for _ in range(layers))
        self.head = nn.Linear(6, 2, bias=False).to(torch.bfloat16)


def _specs(module: nn.Module, prefix: str = "") -> list[TensorSpec]:
    """Tensor specs named the way the model qualifies them (``prefix`` + state-dict name)."""
    persistent = set(module.state_dict())
    named = [*module.named_parameters(), *module.named_buffers()]
    return [
        TensorSpec(
            name=prefix + name,
            shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            buffer=not isinstance(t, nn.Parameter),
            persistent=name in persistent,
        )
        for name, t in named
    ]


def _block(module: _Model, index: int, prefix: str = "") -> Block:
    path = f"{prefix}blocks.{index}"
    specs = [s for s in _specs(module, prefix) if s.name.startswith(path + ".") and s.persistent]
    return Block(path=path, tensors=specs)


def _packed(module: nn.Module, block: Block, prefix: str = "") -> torch.Tensor:
    """The block's flat buffer built directly from the module's tensors, laid out by `pack`."""
    state = module.state_dict()
    return _flat(block.layout, lambda name: state[name.removeprefix(prefix)])


def _flat(layout: Any, tensor: Any) -> torch.Tensor:
    """The flat buffer ``layout`` describes: each tensor's bytes at its offset, zeros between."""
    out = torch.zeros(packed_nbytes(layout), dtype=torch.uint8)
    for spec, off in layout:
        out[off : off + spec.nbytes] = tensor(spec.name).reshape(-1).view(torch.uint8)
    return out


def _model() -> _Model:
    torch.manual_seed(0)
    return _Model()


def _save(model: nn.Module, tmp_path: Path, form: str) -> Path:
    """Write the model's state dict as one file, a folder of two shards, or shards with an index."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if form == "single":
        path = tmp_path / "model.safetensors"
        save_file(state, str(path))
        return path
    keys = sorted(state)
    halves = {"part-00001.safetensors": keys[::2], "part-00002.safetensors": keys[1::2]}
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for file, names in halves.items():
        save_file({k: state[k] for k in names}, str(folder / file))
    if form == "folder":
        return folder
    index = folder / "model.safetensors.index.json"
    weight_map = {k: file for file, names in halves.items() for k in names}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def _raw(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    """Write a safetensors-shaped file by hand: length prefix, header (JSON unless bytes), data."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    prefix = struct.pack("<Q", len(body) if length is None else length)
    path.write_bytes(prefix + body + data)
    return path


def _message(path: object, *problems: str) -> str:
    count = f"{len(problems)} problem" + ("" if len(problems) == 1 else "s")
    lines = "\n".join(f"  - {p}" for p in problems)
    return (
        f"checkpoint {path} cannot fill the expected tensors; {count} (nothing was read or changed):\n{lines}"
    )


_RESAVE = "re-save or re-download the file"


@pytest.mark.parametrize("form", ["single", "folder", "index"])
def test_read_into_full_blocks_reproduce_the_packed_buffer(tmp_path: Path, form: str) -> None:
    """Every block read whole equals the flat buffer packed from the module's own tensors, byte for byte."""
    model = _model()
    path = _save(model, tmp_path, form)
    with CheckpointReader(path) as reader:
        reader.validate(_specs(model))
        for i in range(3):
            block = _block(model, i)
            out = torch.empty(block.nbytes, dtype=torch.uint8)
            reader.read_into(block.layout, out)
            assert torch.equal(out, _packed(model, block))


@pytest.mark.parametrize("world", [2, 3])
def test_shard_ranges_reassemble_the_block_with_zero_padding(tmp_path: Path, world: int) -> None:
    """Each rank's 1/N range equals its slice of the packed buffer; bytes past the block's end are zero."""
    model = _model()
    block = _block(model, 1)
    expected = _packed(model, block)
    total = block.nbytes
    assert total % world != 0  # the last shard carries padding
    shard = math.ceil(total / world)
    starts = {off for _, off in block.layout}
    straddles = [r * shard for r in range(1, world) if r * shard not in starts]
    assert straddles  # at least one shard boundary falls inside a tensor
    padded = torch.cat([expected, torch.zeros(shard * world - total, dtype=torch.uint8)])
    with CheckpointReader(_save(model, tmp_path, "index")) as reader:
        for rank in range(world):
            out = torch.full((shard,), 0xAB, dtype=torch.uint8)
            reader.read_into(block.layout, out, rank * shard, (rank + 1) * shard)
            assert torch.equal(out, padded[rank * shard : (rank + 1) * shard])
        beyond = torch.full((7,), 0xAB, dtype=torch.uint8)
        reader.read_into(block.layout, beyond, total + 1, total + 8)  # a shard that is all padding
        assert torch.equal(beyond, torch.zeros(7, dtype=torch.uint8))


def test_reads_cross_window_and_page_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors larger than one mapped window, at unaligned file offsets, copy exactly."""
    monkeypatch.setattr(checkpoint_module, "WINDOW_BYTES", 4096 + 13)
    torch.manual_seed(1)
    state = {"a.w": torch.randn(3001, dtype=torch.float32), "a.b": torch.randn(7, dtype=torch.bfloat16)}
    path = tmp_path / "big.safetensors"
    save_file(state, str(path))
    specs = [TensorSpec(name=k, shape=tuple(v.shape), dtype=str(v.dtype)[6:]) for k, v in state.items()]
    layout = pack(specs)
    expected = _flat(layout, state.__getitem__)
    with CheckpointReader(path) as reader:
        out = torch.empty(expected.numel(), dtype=torch.uint8)
        reader.read_into(layout, out)
        assert torch.equal(out, expected)
        part = torch.empty(5000, dtype=torch.uint8)
        reader.read_into(layout, part, 4000, 9000)
        assert torch.equal(part, expected[4000:9000])
        assert torch.equal(reader.read_tensor("a.w"), state["a.w"])


def test_read_tensor_returns_a_remainder_tensor(tmp_path: Path) -> None:
    """A non-block tensor comes back with its dtype, shape and values, through the prefix map."""
    model = _model()
    with CheckpointReader(_save(model, tmp_path, "single"), prefix_map={"transformer.": ""}) as reader:
        embed = reader.read_tensor("transformer.embed.weight")
        head = reader.read_tensor("transformer.head.weight")
    assert embed.dtype == torch.float32
    assert torch.equal(embed, model.embed.weight.detach())
    assert head.dtype == torch.bfloat16
    assert torch.equal(head, model.head.weight.detach())


def test_prefix_map_serves_a_component_checkpoint(tmp_path: Path) -> None:
    """Model names under ``transformer.`` validate and read against keys that lack the prefix."""
    model = _model()
    path = _save(model, tmp_path, "folder")
    prefix = "transformer."
    block = _block(model, 2, prefix)
    with CheckpointReader(path) as reader:
        reader.validate(_specs(model, prefix), prefix_map={prefix: ""})
        out = torch.empty(block.nbytes, dtype=torch.uint8)
        reader.read_into(block.layout, out, prefix_map={prefix: ""})
        assert reader.key("transformer.blocks.0.proj.weight", {prefix: "", "transformer.blocks.": "b."}) == (
            "b.0.proj.weight"
        )
    assert torch.equal(out, _packed(model, block, prefix))


def test_tied_tensors_count_once_and_non_persistent_buffers_are_not_expected(tmp_path: Path) -> None:
    """A tied weight found under an alias satisfies its owner; a non-persistent buffer is never missing."""
    weight = torch.randn(4, 3)
    path = tmp_path / "tied.safetensors"
    save_file({"lm_head.weight": weight}, str(path))
    specs = [
        TensorSpec(name="embed.weight", shape=(4, 3), dtype="float32", aliases=("lm_head.weight",)),
        TensorSpec(name="rope", shape=(8,), dtype="float32", buffer=True, persistent=False),
    ]
    with CheckpointReader(path) as reader:
        reader.validate(specs)
        out = torch.empty(48, dtype=torch.uint8)
        reader.read_into(pack(specs[:1]), out)
    assert torch.equal(out, weight.view(-1).view(torch.uint8))


def test_validate_lists_missing_extra_shape_and_dtype_problems_at_once(tmp_path: Path) -> None:
    """Missing, wrong-shape, wrong-dtype and extra tensors all appear, in order, in one PlanError."""
    path = tmp_path / "m.safetensors"
    save_file(
        {
            "a": torch.zeros(2, 3),
            "b": torch.zeros(4, dtype=torch.bfloat16),
            "c": torch.zeros(5, dtype=torch.int64),
            "zz": torch.zeros(1),
        },
        str(path),
    )
    specs = [
        TensorSpec(name="t.a", shape=(3, 2), dtype="float32"),
        TensorSpec(name="t.b", shape=(4,), dtype="float32"),
        TensorSpec(name="t.gone", shape=(1,), dtype="float32"),
        TensorSpec(name="t.c", shape=(5,), dtype="int64"),
    ]
    expected = _message(
        path,
        f"{path}: tensor 'a': shape [2, 3] but the model expects [3, 2] for 't.a'; this checkpoint is for "
        "another model configuration",
        f"{path}: tensor 'b': dtype bfloat16 but the model expects float32 for 't.b'; convert the checkpoint "
        "(loading copies bytes and never converts dtypes)",
        f"{path}: tensor 't.gone' (looked up as 'gone') is missing; add it to the checkpoint or map its name "
        "with prefix_map",
        f"{path}: tensor 'zz' is not expected by the model; remove it, map the model's names with "
        "prefix_map, or pass allow_extra=True",
    )
    with (
        CheckpointReader(path, prefix_map={"t.": ""}) as reader,
        pytest.raises(PlanError, match=re.escape(expected)),
    ):
        reader.validate(specs)


def test_a_checkpoint_with_very_many_unexpected_tensors_lists_a_few(tmp_path: Path) -> None:
    """Tens of thousands of unexpected tensors make one short PlanError: the other problems first,
    then the first unexpected tensors, MAX_LISTED lines in all, and a count of the rest."""
    path = tmp_path / "m.safetensors"
    extra = 30_000
    save_file({"a": torch.zeros(2, 3), **{f"stray.{i:05d}": torch.zeros(1) for i in range(extra)}}, str(path))
    specs = [TensorSpec(name="a", shape=(3, 2), dtype="float32")]
    with CheckpointReader(path) as reader, pytest.raises(PlanError) as caught:
        reader.validate(specs)
    text = str(caught.value)
    lines = text.splitlines()
    count = f"{extra + 1} problems (nothing was read or changed):"
    assert lines[0] == f"checkpoint {path} cannot fill the expected tensors; {count}"
    assert len(lines) == 1 + MAX_LISTED + 1 and len(text) < 5000
    assert lines[1].startswith(f"  - {path}: tensor 'a': shape [2, 3] but the model expects [3, 2]")
    assert lines[2] == (
        f"  - {path}: tensor 'stray.00000' is not expected by the model; remove it, map the model's names "
        "with prefix_map, or pass allow_extra=True"
    )
    rest = extra - (MAX_LISTED - 1)
    assert lines[-1] == f"  - ... and {rest} more, {rest} of them tensors the model does not expect"


def test_allow_extra_accepts_a_checkpoint_holding_more(tmp_path: Path) -> None:
    """With allow_extra, tensors the model does not expect are not problems."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(2), "b": torch.zeros(3)}, str(path))
    with CheckpointReader(path) as reader:
        reader.validate([TensorSpec(name="a", shape=(2,), dtype="float32")], allow_extra=True)


_GOOD = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    ("case", "header", "data", "length", "problem"),
    [
        ("short", None, b"", None, "5 bytes is too short for a safetensors file (no header length)"),
        (
            "prefix",
            _GOOD,
            b"\0" * 8,
            10_000,
            "header length 10000 does not fit a 77-byte file; the file is truncated or not safetensors",
        ),
        (
            "json",
            b'{"w": ',
            b"",
            None,
            "the safetensors header is not valid JSON (Expecting value: line 1 column 7 (char 6))",
        ),
        (
            "utf8",
            b'{"\xff": 1}',
            b"",
            None,
            "the safetensors header is not UTF-8 (byte 2 is 0xff)",
        ),
        ("list", [1, 2], b"", None, "the safetensors header is a list, not a JSON object"),
        (
            "entry",
            {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "tensor 'w' has shape [-2]; a shape is a list of non-negative ints",
        ),
        (
            "backwards",
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
            b"\0" * 8,
            None,
            "tensor 'w' has data_offsets [8, 0] outside the file's 8-byte data region",
        ),
        (
            "length",
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 6]}},
            b"\0" * 8,
            None,
            "tensor 'w' spans 6 bytes, but shape (2,) of float32 needs 8",
        ),
        (
            "beyond",
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [64, 72]}},
            b"\0" * 8,
            None,
            "tensor 'w' has data_offsets [64, 72] outside the file's 8-byte data region",
        ),
        (
            "truncated",
            _GOOD,
            b"\0" * 5,
            None,
            "tensor 'w' has data_offsets [0, 8] outside the file's 5-byte data region",
        ),
    ],
)
def test_each_corrupt_file_fails_validation_with_its_message(
    tmp_path: Path, *, case: str, header: object, data: bytes, length: int | None, problem: str
) -> None:
    """Every kind of corrupt file is reported naming file, tensor and fix, and its tensors as unknown."""
    path = tmp_path / f"{case}.safetensors"
    if header is None:
        path.write_bytes(b"\x01\x02\x03\x04\x05")
    else:
        _raw(path, header, data, length)
    unknown = (
        f"{path}: tensor 'w' is in none of the readable files; it may be in {path}, whose header could "
        "not be read (see above)"
    )
    expected = _message(path, f"{path}: {problem}; {_RESAVE}", unknown)
    with CheckpointReader(path) as reader, pytest.raises(PlanError, match=re.escape(expected)):
        reader.validate([TensorSpec(name="w", shape=(2,), dtype="float32")])


def test_overlapping_ranges_make_the_file_unusable(tmp_path: Path) -> None:
    """Two tensors whose byte ranges overlap are reported, and nothing of the file is read."""
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    path = _raw(tmp_path / "x.safetensors", header, b"\0" * 12)
    specs = [TensorSpec(name=n, shape=(2,), dtype="float32") for n in ("a", "b")]
    overlap = f"{path}: tensors 'a' and 'b' overlap in the data region (bytes 0-8 and 4-12); {_RESAVE}"
    unknown = (
        f"{path}: 2 expected tensors ('a', 'b') are in none of the readable files; they may be in {path}, "
        "whose header could not be read (see above)"
    )
    size = packed_nbytes(pack(specs))
    out = torch.full((size,), 7, dtype=torch.uint8)
    with CheckpointReader(path) as reader:
        assert reader.unreadable == (str(path),)
        with pytest.raises(PlanError, match=re.escape(_message(path, overlap, unknown))):
            reader.validate(specs)
        with pytest.raises(PlanError, match=re.escape(_message(path, unknown))):
            reader.read_into(pack(specs), out)
    assert torch.equal(out, torch.full((size,), 7, dtype=torch.uint8))


def test_read_into_validates_before_touching_out(tmp_path: Path) -> None:
    """A layout that disagrees with the checkpoint raises and leaves every byte of ``out`` as it was."""
    model = _model()
    path = _save(model, tmp_path, "single")
    block = _block(model, 0)
    wrong = Block(
        path=block.path,
        tensors=[
            TensorSpec(name=s.name, shape=s.shape, dtype="float16") if s.dtype == "bfloat16" else s
            for s in block.tensors
        ],
    )
    out = torch.full((wrong.nbytes,), 0xAB, dtype=torch.uint8)
    problems = [
        f"{path}: tensor '{name}': dtype bfloat16 but the model expects float16 for '{name}'; convert the "
        "checkpoint (loading copies bytes and never converts dtypes)"
        for name in ("blocks.0.proj.bias", "blocks.0.proj.weight")  # layout order: by itemsize, then name
    ]
    with (
        CheckpointReader(path) as reader,
        pytest.raises(PlanError, match=re.escape(_message(path, *problems))),
    ):
        reader.read_into(wrong.layout, out)
    assert bool((out == 0xAB).all())


def test_read_into_rejects_a_bad_destination(tmp_path: Path) -> None:
    """A destination of the wrong size, dtype or layout, or a reversed range, is a runtime error."""
    model = _model()
    block = _block(model, 0)
    n = block.nbytes
    with CheckpointReader(_save(model, tmp_path, "single")) as reader:
        with pytest.raises(
            ExecutionError,
            match=re.escape(f"read_into: out holds {n - 1} bytes but the range [0, {n}) is {n}"),
        ):
            reader.read_into(block.layout, torch.empty(n - 1, dtype=torch.uint8))
        with pytest.raises(
            ExecutionError,
            match=re.escape("read_into: out must be a contiguous CPU uint8 tensor, got torch.float32 on cpu"),
        ):
            reader.read_into(block.layout, torch.empty(n, dtype=torch.float32))
        with pytest.raises(
            ExecutionError,
            match=re.escape(
                "read_into: out must be a contiguous CPU uint8 tensor, "
                "got torch.uint8 on cpu (not contiguous)"
            ),
        ):
            reader.read_into(block.layout, torch.empty(2 * n, dtype=torch.uint8)[::2])
        with pytest.raises(
            ExecutionError, match=re.escape("read_into: [5, 2) is not a byte range; need 0 <= start <= end")
        ):
            reader.read_into(block.layout, torch.empty(0, dtype=torch.uint8), 5, 2)


def test_index_problems_name_the_index_and_the_shard(tmp_path: Path) -> None:
    """An index pointing at a missing shard, or at the wrong shard, and duplicate keys are reported."""
    folder = tmp_path / "idx"
    folder.mkdir()
    save_file({"a": torch.zeros(2), "d": torch.zeros(1)}, str(folder / "one.safetensors"))
    save_file({"b": torch.zeros(2), "d": torch.zeros(1)}, str(folder / "two.safetensors"))
    weight_map = {
        "a": "two.safetensors",
        "b": "two.safetensors",
        "c": "gone.safetensors",
        "d": "one.safetensors",
    }
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    one, two, gone = (str(folder / f) for f in ("one.safetensors", "two.safetensors", "gone.safetensors"))
    specs = [TensorSpec(name=n, shape=(2,), dtype="float32") for n in "abc"]
    expected = _message(
        index,
        f"{index}: lists 1 tensor in {gone}, which does not exist; restore the file or fix the index",
        f"{index}: tensor 'd' appears in both {one} and {two}; keep one copy",
        f"{index}: says tensor 'a' is in {two}, but it is in {one}; fix the index",
    )
    with CheckpointReader(index) as reader, pytest.raises(PlanError, match=re.escape(expected)):
        reader.validate(specs)


def test_unusable_paths_fail_when_opened(tmp_path: Path) -> None:
    """A missing path, a folder without shards and a broken index fail at once with how to fix them."""
    how = "point checkpoint at a .safetensors file, a folder of them, or a *.index.json"
    with pytest.raises(PlanError, match=re.escape(f"{tmp_path / 'nope'}: no such checkpoint file or folder")):
        CheckpointReader(tmp_path / "nope")
    with pytest.raises(
        PlanError, match=re.escape(f"{tmp_path}: the folder holds no *.safetensors file; {how}")
    ):
        CheckpointReader(tmp_path)
    bad = tmp_path / "x.index.json"
    bad.write_text('{"metadata": {}}')
    with pytest.raises(
        PlanError,
        match=re.escape(f"{bad}: an index needs a 'weight_map' object of tensor name -> shard file"),
    ):
        CheckpointReader(bad)


def test_missing_tensor_read_and_closed_reader_fail_clearly(tmp_path: Path) -> None:
    """Reading an absent tensor is a PlanError; any read after close is an ExecutionError."""
    model = _model()
    path = _save(model, tmp_path, "single")
    reader = CheckpointReader(path)
    missing = f"{path}: tensor 'nope' is missing; add it to the checkpoint or map its name with prefix_map"
    with pytest.raises(PlanError, match=re.escape(_message(path, missing))):
        reader.read_tensor("nope")
    with reader:
        assert "embed.weight" in reader
        assert (
            repr(reader) == f"CheckpointReader({str(path)!r}, {len(model.state_dict())} tensors in 1 files)"
        )
    assert reader.closed
    closed = f"checkpoint reader for {path} is closed; open a new CheckpointReader"
    with pytest.raises(ExecutionError, match=re.escape(closed)):
        reader.read_tensor("embed.weight")
    with pytest.raises(ExecutionError, match=re.escape(closed)):
        reader.validate([])


def test_validate_accepts_a_topology_a_plan_or_a_component(tmp_path: Path) -> None:
    """Expected tensors come from every component, stack and remainder of a topology or plan."""
    model = _model()
    path = _save(model, tmp_path, "single")
    specs = [s for s in _specs(model, "transformer.") if not s.name.startswith("transformer.blocks.")]
    blocks = [_block(model, i, "transformer.") for i in range(3)]
    rope = TensorSpec(
        name="transformer.blocks.0.rope", shape=(4,), dtype="float32", buffer=True, persistent=False
    )
    component = Component(
        path="transformer",
        kind="dit",
        tensors=[s for s in specs if s.persistent],
        stacks=[Stack(attrs=("blocks",), blocks=blocks)],
        children=[Component(path="transformer.extra", kind="resident", tensors=[rope])],
    )
    topology = Topology(pipeline_class="Pipe", components=[component])
    plan = Plan(topology=topology, config=OffloadConfig(), components=[component])
    with CheckpointReader(path, prefix_map={"transformer.": ""}) as reader:
        for expected in (topology, plan, component):
            reader.validate(expected)
        reader.validate(blocks[1], allow_extra=True)
        ghost = TensorSpec(name="transformer.extra.ghost", shape=(1,), dtype="float32")
        child = Component(path="transformer.extra", kind="resident", tensors=[rope, ghost])
        bigger = Topology(pipeline_class="Pipe", components=[attrs.evolve(component, children=[child])])
        missing = (
            f"{path}: tensor 'transformer.extra.ghost' (looked up as 'extra.ghost') is missing; add it to "
            "the checkpoint or map its name with prefix_map"
        )
        with pytest.raises(PlanError, match=re.escape(_message(path, missing))):
            reader.validate(bigger)


def test_non_persistent_buffer_bytes_in_a_layout_are_left_for_the_caller(tmp_path: Path) -> None:
    """A block layout holding a non-persistent buffer reads every other tensor and keeps that range as is."""
    model = _model()
    path = _save(model, tmp_path, "single")
    block = _block(model, 0)
    rope = TensorSpec(name="blocks.0.rope", shape=(4,), dtype="float32", buffer=True, persistent=False)
    layout = pack([*block.tensors, rope])
    rope_at = next(off for spec, off in layout if spec.name == "blocks.0.rope")
    end = packed_nbytes(layout)
    out = torch.full((end + 3,), 0xCD, dtype=torch.uint8)
    with CheckpointReader(path) as reader:
        reader.read_into(layout, out, 0, end + 3)
    state = model.state_dict()
    for spec, off in layout:
        got = out[off : off + spec.nbytes]
        if spec is rope:
            assert bool((got == 0xCD).all())
        else:
            assert torch.equal(got, state[spec.name].reshape(-1).view(torch.uint8))
    assert rope_at + 16 < end  # the buffer sits among the fp32 tensors, not at the end
    covered = torch.zeros(end + 3, dtype=torch.bool)
    for spec, off in layout:
        covered[off : off + spec.nbytes] = True
    assert bool((out[~covered] == 0).all())  # alignment padding and the bytes past the end are zeros


def test_a_file_replaced_while_open_yields_its_old_tensors(tmp_path: Path) -> None:
    """A shard replaced on disk after the reader opened it reads as the tensors its header described."""
    path = tmp_path / "model.safetensors"
    old = {"a": torch.arange(4, dtype=torch.float32), "b": torch.full((3,), 7, dtype=torch.int64)}
    new = {"b": torch.full((2,), -1, dtype=torch.int64), "a": torch.ones(9), "c": torch.zeros(5)}
    save_file(old, str(path))
    with CheckpointReader(path) as reader:
        save_file(new, str(tmp_path / "new.safetensors"))
        (tmp_path / "new.safetensors").replace(path)  # another layout at the same path
        assert torch.equal(reader.read_tensor("a"), old["a"])
        assert torch.equal(reader.read_tensor("b"), old["b"])
    with CheckpointReader(path) as reader:
        assert torch.equal(reader.read_tensor("a"), new["a"])


def test_the_header_is_parsed_from_the_descriptor_the_data_comes_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file replaced between the open and the header parse still gives header and data of one file."""
    path = tmp_path / "model.safetensors"
    old = {"a": torch.arange(6, dtype=torch.float32)}
    save_file(old, str(path))
    save_file({"z": torch.ones(1), "a": torch.full((6,), 3.0)}, str(tmp_path / "other.safetensors"))
    parse = checkpoint_module.parse_header

    def replace_then_parse(file: str, handle: BinaryIO) -> tuple[HeaderEntry, ...]:
        if (tmp_path / "other.safetensors").exists():  # the race, once: the path changes after the open
            (tmp_path / "other.safetensors").replace(path)
        return parse(file, handle)

    monkeypatch.setattr(checkpoint_module, "parse_header", replace_then_parse)
    with CheckpointReader(path) as reader:
        assert list(reader.entries) == ["a"]
        assert torch.equal(reader.read_tensor("a"), old["a"])


def test_non_regular_shards_are_problems_not_hangs(tmp_path: Path) -> None:
    """A FIFO or folder named *.safetensors in a checkpoint folder is reported by validate, unblocked."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": torch.zeros(2)}, str(folder / "a.safetensors"))
    (folder / "b.safetensors").mkdir()
    fifo = folder / "c.safetensors"
    if hasattr(os, "mkfifo"):
        os.mkfifo(fifo)
    problems = [
        f"{folder / 'b.safetensors'}: is a folder, not a regular file; a checkpoint is read from files; "
        f"{_RESAVE}"
    ]
    if hasattr(os, "mkfifo"):
        problems.append(f"{fifo}: is a FIFO, not a regular file; a checkpoint is read from files; {_RESAVE}")
    with (
        CheckpointReader(folder) as reader,
        pytest.raises(PlanError, match=re.escape(_message(folder, *problems))),
    ):
        reader.validate([TensorSpec(name="a", shape=(2,), dtype="float32")])


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/dev/stdin"])
def test_index_escapes_are_refused_when_opened(tmp_path: Path, shard: str) -> None:
    """An index naming a shard outside its folder (or a device) fails at open, before any shard is read."""
    save_file({"a": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(
        PlanError,
        match=re.escape(
            f"{index}: the index names shard {shard!r} for tensor 'a', which is not a file name inside the "
            "index's folder; shards must sit beside the index (no absolute paths, no '..')"
        ),
    ):
        CheckpointReader(index)


@pytest.mark.parametrize("shard", [None, 1])
def test_tensors_named_to_widen_are_read_from_16_bits_into_float32(tmp_path: Path, shard: int | None) -> None:
    """A float32 model tensor named in ``widen`` and stored in bfloat16 is read widened, exactly, into
    the packed buffer (a whole block or a shard range) and by read_tensor; without ``widen`` it is the
    dtype mismatch it always was, and ``widen`` never narrows."""
    model = _model()
    state = model.state_dict()
    stored = {k: (v.to(torch.bfloat16) if ".norm." in k else v).contiguous() for k, v in state.items()}
    path = tmp_path / "model.safetensors"
    save_file(stored, str(path))
    with torch.no_grad():
        for layer in model.blocks:
            layer.norm.weight.copy_(layer.norm.weight.to(torch.bfloat16).float())
            layer.norm.bias.copy_(layer.norm.bias.to(torch.bfloat16).float())
    block = _block(model, 1)
    norms = {s.name for s in block.tensors if ".norm." in s.name}
    expected = _packed(model, block)
    start, end = (0, expected.numel()) if shard is None else (8, expected.numel() - 8)
    with CheckpointReader(path, widen=norms | {"embed.weight"}) as reader:
        out = torch.empty(end - start, dtype=torch.uint8)
        reader.read_into(block.layout, out, start, end)
        assert torch.equal(out, expected[start:end])
        weight = reader.read_tensor("blocks.1.norm.weight")
        assert weight.dtype == torch.float32 and torch.equal(weight, model.blocks[1].norm.weight.detach())
        reader.validate(block.tensors, allow_extra=True)
        embed = next(s for s in _specs(model) if s.name == "embed.weight")
        with pytest.raises(PlanError, match="dtype float32 but the model expects bfloat16"):
            reader.validate([attrs.evolve(embed, dtype="bfloat16")], allow_extra=True)
    with CheckpointReader(path) as reader, pytest.raises(PlanError) as refused:
        reader.read_into(block.layout, torch.empty(expected.numel(), dtype=torch.uint8))
    assert "tensor 'blocks.1.norm.weight': dtype bfloat16 but the model expects float32" in str(refused.value)
