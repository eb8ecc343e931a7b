"""After a collective fails, the engine never waits for the device and keeps its slots (NCCL safety).

On NCCL a gather that lost its peer never completes, so a device-wide synchronize at close would
block forever and freed slot memory could still be written; gloo shows the same state on CPU.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import pytest
import torch

import torchferry
from torchferry import ExecutionError, OffloadWarning
from torchferry.runtime.device._comm import cpu_backend
from torchferry.testing import StreamSanitizer, run_ranks, toy
from torchferry.testing._multiproc import SANITIZE_ENV

#: The ranks run on the stream sanitizer, which counts host waits for the device.
SANITIZED = {SANITIZE_ENV: "1"}


def _dies(rank: int, world: int) -> dict[str, Any]:
    """The last rank exits mid-step; the others report the failure and how close() went."""
    p = toy.build(0)
    session = torchferry.offload(p, strategy="distributed_layerwise", device="cpu")
    if rank == world - 1:
        p.transformer.blocks[3].register_forward_pre_hook(lambda m, a: os._exit(7))
    failed = False
    try:
        p("a cat")
    except ExecutionError:
        failed = True
    engine = session.engine
    streams = engine.streams
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        session.close()
    return {
        "failed": failed,
        "broken": engine.broken,
        "synchronized": streams.synchronized if isinstance(streams, StreamSanitizer) else None,
        "slots kept": bool(engine.slots.slots),
        "weights": torch.equal(p.transformer.patch_in.weight, toy.build(0).transformer.patch_in.weight),
    }


@pytest.mark.dist
def test_a_broken_group_is_never_waited_on_and_its_slots_are_kept() -> None:
    """A survivor of a dead peer closes without a device-wide wait, keeps its slots, and has its weights."""
    with pytest.raises(torchferry.testing.RankError) as caught:
        run_ranks(_dies, 2, timeout=60, group_timeout=10, env=SANITIZED)
    (survivor,) = [r for r in caught.value.results if r is not None]
    assert survivor == {
        "failed": True, "broken": True, "synchronized": 0, "slots kept": True, "weights": True
    }  # fmt: skip


def _healthy(rank: int, world: int) -> dict[str, Any]:
    p = toy.build(0)
    with torchferry.offload(p, strategy="distributed_layerwise", device="cpu") as session:
        p("a cat", steps=1)
        engine = session.engine
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)
            session.close(gather=True)
    streams = engine.streams
    return {
        "broken": engine.broken,
        "synchronized": streams.synchronized if isinstance(streams, StreamSanitizer) else None,
        "slots kept": bool(engine.slots.slots),
    }


@pytest.mark.dist
def test_a_healthy_group_synchronizes_once_and_frees_its_slots_at_close() -> None:
    """The contrast: with every collective done, close waits for the streams once and frees every slot."""
    expected = {"broken": False, "synchronized": 1, "slots kept": False}
    assert run_ranks(_healthy, 2, timeout=60, env=SANITIZED) == [expected] * 2


@pytest.mark.parametrize(
    ("backend", "cpu"),
    [("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", False), ("mpi", False)],
)
def test_agreements_use_a_cpu_backend_when_the_group_has_one(backend: str, cpu: bool) -> None:
    """A group with a gloo CPU backend agrees on the CPU; a NCCL-only group agrees on the device."""
    assert cpu_backend(backend) is cpu


def _chunked(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 fails a step after its agreement, so it drains the step's chunked gathers (landing in
    views of outputs it drops); then both close."""
    from torch.multiprocessing.reductions import StorageWeakRef

    p = toy.build(0)
    session = torchferry.offload(p, strategy="distributed_layerwise", device="cpu", chunk_bytes=4096)
    armed = [rank == 1]

    def fail_once(module: torch.nn.Module, args: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise ValueError("a rank's own error in block 3")

    p.transformer.blocks[3].register_forward_pre_hook(fail_once)
    with contextlib.suppress(ValueError, ExecutionError):  # rank 1 raises its own, rank 0 may too
        p("a cat", steps=1)
    engine = session.engine
    assert engine.comm is not None
    views = len(engine.comm._views)
    slots = [StorageWeakRef(buffer.data.untyped_storage()) for _, buffer in engine.slots.slots.values()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        session.close()
    return {"views": views, "slots": len(slots), "slots alive": sum(not r.expired() for r in slots)}


@pytest.mark.dist
def test_no_memory_is_kept_by_the_groups_views() -> None:
    """A rank that drains a failed step's chunked gathers keeps no views of the outputs it dropped,
    and a healthy close leaves no slot's memory alive with the session still referenced."""
    for seen in run_ranks(_chunked, 2, timeout=60):
        assert seen["slots"] > 0 and seen["views"] == 0 and seen["slots alive"] == 0, seen
