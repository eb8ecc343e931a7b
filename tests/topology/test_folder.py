"""Pipeline folders from headers alone: components from model_index.json, hub ids and the local hub cache.

The folders here are written by hand (model_index.json, config.json, safetensors files whose data
region is a sparse hole), so nothing needs diffusers; tests/integration/test_folders.py builds real
ones with save_pretrained.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from torchferry import PlanError, topology
from torchferry.cli._plan_input import load_model
from torchferry.topology._safetensors import SAFETENSORS_DTYPES

_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}


def write_header_only(path: Path, tensors: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """A safetensors file of ``name -> (shape, dtype)`` whose data region is a sparse hole."""
    header: dict[str, object] = {}
    offset = 0
    for name, (shape, dtype) in tensors.items():
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * topology.dtype_size(dtype)
        header[name] = {
            "dtype": _CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little"))
        handle.write(raw)
        handle.truncate(8 + len(raw) + offset)


def folder_of(known_id: str, root: Path) -> Path:
    """A pipeline folder holding the known model's persistent tensors, as save_pretrained names them."""
    topo = topology.known_topology(known_id)
    index: dict[str, object] = {"_class_name": topo.pipeline_class, "_diffusers_version": "0.42.1"}
    for c in topo.components:
        library = "transformers" if c.kind == "encoder" else "diffusers"
        index[c.path] = [library, c.class_name]
        config = (
            {"_class_name": c.class_name} if library == "diffusers" else {"architectures": [c.class_name]}
        )
        (root / c.path).mkdir(parents=True)
        (root / c.path / "config.json").write_text(json.dumps(config))
        stem = "diffusion_pytorch_model" if library == "diffusers" else "model"
        tensors = {
            t.name[len(c.path) + 1 :]: (t.shape, t.dtype)
            for t in c.all_tensors()
            if not t.buffer or t.persistent
        }
        write_header_only(root / c.path / f"{stem}.safetensors", tensors)
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    index["tokenizer"] = [None, None]
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def tiny_folder(root: Path, *, sharded: bool = False) -> Path:
    """A two-component pipeline folder of an unknown pipeline class: a DiT and a VAE."""
    index = {
        "_class_name": "TinyPipeline",
        "transformer": ["diffusers", "TinyTransformer"],
        "vae": ["diffusers", "AutoencoderKLTiny"],
        "boundary_ratio": None,
    }
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps(index))
    dit = {f"layers.{i}.w": ((4, 4), "float32") for i in range(3)} | {"proj.w": ((4,), "float32")}
    if sharded:
        first = dict(list(dit.items())[:2])
        second = dict(list(dit.items())[2:])
        write_header_only(root / "transformer" / "diffusion_pytorch_model-00001-of-00002.safetensors", first)
        write_header_only(root / "transformer" / "diffusion_pytorch_model-00002-of-00002.safetensors", second)
        weight_map = {k: "diffusion_pytorch_model-00001-of-00002.safetensors" for k in first} | {
            k: "diffusion_pytorch_model-00002-of-00002.safetensors" for k in second
        }
        index_file = root / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
        index_file.write_text(json.dumps({"weight_map": weight_map}))
    else:
        write_header_only(root / "transformer" / "diffusion_pytorch_model.safetensors", dit)
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": "TinyTransformer"}))
    write_header_only(root / "vae" / "diffusion_pytorch_model.safetensors", {"conv.w": ((2, 2), "float16")})
    return root


@pytest.mark.parametrize("sharded", [False, True])
def test_tiny_folder_components_and_guessed_blocks(tmp_path: Path, sharded: bool) -> None:
    """An unknown pipeline class's folder: kinds from names and classes, blocks guessed, names prefixed."""
    topo = topology.from_checkpoint(tiny_folder(tmp_path / "tiny", sharded=sharded))
    assert topo.pipeline_class == "TinyPipeline"
    assert topo.declaration is None
    assert [(c.path, c.kind, c.class_name) for c in topo.components] == [
        ("transformer", "dit", "TinyTransformer"),
        ("vae", "vae", "AutoencoderKLTiny"),
    ]
    dit = topo.components[0]
    assert [b.path for b in dit.blocks] == [
        "transformer.layers.0",
        "transformer.layers.1",
        "transformer.layers.2",
    ]
    assert [t.name for t in dit.tensors] == ["transformer.proj.w"]
    assert topo.components[1].tensors[0].name == "vae.conv.w"


