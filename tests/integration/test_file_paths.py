"""`from_pretrained` of a pipeline folder named by a relative path: resolved once, at open, so a change
of the working directory afterwards changes nothing of what the file tier reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torchferry
from torchferry import topology
from torchferry.testing import toy

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_from_pretrained_of_a_relative_folder_survives_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline folder opened by a relative name with a file tier runs bit-identical after the working
    directory changes, and its file tier reads absolute file names."""
    ref = toy.wan_pipeline(layers=8, heads=4, head_dim=64, ffn_dim=1024)
    ref.save_pretrained(str(tmp_path / "wan"))
    expected = toy.run_wan(ref)
    budget = 28 << 20
    assert topology.from_checkpoint(tmp_path / "wan").nbytes > budget
    monkeypatch.chdir(tmp_path)
    with torchferry.from_pretrained(
        diffusers.WanPipeline, "wan", strategy="layerwise", device="cpu", host_memory=budget
    ) as session:
        assert session.report().file_packs > 0
        monkeypatch.chdir(tmp_path / "wan")  # "wan" now names nothing
        got = toy.run_wan(session.pipeline)
        tier = session.engine.store.tier
        assert tier is not None
        assert all(os.path.isabs(c.file) for r in tier.reads.values() for c in r.chunks)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
