"""The host budget across ranks: every rank of the group plans with the least budget, so all read the
same packs from the checkpoint (only their shard of an all-gathered block) and agree on every step."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import torchferry
from torchferry import OffloadWarning
from torchferry.testing import run_ranks, toy

pytestmark = pytest.mark.dist

HIDDEN = 512
MiB = 1 << 20


def _ranks(rank: int, world: int, checkpoint: str) -> dict[str, Any]:
    """Open the toy on every rank with a different host_memory= and run one call."""
    ref = toy.build(0, hidden=HIDDEN)
    with torch.no_grad():
        want = ref("a cat", steps=2)
    pipe = toy.build_empty(hidden=HIDDEN)
    budget = (40 + 8 * rank) * MiB
    session = torchferry.offload(
        pipe, strategy="distributed_layerwise", device="cpu", checkpoint=checkpoint, host_memory=budget
    )
    try:
        with torch.no_grad():
            same = [bool(torch.equal(pipe("a cat", steps=2), want)) for _ in range(2)]
        report = session.report()
        tier = session.engine.store.tier
        shards = [
            r
            for r in (tier.reads.values() if tier is not None else ())
            if r.name.startswith("transformer.blocks.")
        ]
        sharded = {g.name for g in session.engine.store.sharded}
        return {
            "same": same,
            "budget": report.host_budget,
            "source": report.host_budget_source,
            "file_packs": report.file_packs,
            "peak": report.peak_host_bytes,
            "shard_reads": [(r.name, r.nbytes) for r in shards if r.name in sharded],
            "held": {g.name: g.held_bytes for g in session.engine.store.sharded},
        }
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)
            session.close()


def test_ranks_take_the_least_host_budget(tmp_path: Path) -> None:
    """Two ranks given 40 and 48 MiB both plan with 40 MiB (the least of the group), read their own
    shards of the file-tier blocks into staging slots, and run bit-identical to the plain model."""
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=HIDDEN), path)
    results = run_ranks(_ranks, 2, str(path), timeout=240)
    for rank, seen in enumerate(results):
        assert seen["same"] == [True, True], rank
        assert seen["budget"] == 40 * MiB, rank
        assert (
            seen["source"].endswith("the least of the group")
            or "the least of the process group" in seen["source"]
        )
        assert seen["file_packs"] > 0 and seen["peak"] <= 40 * MiB
        assert seen["shard_reads"], rank
        for name, nbytes in seen["shard_reads"]:
            assert nbytes == seen["held"][name]  # only this rank's shard is read
    assert results[0]["file_packs"] == results[1]["file_packs"]
