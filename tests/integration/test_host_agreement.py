"""`torchferry plan FOLDER --host-memory X --format json` and the session opened from that folder with
``host_memory=X`` are one host planner: over small saved pipelines (sharded, float32-kept modules
stored in bf16), a grid of budgets, each strategy, with and without ``storage_dtype=``, they name the
same file-tier packs, host bytes, read bytes per forward, call and session, and plan digest, both with
a session's default selection and with ``components=`` given (``--components``); and a refusal's least
budget opens while one byte less is refused."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import torchferry
from torchferry import policies
from torchferry.cli._main import main
from torchferry.testing import toy

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning"),
]

MiB = 1 << 20


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Saved Wan pipelines: ``sharded`` (float32 in 4 MB shards) and ``bf16`` (its float32-kept
    modules widened on read), each built the first time a case asks for it."""

    class Lazy(dict[str, Path]):
        def __missing__(self, kind: str) -> Path:
            path = tmp_path_factory.mktemp(kind) / "wan"
            pipe = toy.wan_pipeline(layers=4, heads=4, head_dim=64, ffn_dim=1024)
            if kind == "bf16":
                pipe.to(torch.bfloat16)
                pipe.save_pretrained(str(path))
            else:
                pipe.save_pretrained(str(path), max_shard_size="4MB")
            self[kind] = path
            return path

    return Lazy()


Selection = frozenset[str] | None


def _plan(folder: Path, strategy: str, budget: int, dtype: str | None, select: Selection) -> dict[str, Any]:
    argv = ["plan", str(folder), "--device", "cpu", "--device-memory", "8GiB", "--host-memory", f"{budget}B"]
    argv += ["--strategy", strategy, "--format", "json", *(["--storage-dtype", dtype] if dtype else [])]
    argv += ["--components", ",".join(sorted(select))] if select else []
    argv += ["--world-size", "1"] if strategy == "distributed_layerwise" else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    doc: dict[str, Any] = json.loads(out.getvalue())
    return doc


@pytest.fixture
def world_of_one(tmp_path: Path) -> Any:
    """A gloo process group of one rank, which the distributed strategy all-gathers over."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _open(folder: Path, strategy: str, budget: int, dtype: str | None, select: Selection) -> Any:
    """The session's report, or its refusal (`policies.HostBudgetTooSmall`)."""
    options: dict[str, Any] = {} if dtype is None else {"storage_dtype": dtype}
    if select is not None:
        options["components"] = set(select)
    bf16 = folder.parent.name.startswith("bf16")
    if bf16:
        options["torch_dtype"] = torch.bfloat16
    try:
        session = torchferry.from_pretrained(
            diffusers.WanPipeline, folder, strategy=strategy, device="cpu", host_memory=budget, **options
        )
    except policies.HostBudgetTooSmall as refused:
        return refused
    with session:
        return session.report()


def _whole(folder: Path) -> int:
    doc = _plan(folder, "layerwise", 1 << 40, None, None)
    total: int = doc["host"]["host_bytes"]
    return total


BOTH = frozenset({"dit", "text_encoder"})
#: (folder, strategy, storage dtype, selection): each strategy and each selection on both folders,
#: ``storage_dtype=`` and ``model_level`` with both selections on one.
GRID = [
    ("sharded", "layerwise", None, None),
    ("sharded", "layerwise", None, BOTH),
    ("sharded", "none", None, None),
    ("sharded", "model_level", None, BOTH),
    ("bf16", "layerwise", None, None),
    ("bf16", "none", None, None),
    ("bf16", "model_level", None, None),
    ("bf16", "model_level", None, BOTH),
    ("bf16", "layerwise", "bfloat16", None),
    ("bf16", "layerwise", "bfloat16", BOTH),
]


@pytest.mark.parametrize(("kind", "strategy", "dtype", "select"), GRID)
def test_plan_and_session_agree_on_the_host_figure(
    folders: dict[str, Path], kind: str, strategy: str, dtype: str | None, select: Selection
) -> None:
    """At budgets from under the file tier's least to over the whole store, plan and session agree on
    tiers, host bytes, reads by how often and digest, or refuse alike, naming a least that opens."""
    _agree(folders[kind], strategy, dtype, select)


@pytest.mark.parametrize(("kind", "select"), [("sharded", None), ("bf16", BOTH)])
def test_distributed_plan_and_session_agree_on_the_host_figure(
    folders: dict[str, Path], kind: str, select: Selection, world_of_one: Any
) -> None:
    """The same for ``distributed_layerwise`` over a gloo group of one rank (``--world-size 1``)."""
    _agree(folders[kind], "distributed_layerwise", None, select)


def test_a_cpu_plan_counts_no_staging_slot_as_the_cpu_session_does(tmp_path: Path) -> None:
    """Two blocks of 10 MiB in 17 MiB of host memory: `plan --device cpu` counts no staging slot (the
    reader fills the CPU device's slots itself), opens, and names the session's file tier and host
    bytes; `--device cuda` counts two 10 MiB staging slots and refuses the same budget, naming 22.5 MiB."""
    folder = tmp_path / "wan"
    toy.wan_pipeline(layers=2, heads=4, head_dim=64, ffn_dim=4096).save_pretrained(str(folder))
    budget = 17 * MiB
    cpu = _plan(folder, "layerwise", budget, None, None)["host"]
    got = _open(folder, "layerwise", budget, None, None)
    assert cpu["staging_slot_bytes"] == [] and cpu["file_packs"]
    assert not isinstance(got, policies.HostBudgetTooSmall)
    assert got.planned_host_bytes == cpu["host_bytes"] <= budget
    assert (got.plan_digest, got.file_pack_names) == (cpu["plan_digest"], tuple(cpu["file_packs"]))
    argv = ["plan", str(folder), "--device", "cuda", "--device-memory", "8GiB", "--host-memory", f"{budget}B"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--strategy", "layerwise", "--format", "json"]) == 0
    refused = json.loads(out.getvalue())["strategies"][0]["error"]
    assert "the file tier would need more (staging slots as large as the largest pack read)" in refused
    assert refused.endswith("pass --host-memory 22.5MiB or more")


def _agree(folder: Path, strategy: str, dtype: str | None, select: Selection) -> None:
    whole = _whole(folder)
    refusals = []
    for budget in (whole // 2, whole * 4 // 5, whole + MiB):
        doc = _plan(folder, strategy, budget, dtype, select)
        row = doc["strategies"][0]
        got = _open(folder, strategy, budget, dtype, select)
        if isinstance(got, policies.HostBudgetTooSmall):
            assert row["error"] == got.message("cli")
            refusals.append(got)
            continue
        host = doc["host"]
        assert (got.plan_digest, got.file_pack_names) == (host["plan_digest"], tuple(host["file_packs"]))
        assert got.planned_host_bytes == host["host_bytes"] <= budget
        assert dict(got.planned_read_bytes) == host["file_read_bytes"]
    for refused in refusals[:1]:
        least = refused.minimum
        assert not isinstance(_open(folder, strategy, least, dtype, select), policies.HostBudgetTooSmall)
        assert isinstance(_open(folder, strategy, least - 1, dtype, select), policies.HostBudgetTooSmall)
