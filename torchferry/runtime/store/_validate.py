"""What `HostStore.prepare` refuses before it allocates anything: live tensors that do not match the
plan, tensors left on meta that nothing fills, weights shared with tensors the session would not
manage, and inference tensors something else still holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from torchferry._errors import PlanError
from torchferry.runtime.memory import (
    shared_elsewhere,
)
from torchferry.runtime.store._fill import (
    swappable,
)
from torchferry.topology import Plan, TensorSpec, find_attr

__all__ = ["Lookup", "check_live", "check_unmanaged", "refuse_shared", "refuse_unswappable", "some"]


class Lookup:
    """Qualified tensor names to the live tensor objects of a pipeline."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def tensor(self, spec: TensorSpec) -> torch.Tensor | None:
        return self.find(spec.name)

    def find(self, name: str) -> torch.Tensor | None:
        try:
            t = find_attr(self.pipeline, name)
        except AttributeError:
            return None
        return t if isinstance(t, torch.Tensor) else None


def check_live(
    specs: Sequence[TensorSpec],
    tensors: Sequence[torch.Tensor | None],
    problems: list[str],
    meta: list[str],
    buffers: list[str],
    *,
    missing_ok: bool = False,
) -> None:
    for spec, t in zip(specs, tensors, strict=True):
        if t is None:
            if not missing_ok:
                problems.append(
                    f"{spec.name}: not found on the pipeline (the topology is stale; discover it again)"
                )
        elif tuple(t.shape) != spec.shape or str(t.dtype).removeprefix("torch.") != (
            spec.compute_dtype or spec.dtype  # a tensor the plan stores in another dtype
        ):
            problems.append(
                f"{spec.name}: the pipeline holds {tuple(t.shape)} {t.dtype}, the topology says "
                f"{spec.shape} {spec.compute_dtype or spec.dtype} (discover it again)"
            )
        elif t.is_meta:
            if spec.buffer and not spec.persistent:
                buffers.append(spec.name)
            meta.append(spec.name)
        elif t.device.type != "cpu":
            problems.append(f"{spec.name}: found on {t.device}")


def check_unmanaged(pipeline: Any, plan: Plan, meta: list[str], unmanaged: list[str]) -> None:
    """Meta tensors of the pipeline that no component of the topology owns: nothing would fill them."""
    if not isinstance(pipeline, nn.Module):
        return
    known = {n for c in plan.topology.components for s in c.all_tensors() for n in (s.name, *s.aliases)}
    named = [*pipeline.named_parameters(), *pipeline.named_buffers()]
    for name, t in named:
        if t.is_meta and name not in known:
            meta.append(name)
            unmanaged.append(name)


def refuse_shared(
    specs: Mapping[str, Sequence[TensorSpec]],
    live: Mapping[str, Sequence[torch.Tensor | None]],
    lookup: Lookup,
) -> None:
    """Raise `PlanError` when a tensor the store takes over shares its storage with one it does not."""
    named: list[tuple[str, torch.Tensor]] = []
    for name, pack in specs.items():
        for spec, t in zip(pack, live[name], strict=True):
            if t is None:
                continue
            named.append((spec.name, t))
            for alias in spec.aliases:
                other = lookup.find(alias)
                if other is not None and other is not t:
                    named.append((alias, other))
    shared = shared_elsewhere(named)
    if shared:
        raise PlanError(
            f"torchferry.offload cannot take over this pipeline: {len(shared)} tensor(s) share their memory "
            f"with a tensor the session would not manage ({some(shared)}): a view or alias of the weight "
            "taken before opening (w[0], w.t(), a state_dict() kept from before, the tensor a parameter was "
            "made from), by your code or cached by a module. The session gives every weight memory of its "
            "own, so that tensor would silently stop sharing it (an edit through one would not reach the "
            "other); drop it (del it, or keep a .clone()) before opening, or take it after opening"
        )


def refuse_unswappable(
    specs: Mapping[str, Sequence[TensorSpec]], live: Mapping[str, Sequence[torch.Tensor | None]]
) -> None:
    """Raise `PlanError` for an inference tensor that cannot be made ordinary in place (see [Note:
    inference tensors])."""
    stuck = [
        spec.name
        for name, pack in specs.items()
        for spec, t in zip(pack, live[name], strict=True)
        if t is not None and not t.is_meta and t.is_inference() and not swappable(t)
    ]
    if stuck:
        raise PlanError(
            f"torchferry.offload cannot take over this pipeline: {len(stuck)} tensor(s) were made under "
            f"torch.inference_mode() and something else holds them ({some(stuck)}: a weak reference, or "
            "the graph of a computation with them outside inference mode, such as a .clone() kept), so "
            "they cannot be made ordinary tensors in place; drop that, or give the "
            "model ordinary tensors first, outside inference mode: model.load_state_dict({k: v.clone() "
            "for k, v in model.state_dict().items()}, assign=True)"
        )


def some(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
