"""`resolve`: the pure function from a topology and a config to a plan, or a `PlanError`.

The rules, in the order they are applied (messages name the component, what was found and the fix):

1. Explicit selection (``config.components`` set): model-level offload needs a DiT and an encoder;
   a selected ``dit``, ``text_encoder`` or ``vae`` must exist.
2. Resident layers (either layerwise strategy) apply only to DiTs in
   ``Declaration.resident_dit_paths``; none matching is an error when explicit, a warning otherwise,
   as is a strategy or selection that streams no DiT ring for them to head; a DiT left out while
   another is declared is a warning naming it.
3. A selected DiT streams its ring under a layerwise strategy. No blocks: error when explicit,
   else a warning and the DiT stays resident. Its resident head is ``resident_layers`` clamped to
   the block count.
4. Exactly one streaming block cannot form a ring: an error when explicit (distributed and
   layerwise wordings); legacy distributed keeps it resident; legacy layerwise skips the DiT.
5. Under the distributed strategy only, DiT children (declared, or over 1024 MiB) own their
   residency: their own ring, else the pipeline's lifecycle, else an error. Otherwise their
   tensors fold back into the DiT's remainder.
6. Encoder types come from ``Declaration.encoder_component_types`` (only ``text_encoder`` is a
   type), else the leaf name starting or ending with ``text_encoder``.
7. A text encoder that all-gathers across more than one rank must be declared replicated; this is
   checked before its blocks, so stub encoders fail the same way on every rank.
8. Encoder block problems are errors when explicit or all-gathering, warnings otherwise; a selected
   encoder needs a streamable plan or a lifecycle when explicit; an on-demand encoder without
   blocks cannot all-gather.
9. A component declared on-demand needs ``load_to_device`` and ``offload_to_cpu``. An encoder
   both on-demand and with block stacks (MiniMax-H3's text encoder) is served as the seed serves
   it: its blocks stream in rings, and its non-block state follows its own lifecycle calls.
10. Legacy layerwise offload with no DiT is a complete no-op with a ``skip_reason``.
11. Every streamed block has exactly one owner (checked last).
12. Model-level offload (not explicit) that would swap nothing warns: no DiT (nothing moves), or
    DiTs but no encoder stage (each DiT is staged whole; layerwise would stream it).
13. With ``world`` (the size of the process group the session all-gathers over), a distributed
    request that all-gathers must name a weight-shard group of that size; a layout left at one rank
    takes it (`_sized_to`), so the plan's config carries the group's size.
14. ``checkpoint_components`` (the top-level components a checkpoint fills; ``None``: all) needs a
    ``checkpoint`` and names only top-level components of the topology.

A ``storage_dtype`` request first stores the DiTs' castable tensors in that dtype (`stored_as`), so the
plan, every byte count and every schedule are in the stored bytes.

A DiT left without blocks under a layerwise strategy is told a `Declaration` that would stream it,
judged from its tensor names (its largest numbered list, else its large children).

Every error is collected; one `PlanError` reports them all. Warnings (`OffloadWarning`) are issued
only when the plan is returned. Components the request does not stream carry no stacks: their
block tensors fold into their remainder.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection

import attrs

from torchferry._errors import Flag, OffloadWarning, Part, PlanError, strategy_named
from torchferry.topology._config import OffloadConfig
from torchferry.topology._model import Component, Declaration, Stack, Topology, join_path
from torchferry.topology._parallel import ParallelLayout
from torchferry.topology._plan import Plan
from torchferry.topology._storage import stored_as

__all__ = ["TEXT_ENCODER", "encoder_type", "resolve", "suggest_declaration"]

TEXT_ENCODER = "text_encoder"
_NO_DIT_SKIP = "No DiT/transformer component was found for layerwise offload of the DiT"


def encoder_type(path: str, declaration: Declaration | None) -> str | None:
    """The public selector type of the encoder at ``path`` (``"text_encoder"`` or ``None``)."""
    if declaration is not None and path in declaration.encoder_component_types:
        return declaration.encoder_component_types[path]
    leaf = path.rsplit(".", 1)[-1]
    return TEXT_ENCODER if leaf.startswith(TEXT_ENCODER) or leaf.endswith(TEXT_ENCODER) else None


def _flat(component: Component, *, selected: bool = False, on_demand: bool = False) -> Component:
    """``component`` without stacks or children: every tensor it owns becomes remainder."""
    return attrs.evolve(
        component,
        tensors=tuple(component.all_tensors()),
        stacks=(),
        children=(),
        selected=selected,
        on_demand=on_demand,
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _block_candidates(component: Component) -> tuple[str, ...]:
    """Attributes of ``component`` that could form its ring, judged from its tensor names alone.

    Numbered children (``layers.0``, ``layers.1``) make a list; the one holding most bytes wins.
    Without any, the direct children that each hold at least 1/8 of the largest child's bytes,
    in tensor order, each one block.
    """
    prefix = f"{component.path}." if component.path else ""
    lists: dict[str, int] = {}
    children: dict[str, int] = {}
    for tensor in component.all_tensors():
        name = tensor.name.removeprefix(prefix)
        parts = name.split(".")
        if len(parts) > 1:
            children[parts[0]] = children.get(parts[0], 0) + tensor.nbytes
        for i in range(1, len(parts) - 1):
            if parts[i].isdigit():
                head = ".".join(parts[:i])
                lists[head] = lists.get(head, 0) + tensor.nbytes
                break
    if lists:
        return (max(lists, key=lambda k: lists[k]),)
    if not children:
        return ()
    largest = max(children.values())
    picked = tuple(name for name, nbytes in children.items() if nbytes * 8 >= largest)
    return picked if len(picked) > 1 else ()


def declared_blocks(path: str) -> Flag:
    """The request that names a component's block lists: ``Declaration.block_attrs[path]`` in the API,
    ``--block-attrs`` on the command line."""
    return Flag(f"Declaration.block_attrs[{path!r}]", "--block-attrs")


def suggest_declaration(component: Component) -> tuple[Part, ...]:
    """``; for example pass declaration=Declaration(...)`` (``--block-attrs ...`` on the command line)
    naming a ring that would stream, as message parts; ``()`` when nothing would."""
    found = _block_candidates(component)
    if not found:
        return ()
    listed = ",".join(join_path(component.path, a) for a in found)
    request = Flag(
        f"declaration=Declaration(block_attrs={{{component.path!r}: {found!r}}})", f"--block-attrs {listed}"
    )
    tail = " listing the block lists (or single blocks) in the order its forward runs them"
    return ("; for example pass ", request, tail)


@attrs.define
class _Resolver:
    topology: Topology
    config: OffloadConfig
    #: Each problem: text, or parts naming request fields (`Flag`) in either caller's words.
    errors: list[str | tuple[Part, ...]] = attrs.field(factory=list)
    warnings: list[str | OffloadWarning] = attrs.field(factory=list)

    @property
    def declaration(self) -> Declaration:
        return self.topology.declaration or Declaration()

    def report(self, strict: bool, error: str | tuple[Part, ...], warning: str | tuple[Part, ...]) -> None:
        """One problem: ``error`` when the request is strict about it, else ``warning`` (each text, or
        parts naming request fields)."""
        if strict:
            self.errors.append(error)
        else:
            self.warnings.append(warning if isinstance(warning, str) else OffloadWarning.worded(*warning))

    # -----------------------------------------------------------------------------------------

    def selection(self) -> None:
        """Rule 1: explicit requests must find what they name."""
        config, topo = self.config, self.topology
        if not config.explicit:
            return
        dits, encoders = topo.of_kind("dit"), topo.of_kind("encoder")
        where = topo.pipeline_class or "this pipeline"
        kind, _, path = topo.source.partition(":")
        stored = kind in ("checkpoint", "folder")
        if stored:
            where = f"the checkpoint {path}" if not topo.pipeline_class else f"{where} at {path}"

        def declare(attr: str) -> str:
            if stored:  # nothing to declare: the files hold what they hold
                return "plan a checkpoint that holds the whole pipeline (a diffusers pipeline folder)"
            return f"declare it in {attr}"

        if config.strategy == "model_level":
            if not dits:
                self.errors.append(
                    f"model_level offload with explicit components swaps a DiT against the encoders, "
                    f"but {where} has no DiT component; {declare('_dit_modules')}"
                )
            if not encoders:
                self.errors.append(
                    f"model_level offload with explicit components swaps the DiT against an encoder "
                    f"stage, but {where} has no encoder component; {declare('_encoder_modules')}"
                )
        elif config.offloads("dit") and not dits:
            self.errors.append(
                f"'dit' is selected but {where} has no DiT component; {declare('_dit_modules')} or "
                "remove 'dit' from components"
            )
        if config.offloads("text_encoder") and not any(
            encoder_type(e.path, self.topology.declaration) == TEXT_ENCODER for e in encoders
        ):
            found = ", ".join(repr(e.path) for e in encoders) or "none"
            self.errors.append(
                f"'text_encoder' is selected but {where} has no text encoder (encoders found: {found}); "
                "type one with Declaration.encoder_component_types or remove 'text_encoder' from "
                "components"
            )
        if config.offloads("vae") and not topo.of_kind("vae"):
            self.errors.append(
                f"'vae' is selected but {where} has no VAE component; declare it in _vae_modules or "
                "remove 'vae' from components"
            )

    def resident_paths(self) -> None:
        """Rule 2: resident layers need a declared resident DiT, and a DiT ring to head."""
        config = self.config
        if not config.resident_layers:
            return
        if not (config.layerwise and config.offloads("dit")):
            why = (
                f"strategy={config.strategy!r} streams no block ring"
                if not config.layerwise
                else "the DiT is not selected (components=)"
            )
            message = (
                f"resident_layers={config.resident_layers} keeps the leading blocks of a streamed DiT on the "
                f"device, and {why}"
            )
            self.report(config.explicit, f"{message}; set resident_layers=0", f"{message}; it is ignored")
            return
        dit_paths = {d.path for d in self.topology.of_kind("dit")}
        heads = self.declaration.resident_dit_paths & dit_paths
        if heads:
            for path in sorted(dit_paths - heads):
                self.warnings.append(
                    f"resident_layers={config.resident_layers} applies to the DiTs declared in "
                    f"Declaration.resident_dit_paths ({', '.join(repr(p) for p in sorted(heads))}); "
                    f"{path!r} is not declared there, so all its blocks stream"
                )
            return
        declared = ", ".join(repr(p) for p in sorted(self.declaration.resident_dit_paths)) or "none"
        message = (
            f"resident_layers={config.resident_layers} was requested, but no DiT of this pipeline is "
            f"declared in Declaration.resident_dit_paths (declared: {declared}; DiTs: "
            f"{', '.join(repr(p) for p in sorted(dit_paths)) or 'none'})"
        )
        self.report(
            config.explicit,
            f"{message}; declare the DiT there or set resident_layers=0",
            f"{message}; all blocks will stream",
        )

    def on_demand_lifecycle(self, component: Component) -> None:
        """Rule 9."""
        if not component.has_lifecycle:
            self.errors.append(
                f"Component {component.path!r} is declared on-demand (Declaration."
                f"on_demand_component_paths) but {component.class_name or 'its module'} has no "
                "load_to_device/offload_to_cpu; define both methods or remove it from "
                "on_demand_component_paths"
            )

    # -----------------------------------------------------------------------------------------

    def dit(self, dit: Component) -> Component:
        """Rules 3-5 for one DiT."""
        config = self.config
        selected = config.strategy != "none" and config.offloads("dit")
        if not (selected and config.layerwise):
            return _flat(dit, selected=selected)
        explicit, cls = config.explicit, dit.class_name or "its class"
        for problem in dit.problems:
            self.report(
                explicit,
                (
                    f"Selected DiT {dit.path!r}: {problem}; fix ",
                    declared_blocks(dit.path),
                    f" or {cls}._layerwise_offload_blocks_attrs",
                ),
                f"DiT {dit.path!r}: {problem}; that attribute is skipped",
            )
        if not dit.blocks:
            hint = suggest_declaration(dit)
            if explicit and not dit.problems:
                self.errors.append(
                    (
                        f"Selected DiT {dit.path!r} ({cls}) has no streamable blocks; declare them with "
                        f"{cls}._layerwise_offload_blocks_attrs or ",
                        declared_blocks(dit.path),
                        *hint,
                    )
                )
            elif not explicit:
                self.warnings.append(
                    OffloadWarning.worded(
                        f"DiT {dit.path!r} ({cls}) has no streamable blocks; it is not offloaded and stays "
                        "resident",
                        *hint,
                    )
                )
            return _flat(dit, selected=selected)

        stacks: list[Stack] = []
        for index, stack in enumerate(dit.stacks):
            count = len(stack.blocks)
            head = 0
            if index == 0 and dit.path in self.declaration.resident_dit_paths:
                head = min(config.resident_layers, count)
            if count - head == 1:
                if explicit and config.distributed:
                    self.errors.append(
                        f"Selected DiT {dit.path!r} leaves exactly one streaming block of {count} after "
                        f"resident_layers={head}; choose a resident count that leaves zero or at least "
                        "two streaming blocks"
                    )
                elif explicit:
                    self.errors.append(
                        f"Selected DiT {dit.path!r} requires at least two streaming blocks for layerwise "
                        f"offload, but {count} block(s) with resident_layers={head} leave one; declare "
                        "more blocks or change resident_layers"
                    )
                elif config.distributed:
                    self.warnings.append(
                        f"DiT {dit.path!r} ({cls}) would stream a single block, which cannot form a "
                        f"ring; all {count} blocks stay resident"
                    )
                    head = count
                else:
                    self.warnings.append(
                        f"DiT {dit.path!r} ({cls}) would stream a single block, which cannot form a "
                        "ring; it is not offloaded and stays resident"
                    )
                    return _flat(dit, selected=selected)
            stacks.append(attrs.evolve(stack, resident_head=head))

        tensors = dit.tensors
        children: list[Component] = []
        if config.distributed:
            children = [self.child(child) for child in dit.children]
        else:
            tensors = tensors + tuple(t for child in dit.children for t in child.all_tensors())
        return attrs.evolve(dit, selected=selected, stacks=stacks, children=children, tensors=tensors)

    def child(self, child: Component) -> Component:
        """Rule 5: a large DiT child under the distributed strategy."""
        for problem in child.problems:
            self.warnings.append(f"DiT child {child.path!r}: {problem}")
        if not child.stacks and not child.has_lifecycle:
            name = child.path.rsplit(".", 1)[-1]
            self.errors.append(
                f"DiT child {child.path!r} ({child.class_name}, {_mib(child.nbytes)}) owns its residency "
                "but has neither its own block ring nor load_to_device/offload_to_cpu; declare its "
                f"block list in Declaration.offload_submodules[{name!r}] or give it a lifecycle"
            )
        return attrs.evolve(child, selected=True, on_demand=not child.stacks)

    # -----------------------------------------------------------------------------------------

    def encoder(self, encoder: Component) -> Component:
        """Rules 6-9 for one encoder."""
        config, declaration = self.config, self.declaration
        kind = encoder_type(encoder.path, self.topology.declaration)
        if kind is not None and kind != TEXT_ENCODER:
            self.errors.append(
                f"Declaration.encoder_component_types maps encoder {encoder.path!r} to {kind!r}; the "
                f"only encoder component type is {TEXT_ENCODER!r}"
            )
            return _flat(encoder)
        if config.strategy == "none":
            selected = False
        elif config.explicit:
            selected = kind == TEXT_ENCODER and config.offloads("text_encoder")
        elif config.strategy == "model_level":
            selected = True
        else:
            selected = (
                encoder.path in declaration.encoder_block_attrs
                or encoder.path in declaration.on_demand_component_paths
            )
        if not (selected and config.layerwise):
            return _flat(encoder, selected=selected)

        on_demand = encoder.path in declaration.on_demand_component_paths
        if on_demand:
            self.on_demand_lifecycle(encoder)
        group = config.dp_size if config.uses_allgather("text_encoder") else 1
        if group > 1 and encoder.path not in declaration.encoder_dlo_weight_replication:
            self.errors.append(
                f"Text encoder {encoder.path!r} cannot all-gather across the {group} ranks of the shard "
                "group: Declaration.encoder_dlo_weight_replication does not declare its weights "
                "identical on every rank; set encoder_transfer='rank-local' "
                "(layer_options.text_encoder.weight_transfer='rank-local') for tensor-parallel or "
                "rank-specific encoders, or declare the replication"
            )
            return _flat(encoder, selected=selected, on_demand=on_demand)

        strict = config.explicit or group > 1
        for problem in () if encoder.stub else encoder.problems:
            self.report(
                strict,
                f"Encoder {encoder.path!r}: {problem}; fix Declaration.encoder_block_attrs[{encoder.path!r}]",
                f"Encoder {encoder.path!r}: {problem}; that block path is skipped",
            )
        declared = encoder.path in declaration.encoder_block_attrs
        has_plan = bool(encoder.stacks) or (encoder.stub and declared)
        if on_demand and not has_plan and config.uses_allgather("text_encoder"):
            self.errors.append(
                f"Text encoder {encoder.path!r} is on-demand without streamable block stacks, so it "
                "cannot all-gather; declare Declaration.encoder_block_attrs"
                f"[{encoder.path!r}] or set encoder_transfer='rank-local'"
            )
        if config.explicit and not (has_plan or on_demand or encoder.problems):
            self.errors.append(
                f"Selected text encoder {encoder.path!r} has neither declared block stacks nor an "
                f"on-demand lifecycle; declare Declaration.encoder_block_attrs[{encoder.path!r}] or "
                "list it in Declaration.on_demand_component_paths"
            )
        return attrs.evolve(encoder, selected=selected, on_demand=on_demand, children=())

    def vae(self, vae: Component) -> Component:
        """VAEs: selectable only explicitly; layerwise staging needs a declared lifecycle."""
        config, declaration = self.config, self.declaration
        declared = vae.path in declaration.on_demand_component_paths
        if config.strategy == "none":
            return _flat(vae)
        if config.explicit and config.offloads("vae"):
            if not config.layerwise:
                return _flat(vae, selected=True)
            if not declared:
                self.errors.append(
                    f"Selected VAE {vae.path!r} needs a pipeline-owned lifecycle under {config.strategy} "
                    "offload; list it in Declaration.on_demand_component_paths and define "
                    "load_to_device/offload_to_cpu, or remove 'vae' from components"
                )
                return _flat(vae, selected=True)
            self.on_demand_lifecycle(vae)
            return _flat(vae, selected=True, on_demand=True)
        if config.layerwise and not config.explicit and declared:
            self.on_demand_lifecycle(vae)
            return _flat(vae, on_demand=True)
        return _flat(vae)

    # -----------------------------------------------------------------------------------------

    def model_level_stage(self) -> None:
        """Rule 12: model-level offload that would swap nothing says so, with what would stream."""
        topo = self.topology
        where = topo.pipeline_class or "this pipeline"
        dits = topo.of_kind("dit")
        if not dits:
            self.warnings.append(
                f"model_level offload swaps DiTs against encoders, but {where} has no DiT component, so "
                "nothing is moved; declare the DiT in _dit_modules (see "
                "torchferry.topology.SupportsComponentDiscovery)"
            )
        elif not topo.of_kind("encoder"):
            paths = ", ".join(repr(d.path) for d in dits)
            streams = [d for d in dits if d.blocks]
            fix = (
                (" to stream its blocks instead",)
                if streams
                else (" with a declared ring", *suggest_declaration(dits[0]))
            )
            self.warnings.append(
                OffloadWarning.worded(
                    f"model_level offload swaps DiTs against encoders, but {where} has no encoder component: "
                    f"each DiT ({paths}) is staged whole onto the device for its forward and nothing else is "
                    "offloaded; use ",
                    strategy_named("layerwise"),
                    *fix,
                )
            )

    def ownership(self, components: tuple[Component, ...]) -> None:
        """Rule 11: each streamed block belongs to one component."""
        owners: dict[str, str] = {}
        for top in components:
            for component in top.walk():
                for block in component.blocks:
                    owner = owners.setdefault(block.path, component.path)
                    if owner != component.path:
                        self.errors.append(
                            f"Block {block.path!r} is claimed by both {owner!r} and {component.path!r}; "
                            "declare one owner for each block list"
                        )
                        return

    def session(self, world: int | None, fill: Collection[str] | None) -> None:
        """Rules 13 and 14: the request against the process group and the checkpoint's components."""
        config = self.config
        gathers = "allgather" in (config.dit_transfer, config.encoder_transfer)
        size = config.parallel.shard_group_size
        if world is not None and config.distributed and gathers and size != world:
            self.errors.append(
                f"the parallel layout gives a weight-shard group of {size} ranks but the process group has "
                f"{world}; pass the group whose ranks share one copy of the weights, or fix the layout"
            )
        if fill is None:
            return
        if config.checkpoint is None:
            self.errors.append(
                "checkpoint_components= says which components to fill from the checkpoint, and no "
                "checkpoint= was given; pass checkpoint=, or drop checkpoint_components="
            )
            return
        tops = [c.path for c in self.topology.components]
        unknown = sorted(set((fill,) if isinstance(fill, str) else fill) - set(tops))
        if unknown:
            self.errors.append(
                f"checkpoint_components names {', '.join(map(repr, unknown))}, which this plan has no "
                f"top-level component for; its components are {', '.join(map(repr, tops)) or '(none)'}"
            )


