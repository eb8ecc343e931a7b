"""`discover`: a pipeline's components read from the ``nn.Module`` objects it holds.

Discovery is independent of any offload request: it records every candidate the resolver may
need (every DiT stack, every declared encoder stack, every large DiT child) and leaves the choice
to `resolve`. It reads module attributes and tensor metadata only, so it works on meta tensors and
never moves, allocates or writes anything. This module finds the components (declared lists, a
known pipeline class, a ``components`` mapping, or the deprecated scan); `_blocks` finds their
rings and `_owners` their tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from torchferry._errors import OffloadWarning, PlanError
from torchferry.topology import _registry
from torchferry.topology._blocks import (
    Skeleton,
    declares_block_attrs,
    dit_skeleton,
    encoder_skeleton,
    structural_block_attrs,
)
from torchferry.topology._model import ComponentKind, Declaration, Topology
from torchferry.topology._owners import build_components
from torchferry.topology._protocol import SupportsComponentDiscovery
from torchferry.topology._reading import Missing, describe, get_path, qualname, warn_once

__all__ = [
    "LEGACY_DIT_ATTRS",
    "LEGACY_ENCODER_ATTRS",
    "LEGACY_VAE_ATTRS",
    "check_stranded",
    "discover",
]

#: Attribute names the deprecated scan tries on a pipeline that does not declare its components.
LEGACY_DIT_ATTRS = (
    "transformer",
    "transformer_2",
    "dit",
    "sr_dit",
    "language_model",
    "transformer_blocks",
    "model",
)
LEGACY_ENCODER_ATTRS = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder", "mllm")
LEGACY_VAE_ATTRS = ("vae", "audio_vae")


# ---------------------------------------------------------------------------------------------
# The pipeline's declaration and component lists


def _declaration_of(pipeline: object, declaration: Declaration | None) -> Declaration | None:
    if declaration is not None:
        if not isinstance(declaration, Declaration):
            raise TypeError(
                f"discover(declaration=...) must be a torchferry.topology.Declaration, "
                f"got {type(declaration).__name__}"
            )
        return declaration
    found: object = getattr(pipeline, "_offload_plan", None)
    origin = "_offload_plan"
    if found is None:
        getter = getattr(pipeline, "get_offload_plan", None)
        if callable(getter):
            found = getter()
            origin = "get_offload_plan()"
    if found is None:
        return None
    if not isinstance(found, Declaration):
        raise TypeError(
            f"{qualname(type(pipeline))}.{origin} must be a torchferry.topology.Declaration, "
            f"got {type(found).__name__}; build one with Declaration(block_attrs=..., ...)"
        )
    return found


def _declared_list(pipeline: object, list_name: str) -> list[tuple[str, nn.Module]]:
    """The modules a ``_*_modules`` class list names, warning about unusable entries."""
    entries = getattr(pipeline, list_name, None) or ()
    if isinstance(entries, str):
        entries = (entries,)
    pipeline_class = qualname(type(pipeline))
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for entry in entries:
        if not isinstance(entry, str):
            warnings.warn(
                f"{pipeline_class}.{list_name} entry {entry!r} is not a dotted attribute path; it is ignored",
                OffloadWarning,
                stacklevel=3,
            )
            continue
        try:
            module = get_path(pipeline, entry)
            what = f"is {describe(module)}"
        except Missing:
            module, what = None, "does not exist"
        if not isinstance(module, nn.Module):
            warnings.warn(
                f"{pipeline_class}.{list_name} names {entry!r}, which {what}, not an nn.Module; "
                "it is ignored",
                OffloadWarning,
                stacklevel=3,
            )
            continue
        if id(module) not in seen:
            seen.add(id(module))
            found.append((entry, module))
    return found


def _scanned_list(pipeline: object, names: Sequence[str]) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for name in names:
        module = getattr(pipeline, name, None)
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue  # a block list of the model itself, never a component
        if isinstance(module, nn.Module) and id(module) not in seen:
            seen.add(id(module))
            found.append((name, module))
    return found


def _kind_of(name: str, module: nn.Module) -> ComponentKind:
    """The kind of a pipeline component, from its class's package and its name."""
    packages = [c.__module__ for c in type(module).__mro__]
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith("vae") or leaf.endswith("vae") or any(".autoencoders" in p for p in packages):
        return "vae"
    if leaf in LEGACY_DIT_ATTRS or any(
        p.startswith(("diffusers.models.transformers", "diffusers.models.unets")) for p in packages
    ):
        return "dit"
    if "encoder" in leaf or any(p.split(".")[0] == "transformers" for p in packages):
        return "encoder"
    return "resident"


