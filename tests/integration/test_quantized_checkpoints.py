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

import torchferry
from torchferry import PlanError, topology
from torchferry.testing import toy

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
torchao_quantization = pytest.importorskip("torchao.quantization")
pytest.importorskip("optimum.quanto")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

#: Each format: the diffusers config that quantizes the transformer, the dtype the transformer is
#: loaded and saved in (torchao's loader defaults to bfloat16; the other components stay float32), and
#: its weights' class.
FORMATS: dict[str, tuple[Any, torch.dtype, str]] = {
    "torchao-int8": (
        lambda: diffusers.TorchAoConfig(torchao_quantization.Int8WeightOnlyConfig()),
        torch.bfloat16,
        "Int8Tensor",
    ),
    "torchao-float8": (
        lambda: diffusers.TorchAoConfig(torchao_quantization.Float8WeightOnlyConfig()),
        torch.bfloat16,
        "Float8Tensor",
    ),
    "quanto-int8": (
        lambda: diffusers.QuantoConfig(weights_dtype="int8"),
        torch.float32,
        "WeightQBytesTensor",
    ),
    "quanto-float8": (
        lambda: diffusers.QuantoConfig(weights_dtype="float8"),
        torch.float32,
        "WeightQBytesTensor",
    ),
}

#: The requests each format opens under; ``files`` keeps transformer packs in the folder's files.
REQUESTS: dict[str, dict[str, Any]] = {
    "layerwise": {"strategy": "layerwise"},
    "model_level": {"strategy": "model_level"},
    "auto": {},
    "files": {"strategy": "layerwise"},
}


def _dtypes(form: str) -> dict[str, torch.dtype]:
    """The dtypes the pipeline of ``form`` is loaded in, by component (diffusers' mapping)."""
    return {"transformer": FORMATS[form][1], "default": torch.float32}


def _saved(root: Path, form: str) -> Path:
    """A Wan pipeline folder (blocks large enough for the file tier) with its transformer quantized
    by diffusers as ``form`` and saved with ``save_pretrained``."""
    make = FORMATS[form][0]
    plain, folder = root / "plain", root / form
    toy.wan_pipeline(layers=8, heads=8, head_dim=64, ffn_dim=2048).save_pretrained(str(plain))
    config = diffusers.PipelineQuantizationConfig(quant_mapping={"transformer": make()})
    pipe = diffusers.WanPipeline.from_pretrained(
        str(plain), tokenizer=None, quantization_config=config, dtype=_dtypes(form)
    )
    pipe.save_pretrained(str(folder))
    return folder


#: The requests each format runs under: the int8 forms all four, the float8 forms (the same code
#: path with another inner dtype) layerwise and from the files, to keep CI short.
RUNS = [
    pytest.param(form, request, id=f"{form}-{name}")
    for form in FORMATS
    for name, request in REQUESTS.items()
    if form.endswith("int8") or name in ("layerwise", "files")
]


@pytest.fixture(scope="module")
def quantized(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Any]:
    """(format, its saved folder, the frames diffusers' plain load of that folder gives)."""
    form = str(request.param)
    folder = _saved(tmp_path_factory.mktemp(form), form)
    loaded = diffusers.WanPipeline.from_pretrained(str(folder), tokenizer=None, dtype=_dtypes(form))
    assert type(loaded.transformer.blocks[0].attn1.to_q.weight).__name__ == FORMATS[form][2]
    return form, folder, toy.run_wan(loaded, steps=1)


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


@pytest.mark.slow  # a transformer of 8 blocks of 4 MiB, so the file tier's 16 MiB of buffers leave packs out
@pytest.mark.parametrize(("quantized", "request_"), RUNS, indirect=["quantized"])
def test_a_quantized_folder_runs_as_diffusers_loads_it(
    quantized: tuple[str, Path, Any], request_: dict[str, Any]
) -> None:
    """The folder opens through from_pretrained with each quantized weight of its class (its device the
    CPU), the plan's blocks hold the bytes the file stores for them, packs left in the files are read as
    those bytes, and the frames equal diffusers' load of the folder, bit for bit."""
    form, folder, expected = quantized
    budget: dict[str, int] = {}
    if request_ is REQUESTS["files"]:
        budget["host_memory"] = topology.from_checkpoint(folder).nbytes - _stored_bytes(folder, "blocks.0.")
    with torchferry.from_pretrained(
        diffusers.WanPipeline, folder, tokenizer=None, dtype=_dtypes(form), device="cpu", **request_, **budget
    ) as session:
        weight = session.pipeline.transformer.blocks[1].attn1.to_q.weight
        assert type(weight).__name__ == FORMATS[form][2] and weight.device == torch.device("cpu")
        blocks = session.plan.topology.component("transformer").blocks
        parts = {t.name: (t.shape, t.dtype) for t in blocks[1].tensors if ".weight." in t.name}
        assert parts and parts == _stored_parts(folder, "blocks.1.")
        got = toy.run_wan(session.pipeline, steps=1)
        if budget:
            assert session.report().file_packs > 0
            tier = session.engine.store.tier
            assert tier is not None and tier.reader.bytes_read > 0
            reads = [r for r in tier.reads.values() if r.name.startswith("transformer.blocks.")]
            assert reads
            for read in reads:
                assert read.file_bytes == _stored_bytes(folder, read.name.removeprefix("transformer.") + ".")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


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
