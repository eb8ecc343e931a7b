"""GGUF files as diffusers loads them (``from_single_file(..., quantization_config=
GGUFQuantizationConfig(...))``) and as torchferry's checkpoint (docs/quantized.md, GGUF): tiny Wan
transformers written by `gguf_files` with Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q6_K, BF16, F16 and F32
tensors, streamed bit-identically under every strategy."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchferry
from torchferry import topology
from torchferry.topology import read_gguf

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")

import gguf_files  # noqa: E402 (needs the gguf package)

#: The session requests: layerwise depth 1 and 2, model_level, and auto.
REQUESTS: dict[str, dict[str, Any]] = {
    "layerwise-d1": {"strategy": "layerwise", "prefetch_depth": 1},
    "layerwise-d2": {"strategy": "layerwise", "prefetch_depth": 2},
    "model_level": {"strategy": "model_level"},
    "auto": {},
}
_STAGED_WHOLE = pytest.mark.filterwarnings("ignore:model_level offload swaps DiTs:torchferry.OffloadWarning")
PARAMS = [
    pytest.param(r, id=k, marks=[_STAGED_WHOLE] if k == "model_level" else []) for k, r in REQUESTS.items()
]
#: A Wan transformer of 33 MiB as GGUF, 2.5 MiB a block: larger than a host budget that fits its
#: read buffers, two staging slots and what is not in blocks, so packs stay in the file.
LARGE = {**gguf_files.WAN_GGUF, "num_attention_heads": 4, "ffn_dim": 1024, "num_layers": 10}


def _load(path: Path, config: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model as diffusers loads the GGUF file."""
    model: nn.Module = diffusers.WanTransformer3DModel.from_single_file(
        str(path),
        config=str(config),
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=dtype),
    )
    return model


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """The 3-block file under Wan's original names, its config folder, and diffusers' output for it."""
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "wan.gguf"
    gguf_files.write(path, gguf_files.wan(), original=True)
    config = gguf_files.config_folder(folder / "config")
    return path, config, gguf_files.call(_load(path, config))


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """The 10-block file (`LARGE`), its config folder, and diffusers' output for it."""
    folder = tmp_path_factory.mktemp("gguf-large")
    path = folder / "wan.gguf"
    gguf_files.write(path, gguf_files.wan(LARGE), original=True)
    config = gguf_files.config_folder(folder / "config", LARGE)
    return path, config, gguf_files.call(_load(path, config))


def _stored(model: nn.Module) -> dict[str, tuple[Any, torch.Tensor]]:
    """Each GGUFParameter's quant type and a copy of its bytes."""
    from diffusers.quantizers.gguf.utils import GGUFParameter

    return {
        n: (p.quant_type, p.detach().clone())
        for n, p in model.named_parameters()
        if isinstance(p, GGUFParameter)
    }


def test_the_header_reads_as_the_gguf_package_reads_it(small: tuple[Path, Path, torch.Tensor]) -> None:
    """Every tensor of the header has the name, torch shape, data offset and type the gguf package's
    reader (what diffusers loads with) gives it."""
    path = small[0]
    ours = {e.name: e for e in read_gguf(path)}
    theirs = gguf.GGUFReader(str(path)).tensors
    assert len(ours) == len(theirs)
    types = set()
    for tensor in theirs:
        entry = ours[tensor.name]
        types.add(entry.quant_type)
        assert entry.shape == tuple(tensor.data.shape)
        assert entry.data_start + entry.begin == tensor.data_offset and entry.nbytes == tensor.n_bytes
        assert entry.quant_type == tensor.tensor_type.name
        assert entry.logical_shape == tuple(reversed(tensor.shape.tolist()))
    assert types == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"}


@pytest.mark.parametrize("request_", PARAMS)
def test_diffusers_gguf_model_streams_as_without(
    small: tuple[Path, Path, torch.Tensor], request_: dict[str, Any]
) -> None:
    """diffusers' GGUF model gives its own output under each strategy, twice and after close; each block
    counts exactly its stored GGUF bytes; every GGUFParameter keeps its quant type and bytes."""
    path, config, reference = small
    model = _load(path, config)
    before = _stored(model)
    blocks = topology.discover(model).components[0].stacks[0].blocks
    # quantized and BF16 tensors count their stored bytes; F32/F16 ones load as float32 (compute_dtype)
    stored = {
        e.name: e.nbytes if e.quantized else 4 * e.nbytes // (2 if e.dtype == "float16" else 4)
        for e in read_gguf(path)
    }
    for i, block in enumerate(blocks):
        prefix = gguf_files.original_name(f"blocks.{i}.").removesuffix(".")
        assert block.nbytes == sum(n for k, n in stored.items() if k.startswith(prefix + "."))
    with torchferry.offload(model, device="cpu", **request_):
        first, second = gguf_files.call(model), gguf_files.call(model)
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert torch.equal(gguf_files.call(model), reference)
    after = _stored(model)
    assert after.keys() == before.keys() and len(after) == 33
    for name, (kind, data) in before.items():
        assert after[name][0] == kind and torch.equal(after[name][1], data)


