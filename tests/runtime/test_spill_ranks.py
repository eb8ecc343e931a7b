"""Two gloo ranks opening a pipeline built in memory with the file tier: a rank whose host check or
spill fails fails every rank (each its own error, none left waiting), and ranks spilling into one
folder do not clobber each other's files."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import torchferry
from torchferry import OffloadWarning
from torchferry.testing import run_ranks, toy

pytestmark = pytest.mark.dist

HIDDEN = 512
MiB = 1 << 20
BUDGET = 44 * MiB


def _open(rank: int, world: int, folders: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Open the toy with the file tier spilled into this rank's folder (rank 1 with ``env`` set in its
    environment); the error, or what it saw."""
    if rank == 1 and env:
        os.environ.update(env)
    ref = toy.build(0, hidden=HIDDEN)
    with torch.no_grad():
        want = ref("a cat", steps=2)
    pipe = toy.build(0, hidden=HIDDEN)
    try:
        session = torchferry.offload(
            pipe, strategy="distributed_layerwise", device="cpu", host_memory=BUDGET, spill=folders[rank]
        )
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    try:
        files = sorted(Path(folders[rank]).glob("spill-*.safetensors"))
        opened = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in files}
        with torch.no_grad():
            same = bool(torch.equal(pipe("a cat", steps=2), want))
        later = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in files}
        return {"error": None, "same": same, "opened": opened, "later": later}
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)
            session.close()


def test_a_rank_that_cannot_spill_fails_every_rank(tmp_path: Path) -> None:
    """Rank 1's spill folder cannot be created: it raises its own PlanError and rank 0 an
    ExecutionError naming rank 1, both promptly (the group's timeout is never reached)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    folders = [str(tmp_path / "spill0"), str(blocker / "spill1")]
    results = run_ranks(_open, 2, folders, timeout=150, group_timeout=120)
    assert results[1]["error"] == "PlanError", results[1]
    assert "cannot create the folder" in results[1]["message"]
    assert results[0]["error"] == "ExecutionError", results[0]
    named = "rank(s) 1 of the 2-rank weight-shard group could not prepare the spill folder"
    assert named in results[0]["message"]
    assert not (tmp_path / "spill0").exists() or not any((tmp_path / "spill0").iterdir())


def test_a_refusal_of_one_rank_alone_fails_every_rank(tmp_path: Path) -> None:
    """Rank 1 alone reads a read mode no reader knows (its own TORCHFERRY_READ): it raises its own
    PlanError and rank 0 an ExecutionError naming rank 1 and the step, promptly (not the group's
    timeout, nor a raw gloo error in the next collective), with no spill written on either."""
    folders = [str(tmp_path / "spill0"), str(tmp_path / "spill1")]
    results = run_ranks(_open, 2, folders, {"TORCHFERRY_READ": "sideways"}, timeout=150, group_timeout=120)
    assert results[1]["error"] == "PlanError", results[1]
    assert "TORCHFERRY_READ='sideways' is no read mode" in results[1]["message"]
    assert results[0]["error"] == "ExecutionError", results[0]
    assert "rank(s) 1 of the 2-rank weight-shard group could not plan the session" in results[0]["message"]
    assert not any((tmp_path / f"spill{r}").exists() for r in (0, 1))


def test_ranks_spilling_into_one_folder_keep_one_set_of_files(tmp_path: Path) -> None:
    """Two ranks with one spill folder: rank 0 writes, rank 1 keeps its files (same inodes on both
    ranks, before and after a call), nothing temporary is left, and both run bit-identical."""
    folder = str(tmp_path / "spill")
    results = run_ranks(_open, 2, [folder, folder], timeout=240)
    for rank, seen in enumerate(results):
        assert seen["error"] is None, (rank, seen)
        assert seen["same"], rank
        assert seen["opened"] and seen["opened"] == seen["later"], rank
    assert results[0]["opened"] == results[1]["opened"]
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]
