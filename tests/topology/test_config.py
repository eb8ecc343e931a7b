"""`OffloadConfig`: field validation, the legacy flags and the compact mapping form."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from torchferry import PlanError
from torchferry.topology import OffloadConfig, ParallelLayout
from torchferry.topology._fields import MAX_PREFETCH_DEPTH

# --- keyword arguments -----------------------------------------------------------------------


def test_defaults_and_derived_properties() -> None:
    """The default request is legacy layerwise with DiT all-gather and a shard group of one."""
    config = OffloadConfig()
    assert config.strategy == "layerwise"
    assert not config.explicit
    assert config.transfer("dit") == "rank-local"
    assert config.dp_size == 1
    assert config.offloads("dit")
    assert not config.offloads("text_encoder")


def test_shard_group_follows_the_parallel_layout() -> None:
    """dp_size is DP; HSDP shard x replicate; else SP; never TP; 1 when nothing all-gathers."""
    dist = {"strategy": "distributed_layerwise"}
    assert OffloadConfig(**dist, parallel=ParallelLayout(data_parallel_size=4)).dp_size == 4
    assert OffloadConfig(**dist, parallel=ParallelLayout(sequence_parallel_size=2)).dp_size == 2
    assert OffloadConfig(**dist, parallel=ParallelLayout(tensor_parallel_size=8)).dp_size == 1
    hsdp = ParallelLayout(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=3)
    assert OffloadConfig(**dist, parallel=hsdp, dit_transfer="rank-local").dp_size == 1
    assert hsdp.shard_group_size == 6
    layout = ParallelLayout(data_parallel_size=4)
    assert OffloadConfig(**dist, parallel=layout, dit_transfer="rank-local").dp_size == 1


def test_checkpoint_accepts_a_path() -> None:
    """A path-like checkpoint is stored as a string."""
    assert OffloadConfig(checkpoint=Path("/x/model.safetensors")).checkpoint == "/x/model.safetensors"


KWARG_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"strategy": 1}, TypeError, "OffloadConfig.strategy must be a str, got int 1"),
    (
        {"strategy": "layer_wise"},
        PlanError,
        "OffloadConfig.strategy is 'layer_wise'; choose one of 'none', 'model_level', 'layerwise', "
        "'distributed_layerwise'",
    ),
    ({"dit_transfer": None}, TypeError, "OffloadConfig.dit_transfer must be a str, got NoneType None"),
    (
        {"encoder_transfer": "nccl"},
        PlanError,
        "OffloadConfig.encoder_transfer is 'nccl'; choose one of 'rank-local', 'allgather'",
    ),
    ({"resident_layers": 1.5}, TypeError, "OffloadConfig.resident_layers must be an int, got float 1.5"),
    ({"resident_layers": True}, TypeError, "OffloadConfig.resident_layers must be an int, got bool True"),
    ({"resident_layers": -1}, PlanError, "OffloadConfig.resident_layers must be >= 0, got -1"),
    ({"prefetch_depth": "2"}, TypeError, "OffloadConfig.prefetch_depth must be an int, got str '2'"),
    ({"prefetch_depth": 0}, PlanError, "OffloadConfig.prefetch_depth must be >= 1, got 0"),
    (
        {"device_memory_bytes": 0},
        PlanError,
        "OffloadConfig.device_memory_bytes must be a positive number of bytes or None, got 0",
    ),
    (
        {"device_memory_bytes": 1e9},
        TypeError,
        "OffloadConfig.device_memory_bytes must be an int, got float 1000000000.0",
    ),
    (
        {"host_memory_bytes": 0},
        PlanError,
        "OffloadConfig.host_memory_bytes must be a positive number of bytes or None, got 0",
    ),
    (
        {"host_memory_bytes": True},
        TypeError,
        "OffloadConfig.host_memory_bytes must be an int, got bool True",
    ),
    (
        {"host_memory_bytes": "0GiB"},
        PlanError,
        "OffloadConfig.host_memory_bytes must be a positive number of bytes, got 0",
    ),
    (
        {"chunk_bytes": -5},
        PlanError,
        "OffloadConfig.chunk_bytes must be a positive number of bytes or None, got -5",
    ),
    ({"pin_memory": 1}, TypeError, "OffloadConfig.pin_memory must be a bool, got int 1"),
    ({"checkpoint": 3}, TypeError, "OffloadConfig.checkpoint must be a path or None, got int 3"),
    ({"parallel": 2}, TypeError, "OffloadConfig.parallel must be a ParallelLayout, got int 2"),
    (
        {"components": 3},
        TypeError,
        "OffloadConfig.components must be None or a collection of component names, got int 3",
    ),
    (
        {"components": {"dit": True}},
        TypeError,
        "OffloadConfig.components must be None or a collection of component names, got dict {'dit': True}",
    ),
    ({"components": ["dit", 2]}, TypeError, "OffloadConfig.components entries must be str, got int 2"),
    (
        {"components": []},
        PlanError,
        "OffloadConfig.components is empty; name at least one of 'dit', 'text_encoder', 'vae', or use "
        "strategy='none' to offload nothing",
    ),
    (
        {"components": ["dit", "unet"]},
        PlanError,
        "OffloadConfig.components has unknown component(s) 'unet'; choose from 'dit', 'text_encoder', 'vae'",
    ),
    (
        {"strategy": "distributed_layerwise", "resident_layers": 2},
        PlanError,
        "OffloadConfig: resident_layers=2 with dit_transfer='allgather' under the distributed_layerwise "
        "strategy; resident blocks keep the loader's rank-local weights, so set dit_transfer='rank-local' "
        "or resident_layers=0",
    ),
    (
        {
            "strategy": "distributed_layerwise",
            "dit_transfer": "rank-local",
            "encoder_transfer": "allgather",
            "parallel": ParallelLayout(use_hsdp=True, hsdp_shard_size=2),
        },
        PlanError,
        "OffloadConfig: distributed_layerwise with all-gather transfers under HSDP would shard parameters "
        "HSDP already shards; set dit_transfer='rank-local' and encoder_transfer='rank-local', or disable "
        "HSDP",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), KWARG_ERRORS)
def test_keyword_validation(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    """Each bad keyword argument raises TypeError (wrong type) or PlanError (bad value), naming the field."""
    with pytest.raises(error, match=re.escape(message)):
        OffloadConfig(**kwargs)


def test_resident_layers_are_fine_outside_distributed_allgather() -> None:
    """Resident layers with the default DiT transfer are fine under plain layerwise (it never gathers)."""
    assert OffloadConfig(strategy="layerwise", resident_layers=3).resident_layers == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"data_parallel_size": 0}, PlanError, "ParallelLayout.data_parallel_size must be >= 1, got 0"),
        (
            {"tensor_parallel_size": "2"},
            TypeError,
            "ParallelLayout.tensor_parallel_size must be an int, got str '2'",
        ),
        ({"use_hsdp": 1}, TypeError, "ParallelLayout.use_hsdp must be a bool, got int 1"),
    ],
)
def test_parallel_layout_validation(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    """ParallelLayout checks its own fields the same way."""
    with pytest.raises(error, match=re.escape(message)):
        ParallelLayout(**kwargs)


# --- legacy flags ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "strategy"),
    [
        ({}, "none"),
        ({"enable_cpu_offload": True}, "model_level"),
        ({"enable_layerwise_offload": True}, "layerwise"),
        ({"enable_distributed_layerwise_offload": True}, "distributed_layerwise"),
    ],
)
def test_legacy_strategy(flags: dict[str, bool], strategy: str) -> None:
    """Each legacy flag alone selects its strategy with the legacy (None) component selection."""
    config = OffloadConfig.from_legacy(**flags)
    assert config.strategy == strategy
    assert config.components is None
    assert config.dit_transfer == "allgather"
    assert config.encoder_transfer == "rank-local"


def test_legacy_priority_logs_what_it_disabled(caplog: pytest.LogCaptureFixture) -> None:
    """Distributed beats layerwise beats model-level, and the overridden flags are logged."""
    with caplog.at_level(logging.INFO, logger="torchferry"):
        config = OffloadConfig.from_legacy(
            enable_cpu_offload=True, enable_layerwise_offload=True, enable_distributed_layerwise_offload=True
        )
        assert config.strategy == "distributed_layerwise"
        config = OffloadConfig.from_legacy(enable_cpu_offload=True, enable_layerwise_offload=True)
        assert config.strategy == "layerwise"
    assert [r.getMessage() for r in caplog.records] == [
        "distributed layerwise offload takes priority; "
        "ignoring enable_layerwise_offload and enable_cpu_offload",
        "layerwise offload takes priority; ignoring enable_cpu_offload",
    ]
    assert {r.name for r in caplog.records} == {"torchferry"}


def test_legacy_rank_local_distributed(caplog: pytest.LogCaptureFixture) -> None:
    """Without all-gather the distributed strategy streams rank-local weights: shard group 1, logged."""
    layout = ParallelLayout(data_parallel_size=4, use_hsdp=True, hsdp_shard_size=4)
    with caplog.at_level(logging.INFO, logger="torchferry"):
        config = OffloadConfig.from_legacy(
            enable_distributed_layerwise_offload=True,
            dlo_use_allgather=False,
            dlo_resident_layers=3,
            pin_cpu_memory=False,
            parallel=layout,
            prefetch_depth=2,
        )
    assert (config.dit_transfer, config.resident_layers, config.pin_memory) == ("rank-local", 3, False)
    assert (config.dp_size, config.prefetch_depth, config.parallel) == (1, 2, layout)
    assert [r.getMessage() for r in caplog.records] == [
        "distributed layerwise offload with dlo_use_allgather=False streams each rank's own loaded weights "
        "(no shard, no all-gather)"
    ]


def test_legacy_allgather_group_size() -> None:
    """With all-gather the legacy distributed config takes its shard group from the layout."""
    config = OffloadConfig.from_legacy(
        enable_distributed_layerwise_offload=True, parallel=ParallelLayout(sequence_parallel_size=4)
    )
    assert config.dp_size == 4


LEGACY_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"enable_cpu_offload": 1}, TypeError, "from_legacy(enable_cpu_offload=...) must be a bool, got int 1"),
    (
        {"dlo_use_allgather": "no"},
        TypeError,
        "from_legacy(dlo_use_allgather=...) must be a bool, got str 'no'",
    ),
    (
        {"dlo_resident_layers": "2"},
        TypeError,
        "from_legacy(dlo_resident_layers=...) must be an int, got str '2'",
    ),
    (
        {"parallel": {"data_parallel_size": 2}},
        TypeError,
        "from_legacy(parallel=...) must be a ParallelLayout or None, got dict",
    ),
    ({"dlo_resident_layers": -1}, PlanError, "from_legacy: dlo_resident_layers must be >= 0, got -1"),
    (
        {"dlo_resident_layers": 2},
        PlanError,
        "from_legacy: dlo_resident_layers=2 requires dlo_use_allgather=False, so that resident blocks keep "
        "the weights the standard loader prepared; pass dlo_use_allgather=False or dlo_resident_layers=0",
    ),
    (
        {
            "enable_distributed_layerwise_offload": True,
            "parallel": ParallelLayout(use_hsdp=True, hsdp_shard_size=2),
        },
        PlanError,
        "from_legacy: enable_distributed_layerwise_offload with dlo_use_allgather=True is incompatible with "
        "HSDP, whose parameters are already sharded; pass dlo_use_allgather=False or disable HSDP",
    ),
]


@pytest.mark.parametrize(("flags", "error", "message"), LEGACY_ERRORS)
def test_legacy_validation(flags: dict[str, Any], error: type[Exception], message: str) -> None:
    """Every bad legacy flag raises TypeError or PlanError with the legacy option names."""
    with pytest.raises(error, match=re.escape(message)):
        OffloadConfig.from_legacy(**flags)


# --- compact mapping -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mapping", "strategy", "dit", "encoder", "resident"),
    [
        (
            {"mode": "module", "components": ["dit", "text_encoder"]},
            "model_level",
            "rank-local",
            "rank-local",
            0,
        ),
        ({"mode": "layer", "components": ["dit"]}, "layerwise", "rank-local", "rank-local", 0),
        (
            {
                "mode": "layer",
                "components": ["dit"],
                "layer_options": {"dit": {"weight_transfer": "allgather"}},
            },
            "distributed_layerwise",
            "allgather",
            "rank-local",
            0,
        ),
        (
            {
                "mode": "layer",
                "components": ["dit", "text_encoder"],
                "layer_options": {"text_encoder": {"weight_transfer": "allgather"}},
            },
            "distributed_layerwise",
            "rank-local",
            "allgather",
            0,
        ),
        (
            {"mode": "layer", "components": ("dit",), "layer_options": {"dit": {"resident_layers": 4}}},
            "distributed_layerwise",
            "rank-local",
            "rank-local",
            4,
        ),
        (
            {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 0}}},
            "layerwise",
            "rank-local",
            "rank-local",
            0,
        ),
    ],
)
def test_mapping_resolution(
    mapping: dict[str, Any], strategy: str, dit: str, encoder: str, resident: int
) -> None:
    """Mode layer becomes distributed when anything all-gathers or the DiT keeps resident layers."""
    config = OffloadConfig.from_mapping(mapping)
    assert (config.strategy, config.dit_transfer, config.encoder_transfer, config.resident_layers) == (
        strategy,
        dit,
        encoder,
        resident,
    )
    assert config.components == frozenset(mapping["components"])
    assert config.explicit


def test_mapping_pin_memory_and_passthrough() -> None:
    """pin_memory comes from the mapping, else the pin_cpu_memory fallback; extra fields pass through."""
    layout = ParallelLayout(data_parallel_size=2)
    config = OffloadConfig.from_mapping(
        {"mode": "layer", "components": ["dit"]}, pin_cpu_memory=False, parallel=layout, prefetch_depth=3
    )
    assert (config.pin_memory, config.parallel, config.prefetch_depth) == (False, layout, 3)
    config = OffloadConfig.from_mapping(
        {"mode": "layer", "components": ["dit"], "pin_memory": True}, pin_cpu_memory=False
    )
    assert config.pin_memory


def test_mapping_allows_vae_in_layer_mode() -> None:
    """`vae` may be selected in layer mode; `resolve` then requires the VAE's declared lifecycle."""
    config = OffloadConfig.from_mapping({"mode": "layer", "components": ["dit", "vae"]})
    assert config.offloads("vae")


