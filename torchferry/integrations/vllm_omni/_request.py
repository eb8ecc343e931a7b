"""What vLLM-Omni's configuration asks of torchferry: read once, checked once, in the engine's words.

This module imports nothing of vLLM-Omni: `read_settings` reads an ``OmniDiffusionConfig`` by its
field names into `EngineSettings` (plain data), and `engine_request` maps those to the keyword
options of `torchferry.offload`, refusing every request torchferry cannot serve with a `PlanError`
that names the option as a vLLM-Omni user writes it (``additional_config["torchferry"]["host_memory"]``,
``enable_layerwise_offload=True``). The backend calls it when vLLM-Omni builds the offload backend,
so a misconfiguration stops the engine at startup, never at its first request.

The mapping (docs/engines.md has it as a table):

- vLLM-Omni's own offload options choose the strategy and the selection exactly as its offloader
  does: ``diffusion_offload_config`` (the compact form) through `OffloadConfig.from_mapping`, else
  the legacy flags (distributed > layerwise > model-level, ``dlo_use_allgather``,
  ``dlo_resident_layers``, ``pin_cpu_memory``) through `OffloadConfig.from_legacy`, with the
  parallel layout of ``parallel_config`` (the shard group: DP, HSDP shard x replicate, else SP).
- ``additional_config["torchferry"]`` adds torchferry's own options: ``strategy`` (``"auto"``, or
  the strategy the flags chose), ``prefetch_depth``, ``device_memory``, ``host_memory``,
  ``storage_dtype``, ``chunk_bytes`` and ``spill``. An option vLLM-Omni already has a name for is
  refused there with that name, so no request is said twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from torchferry._errors import PlanError
from torchferry.topology import OffloadConfig, ParallelLayout, memory_bytes

__all__ = [
    "BACKEND_KEY",
    "BACKEND_NAME",
    "OPTIONS_KEY",
    "EngineRequest",
    "EngineSettings",
    "engine_request",
    "read_settings",
    "selects_torchferry",
]

#: ``additional_config[BACKEND_KEY] == BACKEND_NAME`` selects torchferry; nothing else does.
BACKEND_KEY = "offload_backend"
BACKEND_NAME = "torchferry"
#: ``additional_config[OPTIONS_KEY]`` holds torchferry's own options.
OPTIONS_KEY = "torchferry"

#: torchferry's own options, as ``additional_config["torchferry"]`` names them -> the offload keyword.
OWN_OPTIONS = {
    "strategy": "strategy",
    "prefetch_depth": "prefetch_depth",
    "device_memory": "device_memory_bytes",
    "host_memory": "host_memory_bytes",
    "storage_dtype": "storage_dtype",
    "chunk_bytes": "chunk_bytes",
    "spill": "spill",
}
#: Options vLLM-Omni already names: said there, not in ``additional_config["torchferry"]``.
ENGINE_NAMES = {
    "components": 'diffusion_offload_config["components"]',
    "resident_layers": 'dlo_resident_layers (or diffusion_offload_config["layer_options"])',
    "pin_memory": "pin_cpu_memory",
    "dit_transfer": 'dlo_use_allgather (or diffusion_offload_config["layer_options"])',
    "encoder_transfer": 'diffusion_offload_config["layer_options"]',
    "parallel": "parallel_config",
    "checkpoint": "model (the pipeline folder vLLM-Omni loads)",
    "device": "the engine's device (each worker's own)",
}
#: vLLM-Omni's strategy names for its flags, to word a mismatch.
ENGINE_STRATEGY = {
    "model_level": "enable_cpu_offload=True",
    "layerwise": "enable_layerwise_offload=True",
    "distributed_layerwise": "enable_distributed_layerwise_offload=True",
}
WHERE = f'additional_config["{OPTIONS_KEY}"]'


@attrs.frozen(kw_only=True)
class EngineSettings:
    """The fields of vLLM-Omni's ``OmniDiffusionConfig`` torchferry reads, under the engine's names."""

    enable_cpu_offload: bool = False
    enable_layerwise_offload: bool = False
    enable_distributed_layerwise_offload: bool = False
    diffusion_offload_config: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    dlo_use_allgather: bool = True
    dlo_resident_layers: int = 0
    pin_cpu_memory: bool = True
    host_weight_runtime_mode: str = "disabled"
    dlo_host_registration_limit_gib: float = 0.0
    cache_backend: str | None = None
    parallel: ParallelLayout = attrs.field(factory=ParallelLayout)
    additional_config: Mapping[str, Any] = attrs.field(factory=dict, eq=False)


@attrs.frozen(kw_only=True)
class EngineRequest:
    """What `torchferry.offload` is asked: an `OffloadConfig`, whether auto chooses, and the spill folder."""

    config: OffloadConfig
    auto: bool = False
    spill: str | None = None
    #: The keys of ``additional_config["torchferry"]`` given (a delegated pipeline serves none of them).
    given: frozenset[str] = frozenset()

    def offload_kwargs(self) -> dict[str, Any]:
        """The keywords of `torchferry.offload` (and `torchferry.from_pretrained`) for this request.

        Only the fields that differ from `OffloadConfig`'s defaults, so auto stays auto (a ring knob
        such as ``resident_layers=0`` would name a policy) and from_pretrained sets the checkpoint.
        """
        default = OffloadConfig()
        kwargs: dict[str, Any] = {
            f.name: getattr(self.config, f.name)
            for f in attrs.fields(OffloadConfig)
            if f.name != "strategy" and getattr(self.config, f.name) != getattr(default, f.name)
        }
        kwargs["strategy"] = "auto" if self.auto else self.config.strategy
        if self.spill is not None:
            kwargs["spill"] = self.spill
        return kwargs


def selects_torchferry(additional_config: object) -> bool:
    """Whether vLLM-Omni's ``additional_config`` selects torchferry (``"offload_backend": "torchferry"``)."""
    return isinstance(additional_config, Mapping) and additional_config.get(BACKEND_KEY) == BACKEND_NAME


