"""What ``_keep_in_fp32_modules`` means: the modules a model's library keeps in float32, one rule.

diffusers and transformers keep some modules of a model in float32 whatever dtype the rest is loaded
in, named by class attributes (`KEEP_LISTS`). diffusers keeps every entry of both whenever the model
is loaded in a floating dtype other than float32; transformers keeps ``_keep_in_fp32_modules_strict``
so, and ``_keep_in_fp32_modules`` only for float16 (its dtype rule). A tensor is under a kept module
when any dotted part of its name, from the model, is one of the names (`under_kept`: both libraries'
test). `torchferry.from_pretrained` builds a model's dtypes by it, a GGUF single-file load keeps those
modules unquantized, and the checkpoint reader widens exactly their 16-bit tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

__all__ = ["KEEP_LISTS", "kept_modules", "under_kept"]

#: The class attributes that name the modules a model keeps in float32.
KEEP_LISTS = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")


def _listed(model: object, attribute: str) -> set[str]:
    value = getattr(model, attribute, None)
    if isinstance(value, str):
        return {value}
    if isinstance(value, Iterable):
        return {v for v in value if isinstance(v, str)}
    return set()


def kept_modules(model: object, dtype: str | None = None) -> frozenset[str]:
    """The module names ``model``'s library (``model`` a model or its class) keeps in float32 when it
    loads ``model`` in ``dtype`` (its name: ``"bfloat16"``); none in float32 or a dtype that is not
    floating. ``None``: every name kept at some dtype (both lists, whatever the library), the set a
    reader checks against tensors the model already holds in float32."""
    cls = model if isinstance(model, type) else type(model)
    lenient, strict = _listed(model, KEEP_LISTS[0]), _listed(model, KEEP_LISTS[1])
    if dtype is None:
        return frozenset(lenient | strict)
    if "float" not in dtype or dtype == "float32":
        return frozenset()
    if cls.__module__.split(".")[0] != "transformers":
        return frozenset(lenient | strict)
    return frozenset(strict | lenient if dtype == "float16" else strict)


def under_kept(name: str, modules: Collection[str]) -> bool:
    """Whether the tensor or module ``name`` (dotted, from the model that declares the lists) is under
    one of ``modules``: any dotted part of it is one of them."""
    return any(part in modules for part in name.split("."))
