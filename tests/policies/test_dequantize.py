"""The price of a weight dequantized at every call (diffusers' GGUFLinear): the temporary it holds on the
device, the budget left to the weights, and the compute it adds on a CPU (policies/_dequantize.py)."""

from __future__ import annotations

import pytest

from torchferry import policies, topology
from torchferry.topology import Block, Component, Dequantized, Stack, TensorSpec, Topology


def _weight(name: str, kind: str, rows: int, cols: int, dtype: str | None = "float32") -> TensorSpec:
    block, size = {"Q8_0": (32, 34), "Q4_K": (256, 144), "BF16": (1, 2)}[kind]
    return TensorSpec(
        name=name,
        shape=(rows, cols // block * size),
        dtype="uint8",
        dequantized=Dequantized(quant_type=kind, numel=rows * cols, dtype=dtype),
    )


def _topology() -> Topology:
    blocks = [
        Block(path="blocks.0", tensors=[_weight("blocks.0.q.weight", "Q8_0", 64, 256)]),
        Block(path="blocks.1", tensors=[_weight("blocks.1.q.weight", "Q4_K", 128, 256)]),
    ]
    rest = [
        _weight("proj_out.weight", "BF16", 32, 256),
        TensorSpec(name="norm.weight", shape=(256,), dtype="float32"),
    ]
    dit = Component(
        path="", kind="dit", class_name="T", tensors=rest, stacks=[Stack(attrs=("blocks",), blocks=blocks)]
    )
    return Topology(components=[dit], pipeline_class="T")


def test_the_temporary_is_the_dequantized_tensor_and_its_cast() -> None:
    """A Q8_0 weight dequantizes to float16 and is cast to float32 (both held: 6 bytes a value); BF16's
    dequantize peaks at 8 bytes a value inside (its int32 shift), more than its float32 result; with
    compute in float16 a Q8_0 weight holds 2 bytes; a K-quant's own peak bounds a bfloat16 cast."""
    assert policies.dequantize_bytes(Dequantized(quant_type="Q8_0", numel=1000, dtype="float32")) == 6000
    assert policies.dequantize_bytes(Dequantized(quant_type="BF16", numel=1000, dtype="float32")) == 8000
    assert policies.dequantize_bytes(Dequantized(quant_type="Q4_K", numel=1000, dtype="bfloat16")) == 5190
    assert policies.dequantize_bytes(Dequantized(quant_type="Q8_0", numel=1000, dtype="float16")) == 2000
    assert policies.dequantize_bytes(Dequantized(quant_type="Q6_K", numel=1000, dtype=None)) == 5120


def test_the_largest_layer_is_set_aside_from_the_budget() -> None:
    """The reserve is the largest layer's temporary (Q4_K 128x256 in float32: 196,608 bytes), and
    the weights' budget is what is left, never below 0; a model that dequantizes nothing keeps it all."""
    topo = _topology()
    assert policies.dequantize_reserve(topo) == 128 * 256 * 6
    assert policies.weight_budget(topo, 1 << 20) == (1 << 20) - 196_608
    assert policies.weight_budget(topo, 1000) == 0
    plain = Topology(pipeline_class="T", components=[Component(path="", kind="dit", class_name="T", tensors=[
        TensorSpec(name="w", shape=(4, 4), dtype="float32")])])  # fmt: skip
    assert policies.dequantize_reserve(plain) == 0 and policies.weight_budget(plain, 123) == 123


def test_dequantize_time_is_added_per_block_on_a_cpu_only() -> None:
    """On the CPU class each block computes for its weights' values over the measured rate more (the
    remainder's BF16 weight too); on a GPU class, or with a block time given, nothing is added."""
    topo = _topology()
    cpu = policies.estimate_cost(topo, device=policies.DEVICE_CLASSES["cpu"])
    base = policies.CostModel().block_s
    rates = policies.DEQUANTIZE_VALUES_PER_S
    assert cpu.compute_seconds("blocks.0", block=True) == pytest.approx(base + 64 * 256 / rates["Q8_0"])
    assert cpu.compute_seconds("blocks.1", block=True) == pytest.approx(base + 128 * 256 / rates["Q4_K"])
    assert cpu.compute_seconds("", block=False) == pytest.approx(32 * 256 / rates["BF16"])
    assert "dequantize" in cpu.source
    gpu = policies.estimate_cost(topo, device=policies.DEVICE_CLASSES["h100"])
    assert gpu.compute_seconds("blocks.1", block=True) == base and not gpu.compute_s
    given = policies.estimate_cost(topo, device=policies.DEVICE_CLASSES["cpu"], block_s=0.5)
    assert given.compute_seconds("blocks.1", block=True) == 0.5


def test_a_plan_of_the_topology_keeps_the_facts() -> None:
    """resolve keeps each tensor's Dequantized, so a plan prices what its topology does."""
    topo = _topology()
    plan = topology.resolve(topo, topology.OffloadConfig(strategy="layerwise"))
    assert policies.dequantize_reserve(plan) == policies.dequantize_reserve(topo) == 196_608
