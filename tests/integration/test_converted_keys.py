"""Pipeline folders whose text encoders transformers 5 saves under other names than the modules', read
as transformers loads them (its own conversion mapping), bit-exact, with and without a host budget
that leaves packs in the files.

Qwen-Image, HunyuanImage 2.1 and Kandinsky 5 (Qwen2.5-VL: ``model.layers.*``, ``visual.*`` on disk,
``model.language_model.*``, ``model.visual.*`` in the module), FLUX.2 (Mistral 3) and LTX-2 (Gemma 3:
``language_model.model.*`` on disk, ``model.language_model.*`` in the module) are built tiny from
small configs (no download) with their text encoders, saved with ``save_pretrained`` (the layout
their published checkpoints have), then opened with `torchferry.from_pretrained` and with
``offload(checkpoint=FOLDER)`` over the pipeline built on meta, each compared with diffusers' own load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import fresh_storage

import torchferry
from torchferry import PlanError, topology
from torchferry.cli import main
from torchferry.load._pretrained import pipeline_on_meta

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "vocab_size": 96}
#: A language model of 10 layers of about 3 MiB, large enough for a file tier to pay.
_LARGER = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 10, "vocab_size": 96}


def _qwen25_vl(text: dict[str, int] = _TEXT) -> Any:
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            **text,
            "num_attention_heads": text["hidden_size"] // 16,
            "num_key_value_heads": text["hidden_size"] // 32,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]},
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def _mistral3(text: dict[str, int] = _TEXT) -> Any:
    config = transformers.Mistral3Config(
        text_config={
            **text,
            "model_type": "mistral",
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 16,
            "image_size": 16,
            "patch_size": 4,
        },
    )
    return transformers.Mistral3ForConditionalGeneration(config)


def _gemma3(text: dict[str, int] = _TEXT) -> Any:
    config = transformers.Gemma3Config(
        text_config={**text, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 4,
        },
        mm_tokens_per_image=4,
    )
    return transformers.Gemma3ForConditionalGeneration(config)


def _clip() -> Any:
    config = transformers.CLIPTextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=96
    )
    return transformers.CLIPTextModel(config)


def _t5() -> Any:
    config = transformers.T5Config(
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_layers=2,
        num_heads=4,
        vocab_size=96,
        relative_attention_num_buckets=8,
    )
    return transformers.T5EncoderModel(config)


def _scheduler() -> Any:
    return diffusers.FlowMatchEulerDiscreteScheduler()


#: pipeline class -> its text encoders (attribute -> builder), and the on-disk key its first one
#: has that is not a module name (the layout of the published checkpoints).
PIPELINES: dict[str, tuple[dict[str, Callable[[], Any]], str]] = {
    "QwenImagePipeline": ({"text_encoder": _qwen25_vl}, "model.layers.0.mlp.up_proj.weight"),
    "Flux2Pipeline": ({"text_encoder": _mistral3}, "language_model.model.layers.0.mlp.up_proj.weight"),
    "Kandinsky5T2VPipeline": (
        {"text_encoder": _qwen25_vl, "text_encoder_2": _clip},
        "visual.blocks.0.mlp.up_proj.weight",
    ),
    "Kandinsky5T2IPipeline": (
        {"text_encoder": _qwen25_vl, "text_encoder_2": _clip},
        "model.layers.3.self_attn.q_proj.weight",
    ),
    "HunyuanImagePipeline": (
        {"text_encoder": _qwen25_vl, "text_encoder_2": _t5},
        "model.embed_tokens.weight",
    ),
    "LTX2Pipeline": ({"text_encoder": _gemma3}, "language_model.model.layers.0.mlp.up_proj.weight"),
}


def _left_out(name: str) -> dict[str, None]:
    """The components of ``name`` the tiny pipeline leaves out (passed as ``None`` to load it)."""
    encoders, _ = PIPELINES[name]
    cls = getattr(diffusers, name)
    return {k: None for k in cls._get_signature_keys(cls)[0] if k not in encoders and k != "scheduler"}


def _save(name: str, folder: Path, text: dict[str, int] = _TEXT) -> None:
    """A tiny ``name`` pipeline with its text encoders (the other models left out), saved to ``folder``;
    ``text`` sizes the language model of its first encoder."""
    encoders, _ = PIPELINES[name]
    torch.manual_seed(0)
    values: dict[str, Any] = {
        k: (build(text) if i == 0 else build()).eval()  # type: ignore[call-arg]
        for i, (k, build) in enumerate(encoders.items())
    }
    getattr(diffusers, name)(**values, scheduler=_scheduler(), **_left_out(name)).save_pretrained(str(folder))


def _encode(pipe: Any, attr: str) -> torch.Tensor:
    """The text encoder's last hidden states for fixed token ids."""
    model = getattr(pipe, attr)
    ids = torch.arange(3, 11).reshape(1, 8)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return out.hidden_states[-1]


