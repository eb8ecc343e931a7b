"""Components come from the pipeline: every module it lists is managed, or stated unmanaged and refused
when it would stay off the session's device; library names resolve as diffusers resolves them."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, ClassVar

import pipeline_zoo as zoo
import pytest
import torch
from tiny import Model
from torch import nn

import torchferry
from torchferry import PlanError, topology
from torchferry.load._pretrained import _class
from torchferry.topology import FolderComponent

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:.*requires torchvision:UserWarning")


class Declared:
    """A pipeline declaring its lists, whose ``components`` also lists an image encoder they leave out,
    and a ControlNet-like module it declares resident."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = ["controlnet"]

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.transformer = Model()
        self.image_encoder = nn.Linear(4, 4)
        self.controlnet = nn.Linear(4, 4)
        self.tokenizer = None

    @property
    def components(self) -> dict[str, Any]:
        return {
            "transformer": self.transformer,
            "image_encoder": self.image_encoder,
            "controlnet": self.controlnet,
            "tokenizer": None,
        }


def test_wan_image_to_video_manages_its_image_encoder() -> None:
    """The registry's Wan image-to-video pipeline manages the image encoder it lists beside its own
    entries, and states every other component with the reason it is left where it is."""
    topo = topology.discover(zoo.built("WanImageToVideoPipeline"))
    assert [(c.path, c.kind) for c in topo.components] == [
        ("transformer", "dit"),
        ("text_encoder", "encoder"),
        ("image_encoder", "encoder"),
        ("vae", "vae"),
    ]
    assert topo.unmanaged == (
        ("tokenizer", "absent (None)"),
        ("scheduler", "a FlowMatchEulerDiscreteScheduler, which holds no module weights"),
        ("image_processor", "a CLIPImageProcessorPil, which holds no module weights"),
        ("transformer_2", "absent (None)"),
    )


def test_a_module_left_off_the_session_device_is_refused_naming_it() -> None:
    """A listed module the declared lists leave out, on the host while the session's device is another
    (meta stands for a GPU here), is refused by name before anything moves."""
    pipe = Declared()
    topo = topology.discover(pipe)
    assert topo.unmanaged == (
        ("image_encoder", "a torch.nn.modules.linear.Linear its declared component lists leave out"),
        ("tokenizer", "absent (None)"),
    )
    before = pipe.image_encoder.weight.detach().clone()
    message = (
        "test_pipeline_components.Declared: 1 component(s) torchferry does not manage would stay off the "
        "session's device meta and receive its tensors: 'image_encoder' (a torch.nn.modules.linear.Linear "
        "its declared component lists leave out) holds tensors on cpu; list each in the pipeline's "
        "_dit_modules/_encoder_modules/_vae_modules/_resident_modules, or move it to meta yourself before "
        "offload()"
    )
    with pytest.raises(PlanError, match=f"^{re.escape(message)}$"):
        torchferry.offload(pipe, strategy="layerwise", device="meta")
    assert torch.equal(pipe.image_encoder.weight, before)
    with torchferry.offload(pipe, strategy="layerwise", device="cpu"):  # on its own device it may stay
        pass


@pytest.mark.parametrize(
    "options", [{"strategy": "layerwise"}, {"device_memory": "1MiB"}], ids=["layerwise", "auto"]
)
def test_a_resident_component_on_the_host_runs_on_the_session_device(options: dict[str, Any]) -> None:
    """A resident component (declared, or a pipeline-local module such as LTX-2's connectors) on the
    host is staged whole to the session's device (meta stands for a GPU here) when its forward runs,
    and is back on the host, bit-identical, after close."""
    pipe = Declared()
    pipe.image_encoder = pipe.controlnet  # listed twice: managed as the resident controlnet
    before = pipe.controlnet.weight.detach().clone()
    seen: list[torch.device] = []
    hook = pipe.controlnet.register_forward_pre_hook(lambda m, _: seen.append(m.weight.device))
    with torchferry.offload(pipe, device="meta", **options):
        out = pipe.controlnet(torch.zeros(1, 4, device="meta"))
    hook.remove()
    assert seen == [torch.device("meta")] and out.device == torch.device("meta")
    assert pipe.controlnet.weight.device == torch.device("cpu")
    assert torch.equal(pipe.controlnet.weight, before)


