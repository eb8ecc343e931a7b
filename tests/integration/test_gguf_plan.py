"""What a GGUF model costs beyond its bytes, in `torchferry plan` and in the session alike: each
GGUFLinear dequantizes its weight at every call (compute time, on a CPU, and a temporary that must
fit beside the weights on the device; policies/_dequantize.py)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

import torchferry
from torchferry import policies, topology
from torchferry.topology import read_gguf

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")

import gguf_files  # noqa: E402 (needs the gguf package)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the 3-block Wan file under its original names and the model's config.json."""
    where = tmp_path_factory.mktemp("gguf-plan")
    gguf_files.write(where / "wan.gguf", gguf_files.wan(), original=True)
    shutil.copy(gguf_files.config_folder(where / "config") / "config.json", where / "config.json")
    return where


def _expected_reserve(path: Path, compute: str = "float32") -> int:
    """The largest temporary, from the header alone: per quantized weight, the larger of the
    dequantize's measured peak and its result (float32 for BF16, float16 for the rest) plus the cast."""
    size = torch.tensor([], dtype=getattr(torch, compute)).element_size()
    worst = 0
    for e in read_gguf(path):
        if not e.quantized:
            continue
        numel = 1
        for d in e.logical_shape:
            numel *= d
        made = 4 if e.quant_type == "BF16" else 2
        held = made + (size if size != made else 0)
        worst = max(worst, math.ceil(numel * max(policies.DEQUANTIZE_PEAK_BYTES[e.quant_type], held)))
    return worst


def test_discover_reads_what_each_gguf_linear_dequantizes(folder: Path) -> None:
    """Every GGUFParameter weight of diffusers' own GGUF load is marked with its quant type, logical
    values and compute dtype; every other tensor is not."""
    model = diffusers.WanTransformer3DModel.from_single_file(
        str(folder / "wan.gguf"),
        config=str(folder),
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
    )
    topo = topology.discover(model)
    marked = {t.name: t.dequantized for c in topo.components for t in c.all_tensors() if t.dequantized}
    params = dict(model.named_parameters())
    quantized = {n for n, p in params.items() if hasattr(p, "quant_type")}
    assert set(marked) == quantized and len(quantized) == 33
    for name, d in marked.items():
        assert d is not None and d.quant_type == params[name].quant_type.name and d.dtype == "bfloat16"
        assert d.numel == model.get_submodule(name.removesuffix(".weight")).in_features * (
            model.get_submodule(name.removesuffix(".weight")).out_features
        )
    assert policies.dequantize_reserve(topo) == _expected_reserve(folder / "wan.gguf", "bfloat16")


