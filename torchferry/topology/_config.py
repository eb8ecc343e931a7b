"""What the user asked for: the offload request and the parallel layout it runs under.

An `OffloadConfig` is validated field by field when built (``TypeError`` for a wrong type,
`PlanError` for a bad value) and has three named constructors: keyword arguments, the seeds'
legacy flags (`OffloadConfig.from_legacy`) and the compact mapping (`OffloadConfig.from_mapping`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Literal, TypeVar, cast

import attrs

from torchferry._errors import PlanError
from torchferry.topology._units import memory_bytes

__all__ = [
    "COMPONENT_NAMES",
    "MAPPING_FIELDS",
    "MAPPING_MODES",
    "MAX_PREFETCH_DEPTH",
    "RUNTIME_OPTIONS",
    "STRATEGIES",
    "TRANSFERS",
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
#: Top-level fields of the compact mapping form, and its modes.
MAPPING_FIELDS: tuple[str, ...] = ("mode", "components", "layer_options", "pin_memory")
MAPPING_MODES: tuple[str, ...] = ("module", "layer")
#: The `OffloadConfig` fields `resolve` never reads: how the plan is carried out, not what it is.
#: They take no part in `Plan.digest` (the plan is the same plan whatever they say): the prefetch
#: depth and chunk size are knobs of the policy (`policies.builtin`), the budget is what `check`
#: holds schedules to, pinning and the checkpoint path are the runtime's.
RUNTIME_OPTIONS: tuple[str, ...] = (
    "pin_memory",
    "prefetch_depth",
    "device_memory_bytes",
    "checkpoint",
    "chunk_bytes",
)
#: Per-component keys of ``layer_options`` in the compact form.
_LAYER_OPTION_KEYS: tuple[str, ...] = ("weight_transfer", "resident_layers")

logger = logging.getLogger("torchferry")

_T = TypeVar("_T")
_S = TypeVar("_S", bound=str)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(value: object) -> str:
    return type(value).__name__


def _require_int(where: str, value: object) -> int:
    if not _is_int(value):
        raise TypeError(f"{where} must be an int, got {_type_name(value)} {value!r}")
    return cast("int", value)


def _require_bool(where: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be a bool, got {_type_name(value)} {value!r}")
    return value


def _choices(values: Iterable[str]) -> str:
    return ", ".join(repr(v) for v in values)


# ---------------------------------------------------------------------------------------------
# Field validators: every message names the field as ``<Class>.<field>``


def _where(instance: object, attribute: attrs.Attribute[_T]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def _positive(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    where = _where(instance, attribute)
    if _require_int(where, value) < 1:
        raise PlanError(f"{where} must be >= 1, got {value}")


#: The deepest prefetch ring a config accepts. A ring of depth d holds d + 1 whole blocks on the
#: device, and a stack of n blocks keeps at most n of them in flight, so depth past the stack's block
#: count only adds slots no block fills; the longest stack of a known model has 60 blocks. The bound
#: keeps every schedule small (an unbounded depth built 2**62 slots and never finished).
MAX_PREFETCH_DEPTH = 256


def _depth(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    where = _where(instance, attribute)
    depth = _require_int(where, value)
    if depth < 1:
        raise PlanError(f"{where} must be >= 1, got {value}")
    if depth > MAX_PREFETCH_DEPTH:
        raise PlanError(
            f"{where} must be at most {MAX_PREFETCH_DEPTH} (blocks in flight ahead of the one computing; "
            f"more than a stack's block count buys nothing), got {_show_int(depth)}"
        )


def _show_int(value: int) -> str:
    """An int as text, its digits cut short when there are many (a message stays short)."""
    text = str(value) if value.bit_length() < 10_000 else f"an int of {value.bit_length()} bits"
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} digits)"


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    where = _where(instance, attribute)
    if _require_int(where, value) < 0:
        raise PlanError(f"{where} must be >= 0, got {value}")


def _positive_or_none(instance: object, attribute: attrs.Attribute[int | None], value: object) -> None:
    if value is None:
        return
    where = _where(instance, attribute)
    if _require_int(where, value) <= 0:
        raise PlanError(f"{where} must be a positive number of bytes or None, got {value}")


def _bool_field(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    _require_bool(_where(instance, attribute), value)


def _int_field(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    _require_int(_where(instance, attribute), value)


def _one_of(choices: tuple[_S, ...]) -> Callable[[object, attrs.Attribute[_S], object], None]:
    def check(instance: object, attribute: attrs.Attribute[_S], value: object) -> None:
        where = _where(instance, attribute)
        if not isinstance(value, str):
            raise TypeError(f"{where} must be a str, got {_type_name(value)} {value!r}")
        if value not in choices:
            raise PlanError(f"{where} is {value!r}; choose one of {_choices(choices)}")

    return check


# ---------------------------------------------------------------------------------------------
# ParallelLayout


@attrs.frozen(kw_only=True, cache_hash=True)
class ParallelLayout:
    """The parallel layout the pipeline already runs under; the weight-shard group derives from it."""

    data_parallel_size: int = attrs.field(default=1, validator=_positive)
    sequence_parallel_size: int = attrs.field(default=1, validator=_positive)
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    use_hsdp: bool = attrs.field(default=False, validator=_bool_field)
    hsdp_shard_size: int = attrs.field(default=-1, validator=_int_field)
    hsdp_replicate_size: int = attrs.field(default=1, validator=_positive)

    @property
    def shard_group_size(self) -> int:
        """Ranks that share one copy of the weights: DP; HSDP shard x replicate; else SP; never TP."""
        size = self.data_parallel_size
        if self.use_hsdp and self.hsdp_shard_size > 0:
            size = self.hsdp_shard_size * self.hsdp_replicate_size
        if size <= 1 and self.sequence_parallel_size > 1:
            size = self.sequence_parallel_size
        return size


# ---------------------------------------------------------------------------------------------
# OffloadConfig field checks


def _components_converter(value: Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset((value,))
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise TypeError(
            "OffloadConfig.components must be None or a collection of component names, "
            f"got {_type_name(value)} {value!r}"
        )
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(
                f"OffloadConfig.components entries must be str, got {_type_name(item)} {item!r}"
            )
    return frozenset(items)


def _check_components(
    _: object, __: attrs.Attribute[frozenset[str] | None], value: frozenset[str] | None
) -> None:
    if value is None:
        return
    if not value:
        raise PlanError(
            "OffloadConfig.components is empty; name at least one of 'dit', 'text_encoder', 'vae', "
            "or use strategy='none' to offload nothing"
        )
    unknown = sorted(value.difference(COMPONENT_NAMES))
    if unknown:
        raise PlanError(
            f"OffloadConfig.components has unknown component(s) {_choices(unknown)}; "
            f"choose from {_choices(COMPONENT_NAMES)}"
        )


def _path_or_none(value: str | os.PathLike[str] | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"OffloadConfig.checkpoint must be a path or None, got {_type_name(value)} {value!r}")


def _memory_or_none(value: int | str | None) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str):
        return memory_bytes(value, "OffloadConfig.device_memory_bytes")
    return value  # the validator names the wrong type


def _layout(_: object, __: attrs.Attribute[ParallelLayout], value: object) -> None:
    if not isinstance(value, ParallelLayout):
        raise TypeError(f"OffloadConfig.parallel must be a ParallelLayout, got {_type_name(value)} {value!r}")


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
    - ``checkpoint``: a safetensors file, shard folder or ``*.index.json`` to fill host buffers from.
    - ``chunk_bytes``: split each distributed transfer into chunks of at most this size (None: whole).
    - ``parallel``: the parallel layout, from which the shard group size derives.

    The fields in `RUNTIME_OPTIONS` say how the plan is carried out, not what it is: `resolve` reads
    none of them and `Plan.digest` leaves them out (see `request`).

    Across fields: resident layers need rank-local DiT weights under the distributed strategy,
    and the distributed strategy cannot all-gather weights that HSDP already shards.
    """

    strategy: Strategy = attrs.field(default="layerwise", validator=_one_of(STRATEGIES))
    dit_transfer: Transfer = attrs.field(default="allgather", validator=_one_of(TRANSFERS))
    encoder_transfer: Transfer = attrs.field(default="rank-local", validator=_one_of(TRANSFERS))
    resident_layers: int = attrs.field(default=0, validator=_non_negative)
    components: frozenset[str] | None = attrs.field(
        default=None, converter=_components_converter, validator=_check_components
    )
    pin_memory: bool = attrs.field(default=True, validator=_bool_field)
    prefetch_depth: int = attrs.field(default=1, validator=_depth)
    device_memory_bytes: int | None = attrs.field(
        default=None, converter=_memory_or_none, validator=_positive_or_none
    )
    checkpoint: str | None = attrs.field(default=None, converter=_path_or_none)
    chunk_bytes: int | None = attrs.field(default=None, validator=_positive_or_none)
    parallel: ParallelLayout = attrs.field(factory=ParallelLayout, validator=_layout)

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
        for name, value in (
            ("enable_cpu_offload", enable_cpu_offload),
            ("enable_layerwise_offload", enable_layerwise_offload),
            ("enable_distributed_layerwise_offload", enable_distributed_layerwise_offload),
            ("dlo_use_allgather", dlo_use_allgather),
            ("pin_cpu_memory", pin_cpu_memory),
        ):
            _require_bool(f"from_legacy({name}=...)", value)
        resident = _require_int("from_legacy(dlo_resident_layers=...)", dlo_resident_layers)
        if parallel is not None and not isinstance(parallel, ParallelLayout):
            raise TypeError(
                f"from_legacy(parallel=...) must be a ParallelLayout or None, got {_type_name(parallel)}"
            )
        if resident < 0:
            raise PlanError(f"from_legacy: dlo_resident_layers must be >= 0, got {resident}")
        if resident and dlo_use_allgather:
            raise PlanError(
                f"from_legacy: dlo_resident_layers={resident} requires dlo_use_allgather=False, so that "
                "resident blocks keep the weights the standard loader prepared; pass "
                "dlo_use_allgather=False or dlo_resident_layers=0"
            )
        layout = parallel if parallel is not None else ParallelLayout()
        strategy: Strategy
        if enable_distributed_layerwise_offload:
            strategy = "distributed_layerwise"
            disabled = [
                name
                for name, on in (
                    ("enable_layerwise_offload", enable_layerwise_offload),
                    ("enable_cpu_offload", enable_cpu_offload),
                )
                if on
            ]
            if disabled:
                logger.info(
                    "distributed layerwise offload takes priority; ignoring %s", " and ".join(disabled)
                )
            if layout.use_hsdp and dlo_use_allgather:
                raise PlanError(
                    "from_legacy: enable_distributed_layerwise_offload with dlo_use_allgather=True is "
                    "incompatible with HSDP, whose parameters are already sharded; pass "
                    "dlo_use_allgather=False or disable HSDP"
                )
            if not dlo_use_allgather:
                logger.info(
                    "distributed layerwise offload with dlo_use_allgather=False streams each rank's own "
                    "loaded weights (no shard, no all-gather)"
                )
        elif enable_layerwise_offload:
            strategy = "layerwise"
            if enable_cpu_offload:
                logger.info("layerwise offload takes priority; ignoring enable_cpu_offload")
        elif enable_cpu_offload:
            strategy = "model_level"
        else:
            strategy = "none"
        return cls(
            strategy=strategy,
            dit_transfer="allgather" if dlo_use_allgather else "rank-local",
            encoder_transfer="rank-local",
            resident_layers=resident,
            components=None,
            pin_memory=pin_cpu_memory,
            parallel=layout,
            **fields,
        )

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
        if not isinstance(config, Mapping):
            raise TypeError(f"offload config must be a mapping, got {_type_name(config)} {config!r}")
        _check_keys("offload config", config)
        unknown = [k for k in config if k not in MAPPING_FIELDS]
        if unknown:
            raise PlanError(
                f"offload config has unknown field(s) {_choices(unknown)}; "
                f"allowed fields are {_choices(MAPPING_FIELDS)}"
            )
        for required in ("mode", "components"):
            if required not in config:
                raise PlanError(
                    f"offload config is missing {required!r}; "
                    "write e.g. {'mode': 'layer', 'components': ['dit']}"
                )
        mode = config["mode"]
        if not isinstance(mode, str):
            raise TypeError(f"offload config 'mode' must be a str, got {_type_name(mode)} {mode!r}")
        if mode not in MAPPING_MODES:
            raise PlanError(f"offload config 'mode' is {mode!r}; choose one of {_choices(MAPPING_MODES)}")
        components = _mapping_components(config["components"])
        options = config.get("layer_options", {})
        if not isinstance(options, Mapping):
            raise TypeError(
                f"offload config 'layer_options' must be a mapping, got {_type_name(options)} {options!r}"
            )
        if mode == "module" and options:
            raise PlanError(
                "offload config 'layer_options' only applies to mode 'layer'; remove it or use "
                "mode 'layer'"
            )
        transfers: dict[str, Transfer] = {}
        resident = 0
        for name, opts in options.items():
            if name not in COMPONENT_NAMES:
                raise PlanError(
                    f"offload config 'layer_options' has unknown component {name!r}; "
                    f"choose from {_choices(COMPONENT_NAMES)}"
                )
            if name not in components:
                raise PlanError(
                    f"offload config 'layer_options.{name}' requires selecting the same component; "
                    f"add {name!r} to 'components' or remove its options"
                )
            transfer, layers = _layer_options(name, opts)
            if transfer is not None:
                transfers[name] = transfer
            if layers is not None:
                resident = layers
        dit_transfer = transfers.get("dit", "rank-local")
        if resident and dit_transfer == "allgather":
            raise PlanError(
                f"offload config 'layer_options.dit.resident_layers'={resident} requires "
                "dit.weight_transfer='rank-local': resident blocks keep the weights the standard loader "
                "prepared"
            )
        pin = config.get("pin_memory", pin_cpu_memory)
        _require_bool("offload config 'pin_memory'", pin)
        strategy: Strategy
        if mode == "module":
            strategy = "model_level"
        elif "allgather" in transfers.values() or resident > 0:
            strategy = "distributed_layerwise"
        else:
            strategy = "layerwise"
        return cls(
            strategy=strategy,
            dit_transfer=dit_transfer,
            encoder_transfer=transfers.get("text_encoder", "rank-local"),
            resident_layers=resident,
            components=components,
            pin_memory=pin,
            parallel=parallel if parallel is not None else ParallelLayout(),
            **fields,
        )


