"""Which parts of a component are its blocks: a DiT's block attributes, and each component's skeleton.

A DiT's ring comes from its declaration, its class's attributes, the registry of known classes, or
its structure (`structural_block_attrs`, in the order its forward visits the lists: `_order`), in
that order. A skeleton records what a component is
made of before any tensor is read: its rings of blocks, its large children (each with a ring of its
own) and the problems found on the way; `_owners` then gives every tensor under it one owner.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from torch import nn

from torchferry.topology import _registry
from torchferry.topology._model import ComponentKind, Declaration, join_path
from torchferry.topology._order import forward_order
from torchferry.topology._reading import Missing, describe, get_path, qualname, warn_once

__all__ = [
    "NESTED_BLOCK_ATTRS",
    "NESTED_OFFLOAD_THRESHOLD_BYTES",
    "STRUCTURAL_SHARE",
    "Skeleton",
    "declares_block_attrs",
    "dit_skeleton",
    "encoder_skeleton",
    "structural_block_attrs",
]

#: Block-list names the deprecated scan tries on a large DiT child without a declared ring.
NESTED_BLOCK_ATTRS = ("layers", "blocks", "h", "model.layers")
#: A DiT child with more parameter bytes than this owns its residency even when nothing declares it.
NESTED_OFFLOAD_THRESHOLD_BYTES = 1024 * 1024 * 1024


# ---------------------------------------------------------------------------------------------
# Block attributes of a DiT


def _as_attrs(value: str | Iterable[object]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


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
    remainder). Several lists form one ring, in the order the model registered them (`_dit_block_attrs`
    reorders them as the forward's source names them); a model whose forward interleaves its lists
    needs its order declared (the runtime reports the order it ran).
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
        cls = qualname(type(module))
        warn_once(
            "singular attribute",
            cls,
            f"{cls} declares _layerwise_offload_blocks_attr = {singular!r}; the singular attribute is "
            f"deprecated, declare _layerwise_offload_blocks_attrs = ({singular!r},) instead",
        )
        return _as_attrs(singular), True
    known = _registry.block_attrs_for(type(module))
    if known is not None:
        return known, False
    # Lists found from structure come in registration order: stream them in the forward's.
    return forward_order(type(module), structural_block_attrs(module, skip)), False


def declares_block_attrs(module: nn.Module, declaration: Declaration | None) -> bool:
    """Whether ``module`` is a model that declares its blocks (or is a known class)."""
    if declaration is not None and "" in declaration.block_attrs:
        return True
    if any(hasattr(module, a) for a in ("_layerwise_offload_blocks_attrs", "_layerwise_offload_blocks_attr")):
        return True
    return _registry.block_attrs_for(type(module)) is not None


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
    problems.append(f"block attribute {attr!r} of {owner_class} is {describe(container)}, not a block list")
    return []


# ---------------------------------------------------------------------------------------------
# Component skeletons: which module subtrees are blocks, children and remainder


@attrs.define
class Skeleton:
    """A component found but not yet built: its module, its rings of blocks, its large children."""

    path: str
    kind: ComponentKind
    module: nn.Module
    stacks: list[tuple[tuple[str, ...], list[tuple[str, nn.Module]]]] = attrs.field(factory=list)
    children: list[Skeleton] = attrs.field(factory=list)
    problems: list[str] = attrs.field(factory=list)
    stub: bool = False


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


def dit_skeleton(
    path: str,
    module: nn.Module,
    declaration: Declaration | None,
    component_ids: frozenset[int],
    canonical: dict[int, str],
) -> Skeleton:
    cls = type(module).__name__
    skeleton = Skeleton(path=path, kind="dit", module=module)
    attr_blocks: list[tuple[str, list[tuple[str, nn.Module]]]] = []
    others = [m for m in module.modules() if id(m) in component_ids and m is not module]
    block_attrs, by_user = _dit_block_attrs(module, path, declaration, others)
    for attr in block_attrs:
        try:
            container = get_path(module, attr)
        except Missing:
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
) -> Skeleton:
    cls = qualname(type(module))
    skeleton = Skeleton(path=path, kind="dit", module=module)
    for attr in (declared,) if declared is not None else NESTED_BLOCK_ATTRS:
        try:
            found = get_path(module, attr)
        except Missing:
            found = None
        if isinstance(found, nn.ModuleList) and len(found) > 1:
            if declared is None:
                warn_once(
                    "nested scan",
                    cls,
                    f"{cls} block list was found as {attr!r} by scanning well-known names; declare it in "
                    f"Declaration.offload_submodules (the scan is deprecated)",
                )
            skeleton.stacks.append(_ring(path, [(attr, _blocks_of(found, attr, cls, []))], canonical))
            return skeleton
        if declared is not None:
            skeleton.problems.append(
                f"Declaration.offload_submodules names block attribute {declared!r} for {path!r}, but on "
                f"{type(module).__name__} it is {describe(found)}, not a ModuleList of at least two blocks"
            )
    return skeleton


def encoder_skeleton(
    path: str, module: nn.Module, declaration: Declaration | None, canonical: dict[int, str]
) -> Skeleton:
    skeleton = Skeleton(path=path, kind="encoder", module=module)
    skeleton.stub = getattr(module, "is_loaded", True) is False
    if declaration is None or skeleton.stub:
        return skeleton
    cls = type(module).__name__
    for attr in declaration.encoder_block_attrs.get(path, ()):
        try:
            found = get_path(module, attr)
        except Missing:
            skeleton.problems.append(f"encoder block path {attr!r} was not found on {cls}")
            continue
        if not (isinstance(found, nn.ModuleList) and len(found) > 1):
            skeleton.problems.append(
                f"encoder block path {attr!r} on {cls} is {describe(found)}, "
                "not a ModuleList of at least two blocks"
            )
            continue
        skeleton.stacks.append(_ring(path, [(attr, _blocks_of(found, attr, cls, []))], canonical))
    return skeleton