def test_plan_counts_the_dequantize_time_and_temporary(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchferry plan` of the .gguf on a CPU adds each block's dequantize to its compute (the
    measured CPU rates) and counts the largest dequantized weight in every row's peak."""
    from torchferry.cli import main

    reserve = _expected_reserve(folder / "wan.gguf")
    argv = ["plan", str(folder), "--device-memory", "8MiB", "--device-class", "cpu"]
    assert main([*argv, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (
        doc["assumptions"]["dequantize_bytes"] == reserve == 1536 * 256 * 8
    )  # time_projection.1: the BF16 dequantize peak
    assert "dequantize" in doc["assumptions"]["compute"]
    gpu = ["plan", str(folder), "--device-memory", "8MiB", "--device-class", "h100", "--format", "json"]
    assert main(gpu) == 0
    assert "dequantize" not in json.loads(capsys.readouterr().out)["assumptions"]["compute"]
    # each row's peak is the simulated schedules' peak plus the reserve
    from torchferry.cli._plan_input import load_model

    topo, _ = load_model(str(folder))
    plan = topology.resolve(topo, topology.OffloadConfig(strategy="layerwise"))
    cost = policies.estimate_cost(topo, device=policies.DEVICE_CLASSES["cpu"])
    dit = plan.components[0].path
    steady = policies.layerwise(depth=1)(plan, policies.Step(component=dit, index=0))
    row = next(r for r in doc["strategies"] if r["strategy"] == "layerwise")
    assert row["peak_device_bytes"] == policies.simulate(steady, cost).peak_device_bytes + reserve
    # the compute estimate holds each block's dequantize at the measured rates
    block = plan.components[0].blocks[0]
    rates = policies.DEQUANTIZE_VALUES_PER_S
    added = sum(t.dequantized.numel / rates[t.dequantized.quant_type] for t in block.tensors if t.dequantized)
    assert cost.compute_seconds(block.path, block=True) == pytest.approx(policies.CostModel().block_s + added)
    assert main([*argv]) == 0
    assert "the largest dequantized GGUF weight, 3.0 MiB" in capsys.readouterr().out


def test_the_session_plans_with_the_same_reserve(folder: Path) -> None:
    """A session on the .gguf with a device budget gives its schedules that budget less the largest
    dequantized weight, the figure `torchferry plan` counts, and runs exactly."""
    budget = 8 << 20
    path = folder / "wan.gguf"
    reference = gguf_files.call(
        diffusers.WanTransformer3DModel.from_single_file(
            str(path), config=str(folder), quantization_config=diffusers.GGUFQuantizationConfig()
        )
    )
    with torchferry.from_single_file(
        diffusers.WanTransformer3DModel, path, config=folder, device="cpu", device_memory=budget
    ) as session:
        assert torch.equal(gguf_files.call(session.pipeline), reference)
        report = session.report()
        reserve = policies.dequantize_reserve(session.plan)
        assert reserve == _expected_reserve(path)
        assert report.budget == session.plan.config.device_memory_bytes == budget - reserve
        assert "less 3.0 MiB (3145728) for the largest dequantized weight" in report.budget_source
        assert session.schedules and session.peak_device_bytes <= budget - reserve
        for schedule in session.schedules.values():
            policies.check(schedule, session.plan)  # invariant 4 against the budget less the reserve
    with torchferry.from_single_file(
        diffusers.WanTransformer3DModel,
        path,
        config=folder,
        device="cpu",
        device_memory=budget,
        strategy="layerwise",
    ) as named:  # a strategy the caller named says the same of its budget
        assert torch.equal(gguf_files.call(named.pipeline), reference)
        said = named.report().budget_source
        assert said == "given, less 3.0 MiB (3145728) for the largest dequantized weight"


def test_plan_finds_the_gguf_of_a_hub_id_in_the_cache(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchferry plan org/name` reads the .gguf (and config.json) of that repository's snapshot in
    the hub cache (files linked to blobs, as huggingface_hub writes them), offline, as the folder."""
    from torchferry.cli import main

    cache = tmp_path / "hub"
    repo = cache / "models--org--wan-gguf"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    for name in ("wan.gguf", "config.json"):
        shutil.copy(folder / name, repo / "blobs" / name)
        (snapshot / name).symlink_to(repo / "blobs" / name)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    argv = ["--device-memory", "8MiB", "--format", "json"]
    assert main(["plan", str(folder), *argv]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(["plan", "org/wan-gguf", *argv]) == 0
    hub = json.loads(capsys.readouterr().out)
    assert hub["source"] == f"gguf:{snapshot / 'wan.gguf'}"
    assert hub["components"] == local["components"] and hub["strategies"] == local["strategies"]


def test_plan_with_the_compute_dtype_of_the_session(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`torchferry plan --compute-dtype bfloat16` builds the layers as from_single_file(compute_dtype=
    torch.bfloat16) does, so it counts the temporary that session sets aside; on a model that is not
    GGUF the option is refused."""
    from torchferry.cli import main

    argv = ["plan", str(folder), "--device-memory", "8MiB", "--format", "json", "--compute-dtype", "bfloat16"]
    assert main(argv) == 0
    planned = json.loads(capsys.readouterr().out)["assumptions"]["dequantize_bytes"]
    with torchferry.from_single_file(
        diffusers.WanTransformer3DModel, folder / "wan.gguf", config=folder, device="cpu",
        compute_dtype=torch.bfloat16, device_memory=8 << 20,
    ) as session:  # fmt: skip
        reserve = policies.dequantize_reserve(session.plan)
        assert session.plan.config.device_memory_bytes == policies.weight_budget(session.plan, 8 << 20)
    assert planned == reserve == _expected_reserve(folder / "wan.gguf", "bfloat16")
    assert main(["plan", "wan2.1-t2v-1.3b", "--device-memory", "4GiB", "--compute-dtype", "bfloat16"]) == 2
    assert "--compute-dtype is the compute dtype of a GGUF model's layers" in capsys.readouterr().err


def test_plan_refuses_a_config_the_file_does_not_fill(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchferry plan` of a .gguf beside a config.json it does not fill (more layers than its
    blocks, another ffn_dim, a Wan config beside a FLUX file) refuses as the session does, by the same
    check, in one line naming the config.json, with status 2."""
    import gguf_flux

    from torchferry.cli import main

    cases = {
        "layers": (
            gguf_files.WAN_GGUF | {"num_layers": 16},
            "config field num_layers gives 16 blocks, and the file's longest numbered list, blocks, holds 3",
        ),
        "ffn": (
            gguf_files.WAN_GGUF | {"ffn_dim": 512},
            "tensor 'blocks.0.ffn.net.0.proj.weight': the file's shape is [256, 256], the configuration's "
            "[512, 256] (config field ffn_dim gives 512; the file has 256)",
        ),
        "flux": (
            gguf_files.WAN_GGUF,
            "it holds none of its tensors: they are named as FluxTransformer2DModel",
        ),
    }
    for name, (config, problem) in cases.items():
        where = tmp_path / name
        gguf_files.config_folder(where, config)
        if name == "flux":
            gguf_flux.write(where / "wan.gguf", gguf_flux.flux())
        else:
            shutil.copy(folder / "wan.gguf", where / "wan.gguf")
        assert main(["plan", str(where), "--device-memory", "8MiB"]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if "torchferry" in line]
        assert len(lines) == 1 and problem in lines[0], lines
        assert lines[0].startswith(f"torchferry plan: error: {where / 'wan.gguf'} does not fill the ")
        assert lines[0].endswith(
            "; put the config.json of the model the file was made from beside it, or remove it to infer "
            "the configuration from the file"
        )
        with pytest.raises(torchferry.PlanError, match=re.escape(problem)):  # the session: same check
            torchferry.from_single_file(
                diffusers.WanTransformer3DModel, where / "wan.gguf", config=where, device="cpu"
            )


@pytest.mark.slow
def test_plan_and_session_agree_on_a_gguf_wherever_it_lies(tmp_path: Path) -> None:
    """Issue 39 items 2-4: `plan FILE.gguf --host-memory X` in two folders and the session on the file
    name one digest (the location takes no part), the same host bytes (the biases the file stores in
    16 bits counted as kept, read through the key map), and the bytes a call reads, as measured."""
    from torchferry.cli._main import main

    config = {**gguf_files.WAN_GGUF, "num_layers": 12}
    first, second = tmp_path / "a", tmp_path / "b" / "c"
    first.mkdir()
    gguf_files.write(first / "wan.gguf", gguf_files.wan(config), original=True)
    shutil.copy(gguf_files.config_folder(tmp_path / "config", config) / "config.json", first / "config.json")
    shutil.copytree(first, second)
    budget = 6_000_000
    docs = []
    for where in (first, second):
        argv = ["plan", str(where / "wan.gguf"), "--device", "cpu", "--device-memory", "8GiB"]
        argv += ["--host-memory", f"{budget}B"]  # as the session on the CPU: no staging slot
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*argv, "--strategy", "layerwise", "--format", "json"]) == 0
        docs.append(json.loads(out.getvalue())["host"])
    with torchferry.from_single_file(
        diffusers.WanTransformer3DModel, first / "wan.gguf", config=first, device="cpu", host_memory=budget,
        strategy="layerwise",
    ) as session:  # fmt: skip
        report = session.report()
        gguf_files.call(session.pipeline)
        read = session.report().file_read_bytes
    for host in docs:
        assert (host["plan_digest"], host["host_bytes"]) == (report.plan_digest, report.planned_host_bytes)
        assert host["file_read_bytes"] == dict(report.planned_read_bytes)
    assert report.file_packs and read == report.planned_read_bytes["forward"] > 0
