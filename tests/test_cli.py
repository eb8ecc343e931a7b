"""The command line: ``torchferry plan`` and ``torchferry demo``, called in-process through ``main``."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import torchferry
from torchferry import policies, topology
from torchferry.cli import main
from torchferry.cli._demo_runs import ensure_checkpoint
from torchferry.testing import toy
from torchferry.topology import KNOWN_ALIASES, KNOWN_MODELS, known_topology

GIB = 1024**3


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)``'s exit status, stdout and stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, "plan", *argv, "--format", "json")
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def row(doc: dict[str, Any], strategy: str) -> dict[str, Any]:
    (found,) = [r for r in doc["strategies"] if r["strategy"] == strategy]
    return found


# ------------------------------------------------------------------------------------ plan: known ids

MODELS = ["wan2.2-t2v-a14b", "flux.1-dev", "qwen-image"]


@pytest.mark.parametrize("model", MODELS)
def test_plan_json_component_bytes_match_the_known_topology(
    capsys: pytest.CaptureFixture[str], model: str
) -> None:
    """Total and per-component bytes and block counts in the JSON equal known_topology's exactly."""
    doc = plan_json(capsys, model, "--device-memory", "24GiB")
    topo = known_topology(model)
    assert doc["torchferry_plan"] == 1
    assert doc["total_bytes"] == topo.nbytes
    assert [(c["path"], c["nbytes"], c["blocks"]) for c in doc["components"]] == [
        (c.path, c.nbytes, len(c.blocks)) for c in topo.components
    ]
    for c, comp in zip(doc["components"], topo.components, strict=True):
        assert c["rest_bytes"] + sum(b.nbytes for b in comp.blocks) == comp.nbytes


@pytest.mark.parametrize("model", MODELS)
def test_plan_recommendation_fits_the_budget(capsys: pytest.CaptureFixture[str], model: str) -> None:
    """At 24 GiB nothing fits resident; the recommended strategy's simulated peak fits, and is auto's."""
    doc = plan_json(capsys, model, "--device-memory", "24GiB")
    budget = 24 * GIB
    none = row(doc, "none")
    whole = topology.resolve(known_topology(model), topology.OffloadConfig(strategy="none"))
    # each component staged as one flat buffer: the weights and the padding that aligns them
    assert none["peak_device_bytes"] == sum(c.nbytes for c in whole.components)
    assert none["fits"] is False
    rec = doc["recommended"]
    assert rec == row(doc, "auto")
    assert rec["fits"] is True
    assert rec["peak_device_bytes"] <= budget
    assert rec["step_s"] >= rec["resident_step_s"] > 0
    assert [r["strategy"] for r in doc["strategies"]] == [
        "none",
        "model_level",
        "layerwise",
        "distributed_layerwise",
        "auto",
    ]


def test_plan_wan_peaks_and_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    """Wan2.2 A14B: model-level holds one expert and the VAE; the compute estimate is FLOPs over TFLOP/s."""
    doc = plan_json(capsys, "wan2.2-t2v-a14b", "--device-memory", "24GiB", "--tflops", "200")
    topo = known_topology("wan2.2-t2v-a14b")
    model_level = row(doc, "model_level")
    swapped = topology.resolve(topo, topology.OffloadConfig(strategy="model_level"))
    assert model_level["peak_device_bytes"] == (
        swapped.component("transformer").nbytes + swapped.component("vae").nbytes
    )
    assert model_level["fits"] is False
    known = topology.known_model("wan2.2-t2v-a14b")
    resident_step = sum(known.block_flops()) / 200e12 * known.forwards_per_step
    assert row(doc, "layerwise")["resident_step_s"] == pytest.approx(resident_step)
    assert doc["assumptions"]["forwards_per_step"] == 2
    # A 670 MiB block moves in 28 ms at 25 GB/s while it computes for over 0.8 s: streaming is free.
    assert row(doc, "layerwise")["overhead"] == pytest.approx(0.0, abs=1e-9)


def test_plan_model_level_row_pays_its_swaps(capsys: pytest.CaptureFixture[str]) -> None:
    """flux.1-dev at 24 GiB: the model-level row's step is the resident step plus the per-call swap of
    the transformer and T5 spread over the call's forwards (what auto weighs it by), not the resident
    step alone."""
    doc = plan_json(capsys, "flux.1-dev", "--device-memory", "24GiB", "--h2d", "25GB/s")
    level = row(doc, "model_level")
    swapped = topology.resolve(known_topology("flux.1-dev"), topology.OffloadConfig(strategy="model_level"))
    moved = sum(c.nbytes for c in swapped.components if c.path in ("transformer", "text_encoder_2"))
    calls = attrs.fields(policies.CostModel).forwards_per_call.default  # plan's forwards per call
    assert level["step_s"] > level["resident_step_s"]
    assert level["step_s"] - level["resident_step_s"] == pytest.approx(moved / 25e9 / calls, rel=0.02)


