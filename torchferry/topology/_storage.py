"""Storage dtypes: which tensors a ``storage_dtype=`` request stores in it, and which casts are exact.

A request ``OffloadConfig(storage_dtype="float8_e4m3fn")`` asks torchferry to do what diffusers'
``enable_layerwise_casting(storage_dtype=..., compute_dtype=<the model's dtype>)`` does: hold and
move the weights of the DiTs' Linear, Conv and Embedding layers (outside diffusers' skip patterns)
in the storage dtype and cast them to their own dtype around each forward. `stored_as` rewrites a
topology for it: each tensor that would be cast gets ``dtype=<storage>`` and ``compute_dtype=<its
dtype>``, so every byte count (blocks, plans, schedules, the simulator, ``torchferry plan``) is the
stored bytes. Which tensors would be cast is discovery's ``TensorSpec.castable`` (read from the
layers' classes, `torchferry.topology._layers`); from checkpoint headers, which name no classes,
`castable_name` guesses it from names and shapes.

A tensor is stored in the storage dtype only when that saves bytes and the compute dtype holds every
storage value exactly (`exact_cast`): then casting up and back is the identity, so the one host copy
torchferry keeps is what diffusers' own round trip would leave.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs

from torchferry.topology._model import DTYPE_SIZES, Block, Component, Stack, TensorSpec, Topology

__all__ = ["SKIP_PATTERNS", "STORAGE_DTYPES", "castable_name", "exact_cast", "stored_as"]

#: The dtypes a ``storage_dtype=`` request may name: the float formats narrower than float32.
STORAGE_DTYPES: tuple[str, ...] = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "bfloat16",
    "float16",
)

#: Per float dtype: (mantissa bits, largest exponent, exponent of the smallest subnormal).
_FORMATS: dict[str, tuple[int, int, int]] = {
    "float64": (52, 1023, -1074),
    "float32": (23, 127, -149),
    "bfloat16": (7, 127, -133),
    "float16": (10, 15, -24),
    "float8_e4m3fn": (3, 8, -9),
    "float8_e4m3fnuz": (3, 7, -10),
    "float8_e5m2": (2, 15, -16),
    "float8_e5m2fnuz": (2, 15, -17),
}

#: diffusers' default skip patterns for layerwise casting (``DEFAULT_SKIP_MODULES_PATTERN``), searched
#: in each layer's path relative to its model; its models add their own (``_skip_layerwise_casting_
#: patterns``, ``_keep_in_fp32_modules``), which discovery reads from the class.
SKIP_PATTERNS: tuple[str, ...] = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")


def exact_cast(storage: str, compute: str) -> bool:
    """Whether every ``storage`` value is exactly a ``compute`` value (float dtype names): then a cast
    up and back is the identity."""
    a, b = _FORMATS.get(storage), _FORMATS.get(compute)
    if a is None or b is None:
        return False
    return b[0] >= a[0] and b[1] >= a[1] and b[2] <= a[2]


def castable_name(relative: str, shape: tuple[int, ...], weights: frozenset[str]) -> bool:
    """A guess from names alone (checkpoint headers): would layerwise casting cast tensor ``relative``
    (its name within its component)? A ``weight`` of two to five dimensions (a Linear, Conv or
    Embedding) and the ``bias`` beside such a weight (``weights``: the layer paths with one), outside
    `SKIP_PATTERNS`."""
    layer, _, leaf = relative.rpartition(".")
    if any(re.search(p, layer) for p in SKIP_PATTERNS):
        return False
    if leaf == "weight":
        return 2 <= len(shape) <= 5
    return leaf == "bias" and layer in weights


def _stored(spec: TensorSpec, storage: str, guess: bool) -> TensorSpec:
    castable = spec.castable if spec.castable is not None else guess
    if (
        not castable
        or spec.compute_dtype is not None
        or DTYPE_SIZES[spec.dtype] <= DTYPE_SIZES[storage]
        or not exact_cast(storage, spec.dtype)
    ):
        return spec
    return attrs.evolve(spec, dtype=storage, compute_dtype=spec.dtype)


def _component(component: Component, storage: str) -> Component:
    everything = list(component.all_tensors())
    prefix = f"{component.path}." if component.path else ""

    def relative(spec: TensorSpec) -> str:
        return spec.name.removeprefix(prefix)

    weights = frozenset(
        layer
        for layer, _, leaf in (relative(s).rpartition(".") for s in everything if len(s.shape) >= 2)
        if leaf == "weight"
    )

    def tensors(specs: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
        return tuple(_stored(s, storage, castable_name(relative(s), s.shape, weights)) for s in specs)

    def rewrite(c: Component) -> Component:
        return attrs.evolve(
            c,
            tensors=tensors(c.tensors),
            stacks=[
                Stack(
                    attrs=s.attrs,
                    blocks=[Block(path=b.path, tensors=tensors(b.tensors)) for b in s.blocks],
                    resident_head=s.resident_head,
                )
                for s in c.stacks
            ],
            children=[rewrite(child) for child in c.children],
        )

    return rewrite(component)


def stored_as(topology: Topology, storage: str) -> Topology:
    """``topology`` with its DiTs' castable tensors stored in ``storage`` (see the module docstring)."""
    return attrs.evolve(
        topology,
        components=[_component(c, storage) if c.kind == "dit" else c for c in topology.components],
    )
