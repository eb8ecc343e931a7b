"""Plans built directly as data for the policy tests: small synthetic ones and real model shapes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from torchferry.topology import (
    Block,
    Component,
    ComponentKind,
    OffloadConfig,
    ParallelLayout,
    Plan,
    Stack,
    TensorSpec,
    Topology,
)

MODEL_CONFIGS = Path("/work/shared/models/model_configs.json")
_FALLBACK = Path(__file__).with_name("model_shapes.json")


def tensor(name: str, nbytes: int) -> TensorSpec:
    """One bf16 tensor of ``nbytes`` bytes (odd counts become one uint8 tensor)."""
    if nbytes % 2:
        return TensorSpec(name=name, shape=(nbytes,), dtype="uint8")
    return TensorSpec(name=name, shape=(nbytes // 2,), dtype="bfloat16")


def stack(prefix: str, attr: str, sizes: Sequence[int], resident_head: int = 0) -> Stack:
    """A stack of blocks ``<prefix>.<attr>.<i>``, block i holding one tensor of ``sizes[i]`` bytes."""
    base = f"{prefix}.{attr}" if prefix else attr
    blocks = [
        Block(path=f"{base}.{i}", tensors=[tensor(f"{base}.{i}.weight", n)]) for i, n in enumerate(sizes)
    ]
    return Stack(attrs=(attr,), blocks=blocks, resident_head=resident_head)


def component(
    path: str,
    kind: ComponentKind,
    rest: int = 0,
    stacks: Sequence[Stack] = (),
    *,
    selected: bool = True,
    on_demand: bool = False,
    children: Sequence[Component] = (),
) -> Component:
    """A component with an optional remainder of ``rest`` bytes."""
    tensors = [tensor(f"{path}.rest.weight" if path else "rest.weight", rest)] if rest else []
    return Component(
        path=path,
        kind=kind,
        tensors=tensors,
        stacks=stacks,
        selected=selected,
        on_demand=on_demand,
        has_lifecycle=on_demand,
        children=children,
    )


def plan(components: Sequence[Component], **config: object) -> Plan:
    """A plan holding ``components`` as resolved, under ``OffloadConfig(**config)``."""
    topo = Topology(pipeline_class="TestPipeline", components=components)
    return Plan(topology=topo, config=OffloadConfig(**config), components=components)  # type: ignore[arg-type]


def ring_plan(
    n: int, nbytes: int = 1 << 20, *, rest: int = 0, resident_head: int = 0, **config: object
) -> Plan:
    """One DiT ``transformer`` with ``n`` equal blocks in ``transformer.blocks``."""
    dit = component("transformer", "dit", rest, [stack("transformer", "blocks", [nbytes] * n, resident_head)])
    return plan([dit], **config)


def _shapes() -> dict[str, object]:
    path = MODEL_CONFIGS if MODEL_CONFIGS.exists() else _FALLBACK
    data: dict[str, object] = json.loads(path.read_text())
    return data


def model_plan(
    model: str,
    *,
    stream: Sequence[str] = ("transformer",),
    resident_head: int = 0,
    **config: object,
) -> Plan:
    """The plan of a real model from its measured bf16 byte counts: one tensor per block (block 0 at
    the largest measured size, the rest at the smallest) and the remainder as one tensor. Components
    in ``stream`` keep their stacks and are selected; the others are whole and unselected."""
    spec = _shapes()[model]
    assert isinstance(spec, dict)
    comps = []
    for path, entry in spec.items():
        if path.startswith("_") or "@" in path:
            continue
        measured = entry["measured"]
        cls = entry.get("diffusers_class") or entry.get("transformers_class") or ""
        kind: ComponentKind = (
            "dit" if path.startswith("transformer") else "vae" if path.startswith("vae") else "encoder"
        )
        stacks = []
        if path in stream:
            for attr, b in measured.get("blocks", {}).items():
                sizes = [b["bytes_bf16_per_block_max"]] + [b["bytes_bf16_per_block_min"]] * (b["count"] - 1)
                head = resident_head if kind == "dit" else 0
                stacks.append(stack(path, attr, sizes, head))
            rest = measured["remainder_bytes_bf16"]
        else:
            rest = measured["bytes_bf16_params"]
        c = component(path, kind, rest, stacks, selected=path in stream)
        comps.append(Component(**{**_fields(c), "class_name": cls}))
    return plan(comps, **config)


def _fields(c: Component) -> dict[str, object]:
    import attrs

    return {f.name: getattr(c, f.name) for f in attrs.fields(Component)}


__all__ = ["ParallelLayout", "component", "model_plan", "plan", "ring_plan", "stack", "tensor"]
