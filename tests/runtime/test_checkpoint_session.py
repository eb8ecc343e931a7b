"""Sessions filled from a safetensors checkpoint: meta-built pipelines, validation before any change."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from module_checks import hook_count, same_weights
from safetensors.torch import load_file, save_file

import torchferry
from torchferry import PlanError, topology
from torchferry.testing import toy

Snapshot = dict[str, tuple[int, str, tuple[int, ...]]]


def _snapshot(p: torch.nn.Module) -> Snapshot:
    """Every tensor's identity, storage address, device and shape, to prove nothing was touched."""
    named = [*p.named_parameters(remove_duplicate=False), *p.named_buffers(remove_duplicate=False)]
    return {n: (id(t), f"{t.device}:{0 if t.is_meta else t.data_ptr()}", tuple(t.shape)) for n, t in named}




def _save(tmp_path: Path, form: str, two_experts: bool = False) -> Path:
    """The toy (seed 0) as one file, a folder of two shards, or two shards with an index."""
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, two_experts=two_experts), path)
    if form == "file":
        return path
    state = load_file(str(path))
    path.unlink()
    keys = sorted(state)
    halves = {"part-1.safetensors": keys[::2], "part-2.safetensors": keys[1::2]}
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, str(folder / name))
    if form == "folder":
        return folder
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: f for f, part in halves.items() for k in part}}))
    return index


@pytest.mark.parametrize(("form", "two_experts"), [("file", False), ("folder", True), ("index", False)])
def test_meta_built_pipeline_runs_bit_identical(tmp_path: Path, form: str, two_experts: bool) -> None:
    """A pipeline built with meta parameters and filled from the checkpoint equals the normally built one."""
    path = _save(tmp_path, form, two_experts)
    ref = toy.build(0, two_experts=two_experts)
    p = toy.build_empty(two_experts=two_experts)
    assert p.transformer.blocks[0].q.weight.is_meta
    skip = {1: {2}}
    with torchferry.offload(p, strategy="layerwise", device="cpu", checkpoint=path, prefetch_depth=2):
        assert not any(t.is_meta for t in [*p.parameters(), *p.buffers()])
        assert torch.equal(p("a cat", steps=3), ref("a cat", steps=3))
        assert torch.equal(p("a cat", steps=3, skip=skip), ref("a cat", steps=3, skip=skip))
    assert same_weights(p, ref)
    block = p.transformer.blocks[0]
    assert block.out.weight.stride() == (1, 32)  # the transposed weight keeps its strides
    assert block.norm_k.weight is block.norm_q.weight
    assert hook_count(p) == 0


def test_checkpoint_components_fill_only_those_components(tmp_path: Path) -> None:
    """checkpoint_components= fills the named components from the file; the others keep their own weights."""
    path = _save(tmp_path, "file")
    p = toy.build_empty()
    mine = toy.build(1).transformer  # weights of another seed, not the checkpoint's
    p.transformer = mine
    expected = toy.build(0)
    expected.transformer = toy.build(1).transformer
    only = ["text_encoder", "vae"]
    with torchferry.offload(p, strategy="none", device="cpu", checkpoint=path, checkpoint_components=only):
        assert torch.equal(p("a cat"), expected("a cat"))
    assert same_weights(p, expected)


def test_checkpoint_components_are_checked_before_anything_moves(tmp_path: Path) -> None:
    """An unknown name, a meta component left out, or no checkpoint is a PlanError; nothing is touched."""
    path = _save(tmp_path, "file")
    p = toy.build_empty()
    before = _snapshot(p)
    options: dict[str, Any] = {"strategy": "layerwise", "device": "cpu"}
    with pytest.raises(PlanError) as unknown:
        torchferry.offload(p, checkpoint=path, checkpoint_components=["dit"], **options)
    assert str(unknown.value) == (
        "checkpoint_components names 'dit', which this plan has no top-level component for; its components "
        "are 'transformer', 'text_encoder', 'vae'"
    )
    with pytest.raises(PlanError, match=re.escape("tensor(s) are on the meta device (transformer.")) as left:
        torchferry.offload(p, checkpoint=path, checkpoint_components=["vae"], **options)
    assert "their components are not among the checkpoint's (checkpoint_components)" in str(left.value)
    with pytest.raises(PlanError, match=re.escape("and no checkpoint= was given")):
        torchferry.offload(toy.build(0), checkpoint_components=["vae"], **options)
    assert _snapshot(p) == before


