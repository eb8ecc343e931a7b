"""quant.py's GGUF rows: the same Wan transformer written as a GGUF file (Q8_0, Q4_K) and opened with
``torchferry.from_single_file``, as diffusers' GGUF loader builds it.

Each Linear weight whose rows hold whole blocks of the type is stored in it; every other tensor in
F32. Q8_0 is quantized by the ``gguf`` package; Q4_K, which it does not quantize, is seeded random
blocks with small finite scales (the bytes and the dequantize work are those of a real file). The
row's output is checked against diffusers' ``from_single_file(..., quantization_config=
GGUFQuantizationConfig(compute_dtype=...))`` of the same file. The session is opened with a host
budget of 80% of the file, so packs stay in the ``.gguf`` and the file tier's reads per step are
measured; when even that leaves no room beside the read buffers (a small model), the whole file is
held and the row says so.
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

import torchferry

#: The GGUF types quant.py compares.
KINDS = ("Q8_0", "Q4_K")


def _blocks(values: np.ndarray[Any, Any], kind: Any, seed: int) -> np.ndarray[Any, Any]:
    gguf = importlib.import_module("gguf")
    if kind.name != "Q4_K":
        return np.asarray(gguf.quants.quantize(values, kind))
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows = values.reshape(-1, values.shape[-1])
    out = np.random.default_rng(seed).integers(0, 256, (rows.size // block, size), dtype=np.uint8)
    out[:, 0:4] = np.frombuffer(np.array([0.002, 0.002], dtype=np.float16).tobytes(), dtype=np.uint8)
    return out.reshape(*values.shape[:-1], values.shape[-1] // block * size)


def write(model: torch.nn.Module, folder: Path, kind_name: str) -> Path:
    """``model`` as ``folder/model.gguf`` (Linear weights in ``kind_name``) beside its config.json."""
    gguf = importlib.import_module("gguf")
    kind = gguf.GGMLQuantizationType[kind_name]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    kept = getattr(type(model), "_keep_in_fp32_modules", None) or []
    path = folder / "model.gguf"
    state = model.state_dict()
    quantized = {
        n
        for n, t in state.items()
        if n.endswith(".weight") and t.dim() == 2 and t.shape[1] % block == 0
        and not any(k in n.split(".") for k in kept)
    }  # fmt: skip
    if not quantized:
        raise ValueError(f"no Linear weight has rows of whole {kind_name} blocks ({block} values)")
    writer = gguf.GGUFWriter(str(path), arch="wan")
    for index, (name, tensor) in enumerate(state.items()):
        values = tensor.detach().float().numpy()
        if name in quantized:
            writer.add_tensor(name, _blocks(values, kind, index), raw_dtype=kind)
        else:
            writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_config(str(folder))  # type: ignore[operator]
    return path


def add(
    forms: dict[str, dict[str, Any]],
    calls: dict[str, Callable[[], object]],
    stack: ExitStack,
    *,
    model: Callable[[], torch.nn.Module],
    dtype: torch.dtype,
    device: torch.device,
    forward: Callable[[torch.nn.Module], torch.Tensor],
    counted: Callable[[Any], Any],
) -> None:
    """Add a ``gguf <kind>`` row to ``forms`` (and its step to ``calls``) for each of `KINDS`."""
    try:
        diffusers = importlib.import_module("diffusers")
        importlib.import_module("gguf")
    except ImportError as exc:
        for kind in KINDS:
            forms[f"gguf {kind}"] = {"skipped": f"{type(exc).__name__}: {exc}"}
        return
    for kind in KINDS:
        name = f"gguf {kind}"
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="quant-gguf-")))
        try:
            path = write(model(), folder, kind)
        except ValueError as exc:  # a model too narrow for the type's blocks (--quick and Q4_K)
            forms[name] = {"skipped": str(exc)}
            continue
        config = diffusers.GGUFQuantizationConfig(compute_dtype=dtype)
        plain = diffusers.WanTransformer3DModel.from_single_file(
            str(path), config=str(folder), quantization_config=config
        ).to(device)
        reference = forward(plain)
        del plain
        budget: int | None = int(path.stat().st_size * 0.8)
        open_ = [budget, None]
        session = None
        for budget in open_:
            try:
                session = stack.enter_context(
                    torchferry.from_single_file(
                        diffusers.WanTransformer3DModel,
                        path,
                        config=str(folder),
                        compute_dtype=dtype,
                        strategy="layerwise",
                        prefetch_depth=1,
                        device=device,
                        host_memory=budget,
                    )
                )
                break
            except torchferry.PlanError:
                continue
        assert session is not None
        moved = stack.enter_context(counted(session))
        out = forward(session.pipeline)
        before, read_before = moved[0], session.report().file_read_bytes
        again = forward(session.pipeline)
        report = session.report()
        forms[name] = {
            "identical": bool(torch.equal(out, reference) and torch.equal(again, reference)),
            "bytes_per_step": moved[0] - before,
            "host_bytes": session.host_bytes,
            "block_bytes": session.plan.topology.component("").blocks[0].nbytes,
            "file_bytes": path.stat().st_size,
            "host_budget": budget,
            "file_packs": report.file_packs,
            "file_read_bytes_per_step": report.file_read_bytes - read_before,
            "repoint_us_per_block": 0.0,
            "exchange_us_per_block": 0.0,
            "wrappers_per_block": 0,
        }
        calls[name] = _stepper(session.pipeline, forward)


def _stepper(
    model: torch.nn.Module, forward: Callable[[torch.nn.Module], torch.Tensor]
) -> Callable[[], object]:
    def step() -> object:
        return forward(model)

    return step