def own_weights(plan: Plan, fill: Collection[str] | str | None) -> frozenset[str]:
    """The top-level components of ``plan`` that keep their own weights although a checkpoint is
    given: those ``fill`` (``checkpoint_components=``, the components to read from the checkpoint;
    ``None``: all) leaves out. None without a checkpoint: every component then keeps its own (rule 14
    refuses a ``fill`` without a checkpoint, or one naming no component)."""
    if fill is None or plan.config.checkpoint is None:
        return frozenset()
    named = {fill} if isinstance(fill, str) else set(fill)
    return frozenset(c.path for c in plan.components if c.path not in named)


def _sized_to(config: OffloadConfig, world: int | None) -> OffloadConfig:
    """Rule 13's default: an all-gathering distributed request whose parallel layout is left at one
    rank takes a weight-shard group of ``world`` ranks (the process group's size); any other request
    is returned as it is."""
    gathers = "allgather" in (config.dit_transfer, config.encoder_transfer)
    if world is None or world <= 1 or not (config.distributed and gathers):
        return config
    if config.parallel.shard_group_size != 1:
        return config
    return attrs.evolve(config, parallel=ParallelLayout(data_parallel_size=world))


def resolve(
    topology: Topology,
    config: OffloadConfig,
    *,
    world: int | None = None,
    checkpoint_components: Collection[str] | None = None,
) -> Plan:
    """Resolve and validate ``topology`` under ``config`` (see the module's numbered rules).

    Pure and deterministic: reads its arguments only and returns equal plans for equal inputs.
    Raises `PlanError` listing every problem; otherwise issues the legacy warnings
    (`OffloadWarning`) and returns the `Plan`. ``world`` (the size of the session's weight-shard
    process group) and ``checkpoint_components`` are checked against the request (rules 13, 14);
    ``None`` checks nothing.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"resolve() needs a Topology, got {type(topology).__name__}")
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"resolve() needs an OffloadConfig, got {type(config).__name__}")
    if config.storage_dtype is not None:
        topology = stored_as(topology, config.storage_dtype)  # the bytes that move are the stored ones
    config = _sized_to(config, world)
    r = _Resolver(topology, config)
    r.selection()
    r.resident_paths()
    resolved: list[Component] = []
    for component in topology.components:
        if component.kind == "dit":
            resolved.append(r.dit(component))
        elif component.kind == "encoder":
            resolved.append(r.encoder(component))
        elif component.kind == "vae":
            resolved.append(r.vae(component))
        else:
            resolved.append(_flat(component, selected=False, on_demand=False))

    if config.strategy == "model_level" and not config.explicit:
        r.model_level_stage()
    skip_reason = None
    if config.strategy == "layerwise" and config.offloads("dit") and not topology.of_kind("dit"):
        skip_reason = _NO_DIT_SKIP
        r.warnings.append(f"{skip_reason}; layerwise offload is skipped and nothing is moved")
        resolved = [_flat(c, selected=False, on_demand=False) for c in resolved]
    r.ownership(tuple(resolved))
    r.session(world, checkpoint_components)

    if r.errors:
        problems = [(e,) if isinstance(e, str) else e for e in r.errors]
        if len(problems) == 1:
            raise PlanError.worded(*problems[0])
        listing = [part for problem in problems for part in ("\n  - ", *problem)]
        raise PlanError.worded(f"{len(problems)} problems with this offload request:", *listing)
    for message in r.warnings:
        if isinstance(message, OffloadWarning):
            warnings.warn(message, stacklevel=2)
        else:
            warnings.warn(message, OffloadWarning, stacklevel=2)
    return Plan(topology=topology, config=config, components=resolved, skip_reason=skip_reason)