def test_block_attrs_override_per_component(tmp_path: Path) -> None:
    """A mapping of component name to block attributes overrides the guess; an unknown name is refused."""
    folder = tiny_folder(tmp_path / "tiny")
    topo = topology.from_checkpoint(folder, block_attrs={"transformer": ()})
    assert topo.components[0].blocks == ()
    with pytest.raises(PlanError) as info:
        topology.from_checkpoint(folder, block_attrs={"text_encoder": ("layers",)})
    assert str(info.value) == (
        f"{folder}: block_attrs names 'text_encoder', which the folder has no weights for; its components "
        "are transformer, vae"
    )


def test_read_pipeline_folder_keeps_values_and_absent_components(tmp_path: Path) -> None:
    """Index values that are not components, and [null, null] components, are kept apart."""
    found = topology.read_pipeline_folder(folder_of("wan2.1-t2v-1.3b", tmp_path / "wan"))
    assert found.pipeline_class == "WanPipeline"
    assert [c.name for c in found.weighted] == ["transformer", "text_encoder", "vae"]
    assert [c.name for c in found.components if c.source is None] == ["scheduler"]
    assert found.absent == ("tokenizer",)
    tiny = topology.read_pipeline_folder(tiny_folder(tmp_path / "tiny"))
    assert tiny.init_values == (("boundary_ratio", None),)


def test_a_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    """A pipeline folder whose components hold no safetensors weights says so and how to fix it."""
    root = tmp_path / "bin"
    (root / "transformer").mkdir(parents=True)
    (root / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"\0")
    (root / "model_index.json").write_text(
        json.dumps({"_class_name": "P", "transformer": ["diffusers", "T"]})
    )
    with pytest.raises(PlanError) as info:
        topology.from_checkpoint(root)
    assert str(info.value) == (
        f"{root}: model_index.json lists 1 component(s) but no subfolder holds *.safetensors weights; "
        "torchferry reads safetensors only (re-save with save_pretrained, whose default is safetensors)"
    )


