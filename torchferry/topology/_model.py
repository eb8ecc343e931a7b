"""Immutable data that describes a pipeline: tensors, blocks, stacks, components, the topology.

Everything here is a frozen, slotted, hashable attrs class holding names and numbers only; no module
object, no tensor. Paths are dotted attribute paths from the pipeline root (``transformer.blocks.3``);
a bare model offloaded on its own is the single component with path ``""``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, SupportsIndex

import attrs
from attrs import field as _field

from torchferry.topology._frozen import WHEN_SET, FrozenMap

__all__ = [
    "DTYPE_SIZES",
    "Block",
    "Component",
    "ComponentKind",
    "Declaration",
    "Dequantized",
    "Stack",
    "TensorSpec",
    "Topology",
    "dtype_size",
    "find_attr",
    "find_component",
    "join_path",
    "pack",
]

ComponentKind = Literal["dit", "encoder", "vae", "resident"]

#: Bytes per element of every dtype torchferry streams, by torch's name without the ``torch.`` prefix.
DTYPE_SIZES: FrozenMap[str, int] = FrozenMap(
    {
        "float64": 8,
        "int64": 8,
        "complex64": 8,
        "complex128": 16,
        "float32": 4,
        "int32": 4,
        "uint32": 4,
        "bfloat16": 2,
        "float16": 2,
        "int16": 2,
        "uint16": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "float8_e4m3fnuz": 1,
        "float8_e5m2fnuz": 1,
        "int8": 1,
        "uint8": 1,
        "bool": 1,
    }
)


def dtype_size(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a torch dtype name such as ``"bfloat16"``)."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        known = ", ".join(sorted(DTYPE_SIZES))
        raise ValueError(f"unknown dtype {dtype!r}; torchferry knows {known}") from None


def find_attr(root: object, dotted: str) -> Any:
    """The object at ``dotted`` (``transformer.blocks.3``) under ``root``; ``""`` is ``root`` itself.

    Registered children come first (a module's ``_modules``, ``_parameters`` and ``_buffers``, read
    without importing torch): a child may be named like a module method (``double``, ``half``,
    ``float``, ``type``), and plain ``getattr`` would find the bound method. Raises
    `AttributeError` when a part is missing.
    """
    value: Any = root
    for part in dotted.split(".") if dotted else ():
        for table in _CHILD_TABLES:
            children = getattr(value, table, None)
            if isinstance(children, dict) and part in children:
                value = children[part]
                break
        else:
            value = getattr(value, part)
    return value


#: Where `torch.nn.Module` registers its children, in the order it looks them up.
_CHILD_TABLES = ("_modules", "_parameters", "_buffers")


def join_path(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` alone when the prefix is the root (``""``)."""
    return f"{prefix}.{name}" if prefix and name else (prefix or name)


def _shape(value: Iterable[SupportsIndex]) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