def _mapped_components(
    pipeline: object, skip: Sequence[nn.Module] = ()
) -> dict[ComponentKind, list[tuple[str, nn.Module]]] | None:
    """The components a pipeline lists in its own ``components`` mapping (every diffusers pipeline does).

    Each module the mapping names is a component, under the attribute it is stored at: a diffusers
    model from ``diffusers.models.transformers``/``unets`` (or a ``transformer``/``unet`` name) is a
    DiT, an autoencoder (or a ``vae`` name) a VAE, a transformers model (or an ``*encoder*`` name) an
    encoder, anything else (a ControlNet, an adapter) stays resident.
    """
    if isinstance(pipeline, nn.Module):
        return None
    mapping = getattr(pipeline, "components", None)
    if not isinstance(mapping, Mapping):
        return None
    lists: dict[ComponentKind, list[tuple[str, nn.Module]]] = {
        "dit": [],
        "encoder": [],
        "vae": [],
        "resident": [],
    }
    seen: set[int] = {id(m) for m in skip}
    for name in mapping:
        module = getattr(pipeline, name, None) if isinstance(name, str) else None
        # Only modules stored at the attribute they are listed under: the runtime finds them by path.
        if not isinstance(module, nn.Module) or module is not mapping[name] or id(module) in seen:
            continue
        seen.add(id(module))
        lists[_kind_of(name, _unwrap(module))].append((name, module))
    return lists if any(lists.values()) else None


def _mapped_declaration(lists: Mapping[ComponentKind, list[tuple[str, nn.Module]]]) -> Declaration:
    """The `Declaration` of a pipeline found from its ``components`` mapping.

    Like the known pipelines' declarations: every DiT may keep resident blocks; every text encoder
    (a ``text_encoder`` name) is a selector, streams its known block paths (else those found from
    structure, each its own ring) and is declared replicated. DiT rings are left to the model class,
    the registry or structure.
    """
    types: dict[str, str] = {}
    encoder_blocks: dict[str, tuple[str, ...]] = {}
    for path, module in lists["encoder"]:
        leaf = path.rsplit(".", 1)[-1]
        if not (leaf.startswith("text_encoder") or leaf.endswith("text_encoder")):
            continue
        types[path] = "text_encoder"
        inner = _unwrap(module)
        paths = _registry.encoder_block_attrs_for(type(inner))
        if paths is None or not all(_present(inner, p) for p in paths):
            paths = structural_block_attrs(inner)
        if paths:
            encoder_blocks[path] = paths
    return Declaration(
        resident_dit_paths=[path for path, _ in lists["dit"]],
        encoder_component_types=types,
        encoder_block_attrs=encoder_blocks,
        encoder_dlo_weight_replication=tuple(types),
    )


def _joined(first: Declaration, second: Declaration) -> Declaration:
    """``first`` with the entries of ``second`` (about other components) added."""
    return Declaration(
        block_attrs={**second.block_attrs, **first.block_attrs},
        offload_submodules={**second.offload_submodules, **first.offload_submodules},
        resident_dit_paths=first.resident_dit_paths | second.resident_dit_paths,
        on_demand_component_paths=first.on_demand_component_paths | second.on_demand_component_paths,
        encoder_component_types={**second.encoder_component_types, **first.encoder_component_types},
        encoder_block_attrs={**second.encoder_block_attrs, **first.encoder_block_attrs},
        encoder_dlo_weight_replication=first.encoder_dlo_weight_replication
        | second.encoder_dlo_weight_replication,
    )


