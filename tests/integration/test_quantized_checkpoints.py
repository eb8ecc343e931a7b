"""Quantized checkpoints (docs/quantized.md, Quantized checkpoints): a Wan pipeline folder whose
transformer diffusers saved quantized with torchao or optimum-quanto opens through
``torchferry.from_pretrained``, its quantized weights read from the files as their stored bytes, and
runs bit for bit as diffusers' own load of the folder, in every strategy and with the file tier;
other quantization methods are refused with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import fresh_storage

import torchferry
from torchferry import PlanError, topology
from torchferry.testing import toy

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
torchao_quantization = pytest.importorskip("torchao.quantization")
pytest.importorskip("optimum.quanto")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

#: Each format: the diffusers config that quantizes the transformer, and its weights' class.
FORMATS: dict[str, tuple[Any, str]] = {
    "torchao-int8": (
        lambda: diffusers.TorchAoConfig(torchao_quantization.Int8WeightOnlyConfig()),
        "Int8Tensor",
    ),
    "torchao-float8": (
        lambda: diffusers.TorchAoConfig(torchao_quantization.Float8WeightOnlyConfig()),
        "Float8Tensor",
    ),
    "quanto-int8": (lambda: diffusers.QuantoConfig(weights_dtype="int8"), "WeightQBytesTensor"),
    "quanto-float8": (lambda: diffusers.QuantoConfig(weights_dtype="float8"), "WeightQBytesTensor"),
}

#: The requests each format opens under; ``files`` keeps transformer packs in the folder's files.
REQUESTS: dict[str, dict[str, Any]] = {
    "layerwise": {"strategy": "layerwise"},
    "model_level": {"strategy": "model_level"},
    "auto": {},
    "files": {"strategy": "layerwise"},
}

#: The int8 forms run under every request; the float8 forms (the same code with float8 parts, whose
#: CPU matmul converts element by element) layerwise and from the files, to keep CI short.
RUNS = [
    pytest.param(form, request, id=f"{form}-{name}")
    for form in FORMATS
    for name, request in REQUESTS.items()
    if form.endswith("int8") or name in ("layerwise", "files")
]

#: The pipeline is saved and loaded in float32 (torchao's loader would default to bfloat16, whose
#: int8 path is slow on the CPU; a bfloat16 torchao folder opens alike).
DTYPE = torch.float32


@pytest.fixture(scope="module")
def unquantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Wan pipeline folder whose transformer has 8 blocks of 4 MiB once quantized, so the file
    tier's 16 MiB of read buffers still leave packs in the files under a budget below the total."""
    folder = tmp_path_factory.mktemp("plain") / "wan"
    toy.wan_pipeline(layers=8, heads=8, head_dim=64, ffn_dim=2048).save_pretrained(str(folder))
    return folder


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 16, 2, 4, 4, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
    }


