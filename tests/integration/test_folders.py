"""Diffusers pipeline folders (save_pretrained's layout) planned, opened and loaded by torchferry, bit-exact.

Tiny Wan and Flux pipelines are built from small configs (no download), saved with
``save_pretrained`` as single files per component and as many small shards with an index, then
planned from the folder (`from_checkpoint`, ``torchferry plan``), opened from it
(``offload(checkpoint=FOLDER)`` over a pipeline built on meta) and loaded with
`torchferry.from_pretrained`, each compared with diffusers' own load and run.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import fresh_storage

import torchferry
from torchferry import PlanError, topology
from torchferry.cli import main
from torchferry.testing import toy

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _flux_pipeline() -> Any:
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        shift_factor=0.0,
        scaling_factor=1.0,
    ).eval()
    clip = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            projection_dim=16,
            max_position_embeddings=16,
        )
    ).eval()
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=32, d_model=32, d_kv=4, d_ff=32, num_layers=2, num_heads=4)
    ).eval()
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=None,
        text_encoder_2=t5,
        tokenizer_2=None,
        transformer=transformer,
    )



def _run_flux(pipe: Any) -> tuple[torch.Tensor, torch.Tensor]:
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        pooled = pipe.text_encoder(torch.tensor([[1, 4, 2, 7]])).pooler_output
        embeds = pipe.text_encoder_2(torch.tensor([[3, 5, 1, 2, 6, 0]])).last_hidden_state
        images = pipe(
            prompt_embeds=embeds,
            pooled_prompt_embeds=pooled,
            height=16,
            width=16,
            num_inference_steps=2,
            guidance_scale=3.5,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images
    return embeds, images


def _save(pipe: Any, folder: Path, sharded: bool) -> Path:
    pipe.save_pretrained(str(folder), **({"max_shard_size": "20KB"} if sharded else {}))
    return folder


def _specs(topo: topology.Topology) -> dict[str, set[tuple[str, tuple[int, ...], str]]]:
    """Per component, every persistent tensor as a checkpoint stores it (each tied set once)."""
    out: dict[str, set[tuple[str, tuple[int, ...], str]]] = {}
    for c in topo.components:
        out[c.path] = {(t.name, t.shape, t.dtype) for t in c.all_tensors() if not t.buffer or t.persistent}
    return out


@pytest.mark.parametrize("sharded", [False, True])
def test_folder_topology_matches_the_pipeline(tmp_path: Path, sharded: bool) -> None:
    """A saved Wan pipeline's folder plans as the pipeline: components, kinds, classes, blocks, tensors."""
    pipe = toy.wan_pipeline()
    folder = _save(pipe, tmp_path / "wan", sharded)
    if sharded:
        assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    planned = topology.from_checkpoint(folder)
    found = topology.discover(pipe)
    assert planned.pipeline_class == "WanPipeline"
    assert planned.source == f"folder:{folder}"
    assert [(c.path, c.kind, c.class_name, len(c.blocks)) for c in planned.components] == [
        ("transformer", "dit", "WanTransformer3DModel", 4),
        ("text_encoder", "encoder", "UMT5EncoderModel", 3),
        ("vae", "vae", "AutoencoderKLWan", 0),
    ]
    assert [b.path for b in planned.components[0].blocks] == [b.path for b in found.components[0].blocks]
    mine, theirs = _specs(planned), _specs(found)
    for path in ("transformer", "vae"):
        assert mine[path] == theirs[path]
    # The encoder's tied embedding is stored once, under one of its names.
    assert mine["text_encoder"] <= theirs["text_encoder"] | {
        (a, t.shape, t.dtype) for t in found.components[1].all_tensors() for a in t.aliases
    }
    assert planned.declaration is not None
    assert planned.declaration.encoder_block_attrs["text_encoder"] == ("encoder.block",)


