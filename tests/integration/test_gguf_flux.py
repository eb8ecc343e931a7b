"""FLUX as GGUF files are published: a tiny FluxTransformer2DModel under FLUX's original (BFL) names,
its q, k and v fused (`gguf_flux`), opened by torchferry.from_single_file and filled from the .gguf
under every strategy and with a host budget that leaves packs in the file, bit-identical to
diffusers' own from_single_file load (docs/quantized.md, GGUF)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchferry
from torchferry.runtime import GGUFCheckpointReader
from torchferry.topology import GGUFEntry, read_gguf

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")

import gguf_flux  # noqa: E402 (needs the gguf package)

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
#: 12 double and 16 single blocks: a 34 MiB file, larger than a host budget that holds the read
#: buffers, two staging slots and what is not in blocks.
LARGE = {**gguf_flux.FLUX_GGUF, "num_layers": 12, "num_single_layers": 16}


@pytest.fixture(autouse=True, scope="module")
def _scaled() -> Iterator[None]:
    with gguf_flux.scaled_conversion():
        yield


def _load(path: Path, config: Path) -> nn.Module:
    """The model as diffusers loads the GGUF file."""
    model: nn.Module = diffusers.FluxTransformer2DModel.from_single_file(
        str(path), config=str(config), quantization_config=diffusers.GGUFQuantizationConfig()
    )
    return model


def _files(folder: Path, config: dict[str, Any] | None = None) -> tuple[Path, Path, torch.Tensor]:
    path = folder / "flux.gguf"
    with gguf_flux.scaled_conversion():
        gguf_flux.write(path, gguf_flux.flux(config))
        where = gguf_flux.config_folder(folder / "config", config)
        return path, where, gguf_flux.call(_load(path, where))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """The 2+2-block file under BFL's names, its config folder, and diffusers' output for it."""
    return _files(tmp_path_factory.mktemp("flux"))


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """The 12+16-block file (`LARGE`), its config folder, and diffusers' output for it."""
    return _files(tmp_path_factory.mktemp("flux-large"), LARGE)


def _stored(model: nn.Module) -> dict[str, tuple[Any, torch.Tensor]]:
    from diffusers.quantizers.gguf.utils import GGUFParameter

    return {
        n: (p.quant_type, p.detach().clone())
        for n, p in model.named_parameters()
        if isinstance(p, GGUFParameter)
    }


def test_fused_qkv_is_read_as_row_ranges_of_the_quantized_tensor(
    small: tuple[Path, Path, torch.Tensor],
) -> None:
    """Each third of a quantized fused qkv (and each part of a single block's linear1) is the byte range
    of its rows in the file: no copy, no join; the final modulation's swapped halves are two ranges."""
    path, config, _ = small
    header = {e.name: e for e in read_gguf(path)}
    model = gguf_flux_model(path, config)
    with GGUFCheckpointReader(path, module=model) as reader:
        fused = header["double_blocks.0.img_attn.qkv.weight"]
        assert fused.quantized
        third = fused.nbytes // 3
        for i, x in enumerate("qkv"):
            entry = reader.entries[f"transformer_blocks.0.attn.to_{x}.weight"]
            assert isinstance(entry, GGUFEntry) and entry.pieces == ()
            assert (entry.begin, entry.end) == (fused.begin + i * third, fused.begin + (i + 1) * third)
            assert entry.quant_type == fused.quant_type
        linear1 = header["single_blocks.1.linear1.weight"]
        row = linear1.nbytes // 7
        mlp = reader.entries["single_transformer_blocks.1.proj_mlp.weight"]
        assert (mlp.begin, mlp.end) == (linear1.begin + 3 * row, linear1.end)
        norm = reader.entries["norm_out.linear.weight"]
        assert isinstance(norm, GGUFEntry) and len(norm.pieces) == 2


def gguf_flux_model(path: Path, config: Path) -> nn.Module:
    """The model torchferry builds on meta for the file."""
    from torchferry.load._single_file import model_on_meta

    return model_on_meta(diffusers.FluxTransformer2DModel, path, config=config)


@pytest.mark.parametrize("request_", PARAMS)
def test_flux_from_single_file_equals_diffusers(
    small: tuple[Path, Path, torch.Tensor], request_: dict[str, Any]
) -> None:
    """torchferry.from_single_file of the BFL-named FLUX file gives diffusers' output bit for bit under
    each strategy, twice, and every GGUFParameter has diffusers' quant type and bytes."""
    path, config, reference = small
    with torchferry.from_single_file(
        diffusers.FluxTransformer2DModel, path, config=config, device="cpu", **request_
    ) as session:
        model = session.pipeline
        assert torch.equal(gguf_flux.call(model), reference)
        assert torch.equal(gguf_flux.call(model), reference)
        got = _stored(model)
    want = _stored(_load(path, config))
    assert got.keys() == want.keys() and len(want) > 20
    for name, (kind, data) in want.items():
        assert got[name][0] == kind and torch.equal(got[name][1], data)
    assert torch.equal(gguf_flux.call(model), reference)


@pytest.mark.parametrize(
    "request_",
    [REQUESTS["layerwise-d1"], REQUESTS["layerwise-d2"], REQUESTS["auto"]],
    ids=["layerwise-d1", "layerwise-d2", "auto"],
)
def test_flux_with_packs_left_in_the_gguf(
    large: tuple[Path, Path, torch.Tensor], request_: dict[str, Any]
) -> None:
    """A FLUX file larger than the host budget keeps packs in the .gguf, read on demand from its fused
    tensors' row ranges, within the budget, and gives diffusers' output."""
    path, config, reference = large
    budget = 26 << 20
    assert path.stat().st_size > budget
    with torchferry.from_single_file(
        diffusers.FluxTransformer2DModel, path, config=config, device="cpu", host_memory=budget, **request_
    ) as session:
        got = gguf_flux.call(session.pipeline)
        again = gguf_flux.call(session.pipeline)
        report = session.report()
        assert report.file_packs > 0 and report.peak_host_bytes <= budget
        tier = session.engine.store.tier
        assert tier is not None and {c.file for r in tier.reads.values() for c in r.chunks} == {str(path)}
        read = {n for r in tier.reads.values() for c in r.chunks for n in c.names}
        assert any(n.endswith("attn.to_k.weight") for n in read)  # a third of a fused qkv, from the file
    assert torch.equal(got, reference) and torch.equal(again, reference)


def test_a_conversion_that_fails_is_refused_naming_class_tensor_and_conversion(
    small: tuple[Path, Path, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unscaled, diffusers' FLUX conversion cannot split the tiny file's linear1 (it assumes width
    3072): from_single_file refuses before anything is read, naming the class, the file's tensor and
    the conversion's own error."""
    import re

    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    entry = SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"]
    monkeypatch.setitem(entry, "checkpoint_mapping_fn", convert_flux_transformer_checkpoint_to_diffusers)
    path, config, _ = small
    expected = (
        f"{path}: diffusers' conversion for FluxTransformer2DModel failed at "
        "'single_blocks.0.linear1.weight' (RuntimeError: split_with_sizes expects split_sizes to sum "
        "exactly to 1792 (input tensor's size at "
        "dimension 0), but got split_sizes=[3072, 3072, 3072, 12288]); the file is not a checkpoint of "
        "this FluxTransformer2DModel configuration, or the conversion assumes another one (torchferry runs "
        "diffusers' conversion unchanged, as from_single_file does)"
    )
    with pytest.raises(torchferry.PlanError, match=f"^{re.escape(expected)}$"):
        torchferry.from_single_file(diffusers.FluxTransformer2DModel, path, config=config, device="cpu")