def _str_tuple(value: str | Iterable[object]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


@attrs.frozen(kw_only=True)
class Dequantized:
    """A weight its layer dequantizes at every call (diffusers' ``GGUFLinear``): its ggml type
    (``"Q4_K"``), its logical values, and the dtype the layer computes in (``None``: the layer casts
    nothing, and computes in what the dequantize gives). `policies.dequantize_bytes` and
    `policies.dequantize_seconds` price it."""

    quant_type: str
    numel: int
    dtype: str | None


@attrs.frozen(kw_only=True, cache_hash=True)
class TensorSpec:
    """One parameter or buffer: its qualified name, shape, dtype and byte count.

    ``aliases`` are the other qualified names bound to the very same tensor (tied weights); this spec
    is their one owner, so the bytes are counted and moved once. An inner tensor of a wrapper tensor
    (a quantized weight's ``qdata``) is named ``<wrapper's name>.<attribute>`` (docs/quantized.md).

    ``compute_dtype`` is set when the tensor is stored (held, moved) in ``dtype`` and its layer
    computes in ``compute_dtype`` (a ``storage_dtype=`` request); ``castable`` says whether diffusers'
    layerwise casting would cast it (``None``: no module said, as from checkpoint headers).
    ``dequantized`` is set for a weight its layer dequantizes at every call (`Dequantized`; read
    from the layer by `discover`), so plans count the time and the temporary that costs.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: str
    buffer: bool = False
    persistent: bool = True
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    compute_dtype: str | None = None
    castable: bool | None = attrs.field(default=None, eq=False)
    dequantized: Dequantized | None = attrs.field(default=None, eq=False)

    # Derived once at construction: plans read these for every tensor of every block, many times.
    numel: int = attrs.field(init=False, eq=False, repr=False)
    nbytes: int = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        numel = 1
        for d in self.shape:
            numel *= d
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "nbytes", numel * dtype_size(self.dtype))

    @property
    def itemsize(self) -> int:
        return dtype_size(self.dtype)


def _tensors(value: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    return tuple(value)


def _tensor_bytes(tensors: tuple[TensorSpec, ...]) -> int:
    """Bytes of the flat buffer `pack` lays ``tensors`` out in (alignment padding included)."""
    return packed_nbytes(pack(tensors))


@attrs.frozen(kw_only=True, cache_hash=True)
class Block:
    """One repeated unit of a stack (a transformer block): the smallest thing a ring streams."""

    path: str
    tensors: tuple[TensorSpec, ...] = attrs.field(converter=_tensors)
    #: Bytes of the block's flat buffer (see `pack`: its tensors and the padding that aligns them).
    nbytes: int = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "nbytes", _tensor_bytes(self.tensors))

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({t.dtype for t in self.tensors}))

    @property
    def layout(self) -> tuple[tuple[TensorSpec, int], ...]:
        """Each tensor with its byte offset in the block's flat buffer (see `pack`)."""
        return pack(self.tensors)


#: Every tensor of a flat buffer starts at a multiple of this many bytes (see `pack`).
PACK_ALIGN = 256


def pack(tensors: Iterable[TensorSpec]) -> tuple[tuple[TensorSpec, int], ...]:
    """The flat-buffer layout shared by host buffers, device slots and checkpoint readers.

    Tensors are laid out by itemsize, largest first, then by name, each starting at the next multiple
    of `PACK_ALIGN` (256) bytes, so a layout depends on the tensors alone, never on the order a module
    registered them or a file stored them (a plan from a checkpoint's headers and a session over the
    module agree byte for byte, whatever the file's order). The CUDA caching allocator hands out
    512-byte aligned blocks, so every tensor view into a slot starts on a 256-byte boundary, as its
    own allocation would, and the same kernels run as on a resident model. The buffer is
    `packed_nbytes` long: the tensors' bytes and the padding between them (zeros).
    """
    ordered = sorted(tensors, key=lambda t: (-t.itemsize, t.name))
    placed: list[tuple[TensorSpec, int]] = []
    offset = 0
    for t in ordered:
        offset = -(-offset // PACK_ALIGN) * PACK_ALIGN
        placed.append((t, offset))
        offset += t.nbytes
    return tuple(placed)


def packed_nbytes(layout: Iterable[tuple[TensorSpec, int]]) -> int:
    """Bytes of the flat buffer ``layout`` (from `pack`) describes: up to the end of its last tensor."""
    return max((offset + t.nbytes for t, offset in layout), default=0)


def _blocks(value: Iterable[Block]) -> tuple[Block, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True, cache_hash=True)
class Stack:
    """The ordered blocks of one ring and the attributes they came from.

    ``attrs`` are attribute paths relative to the owning component (``("transformer_blocks",
    "single_transformer_blocks")``); several attributes form one ring in order. The first
    ``resident_head`` blocks stay on the device; the rest stream.
    """

    attrs: tuple[str, ...] = _field(converter=_str_tuple)
    blocks: tuple[Block, ...] = _field(converter=_blocks)
    resident_head: int = _field(default=0)

    @resident_head.validator
    def _check_head(self, _: object, value: int) -> None:
        if not 0 <= value <= len(self.blocks):
            raise ValueError(f"resident_head={value} is outside 0..{len(self.blocks)} for stack {self.attrs}")

    @property
    def resident(self) -> tuple[Block, ...]:
        """Leading blocks that stay on the device instead of streaming."""
        return self.blocks[: self.resident_head]

    @property
    def streaming(self) -> tuple[Block, ...]:
        """Blocks that a ring moves on demand."""
        return self.blocks[self.resident_head :]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)


def _stacks(value: Iterable[Stack]) -> tuple[Stack, ...]:
    return tuple(value)


def _reasons(value: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple((str(name), str(reason)) for name, reason in value)


def _components(value: Iterable[Component]) -> tuple[Component, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True, cache_hash=True)
class Component:
    """One pipeline component (a DiT, a text encoder, a VAE, or a module that simply stays resident).

    ``tensors`` are the tensors this component owns outside its stacks and children (its non-block
    remainder). ``children`` are large submodules that own their residency (their own ring, or the
    pipeline's lifecycle). ``has_lifecycle`` says the module defines ``load_to_device`` and
    ``offload_to_cpu``; ``on_demand`` (set by `resolve`) says the pipeline owns its residency through
    them. ``stub`` marks a component that is declared but not loaded on this rank. ``problems`` are
    discovery findings that `resolve` turns into errors or warnings depending on the request.
    """

    path: str
    kind: ComponentKind
    class_name: str = ""
    tensors: tuple[TensorSpec, ...] = attrs.field(default=(), converter=_tensors)
    stacks: tuple[Stack, ...] = attrs.field(default=(), converter=_stacks)
    children: tuple[Component, ...] = attrs.field(default=(), converter=_components)
    has_lifecycle: bool = False
    on_demand: bool = False
    selected: bool = False
    stub: bool = False
    problems: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)

    @property
    def blocks(self) -> tuple[Block, ...]:
        """Every block of every stack, in ring order."""
        return tuple(b for s in self.stacks for b in s.blocks)

    @property
    def rest_bytes(self) -> int:
        """Bytes of the non-block remainder owned directly by this component."""
        return _tensor_bytes(self.tensors)

    @property
    def nbytes(self) -> int:
        """Every byte this component owns: remainder, stacks and children."""
        return self.rest_bytes + sum(s.nbytes for s in self.stacks) + sum(c.nbytes for c in self.children)

    def walk(self) -> Iterator[Component]:
        """This component, then its children depth-first."""
        yield self
        for child in self.children:
            yield from child.walk()

    def all_tensors(self) -> Iterator[TensorSpec]:
        """Every tensor this component owns, blocks and children included."""
        for component in self.walk():
            yield from component.tensors
            for block in component.blocks:
                yield from block.tensors


def find_component(components: Iterable[Component], path: str, where: str) -> Component:
    """The component at ``path`` among ``components`` and their children; `KeyError` lists the known ones."""
    everything = [c for top in components for c in top.walk()]
    for c in everything:
        if c.path == path:
            return c
    known = ", ".join(repr(c.path) for c in everything)
    raise KeyError(f"no component {path!r} in this {where}; known: {known}")


def _frozen_map_of_tuples(value: Mapping[str, str | Iterable[object]]) -> FrozenMap[str, tuple[str, ...]]:
    return FrozenMap(tuple((str(k), _str_tuple(v)) for k, v in value.items()))


def _frozen_map_of_str(value: Mapping[str, object]) -> FrozenMap[str, str]:
    return FrozenMap(tuple((str(k), str(v)) for k, v in value.items()))


def _frozenset_of_str(value: str | Iterable[object]) -> frozenset[str]:
    return frozenset(_str_tuple(value))


@attrs.frozen(kw_only=True, cache_hash=True)
class Declaration:
    """What a pipeline declares about its own topology (everything optional).

    - ``block_attrs``: DiT path -> block attributes, overriding the model class's own declaration.
    - ``offload_submodules``: DiT child name -> the block attribute of its own ring.
    - ``resident_dit_paths``: DiTs allowed to keep leading blocks resident.
    - ``on_demand_component_paths``: components whose residency the pipeline owns through
      ``load_to_device``/``offload_to_cpu``.
    - ``encoder_component_types``: encoder path -> public selector type (``"text_encoder"``).
    - ``encoder_block_attrs``: encoder path -> dotted block paths; each one is its own ring.
    - ``encoder_dlo_weight_replication``: encoders whose weights are identical on every rank of the
      shard group, the only ones that may use all-gather transfers.
    """

    block_attrs: FrozenMap[str, tuple[str, ...]] = attrs.field(
        factory=FrozenMap, converter=_frozen_map_of_tuples
    )
    offload_submodules: FrozenMap[str, str] = attrs.field(factory=FrozenMap, converter=_frozen_map_of_str)
    resident_dit_paths: frozenset[str] = attrs.field(factory=frozenset, converter=_frozenset_of_str)
    on_demand_component_paths: frozenset[str] = attrs.field(factory=frozenset, converter=_frozenset_of_str)
    encoder_component_types: FrozenMap[str, str] = attrs.field(
        factory=FrozenMap, converter=_frozen_map_of_str
    )
    encoder_block_attrs: FrozenMap[str, tuple[str, ...]] = attrs.field(
        factory=FrozenMap, converter=_frozen_map_of_tuples
    )
    encoder_dlo_weight_replication: frozenset[str] = attrs.field(
        factory=frozenset, converter=_frozenset_of_str
    )


@attrs.frozen(kw_only=True, cache_hash=True)
class Topology:
    """Everything a pipeline is made of, independent of any offload request.

    ``components`` are in pipeline order: DiTs, encoders, VAEs, residents. ``declares_components``
    says the pipeline declared its component lists (otherwise they came from the legacy attribute
    scan). ``source`` says where the facts came from (``module``, ``checkpoint:<path>``,
    ``known:<id>``). ``unmanaged`` names every other component the pipeline declares (a diffusers
    pipeline's ``components``) with why torchferry leaves it where it is (a tokenizer holds no
    weights, an absent component is ``None``).
    """

    pipeline_class: str
    components: tuple[Component, ...] = attrs.field(converter=_components)
    declaration: Declaration | None = None
    declares_components: bool = True
    source: str = "module"
    # In the digest only when set (`WHEN_SET`), so plans of pipelines that leave nothing out keep theirs.
    unmanaged: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_reasons, metadata=WHEN_SET)

    def component(self, path: str) -> Component:
        """The component at ``path`` (children included); `KeyError` names the known paths."""
        return find_component(self.components, path, "topology")

    def of_kind(self, kind: ComponentKind) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.kind == kind)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.components)

    def owners(self) -> FrozenMap[str, str]:
        """Alias name -> owning tensor name, for every tied or aliased tensor."""
        pairs: list[tuple[str, str]] = []
        for top in self.components:
            for t in top.all_tensors():
                pairs.extend((alias, t.name) for alias in t.aliases)
        return FrozenMap(tuple(pairs))
