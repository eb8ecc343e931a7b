"""The host budget across ranks: every rank of the group plans with the least budget, so all read the
same packs from the checkpoint (only their shard of an all-gathered block) and agree on every step."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import torchferry
from torchferry import ExecutionError, OffloadWarning
from torchferry.testing import RankError, run_ranks, toy

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


def _closes(rank: int, world: int, checkpoint: str) -> dict[str, Any]:
    """Open the toy with file-tier shards twice: leave the first with gather_on_close=True, close the
    second plainly; report what each close gave back and what it kept."""
    want = toy.build(0, hidden=HIDDEN).state_dict()
    seen: dict[str, Any] = {}
    for gather in (True, False):
        pipe = toy.build_empty(hidden=HIDDEN)
        session = torchferry.offload(
            pipe, strategy="distributed_layerwise", device="cpu", checkpoint=checkpoint,
            host_memory=40 * MiB, gather_on_close=gather,
        )  # fmt: skip
        store = session.engine.store
        tier = store.tier
        assert tier is not None
        filed = sorted(g.name for g in store.sharded if g.in_file)
        held = sorted(g.name for g in store.sharded if not g.in_file)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OffloadWarning)
            with session, torch.no_grad():
                pipe("a cat", steps=1)
        got = pipe.state_dict()
        of = {n: [k for k in want if k.startswith(n + ".")] for n in filed + held}
        seen["gather" if gather else "plain"] = {
            "filed": filed,
            "held": held,
            "empty": sorted(n for n, keys in of.items() if all(got[k].numel() == 0 for k in keys)),
            "equal": sorted(n for n, keys in of.items() if all(torch.equal(got[k], want[k]) for k in keys)),
            "all equal": all(torch.equal(got[k], want[k]) for k in want),
            "staging": len(tier.staging),
            "warned": [str(w.message) for w in caught if issubclass(w.category, OffloadWarning)],
            "store": len(store.packs),
        }
    return seen


def test_close_gives_file_tier_shards_back_as_views_of_the_file(tmp_path: Path) -> None:
    """Two ranks holding only their shards of file-tier blocks: gather_on_close=True gives back every
    weight, bit-identical, with no collective for the file-tier blocks (every rank has the file), and
    frees the store (staging slots included); a plain close gives the file-tier blocks back too, as
    views of the file, and warns only of the host-tier shards it keeps (before, the gather raised
    and left the store open)."""
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=HIDDEN), path)
    for rank, seen in enumerate(run_ranks(_closes, 2, str(path), timeout=240)):
        gathered, plain = seen["gather"], seen["plain"]
        assert gathered["filed"], rank  # the case under test: sharded blocks in the file tier
        assert gathered["all equal"] and gathered["empty"] == [] and gathered["warned"] == [], rank
        assert gathered["staging"] == 0 and gathered["store"] == 0, rank
        assert plain["filed"] == gathered["filed"] and plain["staging"] == 0, rank
        assert not set(plain["filed"]) & set(plain["empty"]), rank
        assert set(plain["filed"]) <= set(plain["equal"]), rank
        assert plain["empty"] == plain["held"], rank
        assert len(plain["warned"]) == (1 if plain["held"] else 0), rank
        assert all(f"shard of {len(plain['held'])} all-gathered" in w for w in plain["warned"]), rank


def _dies(rank: int, world: int, checkpoint: str) -> dict[str, Any]:
    """The last rank exits mid-step; the survivor reports how close() went with its file tier."""
    pipe = toy.build_empty(hidden=HIDDEN)
    session = torchferry.offload(
        pipe, strategy="distributed_layerwise", device="cpu", checkpoint=checkpoint, host_memory=40 * MiB
    )
    if rank == world - 1:
        pipe.transformer.blocks[3].register_forward_pre_hook(lambda m, a: os._exit(7))
    failed = False
    try:
        with torch.no_grad():
            pipe("a cat", steps=1)
    except ExecutionError:
        failed = True
    engine = session.engine
    tier = engine.store.tier
    assert tier is not None
    slots = {name: s.buffer.data.numel() for name, s in tier.staging.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        session.close()
    want = toy.build(0, hidden=HIDDEN).state_dict()
    filed = [k for k in want if any(k.startswith(n + ".") for n in tier.reads)]
    return {
        "failed": failed,
        "broken": engine.broken,
        "staging kept": {name: s.buffer.data.numel() for name, s in tier.staging.items()} == slots != {},
        "held": engine.store.memory.held_bytes >= sum(slots.values()),
        "file weights": all(torch.equal(pipe.state_dict()[k], want[k]) for k in filed),
    }


def test_a_broken_group_keeps_the_staging_slots_and_closes(tmp_path: Path) -> None:
    """A survivor of a dead peer closes (no wait on a drain), leaves its pinned staging slots mapped
    (a copy queued behind the failed collective may still read them, as its device slots are kept),
    and gives its file-tier weights back as views of the file (before, close freed the slots)."""
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=HIDDEN), path)
    with pytest.raises(RankError) as caught:
        run_ranks(_dies, 2, str(path), timeout=120, group_timeout=10)
    (survivor,) = [r for r in caught.value.results if r is not None]
    assert survivor == {
        "failed": True, "broken": True, "staging kept": True, "held": True, "file weights": True
    }  # fmt: skip
