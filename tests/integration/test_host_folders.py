"""`from_pretrained` of a diffusers pipeline folder larger than the host budget: the packs that do not
fit are read from the folder's own safetensors (the file tier), and it runs as diffusers' load does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import torchferry
from torchferry import topology
from torchferry.testing import toy

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _wan(layers: int = 8) -> Any:
    """A Wan pipeline whose transformer blocks hold 4.2 MiB each (so the file tier pays)."""
    return toy.wan_pipeline(layers=layers, heads=4, head_dim=64, ffn_dim=1024)


def test_from_pretrained_a_folder_larger_than_the_host_budget(tmp_path: Path) -> None:
    """A pipeline folder of ~35 MiB opened with host_memory=28MiB: most transformer blocks stay in the
    folder's files, read on demand, and the frames equal those of the pipeline in memory."""
    folder = tmp_path / "wan"
    ref = _wan()
    ref.save_pretrained(str(folder))
    expected = toy.run_wan(ref)
    total = topology.from_checkpoint(folder).nbytes
    budget = 28 << 20
    assert total > budget
    with torchferry.from_pretrained(
        diffusers.WanPipeline, folder, strategy="layerwise", device="cpu", host_memory=budget
    ) as session:
        got = toy.run_wan(session.pipeline)
        report = session.report()
        assert report.file_packs > 0 and report.peak_host_bytes <= budget
        assert session.engine.store.tier is not None
        files = {c.file for r in session.engine.store.tier.reads.values() for c in r.chunks}
        assert files and all(Path(f).is_relative_to(folder) for f in files)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
