"""What the user asked for: the offload request and the parallel layout it runs under."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import attrs

__all__ = [
    "COMPONENT_NAMES",
    "STRATEGIES",
    "OffloadConfig",
    "ParallelLayout",
    "SelectableComponent",
    "Strategy",
    "Transfer",
]

Strategy = Literal["none", "model_level", "layerwise", "distributed_layerwise"]
Transfer = Literal["rank-local", "allgather"]
SelectableComponent = Literal["dit", "text_encoder", "vae"]

STRATEGIES: tuple[Strategy, ...] = ("none", "model_level", "layerwise", "distributed_layerwise")
TRANSFERS: tuple[Transfer, ...] = ("rank-local", "allgather")
COMPONENT_NAMES: tuple[SelectableComponent, ...] = ("dit", "text_encoder", "vae")


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen(kw_only=True, cache_hash=True)
class ParallelLayout:
    """The parallel layout the pipeline already runs under; the weight-shard group derives from it."""

    data_parallel_size: int = attrs.field(default=1, validator=_positive)
    sequence_parallel_size: int = attrs.field(default=1, validator=_positive)
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    use_hsdp: bool = False
    hsdp_shard_size: int = -1
    hsdp_replicate_size: int = 1

    @property
    def shard_group_size(self) -> int:
        """Ranks that share one copy of the weights: DP; HSDP shard x replicate; else SP; never TP."""
        size = self.data_parallel_size
        if self.use_hsdp and self.hsdp_shard_size > 0:
            size = self.hsdp_shard_size * self.hsdp_replicate_size
        if size <= 1 and self.sequence_parallel_size > 1:
            size = self.sequence_parallel_size
        return size


def _components_converter(value: Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset((value,))
    return frozenset(value)


@attrs.frozen(kw_only=True, cache_hash=True)
class OffloadConfig:
    """An offload request, validated field by field when built.

    - ``strategy``: ``none``, ``model_level`` (DiTs swap against encoders), ``layerwise`` (blocks
      stream through a ring of device slots), ``distributed_layerwise`` (each rank holds a shard of
      every streamed block and the ranks all-gather it).
    - ``dit_transfer`` / ``encoder_transfer``: how the distributed strategy moves each component's
      weights, ``allgather`` (sharded host copy) or ``rank-local`` (whole blocks, no collective).
    - ``resident_layers``: leading DiT blocks kept on the device (declared resident DiTs only).
    - ``components``: the selection (``dit``, ``text_encoder``, ``vae``); ``None`` is the legacy
      default selection, where warnings replace some errors.
    - ``prefetch_depth``: blocks in flight ahead of the one computing (>= 1).
    - ``device_memory_bytes``: the device budget schedules must fit, if any.
    - ``checkpoint``: a safetensors file, shard folder or ``*.index.json`` to fill host buffers from.
    - ``chunk_bytes``: split each distributed transfer into chunks of at most this size (None: whole).
    - ``parallel``: the parallel layout, from which the shard group size derives.
    """

    strategy: Strategy = "layerwise"
    dit_transfer: Transfer = "allgather"
    encoder_transfer: Transfer = "rank-local"
    resident_layers: int = 0
    components: frozenset[str] | None = attrs.field(default=None, converter=_components_converter)
    pin_memory: bool = True
    prefetch_depth: int = 1
    device_memory_bytes: int | None = None
    checkpoint: str | None = None
    chunk_bytes: int | None = None
    parallel: ParallelLayout = attrs.field(factory=ParallelLayout)

    @property
    def explicit(self) -> bool:
        """The user named the components; the resolver turns warn-and-skip cases into errors."""
        return self.components is not None

    @property
    def layerwise(self) -> bool:
        """Either block-streaming strategy."""
        return self.strategy in ("layerwise", "distributed_layerwise")

    @property
    def distributed(self) -> bool:
        return self.strategy == "distributed_layerwise"

    def transfer(self, component: SelectableComponent) -> Transfer:
        """The weight transfer used for ``component`` (always rank-local outside the distributed strategy)."""
        if not self.distributed:
            return "rank-local"
        if component == "dit":
            return self.dit_transfer
        if component == "text_encoder":
            return self.encoder_transfer
        return "rank-local"

    def uses_allgather(self, component: SelectableComponent) -> bool:
        return self.transfer(component) == "allgather"

    def offloads(self, component: SelectableComponent) -> bool:
        """Whether the selection covers ``component`` (legacy selection: the DiT always)."""
        if self.components is None:
            return component == "dit"
        return component in self.components

    @property
    def dp_size(self) -> int:
        """Size of the weight-shard group: 1 unless the distributed strategy all-gathers some weights."""
        if not self.distributed or "allgather" not in (self.dit_transfer, self.encoder_transfer):
            return 1
        return self.parallel.shard_group_size
