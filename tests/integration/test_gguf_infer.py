"""A GGUF file without a config.json: its class and configuration inferred from its tensor names and
shapes (`topology.infer_gguf_model`), offline, for `from_single_file` and `torchferry plan` alike,
and refused, naming the layouts looked for, when nothing matches (docs/quantized.md, GGUF)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchferry
from torchferry.topology import GGUF_LAYOUTS, GGUFEntry, infer_gguf_model, read_gguf

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")

import gguf_files  # noqa: E402 (needs the gguf package)
import gguf_flux  # noqa: E402

#: The tiny Wan of `gguf_files` with the rotary table every known Wan has (no tensor shows its length).
WAN = {**gguf_files.WAN_GGUF, "rope_max_seq_len": 1024}


def _registered(model_class: Any, config: dict[str, Any]) -> str:
    """The whole configuration ``model_class`` registers when built from ``config``, as JSON."""
    with torchferry.meta_parameters():
        built = model_class.from_config(config)
    values = {k: v for k, v in built.config.items() if not k.startswith("_")}  # not diffusers' bookkeeping
    return json.dumps(values, sort_keys=True, default=list)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Wan file under Wan's names and the FLUX file under BFL's, no config beside."""
    where = tmp_path_factory.mktemp("gguf-infer")
    made = {"wan": where / "wan" / "wan.gguf", "flux": where / "flux" / "flux.gguf"}
    for path in made.values():
        path.parent.mkdir()
    gguf_files.write(made["wan"], gguf_files.wan(WAN), original=True)
    gguf_flux.write(made["flux"], gguf_flux.flux())
    return made


def test_the_inferred_configuration_is_the_one_the_file_was_made_from(files: dict[str, Path]) -> None:
    """From the header alone, each file's class is found and its inferred configuration registers
    exactly the configuration the file was written from (depths from block indices, widths from
    shapes); so do the header entries of the Wan model under diffusers' names and of a deeper FLUX
    with guidance."""
    cases = {
        "wan": ("WanTransformer3DModel (Wan's original names)", diffusers.WanTransformer3DModel, WAN),
        "flux": (
            "FluxTransformer2DModel (BFL's names)",
            diffusers.FluxTransformer2DModel,
            gguf_flux.FLUX_GGUF,
        ),
    }
    for key, (layout, model_class, config) in cases.items():
        inferred = infer_gguf_model(str(files[key]), read_gguf(files[key]))
        assert (inferred.layout, inferred.class_name) == (layout, model_class.__name__)
        assert _registered(model_class, inferred.config) == _registered(model_class, config), key
    with torchferry.meta_parameters():
        named = {n: tuple(t.shape) for n, t in diffusers.WanTransformer3DModel(**WAN).state_dict().items()}
    inferred = infer_gguf_model("x.gguf", _header(named))
    assert inferred.layout == "WanTransformer3DModel (diffusers' names)"
    assert _registered(diffusers.WanTransformer3DModel, inferred.config) == _registered(
        diffusers.WanTransformer3DModel, WAN
    )
    deeper = {**gguf_flux.FLUX_GGUF, "num_layers": 3, "num_single_layers": 1, "guidance_embeds": True}
    with torchferry.meta_parameters():
        state = diffusers.FluxTransformer2DModel(**deeper).state_dict()
    inferred = infer_gguf_model(
        "x.gguf", _header({n: tuple(t.shape) for n, t in gguf_flux.original(state).items()})
    )
    assert _registered(diffusers.FluxTransformer2DModel, inferred.config) == _registered(
        diffusers.FluxTransformer2DModel, deeper
    )