def test_meta_parameters_keep_buffers_and_ties() -> None:
    """Under meta_parameters parameters go to meta with their strides, buffers are computed, ties stay."""
    with torchferry.meta_parameters():
        p = toy.build(0)
    ref = toy.build(0)
    block = p.transformer.blocks[1]
    assert block.q.weight.is_meta and block.out.weight.stride() == (1, 32)
    assert block.norm_k.weight is block.norm_q.weight
    assert torch.equal(p.transformer.freqs, ref.transformer.freqs)
    assert torch.equal(block.scale, ref.transformer.blocks[1].scale)
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the patch ends with the block


def test_on_demand_component_is_filled_in_place(tmp_path: Path) -> None:
    """An on-demand component's meta parameters are read from the checkpoint too; nothing stays on meta."""
    decl = topology.Declaration(
        resident_dit_paths={"transformer"},
        encoder_block_attrs={"text_encoder": ("blocks",)},
        on_demand_component_paths={"vae"},
    )
    path = _save(tmp_path, "file")
    p, ref = toy.build_empty(), toy.build(0)
    with torchferry.offload(
        p, strategy="layerwise", device="cpu", declaration=decl, components={"dit", "vae"}, checkpoint=path
    ):
        assert not p.vae.fc1.weight.is_meta
        assert torch.equal(p("a cat"), ref("a cat"))
    assert same_weights(p, ref)


def test_checkpoint_values_replace_a_built_pipelines_own(tmp_path: Path) -> None:
    """With a checkpoint, a materialised pipeline runs the checkpoint's weights, not its own."""
    path = _save(tmp_path, "file")
    p, ref = toy.build(5), toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu", checkpoint=path):
        assert torch.equal(p("a cat"), ref("a cat"))
    assert same_weights(p, ref)


def test_rank_local_distributed_strategy_on_one_process(tmp_path: Path) -> None:
    """distributed_layerwise with rank-local transfers needs no process group and streams full blocks."""
    path = _save(tmp_path, "file")
    p, ref = toy.build_empty(), toy.build(0)
    with torchferry.offload(
        p,
        strategy="distributed_layerwise",
        device="cpu",
        checkpoint=path,
        dit_transfer="rank-local",
        resident_layers=2,
    ) as session:
        assert torch.equal(p("a cat"), ref("a cat"))
        assert session.engine.comm is None and not session.engine.store.sharded
        assert session.schedules and all(
            op.kind != "gather" for schedule in session.schedules.values() for op in schedule.ops
        )
    assert same_weights(p, ref)


