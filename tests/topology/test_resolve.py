"""`resolve`: every rule of the module docstring, matched on the whole message, plus purity."""

from __future__ import annotations

import re
from typing import Any, ClassVar

import attrs
import pytest
import torch
from topology_toys import DiT, Encoder, LifecycleEncoder, LifecycleVae, Pipeline, StubEncoder, Vae
from torch import nn

from torchferry import OffloadWarning, PlanError
from torchferry.topology import (
    Component,
    Declaration,
    OffloadConfig,
    ParallelLayout,
    Plan,
    Topology,
    discover,
    resolve,
)

ENCODER_STACKS = Declaration(encoder_block_attrs={"text_encoder": ("encoder.block",)})
LAYER = OffloadConfig(strategy="layerwise")
DLO_LOCAL = OffloadConfig(strategy="distributed_layerwise", dit_transfer="rank-local")


def explicit(strategy: str = "layerwise", *components: str, **kwargs: Any) -> OffloadConfig:
    return OffloadConfig(strategy=strategy, components=components or ("dit",), **kwargs)  # type: ignore[arg-type]


def topo(**kwargs: Any) -> Topology:
    return discover(Pipeline(**kwargs))


def error(message: str) -> Any:
    return pytest.raises(PlanError, match=f"^{re.escape(message)}$")


def warns(message: str) -> Any:
    return pytest.warns(OffloadWarning, match=f"^{re.escape(message)}$")


class NoDiT:
    _dit_modules: ClassVar[list[str]] = []
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.text_encoder = Encoder()


class DiTOnly:
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["image_encoder"]
    _vae_modules: ClassVar[list[str]] = []

    def __init__(self, blocks: int = 3) -> None:
        self.transformer = DiT(blocks)
        self.image_encoder = Encoder()