def test_from_single_file_without_config_equals_diffusers_with_it(files: dict[str, Path]) -> None:
    """`from_single_file(WanTransformer3DModel, path)` with no config= (and with the class left to the
    file) gives diffusers' output for the file loaded with its config, bit for bit."""
    path = files["wan"]
    config = gguf_files.config_folder(path.parent.parent / "wan-config", WAN)
    expected = gguf_files.call(
        diffusers.WanTransformer3DModel.from_single_file(
            str(path), config=str(config), quantization_config=diffusers.GGUFQuantizationConfig()
        )
    )
    with torchferry.from_single_file(
        diffusers.WanTransformer3DModel, path, device="cpu", strategy="layerwise"
    ) as session:
        assert torch.equal(gguf_files.call(session.pipeline), expected)
    from torchferry.load._single_file import model_on_meta

    assert type(model_on_meta(None, path)) is diffusers.WanTransformer3DModel  # the class from the file
    with pytest.raises(
        torchferry.PlanError,
        match=re.escape(
            f"{path}: its tensors are those of a WanTransformer3DModel (Wan's original names), not of "
            "FluxTransformer2DModel; pass WanTransformer3DModel, or config= of the FluxTransformer2DModel "
            "the file was made from"
        ),
    ):
        torchferry.from_single_file(diffusers.FluxTransformer2DModel, path, device="cpu")