def test_plan_command_reads_a_pipeline_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``torchferry plan FOLDER`` lists each component with the class its config.json names."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", True)
    assert main(["plan", str(folder), "--device-memory", "100KiB"]) == 0
    out = capsys.readouterr().out
    built = f"the pipeline folder {folder}, built on meta as from_pretrained builds it"
    assert out.startswith(f"{folder} (WanPipeline)\n{built}")
    assert re.search(r"^transformer\s+dit\s+WanTransformer3DModel\s", out, re.MULTILINE)
    assert re.search(r"^text_encoder\s+encoder\s+UMT5EncoderModel\s", out, re.MULTILINE)
    assert re.search(r"^vae\s+vae\s+AutoencoderKLWan\s", out, re.MULTILINE)
    assert main(["plan", str(folder), "--device-memory", "100KiB", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["class_name"] for c in doc["components"]] == [
        "WanTransformer3DModel",
        "UMT5EncoderModel",
        "AutoencoderKLWan",
    ]


@pytest.mark.parametrize("sharded", [False, True])
def test_plan_and_session_agree_byte_for_byte_on_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sharded: bool
) -> None:
    """``torchferry plan FOLDER``'s layerwise peak (RoPE buffers, which no file stores, included) is the
    budget from_pretrained's session runs in exactly: at that budget it runs, a byte less it refuses."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", sharded)
    assert main(["plan", str(folder), "--device-memory", "1MiB", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == f"pipeline:{folder}"
    peak = next(r["peak_device_bytes"] for r in doc["strategies"] if r["strategy"] == "layerwise")
    assert peak == 186432  # the same for one file and for shards
    options = {"device": "cpu", "strategy": "layerwise"}
    with torchferry.from_pretrained(diffusers.WanPipeline, folder, device_memory=peak, **options) as session:
        toy.run_wan(session.pipeline)
        assert max(session.step_peaks.values()) == peak
    with pytest.raises(PlanError, match=re.escape(f"({peak - 1}) (config.device_memory_bytes)")):
        torchferry.from_pretrained(diffusers.WanPipeline, folder, device_memory=peak - 1, **options)


def test_one_file_and_shards_of_one_pipeline_plan_the_same_bytes(tmp_path: Path) -> None:
    """A pipeline saved as one file per component and as many shards gives one topology from its headers."""
    pipe = toy.wan_pipeline()
    single = topology.from_checkpoint(_save(pipe, tmp_path / "one", False))
    sharded = topology.from_checkpoint(_save(pipe, tmp_path / "many", True))
    assert single.components == sharded.components
    found = topology.discover(pipe)
    for mine, theirs in zip(single.components, found.components, strict=True):
        # Packed as the session packs the module's tensors, byte for byte.
        assert [b.nbytes for b in mine.blocks] == [b.nbytes for b in theirs.blocks]


@pytest.mark.parametrize("sharded", [False, True])
def test_offload_from_a_folder_over_a_meta_pipeline_is_bit_exact(tmp_path: Path, sharded: bool) -> None:
    """A Wan pipeline built on meta and opened with checkpoint=FOLDER runs exactly as the saved one."""
    ref = toy.wan_pipeline()
    folder = _save(ref, tmp_path / "wan", sharded)
    expected = toy.run_wan(ref)
    with torchferry.meta_parameters():
        pipe = toy.wan_pipeline()
    assert pipe.transformer.blocks[0].attn1.to_q.weight.is_meta
    with torchferry.offload(pipe, strategy="layerwise", device="cpu", checkpoint=folder):
        got = toy.run_wan(pipe)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])


def test_offload_from_a_folder_skips_components_the_pipeline_lacks(tmp_path: Path) -> None:
    """A pipeline loaded without one of the folder's components opens from it; that subfolder is unused."""
    ref = toy.wan_pipeline()
    folder = _save(ref, tmp_path / "wan", False)
    with torchferry.meta_parameters():
        pipe = toy.wan_pipeline()
    pipe.vae = None
    with torchferry.offload(pipe, strategy="layerwise", device="cpu", checkpoint=folder) as session:
        assert [c.path for c in session.plan.components] == ["transformer", "text_encoder"]
        ids = torch.tensor([[3, 7, 1, 9]])
        with torch.no_grad():
            got = pipe.text_encoder(ids).last_hidden_state
            assert torch.equal(got, ref.text_encoder(ids).last_hidden_state)


