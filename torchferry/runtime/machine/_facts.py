"""Every fact the open planner reads, read once before planning (see [Note: the open planner]): the
machine's (`host_facts`), the device's (its free memory), and the store's of a live pipeline and its
checkpoint (`store_facts`: float32 tensors the checkpoint stores in 16 bits, tensors stored with other
strides, components that keep their own weights). `torchferry plan` reads the store's of a pipeline
built on meta with the same functions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from torchferry import policies
from torchferry._errors import PlanError
from torchferry.runtime.files import WIDENED_FROM, open_checkpoint
from torchferry.runtime.interop import kept_in_float32
from torchferry.runtime.machine._device_facts import device_facts
from torchferry.runtime.machine._host_facts import host_facts
from torchferry.runtime.memory import CudaPinner, contiguous_strides, dense_strides
from torchferry.topology import KeyMap, Plan, StoreFacts, Topology, find_attr

__all__ = [
    "READ_MODE_ENV",
    "module_bytes",
    "read_facts",
    "store_facts",
    "strided_names",
    "widened",
    "widened_names",
]

#: Environment variable forcing how file-tier files are read: ``direct``, ``buffered`` or ``auto``.
READ_MODE_ENV = "TORCHFERRY_READ"


def module_bytes(pipeline: Any, topology: Topology) -> int:
    """Bytes of the pipeline's own CPU tensors the store would take over (each storage once): the
    memory that is freed as the store fills from the module."""
    seen: set[int] = set()
    total = 0
    for c in topology.components:
        if c.on_demand:
            continue
        for spec in c.all_tensors():
            try:
                t = find_attr(pipeline, spec.name)
            except AttributeError:
                continue
            if not isinstance(t, torch.Tensor) or t.is_meta or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def store_facts(
    pipeline: Any,
    plan: Plan,
    *,
    prefix_map: Mapping[str, str] | None = None,
    variant: str | None = None,
    own: frozenset[str] = frozenset(),
) -> StoreFacts:
    """The `StoreFacts` of ``pipeline`` under ``plan``, read once from the module and the checkpoint's
    headers: widened and strided tensors, and the components ``own`` that keep their own weights."""
    return StoreFacts(
        widened=widened(pipeline, plan, prefix_map, variant),
        strided=strided_names(pipeline, plan.topology),
        own=own,
    )


def read_facts(
    pipeline: Any,
    plan: Plan,
    *,
    device: torch.device | None = None,
    prefix_map: Mapping[str, str] | None = None,
    variant: str | None = None,
    own: frozenset[str] = frozenset(),
    measure: bool = False,
) -> policies.Facts:
    """Read every fact the open planner needs, once (see [Note: the open planner]): the machine's
    (`runtime.machine.host_facts`, with the read mode `READ_MODE_ENV` sets, and whether this device's
    pinner, CUDA's page-locking, is held to ``RLIMIT_MEMLOCK``), the device's (`device_facts`; with
    ``measure``, what auto starts from too), the module's and the checkpoint's (`store_facts`,
    through the key map ``prefix_map``)."""
    target = torch.device("cpu") if device is None else device
    copied = plan.config.checkpoint is None
    host = host_facts(
        module_bytes=module_bytes(pipeline, plan.topology) if copied and pipeline is not None else 0,
        pins_locked=target.type == "cuda" and CudaPinner.memlock,
        read_mode=os.environ.get(READ_MODE_ENV, "auto").strip().lower(),
    )
    facts = policies.Facts(
        host=host,
        device=device_facts(target, measure=measure),
        store=store_facts(pipeline, plan, prefix_map=prefix_map, variant=variant, own=own),
    )
    return facts


def widened(
    pipeline: Any, plan: Plan, prefix_map: Mapping[str, str] | None, variant: str | None
) -> frozenset[str]:
    """The float32 model tensors the plan's checkpoint stores in 16 bits (`widened_names`)."""
    path = plan.config.checkpoint
    if path is None or pipeline is None:
        return frozenset()
    return widened_names(pipeline, plan.topology, path, prefix_map=prefix_map, variant=variant)


def widened_names(
    pipeline: Any,
    topo: Topology,
    checkpoint: str,
    *,
    prefix_map: Mapping[str, str] | None = None,
    variant: str | None = None,
) -> frozenset[str]:
    """The float32 model tensors that ``checkpoint`` stores in 16 bits (those a model keeps in
    float32, and any other the file holds narrower, as a GGUF file its biases), and the tensors its
    library makes from other stored tensors on load (`topology.KeyMap`): a file-tier pack keeps each
    in host memory for the session and reads none of them per use (a spill writes them as float32,
    so none there). ``pipeline`` may be built on the meta device (`torchferry plan`)."""
    made = frozenset(t for c in KeyMap.of(prefix_map).conversions for t in c.targets)
    kept = kept_in_float32(pipeline, topo)
    specs = [s for c in topo.components for s in c.all_tensors()]
    floats = {s.name for s in specs if s.dtype == "float32" and s.persistent}
    try:
        with open_checkpoint(checkpoint, pipeline=pipeline, prefix_map=prefix_map, variant=variant) as reader:
            stored = {n: reader.entries.get(reader.key(n)) for n in kept | floats}
            # Beyond the kept ones, those the reader widens as it reads (a GGUF file's 16-bit biases).
            read = frozenset(
                n for n in floats - kept if (e := stored[n]) is not None and reader.widens(n, e.dtype)
            )
    except (PlanError, OSError):
        return kept | made  # the engine names the checkpoint's problem; count every candidate meanwhile
    return made | read | frozenset(n for n in kept if (e := stored[n]) is None or e.dtype in WIDENED_FROM)


def strided_names(pipeline: Any, topo: Topology) -> frozenset[str]:
    """Tensors of ``pipeline`` stored with other strides than row-major (a transposed weight): a
    file-tier read of one goes through the reader's scratch."""
    if pipeline is None:
        return frozenset()
    found: set[str] = set()
    for c in topo.components:
        for spec in c.all_tensors():
            try:
                t = find_attr(pipeline, spec.name)
            except AttributeError:
                continue
            if isinstance(t, torch.Tensor) and tuple(dense_strides(t)) != contiguous_strides(t.shape):
                found.add(spec.name)
    return frozenset(found)
