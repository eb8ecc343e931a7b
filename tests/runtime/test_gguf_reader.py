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
from torchferry.topology import GGUFEntry

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


def _flux_header() -> tuple[GGUFEntry, ...]:
    """A FLUX.1-dev header (one double and one single block, at its width of 3072) under BFL's original
    names: Linear weights Q8_0, biases and norm scales F32, at made-up offsets (nothing is read)."""
    d, mlp = 3072, 12288
    linears = {
        "img_in": (d, 64), "txt_in": (d, 4096), "time_in.in_layer": (d, 256), "time_in.out_layer": (d, d),
        "vector_in.in_layer": (d, 768), "vector_in.out_layer": (d, d), "guidance_in.in_layer": (d, 256),
        "guidance_in.out_layer": (d, d), "final_layer.linear": (64, d),
        "final_layer.adaLN_modulation.1": (2 * d, d),
        "single_blocks.0.linear1": (3 * d + mlp, d), "single_blocks.0.linear2": (d, d + mlp),
        "single_blocks.0.modulation.lin": (3 * d, d),
    }  # fmt: skip
    for stream in ("img", "txt"):
        linears |= {
            f"double_blocks.0.{stream}_mod.lin": (6 * d, d), f"double_blocks.0.{stream}_attn.qkv": (3 * d, d),
            f"double_blocks.0.{stream}_attn.proj": (d, d), f"double_blocks.0.{stream}_mlp.0": (mlp, d),
            f"double_blocks.0.{stream}_mlp.2": (d, mlp),
        }  # fmt: skip
    scales = [
        f"double_blocks.0.{s}_attn.norm.{n}_norm.scale" for s in ("img", "txt") for n in ("query", "key")
    ]
    scales += [f"single_blocks.0.norm.{n}_norm.scale" for n in ("query", "key")]
    entries: list[GGUFEntry] = []
    at = 0

    def add(name: str, shape: tuple[int, ...], quant: str, logical: tuple[int, ...]) -> None:
        nonlocal at
        nbytes = shape[0] * (shape[1] if len(shape) > 1 else 4)
        entries.append(
            GGUFEntry(
                name=name,
                dtype="uint8" if quant == "Q8_0" else "float32",
                shape=shape,
                begin=at,
                end=at + nbytes,
                file="flux.gguf",
                data_start=4096,
                quant_type=quant,
                logical_shape=logical,
            )
        )
        at += -(-nbytes // 32) * 32

    for name, (rows, cols) in linears.items():
        add(f"{name}.weight", (rows, cols // 32 * 34), "Q8_0", (rows, cols))
        add(f"{name}.bias", (rows,), "F32", (rows,))
    for name in scales:
        add(name, (128,), "F32", (128,))
    return tuple(entries)


def test_diffusers_flux_conversion_maps_a_flux_header_to_byte_ranges() -> None:
    """diffusers' own FLUX conversion, run on a FLUX.1 header alone, gives every tensor of
    FluxTransformer2DModel: q, k and v are the thirds of the fused qkv's rows, and norm_out.linear is
    the adaLN weight's two halves in the other order."""
    diffusers = pytest.importorskip("diffusers")
    from torchferry.runtime import meta_parameters, model_entries

    header = _flux_header()
    with meta_parameters():
        model = diffusers.FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    names = set(model.state_dict())
    mapped = model_entries("flux.gguf", header, type(model), names)
    assert set(mapped) == names
    by_name = {e.name: e for e in header}
    qkv = by_name["double_blocks.0.img_attn.qkv.weight"]
    third = qkv.nbytes // 3
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        entry = mapped[f"transformer_blocks.0.attn.{part}.weight"]
        assert (entry.begin, entry.end, entry.pieces) == (
            qkv.begin + i * third,
            qkv.begin + (i + 1) * third,
            (),
        )
        assert entry.logical_shape == (3072, 3072) and entry.quant_type == "Q8_0"
    ada = by_name["final_layer.adaLN_modulation.1.weight"]
    half, start = ada.nbytes // 2, ada.data_start + ada.begin
    assert mapped["norm_out.linear.weight"].pieces == (
        (start + half, start + 2 * half),
        (start, start + half),
    )


def test_the_gguf_reader_has_every_field_a_safetensors_reader_has(tmp_path: Path) -> None:
    """One constructor opens both readers (only how headers are read differs), so the GGUF reader holds
    every field of the safetensors reader, the one file its handle and stat were taken from."""
    from safetensors.torch import save_file

    from torchferry.runtime import CheckpointReader

    path = _file(tmp_path / "fused.gguf")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with (
        CheckpointReader(tmp_path / "w.safetensors") as plain,
        GGUFCheckpointReader(path, module=_model(_real(path)), convert=_convert) as reader,
    ):
        assert set(vars(plain)) <= set(vars(reader))
        assert reader.files == (str(path),) and set(reader.stats) == set(reader._handles) == {str(path)}
        assert reader.problems == reader.unreadable == reader.components == ()
    assert reader.closed