def test_offload_from_a_folder_rejects_a_mismatched_pipeline(tmp_path: Path) -> None:
    """A folder whose DiT has another shape is refused, naming the component's tensor, before any change."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", False)
    pipe = toy.wan_pipeline()
    pipe.transformer.blocks[0].attn1.to_q.weight.data = torch.zeros(24, 25)
    with pytest.raises(PlanError) as info:
        torchferry.offload(pipe, strategy="layerwise", device="cpu", checkpoint=folder)
    file = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    assert (
        f"{file}: tensor 'transformer.blocks.0.attn1.to_q.weight': shape [24, 24] but the model expects "
        "[24, 25] for 'transformer.blocks.0.attn1.to_q.weight'; this checkpoint is for another model "
        "configuration"
    ) in str(info.value)
    assert pipe.transformer.blocks[0].attn1.to_q.weight.shape == (24, 25)


@pytest.mark.parametrize("sharded", [False, True])
def test_from_pretrained_equals_diffusers_from_pretrained(tmp_path: Path, sharded: bool) -> None:
    """torchferry.from_pretrained of a saved Wan pipeline runs exactly as WanPipeline.from_pretrained."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", sharded)
    plain = diffusers.WanPipeline.from_pretrained(str(folder), tokenizer=None, transformer_2=None)
    # diffusers leaves a single-file folder's tensors as memory-mapped views at the file's own
    # (unaligned) offsets, and CPU kernels may round unaligned operands differently (1.8e-7 seen):
    # the reference is diffusers' values in memory of their own, as torchferry's host copies are.
    fresh_storage(plain)
    expected = toy.run_wan(plain)
    with torchferry.from_pretrained(
        diffusers.WanPipeline, folder, strategy="layerwise", device="cpu", prefetch_depth=2
    ) as session:
        assert session.host_bytes >= topology.from_checkpoint(folder).nbytes
        got = toy.run_wan(session.pipeline)
        ours = session.pipeline.transformer.state_dict()
        assert all(torch.equal(v, ours[k]) for k, v in plain.transformer.state_dict().items())
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])


def test_from_pretrained_flux_in_bfloat16(tmp_path: Path) -> None:
    """A bf16 FluxPipeline folder loads in its stored dtype and matches diffusers' torch_dtype=bf16 load."""
    folder = _save(_flux_pipeline().to(torch.bfloat16), tmp_path / "flux", False)
    plain = diffusers.FluxPipeline.from_pretrained(
        str(folder), tokenizer=None, tokenizer_2=None, torch_dtype=torch.bfloat16
    )
    fresh_storage(plain)  # the reference: diffusers' values in memory of their own
    expected = _run_flux(plain)
    with torchferry.from_pretrained(
        diffusers.FluxPipeline, folder, torch_dtype=torch.bfloat16, strategy="model_level", device="cpu"
    ) as session:
        pipe = session.pipeline
        assert pipe.transformer.transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
        got = _run_flux(pipe)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])


def test_from_pretrained_keeps_a_tie_stored_under_its_later_name(tmp_path: Path) -> None:
    """A tied pair the file stores under its later name (embed_tokens) loads in bf16, still tied."""
    folder = _save(toy.wan_pipeline().to(torch.bfloat16), tmp_path / "wan", False)
    options: dict[str, Any] = {"torch_dtype": torch.bfloat16, "device": "cpu", "strategy": "layerwise"}
    with torchferry.from_pretrained(diffusers.WanPipeline, folder, **options) as session:
        expected = toy.run_wan(session.pipeline)
    file = folder / "text_encoder" / "model.safetensors"
    state = load_file(str(file))
    state["encoder.embed_tokens.weight"] = state.pop("shared.weight")
    save_file(state, str(file), metadata={"format": "pt"})
    with torchferry.from_pretrained(diffusers.WanPipeline, folder, **options) as session:
        encoder = session.pipeline.text_encoder
        assert encoder.shared.weight is encoder.encoder.embed_tokens.weight
        assert encoder.shared.weight.dtype == torch.bfloat16
        got = toy.run_wan(session.pipeline)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])


def test_from_pretrained_builds_every_model_on_meta(tmp_path: Path) -> None:
    """Before the session reads the files, every parameter of every model component is on meta."""
    from torchferry.load._pretrained import build_on_meta

    folder = _save(_flux_pipeline(), tmp_path / "flux", True)
    pipe, options, built = build_on_meta(diffusers.FluxPipeline, folder, None, {"device": "cpu"})
    assert options == {"device": "cpu"}
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        params = list(getattr(pipe, name).parameters())
        assert params and all(p.is_meta for p in params), name
    assert pipe.tokenizer is None and pipe.tokenizer_2 is None
    assert sorted(built) == ["text_encoder", "text_encoder_2", "transformer", "vae"]


