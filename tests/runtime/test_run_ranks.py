"""`run_ranks` starts its ranks as it says: forked from a preloaded server on Linux by default, each
with the parent's environment as it is at the call; spawned as fresh interpreters on request."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest

from torchferry.testing import RankError, run_ranks

#: A variable no other test sets, changed between calls (a forked rank must see the parent's now).
VARIABLE = "TORCHFERRY_TEST_RUN_RANKS"


def _seen(rank: int, world: int) -> tuple[int, str | None, int]:
    """One rank: a string's hash (its interpreter's seed), the variable, and its pid."""
    return hash("transformer.blocks.0"), os.environ.get(VARIABLE), os.getpid()


@pytest.mark.dist
@pytest.mark.skipif(sys.platform != "linux", reason="tests run_ranks' default on Linux (spawn elsewhere)")
def test_forked_ranks_share_the_servers_seed_and_see_the_parents_environment_at_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VARIABLE, "first")
    first = run_ranks(_seen, 2, timeout=60)
    monkeypatch.setenv(VARIABLE, "second")  # (after the server started: it still has "first")
    second = run_ranks(_seen, 2, timeout=60)
    monkeypatch.delenv(VARIABLE)
    third = run_ranks(_seen, 2, timeout=60, env={"OTHER": "1"})
    assert [v for _, v, _ in first] == ["first"] * 2
    assert [v for _, v, _ in second] == ["second"] * 2
    assert [v for _, v, _ in third] == [None] * 2
    assert len({h for h, _, _ in first + second + third}) == 1  # one interpreter, forked
    assert len({p for _, _, p in first + second + third}) == 6  # six processes


@pytest.mark.dist
def test_spawned_ranks_are_fresh_interpreters() -> None:
    """Each spawned rank draws its own string-hash seed, as torchrun's ranks do (unless the
    environment fixes one)."""
    ranks = run_ranks(_seen, 3, timeout=120, start_method="spawn")
    if os.environ.get("PYTHONHASHSEED") not in (None, "random"):
        assert len({h for h, *_ in ranks}) == 1
    else:
        assert len({h for h, *_ in ranks}) == 3  # (a collision of two 64-bit seeds' hashes: never seen)


def test_an_unknown_start_method_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match=r"start_method must be one of forkserver, spawn, got 'fork'"):
        run_ranks(_seen, 2, start_method="fork")


def _fails(rank: int, world: int) -> None:
    raise RuntimeError(f"rank {rank} of {world} fails on purpose")


@pytest.mark.dist
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_failing_rank_is_named_with_its_traceback_under_either_start(start_method: str) -> None:
    if start_method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"this platform has no {start_method} start method (Windows has spawn only)")
    with pytest.raises(RankError, match=r"rank 0 of 2 raised RuntimeError: rank 0 of 2 fails on purpose"):
        run_ranks(_fails, 2, timeout=120, start_method=start_method)
