"""`discover`: components, rings, children and tensor ownership read from real (tiny) modules."""

from __future__ import annotations

import re
from typing import ClassVar

import pytest
import torch
from topology_toys import (
    DiT,
    DualDiT,
    Encoder,
    LegacyPipeline,
    LifecycleEncoder,
    Pipeline,
    StubEncoder,
    Vae,
    names,
)
from torch import nn

from torchferry import OffloadWarning, PlanError, TorchferryDeprecationWarning
from torchferry.topology import (
    DTYPE_SIZES,
    Declaration,
    SupportsComponentDiscovery,
    TensorSpec,
    Topology,
    discover,
)

LEGACY_MESSAGE = (
    "{cls} does not declare its components; torchferry found them by scanning well-known attribute "
    "names, which is deprecated. Declare _dit_modules, _encoder_modules and _vae_modules (see "
    "torchferry.topology.SupportsComponentDiscovery)"
)


def _every_name(topology: Topology) -> list[str]:
    return [t.name for c in topology.components for t in c.all_tensors()]


def test_declared_pipeline_components_in_kind_order() -> None:
    """A declaring plain object yields its DiT, encoder and VAE, in that order, with one ring of blocks."""
    topo = discover(Pipeline())
    assert [(c.path, c.kind, c.class_name) for c in topo.components] == [
        ("transformer", "dit", "DiT"),
        ("text_encoder", "encoder", "Encoder"),
        ("vae", "vae", "Vae"),
    ]
    assert topo.declares_components
    assert topo.pipeline_class == "topology_toys.Pipeline"
    (stack,) = topo.component("transformer").stacks
    assert stack.attrs == ("blocks",)
    assert [b.path for b in stack.blocks] == [
        "transformer.blocks.0",
        "transformer.blocks.1",
        "transformer.blocks.2",
    ]
    assert names(stack.blocks[1].tensors) == [
        "transformer.blocks.1.attn.weight",
        "transformer.blocks.1.attn.bias",
        "transformer.blocks.1.norm.weight",
        "transformer.blocks.1.norm.bias",
    ]
    assert names(topo.component("transformer").tensors) == [
        "transformer.freqs",
        "transformer.embed.weight",
        "transformer.embed.bias",
    ]


def test_protocol_is_runtime_checkable() -> None:
    """`SupportsComponentDiscovery` recognises objects with the three class lists and nothing else."""
    assert isinstance(Pipeline(), SupportsComponentDiscovery)
    assert not isinstance(LegacyPipeline(), SupportsComponentDiscovery)
    assert not isinstance(nn.Linear(1, 1), SupportsComponentDiscovery)


def test_tensor_specs_record_dtype_shape_and_persistence() -> None:
    """Specs carry dtype names without the torch prefix, shapes, and the buffer's persistent flag."""
    dit = DiT().to(torch.bfloat16)
    dit.register_buffer("table", torch.zeros(2, 3))
    topo = discover(dit)
    by_name = {t.name: t for t in topo.components[0].tensors}
    assert by_name["freqs"] == TensorSpec(
        name="freqs", shape=(4,), dtype="bfloat16", buffer=True, persistent=False
    )
    assert by_name["table"] == TensorSpec(
        name="table", shape=(2, 3), dtype="float32", buffer=True, persistent=True
    )
    assert by_name["embed.weight"].nbytes == 32


def test_bare_model_is_one_dit_at_the_root() -> None:
    """A module whose class declares block attributes is itself the one DiT, with path ''."""
    topo = discover(DiT(blocks=2))
    (component,) = topo.components
    assert component.path == ""
    assert component.kind == "dit"
    assert [b.path for b in component.blocks] == ["blocks.0", "blocks.1"]
    assert names(component.tensors) == ["freqs", "embed.weight", "embed.bias"]


def test_multi_attribute_ring_concatenates_in_order() -> None:
    """Several block attributes form one ring, attribute by attribute, in declaration order."""
    topo = discover(DualDiT())
    (stack,) = topo.components[0].stacks
    assert stack.attrs == ("double", "single")
    assert [b.path for b in stack.blocks] == ["double.0", "double.1", "single.0", "single.1", "single.2"]


