"""Whole diffusers pipelines, built tiny, run bit-identical in all six ways a user runs them.

Each pipeline class of `pipeline_zoo` runs plainly, then under `offload` (layerwise depth 1,
model_level, and auto with a device budget below the pipeline's bytes), then from its
`save_pretrained` folder through `torchferry.from_pretrained`, with and without a host budget that
leaves packs in the folder's files. Every output equals the plain run's bit for bit, every weight is
bit-identical after close, and every module the pipeline lists is managed. The cases marked ``full``
run only with ``TORCHFERRY_ZOO_FULL=1`` (the ``zoo_full`` marker; see docs/pipelines.md for the time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pipeline_zoo as zoo
import pytest
import torch
from torch import nn

import torchferry
from torchferry import policies, topology

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

# The models' own warnings on CPU and the pipelines' deprecations (not torchferry's, which stay errors).
pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*requires torchvision:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn.t accept a copy:DeprecationWarning"),
]


def _cases(folder: bool) -> list[Any]:
    params = []
    for name, case in zoo.CASES.items():
        marks: list[Any] = [pytest.mark.zoo_full] if case.full else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def _same(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], step: str) -> None:
    assert len(got) == len(expected), step
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{step}: output {i} differs"


def _same_weights(pipe: Any, before: dict[str, torch.Tensor], step: str) -> None:
    after = zoo.weights(pipe)
    assert after.keys() == before.keys(), step
    changed = [k for k, t in before.items() if not torch.equal(after[k], t)]
    assert not changed, f"{step}: {len(changed)} weight(s) changed, first {changed[:3]}"


def _managed(pipe: Any) -> None:
    """Every module the pipeline lists is a managed component; the rest are stated with a reason."""
    topo = topology.discover(pipe)
    paths = {c.path for c in topo.components}
    for name, value in pipe.components.items():
        if isinstance(value, nn.Module):
            assert name in paths, f"{name} ({type(value).__name__}) is not managed: {topo.unmanaged}"
        else:
            assert name in dict(topo.unmanaged), name


@pytest.mark.parametrize("name", _cases(folder=False))
def test_pipeline_runs_bit_identical_in_memory(name: str) -> None:
    """Plain, layerwise depth 1, model_level and auto runs of the pipeline give the same tensors, and
    every weight is bit-identical after each session closes."""
    pipe = zoo.built(name)
    _managed(pipe)
    before = zoo.weights(pipe)
    expected = zoo.call(name, pipe)
    budget = topology.discover(pipe).nbytes - 1  # below the whole pipeline: auto must stream
    runs: dict[str, dict[str, Any]] = {
        "layerwise": {"strategy": "layerwise", "prefetch_depth": 1},
        "model_level": {"strategy": "model_level"},
        "auto": {"device_memory": budget},
    }
    for step, options in runs.items():
        with torchferry.offload(pipe, device="cpu", **options):
            got = zoo.call(name, pipe)
        _same(got, expected, step)
        _same_weights(pipe, before, step)


@pytest.mark.parametrize("name", _cases(folder=True))
def test_pipeline_runs_bit_identical_from_its_folder(name: str, tmp_path: Path) -> None:
    """from_pretrained of the pipeline's save_pretrained folder, alone and with a host budget that
    leaves packs in the folder's files, gives the plain run's tensors bit for bit."""
    pipe = zoo.built(name)
    expected = zoo.call(name, pipe)
    folder = tmp_path / name
    pipe.save_pretrained(str(folder))
    cls = type(pipe)
    with torchferry.from_pretrained(cls, folder, strategy="layerwise", device="cpu") as session:
        _managed(session.pipeline)
        _same(zoo.call(name, session.pipeline), expected, "from_pretrained")
    # The least host budget that opens (the refusal of one byte names it), every encoder streaming too:
    # packs beyond it stay in the folder's files and are read on demand.
    options: dict[str, Any] = {"strategy": "layerwise", "device": "cpu"}
    options["components"] = {"dit", "text_encoder"}
    with pytest.raises(policies.HostBudgetTooSmall) as refused:
        torchferry.from_pretrained(cls, folder, host_memory=1, **options)
    budget = refused.value.minimum
    with torchferry.from_pretrained(cls, folder, host_memory=budget, **options) as session:
        got = zoo.call(name, session.pipeline)
        report = session.report()
        assert report.peak_host_bytes <= budget
        # Where the file tier pays (its slots and read buffers take less than the packs it leaves in
        # the files), packs are read from the folder; otherwise every pack is in host memory.
        assert bool(report.file_pack_names) == refused.value.file_tier == (report.file_read_bytes > 0)
    _same(got, expected, "from_pretrained with a host budget")