MAPPING_ERRORS: list[tuple[object, type[Exception], str]] = [
    (["mode", "layer"], TypeError, "offload config must be a mapping, got list ['mode', 'layer']"),
    ({1: "layer"}, TypeError, "offload config keys must be str, got int 1"),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {2: 1}}},
        TypeError,
        "offload config 'layer_options' 'dit' keys must be str, got int 2",
    ),
    (
        {"mode": "layer", "components": ["dit"], "pin": True},
        PlanError,
        "offload config has unknown field(s) 'pin'; allowed fields are 'mode', 'components', "
        "'layer_options', 'pin_memory'",
    ),
    (
        {"components": ["dit"]},
        PlanError,
        "offload config is missing 'mode'; write e.g. {'mode': 'layer', 'components': ['dit']}",
    ),
    (
        {"mode": "layer"},
        PlanError,
        "offload config is missing 'components'; write e.g. {'mode': 'layer', 'components': ['dit']}",
    ),
    ({"mode": 1, "components": ["dit"]}, TypeError, "offload config 'mode' must be a str, got int 1"),
    (
        {"mode": "block", "components": ["dit"]},
        PlanError,
        "offload config 'mode' is 'block'; choose one of 'module', 'layer'",
    ),
    (
        {"mode": "layer", "components": "dit"},
        TypeError,
        "offload config 'components' must be a list of component names, got str 'dit'",
    ),
    (
        {"mode": "layer", "components": {"dit": 1}},
        TypeError,
        "offload config 'components' must be a list of component names, got dict {'dit': 1}",
    ),
    (
        {"mode": "layer", "components": 5},
        TypeError,
        "offload config 'components' must be a list of component names, got int 5",
    ),
    (
        {"mode": "layer", "components": ["dit", None]},
        TypeError,
        "offload config 'components' entries must be str, got NoneType None",
    ),
    (
        {"mode": "layer", "components": []},
        PlanError,
        "offload config 'components' is empty; name at least one of 'dit', 'text_encoder', 'vae'",
    ),
    (
        {"mode": "layer", "components": ["dit", "unet"]},
        PlanError,
        "offload config 'components' has unknown component(s) 'unet'; "
        "choose from 'dit', 'text_encoder', 'vae'",
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": []},
        TypeError,
        "offload config 'layer_options' must be a mapping, got list []",
    ),
    (
        {"mode": "module", "components": ["dit"], "layer_options": {"dit": {}}},
        PlanError,
        "offload config 'layer_options' only applies to mode 'layer'; remove it or use mode 'layer'",
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"unet": {}}},
        PlanError,
        "offload config 'layer_options' has unknown component 'unet'; "
        "choose from 'dit', 'text_encoder', 'vae'",
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"text_encoder": {}}},
        PlanError,
        "offload config 'layer_options.text_encoder' requires selecting the same component; add "
        "'text_encoder' to 'components' or remove its options",
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": "allgather"}},
        TypeError,
        "offload config 'layer_options.dit' must be a mapping, got str 'allgather'",
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"depth": 2}}},
        PlanError,
        "offload config 'layer_options.dit' has unknown option(s) 'depth'; allowed options are "
        "'weight_transfer', 'resident_layers'",
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": 1}}},
        TypeError,
        "offload config 'layer_options.dit.weight_transfer' must be a str, got int 1",
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "nccl"}}},
        PlanError,
        "offload config 'layer_options.dit.weight_transfer' is 'nccl'; "
        "choose one of 'rank-local', 'allgather'",
    ),
    (
        {"mode": "layer", "components": ["vae"], "layer_options": {"vae": {"weight_transfer": "allgather"}}},
        PlanError,
        "offload config 'layer_options.vae.weight_transfer' is 'allgather'; "
        "VAE weights always move 'rank-local'",
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 1.0}}},
        TypeError,
        "offload config 'layer_options.dit.resident_layers' must be an int, got float 1.0",
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": -2}}},
        PlanError,
        "offload config 'layer_options.dit.resident_layers' must be >= 0, got -2",
    ),
    (
        {
            "mode": "layer",
            "components": ["dit", "text_encoder"],
            "layer_options": {"text_encoder": {"resident_layers": 2}},
        },
        PlanError,
        "offload config 'layer_options.text_encoder.resident_layers' is only supported for 'dit'; move it "
        "to layer_options.dit",
    ),
    (
        {"mode": "layer", "components": ["dit"], "pin_memory": "yes"},
        TypeError,
        "offload config 'pin_memory' must be a bool, got str 'yes'",
    ),
    (
        {
            "mode": "layer",
            "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": "allgather", "resident_layers": 2}},
        },
        PlanError,
        "offload config 'layer_options.dit.resident_layers'=2 requires dit.weight_transfer='rank-local': "
        "resident blocks keep the weights the standard loader prepared",
    ),
]