def _stored_keys(folder: Path, component: str) -> set[str]:
    keys: set[str] = set()
    for file in (folder / component).glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            keys.update(handle.keys())
    return keys


def _weights(pipe: Any, attrs_: list[str]) -> dict[str, torch.Tensor]:
    return {f"{a}.{k}": v.clone() for a in attrs_ for k, v in getattr(pipe, a).state_dict().items()}


def _opens_bit_exact(name: str, folder: Path, host_memory: int | None) -> None:
    """``folder`` (a saved ``name``) opened with from_pretrained and with offload(checkpoint=) over the
    pipeline built on meta gives diffusers' encoder outputs, and its weights after close, bit for bit."""
    encoders, on_disk = PIPELINES[name]
    first = next(iter(encoders))
    plain = fresh_storage(getattr(diffusers, name).from_pretrained(str(folder), **_left_out(name)))
    assert on_disk in _stored_keys(folder, first) and on_disk not in getattr(plain, first).state_dict()
    expected = {a: _encode(plain, a) for a in encoders}
    weights = _weights(plain, list(encoders))
    options: dict[str, Any] = {"strategy": "layerwise", "device": "cpu", "host_memory": host_memory}
    if host_memory is not None:  # stream the encoder's blocks, so a pack read is a block
        options["components"] = ("text_encoder",)
    with torchferry.from_pretrained(
        getattr(diffusers, name), folder, **_left_out(name), **options
    ) as session:
        got = {a: _encode(session.pipeline, a) for a in encoders}
        assert (session.report().file_packs > 0) == (host_memory is not None)
    assert {a: torch.equal(got[a], expected[a]) for a in encoders} == dict.fromkeys(encoders, True)
    after = _weights(session.pipeline, list(encoders))
    assert after.keys() == weights.keys()
    assert [k for k in weights if not torch.equal(after[k], weights[k])] == []
    meta = pipeline_on_meta(folder)
    with torchferry.offload(meta, checkpoint=str(folder), **options) as session:
        got = {a: _encode(meta, a) for a in encoders}
        assert (session.report().file_packs > 0) == (host_memory is not None)
    assert {a: torch.equal(got[a], expected[a]) for a in encoders} == dict.fromkeys(encoders, True)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_folder_saved_under_transformers_names_opens_bit_exact(tmp_path: Path, name: str) -> None:
    """A pipeline folder whose text encoder's files use transformers' saved names opens with
    from_pretrained and with offload(checkpoint=), every encoder output and weight as diffusers loads them."""
    _save(name, tmp_path / name)
    _opens_bit_exact(name, tmp_path / name, None)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Flux2Pipeline", "LTX2Pipeline", "QwenImagePipeline"])
def test_such_a_folder_over_the_host_budget_reads_packs_from_its_files(tmp_path: Path, name: str) -> None:
    """The same with a host budget that leaves packs in the files (read on demand by their saved
    names), for each of the three encoder layouts (Qwen2.5-VL, Mistral 3, Gemma 3)."""
    _save(name, tmp_path / name, _LARGER)
    total = topology.from_checkpoint(tmp_path / name).nbytes
    budget = 28 << 20
    assert total > budget
    _opens_bit_exact(name, tmp_path / name, budget)