class Shared:
    _dit_modules: ClassVar[list[str]] = ["transformer", "transformer_2"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.transformer = DiT(2)
        self.transformer_2 = DiT(2)
        self.transformer_2.blocks = self.transformer.blocks


class _Refiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.out = nn.Linear(4, 4)


class _Staged(nn.Linear):
    def load_to_device(self) -> None:
        """Stage onto the device."""

    def offload_to_cpu(self) -> None:
        """Stage back."""


class WithChildren:
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []

    def __init__(self, plan: Declaration) -> None:
        self.transformer = DiT(3)
        self.transformer.refiner = _Refiner()
        self.transformer.staged = _Staged(4, 4)
        self.transformer.plain = nn.Linear(4, 4)
        self._offload_plan = plan


CHILDREN = Declaration(offload_submodules={"refiner": "blocks", "staged": "missing"})


# --- rule 1: explicit selection ---------------------------------------------------------------


def test_explicit_model_level_needs_a_dit() -> None:
    """Explicit model-level offload without a DiT is rejected."""
    with error(
        "model_level offload with explicit components swaps a DiT against the encoders, but "
        "test_resolve.NoDiT has no DiT component; declare it in _dit_modules"
    ):
        resolve(discover(NoDiT()), explicit("model_level", "text_encoder"))


def test_explicit_model_level_needs_an_encoder() -> None:
    """Explicit model-level offload without any encoder is rejected."""
    topology = attrs.evolve(topo(), components=topo().of_kind("dit"))
    with error(
        "model_level offload with explicit components swaps the DiT against an encoder stage, but "
        "topology_toys.Pipeline has no encoder component; declare it in _encoder_modules"
    ):
        resolve(topology, explicit("model_level", "dit"))


def test_selected_dit_must_exist() -> None:
    """Selecting 'dit' for a pipeline without a DiT is rejected."""
    with error(
        "'dit' is selected but test_resolve.NoDiT has no DiT component; declare it in _dit_modules or "
        "remove 'dit' from components"
    ):
        resolve(discover(NoDiT()), explicit("layerwise", "dit"))


def test_selected_text_encoder_must_exist() -> None:
    """Selecting 'text_encoder' when no encoder counts as one is rejected, listing the encoders."""
    with error(
        "'text_encoder' is selected but test_resolve.DiTOnly has no text encoder (encoders found: "
        "'image_encoder'); type one with Declaration.encoder_component_types or remove 'text_encoder' "
        "from components"
    ):
        resolve(discover(DiTOnly()), explicit("model_level", "dit", "text_encoder"))


def test_selected_vae_must_exist() -> None:
    """Selecting 'vae' for a pipeline without a VAE is rejected."""
    with error(
        "'vae' is selected but test_resolve.DiTOnly has no VAE component; declare it in _vae_modules or "
        "remove 'vae' from components"
    ):
        resolve(discover(DiTOnly()), explicit("model_level", "dit", "vae"))


def test_declared_encoder_type_selects_it() -> None:
    """`encoder_component_types` makes any encoder selectable as a text encoder."""
    plan = Declaration(
        encoder_component_types={"image_encoder": "text_encoder"},
        on_demand_component_paths={"image_encoder"},
    )
    pipeline = DiTOnly()
    pipeline.image_encoder = LifecycleEncoder()
    result = resolve(discover(pipeline, plan), explicit("layerwise", "dit", "text_encoder"))
    assert result.component("image_encoder").selected
    assert result.component("image_encoder").on_demand


def test_unknown_encoder_type_is_rejected() -> None:
    """An encoder type other than 'text_encoder' is rejected (rule 6)."""
    plan = Declaration(encoder_component_types={"text_encoder": "image"})
    with error(
        "Declaration.encoder_component_types maps encoder 'text_encoder' to 'image'; the only encoder "
        "component type is 'text_encoder'"
    ):
        resolve(topo(plan=plan), LAYER)


# --- rules 2-4: DiT stacks --------------------------------------------------------------------


def test_resident_layers_without_declared_dit_explicit() -> None:
    """Explicit resident layers with no matching resident_dit_paths is an error."""
    with error(
        "resident_layers=2 was requested, but no DiT of this pipeline is declared in "
        "Declaration.resident_dit_paths (declared: none; DiTs: 'transformer'); declare the DiT there or "
        "set resident_layers=0"
    ):
        resolve(topo(), explicit("layerwise", "dit", resident_layers=2))


def test_resident_layers_without_declared_dit_legacy() -> None:
    """Legacy resident layers with no matching resident_dit_paths warn and stream every block."""
    plan = Declaration(resident_dit_paths={"other"})
    with warns(
        "resident_layers=2 was requested, but no DiT of this pipeline is declared in "
        "Declaration.resident_dit_paths (declared: 'other'; DiTs: 'transformer'); all blocks will stream"
    ):
        result = resolve(
            topo(plan=plan),
            OffloadConfig.from_legacy(
                enable_distributed_layerwise_offload=True, dlo_use_allgather=False, dlo_resident_layers=2
            ),
        )
    assert result.component("transformer").stacks[0].resident_head == 0


@pytest.mark.parametrize(
    "config", [explicit("layerwise", "dit", resident_layers=9), attrs.evolve(DLO_LOCAL, resident_layers=1)]
)
def test_resident_head_is_clamped_and_honoured_by_both_strategies(config: OffloadConfig) -> None:
    """A declared resident DiT keeps min(resident_layers, blocks) leading blocks under either strategy."""
    plan = Declaration(resident_dit_paths={"transformer"})
    stack = resolve(topo(plan=plan), config).component("transformer").stacks[0]
    assert stack.resident_head == min(config.resident_layers, 3)
    assert len(stack.streaming) == 3 - stack.resident_head


def test_selected_dit_without_blocks_explicit() -> None:
    """An explicitly selected DiT without blocks is an error."""
    topology = discover(Pipeline(), Declaration(block_attrs={"transformer": ()}))
    with error(
        "Selected DiT 'transformer' (DiT) has no streamable blocks; declare them with "
        "DiT._layerwise_offload_blocks_attrs or Declaration.block_attrs['transformer']; for example pass "
        "declaration=Declaration(block_attrs={'transformer': ('blocks',)}) listing the block lists (or "
        "single blocks) in the order its forward runs them"
    ):
        resolve(topology, explicit())


def test_selected_dit_without_blocks_legacy() -> None:
    """A legacy DiT without blocks warns and stays resident with all its tensors as remainder."""
    topology = discover(Pipeline(), Declaration(block_attrs={"transformer": ()}))
    with warns(
        "DiT 'transformer' (DiT) has no streamable blocks; it is not offloaded and stays resident; for "
        "example pass declaration=Declaration(block_attrs={'transformer': ('blocks',)}) listing the block "
        "lists (or single blocks) in the order its forward runs them"
    ):
        result = resolve(topology, LAYER)
    dit = result.component("transformer")
    assert dit.stacks == ()
    # the same weights; their packing (and so the alignment padding) differs once folded into one buffer
    assert sum(t.nbytes for t in dit.all_tensors()) == sum(
        t.nbytes for t in topology.component("transformer").all_tensors()
    )


def test_dit_problem_explicit_and_legacy() -> None:
    """A missing declared block attribute is an error when explicit and a warning otherwise."""
    topology = discover(Pipeline(), Declaration(block_attrs={"transformer": ("gone", "blocks")}))
    with error(
        "Selected DiT 'transformer': block attribute 'gone' was not found on DiT; fix "
        "Declaration.block_attrs['transformer'] or DiT._layerwise_offload_blocks_attrs"
    ):
        resolve(topology, explicit())
    with warns("DiT 'transformer': block attribute 'gone' was not found on DiT; that attribute is skipped"):
        result = resolve(topology, LAYER)
    assert len(result.component("transformer").blocks) == 3


def test_one_streaming_block_explicit_distributed() -> None:
    """Explicit distributed offload leaving one streaming block is rejected with the resident wording."""
    plan = Declaration(resident_dit_paths={"transformer"})
    with error(
        "Selected DiT 'transformer' leaves exactly one streaming block of 3 after resident_layers=2; "
        "choose a resident count that leaves zero or at least two streaming blocks"
    ):
        resolve(
            topo(plan=plan),
            explicit("distributed_layerwise", "dit", dit_transfer="rank-local", resident_layers=2),
        )


def test_one_streaming_block_explicit_layerwise() -> None:
    """Explicit layerwise offload of a one-block DiT is rejected with the layerwise wording."""
    with error(
        "Selected DiT 'transformer' requires at least two streaming blocks for layerwise offload, but 1 "
        "block(s) with resident_layers=0 leave one; declare more blocks or change resident_layers"
    ):
        resolve(topo(blocks=1), explicit())


def test_one_streaming_block_legacy_distributed_keeps_all_resident() -> None:
    """Legacy distributed offload keeps a lone streaming block resident instead of skipping."""
    with warns(
        "DiT 'transformer' (DiT) would stream a single block, which cannot form a ring; all 1 blocks "
        "stay resident"
    ):
        result = resolve(topo(blocks=1), DLO_LOCAL)
    stack = result.component("transformer").stacks[0]
    assert (stack.resident_head, stack.streaming) == (1, ())


def test_one_streaming_block_legacy_layerwise_skips() -> None:
    """Legacy layerwise offload skips a DiT with one streaming block."""
    with warns(
        "DiT 'transformer' (DiT) would stream a single block, which cannot form a ring; it is not "
        "offloaded and stays resident"
    ):
        result = resolve(topo(blocks=1), LAYER)
    assert result.component("transformer").stacks == ()


# --- rule 5: DiT children ---------------------------------------------------------------------


def test_children_under_distributed_strategy() -> None:
    """Under the distributed strategy a child streams its ring or, with a lifecycle, is on-demand."""
    topology = discover(WithChildren(CHILDREN))
    message = (
        "DiT child 'transformer.staged': Declaration.offload_submodules names block attribute 'missing' "
        "for 'transformer.staged', but on _Staged it is None, not a ModuleList of at least two blocks"
    )
    with warns(message):
        result = resolve(topology, DLO_LOCAL)
    refiner, staged = result.component("transformer").children
    assert (refiner.path, refiner.selected, refiner.on_demand, len(refiner.blocks)) == (
        "transformer.refiner",
        True,
        False,
        2,
    )
    assert (staged.path, staged.on_demand, staged.stacks) == ("transformer.staged", True, ())


def test_child_without_ring_or_lifecycle_is_rejected() -> None:
    """A child that owns its residency needs a ring or a lifecycle."""
    topology = discover(WithChildren(Declaration(offload_submodules={"plain": "layers"})))
    with error(
        "DiT child 'transformer.plain' (Linear, 0.0 MiB) owns its residency but has neither its own block "
        "ring nor load_to_device/offload_to_cpu; declare its block list in "
        "Declaration.offload_submodules['plain'] or give it a lifecycle"
    ):
        resolve(topology, DLO_LOCAL)  # errors win: the child's problem warning is not issued


def test_children_fold_back_outside_the_distributed_strategy() -> None:
    """Under plain layerwise offload children are not separate: their tensors join the DiT remainder."""
    topology = discover(WithChildren(CHILDREN))
    dit = resolve(topology, LAYER).component("transformer")
    assert dit.children == ()
    assert "transformer.refiner.blocks.0.weight" in [t.name for t in dit.tensors]
    # the same weights; their packing (and so the alignment padding) differs once folded into one buffer
    assert sum(t.nbytes for t in dit.all_tensors()) == sum(
        t.nbytes for t in topology.component("transformer").all_tensors()
    )


# --- rules 6-9: encoders and VAEs -------------------------------------------------------------

DLO_GATHER = OffloadConfig(
    strategy="distributed_layerwise",
    dit_transfer="rank-local",
    encoder_transfer="allgather",
    components=("dit", "text_encoder"),
    parallel=ParallelLayout(data_parallel_size=2),
)
REPLICATION = (
    "Text encoder 'text_encoder' cannot all-gather across the 2 ranks of the shard group: "
    "Declaration.encoder_dlo_weight_replication does not declare its weights identical on every rank; "
    "set encoder_transfer='rank-local' (layer_options.text_encoder.weight_transfer='rank-local') for "
    "tensor-parallel or rank-specific encoders, or declare the replication"
)


@pytest.mark.parametrize("encoder", [Encoder, StubEncoder])
def test_encoder_allgather_needs_declared_replication(encoder: type[nn.Module]) -> None:
    """All-gathering an encoder not declared replicated is rejected, stubs included."""
    with error(REPLICATION):
        resolve(topo(encoder=encoder(), plan=ENCODER_STACKS), DLO_GATHER)


def test_encoder_allgather_with_replication() -> None:
    """A declared replicated encoder all-gathers its declared stacks."""
    plan = attrs.evolve(ENCODER_STACKS, encoder_dlo_weight_replication={"text_encoder"})
    encoder = resolve(topo(plan=plan), DLO_GATHER).component("text_encoder")
    assert encoder.selected
    assert [s.attrs for s in encoder.stacks] == [("encoder.block",)]


def test_encoder_problems_strict_and_legacy() -> None:
    """Encoder block problems are errors when explicit and warnings under legacy selection."""
    plan = Declaration(encoder_block_attrs={"text_encoder": ("encoder.block", "final")})
    problem = "encoder block path 'final' on Encoder is a LayerNorm, not a ModuleList of at least two blocks"
    with error(f"Encoder 'text_encoder': {problem}; fix Declaration.encoder_block_attrs['text_encoder']"):
        resolve(topo(plan=plan), explicit("layerwise", "dit", "text_encoder"))
    with warns(f"Encoder 'text_encoder': {problem}; that block path is skipped"):
        result = resolve(topo(plan=plan), LAYER)
    assert len(result.component("text_encoder").stacks) == 1


def test_explicit_encoder_needs_a_plan() -> None:
    """An explicitly selected text encoder needs declared stacks or an on-demand lifecycle."""
    with error(
        "Selected text encoder 'text_encoder' has neither declared block stacks nor an on-demand "
        "lifecycle; declare Declaration.encoder_block_attrs['text_encoder'] or list it in "
        "Declaration.on_demand_component_paths"
    ):
        resolve(topo(), explicit("layerwise", "dit", "text_encoder"))


def test_stub_encoder_with_declared_plan_is_a_no_op() -> None:
    """A stub encoder with a declared plan resolves to a selected encoder without stacks."""
    encoder = resolve(
        topo(encoder=StubEncoder(), plan=ENCODER_STACKS), explicit("layerwise", "dit", "text_encoder")
    )
    assert encoder.component("text_encoder").selected
    assert encoder.component("text_encoder").stacks == ()


def test_on_demand_encoder_needs_a_lifecycle() -> None:
    """A component declared on-demand without load_to_device/offload_to_cpu is rejected."""
    plan = Declaration(on_demand_component_paths={"text_encoder"})
    with error(
        "Component 'text_encoder' is declared on-demand (Declaration.on_demand_component_paths) but "
        "Encoder has no load_to_device/offload_to_cpu; define both methods or remove it from "
        "on_demand_component_paths"
    ):
        resolve(topo(plan=plan), LAYER)


def test_on_demand_encoder_without_stacks_cannot_allgather() -> None:
    """An on-demand encoder without block stacks cannot use all-gather."""
    plan = Declaration(
        on_demand_component_paths={"text_encoder"}, encoder_dlo_weight_replication={"text_encoder"}
    )
    with error(
        "Text encoder 'text_encoder' is on-demand without streamable block stacks, so it cannot "
        "all-gather; declare Declaration.encoder_block_attrs['text_encoder'] or set "
        "encoder_transfer='rank-local'"
    ):
        resolve(topo(encoder=LifecycleEncoder(), plan=plan), DLO_GATHER)


def test_legacy_encoder_selection() -> None:
    """Legacy model-level selects every encoder; legacy layerwise only declared ones."""
    model_level = resolve(discover(DiTOnly()), OffloadConfig(strategy="model_level"))
    assert model_level.component("image_encoder").selected
    assert model_level.component("image_encoder").stacks == ()
    assert not resolve(discover(DiTOnly()), LAYER).component("image_encoder").selected
    assert resolve(topo(plan=ENCODER_STACKS), LAYER).component("text_encoder").selected


def test_selected_vae_needs_a_lifecycle_under_layerwise() -> None:
    """An explicitly selected VAE under a layerwise strategy needs a declared on-demand lifecycle."""
    with error(
        "Selected VAE 'vae' needs a pipeline-owned lifecycle under layerwise offload; list it in "
        "Declaration.on_demand_component_paths and define load_to_device/offload_to_cpu, or remove 'vae' "
        "from components"
    ):
        resolve(topo(), explicit("layerwise", "dit", "vae"))
    plan = Declaration(on_demand_component_paths={"vae"})
    vae = resolve(topo(vae=LifecycleVae(), plan=plan), explicit("layerwise", "dit", "vae")).component("vae")
    assert (vae.selected, vae.on_demand) == (True, True)


def test_legacy_declared_vae_is_staged() -> None:
    """Under legacy layerwise selection a VAE declared on-demand is staged, but not selected."""
    plan = Declaration(on_demand_component_paths={"vae"})
    vae = resolve(topo(vae=LifecycleVae(), plan=plan), LAYER).component("vae")
    assert (vae.selected, vae.on_demand) == (False, True)
    assert (
        not resolve(topo(vae=Vae(), plan=plan), OffloadConfig(strategy="model_level"))
        .component("vae")
        .on_demand
    )


# --- rules 10-11 and the plan as a whole ------------------------------------------------------


def test_legacy_layerwise_without_dit_is_skipped() -> None:
    """Legacy layerwise offload with no DiT is a no-op plan with a skip reason."""
    with warns(
        "No DiT/transformer component was found for layerwise offload of the DiT; layerwise offload is "
        "skipped and nothing is moved"
    ):
        result = resolve(discover(NoDiT(), ENCODER_STACKS), LAYER)
    assert result.skip_reason == "No DiT/transformer component was found for layerwise offload of the DiT"
    assert all(not c.selected and not c.stacks for c in result.components)


def test_block_claimed_by_two_components() -> None:
    """A block list shared by two DiTs is rejected."""
    with error(
        "Block 'transformer.blocks.0' is claimed by both 'transformer' and 'transformer_2'; declare one "
        "owner "
        "for each block list"
    ):
        resolve(discover(Shared()), LAYER)
    with warns(
        "model_level offload swaps DiTs against encoders, but test_resolve.Shared has no encoder "
        "component: each DiT ('transformer', 'transformer_2') is staged whole onto the device for its "
        "forward and nothing else is offloaded; use strategy='layerwise' to stream its blocks instead"
    ):
        plan = resolve(discover(Shared()), OffloadConfig(strategy="model_level"))
    assert plan.component("transformer_2").stacks == ()


def test_model_level_without_a_dit_warns_that_nothing_moves() -> None:
    """Model-level offload of a pipeline with no DiT warns that nothing is moved (rule 12)."""

    with warns(
        "model_level offload swaps DiTs against encoders, but test_resolve.NoDiT has no DiT "
        "component, so nothing is moved; declare the DiT in _dit_modules (see "
        "torchferry.topology.SupportsComponentDiscovery)"
    ):
        resolve(discover(NoDiT()), OffloadConfig(strategy="model_level"))


def test_all_problems_are_reported_together() -> None:
    """Several problems are collected into one PlanError."""
    plan = Declaration(on_demand_component_paths={"text_encoder", "vae"})
    with error(
        "2 problems with this offload request:\n"
        "  - Component 'text_encoder' is declared on-demand (Declaration.on_demand_component_paths) but "
        "Encoder has no load_to_device/offload_to_cpu; define both methods or remove it from "
        "on_demand_component_paths\n"
        "  - Component 'vae' is declared on-demand (Declaration.on_demand_component_paths) but Vae has no "
        "load_to_device/offload_to_cpu; define both methods or remove it from on_demand_component_paths"
    ):
        resolve(topo(plan=plan), LAYER)


def test_plan_mirrors_topology_order_and_bytes() -> None:
    """Components keep topology order; non-streamed ones carry no stacks but keep every byte."""
    topology = topo(plan=ENCODER_STACKS)
    for config in (LAYER, OffloadConfig(strategy="model_level"), OffloadConfig(strategy="none")):
        result = resolve(topology, config)
        assert [c.path for c in result.components] == [c.path for c in topology.components]
        weights = [sum(t.nbytes for t in c.all_tensors()) for c in result.components]
        assert weights == [sum(t.nbytes for t in c.all_tensors()) for c in topology.components]
    model_level = resolve(topology, OffloadConfig(strategy="model_level"))
    assert all(c.stacks == () for c in model_level.components)
    assert [c.selected for c in model_level.components] == [True, True, False]
    assert [c.selected for c in resolve(topology, OffloadConfig(strategy="none")).components] == [False] * 3


def _snapshot(pipeline: Pipeline) -> list[tuple[str, str, int, tuple[str, ...]]]:
    rows = []
    for component in (pipeline.transformer, pipeline.text_encoder, pipeline.vae):
        for name, module in component.named_modules():
            rows.append((name, "module", 0, tuple(sorted(module.__dict__))))
        for name, tensor in [*component.named_parameters(), *component.named_buffers()]:
            rows.append((name, str(tensor.device), tensor.data_ptr(), ()))
    return rows


def test_discover_and_resolve_are_pure_and_deterministic() -> None:
    """Nothing moves or changes on the modules, and repeated resolution gives equal plans and digests."""
    pipeline = Pipeline(plan=attrs.evolve(ENCODER_STACKS, resident_dit_paths={"transformer"}))
    before = _snapshot(pipeline)
    values = [t.clone() for t in pipeline.transformer.parameters()]
    config = explicit(
        "distributed_layerwise", "dit", "text_encoder", dit_transfer="rank-local", resident_layers=1
    )
    plans = [resolve(discover(pipeline), config) for _ in range(2)]
    assert _snapshot(pipeline) == before
    assert all(torch.equal(a, b) for a, b in zip(values, pipeline.transformer.parameters(), strict=True))
    assert plans[0] == plans[1]
    assert plans[0].digest == plans[1].digest
    assert isinstance(plans[0], Plan)
    assert resolve(discover(pipeline), LAYER).digest != plans[0].digest


def test_resolve_rejects_wrong_argument_types() -> None:
    """resolve() takes a Topology and an OffloadConfig."""
    with pytest.raises(TypeError, match=re.escape("resolve() needs an OffloadConfig, got dict")):
        resolve(topo(), {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("resolve() needs a Topology, got Component")):
        resolve(Component(path="x", kind="dit"), LAYER)  # type: ignore[arg-type]


def test_rule_13_the_shard_group_must_be_the_process_group() -> None:
    """An all-gathering request whose layout names another shard group size than ``world`` is refused."""
    request = OffloadConfig(strategy="distributed_layerwise", parallel=ParallelLayout(data_parallel_size=4))
    with error(
        "the parallel layout gives a weight-shard group of 4 ranks but the process group has 2; pass the "
        "group whose ranks share one copy of the weights, or fix the layout"
    ):
        resolve(topo(), request, world=2)
    assert resolve(topo(), request, world=4) == resolve(topo(), request)
    # Rank-local transfers gather nothing: the group's size does not matter.
    assert resolve(topo(), DLO_LOCAL, world=3) == resolve(topo(), DLO_LOCAL)


def test_rule_13_a_layout_left_at_one_rank_takes_the_groups_size() -> None:
    """Issue 39 (S4): an all-gathering distributed request whose layout is left at one rank is sized to
    the process group by resolve (the plan's config carries it, as if the layout had named it); a
    named layout, rank-local transfers, one rank or no group leave the request as it is."""
    request = OffloadConfig(strategy="distributed_layerwise")
    sized = resolve(topo(), request, world=4)
    named = OffloadConfig(strategy="distributed_layerwise", parallel=ParallelLayout(data_parallel_size=4))
    assert sized.config == named and sized == resolve(topo(), named)
    assert sized.config.dp_size == 4
    assert resolve(topo(), request, world=1).config == request
    assert resolve(topo(), request).config == request
    assert resolve(topo(), DLO_LOCAL, world=4).config == DLO_LOCAL


def test_rule_14_checkpoint_components_name_top_level_components_of_a_checkpoint() -> None:
    """checkpoint_components= needs checkpoint= and names only the topology's top-level components."""
    with error(
        "checkpoint_components= says which components to fill from the checkpoint, and no checkpoint= was "
        "given; pass checkpoint=, or drop checkpoint_components="
    ):
        resolve(topo(), LAYER, checkpoint_components=["vae"])
    with_file = OffloadConfig(strategy="layerwise", checkpoint="/nowhere/model.safetensors")
    with error(
        "checkpoint_components names 'dit', 'unet', which this plan has no top-level component for; its "
        "components are 'transformer', 'text_encoder', 'vae'"
    ):
        resolve(topo(), with_file, checkpoint_components=["unet", "dit", "vae"])
    assert resolve(topo(), with_file, checkpoint_components="vae") == resolve(topo(), with_file)


def test_rules_13_and_14_are_reported_together() -> None:
    """A wrong group size and a checkpoint_components= with no checkpoint are both listed at once."""
    request = OffloadConfig(strategy="distributed_layerwise", parallel=ParallelLayout(data_parallel_size=2))
    with error(
        "2 problems with this offload request:\n"
        "  - the parallel layout gives a weight-shard group of 2 ranks but the process group has 8; pass the "
        "group whose ranks share one copy of the weights, or fix the layout\n"
        "  - checkpoint_components= says which components to fill from the checkpoint, and no checkpoint= "
        "was given; pass checkpoint=, or drop checkpoint_components="
    ):
        resolve(topo(), request, world=8, checkpoint_components=())