@pytest.mark.parametrize(("mapping", "error", "message"), MAPPING_ERRORS)
def test_mapping_validation(mapping: object, error: type[Exception], message: str) -> None:
    """Every rule of the compact form: TypeError for types, PlanError for values, whole message."""
    with pytest.raises(error, match=re.escape(message)):
        OffloadConfig.from_mapping(mapping)  # type: ignore[arg-type]


def test_mapping_hsdp_allgather_is_rejected() -> None:
    """HSDP with all-gather from the compact form fails in the config's cross-field check."""
    message = (
        "OffloadConfig: distributed_layerwise with all-gather transfers under HSDP would shard parameters "
        "HSDP already shards; set dit_transfer='rank-local' and encoder_transfer='rank-local', or disable "
        "HSDP"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        OffloadConfig.from_mapping(
            {
                "mode": "layer",
                "components": ["dit"],
                "layer_options": {"dit": {"weight_transfer": "allgather"}},
            },
            parallel=ParallelLayout(use_hsdp=True, hsdp_shard_size=2),
        )


def test_runtime_options_take_no_part_in_the_plan_digest() -> None:
    """Plans differing only in RUNTIME_OPTIONS share a digest; a field resolve reads changes it."""
    from torchferry.topology import RUNTIME_OPTIONS, Plan, Topology

    topo = Topology(pipeline_class="P", components=())

    def digest(config: OffloadConfig) -> str:
        return Plan(topology=topo, config=config, components=()).digest

    base = digest(OffloadConfig())
    runtime = OffloadConfig(
        pin_memory=False,
        prefetch_depth=3,
        device_memory_bytes=2**30,
        checkpoint="/x.safetensors",
        chunk_bytes=4096,
    )
    assert RUNTIME_OPTIONS == (
        "pin_memory",
        "prefetch_depth",
        "device_memory_bytes",
        "checkpoint",
        "chunk_bytes",
        "host_memory_bytes",
    )
    assert runtime.request == OffloadConfig()
    assert digest(runtime) == base
    assert digest(OffloadConfig(host_memory_bytes=2**35)) == base
    assert digest(OffloadConfig(strategy="model_level")) != base


@pytest.mark.parametrize(("value", "expected"), [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), (4096, 4096)])
def test_device_memory_accepts_sizes_as_text(value: object, expected: int) -> None:
    """The budget is bytes or a size such as '24GiB' (decimal and binary units)."""
    assert OffloadConfig(device_memory_bytes=value).device_memory_bytes == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "expected"), [("32GiB", 32 * 2**30), ("64GB", 64 * 10**9), (4096, 4096)])
