"""`discover`: the only code that reads an ``nn.Module``.

Discovery is independent of any offload request: it records every candidate the resolver may
need (every DiT stack, every declared encoder stack, every large DiT child) and leaves the choice
to `resolve`. It reads module attributes and tensor metadata only, so it works on meta tensors and
never moves, allocates or writes anything.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence

import attrs
import torch
from torch import nn

from torchferry._errors import OffloadWarning, PlanError, TorchferryDeprecationWarning
from torchferry.topology import _registry
from torchferry.topology._model import (
    DTYPE_SIZES,
    Block,
    Component,
    ComponentKind,
    Declaration,
    Stack,
    TensorSpec,
    Topology,
    find_attr,
    join_path,
)
from torchferry.topology._protocol import SupportsComponentDiscovery

__all__ = [
    "LEGACY_DIT_ATTRS",
    "LEGACY_ENCODER_ATTRS",
    "LEGACY_VAE_ATTRS",
    "NESTED_BLOCK_ATTRS",
    "NESTED_OFFLOAD_THRESHOLD_BYTES",
    "discover",
    "reset_warning_caches",
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
#: Block-list names the deprecated scan tries on a large DiT child without a declared ring.
NESTED_BLOCK_ATTRS = ("layers", "blocks", "h", "model.layers")
#: A DiT child with more parameter bytes than this owns its residency even when nothing declares it.
NESTED_OFFLOAD_THRESHOLD_BYTES = 1024 * 1024 * 1024

# Deprecation warnings are issued once per class (fully qualified name) per process.
_warned_legacy_pipelines: set[str] = set()
_warned_nested_scans: set[str] = set()
_warned_singular_attrs: set[str] = set()


def reset_warning_caches() -> None:
    """Forget which classes were already warned about, so the next discovery warns again."""
    _warned_legacy_pipelines.clear()
    _warned_nested_scans.clear()
    _warned_singular_attrs.clear()


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _warn_once(cache: set[str], key: str, message: str) -> None:
    if key not in cache:
        cache.add(key)
        warnings.warn(message, TorchferryDeprecationWarning, stacklevel=4)


class _Missing(Exception):
    """A dotted attribute path that does not exist."""


def _get_path(root: object, dotted: str) -> object:
    try:
        return find_attr(root, dotted)
    except AttributeError:
        raise _Missing(dotted) from None


def _describe(value: object) -> str:
    if isinstance(value, nn.ModuleList):
        return f"a ModuleList of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"


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
            f"{_qualname(type(pipeline))}.{origin} must be a torchferry.topology.Declaration, "
            f"got {type(found).__name__}; build one with Declaration(block_attrs=..., ...)"
        )
    return found


def _declared_list(pipeline: object, list_name: str) -> list[tuple[str, nn.Module]]:
    """The modules a ``_*_modules`` class list names, warning about unusable entries."""
    entries = getattr(pipeline, list_name, None) or ()
    if isinstance(entries, str):
        entries = (entries,)
    pipeline_class = _qualname(type(pipeline))
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for entry in entries:
        if not isinstance(entry, str):
            warnings.warn(
                f"{pipeline_class}.{list_name} entry {entry!r} is not a dotted attribute path; "
                "it is ignored",
                OffloadWarning,
                stacklevel=3,
            )
            continue
        try:
            module = _get_path(pipeline, entry)
            what = f"is {_describe(module)}"
        except _Missing:
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


def _mapped_components(pipeline: object) -> dict[ComponentKind, list[tuple[str, nn.Module]]] | None:
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
    seen: set[int] = set()
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


def _present(module: nn.Module, dotted: str) -> bool:
    try:
        return isinstance(_get_path(module, dotted), nn.Module)
    except _Missing:
        return False


# ---------------------------------------------------------------------------------------------
# Block attributes of a DiT


def _registry_pipeline(pipeline: object) -> tuple[tuple[str, ComponentKind], ...] | None:
    """``(path, kind)`` of the components of a known diffusers pipeline class (or a subclass), else None."""
    if isinstance(pipeline, nn.Module):
        return None
    return _registry.pipeline_components(type(pipeline))


def _as_attrs(value: str | Iterable[object]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


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


def _module_bytes(module: nn.Module, *, buffers: bool = True) -> int:
    """Bytes of every distinct parameter (and buffer, unless ``buffers`` is false) under ``module``."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *(module.buffers() if buffers else ())):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _is_block_list(module: nn.Module) -> bool:
    """A list of at least two blocks with tensors: a ``ModuleList``, or a ``Sequential`` of one class."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    members = list(module)
    if not all(_holds_tensors(m) for m in members):
        return False
    return isinstance(module, nn.ModuleList) or len({type(m) for m in members}) == 1


#: A block list found from structure joins the ring when it holds at least 1/8 of the largest one's bytes.
STRUCTURAL_SHARE = 8


def structural_block_attrs(module: nn.Module, skip: Iterable[nn.Module] = ()) -> tuple[str, ...]:
    """The block lists of ``module`` found from its structure alone, in registration order.

    A block list is a ``ModuleList`` (or a ``Sequential`` of one class) of at least two modules that
    hold tensors. Only the outermost lists count (a list inside a block is part of that block), and
    of those only the ones nearest the model's root (a list inside an embedder is that embedder's);
    the modules in ``skip`` (other components) are not entered, and a list joins the ring only if it
    holds at least 1/`STRUCTURAL_SHARE` of the largest list's bytes (small helper lists stay in the
    remainder). Several lists form one ring, in the order the model registered them; a model whose
    forward interleaves its lists needs its order declared (the runtime reports the order it ran).
    """
    stop = {id(m) for m in skip}
    found: list[tuple[str, int, int]] = []
    seen: set[int] = set()

    def visit(mod: nn.Module, prefix: str, depth: int) -> None:
        for name, child in mod._modules.items():
            if child is None or id(child) in stop or id(child) in seen:
                continue
            seen.add(id(child))
            path = join_path(prefix, name)
            if _is_block_list(child):
                found.append((path, depth, _module_bytes(child)))
            else:
                visit(child, path, depth + 1)

    visit(module, "", 0)
    if not found:
        return ()
    # The shallowest lists are the model's own; deeper ones belong to an embedder or an encoder
    # inside it (a refiner, a motion encoder) that runs on its own schedule.
    top = min(depth for _, depth, _ in found)
    found = [entry for entry in found if entry[1] == top]
    largest = max(nbytes for _, _, nbytes in found)
    return tuple(path for path, _, nbytes in found if nbytes * STRUCTURAL_SHARE >= largest)


def _dit_block_attrs(
    module: nn.Module, path: str, declaration: Declaration | None, skip: Iterable[nn.Module] = ()
) -> tuple[tuple[str, ...], bool]:
    """The block attributes of one DiT, by precedence (see `discover`), and whether they were declared.

    Attributes that come from the registry or from structure are not the user's words: one that is
    ``None`` on this instance (a UNet built without a mid block) is skipped without a problem.
    """
    if declaration is not None and path in declaration.block_attrs:
        return declaration.block_attrs[path], True
    plural = getattr(module, "_layerwise_offload_blocks_attrs", None)
    if plural is not None:
        return _as_attrs(plural), True
    singular = getattr(module, "_layerwise_offload_blocks_attr", None)
    if singular is not None:
        cls = _qualname(type(module))
        _warn_once(
            _warned_singular_attrs,
            cls,
            f"{cls} declares _layerwise_offload_blocks_attr = {singular!r}; the singular attribute is "
            f"deprecated, declare _layerwise_offload_blocks_attrs = ({singular!r},) instead",
        )
        return _as_attrs(singular), True
    known = _registry.block_attrs_for(type(module))
    if known is not None:
        return known, False
    return structural_block_attrs(module, skip), False


def _declares_block_attrs(module: nn.Module, declaration: Declaration | None) -> bool:
    """Whether ``module`` is a model that declares its blocks (or is a known class)."""
    if declaration is not None and "" in declaration.block_attrs:
        return True
    if any(hasattr(module, a) for a in ("_layerwise_offload_blocks_attrs", "_layerwise_offload_blocks_attr")):
        return True
    return _registry.block_attrs_for(type(module)) is not None


def _is_bare_model(module: nn.Module, scanned: list[tuple[str, nn.Module]]) -> bool:
    """Whether an undeclared ``nn.Module`` is a model of its own rather than a container of components.

    A container holds nothing but its components; a model has tensors of its own outside whatever
    the legacy attribute names found (a ``transformer`` attribute inside a model is a part of it).
    """
    inside = {id(t) for _, c in scanned for t in (*c.parameters(), *c.buffers())}
    own = [t for t in (*module.parameters(), *module.buffers()) if id(t) not in inside]
    return bool(own) or not scanned


def _blocks_of(
    container: object, attr: str, owner_class: str, problems: list[str], *, declared: bool = True
) -> list[tuple[str, nn.Module]]:
    """The blocks one attribute contributes to a DiT ring, each with its path below the attribute.

    A list's blocks are ``attr.0``, ``attr.1``, ...; a ``ModuleDict``'s are ``attr.<key>``; a single
    module (a UNet's ``mid_block``) is one block at ``attr`` itself.
    """
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return [(str(i), m) for i, m in enumerate(container)]
    if isinstance(container, nn.ModuleDict):
        return list(container.items())
    if isinstance(container, nn.Module):
        return [("", container)]
    if isinstance(container, (list, tuple)) and all(isinstance(m, nn.Module) for m in container):
        return [(str(i), m) for i, m in enumerate(container)]
    if container is None and not declared:
        return []
    problems.append(f"block attribute {attr!r} of {owner_class} is {_describe(container)}, not a block list")
    return []


# ---------------------------------------------------------------------------------------------
# Tensors and their owners


@attrs.frozen
class _Occurrence:
    """One qualified name under which a tensor is reachable, and which part of the tree holds it."""

    rank: tuple[int, int, int]  # (component index, 0 remainder | 1 child | 2 block, sequence)
    owner: str  # "" for the remainder, else the child or block path
    component: int
    name: str
    tensor: torch.Tensor = attrs.field(eq=False)
    buffer: bool
    persistent: bool


_Found = tuple[str, torch.Tensor, bool, bool]


def _walk(module: nn.Module, prefix: str, stop: frozenset[int]) -> Iterator[_Found]:
    """``(name, tensor, is_buffer, persistent)`` for every tensor under ``module``, skipping ``stop``."""
    active: set[int] = set()

    def visit(mod: nn.Module, pre: str) -> Iterator[_Found]:
        active.add(id(mod))
        for name, param in mod._parameters.items():
            if param is not None:
                yield join_path(pre, name), param, False, True
        non_persistent = mod._non_persistent_buffers_set
        for name, buf in mod._buffers.items():
            if buf is not None:
                yield join_path(pre, name), buf, True, name not in non_persistent
        for name, child in mod._modules.items():
            if child is None or id(child) in stop or id(child) in active:
                continue
            yield from visit(child, join_path(pre, name))
        active.discard(id(mod))

    yield from visit(module, prefix)


def _check_plain(name: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor torchferry cannot re-point: a wrapper subclass (naming its type), an inference tensor.

    Subclasses that keep ordinary storage and only override ``__torch_function__`` (diffusers'
    ``GGUFParameter``) stream like any parameter; wrapper subclasses that dispatch to inner tensors
    (torchao's quantized tensors, ``DTensor``) have no storage torchferry could move.
    """
    cls = type(tensor)
    if cls in (torch.Tensor, nn.Parameter) or cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        if tensor.is_inference():
            raise PlanError(
                f"Tensor {name!r} was created under torch.inference_mode(), and an inference tensor can "
                "never be re-pointed at torchferry's buffers outside it; build the model outside "
                "inference mode, or give it ordinary tensors first, outside inference mode: "
                "model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)"
            )
        return
    raise PlanError(
        f"Tensor {name!r} is a {_qualname(cls)}, a tensor subclass that keeps its data in inner tensors; "
        "torchferry streams tensors with storage of their own only (torch.Tensor, nn.Parameter and "
        "subclasses without __torch_dispatch__ such as diffusers' GGUFParameter, in any dtype it knows, "
        "float8 included); dequantize it (for a DTensor, full_tensor()) before offloading, or leave its "
        "component out of the offload"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` of ``t`` within its storage."""
    size = int(t.element_size())
    start = int(t.storage_offset()) * size
    if t.numel() == 0:
        return start, start
    span = 1 + sum((int(d) - 1) * int(s) for d, s in zip(t.shape, t.stride(), strict=True))
    return start, start + span * size


def _storage_key(t: torch.Tensor) -> tuple[object, ...]:
    storage = t.untyped_storage()
    if storage.nbytes() == 0 and t.device.type != "meta":
        return ("tensor", id(t))
    if t.device.type == "meta":
        return ("meta", storage._cdata)
    return (str(t.device), storage.data_ptr())


def _assign_owners(occurrences: list[_Occurrence]) -> dict[int, list[tuple[_Occurrence, tuple[str, ...]]]]:
    """Group occurrences of one tensor, pick its one owner, reject overlapping distinct views.

    Returns, per component index, the owning occurrences with their aliases. The owner is the
    occurrence with the lowest rank: the earliest component, then its remainder before its
    children before its blocks (a weight the remainder also uses must not be evicted with a block).
    """
    by_storage: dict[tuple[object, ...], dict[tuple[object, ...], list[_Occurrence]]] = {}
    for occ in occurrences:
        t = occ.tensor
        view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        by_storage.setdefault(_storage_key(t), {}).setdefault(view, []).append(occ)

    owned: dict[int, list[tuple[_Occurrence, tuple[str, ...]]]] = {}
    for views in by_storage.values():
        if len(views) > 1:
            spans = sorted(
                ((*_extent(group[0].tensor), group[0].name) for group in views.values()),
                key=lambda s: (s[0], s[1], s[2]),
            )
            reach, reach_name = -1, ""
            for start, end, name in spans:
                if start < end:
                    if start < reach:
                        raise PlanError(
                            f"Tensors {reach_name!r} and {name!r} are different views of overlapping "
                            "bytes of one storage; torchferry moves whole tensors, so give each "
                            "parameter and buffer its own storage (clone one of them) or tie them as "
                            "the same tensor"
                        )
                    if end > reach:
                        reach, reach_name = end, name
        for group in views.values():
            owner = min(group, key=lambda o: o.rank)
            aliases: list[str] = []
            for occ in sorted(group, key=lambda o: o.rank):
                if occ.name != owner.name and occ.name not in aliases:
                    aliases.append(occ.name)
            owned.setdefault(owner.component, []).append((owner, tuple(aliases)))
    for entries in owned.values():
        entries.sort(key=lambda e: e[0].rank)
    return owned


def _spec(occ: _Occurrence, aliases: tuple[str, ...]) -> TensorSpec:
    dtype = _dtype_name(occ.tensor.dtype)
    if dtype not in DTYPE_SIZES:
        known = ", ".join(sorted(DTYPE_SIZES))
        raise PlanError(
            f"Tensor {occ.name!r} has dtype {dtype}, which torchferry cannot stream; "
            f"convert it to one of {known}"
        )
    return TensorSpec(
        name=occ.name,
        shape=tuple(occ.tensor.shape),
        dtype=dtype,
        buffer=occ.buffer,
        persistent=occ.persistent,
        aliases=aliases,
    )


# ---------------------------------------------------------------------------------------------
# Component skeletons: which module subtrees are blocks, children and remainder


@attrs.define
class _Skeleton:
    path: str
    kind: ComponentKind
    module: nn.Module
    stacks: list[tuple[tuple[str, ...], list[tuple[str, nn.Module]]]] = attrs.field(factory=list)
    children: list[_Skeleton] = attrs.field(factory=list)
    problems: list[str] = attrs.field(factory=list)
    stub: bool = False


def _has_lifecycle(module: nn.Module) -> bool:
    return all(callable(getattr(module, name, None)) for name in ("load_to_device", "offload_to_cpu"))


def _ring(
    path: str, attr_blocks: list[tuple[str, list[tuple[str, nn.Module]]]], canonical: dict[int, str]
) -> tuple[tuple[str, ...], list[tuple[str, nn.Module]]]:
    """One ring from the blocks of several attributes, in order, each block once, canonically named."""
    attrs_used: list[str] = []
    blocks: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for attr, modules in attr_blocks:
        if not modules:
            continue
        attrs_used.append(attr)
        for name, block in modules:
            if id(block) in seen:
                continue
            seen.add(id(block))
            block_path = canonical.setdefault(id(block), join_path(path, join_path(attr, name)))
            blocks.append((block_path, block))
    return tuple(attrs_used), blocks


def _dit_skeleton(
    path: str,
    module: nn.Module,
    declaration: Declaration | None,
    component_ids: frozenset[int],
    canonical: dict[int, str],
) -> _Skeleton:
    cls = type(module).__name__
    skeleton = _Skeleton(path=path, kind="dit", module=module)
    attr_blocks: list[tuple[str, list[tuple[str, nn.Module]]]] = []
    others = [m for m in module.modules() if id(m) in component_ids and m is not module]
    block_attrs, by_user = _dit_block_attrs(module, path, declaration, others)
    for attr in block_attrs:
        try:
            container = _get_path(module, attr)
        except _Missing:
            if by_user:
                skeleton.problems.append(f"block attribute {attr!r} was not found on {cls}")
            continue
        attr_blocks.append((attr, _blocks_of(container, attr, cls, skeleton.problems, declared=by_user)))
    stack_attrs, blocks = _ring(path, attr_blocks, canonical)
    if blocks:
        skeleton.stacks.append((stack_attrs, blocks))

    block_roots = {a.split(".")[0] for a, _ in attr_blocks}
    submodules = {} if declaration is None else declaration.offload_submodules
    for name, child in module.named_children():
        if name in block_roots or id(child) in component_ids:
            continue
        declared = submodules.get(name)
        if declared is None and _module_bytes(child, buffers=False) <= NESTED_OFFLOAD_THRESHOLD_BYTES:
            continue
        skeleton.children.append(_child_skeleton(join_path(path, name), child, declared, canonical))
    return skeleton


def _child_skeleton(
    path: str, module: nn.Module, declared: str | None, canonical: dict[int, str]
) -> _Skeleton:
    cls = _qualname(type(module))
    skeleton = _Skeleton(path=path, kind="dit", module=module)
    for attr in (declared,) if declared is not None else NESTED_BLOCK_ATTRS:
        try:
            found = _get_path(module, attr)
        except _Missing:
            found = None
        if isinstance(found, nn.ModuleList) and len(found) > 1:
            if declared is None:
                _warn_once(
                    _warned_nested_scans,
                    cls,
                    f"{cls} block list was found as {attr!r} by scanning well-known names; declare it in "
                    f"Declaration.offload_submodules (the scan is deprecated)",
                )
            skeleton.stacks.append(_ring(path, [(attr, _blocks_of(found, attr, cls, []))], canonical))
            return skeleton
        if declared is not None:
            skeleton.problems.append(
                f"Declaration.offload_submodules names block attribute {declared!r} for {path!r}, but on "
                f"{type(module).__name__} it is {_describe(found)}, not a ModuleList of at least two blocks"
            )
    return skeleton


def _encoder_skeleton(
    path: str, module: nn.Module, declaration: Declaration | None, canonical: dict[int, str]
) -> _Skeleton:
    skeleton = _Skeleton(path=path, kind="encoder", module=module)
    skeleton.stub = getattr(module, "is_loaded", True) is False
    if declaration is None or skeleton.stub:
        return skeleton
    cls = type(module).__name__
    for attr in declaration.encoder_block_attrs.get(path, ()):
        try:
            found = _get_path(module, attr)
        except _Missing:
            skeleton.problems.append(f"encoder block path {attr!r} was not found on {cls}")
            continue
        if not (isinstance(found, nn.ModuleList) and len(found) > 1):
            skeleton.problems.append(
                f"encoder block path {attr!r} on {cls} is {_describe(found)}, "
                "not a ModuleList of at least two blocks"
            )
            continue
        skeleton.stacks.append(_ring(path, [(attr, _blocks_of(found, attr, cls, []))], canonical))
    return skeleton


def _occurrences(skeletons: list[_Skeleton], component_ids: frozenset[int]) -> list[_Occurrence]:
    occurrences: list[_Occurrence] = []
    seq = 0

    def add(
        index: int, category: int, owner: str, root: nn.Module, *, prefix: str, stop: frozenset[int]
    ) -> None:
        nonlocal seq
        for name, tensor, buffer, persistent in _walk(root, prefix, stop):
            _check_plain(name, tensor)
            occurrences.append(
                _Occurrence(
                    rank=(index, category, seq), owner=owner, component=index, name=name, tensor=tensor,
                    buffer=buffer, persistent=persistent,
                )
            )
            seq += 1

    for index, sk in enumerate(skeletons):
        others = component_ids - {id(sk.module)}
        parts = [sk, *sk.children]
        cut = frozenset(
            [id(b) for part in parts for _, blocks in part.stacks for _, b in blocks]
            + [id(c.module) for c in sk.children]
        )
        add(index, 0, "", sk.module, prefix=sk.path, stop=cut | others)
        for child in sk.children:
            stop = (cut - {id(child.module)}) | others
            add(index, 1, child.path, child.module, prefix=child.path, stop=stop)
        for part in parts:
            for _, blocks in part.stacks:
                for block_path, block in blocks:
                    add(index, 2, block_path, block, prefix=block_path, stop=(cut - {id(block)}) | others)
    return occurrences


def _build(sk: _Skeleton, owned: list[tuple[_Occurrence, tuple[str, ...]]]) -> Component:
    by_owner: dict[str, list[TensorSpec]] = {}
    for occ, aliases in owned:
        by_owner.setdefault(occ.owner, []).append(_spec(occ, aliases))

    def component(part: _Skeleton, remainder_key: str, children: tuple[Component, ...]) -> Component:
        return Component(
            path=part.path,
            kind=part.kind,
            class_name=type(part.module).__name__,
            tensors=by_owner.get(remainder_key, ()),
            stacks=[
                Stack(attrs=a, blocks=[Block(path=p, tensors=by_owner.get(p, ())) for p, _ in blocks])
                for a, blocks in part.stacks
            ],
            children=children,
            has_lifecycle=_has_lifecycle(part.module),
            stub=part.stub,
            problems=part.problems,
        )

    children = tuple(component(c, c.path, ()) for c in sk.children)
    return component(sk, "", children)


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
        if declaration is None:
            declaration = _registry.declaration_for_pipeline(
                type(pipeline),
                {path: type(_unwrap(m)).__name__ for entries in lists.values() for path, m in entries},
            )
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
            _declares_block_attrs(_unwrap(pipeline), declaration) or _is_bare_model(pipeline, scanned)
        ):
            declares = True
            lists = {"dit": [("", pipeline)], "encoder": [], "vae": [], "resident": []}
        elif scanned:
            cls = _qualname(type(pipeline))
            _warn_once(
                _warned_legacy_pipelines,
                cls,
                f"{cls} does not declare its components; torchferry found them by scanning well-known "
                "attribute names, which is deprecated. Declare _dit_modules, _encoder_modules and "
                "_vae_modules (see torchferry.topology.SupportsComponentDiscovery)",
            )
    lists = {kind: [(path, _unwrap(m)) for path, m in entries] for kind, entries in lists.items()}

    component_ids = frozenset(id(m) for entries in lists.values() for _, m in entries)
    canonical: dict[int, str] = {}
    skeletons: list[_Skeleton] = []
    for kind, entries in lists.items():
        for path, module in entries:
            if kind == "dit":
                skeletons.append(_dit_skeleton(path, module, declaration, component_ids, canonical))
            elif kind == "encoder":
                skeletons.append(_encoder_skeleton(path, module, declaration, canonical))
            else:
                skeletons.append(_Skeleton(path=path, kind=kind, module=module))

    owned = _assign_owners(_occurrences(skeletons, component_ids))
    return Topology(
        pipeline_class=_qualname(type(pipeline)),
        components=[_build(sk, owned.get(i, [])) for i, sk in enumerate(skeletons)],
        declaration=declaration,
        declares_components=declares,
        source="module",
    )