def test_from_pretrained_refuses_a_dtype_it_would_have_to_convert(tmp_path: Path) -> None:
    """torch_dtype=bf16 over a float32 folder is refused with the fix, before anything is read."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", False)
    with pytest.raises(PlanError, match=re.escape("torchferry copies the stored bytes and never converts")):
        torchferry.from_pretrained(diffusers.WanPipeline, folder, torch_dtype=torch.bfloat16, device="cpu")


def test_from_pretrained_refuses_a_component_it_cannot_build_on_meta(tmp_path: Path) -> None:
    """A model component that is neither a diffusers nor a transformers model is refused, naming it."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", False)
    index = json.loads((folder / "model_index.json").read_text())
    index["transformer"] = ["torch.nn", "Linear"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError) as info:
        torchferry.from_pretrained(diffusers.WanPipeline, folder, device="cpu")
    assert str(info.value) == (
        "component 'transformer' (torch.Linear) is neither a diffusers ModelMixin nor a transformers "
        "PreTrainedModel, so torchferry cannot build it from its configuration; load that component "
        "yourself (Linear.from_pretrained(folder, subfolder='transformer')) and pass it as "
        "from_pretrained(..., transformer=model)"
    )


def test_from_pretrained_takes_components_as_diffusers_does(tmp_path: Path) -> None:
    """A component passed by keyword replaces the folder's, as in diffusers' from_pretrained."""
    ref = toy.wan_pipeline()
    folder = _save(ref, tmp_path / "wan", False)
    expected = toy.run_wan(ref)
    mine = toy.wan_pipeline().vae
    with torchferry.from_pretrained(diffusers.WanPipeline, folder, vae=mine, device="cpu") as session:
        assert session.pipeline.vae is mine
        got = toy.run_wan(session.pipeline)
    assert torch.equal(got[1], expected[1])


def test_a_wan_pipeline_built_under_inference_mode_streams_exactly() -> None:
    """A WanPipeline built under torch.inference_mode() (as serving frameworks build them) runs a whole
    call bit-exact under layerwise, its tied UMT5 embedding still one object."""
    expected = toy.run_wan(toy.wan_pipeline())
    with torch.inference_mode():
        pipe = toy.wan_pipeline()
    assert pipe.transformer.blocks[0].attn1.to_q.weight.is_inference()
    with torchferry.offload(pipe, strategy="layerwise", device="cpu"), torch.inference_mode():
        got = toy.run_wan(pipe)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    assert pipe.text_encoder.shared.weight is pipe.text_encoder.encoder.embed_tokens.weight


@pytest.mark.parametrize("name", ["transformer", "vae"])
def test_from_pretrained_uses_a_component_given_by_keyword_as_given(tmp_path: Path, name: str) -> None:
    """A component passed by keyword keeps its own weights (not the folder's), in the session and after."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", False)
    mine = getattr(toy.wan_pipeline(), name)
    with torch.no_grad():
        for t in mine.parameters():
            t.mul_(1.5)
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    reference = toy.wan_pipeline()
    getattr(reference, name).load_state_dict(before)
    expected = toy.run_wan(reference)
    with torchferry.from_pretrained(
        diffusers.WanPipeline, folder, device="cpu", strategy="layerwise", **{name: mine}
    ) as session:
        assert getattr(session.pipeline, name) is mine
        got = toy.run_wan(session.pipeline)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    after = mine.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_from_pretrained_takes_a_component_the_folder_lists_as_absent(tmp_path: Path) -> None:
    """A component listed as [null, null] (transformer_2) that the caller passes is used, as in diffusers."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", False)
    assert json.loads((folder / "model_index.json").read_text())["transformer_2"] == [None, None]
    second = toy.wan_pipeline().transformer
    with torch.no_grad():
        for t in second.parameters():
            t.mul_(0.5)
    plain = diffusers.WanPipeline.from_pretrained(
        str(folder), tokenizer=None, transformer_2=copy.deepcopy(second), boundary_ratio=0.5
    )
    fresh_storage(plain)
    expected = toy.run_wan(plain)
    with torchferry.from_pretrained(
        diffusers.WanPipeline,
        folder,
        transformer_2=second,
        boundary_ratio=0.5,
        device="cpu",
        strategy="layerwise",
    ) as session:
        assert session.pipeline.transformer_2 is second
        got = toy.run_wan(session.pipeline)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])