def test_host_memory_accepts_sizes_as_text(value: object, expected: int) -> None:
    """The host budget reads like the device budget: bytes, or a size such as '32GiB'."""
    assert OffloadConfig(host_memory_bytes=value).host_memory_bytes == expected  # type: ignore[arg-type]
    assert OffloadConfig().host_memory_bytes is None


def test_host_memory_text_that_does_not_parse_names_its_field() -> None:
    """A host budget that is not a size names its own field, not the device budget's."""
    with pytest.raises(PlanError) as caught:
        OffloadConfig(host_memory_bytes="plenty")  # type: ignore[arg-type]
    assert str(caught.value) == (
        "OffloadConfig.host_memory_bytes: cannot read 'plenty' as a size; write a number with a unit such "
        "as 24GiB, 80GB or 512MiB"
    )


@pytest.mark.parametrize("field", ["host_memory_bytes", "device_memory_bytes"])
@pytest.mark.parametrize("text", ["32", " 24.5 "])
def test_a_budget_as_text_without_a_unit_is_refused(field: str, text: str) -> None:
    """Text such as '32' (bytes or GiB?) is refused with the CLI's wording; an int stays bytes."""
    number = text.strip()
    with pytest.raises(PlanError) as caught:
        OffloadConfig(**{field: text})
    assert str(caught.value) == (
        f"OffloadConfig.{field}: '{number}' has no unit; write {number}GiB (binary) or {number}GB (decimal)"
    )
    assert getattr(OffloadConfig(**{field: 32}), field) == 32


