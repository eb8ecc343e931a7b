"""`OffloadConfig`: what the user asked for, validated field by field when built.

A wrong type is a ``TypeError``, a bad value a `PlanError` (the checks are in `_fields`). Besides
keyword arguments, a config comes from the seeds' legacy flags (`OffloadConfig.from_legacy`) or
the compact mapping (`OffloadConfig.from_mapping`), both read in `_legacy`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from torchferry._errors import PlanError, strategy_named
from torchferry.topology._fields import (
    COMPONENT_NAMES,
    STRATEGIES,
    TRANSFERS,
    WHEN_SET,
    SelectableComponent,
    Strategy,
    Transfer,
    bool_field,
    choices,
    memory_or_none,
    non_negative,
    one_of,
    positive_or_none,
    ring_depth,
    storage_dtype,
    storage_dtype_name,
    type_name,
)
from torchferry.topology._legacy import legacy_fields, mapping_fields
from torchferry.topology._parallel import ParallelLayout

__all__ = ["RUNTIME_OPTIONS", "OffloadConfig"]

#: The `OffloadConfig` fields `resolve` never reads: how the plan is carried out, not what it is.
#: They take no part in `Plan.digest` (the plan is the same plan whatever they say): the prefetch
#: depth and chunk size are knobs of the policy (`policies.builtin`), the budgets are what `check`
#: holds schedules to, pinning and the checkpoint path are the runtime's.
RUNTIME_OPTIONS: tuple[str, ...] = (
    "pin_memory",
    "prefetch_depth",
    "device_memory_bytes",
    "checkpoint",
    "chunk_bytes",
    "host_memory_bytes",
)


def _components_converter(value: Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset((value,))
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise TypeError(
            "OffloadConfig.components must be None or a collection of component names, "
            f"got {type_name(value)} {value!r}"
        )
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"OffloadConfig.components entries must be str, got {type_name(item)} {item!r}")
    return frozenset(items)


def _check_components(
    _: object, __: attrs.Attribute[frozenset[str] | None], value: frozenset[str] | None
) -> None:
    if value is None:
        return
    if not value:
        raise PlanError.worded(
            "OffloadConfig.components is empty; name at least one of 'dit', 'text_encoder', 'vae', or use ",
            strategy_named("none"),
            " to offload nothing",
        )
    unknown = sorted(value.difference(COMPONENT_NAMES))
    if unknown:
        raise PlanError(
            f"OffloadConfig.components has unknown component(s) {choices(unknown)}; "
            f"choose from {choices(COMPONENT_NAMES)}"
        )


def _path_or_none(value: str | os.PathLike[str] | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"OffloadConfig.checkpoint must be a path or None, got {type_name(value)} {value!r}")


def _device_memory(value: int | str | None) -> int | None:
    return memory_or_none(value, "OffloadConfig.device_memory_bytes")


def _host_memory(value: int | str | None) -> int | None:
    return memory_or_none(value, "OffloadConfig.host_memory_bytes")


def _layout(_: object, __: attrs.Attribute[ParallelLayout], value: object) -> None:
    if not isinstance(value, ParallelLayout):
        raise TypeError(f"OffloadConfig.parallel must be a ParallelLayout, got {type_name(value)} {value!r}")


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
    - ``prefetch_depth``: blocks in flight ahead of the one computing (1 to `MAX_PREFETCH_DEPTH`).
    - ``device_memory_bytes``: the device budget schedules must fit, if any: bytes, or a size such
      as ``"24GiB"`` (`offload` and `torchferry plan` call it ``device_memory``).
    - ``host_memory_bytes``: the host budget, the most bytes torchferry's own host buffers (pinned
      store, staging slots, read buffers) may hold at once: bytes or a size such as ``"32GiB"``
      (``host_memory`` to `offload`). Packs that do not fit stay in the checkpoint, the *file tier*
      (`policies.tiers`); ``None``: no limit.
    - ``checkpoint``: a safetensors file, shard folder or ``*.index.json`` to fill host buffers from.
    - ``chunk_bytes``: split each distributed transfer into chunks of at most this size (None: whole).
    - ``parallel``: the parallel layout, from which the shard group size derives.
    - ``storage_dtype``: store the DiTs' Linear, Conv and Embedding weights in this dtype (a float8
      or 16-bit float, or its torch dtype) and cast them to their own around each forward, as
      diffusers' ``enable_layerwise_casting`` does (docs/quantized.md); ``None``: each tensor's own.

    The fields in `RUNTIME_OPTIONS` say how the plan is carried out, not what it is: `resolve` reads
    none of them and `Plan.digest` leaves them out (see `request`).

    Across fields: resident layers need rank-local DiT weights under the distributed strategy,
    and the distributed strategy cannot all-gather weights that HSDP already shards.
    """

    strategy: Strategy = attrs.field(default="layerwise", validator=one_of(STRATEGIES))
    dit_transfer: Transfer = attrs.field(default="allgather", validator=one_of(TRANSFERS))
    encoder_transfer: Transfer = attrs.field(default="rank-local", validator=one_of(TRANSFERS))
    resident_layers: int = attrs.field(default=0, validator=non_negative)
    components: frozenset[str] | None = attrs.field(
        default=None, converter=_components_converter, validator=_check_components
    )
    pin_memory: bool = attrs.field(default=True, validator=bool_field)
    prefetch_depth: int = attrs.field(default=1, validator=ring_depth)
    device_memory_bytes: int | None = attrs.field(
        default=None,
        converter=_device_memory,
        validator=positive_or_none,
    )
    host_memory_bytes: int | None = attrs.field(
        default=None,
        converter=_host_memory,
        validator=positive_or_none,
        metadata=WHEN_SET,
    )
    checkpoint: str | None = attrs.field(default=None, converter=_path_or_none)
    chunk_bytes: int | None = attrs.field(default=None, validator=positive_or_none)
    parallel: ParallelLayout = attrs.field(factory=ParallelLayout, validator=_layout)
    # Weights stored in a narrower dtype (layerwise casting); no part of a plan's digest while None.
    storage_dtype: str | None = attrs.field(
        default=None,
        converter=storage_dtype_name,
        validator=storage_dtype,
        metadata=WHEN_SET,
    )

    def __attrs_post_init__(self) -> None:
        if self.resident_layers and self.uses_allgather("dit"):
            raise PlanError(
                f"OffloadConfig: resident_layers={self.resident_layers} with dit_transfer='allgather' "
                "under the distributed_layerwise strategy; resident blocks keep the loader's "
                "rank-local weights, so set dit_transfer='rank-local' or resident_layers=0"
            )
        gathers = "allgather" in (self.dit_transfer, self.encoder_transfer)
        if self.distributed and self.parallel.use_hsdp and gathers:
            raise PlanError(
                "OffloadConfig: distributed_layerwise with all-gather transfers under HSDP would shard "
                "parameters HSDP already shards; set dit_transfer='rank-local' and "
                "encoder_transfer='rank-local', or disable HSDP"
            )

    @property
    def request(self) -> OffloadConfig:
        """This config with every `RUNTIME_OPTIONS` field at its default: all that `resolve` reads,
        and what `Plan.digest` covers."""
        defaults: dict[str, Any] = {
            f.name: f.default for f in attrs.fields(OffloadConfig) if f.name in RUNTIME_OPTIONS
        }
        if all(getattr(self, k) == v for k, v in defaults.items()):
            return self
        return attrs.evolve(self, **defaults)

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

    # -----------------------------------------------------------------------------------------
    # Named constructors

    @classmethod
    def from_legacy(
        cls,
        *,
        enable_cpu_offload: bool = False,
        enable_layerwise_offload: bool = False,
        enable_distributed_layerwise_offload: bool = False,
        dlo_use_allgather: bool = True,
        dlo_resident_layers: int = 0,
        pin_cpu_memory: bool = True,
        parallel: ParallelLayout | None = None,
        **fields: Any,
    ) -> OffloadConfig:
        """A config from the seeds' legacy flags: distributed > layerwise > model-level.

        The components stay ``None`` (legacy selection). The DiT all-gathers iff
        ``dlo_use_allgather``; encoders stream rank-local. Flags a higher-priority strategy
        overrides are logged (logger ``torchferry``, level INFO). ``fields`` are passed through
        to the config (``prefetch_depth``, ``device_memory_bytes``, ``checkpoint``, ``chunk_bytes``).
        """
        legacy = legacy_fields(
            enable_cpu_offload=enable_cpu_offload,
            enable_layerwise_offload=enable_layerwise_offload,
            enable_distributed_layerwise_offload=enable_distributed_layerwise_offload,
            dlo_use_allgather=dlo_use_allgather,
            dlo_resident_layers=dlo_resident_layers,
            pin_cpu_memory=pin_cpu_memory,
            parallel=parallel,
        )
        return cls(**legacy, **fields)

    @classmethod
    def from_mapping(
        cls,
        config: Mapping[str, Any],
        *,
        pin_cpu_memory: bool = True,
        parallel: ParallelLayout | None = None,
        **fields: Any,
    ) -> OffloadConfig:
        """A config from the compact form ``{"mode", "components", "layer_options", "pin_memory"}``.

        ``mode`` is ``"module"`` (model-level) or ``"layer"``: the distributed strategy when any
        ``weight_transfer`` is ``"allgather"`` or the DiT keeps ``resident_layers``, else layerwise.
        ``components`` is a non-empty list of ``dit``, ``text_encoder``, ``vae``; ``layer_options``
        maps a selected component to ``{"weight_transfer": "rank-local" | "allgather",
        "resident_layers": N}`` (resident layers: DiT only). ``pin_memory`` falls back to
        ``pin_cpu_memory``. Transfers default to rank-local. ``vae`` may be selected in layer mode;
        `resolve` then requires the pipeline to own the VAE's residency (a declared lifecycle).
        """
        return cls(**mapping_fields(config, pin_cpu_memory=pin_cpu_memory, parallel=parallel), **fields)