def test_dotted_block_attribute() -> None:
    """A dotted block attribute reaches a block list nested inside a submodule."""

    class Nested(nn.Module):
        _layerwise_offload_blocks_attrs = ("body.layers",)

        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Module()
            self.body.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.head = nn.Linear(2, 2)

    topo = discover(Nested())
    assert [b.path for b in topo.components[0].blocks] == ["body.layers.0", "body.layers.1"]
    assert names(topo.components[0].tensors) == ["head.weight", "head.bias"]


def test_declaration_block_attrs_override_class_attribute() -> None:
    """`Declaration.block_attrs[path]` wins over the model class's own block attributes."""
    pipeline = Pipeline(plan=Declaration(block_attrs={"transformer": ("blocks.0.attn",)}))
    topo = discover(pipeline)
    (stack,) = topo.component("transformer").stacks
    assert stack.attrs == ("blocks.0.attn",)
    assert [b.path for b in stack.blocks] == ["transformer.blocks.0.attn"]


def test_singular_block_attribute_is_deprecated_once_per_class() -> None:
    """The singular `_layerwise_offload_blocks_attr` still works and warns once per class."""

    class Old(nn.Module):
        _layerwise_offload_blocks_attr = "blocks"

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    cls = f"{Old.__module__}.{Old.__qualname__}"
    message = (
        f"{cls} declares _layerwise_offload_blocks_attr = 'blocks'; the singular attribute is deprecated, "
        "declare _layerwise_offload_blocks_attrs = ('blocks',) instead"
    )
    with pytest.warns(TorchferryDeprecationWarning, match=re.escape(message)):
        topo = discover(Old())
    assert len(topo.components[0].blocks) == 2
    discover(Old())  # second discovery of the same class: no warning (warnings are errors here)


def test_registry_supplies_block_attrs_of_known_classes() -> None:
    """A model class that declares nothing gets its block attributes from the registry by class name."""

    class WanTransformer3DModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    class Pipe:
        _dit_modules: ClassVar[list[str]] = ["transformer"]
        _encoder_modules: ClassVar[list[str]] = []
        _vae_modules: ClassVar[list[str]] = []

        def __init__(self) -> None:
            self.transformer = WanTransformer3DModel()

    topo = discover(Pipe())
    assert topo.component("transformer").stacks[0].attrs == ("blocks",)


def test_missing_block_attribute_is_recorded_as_a_problem() -> None:
    """A declared block attribute that does not exist becomes a component problem for `resolve`."""
    topo = discover(Pipeline(plan=Declaration(block_attrs={"transformer": ("nope", "blocks")})))
    dit = topo.component("transformer")
    assert dit.problems == ("block attribute 'nope' was not found on DiT",)
    assert dit.stacks[0].attrs == ("blocks",)


def test_legacy_scan_warns_once_per_pipeline_class() -> None:
    """Without declared lists the attribute scan finds components and warns once per class."""
    message = LEGACY_MESSAGE.format(cls="topology_toys.LegacyPipeline")
    with pytest.warns(TorchferryDeprecationWarning, match=re.escape(message)):
        topo = discover(LegacyPipeline())
    assert [(c.path, c.kind) for c in topo.components] == [
        ("transformer", "dit"),
        ("text_encoder", "encoder"),
        ("image_encoder", "encoder"),
        ("vae", "vae"),
    ]
    assert not topo.declares_components
    again = discover(LegacyPipeline())
    assert again == topo


