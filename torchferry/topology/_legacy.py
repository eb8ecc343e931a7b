"""The request's two older forms: the seeds' legacy flags and the compact mapping, read into fields.

Each builder checks its form the way the form names things (``from_legacy(enable_cpu_offload=...)``,
``offload config 'layer_options.dit'``) and returns the `OffloadConfig` keyword arguments it
stands for; `OffloadConfig.from_legacy` and `OffloadConfig.from_mapping` build the config from them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any, cast

from torchferry._errors import PlanError
from torchferry.topology._fields import (
    COMPONENT_NAMES,
    TRANSFERS,
    Strategy,
    Transfer,
    choices,
    require_bool,
    require_int,
    type_name,
)
from torchferry.topology._parallel import ParallelLayout

__all__ = ["MAPPING_FIELDS", "MAPPING_MODES", "legacy_fields", "mapping_fields"]

#: Top-level fields of the compact mapping form, and its modes.
MAPPING_FIELDS: tuple[str, ...] = ("mode", "components", "layer_options", "pin_memory")
MAPPING_MODES: tuple[str, ...] = ("module", "layer")
#: Per-component keys of ``layer_options`` in the compact form.
_LAYER_OPTION_KEYS: tuple[str, ...] = ("weight_transfer", "resident_layers")

logger = logging.getLogger("torchferry")


def legacy_fields(
    *,
    enable_cpu_offload: bool,
    enable_layerwise_offload: bool,
    enable_distributed_layerwise_offload: bool,
    dlo_use_allgather: bool,
    dlo_resident_layers: int,
    pin_cpu_memory: bool,
    parallel: ParallelLayout | None,
) -> dict[str, Any]:
    """The `OffloadConfig` fields the seeds' legacy flags stand for (see `OffloadConfig.from_legacy`)."""
    for name, value in (
        ("enable_cpu_offload", enable_cpu_offload),
        ("enable_layerwise_offload", enable_layerwise_offload),
        ("enable_distributed_layerwise_offload", enable_distributed_layerwise_offload),
        ("dlo_use_allgather", dlo_use_allgather),
        ("pin_cpu_memory", pin_cpu_memory),
    ):
        require_bool(f"from_legacy({name}=...)", value)
    resident = require_int("from_legacy(dlo_resident_layers=...)", dlo_resident_layers)
    if parallel is not None and not isinstance(parallel, ParallelLayout):
        raise TypeError(
            f"from_legacy(parallel=...) must be a ParallelLayout or None, got {type_name(parallel)}"
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
    return {
        "strategy": strategy,
        "dit_transfer": "allgather" if dlo_use_allgather else "rank-local",
        "encoder_transfer": "rank-local",
        "resident_layers": resident,
        "components": None,
        "pin_memory": pin_cpu_memory,
        "parallel": layout,
    }


def mapping_fields(
    config: Mapping[str, Any], *, pin_cpu_memory: bool, parallel: ParallelLayout | None
) -> dict[str, Any]:
    """The `OffloadConfig` fields the compact mapping stands for (see `OffloadConfig.from_mapping`)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"offload config must be a mapping, got {type_name(config)} {config!r}")
    _check_keys("offload config", config)
    unknown = [k for k in config if k not in MAPPING_FIELDS]
    if unknown:
        raise PlanError(
            f"offload config has unknown field(s) {choices(unknown)}; "
            f"allowed fields are {choices(MAPPING_FIELDS)}"
        )
    for required in ("mode", "components"):
        if required not in config:
            raise PlanError(
                f"offload config is missing {required!r}; "
                "write e.g. {'mode': 'layer', 'components': ['dit']}"
            )
    mode = config["mode"]
    if not isinstance(mode, str):
        raise TypeError(f"offload config 'mode' must be a str, got {type_name(mode)} {mode!r}")
    if mode not in MAPPING_MODES:
        raise PlanError(f"offload config 'mode' is {mode!r}; choose one of {choices(MAPPING_MODES)}")
    components = _mapping_components(config["components"])
    options = config.get("layer_options", {})
    if not isinstance(options, Mapping):
        raise TypeError(
            f"offload config 'layer_options' must be a mapping, got {type_name(options)} {options!r}"
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
                f"choose from {choices(COMPONENT_NAMES)}"
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
    require_bool("offload config 'pin_memory'", pin)
    strategy: Strategy
    if mode == "module":
        strategy = "model_level"
    elif "allgather" in transfers.values() or resident > 0:
        strategy = "distributed_layerwise"
    else:
        strategy = "layerwise"
    return {
        "strategy": strategy,
        "dit_transfer": dit_transfer,
        "encoder_transfer": transfers.get("text_encoder", "rank-local"),
        "resident_layers": resident,
        "components": components,
        "pin_memory": pin,
        "parallel": parallel if parallel is not None else ParallelLayout(),
    }


def _check_keys(where: str, value: Mapping[Any, Any]) -> None:
    """Every key at every level of the compact form is a string."""
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{where} keys must be str, got {type_name(key)} {key!r}")
        if isinstance(item, Mapping):
            _check_keys(f"{where} '{key}'", item)


def _mapping_components(value: object) -> frozenset[str]:
    if isinstance(value, (str, Mapping)) or not isinstance(value, Collection):
        raise TypeError(
            "offload config 'components' must be a list of component names, "
            f"got {type_name(value)} {value!r}"
        )
    for item in value:
        if not isinstance(item, str):
            raise TypeError(
                f"offload config 'components' entries must be str, got {type_name(item)} {item!r}"
            )
    if not value:
        raise PlanError(
            f"offload config 'components' is empty; name at least one of {choices(COMPONENT_NAMES)}"
        )
    unknown = [c for c in value if c not in COMPONENT_NAMES]
    if unknown:
        raise PlanError(
            f"offload config 'components' has unknown component(s) {choices(unknown)}; "
            f"choose from {choices(COMPONENT_NAMES)}"
        )
    return frozenset(cast("Collection[str]", value))


def _layer_options(name: str, opts: object) -> tuple[Transfer | None, int | None]:
    where = f"offload config 'layer_options.{name}'"
    if not isinstance(opts, Mapping):
        raise TypeError(f"{where} must be a mapping, got {type_name(opts)} {opts!r}")
    unknown = [k for k in opts if k not in _LAYER_OPTION_KEYS]
    if unknown:
        raise PlanError(
            f"{where} has unknown option(s) {choices(unknown)}; allowed options are "
            f"{choices(_LAYER_OPTION_KEYS)}"
        )
    transfer: Transfer | None = None
    if "weight_transfer" in opts:
        key = f"offload config 'layer_options.{name}.weight_transfer'"
        value = opts["weight_transfer"]
        if not isinstance(value, str):
            raise TypeError(f"{key} must be a str, got {type_name(value)} {value!r}")
        if value not in TRANSFERS:
            raise PlanError(f"{key} is {value!r}; choose one of {choices(TRANSFERS)}")
        if name == "vae" and value != "rank-local":
            raise PlanError(f"{key} is {value!r}; VAE weights always move 'rank-local'")
        transfer = value
    layers: int | None = None
    if "resident_layers" in opts:
        key = f"offload config 'layer_options.{name}.resident_layers'"
        layers = require_int(key, opts["resident_layers"])
        if layers < 0:
            raise PlanError(f"{key} must be >= 0, got {layers}")
        if name != "dit":
            raise PlanError(f"{key} is only supported for 'dit'; move it to layer_options.dit")
    return transfer, layers
