"""What a weight dequantized at every call costs: compute time per block, and a device temporary.

diffusers' ``GGUFLinear`` (without the fused CUDA kernels of the ``kernels`` package) runs
``dequantize_gguf_tensor(weight).to(compute_dtype)`` in every forward, then its matmul. So each
call pays a dequantize proportional to the weight's logical values, by ggml type, and holds
temporaries: inside the dequantize, its intermediates (`DEQUANTIZE_PEAK_BYTES`: up to 12 bytes a
value for the IQ4 types, 8 for BF16, measured), and while the cast runs, the dequantized tensor
(float16 for the Q-types and K-quants, float32 for BF16 and the IQ4 types, as diffusers 0.42's
dequantize functions return it) and its cast to the compute dtype (none when the two dtypes are
equal: ``.to`` then returns its input). All are freed when the layer returns, so what must fit
beside the weights is the largest layer's larger of the two.

`dequantize_bytes` and `dequantize_reserve` price the temporary; `weight_budget` is the device
budget the weights' schedule gets once the largest temporary is set aside: ``torchferry plan`` and
the session both call it, so a plan that fits leaves that room. `dequantize_seconds` prices the
time at `DEQUANTIZE_VALUES_PER_S`, which are CPU figures (see there); `estimate_cost` adds it to
each block's compute on a CPU device only, since no GPU figure was measured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

from torchferry.policies._sim import CostModel
from torchferry.topology import Dequantized, Plan, TensorSpec, Topology, dtype_size

__all__ = [
    "DEQUANTIZED_DTYPE",
    "DEQUANTIZE_PEAK_BYTES",
    "DEQUANTIZE_VALUES_PER_S",
    "dequantize_bytes",
    "dequantize_paths",
    "dequantize_reserve",
    "dequantize_seconds",
    "dequantized_tensors",
    "weight_budget",
    "with_dequantize",
]

#: The dtype diffusers' dequantize function of each ggml type returns (diffusers 0.42.1, read by
#: running each on a tiny tensor: ``benchmarks/gguf_dequantize.py`` prints it).
DEQUANTIZED_DTYPE: Mapping[str, str] = MappingProxyType(
    {
        "BF16": "float32",
        "IQ4_NL": "float32",
        "IQ4_XS": "float32",
        **dict.fromkeys(
            ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"), "float16"
        ),
    }
)

#: Peak bytes per logical value alive inside diffusers' dequantize of each ggml type (its
#: intermediates and result; the packed weight itself not counted): measured by
#: ``benchmarks/gguf_dequantize.py``, which counts every tensor the dequantize makes (a dispatch
#: mode) until it is freed, on a 64 x 1024 weight (diffusers 0.42.1).
DEQUANTIZE_PEAK_BYTES: Mapping[str, float] = MappingProxyType(
    {
        "BF16": 8.0,
        "Q8_0": 2.0,
        "Q4_0": 3.0,
        "Q4_1": 5.0,
        "Q5_0": 10.0,
        "Q5_1": 10.0,
        "Q2_K": 5.25,
        "Q3_K": 5.31,
        "Q4_K": 5.19,
        "Q5_K": 7.19,
        "Q6_K": 5.12,
        "IQ4_NL": 12.0,
        "IQ4_XS": 12.22,
    }
)

#: Logical values per second that diffusers' ``dequantize_gguf_tensor(w).to(torch.float32)`` makes
#: on a CPU, by ggml type: measured by ``benchmarks/gguf_dequantize.py`` (a 256 x 4096 weight, one
#: thread, the fastest of 5 calls, diffusers 0.42.1, torch 2.13 on a shared 2-core cloud VM; runs at
#: other loads of that box differ by up to 2x either way). A CPU
#: figure: a GPU dequantizes far faster and was not measured, so it is applied on CPU devices only.
DEQUANTIZE_VALUES_PER_S: Mapping[str, float] = MappingProxyType(
    {
        "BF16": 3.59e9,
        "Q8_0": 824e6,
        "Q4_0": 274e6,
        "Q4_1": 361e6,
        "Q5_0": 257e6,
        "Q5_1": 162e6,
        "Q2_K": 118e6,
        "Q3_K": 121e6,
        "Q4_K": 308e6,
        "Q5_K": 285e6,
        "Q6_K": 296e6,
        "IQ4_NL": 194e6,
        "IQ4_XS": 220e6,
    }
)


def dequantize_bytes(weight: Dequantized) -> int:
    """Bytes ``weight``'s layer holds at most while it dequantizes it (see the module notes): the
    larger of the dequantize's own peak (`DEQUANTIZE_PEAK_BYTES`) and the dequantized tensor plus its
    cast to the compute dtype when that is another dtype."""
    made = DEQUANTIZED_DTYPE.get(weight.quant_type, "float32")
    cast = dtype_size(made)
    if weight.dtype is not None and weight.dtype != made:
        cast += dtype_size(weight.dtype)
    inside = DEQUANTIZE_PEAK_BYTES.get(weight.quant_type, max(DEQUANTIZE_PEAK_BYTES.values()))
    return math.ceil(weight.numel * max(inside, float(cast)))


def dequantize_seconds(weights: Iterable[Dequantized], *, rates: Mapping[str, float] | None = None) -> float:
    """Seconds one call of the layers holding ``weights`` spends dequantizing them, at ``rates``
    (logical values per second by ggml type; default `DEQUANTIZE_VALUES_PER_S`, a CPU figure)."""
    table = DEQUANTIZE_VALUES_PER_S if rates is None else rates
    slowest = min(table.values(), default=0.0)
    total = 0.0
    for w in weights:
        rate = table.get(w.quant_type, slowest)
        total += w.numel / rate if rate > 0 else 0.0
    return total


def dequantized_tensors(tensors: Iterable[TensorSpec]) -> tuple[Dequantized, ...]:
    """What the layers of ``tensors`` dequantize at every call (`TensorSpec.dequantized`)."""
    return tuple(t.dequantized for t in tensors if t.dequantized is not None)


def dequantize_reserve(model: Topology | Plan) -> int:
    """Device bytes the largest dequantize temporary of ``model`` takes beside the weights (0 when no
    layer dequantizes its weight): one layer runs at a time, so the largest is what must fit."""
    topo = model.topology if isinstance(model, Plan) else model
    found = (dequantize_bytes(d) for c in topo.components for t in c.all_tensors() if (d := t.dequantized))
    return max(found, default=0)


def weight_budget(model: Topology | Plan, budget: int) -> int:
    """The device bytes the weights' schedule may use out of ``budget``: what is left once the largest
    dequantize temporary (`dequantize_reserve`) is set aside, never below 0."""
    return max(budget - dequantize_reserve(model), 0)


def dequantize_paths(
    topo: Topology, rates: Mapping[str, float] | None = None
) -> dict[str, tuple[float, bool]]:
    """Per block and component path of ``topo`` whose layers dequantize their weights: the seconds one
    call spends on it (`dequantize_seconds` at ``rates``), and whether the path is a block."""
    found: dict[str, tuple[float, bool]] = {}
    for top in topo.components:
        for c in top.walk():
            for b in c.blocks:
                if s := dequantize_seconds(dequantized_tensors(b.tensors), rates=rates):
                    found[b.path] = (s, True)
            if s := dequantize_seconds(dequantized_tensors(c.tensors), rates=rates):
                found[c.path] = (s, False)
    return found


def with_dequantize(cost: CostModel, topo: Topology, rates: Mapping[str, float] | None = None) -> CostModel:
    """``cost`` with each block's and component's dequantize time (`dequantize_paths` at ``rates``,
    default the CPU figures) added to its compute, per path; unchanged when nothing dequantizes."""
    extra = dequantize_paths(topo, rates)
    if not extra:
        return cost
    compute = dict(cost.compute_s)
    for path, (s, block) in extra.items():
        compute[path] = cost.compute_seconds(path, block=block) - cost.launch_s + s
    blocks = [s for s, block in extra.values() if block]
    mean = sum(blocks) / max(1, len(blocks))
    what = f"dequantize {mean * 1e3:.3g} ms per block at CPU rates measured (benchmarks/gguf_dequantize.py)"
    return attrs.evolve(cost, compute_s=compute, source=f"{cost.source}; {what}" if cost.source else what)