def test_legacy_scan_of_a_module_pipeline() -> None:
    """An nn.Module pipeline without declarations is scanned too, its submodules being components."""

    class ModulePipeline(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dit = DiT(blocks=2)
            self.audio_vae = Vae()

    cls = f"{ModulePipeline.__module__}.{ModulePipeline.__qualname__}"
    with pytest.warns(TorchferryDeprecationWarning, match=re.escape(LEGACY_MESSAGE.format(cls=cls))):
        topo = discover(ModulePipeline())
    assert [(c.path, c.kind) for c in topo.components] == [("dit", "dit"), ("audio_vae", "vae")]


def test_declared_entries_that_are_not_modules_warn() -> None:
    """Missing, None and non-module entries of a declared list warn and are skipped; duplicates dedupe."""

    class Pipe:
        _dit_modules: ClassVar[list[str]] = ["transformer", "alias", "missing", "nothing", "number"]
        _encoder_modules: ClassVar[list[str]] = []
        _vae_modules: ClassVar[list[str]] = []

        def __init__(self) -> None:
            self.transformer = DiT()
            self.alias = self.transformer
            self.nothing = None
            self.number = 3

    cls = f"{Pipe.__module__}.{Pipe.__qualname__}"
    with pytest.warns(OffloadWarning) as record:
        topo = discover(Pipe())
    assert [str(w.message) for w in record] == [
        f"{cls}._dit_modules names 'missing', which does not exist, not an nn.Module; it is ignored",
        f"{cls}._dit_modules names 'nothing', which is None, not an nn.Module; it is ignored",
        f"{cls}._dit_modules names 'number', which is a int, not an nn.Module; it is ignored",
    ]
    assert [c.path for c in topo.components] == ["transformer"]


def test_dotted_component_paths_and_resident_modules() -> None:
    """Declared component paths may be dotted; `_resident_modules` become resident components."""

    class Pipe:
        _dit_modules: ClassVar[list[str]] = ["inner.transformer"]
        _encoder_modules: ClassVar[list[str]] = []
        _vae_modules: ClassVar[list[str]] = []
        _resident_modules: ClassVar[list[str]] = ["scheduler_net"]

        def __init__(self) -> None:
            self.inner = nn.Module()
            self.inner.transformer = DiT(blocks=2)
            self.scheduler_net = nn.Linear(2, 2)

    topo = discover(Pipe())
    assert [(c.path, c.kind) for c in topo.components] == [
        ("inner.transformer", "dit"),
        ("scheduler_net", "resident"),
    ]
    assert topo.components[0].blocks[0].tensors[0].name == "inner.transformer.blocks.0.attn.weight"


def test_declaration_sources() -> None:
    """The declaration comes from the argument, else `_offload_plan`, else `get_offload_plan()`."""
    attached = Declaration(resident_dit_paths={"transformer"})
    given = Declaration(on_demand_component_paths={"vae"})
    assert discover(Pipeline(plan=attached)).declaration == attached
    assert discover(Pipeline(plan=attached), declaration=given).declaration == given

    class Computed(Pipeline):
        def get_offload_plan(self) -> Declaration:
            return given

    assert discover(Computed()).declaration == given
    assert discover(Pipeline()).declaration is None


def test_declaration_argument_must_be_a_declaration() -> None:
    """Passing something other than a Declaration to discover() is a TypeError."""
    message = "discover(declaration=...) must be a torchferry.topology.Declaration, got dict"
    with pytest.raises(TypeError, match=re.escape(message)):
        discover(Pipeline(), {"block_attrs": {}})  # type: ignore[arg-type]


def test_foreign_offload_plan_is_a_type_error() -> None:
    """An `_offload_plan` that is not a torchferry Declaration is rejected, naming the fix."""
    pipeline = Pipeline()
    pipeline._offload_plan = {"block_attrs": {}}  # type: ignore[assignment]
    message = (
        "topology_toys.Pipeline._offload_plan must be a torchferry.topology.Declaration, got dict; "
        "build one with Declaration(block_attrs=..., ...)"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        discover(pipeline)


def test_tied_weights_have_one_owner_with_aliases() -> None:
    """A Parameter reachable under two names is one spec owned once, the other name an alias."""
    topo = discover(Pipeline(plan=Declaration(encoder_block_attrs={"text_encoder": ("encoder.block",)})))
    encoder = topo.component("text_encoder")
    assert names(encoder.tensors) == [
        "text_encoder.shared.weight",
        "text_encoder.final.weight",
        "text_encoder.final.bias",
    ]
    assert encoder.tensors[0].aliases == ("text_encoder.encoder.embed.weight",)
    assert topo.owners() == {"text_encoder.encoder.embed.weight": "text_encoder.shared.weight"}


def test_same_storage_view_is_an_alias() -> None:
    """Two distinct tensor objects viewing the same bytes the same way are one tensor."""
    model = DiT(blocks=2)
    model.register_buffer("embed_copy", model.embed.weight.detach().view(4, 4))
    topo = discover(model)
    owner = next(t for t in topo.components[0].tensors if t.name == "embed_copy")
    assert owner.aliases == ("embed.weight",)
    assert "embed.weight" not in _every_name(topo)


def test_remainder_owns_a_weight_shared_with_a_block() -> None:
    """A weight used by both the remainder and a block is owned by the remainder, never streamed away."""
    model = DiT(blocks=2)
    model.blocks[1].attn.weight = model.embed.weight
    topo = discover(model)
    component = topo.components[0]
    owner = next(t for t in component.tensors if t.name == "embed.weight")
    assert owner.aliases == ("blocks.1.attn.weight",)
    assert names(component.blocks[1].tensors) == [
        "blocks.1.attn.bias",
        "blocks.1.norm.weight",
        "blocks.1.norm.bias",
    ]


def test_overlapping_views_are_rejected() -> None:
    """Different views over overlapping bytes of one storage are a PlanError naming both tensors."""
    model = DiT(blocks=2)
    flat = torch.zeros(40)
    model.embed.weight = nn.Parameter(flat[:16].view(4, 4))
    model.embed.bias = nn.Parameter(flat[12:16])
    message = (
        "Tensors 'embed.weight' and 'embed.bias' are different views of overlapping bytes of one "
        "storage; torchferry moves whole tensors, so give each parameter and buffer its own storage "
        "(clone one of them) or tie them as the same tensor"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        discover(model)


def test_disjoint_views_of_one_storage_are_distinct_tensors() -> None:
    """Parameters packed side by side in one flat buffer are separate tensors, not aliases."""
    model = DiT(blocks=2)
    flat = torch.zeros(20)
    model.embed.weight = nn.Parameter(flat[:16].view(4, 4))
    model.embed.bias = nn.Parameter(flat[16:])
    specs = {t.name: t for t in discover(model).components[0].tensors}
    assert specs["embed.weight"].aliases == ()
    assert specs["embed.bias"].aliases == ()


def test_every_tensor_has_exactly_one_owner() -> None:
    """Each parameter and buffer name appears once: in a block, a child or a remainder, or as an alias."""
    pipeline = Pipeline(plan=Declaration(encoder_block_attrs={"text_encoder": ("encoder.block",)}))
    topo = discover(pipeline)
    owned = _every_name(topo)
    aliases = list(topo.owners())
    expected = [
        join
        for path, module in (
            ("transformer", pipeline.transformer),
            ("text_encoder", pipeline.text_encoder),
            ("vae", pipeline.vae),
        )
        for join in (
            *(f"{path}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)),
            *(f"{path}.{n}" for n, _ in module.named_buffers(remove_duplicate=False)),
        )
    ]
    assert sorted(owned + aliases) == sorted(expected)
    assert len(set(owned)) == len(owned)


def test_meta_device_modules_are_sized_from_metadata() -> None:
    """Discovery works on meta tensors and sizes them from shape and dtype."""
    with torch.device("meta"):
        model = DiT(blocks=3, width=64).to(torch.bfloat16)
    topo = discover(model)
    block = topo.components[0].blocks[0]
    assert sum(t.nbytes for t in block.tensors) == (64 * 64 + 64 + 64 + 64) * 2
    # each 128-byte vector starts on a 256-byte boundary
    assert block.nbytes == 64 * 64 * 2 + 2 * 256 + 64 * 2
    weights = sum(t.nbytes for c in topo.components for t in c.all_tensors())
    assert weights == sum(p.numel() * 2 for p in model.parameters()) + 64 * 2


def test_meta_tied_weights_still_alias() -> None:
    """On the meta device a tied Parameter is still recognised by identity, and untied ones are not."""
    with torch.device("meta"):
        encoder = Encoder()
    topo = discover(Pipeline(encoder=encoder))
    assert topo.owners() == {"text_encoder.encoder.embed.weight": "text_encoder.shared.weight"}


def test_encoder_stacks_and_problems() -> None:
    """Each declared encoder block path is its own ring; unusable paths are recorded as problems."""
    plan = Declaration(encoder_block_attrs={"text_encoder": ("encoder.block", "final", "missing.layers")})
    topo = discover(Pipeline(plan=plan))
    encoder = topo.component("text_encoder")
    assert [s.attrs for s in encoder.stacks] == [("encoder.block",)]
    assert [b.path for b in encoder.blocks] == [
        "text_encoder.encoder.block.0",
        "text_encoder.encoder.block.1",
    ]
    assert encoder.problems == (
        "encoder block path 'final' on Encoder is a LayerNorm, not a ModuleList of at least two blocks",
        "encoder block path 'missing.layers' was not found on Encoder",
    )


def test_short_encoder_block_list_is_a_problem() -> None:
    """A declared encoder ModuleList of one block cannot stream and is recorded as a problem."""
    plan = Declaration(encoder_block_attrs={"text_encoder": ("encoder.block",)})
    topo = discover(Pipeline(encoder=Encoder(blocks=1), plan=plan))
    assert topo.component("text_encoder").problems == (
        "encoder block path 'encoder.block' on Encoder is a ModuleList of 1, "
        "not a ModuleList of at least two blocks",
    )


def test_stub_encoder_is_a_legal_no_op() -> None:
    """An encoder with ``is_loaded == False`` is a stub: no stacks and no problems."""
    plan = Declaration(encoder_block_attrs={"text_encoder": ("encoder.block",)})
    topo = discover(Pipeline(encoder=StubEncoder(), plan=plan))
    encoder = topo.component("text_encoder")
    assert encoder.stub
    assert encoder.stacks == ()
    assert encoder.problems == ()


def test_lifecycle_is_recorded() -> None:
    """`has_lifecycle` says the module defines both load_to_device and offload_to_cpu."""
    topo = discover(Pipeline(encoder=LifecycleEncoder()))
    assert topo.component("text_encoder").has_lifecycle
    assert not topo.component("transformer").has_lifecycle


class _Refiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 8)


class _BigDiT(DiT):
    """A DiT with a declared child, a large scanned child, a large child without a ring and a small one."""

    def __init__(self) -> None:
        super().__init__(blocks=2)
        self.refiner = _Refiner()
        self.big = nn.Module()
        self.big.layers = nn.ModuleList(nn.Linear(16384, 16384) for _ in range(2))
        self.huge = nn.Linear(16384, 16385)
        self.small = nn.Linear(4, 4)


def test_dit_children_declared_or_large() -> None:
    """Declared children and children over 1024 MiB are recorded with their own ring or none."""
    with torch.device("meta"):
        dit = _BigDiT()

    class Pipe:
        _dit_modules: ClassVar[list[str]] = ["transformer"]
        _encoder_modules: ClassVar[list[str]] = []
        _vae_modules: ClassVar[list[str]] = []
        _offload_plan = Declaration(offload_submodules={"refiner": "blocks"})

        def __init__(self) -> None:
            self.transformer = dit

    message = (
        "torch.nn.modules.module.Module block list was found as 'layers' by scanning well-known names; "
        "declare it in Declaration.offload_submodules (the scan is deprecated)"
    )
    with pytest.warns(TorchferryDeprecationWarning, match=re.escape(message)):
        topo = discover(Pipe())
    component = topo.component("transformer")
    assert [(c.path, [s.attrs for s in c.stacks]) for c in component.children] == [
        ("transformer.refiner", [("blocks",)]),
        ("transformer.big", [("layers",)]),
        ("transformer.huge", []),
    ]
    assert names(component.children[0].tensors) == [
        "transformer.refiner.out.weight",
        "transformer.refiner.out.bias",
    ]
    assert [b.path for b in component.children[1].blocks] == [
        "transformer.big.layers.0",
        "transformer.big.layers.1",
    ]
    assert "transformer.small.weight" in names(component.tensors)
    assert not any(name.startswith("transformer.huge") for name in names(component.tensors))


def test_declared_child_without_a_ring_is_a_problem() -> None:
    """A child declared with a block attribute that is not a block list records the finding."""

    class Pipe(Pipeline):
        _offload_plan = Declaration(offload_submodules={"embed": "weight"})

    topo = discover(Pipe())
    (child,) = topo.component("transformer").children
    assert child.problems == (
        "Declaration.offload_submodules names block attribute 'weight' for 'transformer.embed', but on "
        "Linear it is a Parameter, not a ModuleList of at least two blocks",
    )


def test_nested_component_is_excluded_from_its_parent() -> None:
    """A DiT inside another declared DiT is its own component; the parent owns none of its tensors."""

    class Outer(DiT):
        def __init__(self) -> None:
            super().__init__(blocks=2)
            self.language_model = DiT(blocks=2)

    class Pipe:
        _dit_modules: ClassVar[list[str]] = ["transformer", "transformer.language_model"]
        _encoder_modules: ClassVar[list[str]] = []
        _vae_modules: ClassVar[list[str]] = []

        def __init__(self) -> None:
            self.transformer = Outer()

    topo = discover(Pipe())
    outer, inner = topo.components
    assert outer.children == ()
    assert not any("language_model" in n for n in names(outer.all_tensors()))
    assert [b.path for b in inner.blocks] == [
        "transformer.language_model.blocks.0",
        "transformer.language_model.blocks.1",
    ]


def test_shared_block_list_gets_one_canonical_path() -> None:
    """A block list reachable from two DiTs is named by its first path, so `resolve` can see the clash."""

    class Pipe:
        _dit_modules: ClassVar[list[str]] = ["transformer", "transformer_2"]
        _encoder_modules: ClassVar[list[str]] = []
        _vae_modules: ClassVar[list[str]] = []

        def __init__(self) -> None:
            self.transformer = DiT(blocks=2)
            self.transformer_2 = DiT(blocks=2)
            self.transformer_2.blocks = self.transformer.blocks

    topo = discover(Pipe())
    first, second = topo.components
    assert (
        [b.path for b in second.blocks]
        == [b.path for b in first.blocks]
        == [
            "transformer.blocks.0",
            "transformer.blocks.1",
        ]
    )


def test_unknown_dtype_is_rejected() -> None:
    """A tensor of a dtype torchferry cannot size is a PlanError naming it."""
    model = DiT(blocks=2)
    model.register_buffer("odd", torch.zeros(2, dtype=torch.uint64))
    known = ", ".join(sorted(DTYPE_SIZES))
    message = f"Tensor 'odd' has dtype uint64, which torchferry cannot stream; convert it to one of {known}"
    with pytest.raises(PlanError, match=re.escape(message)):
        discover(model)


def test_discover_is_deterministic() -> None:
    """Discovering equal pipelines gives equal, equally hashed topologies."""
    assert discover(Pipeline()) == discover(Pipeline())
    assert hash(discover(Pipeline())) == hash(discover(Pipeline()))


def test_vae_and_resident_are_plain_components() -> None:
    """A VAE has only remainder tensors."""
    vae = discover(Pipeline()).component("vae")
    assert vae.stacks == ()
    assert names(vae.tensors) == ["vae.conv.weight", "vae.conv.bias"]
    assert isinstance(Vae(), nn.Module)


# ---------------------------------------------------------------------------------------------
# Discovery with nothing declared: structure, single-module blocks, the components mapping


class _Attention(nn.Module):
    """A block holding an inner list of its own (never a ring of the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.to_out = nn.ModuleList([nn.Linear(8, 8), nn.Dropout()])
        self.norm = nn.LayerNorm(8)


class _Bare(nn.Module):
    """An undeclared model: two block lists, an embedder with its own list, a small helper list."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Module()
        self.embed.refiner = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.transformer_blocks = nn.ModuleList(_Attention() for _ in range(3))
        self.single_blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(2) for _ in range(2))
        self.out = nn.Linear(8, 8)


def test_bare_model_ring_is_found_from_structure() -> None:
    """An undeclared bare model is its own DiT; its top-level block lists form one ring, in order."""
    topo = discover(_Bare())
    (dit,) = topo.components
    assert (dit.path, dit.kind) == ("", "dit")
    (stack,) = dit.stacks
    assert stack.attrs == ("transformer_blocks", "single_blocks")
    assert [b.path for b in stack.blocks] == [
        "transformer_blocks.0",
        "transformer_blocks.1",
        "transformer_blocks.2",
        "single_blocks.0",
        "single_blocks.1",
    ]
    assert "embed.refiner.0.weight" in names(dit.tensors)
    assert "norms.0.weight" in names(dit.tensors)


def test_inner_block_list_is_never_a_component() -> None:
    """A model whose list sits at a legacy DiT name (``transformer_blocks``) is not scanned as a pipeline."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.transformer_blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    topo = discover(Model())  # no deprecation warning: the model is not a pipeline
    assert [(c.path, len(c.blocks)) for c in topo.components] == [("", 2)]
    assert topo.declares_components


def test_model_with_a_transformer_inside_is_one_bare_model() -> None:
    """A model holding a ``transformer`` part and tensors of its own is one DiT whose ring is inside it."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch = nn.Linear(4, 4)
            self.transformer = Inner()

    topo = discover(Model())
    assert [(c.path, c.stacks[0].attrs) for c in topo.components] == [("", ("transformer.layers",))]


def test_single_module_and_module_dict_are_blocks_named_by_their_paths() -> None:
    """A declared single module is one block at its own path; a ModuleDict's blocks are named by key."""

    class UNetLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.mid = nn.Linear(4, 4)
            self.up = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})

    topo = discover(UNetLike(), Declaration(block_attrs={"": ("down", "mid", "up")}))
    assert [b.path for b in topo.components[0].blocks] == ["down.0", "down.1", "mid", "up.a", "up.b"]