@pytest.mark.parametrize("request_", PARAMS)
def test_from_single_file_equals_diffusers(
    small: tuple[Path, Path, torch.Tensor], request_: dict[str, Any]
) -> None:
    """torchferry.from_single_file builds the model diffusers builds from the file (GGUFLinear layers,
    GGUFParameter weights with their quant types) on meta and fills it from the .gguf: same output."""
    path, config, reference = small
    expected = _load(path, config)
    with torchferry.from_single_file(
        diffusers.WanTransformer3DModel, path, config=config, device="cpu", **request_
    ) as session:
        model = session.pipeline
        assert torch.equal(gguf_files.call(model), reference)
        got = _stored(model)
    want = _stored(expected)
    assert got.keys() == want.keys()
    for name, (kind, data) in want.items():
        assert got[name][0] == kind and torch.equal(got[name][1], data)
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        n: p.dtype for n, p in expected.named_parameters()
    }
    assert torch.equal(gguf_files.call(model), reference)


def test_compute_dtype_casts_plain_tensors_as_diffusers_does(small: tuple[Path, Path, torch.Tensor]) -> None:
    """With compute_dtype=bfloat16 the F32/F16 tensors load as bfloat16 (float32 in the modules Wan
    keeps in float32), as diffusers casts them, and the output is diffusers' bit for bit."""
    path, config, _ = small
    expected = _load(path, config, torch.bfloat16)
    with torchferry.from_single_file(
        diffusers.WanTransformer3DModel, path, config=config, compute_dtype=torch.bfloat16, device="cpu"
    ) as session:
        model = session.pipeline
        assert {n: p.dtype for n, p in model.named_parameters()} == {
            n: p.dtype for n, p in expected.named_parameters()
        }
        bf16 = torch.bfloat16
        assert torch.equal(gguf_files.call(model, bf16), gguf_files.call(expected, bf16))


@pytest.mark.slow
@pytest.mark.parametrize(
    "request_",
    [REQUESTS["layerwise-d1"], REQUESTS["layerwise-d2"], REQUESTS["auto"]],
    ids=["layerwise-d1", "layerwise-d2", "auto"],
)
def test_a_host_budget_smaller_than_the_file_reads_packs_from_the_gguf(
    large: tuple[Path, Path, torch.Tensor], request_: dict[str, Any]
) -> None:
    """A 33 MiB GGUF file opened with host_memory=26MiB keeps packs in the .gguf, read on demand from
    it (no second copy), within the budget, and gives diffusers' output. Under auto on the CPU the
    one budget holds the device's share too (its memory is host memory): 44 MiB, 26 of them or less
    the host's."""
    path, config, reference = large
    budget = 26 << 20
    one = budget if request_ else 44 << 20
    assert path.stat().st_size > budget
    with torchferry.from_single_file(
        diffusers.WanTransformer3DModel, path, config=config, device="cpu", host_memory=one, **request_
    ) as session:
        got = gguf_files.call(session.pipeline)
        report = session.report()
        assert report.host_budget is not None and report.host_budget <= budget
        assert report.file_packs > 0 and report.peak_host_bytes <= report.host_budget
        tier = session.engine.store.tier
        assert tier is not None and {c.file for r in tier.reads.values() for c in r.chunks} == {str(path)}
    assert torch.equal(got, reference)


def test_a_diffusers_named_file_needs_no_conversion(
    tmp_path: Path, small: tuple[Path, Path, torch.Tensor]
) -> None:
    """A file written under diffusers' own names fills the same model with the same output."""
    path = tmp_path / "wan-diffusers.gguf"
    gguf_files.write(path, gguf_files.wan(), original=False)
    config = small[1]
    with torchferry.from_single_file(
        diffusers.WanTransformer3DModel, path, config=config, device="cpu"
    ) as session:
        assert torch.equal(gguf_files.call(session.pipeline), gguf_files.call(_load(path, config)))


