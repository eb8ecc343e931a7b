"""Which tensors of a model diffusers' layerwise casting would cast, read from its layers' classes.

diffusers' ``ModelMixin.enable_layerwise_casting`` walks the model from its root and hooks every
Linear, Conv (1-3d, transposed too) and Embedding layer whose path (relative to the model) matches
none of its skip patterns: diffusers' defaults (`SKIP_PATTERNS`), the class's own
``_skip_layerwise_casting_patterns`` and ``_keep_in_fp32_modules``, and the adapter names of peft's
LoRA, LoHa and LoKr layers; a skipped module's children are skipped with it. Discovery marks those
layers' floating tensors ``TensorSpec.castable``, so a ``storage_dtype=`` request
(`torchferry.topology._storage`) stores exactly the tensors diffusers would.
"""

from __future__ import annotations

import re
import sys

from torch import nn

from torchferry.topology._storage import SKIP_PATTERNS
from torchferry.topology._wrapped import is_wrapper

__all__ = ["castable_ids"]

#: The layer classes diffusers' layerwise casting hooks.
_LAYERS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
    nn.Embedding,
)


#: peft's adapter layers, whose adapter names diffusers' casting skips (module, class).
_PEFT_LAYERS = (
    ("peft.tuners.loha.layer", "LoHaLayer"),
    ("peft.tuners.lokr.layer", "LoKrLayer"),
    ("peft.tuners.lora.layer", "LoraLayer"),
)


def _patterns(model: nn.Module) -> tuple[str, ...]:
    patterns = list(SKIP_PATTERNS)
    for attribute in ("_keep_in_fp32_modules", "_skip_layerwise_casting_patterns"):
        patterns.extend(getattr(model, attribute, None) or ())
    # A model with peft layers has imported their modules (reading them imports nothing, nor peft).
    for where, name in _PEFT_LAYERS:
        layer = getattr(sys.modules.get(where), name, None)
        patterns.extend(getattr(layer, "adapter_layer_names", ()))
    return tuple(dict.fromkeys(str(p) for p in patterns))


def castable_ids(model: nn.Module) -> set[int]:
    """Ids of the floating tensors of ``model`` that its layerwise casting would cast."""
    patterns = _patterns(model)
    found: set[int] = set()

    def visit(module: nn.Module, prefix: str) -> None:
        if any(re.search(p, prefix) for p in patterns):
            return
        if isinstance(module, _LAYERS):
            found.update(  # a quantized (wrapper) weight is not cast: its inner tensors move as they are
                id(t)
                for t in (*module.parameters(), *module.buffers())
                if not is_wrapper(t) and t.is_floating_point()
            )
            return
        for name, child in module.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name)

    visit(model, "")
    return found