def test_registry_attribute_that_is_none_is_skipped() -> None:
    """A registered UNet built without a mid block streams its down and up blocks, with no problem."""

    class UNet2DConditionModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down_blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.mid_block = None
            self.up_blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    (unet,) = discover(UNet2DConditionModel()).components
    assert unet.stacks[0].attrs == ("down_blocks", "up_blocks")
    assert unet.problems == ()


class _Mapped:
    """A pipeline listing its components in a ``components`` mapping, as diffusers pipelines do."""

    def __init__(self) -> None:
        self.transformer = _Bare()
        self.text_encoder = Encoder(blocks=3)
        self.image_encoder = Encoder()
        self.vae = Vae()
        self.controlnet = nn.Linear(4, 4)
        self.scheduler = object()

    @property
    def components(self) -> dict[str, object]:
        names_ = ("transformer", "text_encoder", "image_encoder", "vae", "controlnet", "scheduler")
        return {name: getattr(self, name) for name in names_}


def test_pipeline_components_come_from_its_components_mapping() -> None:
    """An unknown pipeline class is read from its ``components``: kinds, rings and a declaration."""
    topo = discover(_Mapped())
    assert [(c.path, c.kind, len(c.blocks)) for c in topo.components] == [
        ("transformer", "dit", 5),
        ("text_encoder", "encoder", 3),
        ("image_encoder", "encoder", 0),
        ("vae", "vae", 0),
        ("controlnet", "resident", 0),
    ]
    declaration = topo.declaration
    assert declaration is not None
    assert declaration.encoder_block_attrs == {"text_encoder": ("encoder.block",)}
    assert declaration.encoder_component_types == {"text_encoder": "text_encoder"}
    assert declaration.resident_dit_paths == {"transformer"}


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_component_is_unwrapped() -> None:
    """A ``torch.compile``d component is discovered through its original module, under its own path."""
    pipe = _Mapped()
    pipe.transformer = torch.compile(pipe.transformer)  # type: ignore[assignment]
    topo = discover(pipe)
    dit = topo.component("transformer")
    assert dit.class_name == "_Bare"
    assert dit.blocks[0].path == "transformer.transformer_blocks.0"
    assert not any("_orig_mod" in t.name for t in dit.all_tensors())


