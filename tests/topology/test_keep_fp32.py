"""What ``_keep_in_fp32_modules`` means, on literal class attributes: the one rule `from_pretrained`,
a GGUF single-file load and the checkpoint reader's widening all read (issue 39, S8)."""

from __future__ import annotations

from typing import ClassVar

from torchferry import topology


class DiffusersModel:
    """A diffusers model class as it declares its float32 modules."""

    __module__ = "diffusers.models.transformers.transformer_wan"
    _keep_in_fp32_modules: ClassVar[list[str]] = ["time_embedder", "scale_shift_table", "norm1"]


class TransformersModel:
    """A transformers model class with both of its lists."""

    __module__ = "transformers.models.t5.modeling_t5"
    _keep_in_fp32_modules: ClassVar[list[str]] = ["wo"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["relative_attention_bias"]


class Declares:
    """A class naming one module as a bare string, with ``None`` in the strict list."""

    __module__ = "diffusers.models.x"
    _keep_in_fp32_modules = "norm_out"
    _keep_in_fp32_modules_strict = None


def test_diffusers_keeps_every_entry_at_any_16_bit_dtype() -> None:
    """A diffusers class keeps all its entries in float16, bfloat16 and float8; none in float32 or a
    dtype that is not floating; an instance reads as its class."""
    everything = frozenset({"time_embedder", "scale_shift_table", "norm1"})
    for dtype in ("float16", "bfloat16", "float8_e4m3fn"):
        assert topology.kept_modules(DiffusersModel, dtype) == everything
    assert topology.kept_modules(DiffusersModel(), "bfloat16") == everything
    assert topology.kept_modules(DiffusersModel, "float32") == frozenset()
    assert topology.kept_modules(DiffusersModel, "int8") == frozenset()
    assert topology.kept_modules(Declares, "bfloat16") == frozenset({"norm_out"})


def test_transformers_keeps_its_lenient_list_in_float16_only() -> None:
    """transformers' dtype rule: the strict list in float16 and bfloat16, ``_keep_in_fp32_modules`` in
    float16 only; with no dtype, every name kept at some dtype (what the reader checks float32
    tensors against)."""
    assert topology.kept_modules(TransformersModel, "float16") == frozenset({"wo", "relative_attention_bias"})
    assert topology.kept_modules(TransformersModel(), "bfloat16") == frozenset({"relative_attention_bias"})
    assert topology.kept_modules(TransformersModel, "float32") == frozenset()
    assert topology.kept_modules(TransformersModel) == frozenset({"wo", "relative_attention_bias"})
    assert topology.kept_modules(object()) == frozenset()


def test_a_tensor_is_kept_when_a_dotted_part_of_its_name_is_kept() -> None:
    """Any dotted part of a name from the model counts (both libraries' test), a part's prefix does
    not."""
    kept = topology.kept_modules(DiffusersModel, "bfloat16")
    assert topology.under_kept("blocks.0.norm1.weight", kept)
    assert topology.under_kept("condition_embedder.time_embedder.linear_1.bias", kept)
    assert not topology.under_kept("blocks.0.norm10.weight", kept)
    assert not topology.under_kept("blocks.0.attn1.to_q.weight", kept)