def test_a_field_added_later_leaves_older_digests_alone() -> None:
    """A config that leaves host_memory_bytes unset renders (and hashes) as before the field existed."""
    from torchferry.topology import Plan, Topology, canonical

    plan = Plan(topology=Topology(pipeline_class="P", components=()), config=OffloadConfig(), components=())
    rendered = repr(canonical(plan.config))
    assert "host_memory_bytes" not in rendered
    assert "device_memory_bytes" in rendered
    assert "host_memory_bytes" in repr(canonical(OffloadConfig(host_memory_bytes=1)))


def test_device_memory_text_that_does_not_parse_is_refused() -> None:
    """A budget that is not a size names the field and shows how to write one."""
    with pytest.raises(PlanError) as caught:
        OffloadConfig(device_memory_bytes="lots")  # type: ignore[arg-type]
    assert str(caught.value) == (
        "OffloadConfig.device_memory_bytes: cannot read 'lots' as a size; write a number with a unit such "
        "as 24GiB, 80GB or 512MiB"
    )

@pytest.mark.parametrize(
    ("depth", "shown"),
    [
        (MAX_PREFETCH_DEPTH + 1, str(MAX_PREFETCH_DEPTH + 1)),
        (10**6, "1000000"),
        (2**62, str(2**62)),
        (10**5000, "an int of 16610 bits"),
    ],
    ids=["max+1", "10**6", "2**62", "10**5000"],
)
def test_prefetch_depth_is_bounded(depth: int, shown: str) -> None:
    """A depth past MAX_PREFETCH_DEPTH is refused when the config is built, in a short message."""
    with pytest.raises(
        PlanError,
        match=re.escape(
            f"OffloadConfig.prefetch_depth must be at most {MAX_PREFETCH_DEPTH} (blocks in flight ahead of "
            f"the one computing; more than a stack's block count buys nothing), got {shown}"
        )
        + r"\Z",
    ):
        OffloadConfig(prefetch_depth=depth)
    assert OffloadConfig(prefetch_depth=MAX_PREFETCH_DEPTH).prefetch_depth == MAX_PREFETCH_DEPTH