def test_plan_auto_row_that_chose_model_level_pays_its_swaps(capsys: pytest.CaptureFixture[str]) -> None:
    """Where auto chooses model-level swapping (Wan 2.2 at 32 GiB with 0.5 ms blocks), its row and the
    recommendation give the model-level row's step, swaps included, not the resident step."""
    doc = plan_json(capsys, "wan2.2-t2v-a14b", "--device-memory", "32GiB", "--block-ms", "0.5")
    auto, level = row(doc, "auto"), row(doc, "model_level")
    assert auto["policy"] == level["policy"] == "model_level()"
    assert auto["step_s"] == pytest.approx(level["step_s"]) and auto["step_s"] > 2 * auto["resident_step_s"]
    assert doc["recommended"]["step_s"] == pytest.approx(level["step_s"])


def test_plan_ignores_an_unreadable_saved_profile_it_needs_no_figure_from(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broken saved profile does not stop plan --device-class (no figure of it is used), and with
    --host-memory it is named as unreadable where its read rate would have come from."""
    saved = tmp_path / "profile.json"
    saved.write_text('{"torchferry_profile": 999}')
    monkeypatch.setenv("TORCHFERRY_PROFILE", str(saved))
    plan_json(capsys, "flux.1-dev", "--device-memory", "24GiB", "--device-class", "h100")
    code, out, err = run(capsys, "plan", "flux.1-dev", "--device-memory", "24GiB", "--device-class", "h100",
                         "--host-memory", "16GiB")  # fmt: skip
    assert code == 0, err
    assert f"the saved profile {saved} could not be read" in out


def test_plan_storage_dtype_plans_the_stored_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """``--storage-dtype float8_e4m3fn`` plans the DiTs' weights in float8: each bf16 Wan block's bytes
    halve (its norms' and tables' float32 stay), the encoder keeps its bytes, the report says so."""
    args = ("wan2.2-t2v-a14b", "--device-memory", "24GiB", "--strategy", "layerwise")
    full, stored = plan_json(capsys, *args), plan_json(capsys, *args, "--storage-dtype", "float8_e4m3fn")
    assert stored["assumptions"]["storage_dtype"] == "float8_e4m3fn"
    assert full["assumptions"]["storage_dtype"] is None
    by_path = {c["path"]: c for c in full["components"]}
    for c in stored["components"]:
        if c["kind"] == "dit":
            assert 0.45 < c["block_max_bytes"] / by_path[c["path"]]["block_max_bytes"] < 0.55
        else:
            assert c["nbytes"] == by_path[c["path"]]["nbytes"]
    assert row(stored, "layerwise")["peak_device_bytes"] < row(full, "layerwise")["peak_device_bytes"]
    code, out, _ = run(capsys, "plan", *args, "--storage-dtype", "float8_e4m3fn")
    assert code == 0 and "weights stored as float8_e4m3fn (--storage-dtype)" in out


def test_plan_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    """The text report names every component with its bytes, every strategy row and the recommendation."""
    code, out, err = run(capsys, "plan", "flux.1-dev", "--device-memory", "24GiB", "--block-ms", "10")
    assert code == 0, err
    topo = known_topology("flux.1-dev")
    assert f"total: {policies.format_bytes(topo.nbytes, exact=False)} ({topo.nbytes} bytes)" in out
    for c in topo.components:
        line = next(line for line in out.splitlines() if line.startswith(f"{c.path} "))
        assert policies.format_bytes(c.nbytes, exact=False) in line
    assert "57 x 270.1 MiB-648.2 MiB" in out
    assert "compute: 10 ms per block (given)" in out
    for name in ("none()", "model_level()", "layerwise(depth=1)", "distributed_layerwise(depth=1)", "auto: "):
        assert any(line.startswith(name) for line in out.splitlines()), name
    assert re.search(r"^recommended: layerwise\(depth=\d", out, re.MULTILINE)


def test_plan_single_strategy_and_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    """--strategy evaluates one row at --depth; --show-schedule prints that strategy's steady DiT step."""
    args = ["qwen-image", "--device-memory", "24GiB", "--strategy", "layerwise", "--depth", "2"]
    doc = plan_json(capsys, *args, "--show-schedule")
    assert [r["policy"] for r in doc["strategies"]] == ["layerwise(depth=2)"]
    assert doc["recommended"] is None
    schedule = policies.parse_schedule(doc["schedule"])
    assert schedule.policy == "layerwise(depth=2)"
    assert schedule.step.component == "transformer" and schedule.step.index == 1
    code, out, _ = run(capsys, "plan", *args, "--show-schedule")
    assert code == 0
    assert "# torchferry schedule v1" in out


def test_plan_world_size_lets_auto_pick_distributed(capsys: pytest.CaptureFixture[str]) -> None:
    """Transfer-bound Qwen-Image at 12 GB/s: with 4 ranks given, auto shares the copies and is faster."""
    common = ["qwen-image", "--device-memory", "24GiB", "--h2d", "12GB/s"]
    single = plan_json(capsys, *common)
    shared = plan_json(capsys, *common, "--world-size", "4")
    assert single["recommended"]["policy"].startswith("layerwise(")
    assert shared["recommended"]["policy"].startswith("distributed_layerwise(")
    assert shared["recommended"]["step_s"] < single["recommended"]["step_s"]
    assert shared["recommended"]["host_bytes_per_rank"] < single["recommended"]["host_bytes_per_rank"]


def test_plan_resolution_changes_compute(capsys: pytest.CaptureFixture[str]) -> None:
    """A smaller --resolution means fewer FLOPs per block, so a shorter resident step."""
    full = plan_json(capsys, "flux.1-dev", "--device-memory", "24GiB", "--strategy", "none")
    small = plan_json(
        capsys, "flux.1-dev", "--device-memory", "24GiB", "--strategy", "none", "--resolution", "512x512"
    )
    assert small["assumptions"]["resolution"] == {"height": 512, "width": 512, "frames": 1}
    assert small["strategies"][0]["resident_step_s"] < full["strategies"][0]["resident_step_s"] / 3


def test_plan_list(capsys: pytest.CaptureFixture[str]) -> None:
    """--list shows every known id and alias with its total size and hub ids, in text and JSON."""
    code, out, _ = run(capsys, "plan", "--list")
    assert code == 0
    text = out
    for model in (*KNOWN_MODELS, *KNOWN_ALIASES):
        line = next(line for line in out.splitlines() if line.startswith(model + " "))
        assert policies.format_bytes(known_topology(model).nbytes, exact=False) in line
    code, out, _ = run(capsys, "plan", "--list", "--format", "json")
    doc = json.loads(out)
    assert [m["id"] for m in doc["models"]] == [*KNOWN_MODELS, *KNOWN_ALIASES]
    assert all(m["total_bytes"] == known_topology(m["id"]).nbytes for m in doc["models"])
    hub = {m["id"]: m["hub_ids"] for m in doc["models"]}
    assert hub["flux.1-dev"] == ["black-forest-labs/FLUX.1-dev"]
    assert hub["wan2.2-t2v-a14b"] == ["Wan-AI/Wan2.2-T2V-A14B-Diffusers"]
    assert "Wan-AI/Wan2.2-T2V-A14B-Diffusers        wan2.2-t2v-a14b" in text


# ------------------------------------------------------------------------------------- plan: errors


def expect_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", message + "\n")


def test_unknown_id_lists_known_ids(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown id is one line naming every known id and alias, exit status 2."""
    expect_error(
        capsys,
        ["plan", "flux.2-dev", "--device-memory", "24GiB"],
        "torchferry plan: error: unknown model id 'flux.2-dev': torchferry knows "
        + ", ".join(KNOWN_MODELS)
        + "; aliases: ltx-video-2b-0.9.1 (ltx-video-2b), ltx-video-2b-0.9.5 (ltx-video-2b). "
        "Pass one of these ids or their hub ids (black-forest-labs/FLUX.1-dev; torchferry plan --list "
        "shows them), a diffusers pipeline folder, or a safetensors file, folder or *.index.json.",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--device-memory", "24 parsecs"],
            "argument --device-memory: cannot read '24 parsecs' as a size; write a number with a unit such "
            "as 24GiB, 80GB or 512MiB (see torchferry plan --help)",
        ),
        (
            ["--device-memory", "24GiB", "--h2d", "25GB"],
            "argument --h2d: cannot read '25GB' as a bandwidth; write a size per second such as 25GB/s "
            "(see torchferry plan --help)",
        ),
        (
            ["--device-memory", "24GiB", "--resolution", "1024"],
            "argument --resolution: cannot read '1024' as a resolution; write WIDTHxHEIGHT or "
            "WIDTHxHEIGHTxFRAMES, such as 1024x1024 or 1280x720x81 (see torchferry plan --help)",
        ),
        (
            ["--device-memory", "24GiB", "--depth", "0"],
            "argument --depth: '0' must be at least 1 (see torchferry plan --help)",
        ),
        ([], "plan needs --device-memory SIZE, the device budget (e.g. 24GiB)"),
        (
            ["--device-memory", "24"],
            "argument --device-memory: '24' has no unit; write 24GiB (binary) or 24GB (decimal) "
            "(see torchferry plan --help)",
        ),
        (
            ["--device-memory", "24GiB", "--block-ms", "5", "--tflops", "100"],
            "--block-ms and --tflops are two ways to set compute time; pass one of them",
        ),
    ],
)
def test_bad_options(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """A size, rate, resolution or depth that does not parse, or no budget, is one line and status 2."""
    expect_error(capsys, ["plan", "flux.1-dev", *argv], f"torchferry plan: error: {message}")


def test_missing_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A checkpoint path that does not exist is one line and status 2."""
    missing = tmp_path / "nope.safetensors"
    expect_error(
        capsys,
        ["plan", str(missing), "--device-memory", "24GiB"],
        f"torchferry plan: error: {missing}: no such checkpoint file or folder",
    )


def test_corrupt_header(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A checkpoint whose header is not JSON is one line naming the file, status 2."""
    path = tmp_path / "broken.safetensors"
    path.write_bytes((8).to_bytes(8, "little") + b"not json" + b"\0" * 16)
    expect_error(
        capsys,
        ["plan", str(path), "--device-memory", "24GiB"],
        f"torchferry plan: error: {path}: the safetensors header is not valid JSON "
        "(Expecting value: line 1 column 1 (char 0))",
    )


def test_unknown_hub_id(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub id neither known nor in the local cache is one line saying where it looked and what to do."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    expect_error(
        capsys,
        ["plan", "someone/some-model", "--device-memory", "24GiB"],
        f"torchferry plan: error: someone/some-model: no such checkpoint file or folder, nor a snapshot of "
        f"that hub repository in {tmp_path}; torchferry downloads nothing, so fetch it first "
        "(hf download someone/some-model) or pass a known id (torchferry plan --list)",
    )


def test_known_hub_id_plans_the_known_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A known model's hub id, not in the local cache, plans exactly as its known id does."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    by_hub = plan_json(capsys, "black-forest-labs/FLUX.1-dev", "--device-memory", "24GiB")
    by_id = plan_json(capsys, "flux.1-dev", "--device-memory", "24GiB")
    assert by_hub["source"] == by_id["source"] == "known:flux.1-dev"
    assert by_hub["components"] == by_id["components"]
    assert by_hub["strategies"] == by_id["strategies"]
    assert by_hub["assumptions"]["fits_counts"] == "weights only (no activations, no VAE decode)"


def test_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    """No command is one line and status 2."""
    expect_error(
        capsys, [], "torchferry: error: the following arguments are required: COMMAND (see torchferry --help)"
    )


# --------------------------------------------------------------------------------- plan: checkpoints


def write_sparse(path: Path, tensors: dict[str, tuple[int, ...]]) -> None:
    """A bf16 safetensors file whose data region is a sparse hole (nothing real to read)."""
    header: dict[str, object] = {}
    offset = 0
    for name, shape in tensors.items():
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little"))
        handle.write(raw)
        handle.truncate(8 + len(raw) + offset)


def wan_like_folder(folder: Path, blocks: int = 40, shards: int = 4) -> int:
    """A 60 GiB DiT in ``shards`` files plus an index: 1.5 GiB blocks named ``blocks.<i>.*``."""
    folder.mkdir()
    width = 16384
    per = blocks // shards
    weight_map: dict[str, str] = {}
    for s in range(shards):
        tensors: dict[str, tuple[int, ...]] = {}
        if s == 0:
            tensors["patch_embedding.weight"] = (width, 64)
        for i in range(s * per, (s + 1) * per):
            for part in ("attn.qkv", "ffn.up", "ffn.down"):
                tensors[f"blocks.{i}.{part}.weight"] = (width, width)
        name = f"model-{s:05d}-of-{shards:05d}.safetensors"
        write_sparse(folder / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return width * 64 * 2 + blocks * 3 * width * width * 2


def test_plan_sixty_gigabyte_folder_in_well_under_a_second(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A 60 GiB sharded checkpoint plans from headers alone, blocks found, in well under a second."""
    folder = tmp_path / "dit"
    total = wan_like_folder(folder)
    start = time.perf_counter()
    argv = ("--device-memory", "24GiB", "--block-ms", "50", "--components", "dit")
    doc = plan_json(capsys, str(folder), *argv)
    # Reading the 60 GiB would take tens of seconds; the bound is loose so a loaded machine passes.
    assert time.perf_counter() - start < 10.0
    assert doc["total_bytes"] == total
    (dit,) = doc["components"]
    assert (dit["path"], dit["kind"], dit["blocks"]) == ("", "dit", 40)
    assert dit["block_min_bytes"] == dit["block_max_bytes"] == 3 * 16384 * 16384 * 2
    assert row(doc, "model_level")["applicable"] is False
    assert row(doc, "model_level")["error"] == (
        f"model_level offload with explicit components swaps the DiT against an encoder stage, but the "
        f"checkpoint {folder} has no encoder component; plan a checkpoint that holds the whole pipeline (a "
        "diffusers pipeline folder)"
    )
    assert doc["recommended"]["fits"] is True
    assert doc["recommended"]["peak_device_bytes"] <= 24 * GIB
    # Through the index the same checkpoint plans the same.
    again = plan_json(
        capsys, str(folder / "model.safetensors.index.json"), "--device-memory", "24GiB", "--block-ms", "50"
    )
    assert again["components"] == doc["components"]
    assert again["recommended"] == doc["recommended"]


def test_plan_checkpoint_block_attrs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Two numbered block lists are both found, shorter name first; --block-attrs overrides the guess."""
    path = tmp_path / "flux-like.safetensors"
    tensors: dict[str, tuple[int, ...]] = {"x_embedder.weight": (64, 64)}
    tensors |= {f"single_transformer_blocks.{i}.linear.weight": (64, 64) for i in range(3)}
    tensors |= {f"transformer_blocks.{i}.ff.net.0.proj.weight": (64, 128) for i in range(2)}
    write_sparse(path, tensors)
    doc = plan_json(
        capsys, str(path), "--device-memory", "1GiB", "--strategy", "layerwise", "--show-schedule"
    )
    assert doc["components"][0]["blocks"] == 5
    ring = policies.parse_schedule(doc["schedule"])
    loads = [op.unit for op in ring.ops if op.kind == "wait" and "blocks" in op.unit]
    assert loads[:2] == ["transformer_blocks.0", "transformer_blocks.1"]
    only = plan_json(capsys, str(path), "--device-memory", "1GiB", "--block-attrs", "transformer_blocks")
    assert only["components"][0]["blocks"] == 2


def test_block_attrs_that_find_nothing_are_told_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`plan CKPT --block-attrs nope` warns in flags (``--block-attrs blocks``), never the API's
    ``declaration=Declaration(...)``, and an explicit layerwise request's refusal is in flags too."""
    path = tmp_path / "dit.safetensors"
    write_sparse(path, {f"blocks.{i}.w.weight": (64, 64) for i in range(3)} | {"head.weight": (8, 64)})
    doc = plan_json(capsys, str(path), "--device-memory", "1GiB", "--block-attrs", "nope")
    hint = (
        "; for example pass --block-attrs blocks listing the block lists (or single blocks) in the order "
        "its forward runs them"
    )
    assert (
        "layerwise: DiT '' (its class) has no streamable blocks; it is not offloaded and stays "
        + (f"resident{hint}")
        in doc["warnings"]
    )
    assert not [w for w in doc["warnings"] if "declaration=" in w or "Declaration(" in w]
    argv = (
        "--device-memory",
        "1GiB",
        "--block-attrs",
        "nope",
        "--strategy",
        "layerwise",
        "--components",
        "dit",
    )
    refused = plan_json(capsys, str(path), *argv)
    assert row(refused, "layerwise")["error"] == (
        "Selected DiT '' (its class) has no streamable blocks; declare them with its "
        f"class._layerwise_offload_blocks_attrs or --block-attrs{hint}"
    )


def test_plan_predicts_the_peak_the_runtime_measures(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Planned from the demo checkpoint's headers, each strategy's peak is what a session measures,
    less the one buffer a checkpoint does not hold."""
    path, _ = ensure_checkpoint(tmp_path)
    argv = ("--device-memory", "20MiB", "--block-ms", "1", "--components", "dit,text_encoder")
    doc = plan_json(capsys, str(path), *argv)  # the selection the sessions below are given
    assert [(c["path"], c["kind"], c["blocks"]) for c in doc["components"]] == [
        ("transformer", "dit", 12),
        ("text_encoder", "encoder", 4),
        ("vae", "vae", 0),
    ]
    weights = path.stat().st_size - 8 - int.from_bytes(path.read_bytes()[:8], "little")
    whole = topology.resolve(topology.from_checkpoint(path), topology.OffloadConfig(strategy="none"))
    assert sum(t.nbytes for c in whole.components for t in c.all_tensors()) == weights
    assert row(doc, "none")["peak_device_bytes"] == sum(c.nbytes for c in whole.components)
    for strategy, options in [
        ("model_level", {}),
        ("layerwise", {"prefetch_depth": 1}),
    ]:
        pipeline = toy.build_empty(hidden=256, blocks=12, encoder_blocks=4)
        with torchferry.offload(
            pipeline,
            strategy=strategy,
            device="cpu",
            components={"dit", "text_encoder"},
            checkpoint=str(path),
            **options,
        ) as session:
            pipeline("a cat", steps=2)
            measured = session.peak_device_bytes
            live = session.plan.component("transformer")
        # The one difference: the DiT's non-persistent ``freqs`` buffer (128 fp32), in no checkpoint,
        # packed into the DiT's remainder buffer; the checkpoint lists tensors in another order, so
        # the alignment padding (under 256 bytes a tensor, see topology.pack) may differ too.
        rest = [t for t in live.tensors if t.name != "transformer.freqs"]
        assert sum(t.nbytes for t in live.tensors) - sum(t.nbytes for t in rest) == 128 * 4
        gap = measured - row(doc, strategy)["peak_device_bytes"] - 128 * 4
        assert abs(gap) < topology.PACK_ALIGN * len(live.tensors), strategy
    assert row(doc, "auto")["fits"] is True


# -------------------------------------------------------------------------------------------- demo


def test_demo_table_says_how_sure_each_figure_is() -> None:
    """The table shows each strategy's fastest and median step; an overhead inside the noise (the
    spreads, or the resident run's drift between its two timings) is marked (noise), and a strategy
    measured faster than resident, as on a busy machine, is marked and explained, not hidden."""
    from torchferry.cli._demo_output import format_table, noise_notes
    from torchferry.cli._demo_runs import DemoRow

    rows = [
        DemoRow(
            strategy="resident (no offload)", peak_device_bytes=35 << 20, step_s=0.01323, median_s=0.0172
        ),
        DemoRow(strategy="model_level", peak_device_bytes=31 << 20, step_s=0.0135, median_s=0.0139),
        DemoRow(strategy="layerwise(depth=1)", peak_device_bytes=6 << 20, step_s=0.0125, median_s=0.0245),
        DemoRow(strategy="layerwise(depth=2)", peak_device_bytes=9 << 20, step_s=0.0320, median_s=0.0330),
    ]
    rows[1:] = [attrs.evolve(r, identical=True) for r in rows[1:]]
    text = format_table(rows, 0.01323).splitlines()
    assert [re.split(r"\s{2,}", line.strip()) for line in text] == [
        ["strategy", "peak device", "fastest", "median", "overhead", "outputs identical"],
        ["resident (no offload)", "35.0 MiB", "13.23 ms", "17.20 ms", "-", "(reference)"],
        ["model_level", "31.0 MiB", "13.50 ms", "13.90 ms", "+2.0% (noise)", "yes"],
        ["layerwise(depth=1)", "6.0 MiB", "12.50 ms", "24.50 ms", "-5.5% (noise)", "yes"],
        ["layerwise(depth=2)", "9.0 MiB", "32.00 ms", "33.00 ms", "+142%", "yes"],
    ]
    assert noise_notes(rows, 0.01323) == [
        "model_level: +2.0% is within the noise (the resident run's median is 30% above its fastest, this "
        "run's 3%, and the resident run moved 0% between its two timings): this machine could not tell its "
        "cost from none",
        "layerwise(depth=1): measured 5.5% faster than resident, which offloading cannot be (it only adds "
        "work): noise (the resident run's median is 30% above its fastest, this run's 96%, and the resident "
        "run moved 0% between its two timings)",
    ]
    drifting = [attrs.evolve(rows[0], median_s=0.0133, drift=1.5), rows[3]]  # it moved by 150%
    assert format_table(drifting, 0.01323).splitlines()[2].endswith("+142% (noise)  yes")


def test_demo_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The demo runs every strategy from the cached checkpoint, all outputs identical, and draws one step
    of the distributed run simulated above the same step measured."""
    svg = tmp_path / "step.svg"
    code, out, err = run(
        capsys,
        "demo",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--steps",
        "2",
        "--calls",
        "2",
        "--timeline",
        str(svg),
    )
    assert code == 0, out + err
    lines = out.splitlines()
    header = ["strategy", "peak", "device", "fastest", "median", "overhead", "outputs", "identical"]
    assert lines[0].split() == header
    rows = {line.split("  ")[0]: line for line in lines[1:6]}
    assert list(rows) == [
        "resident (no offload)",
        "model_level",
        "layerwise(depth=1)",
        "layerwise(depth=2)",
        "distributed_layerwise(depth=1), 2 ranks",
    ]
    assert rows["resident (no offload)"].endswith("(reference)")
    assert all(line.endswith("  yes") for name, line in rows.items() if name != "resident (no offload)")
    assert "checkpoint written" in err and "resident:" in err and "starting 2 local processes" in err
    peak = {name: re.split(r"\s{2,}", line)[1] for name, line in rows.items()}
    assert peak["resident (no offload)"] == "35.3 MiB"  # every weight of the demo toy
    mib = {name: float(value.removesuffix(" MiB")) for name, value in peak.items()}
    assert mib["layerwise(depth=1)"] < mib["layerwise(depth=2)"] < mib["model_level"] < 35.3
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    panels = [g for g in root.iter(f"{ns}g") if g.get("class") == "panel"]
    assert len(panels) == 2
    for panel, heading in zip(
        panels,
        ["simulated (policies.simulate under a cost model)", "measured on cpu (synchronous copies), rank 0"],
        strict=True,
    ):
        texts = [t.text for t in panel.iter(f"{ns}text")]
        assert texts[0] == heading
        assert {"copy (H2D)", "comm (all-gather)", "compute"} <= set(texts)
        fills = {r.get("fill") for r in panel.iter(f"{ns}rect")}
        assert {"#4c78a8", "#f58518", "#54a24b"} <= fills
        bars = [t.text or "" for t in panel.iter(f"{ns}title")]
        # one steady step: the 12 blocks' computes, and a shard copy and an all-gather for each
        for kind in ("compute", "load", "gather"):
            assert len({b.split(":")[0] for b in bars if b.startswith(f"{kind} transformer.blocks.")}) == 12
    note = " ".join(t.text or "" for t in panels[1].iter(f"{ns}text"))
    assert "host clock" in note and "in 12 copies" in note and "in 12 all-gathers" in note


def test_demo_device_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A device that is not one, or CUDA where there is none, is one line and status 2."""
    expect_error(
        capsys,
        ["demo", "--device", "warp9"],
        "torchferry demo: error: argument --device: 'warp9' is not a device; write cpu, cuda or cuda:N "
        "(see torchferry demo --help)",
    )
    if torch.cuda.is_available():  # the second message is about machines without CUDA
        return
    expect_error(
        capsys,
        ["demo", "--device", "cuda", "--cache-dir", str(tmp_path)],
        "torchferry demo: error: --device cuda: CUDA is not available here; use --device cpu",
    )


def test_demo_checkpoint_is_written_once(tmp_path: Path) -> None:
    """The checkpoint is written on first use, reused after, and rewritten when it is corrupt."""
    path, written = ensure_checkpoint(tmp_path)
    assert written and path.parent == tmp_path
    stamp = path.stat().st_mtime_ns
    assert ensure_checkpoint(tmp_path) == (path, False)
    assert path.stat().st_mtime_ns == stamp
    path.write_bytes(b"broken")
    assert ensure_checkpoint(tmp_path) == (path, True)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_simulated_timeline_accounts_for_the_step() -> None:
    """The timeline's computes sum to the resident makespan, its stalls to the stall total, and its last
    interval ends at the makespan; every all-gather starts after its shard's copy ends."""
    topo = topology.discover(toy.build(0))
    config = topology.OffloadConfig(
        strategy="distributed_layerwise",
        components={"dit", "text_encoder"},
        parallel=topology.ParallelLayout(data_parallel_size=2),
    )
    plan = topology.resolve(topo, config)
    policy = policies.distributed_layerwise(1)
    first = policy(plan, policies.Step(component="transformer"))
    steady = policy(plan, policies.Step(component="transformer", index=1, entry=first.exit))
    # Copies slower than compute, so the compute stream stalls.
    report = policies.simulate(steady, policies.CostModel(h2d_bytes_per_s=1e6, block_s=0.001))
    timeline = report.timeline
    assert {i.stream for i in timeline} == {"copy", "comm", "compute"}
    computes = [i for i in timeline if i.kind == "compute"]
    stalls = [i for i in timeline if i.kind == "stall"]
    assert len(computes) == 9  # the component and its 8 blocks
    assert sum(i.end_s - i.start_s for i in computes) == pytest.approx(report.resident_makespan_s)
    assert report.total_stall_s > 0
    assert sum(i.end_s - i.start_s for i in stalls) == pytest.approx(report.total_stall_s)
    assert max(i.end_s for i in timeline) == pytest.approx(report.makespan_s)
    copied = {i.label: i.end_s for i in timeline if i.kind == "load"}
    gathers = [i for i in timeline if i.kind == "gather"]
    assert gathers and all(g.start_s >= copied[g.label] for g in gathers)
    for stream in ("copy", "comm", "compute"):
        spans = sorted((i.start_s, i.end_s) for i in timeline if i.stream == stream)
        assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(spans)), stream


# ---------------------------------------------------------------------------------- entry points


def test_python_dash_m_help() -> None:
    """``python -m torchferry --help`` prints both commands and exits 0."""
    done = subprocess.run(
        [sys.executable, "-m", "torchferry", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "demo" in done.stdout and "plan" in done.stdout


def test_console_script_is_main() -> None:
    """The installed ``torchferry`` console script points at ``torchferry.cli:main``."""
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "torchferry"]
    assert script.value == "torchferry.cli:main"
    assert script.load() is main


# ------------------------------------------------------------------------------ probe and device figures


def test_probe_saves_a_profile_that_plan_reads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`torchferry probe` measures the CPU, says so and which device and machine it measured, and
    saves a profile that `plan` leaves out by default (its plans are for GPUs: a CPU profile made every
    plan a CPU plan) and uses when given with --profile; a saved GPU profile is used by default."""
    from torchferry.runtime import host_name

    where = tmp_path / "profile.json"
    monkeypatch.setenv("TORCHFERRY_PROFILE", str(where))
    code, out, err = run(capsys, "probe", "--device", "cpu", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["saved_to"] == str(where) and doc["torchferry_profile"] == 1
    assert doc["measured"] == f"this machine's CPU (--device cpu), on {host_name()}"
    assert doc["used_by"].startswith("sessions on this machine's CPU; `torchferry plan` plans for GPUs")
    saved = policies.DeviceProfile.from_json(json.loads(where.read_text()))
    assert (saved.name, saved.dtype, saved.device, saved.host) == ("cpu", "float32", "cpu", host_name())
    assert saved.h2d_bytes_per_s > 1e8 and saved.flops_per_s > 1e9
    assert saved.source.startswith("measured on cpu (cpu) by torchferry probe, ")
    plan = plan_json(capsys, "qwen-image", "--device-memory", "24GiB")
    assert plan["assumptions"]["h2d_bytes_per_s"] == policies.DEFAULT_DEVICE.h2d_bytes_per_s
    assert plan["assumptions"]["device"]["source"] == (
        f"{policies.DEFAULT_DEVICE.source}; the saved profile {where}'s device figures were not used: it "
        "holds CPU figures; "
        "pass --profile to plan with them, or --device-class cpu"
    )
    given = plan_json(capsys, "qwen-image", "--device-memory", "24GiB", "--profile", str(where))
    assert given["assumptions"]["h2d_bytes_per_s"] == saved.h2d_bytes_per_s
    assert given["assumptions"]["device"]["source"] == saved.source
    faster = plan_json(
        capsys, "qwen-image", "--device-memory", "24GiB", "--h2d", "30GB/s", "--profile", str(where)
    )
    assert faster["assumptions"]["h2d_bytes_per_s"] == 30e9  # a figure given beats the profile's
    if not torch.cuda.is_available():  # a GPU profile saved elsewhere plans for that GPU
        gpu = attrs.evolve(saved, name="NVIDIA H200", device="cuda", h2d_bytes_per_s=5e10, dtype="bfloat16")
        where.write_text(json.dumps(gpu.to_json()))
        assumed = plan_json(capsys, "qwen-image", "--device-memory", "24GiB")["assumptions"]
        assert assumed["h2d_bytes_per_s"] == 5e10 and assumed["device"]["name"] == "NVIDIA H200"


def test_probe_says_what_it_measured(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The text form of probe opens with the device it measured, and says what will use the figures."""
    from torchferry.runtime import host_name

    code, out, err = run(capsys, "probe", "--device", "cpu", "--output", str(tmp_path / "p.json"))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"measured: this machine's CPU (--device cpu), on {host_name()}"
    assert lines[1].startswith("host-to-device (a host memcpy): ")
    assert lines[2].startswith("matmul (float32): ")
    assert lines[3] == (
        "used by: sessions on this machine's CPU; `torchferry plan` plans for GPUs and leaves CPU "
        "figures out unless given with --profile FILE"
    )
    assert lines[4] == f"saved to {tmp_path / 'p.json'}"


def test_plan_device_class_sets_bandwidth_and_compute(capsys: pytest.CaptureFixture[str]) -> None:
    """--device-class h100 assumes PCIe Gen5 and H100-class bf16; the default is the RTX 4090-class guess."""
    h100 = plan_json(capsys, "qwen-image", "--device-memory", "24GiB", "--device-class", "h100")
    default = plan_json(capsys, "qwen-image", "--device-memory", "24GiB")
    assert (h100["assumptions"]["h2d_bytes_per_s"], default["assumptions"]["h2d_bytes_per_s"]) == (55e9, 25e9)
    assert default["assumptions"]["collective_bytes_per_s"] == 100e9
    assert row(h100, "layerwise")["resident_step_s"] == pytest.approx(
        row(default, "layerwise")["resident_step_s"] * 150 / 600
    )


def test_plan_for_a_named_gpu_takes_the_figures_a_session_on_it_starts_from(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39 (S6): with no saved profile, plan --device-name "NVIDIA H100 80GB HBM3" assumes the H100
    class, the figures `policies.device_profile` gives a session on that GPU; a saved profile of that
    GPU on this machine is used, one of another GPU is left out saying why; --device-name with
    --device-class is two sources."""
    from torchferry.runtime import host_name

    where = tmp_path / "profile.json"
    monkeypatch.setenv("TORCHFERRY_PROFILE", str(where))
    name = "NVIDIA H100 80GB HBM3"
    facts = policies.DeviceFacts(type="cuda", name=name, machine=host_name())
    doc = plan_json(capsys, "qwen-image", "--device-memory", "24GiB", "--device-name", name)
    assert policies.device_profile(facts)[0] == policies.DEVICE_CLASSES["h100"]
    assert doc["assumptions"]["device"]["name"] == "h100" and doc["assumptions"]["h2d_bytes_per_s"] == 55e9
    saved = attrs.evolve(policies.DEVICE_CLASSES["h100"], name=name, h2d_bytes_per_s=4e10, device="cuda",
                         host=host_name(), source="measured here")  # fmt: skip
    where.write_text(json.dumps(saved.to_json()))
    doc = plan_json(capsys, "qwen-image", "--device-memory", "24GiB", "--device-name", name)
    assert doc["assumptions"]["h2d_bytes_per_s"] == 4e10
    a100 = "NVIDIA A100-SXM4-80GB"
    doc = plan_json(capsys, "qwen-image", "--device-memory", "24GiB", "--device-name", a100)
    assert doc["assumptions"]["h2d_bytes_per_s"] == 25e9
    assert doc["assumptions"]["device"]["source"] == (
        f"{policies.DEVICE_CLASSES['a100'].source}; the saved profile {where}'s device figures were not "
        f"used: it was measured on {name}, and this device is NVIDIA A100-SXM4-80GB; probe this one"
    )
    code, out, err = run(capsys, "plan", "qwen-image", "--device-memory", "24GiB", "--device-class", "h100",
                         "--device-name", name)  # fmt: skip
    assert (code, out) == (2, "")
    assert err == (
        "torchferry plan: error: --device-class and --device-name are two sources of device figures; "
        "pass one of them\n"
    )


def test_plan_auto_is_the_chooser_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """--strategy auto reports policies.choose's choice for the layerwise plan, with its reason."""
    doc = plan_json(
        capsys, "qwen-image", "--device-memory", "24GiB", "--strategy", "auto", "--forwards-per-step", "2"
    )
    (auto,) = doc["strategies"]
    plan = topology.resolve(
        known_topology("qwen-image"),
        topology.OffloadConfig(strategy="layerwise", components={"dit", "text_encoder"}),
    )
    cost = policies.estimate_cost(plan.topology, topology.known_model("qwen-image"), forwards_per_step=2)
    choice = policies.choose(plan, 24 * GIB, cost)
    assert auto["policy"] == choice.policy().name
    assert auto["reason"] == choice.reason
    assert doc["assumptions"]["forwards_per_step"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "plan",
                "qwen-image",
                "--device-memory",
                "24GiB",
                "--device-class",
                "h100",
                "--profile",
                "p.json",
            ],
            "torchferry plan: error: --device-class and --profile are two sources of device figures; "
            "pass one of them",
        ),
        (
            ["plan", "qwen-image", "--device-memory", "24GiB", "--profile", "/nonexistent/p.json"],
            "torchferry plan: error: --profile /nonexistent/p.json: no such file; write one with "
            "`torchferry probe --output FILE`",
        ),
    ],
)
def test_plan_device_figure_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """Conflicting or missing sources of device figures are one-line usage errors."""
    assert run(capsys, *argv) == (2, "", message + "\n")


def test_a_damaged_profile_says_to_probe_again(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A profile file that is not a profile names the file and the command that writes a new one."""
    bad = tmp_path / "p.json"
    bad.write_text('{"torchferry_profile": 99}')
    code, out, err = run(capsys, "plan", "qwen-image", "--device-memory", "24GiB", "--profile", str(bad))
    assert (code, out) == (2, "")
    assert err == (
        f"torchferry plan: error: profile {bad} is not a torchferry profile of version 1; "
        "write a new one with `torchferry probe`\n"
    )


def test_help_names_values_as_the_docs_do(capsys: pytest.CaptureFixture[str]) -> None:
    """plan --help shows --depth N, --world-size N, --block-ms MS and that a session's host default
    differs from plan's; probe --help shows the device forms and --min-bytes."""
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("[--depth N]", "[--world-size N]", "[--tflops TFLOPS]", "[--block-ms MS]"):
        assert shown in text
    assert "a session's default is this machine's available memory" in text
    assert main(["probe", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "[--device cpu|cuda|cuda:N]" in text and "[--min-bytes SIZE]" in text
