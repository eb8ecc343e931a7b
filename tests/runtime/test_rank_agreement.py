"""Ranks that part ways before they agree on the plan: one asks for another strategy or transfer, asks
for other options, or is killed first; every survivor gets an ExecutionError naming the ranks and
what each asked for, and its pipeline is untouched."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import torchferry
from torchferry import ExecutionError
from torchferry.testing import RankError, run_ranks, toy

pytestmark = pytest.mark.dist

#: The group timeout: short, yet long enough for ranks that start seconds apart on a busy machine
#: (a peer that exits or dies is found out at once, when gloo loses its connection).
GROUP_TIMEOUT = 10


def _untouched(p: toy.ToyPipeline) -> bool:
    """Whether ``p`` is as built: no session serves it, no hook on it, its weights as they were."""
    hooks = any(m._forward_pre_hooks or m._forward_hooks for m in p.modules())
    ref = toy.build(0).state_dict()
    same = all(torch.equal(t, ref[k]) for k, t in p.state_dict().items())
    return torchferry.session_of(p) is None and not hooks and same


def _opens(rank: int, world: int, mine: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 opens a session with ``mine``, the others with ``other``; each says how it went."""
    p = toy.build(0)
    try:
        with torchferry.offload(p, device="cpu", **(mine if rank == 0 else other)):
            p("a cat", steps=1)
    except ExecutionError as exc:
        return {"error": str(exc), "untouched": _untouched(p)}
    return {"error": None}


DISTRIBUTED = {"strategy": "distributed_layerwise"}


def _two_sessions(rank: int, world: int, other: dict[str, Any]) -> list[dict[str, Any]]:
    """Both ranks ask for the distributed strategy with other prefetch depths (a failed agreement that
    leaves the group usable), then rank 0 for it again and rank 1 for ``other``."""
    first = _opens(rank, world, {**DISTRIBUTED, "prefetch_depth": 1}, {**DISTRIBUTED, "prefetch_depth": 2})
    return [first, _opens(rank, world, DISTRIBUTED, other)]


@pytest.mark.parametrize(
    "other",
    [{"strategy": "layerwise"}, {"strategy": "distributed_layerwise", "dit_transfer": "rank-local"}],
    ids=["layerwise", "rank-local"],
)
def test_ranks_that_ask_for_other_things_are_named(other: dict[str, Any]) -> None:
    """Ranks asking for other prefetch depths both fail at the first collective, each naming what every
    rank asked for; then a rank that opens a session with no collective (layerwise, or rank-local
    transfers) leaves its peer waiting, and the peer's error names the rank that never joined and what
    the peer asked for, not gloo's timeout alone; nothing was changed on a rank that failed."""
    zero, one = run_ranks(
        _two_sessions, 2, other, timeout=60, group_timeout=GROUP_TIMEOUT, start_method="spawn"
    )
    for rank, seen in enumerate([zero[0], one[0]]):
        assert seen["untouched"], rank
        assert seen["error"] == (
            "the ranks of the 2-rank weight-shard group disagree on what they ask for: rank 0 asked for "
            "strategy='distributed_layerwise', dit_transfer='allgather', encoder_transfer='rank-local', "
            "prefetch_depth=1; rank 1 asked for strategy='distributed_layerwise', dit_transfer='allgather', "
            f"encoder_transfer='rank-local', prefetch_depth=2; this is rank {rank}, and nothing was changed "
            "on it. Every rank must open torchferry.offload(...) on the same pipeline with the same options, "
            "so that all issue the same collectives"
        )
    survivor, peer = zero[1], one[1]
    assert peer == {"error": None}
    assert survivor["untouched"]
    text = survivor["error"]
    assert text.startswith(
        "the ranks of the 2-rank weight-shard group could not agree on the plan: rank 1 never joined: no "
        "weight-sharded session was opened there (another strategy=, dit_transfer='rank-local', no offload "
        "call at all), or the rank died or stalled before it (gloo: "
    ), text
    assert (
        "this is rank 0, which asked for strategy='distributed_layerwise', dit_transfer='allgather', "
        "encoder_transfer='rank-local', and nothing was changed on it"
    ) in text


def _killed_first(rank: int, world: int) -> dict[str, Any]:
    """The last rank is killed before it opens its session; the others open one."""
    if rank == world - 1:
        os._exit(9)
    return _opens(rank, world, DISTRIBUTED, DISTRIBUTED)


def test_a_rank_killed_before_the_agreement_is_named() -> None:
    """A rank killed before the ranks agree on the plan: the survivor's error names it as never
    joined (gloo's words kept in brackets), and the survivor's pipeline is untouched."""
    with pytest.raises(RankError) as caught:
        run_ranks(_killed_first, 2, timeout=60, group_timeout=GROUP_TIMEOUT)
    survivor = caught.value.results[0]
    assert survivor is not None and survivor["untouched"]
    assert survivor["error"].startswith(
        "the ranks of the 2-rank weight-shard group could not agree on the plan: rank 1 never joined"
    ), survivor["error"]
