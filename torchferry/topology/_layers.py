"""Which tensors of a model diffusers' layerwise casting would cast, read from its layers' classes.

diffusers' ``ModelMixin.enable_layerwise_casting`` walks the model from its root and hooks every
Linear, Conv (1-3d, transposed too) and Embedding layer whose path (relative to the model) matches
none of its skip patterns: diffusers' defaults (`SKIP_PATTERNS`), the class's own
``_skip_layerwise_casting_patterns`` and ``_keep_in_fp32_modules``, and the adapter names of peft's
LoRA, LoHa and LoKr layers; a skipped module's children are skipped with it. Discovery marks those
layers' floating tensors ``TensorSpec.castable``, so a ``storage_dtype=`` request
(`torchferry.topology._storage`) stores exactly the tensors diffusers would.

`dequantized_weights` finds the weights a layer dequantizes at every call: diffusers'
``GGUFLinear`` (a ``nn.Linear`` with a ``compute_dtype``) whose weight is a ``GGUFParameter`` (it
has a ``quant_type``) dequantizes it in its forward and casts the result to ``compute_dtype``.
"""

from __future__ import annotations

import re
import sys

from torch import nn

from torchferry.topology._gguf import GGUF_TYPES
from torchferry.topology._model import Dequantized
from torchferry.topology._storage import SKIP_PATTERNS
from torchferry.topology._wrapped import is_wrapper

__all__ = ["castable_ids", "dequantized_weights"]

_GGUF_BLOCKS = {name: (block, size) for name, block, size in GGUF_TYPES.values()}

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


def dequantized_weights(model: nn.Module) -> dict[int, Dequantized]:
    """Ids of the weights of ``model`` that their layer dequantizes at every call (see the module
    notes), each with what that dequantize makes: its type, logical values and compute dtype."""
    found: dict[int, Dequantized] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if isinstance(module, nn.Linear) else None
        kind = getattr(weight, "quant_type", None)
        if weight is None or kind is None or not hasattr(module, "compute_dtype"):
            continue
        name = str(getattr(kind, "name", kind))
        if name not in _GGUF_BLOCKS or name in ("F32", "F16"):
            continue
        block, size = _GGUF_BLOCKS[name]
        dtype = module.compute_dtype
        found[id(weight)] = Dequantized(
            quant_type=name,
            numel=weight.numel() // size * block,
            dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        )
    return found