def test_plan_of_such_a_folder_counts_the_module_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``torchferry plan FOLDER`` plans such a folder as the pipeline built on meta, which holds the
    dtypes the files store under their other names, so it counts the files' bytes."""
    folder = tmp_path / "qwen"
    torch.manual_seed(0)
    encoder = _qwen25_vl().to(torch.bfloat16).eval()
    diffusers.QwenImagePipeline(
        scheduler=_scheduler(), vae=None, text_encoder=encoder, tokenizer=None, transformer=None
    ).save_pretrained(str(folder))
    built = topology.discover(pipeline_on_meta(folder))
    stored = [t for c in built.components for t in c.all_tensors() if t.persistent or not t.buffer]
    files = topology.from_checkpoint(folder)
    assert sum(t.nbytes for t in stored) == sum(t.nbytes for c in files.components for t in c.all_tensors())
    assert {t.dtype for t in stored} == {"bfloat16"}
    assert main(["plan", str(folder), "--device-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{folder} (QwenImagePipeline)\nthe pipeline folder {folder}, built on meta as ")
    assert re.search(r"^text_encoder\s+encoder\s+Qwen2_5_VLForConditionalGeneration\s", out, re.MULTILINE)


def _mixtral(width: int = 32) -> Any:
    """A MixtralModel of 2 experts: ``width=512`` makes 10 blocks of 3.5 MiB whose experts (the fused
    tensors, kept in host memory as made) are 0.4 MiB, so a file tier pays."""
    config = transformers.MixtralConfig(
        hidden_size=width,
        intermediate_size=2 * width if width < 512 else 32,
        num_hidden_layers=1 if width < 512 else 10,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    return transformers.MixtralModel(config)


def _mixtral_folder(folder: Path, width: int = 32) -> Any:
    """A MixtralModel saved to ``folder`` (transformers writes its fused experts one by one)."""
    torch.manual_seed(0)
    model = _mixtral(width).eval()
    model.save_pretrained(str(folder))
    assert "layers.0.block_sparse_moe.experts.0.w1.weight" in _stored_keys(folder.parent, folder.name)
    assert "layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    return model


def _on_meta(width: int = 32) -> tuple[Any, dict[str, Any]]:
    with torchferry.meta_parameters():
        meta = _mixtral(width).eval()
    declaration = topology.Declaration(block_attrs={"": ("layers",)})
    return meta, {"declaration": declaration, "device": "cpu", "strategy": "layerwise"}


@pytest.mark.slow
@pytest.mark.parametrize("host_memory", [None, 32 << 20])
def test_a_conversion_is_carried_out_as_transformers_loads_it(
    tmp_path: Path, host_memory: int | None
) -> None:
    """A checkpoint whose tensors transformers fuses on load (Mixtral's per-expert weights into one
    gate_up_proj) fills the module's fused tensors, in memory and, over a host budget, from the file
    tier, and the model runs as transformers' own load of the same folder, bit for bit."""
    width = 32 if host_memory is None else 512
    _mixtral_folder(tmp_path / "mixtral", width)
    loaded = fresh_storage(transformers.MixtralModel.from_pretrained(str(tmp_path / "mixtral")).eval())
    ids = torch.arange(2, 10).reshape(1, 8)
    with torch.no_grad():
        expected = loaded(input_ids=ids).last_hidden_state
    meta, options = _on_meta(width)
    with torchferry.offload(
        meta, checkpoint=str(tmp_path / "mixtral"), host_memory=host_memory, **options
    ) as session:
        with torch.no_grad():
            got = meta(input_ids=ids).last_hidden_state
        assert (session.report().file_packs > 0) == (host_memory is not None)
    assert torch.equal(got, expected)
    weights = loaded.state_dict()
    assert [k for k, v in meta.state_dict().items() if not torch.equal(v, weights[k])] == []


def test_a_conversion_that_cannot_be_carried_out_is_refused_by_name(tmp_path: Path) -> None:
    """A fused tensor one of whose stored parts is missing from the checkpoint (so the conversion makes
    the wrong shape) is refused before anything is read, naming the model class, the keys and the
    conversion."""
    _mixtral_folder(tmp_path / "mixtral")
    file = tmp_path / "mixtral" / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["layers.0.block_sparse_moe.experts.1.w2.weight"]
    save_file(tensors, str(file))
    meta, options = _on_meta()
    with pytest.raises(PlanError) as raised:
        torchferry.offload(meta, checkpoint=str(tmp_path / "mixtral"), **options)
    folder = tmp_path / "mixtral"
    assert str(raised.value) == (
        f"checkpoint {folder} cannot fill the expected tensors; 1 problem (nothing was read or changed):\n"
        f"  - {folder}: transformers MixtralModel makes 'layers.0.mlp.experts.down_proj' from the stored "
        "'layers.0.block_sparse_moe.experts.0.w2.weight' with MergeModulelist(dim=0) when it loads, which "
        "makes [1, 32, 64] of float32 where the model holds [2, 32, 64] of float32; load that model with "
        "MixtralModel.from_pretrained and keep its weights (offload it without checkpoint=)"
    )
    assert all(t.device.type == "meta" for t in meta.parameters())


def test_a_diffusers_legacy_single_file_reads_as_diffusers_loads_it(tmp_path: Path) -> None:
    """A VAE file whose attention block has its old names (``query``, ``proj_attn``), which diffusers
    renames when it loads one file, fills the module's ``to_q``... and equals diffusers' load."""
    config = {"block_out_channels": (8, 8), "norm_num_groups": 4, "latent_channels": 4}
    torch.manual_seed(0)
    diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, **config
    ).save_pretrained(str(tmp_path / "vae"))
    file = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    tensors = load_file(str(file))
    renamed = {
        re.sub(r"\.(to_q|to_k|to_v|to_out\.0)\.", lambda m: f".{old[m.group(1)]}.", k): v
        for k, v in tensors.items()
    }
    assert "encoder.mid_block.attentions.0.query.weight" in renamed
    save_file(renamed, str(file))
    loaded = diffusers.AutoencoderKL.from_pretrained(str(tmp_path / "vae")).eval()
    with torchferry.meta_parameters():
        meta = diffusers.AutoencoderKL.from_config(diffusers.AutoencoderKL.load_config(str(tmp_path / "vae")))
    with torchferry.offload(meta.eval(), strategy="layerwise", device="cpu", checkpoint=str(file)):
        weights = {k: v.clone() for k, v in meta.state_dict().items()}
    expected = loaded.state_dict()
    assert weights.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(weights[k], expected[k])] == []