def test_order_mismatch_names_both_orders_and_the_declaration() -> None:
    """`order_mismatch` is None for a forward that follows the ring, else both orders and the fix."""
    from torchferry.topology._order import order_mismatch

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            self.hints = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    pipe = Pipeline()
    pipe.transformer = Model()  # type: ignore[assignment]
    dit = discover(pipe, Declaration(block_attrs={"transformer": ("blocks", "hints")})).component(
        "transformer"
    )
    assert order_mismatch(dit, ["transformer.blocks.0", "transformer.blocks.1"]) is None
    assert order_mismatch(dit, ["transformer.hints.0"]) == (
        "declared order transformer.blocks.0-2, transformer.hints.0-1, forward ran transformer.hints.0; "
        "declare Declaration(block_attrs={'transformer': ('hints', 'blocks')}) so the ring follows the "
        "forward"
    )


def test_block_less_dit_is_told_a_declaration_from_its_tensor_names() -> None:
    """`suggest_declaration` names the largest numbered list, else the large children, else nothing."""
    from torchferry._errors import said
    from torchferry.topology._resolve import suggest_declaration

    class Numbered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Module()
            for i in range(3):
                self.body.add_module(str(i), nn.Linear(4, 4))
            self.head = nn.Linear(4, 4)

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(8, 8)
            self.second = nn.Linear(8, 8)
            self.tiny = nn.LayerNorm(1)

    none = Declaration(block_attrs={"": ()})
    numbered = suggest_declaration(discover(Numbered(), none).components[0])
    assert said(numbered) == (
        "; for example pass declaration=Declaration(block_attrs={'': ('body',)}) listing the block lists "
        "(or single blocks) in the order its forward runs them"
    )
    assert said(numbered, "cli").startswith("; for example pass --block-attrs body listing")
    named = suggest_declaration(discover(Named(), none).components[0])
    assert "('first', 'second')" in said(named) and "--block-attrs first,second " in said(named, "cli")
    assert suggest_declaration(discover(nn.Linear(2, 2), none).components[0]) == ()
