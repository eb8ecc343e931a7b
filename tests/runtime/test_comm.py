"""The weight-shard collectives use torch's current API: a 2-rank gloo gather warns nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from torchferry.testing import run_ranks


def _gather(rank: int, world: int) -> tuple[list[int], list[str]]:
    """One rank: an agreement, a plain and a chunked gather, and a host re-assembly, recording warnings."""
    from torchferry.runtime.device._comm import Comm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = Comm(dist.group.WORLD, torch.device("cpu"))
        comm.agree("the test", "same text")
        slot = torch.empty(world * 8, dtype=torch.uint8)
        comm.all_gather(slot, torch.full((8,), rank + 1, dtype=torch.uint8), 1, "a block")
        whole = comm.gather_host(torch.full((3,), 10 + rank, dtype=torch.uint8), "a block")
    return [*slot.tolist(), *whole.tolist()], [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.mark.dist
def test_collectives_are_warning_free_on_gloo() -> None:
    """No collective the runtime issues warns (all_gather_into_tensor is deprecated in torch 2.13)."""
    for values, caught in run_ranks(_gather, 2, timeout=60):
        assert values == [1] * 8 + [2] * 8 + [10] * 3 + [11] * 3
        assert caught == []