def _parallel(parallel_config: object) -> ParallelLayout:
    if parallel_config is None:
        return ParallelLayout()

    def number(name: str, default: int) -> int:
        value = getattr(parallel_config, name, default)
        return default if value is None else int(value)

    return ParallelLayout(
        data_parallel_size=number("data_parallel_size", 1),
        sequence_parallel_size=max(number("sequence_parallel_size", 1), 1),
        tensor_parallel_size=number("tensor_parallel_size", 1),
        use_hsdp=bool(getattr(parallel_config, "use_hsdp", False)),
        hsdp_shard_size=number("hsdp_shard_size", -1),
        hsdp_replicate_size=number("hsdp_replicate_size", 1),
    )


def read_settings(od_config: object) -> EngineSettings:
    """The fields of an ``OmniDiffusionConfig`` torchferry reads (defaults where a release lacks one)."""
    defaults = EngineSettings()

    def field(name: str) -> Any:
        return getattr(od_config, name, getattr(defaults, name))

    cache = field("cache_backend")
    return EngineSettings(
        enable_cpu_offload=bool(field("enable_cpu_offload")),
        enable_layerwise_offload=bool(field("enable_layerwise_offload")),
        enable_distributed_layerwise_offload=bool(field("enable_distributed_layerwise_offload")),
        diffusion_offload_config=field("diffusion_offload_config"),
        dlo_use_allgather=bool(field("dlo_use_allgather")),
        dlo_resident_layers=int(field("dlo_resident_layers")),
        pin_cpu_memory=bool(field("pin_cpu_memory")),
        host_weight_runtime_mode=str(field("host_weight_runtime_mode") or "disabled"),
        dlo_host_registration_limit_gib=float(field("dlo_host_registration_limit_gib") or 0.0),
        cache_backend=None if cache in (None, "none") else str(cache),
        parallel=_parallel(getattr(od_config, "parallel_config", None)),
        additional_config=field("additional_config") or {},
    )


def _engine_config(settings: EngineSettings) -> OffloadConfig:
    """The request vLLM-Omni's own offload options make, as its offloader reads them."""
    try:
        if settings.diffusion_offload_config is not None:
            return OffloadConfig.from_mapping(
                settings.diffusion_offload_config,
                pin_cpu_memory=settings.pin_cpu_memory,
                parallel=settings.parallel,
            )
        return OffloadConfig.from_legacy(
            enable_cpu_offload=settings.enable_cpu_offload,
            enable_layerwise_offload=settings.enable_layerwise_offload,
            enable_distributed_layerwise_offload=settings.enable_distributed_layerwise_offload,
            dlo_use_allgather=settings.dlo_use_allgather,
            dlo_resident_layers=settings.dlo_resident_layers,
            pin_cpu_memory=settings.pin_cpu_memory,
            parallel=settings.parallel,
        )
    except (PlanError, TypeError, ValueError) as exc:
        raise PlanError(f"vLLM-Omni's offload options, served by torchferry: {exc}") from None


