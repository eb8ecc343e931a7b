"""Checks the runtime tests share: hooks left on a pipeline, and weights equal to a reference's."""

from __future__ import annotations

import torch


def hook_count(p: torch.nn.Module) -> int:
    """Forward hooks and pre-hooks installed anywhere in ``p``."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in p.modules())


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every parameter and buffer of ``a`` equals ``b``'s: values, strides and devices."""
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k], sb[k]) and sa[k].stride() == sb[k].stride() and sa[k].device == sb[k].device
        for k in sa
    )