def test_a_folders_pipeline_local_components_fill_from_their_files(tmp_path: Path) -> None:
    """LTX-2's pipeline-local ``connectors`` and ``vocoder`` (resident components), built on meta by
    from_pretrained, fill from the folder's files and run bit-exact as the saved pipeline's."""
    pipe = zoo.built("LTX2Pipeline")
    pipe.save_pretrained(str(tmp_path))
    seeded = torch.Generator().manual_seed(2)
    embeds, mel = torch.randn(1, 8, 48, generator=seeded), torch.randn(1, 2, 4, 8, generator=seeded)

    def run(p: Any) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return (*p.connectors(embeds, zoo.MASK), p.vocoder(mel))

    expected = run(pipe)
    cls = type(pipe)
    with torchferry.from_pretrained(cls, tmp_path, strategy="layerwise", device="cpu") as session:
        kinds = {c.path: c.kind for c in session.plan.components}
        assert (kinds["connectors"], kinds["vocoder"]) == ("resident", "resident")
        got = run(session.pipeline)
    assert [torch.equal(a, b) for a, b in zip(got, expected, strict=True)] == [True] * 4


def test_a_pipeline_local_library_resolves_to_its_diffusers_pipelines_module(tmp_path: Path) -> None:
    """LTX-2's ``["ltx2", "LTX2Vocoder"]`` is diffusers.pipelines.ltx2's class; a library that is
    neither loadable nor imported is refused with the fix, never imported."""
    vocoder = FolderComponent(
        name="vocoder",
        library="ltx2",
        class_name="LTX2Vocoder",
        index_class="LTX2Vocoder",
        folder=tmp_path / "vocoder",
        source=None,
    )
    assert _class(vocoder) is diffusers.pipelines.ltx2.LTX2Vocoder
    assert "not_imported_lib" not in sys.modules
    stray = FolderComponent(
        name="vocoder",
        library="not_imported_lib",
        class_name="Vocoder",
        index_class="Vocoder",
        folder=tmp_path / "vocoder",
        source=None,
    )
    message = (
        "component 'vocoder' is a not_imported_lib.Vocoder, and not_imported_lib is neither a library "
        "diffusers loads components from (diffusers, transformers) nor one of its pipeline modules; "
        "import not_imported_lib before from_pretrained if it is your own module, or pass the component "
        "yourself (from_pretrained(..., vocoder=...))"
    )
    with pytest.raises(PlanError, match=f"^{re.escape(message)}$"):
        _class(stray)


def _pipeline_classes() -> list[type]:
    return [
        cls
        for name in sorted(dir(diffusers))
        if isinstance(cls := getattr(diffusers, name, None), type)
        and issubclass(cls, diffusers.DiffusionPipeline)
        and cls is not diffusers.DiffusionPipeline
    ]


def test_every_diffusers_pipeline_class_has_each_listed_module_managed() -> None:
    """For every pipeline class diffusers exports, built with a module at each model component its
    ``__init__`` and ``_optional_components`` name (None at schedulers, tokenizers, processors), every
    module it lists is a managed component and every other entry is stated with a reason."""
    skip = ("scheduler", "tokenizer", "processor", "feature_extractor", "guider")
    checked, left = 0, []
    for cls in _pipeline_classes():
        expected, _ = cls._get_signature_keys(cls)
        names = sorted(set(expected) | set(getattr(cls, "_optional_components", None) or ()))
        pipe = object.__new__(cls)
        pipe.register_modules(**{k: None if any(w in k for w in skip) else nn.Linear(2, 2) for k in names})
        try:
            listed = pipe.components
        except ValueError:  # LEditsPP's __init__ takes a value its components property cannot list
            continue
        topo = topology.discover(pipe)
        managed = {c.path for c in topo.components}
        stated = dict(topo.unmanaged)
        checked += 1
        for name, value in listed.items():
            if isinstance(value, nn.Module) and name not in managed:
                left.append(f"{cls.__name__}.{name}")
            elif not isinstance(value, nn.Module) and name not in stated:
                left.append(f"{cls.__name__}.{name} (not stated)")
    assert left == []
    assert checked >= 290