@pytest.mark.slow
def test_plan_and_session_agree_on_a_folder_saved_under_other_names(tmp_path: Path) -> None:
    """Issue 39 item 4: ``plan FOLDER --host-memory X`` reads the folder's store facts through the key
    map the session reads them with (transformers' saved names), so both name one digest, the same
    host bytes (float32 tensors found under their saved names, not counted as widened) and reads."""
    import contextlib
    import io
    import json

    folder = tmp_path / "qwen"
    _save("QwenImagePipeline", folder, _LARGER)
    budget = 28 << 20
    argv = ["plan", str(folder), "--device", "cpu", "--device-memory", "8GiB", "--host-memory", f"{budget}B"]
    argv.append("--strategy")  # as the session on the CPU: no staging slot
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "layerwise", "--components", "text_encoder", "--format", "json"]) == 0
    host = json.loads(out.getvalue())["host"]
    with torchferry.from_pretrained(
        diffusers.QwenImagePipeline, folder, **_left_out("QwenImagePipeline"), strategy="layerwise",
        device="cpu", host_memory=budget, components=("text_encoder",),
    ) as session:  # fmt: skip
        report = session.report()
        widened = session.plan.facts.widened
    assert report.file_packs > 0 and not widened  # the folder is float32 throughout: nothing widens
    assert (host["plan_digest"], host["host_bytes"]) == (report.plan_digest, report.planned_host_bytes)
    assert host["file_read_bytes"] == dict(report.planned_read_bytes)