def test_plan_without_config_plans_what_the_config_plans(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchferry plan` of a .gguf with no config.json beside it (Wan, and FLUX under BFL's names)
    plans the inferred model: the same components, bytes and rows as with the file's config.json."""
    from torchferry.cli import main

    argv = ["--device-memory", "8MiB", "--format", "json"]
    classes = {"wan": "WanTransformer3DModel", "flux": "FluxTransformer2DModel"}
    for key, config in (("wan", WAN), ("flux", gguf_flux.FLUX_GGUF)):
        alone = tmp_path / key
        alone.mkdir()
        shutil.copy(files[key], alone / "model.gguf")
        beside = tmp_path / f"{key}-config"
        shutil.copy(files[key], gguf_files.config_folder(beside, config, classes[key]) / "model.gguf")
        with gguf_flux.scaled_conversion():  # FLUX's conversion at the tiny width (gguf_flux's notes)
            assert main(["plan", str(alone / "model.gguf"), *argv]) == 0
            inferred = json.loads(capsys.readouterr().out)
            assert main(["plan", str(beside), *argv]) == 0
            given = json.loads(capsys.readouterr().out)
        assert inferred["components"] == given["components"] and inferred["components"][0]["blocks"] > 1
        assert inferred["strategies"] == given["strategies"]
        assert inferred["source"] == f"gguf-inferred:{alone / 'model.gguf'}"
    assert main(["plan", str(tmp_path / "wan" / "model.gguf"), "--device-memory", "8MiB"]) == 0
    said = ", with no config.json beside it: its class and configuration inferred from its tensor names"
    assert f"{tmp_path / 'wan' / 'model.gguf'}{said} and shapes\n" in capsys.readouterr().out


def test_a_file_that_matches_no_layout_is_refused_naming_the_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GGUF file whose tensors are of no layout torchferry knows is refused by from_single_file and
    `torchferry plan` (status 2, one line, in flags), naming every layout and the tensors looked for."""
    from torchferry.cli import main

    path = tmp_path / "other.gguf"
    values = np.zeros((4, 32), dtype=np.float32)
    gguf_files.write_tensors(
        path,
        "other",
        {"layers.0.w.weight": torch.from_numpy(values)},
        lambda *_: gguf.GGMLQuantizationType.F32,
    )
    looked = "; ".join(f"{t.name}: {', '.join(t.markers)}" for t in GGUF_LAYOUTS)
    assert "WanTransformer3DModel (Wan's original names): head.modulation, patch_embedding.weight" in looked
    assert "FluxTransformer2DModel (BFL's names): double_blocks.0.img_attn.norm.key_norm.scale" in looked
    said = (
        f"{path}: a GGUF file does not say which model it fills, and its tensors (named like "
        f"'layers.0.w.weight') match none of the layouts torchferry infers one from ({looked}); "
    )
    with pytest.raises(torchferry.PlanError, match=re.escape(said + "pass config= (the model's diffusers")):
        torchferry.from_single_file(diffusers.WanTransformer3DModel, path, device="cpu")
    assert main(["plan", str(path), "--device-memory", "8MiB"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "torchferry" in line]
    assert lines == [
        f"torchferry plan: error: {said}put the model's config.json (from its diffusers folder, e.g. "
        "transformer/config.json) beside it"
    ]


def _header(shapes: dict[str, tuple[int, ...]]) -> list[GGUFEntry]:
    """Header entries of F16 tensors of these logical shapes (no file: inference reads names and shapes)."""
    return [
        GGUFEntry(
            name=n, dtype="float16", shape=s, begin=0, end=0, file="x.gguf", quant_type="F16", logical_shape=s
        )
        for n, s in shapes.items()
    ]


#: The published transformer configurations of two known models (`torchferry/topology/known`, from
#: diffusers' scripts/convert_wan_to_diffusers.py and convert_flux_to_diffusers.py).
PUBLISHED: dict[str, dict[str, Any]] = {
    "wan2.1-t2v-14b": {
        "patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
        "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "image_dim": None,
        "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
    },
    "flux.1-dev": {
        "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19, "num_single_layers": 38,
        "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
        "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": (16, 56, 56),
    },
}  # fmt: skip


def test_known_models_are_inferred_from_full_size_headers() -> None:
    """The shipped tensor specs of Wan2.1-T2V-14B and FLUX.1-dev, under diffusers' names and under
    the original ones (a city96 flux1-dev file's), infer exactly the published configurations."""
    from torchferry import topology

    for model_id, published in PUBLISHED.items():
        dit = next(c for c in topology.known_topology(model_id).components if c.kind == "dit")
        specs = {t.name.removeprefix("transformer."): t.shape for t in dit.all_tensors() if t.persistent}
        if model_id.startswith("wan"):
            original = {gguf_files.original_name(n): s for n, s in specs.items()}
        else:
            meta = {n: torch.empty(s, device="meta") for n, s in specs.items()}
            original = {n: tuple(t.shape) for n, t in gguf_flux.original(meta).items()}
        for shapes in (specs, original):
            assert infer_gguf_model("x.gguf", _header(shapes)).config == published, model_id


#: The smallest set of tensors Wan's original names infer a configuration from (one block).
ONE_BLOCK_WAN: dict[str, tuple[int, ...]] = {
    "head.modulation": (1, 2, 256),
    "patch_embedding.weight": (256, 4, 1, 2, 2),
    "blocks.0.self_attn.q.weight": (256, 256),
    "head.head.weight": (16, 256),
    "text_embedding.0.weight": (256, 16),
    "time_embedding.0.weight": (256, 16),
    "blocks.0.ffn.0.weight": (256, 256),
}


def test_hostile_shapes_and_indices_are_refused_naming_them() -> None:
    """A block index far past the others (which would build a hundred million blocks), and a patch
    embedding of the wrong rank, are refused by name; no model is built."""
    base = dict(ONE_BLOCK_WAN)
    assert infer_gguf_model("x.gguf", _header(base)).config["num_layers"] == 1
    far = {**base, "blocks.99999999.ffn.0.weight": (256, 256)}
    with pytest.raises(
        torchferry.PlanError,
        match=re.escape(
            "x.gguf: its tensors are named as WanTransformer3DModel (Wan's original names) files are, but "
            "its configuration cannot be read from them (its blocks run to index 99999999 but blocks.1 is "
            "not there (2 blocks in all)); pass config="
        ),
    ):
        infer_gguf_model("x.gguf", _header(far))
    flat = {**base, "patch_embedding.weight": (256, 16)}
    with pytest.raises(
        torchferry.PlanError,
        match=re.escape(
            "(tensor 'patch_embedding.weight' has shape [256, 16], and 5 dimensions were expected (a 3-d "
            "convolution's weight))"
        ),
    ):
        infer_gguf_model("x.gguf", _header(flat))


@pytest.mark.parametrize(
    ("name", "shape", "said"),
    [
        ("patch_embedding.weight", (256, 0, 1, 2, 2), "in_channels=0"),
        ("text_embedding.0.weight", (256, 0), "text_dim=0"),
        ("blocks.0.ffn.0.weight", (0, 256), "ffn_dim=0"),
    ],
)
def test_a_zero_width_read_from_a_shape_is_refused(name: str, shape: tuple[int, ...], said: str) -> None:
    """A tensor with a zero dimension gives a zero width (in_channels, text_dim, ffn_dim): refused by
    name at inference, not planned as a model that fails at its first forward."""
    base = dict(ONE_BLOCK_WAN)
    with pytest.raises(torchferry.PlanError, match=re.escape(f"(its tensors give {said}, and a width")):
        infer_gguf_model("x.gguf", _header({**base, name: shape}))
