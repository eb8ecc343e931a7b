"""Storage dtypes (``OffloadConfig.storage_dtype``): which casts are exact, which tensors a request
stores narrower, and how a plan and its digest show it (docs/quantized.md)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from torchferry import PlanError, topology
from torchferry.topology import OffloadConfig, _storage


@pytest.mark.parametrize(
    ("storage", "compute", "exact"),
    [
        ("float8_e4m3fn", "bfloat16", True),
        ("float8_e4m3fn", "float16", True),
        ("float8_e5m2", "bfloat16", True),
        ("float8_e4m3fn", "float32", True),
        ("bfloat16", "float32", True),
        ("float16", "float32", True),
        ("float16", "bfloat16", False),
        ("bfloat16", "float16", False),
        ("float32", "bfloat16", False),
        ("int8", "float32", False),
    ],
)
def test_exact_cast_says_whether_every_stored_value_survives(storage: str, compute: str, exact: bool) -> None:
    """A cast is exact when the compute dtype has at least the storage dtype's mantissa bits and
    exponent range (float8 and the 16-bit floats widen; float16 and bfloat16 do not hold each other)."""
    assert _storage.exact_cast(storage, compute) is exact


@pytest.mark.parametrize(("storage", "compute"), [("float8_e4m3fn", "bfloat16"), ("float16", "float32")])
def test_an_exact_cast_round_trips_every_value(storage: str, compute: str) -> None:
    """Every bit pattern of the storage dtype survives the cast up and back (NaNs stay NaN)."""
    s = getattr(torch, storage)
    width = torch.uint8 if s.itemsize == 1 else torch.int16
    values = torch.arange(2 ** (8 * s.itemsize), dtype=torch.int32).to(width).view(s)
    back = values.to(getattr(torch, compute)).to(s)
    nan = torch.isnan(values.float())
    assert torch.equal(back.float()[~nan], values.float()[~nan]) and torch.isnan(back.float()[nan]).all()


def test_storage_dtype_accepts_a_dtype_or_its_name_and_refuses_the_rest() -> None:
    """``storage_dtype`` takes a torch dtype or its name, and refuses a dtype it cannot store in."""
    assert OffloadConfig(storage_dtype=torch.float8_e4m3fn).storage_dtype == "float8_e4m3fn"
    assert OffloadConfig(storage_dtype="bfloat16").storage_dtype == "bfloat16"
    with pytest.raises(PlanError, match=re.escape("OffloadConfig.storage_dtype is 'int8'; weights can be")):
        OffloadConfig(storage_dtype=torch.int8)
    with pytest.raises(TypeError, match=re.escape("OffloadConfig.storage_dtype must be a dtype or its name")):
        OffloadConfig(storage_dtype=8)  # type: ignore[arg-type]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.zeros(2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x)) + self.table[0]


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, 8)
        self.embed = nn.Embedding(4, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.proj_out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for b in self.blocks:
            x = b(x)
        return self.proj_out(x)


def test_discovery_marks_what_layerwise_casting_casts() -> None:
    """Discovery marks the floating tensors of Linear, Conv and Embedding layers outside the skip
    patterns castable: not norms (``norm``), not ``proj_in``/``proj_out``, not a block's own table."""
    topo = topology.discover(_Model())
    castable = sorted(t.name for c in topo.components for t in c.all_tensors() if t.castable)
    blocks = [f"blocks.{i}.proj.{k}" for i in range(3) for k in ("bias", "weight")]
    assert castable == [*blocks, "embed.weight"]


def test_a_plan_stores_the_castable_tensors_narrower_and_counts_their_bytes() -> None:
    """A ``storage_dtype`` plan gives each castable float32 tensor the storage dtype and its own as
    ``compute_dtype``; the others keep theirs; the block bytes shrink accordingly."""
    topo = topology.discover(_Model())
    plain = topology.resolve(topo, OffloadConfig(strategy="layerwise"))
    stored = topology.resolve(topo, OffloadConfig(strategy="layerwise", storage_dtype="float8_e4m3fn"))
    block = stored.topology.component("").blocks[0]
    kinds = {t.name.removeprefix("blocks.0."): (t.dtype, t.compute_dtype) for t in block.tensors}
    assert kinds == {
        "proj.weight": ("float8_e4m3fn", "float32"),
        "proj.bias": ("float8_e4m3fn", "float32"),
        "norm.weight": ("float32", None),
        "norm.bias": ("float32", None),
        "table": ("float32", None),
    }
    plain_block = plain.topology.component("").blocks[0]
    # the tensors' own bytes shrink; the packed bytes (256-byte aligned pieces) never grow
    assert sum(t.nbytes for t in block.tensors) < sum(t.nbytes for t in plain_block.tensors)
    assert block.nbytes <= plain_block.nbytes
    assert stored.digest != plain.digest


def test_a_default_storage_dtype_leaves_the_digest_as_it_was() -> None:
    """A config that does not set ``storage_dtype`` hashes as before the field existed (the goldens'
    plan digests stay), and one that sets it hashes differently."""
    config = OffloadConfig(strategy="layerwise")
    assert "storage_dtype" not in repr(topology.canonical(config))
    assert "storage_dtype" in repr(topology.canonical(OffloadConfig(storage_dtype="float16")))
    topo = topology.discover(_Model())
    half = topology.resolve(topo, OffloadConfig(strategy="layerwise", storage_dtype="float16"))
    assert half.digest != topology.resolve(topo, config).digest


def test_names_alone_guess_the_castable_tensors_of_a_checkpoint() -> None:
    """Without layer classes (checkpoint headers) a ``weight`` of 2 to 5 dimensions and its ``bias``,
    outside the default skip patterns, are guessed castable; norms, 1-d weights and tables are not."""
    weights = frozenset({"blocks.0.proj"})
    guess = _storage.castable_name
    assert guess("blocks.0.proj.weight", (8, 8), weights)
    assert guess("blocks.0.proj.bias", (8,), weights)
    assert not guess("blocks.0.norm.weight", (8, 8), weights)  # the norm pattern
    assert not guess("proj_in.weight", (8, 8), weights)
    assert not guess("blocks.0.ln.weight", (8,), weights)
    assert not guess("blocks.0.table", (2, 8), weights)
