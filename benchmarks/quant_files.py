"""`quant.py`'s file-tier rows: the same transformer read from a quantized checkpoint folder.

Each form is a diffusers pipeline folder written by ``save_pretrained`` (the bench transformer, with
a tiny UMT5 encoder and Wan VAE beside it): ``full`` as built, ``torchao int8`` and ``quanto qint8``
after diffusers loaded it with ``TorchAoConfig(Int8WeightOnlyConfig())`` /
``QuantoConfig(weights_dtype="int8")``. Each opens through ``torchferry.from_pretrained`` under
layerwise depth 1 with a host budget that leaves all but three transformer blocks in the folder's
files (docs/quantized.md, Quantized checkpoints), and is checked bit for bit against diffusers' own
load of the folder. Per form: the folder's transformer bytes, the host budget and host store, the
packs left in the files, the bytes the file tier reads per step (one transformer forward) and the
step time. Imported by ``quant.py``, which prints the table after its own.
"""

from __future__ import annotations

import importlib
import tempfile
import warnings
from pathlib import Path
from typing import Any

import _common as common
import torch

import torchferry
from torchferry import policies, topology
from torchferry.testing import toy

#: Each form: the diffusers quantization config of its transformer (``None``: saved as built).
FORMS: dict[str, Any] = {
    "full": lambda d: None,
    "torchao int8": lambda d: d.TorchAoConfig(
        importlib.import_module("torchao.quantization").Int8WeightOnlyConfig()
    ),
    "quanto qint8": lambda d: d.QuantoConfig(weights_dtype="int8"),
}


def _pipeline(transformer: torch.nn.Module) -> Any:
    """A WanPipeline around ``transformer`` (the other components tiny; only the transformer runs)."""
    pipe = toy.wan_pipeline(layers=1)
    pipe.transformer = transformer
    return pipe


def _budget(folder: Path, blocks: int) -> int:
    """Host bytes for all but three transformer blocks, plus the file tier's buffers and slots."""
    total = topology.from_checkpoint(folder).nbytes
    block = sum(
        e.nbytes
        for e in topology.read_header(folder / "transformer" / "diffusion_pytorch_model.safetensors")
        if e.name.startswith("blocks.0.")
    )
    return total - (blocks - 3) * block + policies.read_buffer_bytes(block) + policies.STAGING_SLOTS * block


def _own_memory(model: torch.nn.Module) -> None:
    """Give every tensor of ``model`` memory of its own: diffusers' load leaves float32 weights as
    views of the file's mapping, at the file's offsets, and the CPU's float32 matmul can round
    differently on a differently aligned weight (torchferry's host copies are 256-byte aligned)."""
    for t in (*model.parameters(), *model.buffers()):
        if topology.is_wrapper(t):
            for name in t.__tensor_flatten__()[0]:  # type: ignore[attr-defined]
                setattr(t, name, getattr(t, name).clone())
        else:
            t.data = t.data.clone()


def files(
    transformer: torch.nn.Module, x: dict[str, torch.Tensor], blocks: int, repeats: int
) -> dict[str, Any]:
    """Every form read from its folder under a budget that keeps most blocks in the files."""
    diffusers: Any = importlib.import_module("diffusers")
    forms: dict[str, dict[str, Any]] = {}
    calls: dict[str, Any] = {}
    dtypes = {"default": torch.float32}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        plain = Path(tmp) / "full"
        _pipeline(transformer).save_pretrained(str(plain))
        sessions = []
        try:
            for name, make in FORMS.items():
                folder = plain
                config = make(diffusers)
                if config is not None:
                    folder = Path(tmp) / name.replace(" ", "-")
                    quant = diffusers.PipelineQuantizationConfig(quant_mapping={"transformer": config})
                    diffusers.WanPipeline.from_pretrained(
                        str(plain), tokenizer=None, quantization_config=quant, dtype=dtypes
                    ).save_pretrained(str(folder))
                loaded = diffusers.WanPipeline.from_pretrained(str(folder), tokenizer=None, dtype=dtypes)
                _own_memory(loaded.transformer)
                reference = _forward(loaded.transformer, x)
                del loaded
                budget = _budget(folder, blocks)
                session = torchferry.from_pretrained(
                    diffusers.WanPipeline,
                    folder,
                    tokenizer=None,
                    dtype=dtypes,
                    device="cpu",
                    strategy="layerwise",
                    prefetch_depth=1,
                    host_memory=budget,
                )
                sessions.append(session)
                model = session.pipeline.transformer
                out = _forward(model, x)
                tier = session.engine.store.tier
                before = 0 if tier is None else tier.reader.bytes_read
                again = _forward(model, x)
                read = 0 if tier is None else tier.reader.bytes_read - before
                stored = topology.read_header(folder / "transformer" / "diffusion_pytorch_model.safetensors")
                forms[name] = {
                    "identical": bool(torch.equal(out, reference) and torch.equal(again, reference)),
                    "folder_bytes": sum(e.nbytes for e in stored),
                    "budget": budget,
                    "host_bytes": session.host_bytes,
                    "file_packs": session.report().file_packs,
                    "read_bytes_per_step": read,
                }
                calls[name] = _stepper(model, x)
            for name, stats in common.round_robin(calls, repeats, warmup=1).items():
                forms[name]["step"] = stats.to_json()
        finally:
            for session in sessions:
                session.close()
    return forms


def _forward(model: torch.nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(**x, return_dict=False)[0]
    return out


def _stepper(model: torch.nn.Module, x: dict[str, torch.Tensor]) -> Any:
    def step() -> object:
        return _forward(model, x)

    return step


def report(forms: dict[str, Any]) -> str:
    """The file-tier table."""
    rows = []
    for name, f in forms.items():
        step = f["step"]
        rows.append(
            [
                name,
                f["identical"],
                common.fmt_bytes(f["folder_bytes"]),
                common.fmt_bytes(f["budget"]),
                common.fmt_bytes(f["host_bytes"]),
                f["file_packs"],
                common.fmt_bytes(f["read_bytes_per_step"]),
                f"{common.fmt_seconds(step['min_s'])} / {common.fmt_seconds(step['median_s'])} / "
                f"{common.fmt_seconds(step['max_s'])}",
            ]
        )
    headers = [
        "from folder",
        "identical",
        "transformer file",
        "host budget",
        "host store",
        "packs in files",
        "read/step",
        "step min / median / max",
    ]
    return common.table(headers, rows)
