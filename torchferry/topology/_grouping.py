"""A component from a checkpoint's header entries: its tensors grouped into blocks, rings and the rest.

`from_checkpoint` and `from_pipeline_folder` both build their components here, so a file, an index
and a pipeline folder split the same tensor names into the same blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

from torchferry.topology._model import Block, Component, ComponentKind, Stack, TensorSpec, join_path
from torchferry.topology._safetensors import HeaderEntry

__all__ = ["by_kind", "component_from_entries"]

#: The order components are listed in a topology built from files: DiTs, encoders, VAEs, the rest.
_KIND_ORDER: dict[ComponentKind, int] = {"dit": 0, "encoder": 1, "vae": 2, "resident": 3}


def _spec(entry: HeaderEntry) -> TensorSpec:
    return TensorSpec(name=entry.name, shape=entry.shape, dtype=entry.dtype)


def component_from_entries(
    prefix: str, kind: ComponentKind, attrs_: tuple[str, ...], entries: list[HeaderEntry]
) -> Component:
    """The component at ``prefix`` from its ``entries``: ``<attr>.<i>.…`` names under ``attrs_`` are blocks.

    A DiT's blocks form one ring, attributes in order and indices numerically; an encoder's
    attributes are a ring each, and one with fewer than two blocks is a problem of the component
    (its tensors stay in the remainder). Tensors are in name order, in blocks and the remainder
    alike, so one model saved as one file or as shards is one topology (and `pack` lays each buffer
    out by itemsize and name, as for a discovered model: the bytes a plan counts are the session's).
    """
    blocks: dict[tuple[str, int], list[HeaderEntry]] = {}
    rest: list[HeaderEntry] = []
    by_length = sorted(attrs_, key=len, reverse=True)
    for entry in entries:
        relative = entry.name[len(prefix) + 1 :] if prefix else entry.name
        for attr in by_length:
            if relative.startswith(attr + "."):
                index, dot, _ = relative[len(attr) + 1 :].partition(".")
                if dot and index.isascii() and index.isdigit():  # not '²', which isdigit() accepts
                    blocks.setdefault((attr, int(index)), []).append(entry)
                    break
        else:
            rest.append(entry)

    def block(attr: str, index: int) -> Block:
        tensors = [_spec(e) for e in sorted(blocks[attr, index], key=lambda e: e.name)]
        return Block(path=join_path(prefix, f"{attr}.{index}"), tensors=tensors)

    def ring(names: tuple[str, ...]) -> Stack:
        keys = sorted((k for k in blocks if k[0] in names), key=lambda k: (names.index(k[0]), k[1]))
        used = tuple(a for a in names if any(k[0] == a for k in keys))
        return Stack(attrs=used, blocks=[block(a, i) for a, i in keys])

    stacks: list[Stack] = []
    problems: list[str] = []
    if kind == "encoder":
        for attr in attrs_:
            count = sum(1 for k in blocks if k[0] == attr)
            if count > 1:
                stacks.append(ring((attr,)))
            else:
                problems.append(f"encoder block path {attr!r} has {count} block(s) in the checkpoint")
                rest.extend(e for k, es in blocks.items() if k[0] == attr for e in es)
    elif blocks:
        stacks.append(ring(attrs_))
    rest.sort(key=lambda e: e.name)
    return Component(
        path=prefix,
        kind=kind,
        tensors=[_spec(e) for e in rest],
        stacks=stacks,
        problems=problems,
    )


def by_kind(components: Iterable[Component]) -> list[Component]:
    """``components`` in topology order (DiTs, encoders, VAEs, residents), each kind in its given order."""
    return sorted(components, key=lambda c: _KIND_ORDER[c.kind])