def _refuse_engine_features(settings: EngineSettings) -> None:
    """Refuse the engine features torchferry cannot serve, each with what to do instead."""
    instead = f'or drop additional_config["{BACKEND_KEY}"] to use vLLM-Omni\'s own offloader'
    if settings.cache_backend is not None:
        raise PlanError(
            f'cache_backend={settings.cache_backend!r} with additional_config["{BACKEND_KEY}"]='
            f"'{BACKEND_NAME}': a cache backend skips transformer blocks on some steps, and torchferry "
            "streams every block on a schedule checked before it runs (a skipped block would leave its "
            f"load unwaited); set cache_backend=None, {instead}"
        )
    if settings.host_weight_runtime_mode not in ("disabled", ""):
        raise PlanError(
            f"host_weight_runtime_mode={settings.host_weight_runtime_mode!r} is vLLM-Omni's own host "
            "weight store, and torchferry keeps its own (with a host budget and a file tier); set "
            f"host_weight_runtime_mode='disabled' and give {WHERE}[\"host_memory\"] instead, {instead}"
        )
    if settings.dlo_host_registration_limit_gib:
        raise PlanError(
            f"dlo_host_registration_limit_gib={settings.dlo_host_registration_limit_gib} limits vLLM-Omni's "
            f'own host registration; torchferry\'s host budget is {WHERE}["host_memory"] (such as '
            f'"32GiB"); drop it and set that, {instead}'
        )


def _own_options(config: OffloadConfig, options: Mapping[str, Any]) -> tuple[OffloadConfig, bool, str | None]:
    """``config`` with torchferry's own options applied, each checked and refused in the engine's words."""
    unknown = sorted(set(options) - set(OWN_OPTIONS))
    for key in unknown:
        if key in ENGINE_NAMES:
            raise PlanError(
                f'{WHERE}["{key}"]: vLLM-Omni names this option itself; set {ENGINE_NAMES[key]} instead '
                f"and drop it from {WHERE}"
            )
    if unknown:
        raise PlanError(
            f"{WHERE} has unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
            f"{', '.join(map(repr, sorted(OWN_OPTIONS)))}"
        )
    auto = False
    spill: str | None = None
    for key, value in options.items():
        where = f'{WHERE}["{key}"]={value!r}'
        if key == "spill":
            if not isinstance(value, str) or not value:
                raise PlanError(f"{where}: spill is a folder's path, as a non-empty string")
            spill = value
            continue
        if key == "strategy":
            if value == "auto":
                auto = True
                continue
            if value != config.strategy:
                flag = ENGINE_STRATEGY.get(config.strategy, f"strategy {config.strategy!r}")
                raise PlanError(
                    f"{where}: vLLM-Omni's options ask for {flag} ({config.strategy!r}); the strategy is "
                    f'said once: leave it to those options, or set {WHERE}["strategy"]="auto" to let '
                    "torchferry choose within the device budget"
                )
            continue
        field = OWN_OPTIONS[key]
        try:
            size = field in ("device_memory_bytes", "host_memory_bytes") and isinstance(value, str)
            changes: dict[str, Any] = {field: memory_bytes(value, key) if size else value}
            config = attrs.evolve(config, **changes)
        except (PlanError, TypeError, ValueError) as exc:
            raise PlanError(f"{where}: {exc}") from None
    if auto and config.prefetch_depth != OffloadConfig().prefetch_depth:
        raise PlanError(
            f'{WHERE}: strategy "auto" picks the prefetch depth itself; drop "prefetch_depth", or name '
            'the strategy with vLLM-Omni\'s flag and drop "strategy"'
        )
    return config, auto, spill


def engine_request(settings: EngineSettings) -> EngineRequest:
    """The torchferry request vLLM-Omni's configuration makes, or a `PlanError` in vLLM-Omni's words.

    Called only when ``additional_config`` selects torchferry (`selects_torchferry`).
    """
    options = settings.additional_config.get(OPTIONS_KEY, {})
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise PlanError(
            f'{WHERE} must be a mapping of torchferry\'s options (such as {{"host_memory": "32GiB"}}), '
            f"got {type(options).__name__} {options!r}"
        )
    _refuse_engine_features(settings)
    config = _engine_config(settings)
    if config.strategy == "none":
        raise PlanError(
            f"additional_config[\"{BACKEND_KEY}\"]='{BACKEND_NAME}' selects torchferry, but none of "
            "vLLM-Omni's offload options is set, so the engine would load every weight onto the device "
            "before any offloader runs; set enable_layerwise_offload=True (layerwise), enable_cpu_offload="
            "True (model-level), enable_distributed_layerwise_offload=True, or diffusion_offload_config"
        )
    config, auto, spill = _own_options(config, options)
    return EngineRequest(config=config, auto=auto, spill=spill, given=frozenset(options))