def _check_keys(where: str, value: Mapping[Any, Any]) -> None:
    """Every key at every level of the compact form is a string."""
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{where} keys must be str, got {_type_name(key)} {key!r}")
        if isinstance(item, Mapping):
            _check_keys(f"{where} '{key}'", item)


def _mapping_components(value: object) -> frozenset[str]:
    if isinstance(value, (str, Mapping)) or not isinstance(value, Collection):
        raise TypeError(
            "offload config 'components' must be a list of component names, "
            f"got {_type_name(value)} {value!r}"
        )
    for item in value:
        if not isinstance(item, str):
            raise TypeError(
                f"offload config 'components' entries must be str, got {_type_name(item)} {item!r}"
            )
    if not value:
        raise PlanError(
            f"offload config 'components' is empty; name at least one of {_choices(COMPONENT_NAMES)}"
        )
    unknown = [c for c in value if c not in COMPONENT_NAMES]
    if unknown:
        raise PlanError(
            f"offload config 'components' has unknown component(s) {_choices(unknown)}; "
            f"choose from {_choices(COMPONENT_NAMES)}"
        )
    return frozenset(cast("Collection[str]", value))


def _layer_options(name: str, opts: object) -> tuple[Transfer | None, int | None]:
    where = f"offload config 'layer_options.{name}'"
    if not isinstance(opts, Mapping):
        raise TypeError(f"{where} must be a mapping, got {_type_name(opts)} {opts!r}")
    unknown = [k for k in opts if k not in _LAYER_OPTION_KEYS]
    if unknown:
        raise PlanError(
            f"{where} has unknown option(s) {_choices(unknown)}; allowed options are "
            f"{_choices(_LAYER_OPTION_KEYS)}"
        )
    transfer: Transfer | None = None
    if "weight_transfer" in opts:
        key = f"offload config 'layer_options.{name}.weight_transfer'"
        value = opts["weight_transfer"]
        if not isinstance(value, str):
            raise TypeError(f"{key} must be a str, got {_type_name(value)} {value!r}")
        if value not in TRANSFERS:
            raise PlanError(f"{key} is {value!r}; choose one of {_choices(TRANSFERS)}")
        if name == "vae" and value != "rank-local":
            raise PlanError(f"{key} is {value!r}; VAE weights always move 'rank-local'")
        transfer = value
    layers: int | None = None
    if "resident_layers" in opts:
        key = f"offload config 'layer_options.{name}.resident_layers'"
        layers = _require_int(key, opts["resident_layers"])
        if layers < 0:
            raise PlanError(f"{key} must be >= 0, got {layers}")
        if name != "dit":
            raise PlanError(f"{key} is only supported for 'dit'; move it to layer_options.dit")
    return transfer, layers