def test_from_pretrained_names_a_missing_or_broken_scheduler_or_tokenizer(tmp_path: Path) -> None:
    """A scheduler subfolder that is gone, or a tokenizer's that is broken, is a PlanError naming the
    component and the fix, not the library's raw OSError (which talks of connecting to the hub)."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", False)
    shutil.rmtree(folder / "scheduler")
    with pytest.raises(PlanError) as gone:
        torchferry.from_pretrained(diffusers.WanPipeline, folder, device="cpu")
    assert str(gone.value) == (
        f"component 'scheduler' (diffusers.FlowMatchEulerDiscreteScheduler) could not be loaded from "
        f"{folder / 'scheduler'} (the subfolder does not exist); re-save or re-download the pipeline "
        "(nothing is downloaded here), or pass the component yourself (from_pretrained(..., "
        "scheduler=...), or scheduler=None to leave it out)"
    )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer_config.json").write_text("{ not json")
    with pytest.raises(PlanError) as broken:
        torchferry.from_pretrained(diffusers.WanPipeline, folder, scheduler=scheduler, device="cpu")
    where = f"could not be loaded from {folder / 'tokenizer'} (the subfolder is broken: "
    assert str(broken.value).startswith(f"component 'tokenizer' (transformers.T5TokenizerFast) {where}")
    with torchferry.from_pretrained(
        diffusers.WanPipeline, folder, scheduler=scheduler, tokenizer=None, device="cpu"
    ) as session:
        assert session.pipeline.tokenizer is None


def test_from_pretrained_takes_the_class_or_diffusion_pipeline_and_refuses_none(tmp_path: Path) -> None:
    """``DiffusionPipeline`` builds the class model_index.json names, as in diffusers; ``None`` is a
    PlanError saying which class to pass."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", False)
    expected = toy.run_wan(toy.wan_pipeline())
    with torchferry.from_pretrained(diffusers.DiffusionPipeline, folder, device="cpu") as session:
        assert isinstance(session.pipeline, diffusers.WanPipeline)
        got = toy.run_wan(session.pipeline)
    assert torch.equal(got[1], expected[1])
    with pytest.raises(PlanError) as caught:
        torchferry.from_pretrained(None, folder, device="cpu")
    assert str(caught.value) == (
        f"from_pretrained(None, {str(folder)!r}): the first argument is the pipeline class to build; "
        f"{folder}'s model_index.json names WanPipeline (pass diffusers.WanPipeline, or "
        "diffusers.DiffusionPipeline to build the class the folder names)"
    )


def test_from_pretrained_takes_torch_dtype_as_a_mapping(tmp_path: Path) -> None:
    """``torch_dtype={'default': torch.float32}`` over a float32 folder loads; a dtype the files do not
    store is refused saying both dtypes; a mapping naming no component is refused."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", False)
    expected = toy.run_wan(toy.wan_pipeline())
    with torchferry.from_pretrained(
        diffusers.WanPipeline, folder, torch_dtype={"default": torch.float32}, device="cpu"
    ) as session:
        assert torch.equal(toy.run_wan(session.pipeline)[1], expected[1])
    with pytest.raises(PlanError, match=re.escape("is stored as float32, not bfloat16")) as asked:
        torchferry.from_pretrained(
            diffusers.WanPipeline, folder, torch_dtype={"transformer": torch.bfloat16}, device="cpu"
        )
    assert "text_encoder" not in str(asked.value)
    with pytest.raises(PlanError) as unknown:
        torchferry.from_pretrained(diffusers.WanPipeline, folder, torch_dtype={"unet": torch.float32})
    assert str(unknown.value) == (
        "from_pretrained(torch_dtype=...) has names no component of the folder ('unet'); map component "
        "names (scheduler, text_encoder, transformer, vae) or 'default' to torch dtypes"
    )


def test_from_pretrained_finds_a_hub_id_in_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub id cached in $HF_HUB_CACHE loads from its snapshot; an absent one says how to fetch it."""
    ref = toy.wan_pipeline()
    repo = tmp_path / "hub" / "models--tiny-org--tiny-wan"
    snapshot = _save(ref, repo / "snapshots" / "0123abc", True)
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(p for p in snapshot.rglob("*") if p.is_file())):
        blob = repo / "blobs" / f"blob{i}"  # the hub cache keeps files as blobs, linked from snapshots
        file.rename(blob)
        file.symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    expected = toy.run_wan(ref)
    with torchferry.from_pretrained(diffusers.WanPipeline, "tiny-org/tiny-wan", device="cpu") as session:
        assert session.plan.config.checkpoint == str(repo / "snapshots" / "0123abc")
        assert torch.equal(toy.run_wan(session.pipeline)[1], expected[1])
    with pytest.raises(PlanError) as info:
        torchferry.from_pretrained(diffusers.WanPipeline, "tiny-org/other", device="cpu")
    assert str(info.value) == (
        "tiny-org/other: no such folder, nor a hub id in the local Hugging Face cache; download it first "
        "(hf download tiny-org/other, or Pipeline.from_pretrained once), or pass the folder's "
        "path"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_from_pretrained_keeps_fp32_modules_as_diffusers_does(tmp_path: Path, dtype: torch.dtype) -> None:
    """A 16-bit Wan folder loads as diffusers loads it with dtype=: the modules each class keeps in
    float32 (the transformer's norms and time embedder; UMT5's wo in float16) are widened from the
    files, every tensor and the output bit-identical to WanPipeline.from_pretrained."""
    folder = _save(toy.wan_pipeline().to(dtype), tmp_path / "wan", False)
    plain = diffusers.WanPipeline.from_pretrained(
        str(folder), tokenizer=None, transformer_2=None, dtype=dtype
    )
    fresh_storage(plain)
    expected = toy.run_wan(plain)
    with torchferry.from_pretrained(
        diffusers.WanPipeline, folder, dtype=dtype, strategy="layerwise", device="cpu"
    ) as session:
        pipe = session.pipeline
        kept = pipe.transformer.condition_embedder.time_embedder.linear_1.weight
        assert kept.dtype == torch.float32
        assert pipe.transformer.blocks[0].attn1.to_q.weight.dtype == dtype
        wo = pipe.text_encoder.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype
        assert wo == (torch.float32 if dtype == torch.float16 else dtype)
        got = toy.run_wan(pipe)
        for name in ("transformer", "text_encoder", "vae"):
            ours = getattr(pipe, name).state_dict()
            for key, value in getattr(plain, name).state_dict().items():
                assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), (name, key)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("sharded", [False, True])