def _unmanaged(pipeline: object, managed: Mapping[int, str]) -> list[tuple[str, str]]:
    """Every component the pipeline's ``components`` lists that is not managed, with the reason."""
    mapping = None if isinstance(pipeline, nn.Module) else getattr(pipeline, "components", None)
    if not isinstance(mapping, Mapping):
        return []
    found: list[tuple[str, str]] = []
    paths = set(managed.values())
    for key, value in mapping.items():
        name = str(key)
        if name in paths:
            continue
        if value is None:
            found.append((name, "absent (None)"))
        elif isinstance(value, nn.Module) and id(value) in managed:
            found.append((name, f"the same module as {managed[id(value)]!r}, managed there"))
        elif isinstance(value, nn.Module) and getattr(pipeline, name, None) is value:
            found.append((name, f"a {qualname(type(value))} its declared component lists leave out"))
        elif isinstance(value, nn.Module):
            found.append((name, f"a {qualname(type(value))} not stored at the pipeline's attribute {name!r}"))
        else:
            found.append((name, f"a {type(value).__name__}, which holds no module weights"))
    return found


def check_stranded(pipeline: object, topo: Topology, device: torch.device) -> None:
    """Refuse a component ``topo`` leaves unmanaged whose tensors are off the session's ``device``.

    Such a component would receive the session's tensors while its weights stay put (an image
    encoder on the host while the pipeline runs on a GPU); a `PlanError` names each one before
    anything moves. Tensors on ``meta`` count as elsewhere unless ``device`` is meta. A resident
    component is managed: every policy stages it whole on its first forward and keeps it on the
    device, from the host or from a checkpoint (LTX-2's pipeline-local ``connectors`` and
    ``vocoder``, built on meta by `from_pretrained`), so wherever its tensors are it is no such case.
    """
    mapping = None if isinstance(pipeline, nn.Module) else getattr(pipeline, "components", None)
    found: list[tuple[str, str, object]] = []
    if isinstance(mapping, Mapping):
        for name, reason in topo.unmanaged:
            if not reason.endswith("managed there"):
                found.append((name, reason, mapping.get(name)))
    problems: list[str] = []
    for name, reason, value in found:
        if not isinstance(value, nn.Module):
            continue
        devices = sorted({str(t.device) for t in (*value.parameters(), *value.buffers())} - {str(device)})
        if devices:
            problems.append(f"{name!r} ({reason}) holds tensors on {', '.join(devices)}")
    if problems:
        raise PlanError(
            f"{qualname(type(pipeline))}: {len(problems)} component(s) torchferry does not manage would stay "
            f"off the session's device {device} and receive its tensors: {'; '.join(problems)}; list each "
            "in the pipeline's _dit_modules/_encoder_modules/_vae_modules/_resident_modules, or move it to "
            f"{device} yourself before offload()"
        )


def _present(module: nn.Module, dotted: str) -> bool:
    try:
        return isinstance(get_path(module, dotted), nn.Module)
    except Missing:
        return False


def _registry_pipeline(pipeline: object) -> tuple[tuple[str, ComponentKind], ...] | None:
    """``(path, kind)`` of the components of a known diffusers pipeline class (or a subclass), else None."""
    if isinstance(pipeline, nn.Module):
        return None
    return _registry.pipeline_components(type(pipeline))