def test_a_stray_safetensors_beside_a_scheduler_is_no_model(tmp_path: Path) -> None:
    """A *.safetensors file in the scheduler's (or a tokenizer's) subfolder is not a second DiT: those
    components hold no weights, as diffusers, loading them with their own from_pretrained, treats them."""
    root = folder_of("wan2.1-t2v-1.3b", tmp_path / "wan")
    clean = topology.from_checkpoint(root)
    index = json.loads((root / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    (root / "model_index.json").write_text(json.dumps(index))
    for name in ("scheduler", "tokenizer"):
        write_header_only(root / name / "stray.safetensors", {"blocks.0.w": ((64, 64), "float32")})
    topo = topology.from_checkpoint(root)
    assert [c.path for c in topo.components] == ["transformer", "text_encoder", "vae"]
    assert topo.components == clean.components
    found = topology.read_pipeline_folder(root)
    assert [c.name for c in found.components if c.source is None] == ["scheduler", "tokenizer"]


@pytest.mark.parametrize("name", ["../outside", "/abs", "sub/dir", ""])
def test_a_component_named_outside_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    """A model_index.json component whose name is no attribute name (``../outside``) would be read from
    outside the folder: refused, as an index shard named with ``..`` is."""
    root = tiny_folder(tmp_path / "tiny")
    write_header_only(tmp_path / "outside" / "diffusion_pytorch_model.safetensors", {"w": ((2,), "float32")})
    index = json.loads((root / "model_index.json").read_text())
    index[name] = ["diffusers", "TinyTransformer"]
    (root / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError) as info:
        topology.from_checkpoint(root)
    assert str(info.value) == (
        f"{root / 'model_index.json'}: component {name!r} is not an attribute name, and a component's "
        "subfolder is named after it, inside the pipeline folder (a name with '..' or a path separator "
        "would be read from elsewhere, as an index shard named so is refused); fix model_index.json"
    )


def test_several_weight_sets_without_a_plain_name_are_refused(tmp_path: Path) -> None:
    """Two variant files (fp16 and bf16) with no plain one are ambiguous: the error names them."""
    root = tiny_folder(tmp_path / "tiny")
    sub = root / "vae"
    (sub / "diffusion_pytorch_model.safetensors").rename(sub / "diffusion_pytorch_model.fp16.safetensors")
    write_header_only(sub / "diffusion_pytorch_model.bf16.safetensors", {"conv.w": ((2, 2), "bfloat16")})
    with pytest.raises(PlanError, match=re.escape(f"{sub}: holds several safetensors weight sets")):
        topology.from_checkpoint(root)


def test_a_folder_with_a_known_models_shapes_gets_its_compute_facts(tmp_path: Path) -> None:
    """A folder holding Wan2.1 1.3B's tensors plans with that known model's facts (FLOPs, hub repo)."""
    folder = folder_of("wan2.1-t2v-1.3b", tmp_path / "wan")
    topo, known = load_model(str(folder))
    assert known is not None and known.id == "wan2.1-t2v-1.3b"
    expected = topology.known_topology("wan2.1-t2v-1.3b")
    assert [(c.path, c.kind, c.class_name, len(c.blocks)) for c in topo.components] == [
        (c.path, c.kind, c.class_name, len(c.blocks)) for c in expected.components
    ]
    assert topo.declaration == expected.declaration


def test_hub_cache_dir_follows_the_environment(tmp_path: Path) -> None:
    """HF_HUB_CACHE wins over HF_HOME, which wins over ~/.cache/huggingface/hub."""
    assert topology.hub_cache_dir({"HF_HUB_CACHE": str(tmp_path / "a"), "HF_HOME": "x"}) == tmp_path / "a"
    assert topology.hub_cache_dir({"HF_HOME": str(tmp_path / "h")}) == tmp_path / "h" / "hub"
    assert topology.hub_cache_dir({}) == Path("~/.cache/huggingface/hub").expanduser()


def test_hub_id_resolves_to_its_cached_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id in the local cache is its refs/main snapshot; in any case; absent, it is None."""
    cache = tmp_path / "hub"
    repo = cache / "models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers"
    folder_of("wan2.1-t2v-1.3b", repo / "snapshots" / "abc123")
    (repo / "snapshots" / "old").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert topology.hub_snapshot("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == repo / "snapshots" / "abc123"
    assert topology.hub_snapshot("wan-ai/wan2.1-t2v-1.3b-diffusers") == repo / "snapshots" / "abc123"
    assert topology.hub_snapshot("black-forest-labs/FLUX.1-dev") is None
    topo, known = load_model("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    assert topo.source == f"folder:{repo / 'snapshots' / 'abc123'}"
    assert known is not None and known.id == "wan2.1-t2v-1.3b"


def test_hub_id_not_cached_plans_the_known_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A known hub id absent from the cache plans from the shipped specs; hub ids are case-insensitive."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    topo, known = load_model("black-forest-labs/FLUX.1-dev")
    assert topo == topology.known_topology("flux.1-dev")
    assert known is not None and known.id == "flux.1-dev"
    assert topology.hub_model_id("WAN-AI/wan2.2-t2v-a14b-diffusers") == "wan2.2-t2v-a14b"
    assert topology.hub_model_id("someone/else") is None


def test_library_names_resolve_as_diffusers_reads_them() -> None:
    """A library diffusers loads from is itself, a pipeline-local name is its diffusers.pipelines module,
    and any other name only a module the process imported already (never one a file names)."""
    from torchferry.topology._folder import library_module

    assert library_module("transformers", pipeline_local=False, imported=False) == "transformers"
    assert library_module("ltx2", pipeline_local=True, imported=False) == "diffusers.pipelines.ltx2"
    assert library_module("my_models", pipeline_local=False, imported=True) == "my_models"
    assert library_module("evil", pipeline_local=False, imported=False) is None