def test_plan_reads_a_gguf_folder_from_its_header(
    small: tuple[Path, Path, torch.Tensor], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchferry plan` on a folder holding a .gguf and its config.json counts the quantized bytes the
    model holds (3 blocks found on the model's names, not text_embedding/time_embedding), and a
    .gguf beside a config.json that cannot be read is refused with the fix (without one, the
    configuration is inferred: test_gguf_infer.py)."""
    import json
    import shutil

    from torchferry.cli import main

    path, config, _ = small
    folder = tmp_path / "gguf"
    folder.mkdir()
    shutil.copy(path, folder / "wan.gguf")
    shutil.copy(config / "config.json", folder / "config.json")
    assert main(["plan", str(folder), "--device-memory", "2MiB", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (component,) = doc["components"]
    held = topology.discover(_load(path, config)).nbytes  # what diffusers' model holds, as stored bytes
    assert component["blocks"] == 3 and component["nbytes"] == doc["total_bytes"] == held
    (folder / "config.json").write_text("{not json")
    assert main(["plan", str(folder / "wan.gguf"), "--device-memory", "2MiB"]) == 2
    assert capsys.readouterr().err.endswith(
        f"{folder / 'config.json'}: the config.json beside wan.gguf cannot be read (Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)); put the model's config.json (from "
        "its diffusers folder, e.g. transformer/config.json) beside it, or remove it to infer the class and "
        "configuration from the file\n"
    )


def test_a_quantized_tensor_diffusers_would_dequantize_is_refused(tmp_path: Path) -> None:
    """A Q8_0 weight in a module Wan keeps in float32 (diffusers dequantizes it at load) is refused
    before anything is read, naming the tensor and the fix."""
    path = tmp_path / "kept.gguf"
    model = gguf_files.wan()
    gguf_files.write(
        path,
        model,
        original=False,
        types={"condition_embedder.time_embedder.linear_2.weight": gguf.GGMLQuantizationType.Q8_0},
    )
    config = gguf_files.config_folder(tmp_path / "config")
    with pytest.raises(
        torchferry.PlanError,
        match=re.escape(
            f"{path}: 1 quantized tensor(s) ('condition_embedder.time_embedder.linear_2.weight') are in "
            "modules WanTransformer3DModel keeps in float32, which diffusers dequantizes at load; "
            "torchferry streams stored bytes only: store those tensors as F32 or F16"
        ),
    ):
        torchferry.from_single_file(diffusers.WanTransformer3DModel, path, config=config, device="cpu")


def test_a_model_not_built_for_the_file_is_refused_with_every_problem(
    small: tuple[Path, Path, torch.Tensor],
) -> None:
    """offload(model, checkpoint=<.gguf>) over a model with plain Linear layers (not built as diffusers'
    GGUF load builds it) lists every mismatch, as for a safetensors checkpoint, before anything is read."""
    path, _, _ = small
    with torchferry.meta_parameters():
        model = diffusers.WanTransformer3DModel(**gguf_files.WAN_GGUF).eval()
    expected = (
        r"^checkpoint .*wan\.gguf cannot fill the expected tensors; 66 problems \(nothing was read or "
        r"changed\):\n  - .*wan\.gguf: tensor 'condition_embedder\.time_proj\.weight': shape \[1536, 512\] "
        r"but the model expects \[1536, 256\] for 'condition_embedder\.time_proj\.weight'; this checkpoint "
        r"is for another model configuration\n"
    )
    with pytest.raises(torchferry.PlanError, match=expected):
        torchferry.offload(model, checkpoint=str(path), device="cpu")


@pytest.mark.parametrize(
    ("field", "value"), [("num_layers", "3"), ("ffn_dim", -256), ("num_attention_heads", None)]
)
def test_a_config_of_wrong_types_or_values_is_refused_in_words(
    small: tuple[Path, Path, torch.Tensor], field: str, value: object
) -> None:
    """A config whose field diffusers cannot build a model from (a string count, a negative width, a
    missing head count) is a PlanError naming the file and diffusers' reason, not diffusers' own
    TypeError or torch's RuntimeError."""
    path, _, _ = small
    config = {**gguf_files.WAN_GGUF, field: value}
    start = f"{path}: the configuration given does not build WanTransformer3DModel ("
    with pytest.raises(torchferry.PlanError, match="^" + re.escape(start)) as caught:
        torchferry.from_single_file(diffusers.WanTransformer3DModel, path, config=config, device="cpu")
    assert str(caught.value).endswith("or leave config= out to infer it from the file")


def test_a_config_the_file_does_not_fill_is_refused_naming_tensor_shapes_and_field(
    small: tuple[Path, Path, torch.Tensor],
) -> None:
    """from_single_file with a config whose ffn_dim (512) is not the file's (256) is refused at open,
    naming each tensor, the two shapes and the field (no GGUFLinear built around the wrong rows), and
    a config of more layers than the file's blocks names num_layers and the file's count, before the
    model is built."""
    path, _, _ = small
    wider = {**gguf_files.WAN_GGUF, "ffn_dim": 512}
    first = (
        f"{path} does not fill the WanTransformer3DModel its configuration builds (9 problems; nothing was "
        "read):\n  - tensor 'blocks.0.ffn.net.0.proj.weight': the file's shape is [256, 256], the "
        "configuration's [512, 256] (config field ffn_dim gives 512; the file has 256)\n"
    )
    with pytest.raises(torchferry.PlanError, match=re.escape(first)) as caught:
        torchferry.from_single_file(diffusers.WanTransformer3DModel, path, config=wider, device="cpu")
    assert str(caught.value).endswith(
        "\npass config= the configuration the file was made from, or leave config= out to infer it from "
        "the file"
    )
    deeper = {**gguf_files.WAN_GGUF, "num_layers": 5}
    with pytest.raises(
        torchferry.PlanError,
        match=re.escape(
            "(nothing was built or read): config field num_layers gives 5 blocks, and the file's longest "
            "numbered list, blocks, holds 3\n"
        ),
    ):
        torchferry.from_single_file(diffusers.WanTransformer3DModel, path, config=deeper, device="cpu")