def _forward(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(**_inputs(), return_dict=False)[0]
    return out


@pytest.fixture(scope="module")
def quantized(request: pytest.FixtureRequest, unquantized: Path) -> tuple[str, Path, torch.Tensor]:
    """(format, its folder as diffusers saved it, the output of diffusers' load of that folder)."""
    form = str(request.param)
    folder = unquantized.parent / form
    config = diffusers.PipelineQuantizationConfig(quant_mapping={"transformer": FORMATS[form][0]()})
    diffusers.WanPipeline.from_pretrained(
        str(unquantized), tokenizer=None, quantization_config=config, dtype=DTYPE
    ).save_pretrained(str(folder))
    loaded = diffusers.WanPipeline.from_pretrained(str(folder), tokenizer=None, dtype=DTYPE).transformer
    assert type(loaded.blocks[0].attn1.to_q.weight).__name__ == FORMATS[form][1]
    fresh_storage(loaded)  # diffusers leaves float32 weights as views of the file's mapping
    return form, folder, _forward(loaded)


def _stored_bytes(folder: Path, prefix: str) -> int:
    """Bytes the folder's transformer file stores under ``prefix`` (from its header)."""
    file = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    return sum(e.nbytes for e in topology.read_header(file) if e.name.startswith(prefix))


def _stored_parts(folder: Path, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The quantized weights' parts the transformer file stores under ``prefix``, under discovery's
    names (torchao's ``_weight_qdata`` is ``weight.qdata``), with their shapes and dtypes."""
    file = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    with open(file, "rb") as handle:
        renamed = topology.flattened_names(topology.header_metadata(str(file), handle))
    found = {renamed.get(e.name, e.name): (e.shape, e.dtype) for e in topology.read_header(file)}
    return {f"transformer.{k}": v for k, v in found.items() if k.startswith(prefix) and ".weight." in k}


@pytest.mark.slow  # 34 MiB of quantized weights, so the file tier's buffers leave packs out
@pytest.mark.parametrize(("quantized", "request_"), RUNS, indirect=["quantized"])
def test_a_quantized_folder_runs_as_diffusers_loads_it(
    quantized: tuple[str, Path, torch.Tensor], request_: dict[str, Any]
) -> None:
    """The folder opens through from_pretrained with each quantized weight of its class (its device the
    CPU), the plan holds the parts the file stores, packs left in the files are read as exactly the
    bytes the file stores for them, and the transformer gives what diffusers' load of the folder gives,
    bit for bit, twice."""
    form, folder, expected = quantized
    budget: dict[str, int] = {}
    if request_ is REQUESTS["files"]:
        budget["host_memory"] = topology.from_checkpoint(folder).nbytes - _stored_bytes(folder, "blocks.0.")
    with torchferry.from_pretrained(
        diffusers.WanPipeline, folder, tokenizer=None, dtype=DTYPE, device="cpu", **request_, **budget
    ) as session:
        model = session.pipeline.transformer
        weight = model.blocks[1].attn1.to_q.weight
        assert type(weight).__name__ == FORMATS[form][1] and weight.device == torch.device("cpu")
        blocks = session.plan.topology.component("transformer").blocks
        parts = {t.name: (t.shape, t.dtype) for t in blocks[1].tensors if ".weight." in t.name}
        assert parts and parts == _stored_parts(folder, "blocks.1.")
        first, second = _forward(model), _forward(model)
        if budget:
            assert session.report().file_packs > 0
            tier = session.engine.store.tier
            assert tier is not None and tier.reader.bytes_read > 0
            reads = [r for r in tier.reads.values() if r.name.startswith("transformer.blocks.")]
            assert reads
            for read in reads:
                assert read.file_bytes == _stored_bytes(folder, read.name.removeprefix("transformer.") + ".")
    assert torch.equal(first, expected) and torch.equal(second, expected)


def _with_quantization(folder: Path, component: str, quantization: dict[str, Any]) -> None:
    """Write ``quantization`` into ``component``'s config.json as its quantization_config."""
    file = folder / component / "config.json"
    config = json.loads(file.read_text())
    config["quantization_config"] = quantization
    file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Wan pipeline folder, unquantized."""
    folder = tmp_path_factory.mktemp("plain") / "wan"
    toy.wan_pipeline().save_pretrained(str(folder))
    return folder


def test_a_bitsandbytes_checkpoint_is_refused_with_the_reason(plain: Path, tmp_path: Path) -> None:
    """A transformer whose config names bitsandbytes quantization is refused before anything is read,
    naming the method, why, and what to do instead."""
    folder = tmp_path / "wan"
    shutil.copytree(plain, folder)
    _with_quantization(folder, "transformer", {"quant_method": "bitsandbytes", "load_in_8bit": True})
    why = (
        "bitsandbytes keeps its 8-bit and 4-bit weights in its own parameter classes (Int8Params, "
        "Params4bit) with quantization state beside them, not in tensor subclasses whose inner tensors "
        "torchferry can re-point, and its kernels need CUDA"
    )
    message = (
        f"component 'transformer' is a bitsandbytes-quantized checkpoint ({folder}/transformer/config.json "
        f"has quantization_config with quant_method 'bitsandbytes'), and torchferry cannot stream it: {why}; "
        "load that component with its library (WanTransformer3DModel.from_pretrained(folder, "
        "subfolder='transformer')) and pass it as from_pretrained(..., transformer=model), or save the model "
        "unquantized and quantize it after loading (docs/quantized.md lists the checkpoints that open)"
    )
    with pytest.raises(PlanError, match=f"^{_escaped(message)}$"):
        torchferry.from_pretrained(diffusers.WanPipeline, folder, tokenizer=None, device="cpu")


def test_a_quantized_transformers_component_is_refused(plain: Path, tmp_path: Path) -> None:
    """A text encoder (a transformers model) saved with a torchao quantization config is refused: the
    checkpoints of diffusers models open, transformers' own quantized layers do not."""
    folder = tmp_path / "wan"
    shutil.copytree(plain, folder)
    _with_quantization(folder, "text_encoder", {"quant_method": "torchao", "quant_type": {}})
    with pytest.raises(
        PlanError,
        match=(
            r"^component 'text_encoder' is a torchao-quantized checkpoint .* torchferry cannot stream it: "
            r"torchferry opens the quantized checkpoints of diffusers models only; transformers rebuilds "
            r"its quantized layers with loading code of its own; load that component with its library "
            r"\(UMT5EncoderModel\.from_pretrained\(folder, subfolder='text_encoder'\)\) .*$"
        ),
    ):
        torchferry.from_pretrained(diffusers.WanPipeline, folder, tokenizer=None, device="cpu")


def _escaped(text: str) -> str:
    import re

    return re.escape(text)