def _unwrap(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) runs, else ``module`` itself.

    The wrapper forwards attribute reads to ``_orig_mod`` and calls it from its own forward, so the
    original module's paths and hooks serve the compiled one too.
    """
    for _ in range(8):  # a wrapper of a wrapper, never a cycle
        inner = module._modules.get("_orig_mod")
        if type(module).__name__ != "OptimizedModule" or inner is None:
            break
        module = inner
    return module


def _is_bare_model(module: nn.Module, scanned: list[tuple[str, nn.Module]]) -> bool:
    """Whether an undeclared ``nn.Module`` is a model of its own rather than a container of components.

    A container holds nothing but its components; a model has tensors of its own outside whatever
    the legacy attribute names found (a ``transformer`` attribute inside a model is a part of it).
    """
    inside = {id(t) for _, c in scanned for t in (*c.parameters(), *c.buffers())}
    own = [t for t in (*module.parameters(), *module.buffers()) if id(t) not in inside]
    return bool(own) or not scanned


# ---------------------------------------------------------------------------------------------


def discover(pipeline: object, declaration: Declaration | None = None) -> Topology:
    """Describe ``pipeline`` as a `Topology`, reading module structure and tensor metadata only.

    ``pipeline`` is an ``nn.Module`` or any object whose attributes are components (diffusers
    pipelines are not modules), or a bare model whose own class declares block attributes (then
    it is the one DiT, with path ``""``).

    Components come from the pipeline's ``_dit_modules``, ``_encoder_modules``, ``_vae_modules``
    and ``_resident_modules`` lists (`SupportsComponentDiscovery`), else from the deprecated
    attribute scan. The declaration is ``declaration``, else the pipeline's ``_offload_plan``, else
    its ``get_offload_plan()``. A DiT's ring comes from ``declaration.block_attrs[path]``, else the
    model class's ``_layerwise_offload_blocks_attrs`` (several attributes make one ring, in
    order), else the deprecated ``_layerwise_offload_blocks_attr``, else the registry of known
    model classes. Every tensor gets exactly one owner; tied tensors are one spec with aliases.
    """
    declaration = _declaration_of(pipeline, declaration)
    declares = isinstance(pipeline, SupportsComponentDiscovery)
    known = None if declares else _registry_pipeline(pipeline)
    mapped = None if declares or known is not None else _mapped_components(pipeline)
    lists: dict[ComponentKind, list[tuple[str, nn.Module]]]
    if known is not None:
        declares = True
        lists = {"dit": [], "encoder": [], "vae": [], "resident": []}
        for path, kind in known:
            module = getattr(pipeline, path, None)
            if isinstance(module, nn.Module):
                lists[kind].append((path, module))
        # The registry's paths get its kinds and declaration; every other module the pipeline lists
        # in its ``components`` (an image encoder, a second text encoder) is managed as if mapped.
        extra = _mapped_components(pipeline, skip=[m for entries in lists.values() for _, m in entries])
        for kind, entries in (extra or {}).items():
            lists[kind].extend(entries)
        if declaration is None:
            declaration = _registry.declaration_for_pipeline(
                type(pipeline),
                {path: type(_unwrap(m)).__name__ for entries in lists.values() for path, m in entries},
            )
            if extra is not None and declaration is not None:
                declaration = _joined(declaration, _mapped_declaration(extra))
    elif mapped is not None:
        declares = True
        lists = mapped
        if declaration is None:
            declaration = _mapped_declaration(lists)
    elif declares:
        lists = {
            "dit": _declared_list(pipeline, "_dit_modules"),
            "encoder": _declared_list(pipeline, "_encoder_modules"),
            "vae": _declared_list(pipeline, "_vae_modules"),
            "resident": _declared_list(pipeline, "_resident_modules"),
        }
    else:
        lists = {
            "dit": _scanned_list(pipeline, LEGACY_DIT_ATTRS),
            "encoder": _scanned_list(pipeline, LEGACY_ENCODER_ATTRS),
            "vae": _scanned_list(pipeline, LEGACY_VAE_ATTRS),
            "resident": [],
        }
        scanned = [entry for entries in lists.values() for entry in entries]
        if isinstance(pipeline, nn.Module) and (
            declares_block_attrs(_unwrap(pipeline), declaration) or _is_bare_model(pipeline, scanned)
        ):
            declares = True
            lists = {"dit": [("", pipeline)], "encoder": [], "vae": [], "resident": []}
        elif scanned:
            cls = qualname(type(pipeline))
            warn_once(
                "legacy pipeline",
                cls,
                f"{cls} does not declare its components; torchferry found them by scanning well-known "
                "attribute names, which is deprecated. Declare _dit_modules, _encoder_modules and "
                "_vae_modules (see torchferry.topology.SupportsComponentDiscovery)",
            )
    lists = {kind: [(path, _unwrap(m)) for path, m in entries] for kind, entries in lists.items()}

    component_ids = frozenset(id(m) for entries in lists.values() for _, m in entries)
    canonical: dict[int, str] = {}
    skeletons: list[Skeleton] = []
    for kind, entries in lists.items():
        for path, module in entries:
            if kind == "dit":
                skeletons.append(dit_skeleton(path, module, declaration, component_ids, canonical))
            elif kind == "encoder":
                skeletons.append(encoder_skeleton(path, module, declaration, canonical))
            else:
                skeletons.append(Skeleton(path=path, kind=kind, module=module))

    managed = {id(m): path for entries in lists.values() for path, m in entries}
    return Topology(
        pipeline_class=qualname(type(pipeline)),
        components=build_components(skeletons, component_ids),
        declaration=declaration,
        declares_components=declares,
        source="module",
        unmanaged=_unmanaged(pipeline, managed),
    )
