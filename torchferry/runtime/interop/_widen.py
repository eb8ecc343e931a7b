"""Which model tensors a checkpoint may hold in 16 bits: the float32 tensors a model class keeps so.

diffusers and transformers keep some modules of a model in float32 whatever dtype the rest is loaded
in (``_keep_in_fp32_modules``; transformers' ``_keep_in_fp32_modules_strict`` too): a norm or a time
embedding stored in bfloat16 is widened to float32 as it loads. A model built that way (as
`torchferry.from_pretrained` builds it, and diffusers' own load does) holds those tensors in float32
while the files store 16 bits, and `CheckpointReader` widens exactly these, exactly, on the way in.
A tensor counts when it is under a module its model keeps (`topology.kept_modules` and
`topology.under_kept`: the one rule `from_pretrained` builds the model's dtypes by) and the model
holds it in float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from torchferry.topology import Topology, find_attr, kept_modules, under_kept

__all__ = ["kept_in_float32"]


def _named(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from root.named_parameters(remove_duplicate=False)
    yield from root.named_buffers(remove_duplicate=False)


def kept_in_float32(pipeline: Any, topo: Topology) -> frozenset[str]:
    """The names (from the pipeline root) of every float32 tensor under a module its model keeps in
    float32, over the components of ``topo``; each name of a tied tensor is included."""
    found: set[str] = set()
    for component in topo.components:
        try:
            root = find_attr(pipeline, component.path)
        except AttributeError:
            continue
        if not isinstance(root, nn.Module):
            continue
        for prefix, model in root.named_modules(remove_duplicate=False):
            keep = kept_modules(model)  # at any dtype: the tensors it holds in float32 are the kept ones
            if not keep:
                continue
            for name, tensor in _named(model):
                if tensor.dtype == torch.float32 and under_kept(name, keep):
                    found.add(".".join(p for p in (component.path, prefix, name) if p))
    return frozenset(found)