def test_meta_device_build_is_refused_for_its_buffers(tmp_path: Path) -> None:
    """Under torch.device('meta') the RoPE-like buffer is on meta too: refused, saying how to build."""
    path = _save(tmp_path, "file")
    with torch.device("meta"):
        p = toy.build(0)
    before = _snapshot(p)
    message = (
        "torchferry.offload cannot fill this pipeline from its checkpoint: 1 non-persistent buffer(s) are on "
        "the meta device (transformer.freqs), and checkpoints do not hold such buffers nor can torchferry "
        "recompute them; build the pipeline under torchferry.meta_parameters() (parameters on meta, buffers "
        "computed on the CPU as the module makes them) instead of torch.device('meta')"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        torchferry.offload(p, strategy="layerwise", device="cpu", checkpoint=path)
    assert _snapshot(p) == before
    assert hook_count(p) == 0


def test_distributed_allgather_needs_a_process_group() -> None:
    """All-gather transfers without torch.distributed initialised fail with how to set it up, untouched."""
    p = toy.build(0)
    before = _snapshot(p)
    message = (
        "strategy='distributed_layerwise' with 'allgather' transfers shards weights across the ranks of a "
        "process group, and torch.distributed is not initialised; call torch.distributed.init_process_group"
        "(...) on every rank first (or pass process_group=...), or use dit_transfer='rank-local' and "
        "encoder_transfer='rank-local'"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        torchferry.offload(p, strategy="distributed_layerwise", device="cpu")
    message = (
        "offload(process_group=...) is only used by strategy='distributed_layerwise', and this request is "
        "strategy='layerwise'; drop process_group or change the strategy"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        torchferry.offload(p, strategy="layerwise", device="cpu", process_group=object())
    assert _snapshot(p) == before


# ------------------------------------------------------------------------------ corrupt checkpoints


def _rewrite(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a safetensors file's header through ``edit``, keeping its data bytes."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + length :])


def _expected_names() -> list[str]:
    """Persistent tensors of the toy in the order the checkpoint check lists them."""
    topo = topology.discover(toy.build(0))
    return [s.name for c in topo.components for s in c.all_tensors() if s.persistent or not s.buffer]


def _unreadable(path: Path, count: int) -> str:
    names = _expected_names()
    shown = ", ".join(repr(n) for n in names[:3])
    return (
        f"{path}: {count} expected tensors ({shown}, ...) are in none of the readable files; they may be in "
        f"{path}, whose header could not be read (see above)"
    )


def _corrupt(tmp_path: Path, case: str) -> tuple[Path, list[str]]:
    """A toy checkpoint damaged one way, and the problems the check must list for it."""
    path = tmp_path / f"{case}.safetensors"
    toy.save_checkpoint(toy.build(0), path)
    state = load_file(str(path))
    if case == "missing":
        del state["transformer.blocks.3.fc1.bias"]
        save_file(state, str(path))
        return path, [
            f"{path}: tensor 'transformer.blocks.3.fc1.bias' is missing; add it to the checkpoint or map its "
            "name with prefix_map"
        ]
    if case == "extra":
        state["transformer.blocks.3.extra"] = torch.zeros(3)
        save_file(state, str(path))
        return path, [
            f"{path}: tensor 'transformer.blocks.3.extra' is not expected by the model; remove it, map the "
            "model's names with prefix_map, or pass allow_extra=True"
        ]
    if case == "shape":
        state["transformer.blocks.1.q.bias"] = torch.zeros(31)
        save_file(state, str(path))
        return path, [
            f"{path}: tensor 'transformer.blocks.1.q.bias': shape [31] but the model expects [32] for "
            "'transformer.blocks.1.q.bias'; this checkpoint is for another model configuration"
        ]
    if case == "dtype":
        state["transformer.blocks.1.gate"] = state["transformer.blocks.1.gate"].float()
        save_file(state, str(path))
        return path, [
            f"{path}: tensor 'transformer.blocks.1.gate': dtype float32 but the model expects float16 for "
            "'transformer.blocks.1.gate'; convert the checkpoint (loading copies bytes and never converts "
            "dtypes)"
        ]
    if case == "truncated":
        raw = path.read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + length])
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
        begin, end = header[last]["data_offsets"]
        path.write_bytes(raw[:-4])
        data = len(raw) - 8 - length - 4
        return path, [
            f"{path}: tensor {last!r} has data_offsets [{begin}, {end}] outside the file's {data}-byte data "
            "region; re-save or re-download the file",
            _unreadable(path, len(_expected_names())),
        ]
    assert case == "offsets"
    q, k = "transformer.blocks.0.q.bias", "transformer.blocks.0.k.bias"
    spans: list[int] = []

    def lie(header: dict[str, Any]) -> None:
        header[k]["data_offsets"] = header[q]["data_offsets"]
        spans.extend(header[q]["data_offsets"])

    _rewrite(path, lie)
    b, e = spans
    return path, [
        f"{path}: tensors {k!r} and {q!r} overlap in the data region (bytes {b}-{e} and {b}-{e}); re-save or "
        "re-download the file",
        _unreadable(path, len(_expected_names())),
    ]


@pytest.mark.parametrize("case", ["missing", "extra", "shape", "dtype", "truncated", "offsets"])
@pytest.mark.parametrize("empty", [True, False])
def test_corrupt_checkpoint_raises_and_leaves_pipeline_untouched(
    tmp_path: Path, case: str, empty: bool
) -> None:
    """Each kind of mismatch raises one PlanError naming tensor and file; no tensor of the pipeline moved."""
    path, problems = _corrupt(tmp_path, case)
    p = toy.build_empty() if empty else toy.build(3)
    before = _snapshot(p)
    count = f"{len(problems)} problem" + ("" if len(problems) == 1 else "s")
    lines = "\n".join(f"  - {x}" for x in problems)
    message = (
        f"checkpoint {path} cannot fill the expected tensors; {count} (nothing was read or changed):\n{lines}"
    )
    with pytest.raises(PlanError, match=re.escape(message) + r"\Z"):
        torchferry.offload(p, strategy="layerwise", device="cpu", checkpoint=path)
    assert _snapshot(p) == before
    assert hook_count(p) == 0
    if not empty:
        torchferry.offload(p, strategy="layerwise", device="cpu").close()  # usable, and not left "open"


@pytest.mark.gpu
def test_meta_built_pipeline_streams_on_cuda(tmp_path: Path) -> None:
    """On CUDA, a meta-built pipeline filled from the checkpoint matches the resident CUDA run bit for bit."""
    path = _save(tmp_path, "file")
    ref = toy.build(0).to("cuda")
    p = toy.build_empty()
    with torchferry.offload(p, strategy="layerwise", device="cuda", checkpoint=path, prefetch_depth=2):
        for _ in range(2):
            assert torch.equal(p("a cat", device="cuda"), ref("a cat", device="cuda"))
    assert same_weights(p, toy.build(0))
