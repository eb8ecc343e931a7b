"""`GGUFCheckpointReader` over a conversion that renames, splits rows and joins them (as FLUX's does:
``torch.cat([q])`` copies of a fused qkv's thirds, ``swap_scale_shift``'s halves in the other order):
every model tensor is read as the bytes the conversion gives on the file's real tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from torchferry import PlanError, topology
from torchferry.runtime import GGUFCheckpointReader

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _convert(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames, a row split, copies of splits, and two halves joined in the other order."""
    q, k, v = torch.chunk(checkpoint.pop("fused.weight"), 3, dim=0)
    shift, scale = checkpoint.pop("mod.weight").chunk(2, dim=0)
    return {
        "q.weight": torch.cat([q]),
        "k.weight": k,
        "v.weight": torch.cat([v]),
        "norm.weight": torch.cat([scale, shift], dim=0),
        "b.bias": checkpoint.pop("bias"),
    }


def _file(path: Path) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch="test")
    writer.add_tensor(
        "fused.weight",
        gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), Q.Q8_0),
        raw_dtype=Q.Q8_0,
    )
    writer.add_tensor(
        "mod.weight",
        gguf.quants.quantize(rng.standard_normal((4, 32)).astype(np.float32), Q.Q4_0),
        raw_dtype=Q.Q4_0,
    )
    writer.add_tensor("bias", rng.standard_normal(6).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _real(path: Path) -> dict[str, torch.Tensor]:
    """The conversion run on the file's tensors as diffusers reads them."""
    return _convert({t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(str(path)).tensors})


def _model(expected: dict[str, torch.Tensor]) -> nn.Module:
    model = nn.Module()
    for name, tensor in expected.items():
        owner, leaf = name.split(".")
        module = nn.Module()
        module.register_parameter(leaf, nn.Parameter(torch.empty_like(tensor), requires_grad=False))
        model.add_module(owner, module)
    return model


def test_split_and_joined_rows_read_as_the_conversion_gives_them(tmp_path: Path) -> None:
    """Each converted tensor, one byte range of the file or two joined, reads (alone and packed into a
    flat buffer) as the conversion's result on the real tensors."""
    path = _file(tmp_path / "fused.gguf")
    expected = _real(path)
    with GGUFCheckpointReader(path, module=_model(expected), convert=_convert) as reader:
        assert reader.entries["k.weight"].pieces == reader.entries["q.weight"].pieces == ()
        assert len(reader.entries["norm.weight"].pieces) == 2  # type: ignore[attr-defined]
        for name, tensor in expected.items():
            assert torch.equal(reader.read_tensor(name), tensor), name
        specs = [
            topology.TensorSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
            for n, t in expected.items()
        ]
        reader.validate(specs)
        layout = topology.pack(specs)
        flat = torch.empty(topology.packed_nbytes(layout), dtype=torch.uint8)
        reader.read_into(layout, flat)
        for spec, offset in layout:
            got = flat[offset : offset + spec.nbytes]
            assert torch.equal(got, expected[spec.name].reshape(-1).view(torch.uint8)), spec.name


def test_a_computed_tensor_is_refused(tmp_path: Path) -> None:
    """A conversion that computes a tensor (a sum) rather than moving rows is refused by name."""
    path = _file(tmp_path / "fused.gguf")

    def summed(checkpoint: dict[str, Any]) -> dict[str, Any]:
        return {**_convert(dict(checkpoint)), "b.bias": checkpoint["bias"] + 1}

    with pytest.raises(
        PlanError,
        match=re.escape(
            f"{path}: the conversion computes 1 tensor(s) ('b.bias') from the file's data rather than "
            "renaming, slicing or joining rows of them, so they are no byte ranges of the file; torchferry "
            "streams the file's bytes only"
        ),
    ):
        GGUFCheckpointReader(path, module=_model(_real(path)), convert=summed)