def test_from_pretrained_reads_a_weight_variant(tmp_path: Path, sharded: bool) -> None:
    """variant='fp16' reads the files save_pretrained(variant='fp16') wrote, beside the plain ones; a
    variant no component has is refused, naming the files looked for."""
    ref = toy.wan_pipeline()
    expected = toy.run_wan(ref)
    folder = tmp_path / "wan"
    plain = toy.wan_pipeline()
    with torch.no_grad():
        plain.transformer.blocks[0].attn1.to_q.weight.mul_(2)  # the plain files differ from the variant
    plain.save_pretrained(str(folder))
    ref.save_pretrained(str(folder), variant="fp16", **({"max_shard_size": "20KB"} if sharded else {}))
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    with torchferry.from_pretrained(diffusers.WanPipeline, folder, variant="fp16", device="cpu") as session:
        assert torch.equal(toy.run_wan(session.pipeline)[1], expected[1])
    with torchferry.from_pretrained(diffusers.WanPipeline, folder, device="cpu") as session:
        assert not torch.equal(toy.run_wan(session.pipeline)[1], expected[1])
    with pytest.raises(PlanError) as info:
        torchferry.from_pretrained(diffusers.WanPipeline, folder, variant="bf16", device="cpu")
    assert str(info.value) == (
        f"{folder}: no component holds weights of variant 'bf16' (files such as "
        "diffusion_pytorch_model.bf16.safetensors or model.bf16.safetensors); drop variant= to read the "
        "plain files, or fetch that variant"
    )


def test_from_pretrained_names_the_equivalent_of_diffusers_options(tmp_path: Path) -> None:
    """A diffusers loading or offloading keyword is refused by name with what torchferry does
    instead, before anything is read; dtype= and torch_dtype= together are refused too."""
    folder = _save(toy.wan_pipeline(), tmp_path / "wan", False)
    with pytest.raises(PlanError) as info:
        torchferry.from_pretrained(diffusers.WanPipeline, folder, low_cpu_mem_usage=True, device="cpu")
    assert str(info.value).startswith(
        "from_pretrained() got unknown option(s) 'low_cpu_mem_usage'; low_cpu_mem_usage= has no "
        "equivalent because torchferry always loads that way: torchferry.from_pretrained builds every "
        "model on the meta device and reads each weight once; drop it; the options are the OffloadConfig "
        "fields: "
    )
    with pytest.raises(PlanError, match=re.escape("got both dtype= and torch_dtype=")):
        torchferry.from_pretrained(
            diffusers.WanPipeline, folder, dtype=torch.float32, torch_dtype=torch.float32, device="cpu"
        )
