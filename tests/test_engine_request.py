"""What vLLM-Omni's configuration asks of torchferry (`integrations.vllm_omni._request`), on literal settings.

These run in CI without vLLM-Omni: the mapping is a pure function of the settings read from an
``OmniDiffusionConfig``. tests/engines/ drives the same code through vLLM-Omni's own functions.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from torchferry import PlanError
from torchferry.integrations.vllm_omni import (
    EngineRequest,
    EngineSettings,
    engine_request,
    read_settings,
    selects_torchferry,
)
from torchferry.topology import OffloadConfig, ParallelLayout

SELECT = {"offload_backend": "torchferry"}


def settings(options: Any = None, **fields: Any) -> EngineSettings:
    extra = {} if options is None else {"torchferry": options}
    return EngineSettings(additional_config={**SELECT, **extra}, **fields)


def test_only_the_named_backend_selects_torchferry() -> None:
    """Only ``additional_config["offload_backend"] == "torchferry"`` selects torchferry."""
    assert selects_torchferry({"offload_backend": "torchferry"})
    assert not selects_torchferry({})
    assert not selects_torchferry({"offload_backend": "layerwise"})
    assert not selects_torchferry(None)
    assert not selects_torchferry("torchferry")


def test_the_legacy_flags_map_as_vllm_omni_reads_them() -> None:
    """Layerwise, model-level and distributed flags give torchferry's strategy, with pinning, resident
    layers and the DiT transfer carried over."""
    assert engine_request(settings(enable_layerwise_offload=True)).config.strategy == "layerwise"
    assert engine_request(settings(enable_cpu_offload=True)).config.strategy == "model_level"
    unpinned = engine_request(settings(enable_layerwise_offload=True, pin_cpu_memory=False))
    assert unpinned.config.pin_memory is False
    dlo = engine_request(
        settings(
            enable_distributed_layerwise_offload=True,
            dlo_use_allgather=False,
            dlo_resident_layers=2,
            parallel=ParallelLayout(data_parallel_size=2),
        )
    ).config
    assert (dlo.strategy, dlo.dit_transfer, dlo.resident_layers, dlo.parallel.shard_group_size) == (
        "distributed_layerwise",
        "rank-local",
        2,
        2,
    )


def test_the_compact_config_selects_components() -> None:
    """``diffusion_offload_config`` maps through the compact form: mode and the component selection."""
    config = engine_request(
        settings(diffusion_offload_config={"mode": "layer", "components": ["dit", "text_encoder"]})
    ).config
    assert config.strategy == "layerwise"
    assert config.components == frozenset({"dit", "text_encoder"})


def test_torchferrys_own_options_apply_and_become_offload_keywords() -> None:
    """Depth, budgets (sizes read as bytes), storage dtype and spill go to offload; defaults stay out."""
    request = engine_request(
        settings(
            {"prefetch_depth": 2, "host_memory": "32GiB", "storage_dtype": "bfloat16", "spill": "/tmp/spill"},
            enable_layerwise_offload=True,
        )
    )
    assert request.offload_kwargs() == {
        "strategy": "layerwise",
        "prefetch_depth": 2,
        "host_memory_bytes": 32 << 30,
        "storage_dtype": "bfloat16",
        "spill": "/tmp/spill",
    }


def test_auto_names_no_ring_knob() -> None:
    """``strategy: "auto"`` leaves the choice to torchferry: no resident_layers=0 or depth is passed."""
    request = engine_request(settings({"strategy": "auto", "device_memory": "8GiB"}, enable_cpu_offload=True))
    assert request == EngineRequest(
        config=OffloadConfig(strategy="model_level", device_memory_bytes=8 << 30),
        auto=True,
        given=frozenset({"strategy", "device_memory"}),
    )
    assert request.offload_kwargs() == {"strategy": "auto", "device_memory_bytes": 8 << 30}


@pytest.mark.parametrize(
    ("options", "fields", "message"),
    [
        (
            {"prefetch_depht": 2},
            {"enable_layerwise_offload": True},
            "additional_config[\"torchferry\"] has unknown key(s) 'prefetch_depht'; the keys are "
            "'chunk_bytes', 'device_memory', 'host_memory', 'prefetch_depth', 'spill', 'storage_dtype', "
            "'strategy'",
        ),
        (
            {"components": ["dit"]},
            {"enable_layerwise_offload": True},
            'additional_config["torchferry"]["components"]: vLLM-Omni names this option itself; set '
            'diffusion_offload_config["components"] instead and drop it from additional_config["torchferry"]',
        ),
        (
            {"strategy": "model_level"},
            {"enable_layerwise_offload": True},
            "additional_config[\"torchferry\"][\"strategy\"]='model_level': vLLM-Omni's options ask for "
            "enable_layerwise_offload=True ('layerwise'); the strategy is said once",
        ),
        (
            {"strategy": "auto", "prefetch_depth": 2},
            {"enable_layerwise_offload": True},
            'additional_config["torchferry"]: strategy "auto" picks the prefetch depth itself',
        ),
        ({"spill": ""}, {"enable_layerwise_offload": True}, "spill is a folder's path"),
        (None, {}, "none of vLLM-Omni's offload options is set"),
        (None, {"enable_layerwise_offload": True, "cache_backend": "tea_cache"}, "cache_backend='tea_cache'"),
        (
            None,
            {"enable_layerwise_offload": True, "host_weight_runtime_mode": "mmap"},
            "host_weight_runtime_mode='mmap' is vLLM-Omni's own host weight store",
        ),
        (
            None,
            {"enable_layerwise_offload": True, "dlo_host_registration_limit_gib": 4.0},
            "dlo_host_registration_limit_gib=4.0 limits vLLM-Omni's own host registration",
        ),
    ],
    ids=["unknown", "engine_name", "strategy", "auto_depth", "spill", "no_flag", "cache", "hwr", "limit"],
)
def test_misconfiguration_is_refused_in_the_engines_words(
    options: Any, fields: dict[str, Any], message: str
) -> None:
    """Every request torchferry cannot serve is a PlanError naming the option as vLLM-Omni spells it."""
    with pytest.raises(PlanError, match=re.escape(message)):
        engine_request(settings(options, **fields))


@pytest.mark.parametrize(
    ("options", "start"),
    [
        ({"prefetch_depth": "2"}, 'additional_config["torchferry"]["prefetch_depth"]=\'2\': '),
        ({"prefetch_depth": 0}, 'additional_config["torchferry"]["prefetch_depth"]=0: '),
        ({"host_memory": "lots"}, 'additional_config["torchferry"]["host_memory"]=\'lots\': '),
        ({"storage_dtype": "int3"}, 'additional_config["torchferry"]["storage_dtype"]=\'int3\': '),
    ],
)
def test_a_wrong_value_names_its_key(options: dict[str, Any], start: str) -> None:
    """A value of the wrong type or range is refused naming its key under additional_config."""
    with pytest.raises(PlanError, match="^" + re.escape(start)):
        engine_request(settings(options, enable_layerwise_offload=True))


def test_a_non_mapping_options_entry_is_refused() -> None:
    """``additional_config["torchferry"]`` that is not a mapping is refused, saying what it must be."""
    with pytest.raises(PlanError, match=re.escape('additional_config["torchferry"] must be a mapping')):
        engine_request(settings("fast", enable_layerwise_offload=True))


def test_settings_are_read_by_field_name() -> None:
    """`read_settings` reads the engine config's fields by name, its parallel layout included, and
    maps vLLM-Omni's "none" cache backend to no cache backend."""

    class Parallel:
        data_parallel_size = 1
        sequence_parallel_size = 4
        tensor_parallel_size = 2
        use_hsdp = False

    class Config:
        enable_layerwise_offload = True
        cache_backend = "none"
        pin_cpu_memory = False
        parallel_config = Parallel()
        additional_config = SELECT

    read = read_settings(Config())
    assert read.enable_layerwise_offload and not read.enable_cpu_offload
    assert read.cache_backend is None and read.pin_cpu_memory is False
    assert read.parallel == ParallelLayout(sequence_parallel_size=4, tensor_parallel_size=2)
    assert read.parallel.shard_group_size == 4
