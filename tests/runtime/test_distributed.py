"""The multi-rank runtime on spawned gloo processes: sharded host weights, all-gathers, agreement, failures.

Spawning is slow, so each test runs one batch of checks on every rank (the ``_...`` workers below run
inside the children and return what they saw) and asserts on the results in the parent.
"""

from __future__ import annotations

import math
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import torchferry
from torchferry import ExecutionError, OffloadWarning, PlanError, policies
from torchferry.policies import shard_nbytes
from torchferry.runtime import CheckpointReader
from torchferry.testing import RankError, run_ranks, toy

pytestmark = pytest.mark.dist

CALLS: list[dict[str, Any]] = [{"steps": 2}, {"steps": 3, "skip": {1: {2}, 2: {7}}}]

#: name -> (offload options, two experts, from the checkpoint on a meta-built pipeline)
CASES: dict[str, tuple[dict[str, Any], bool, bool]] = {
    "allgather": ({"prefetch_depth": 2}, False, False),
    "allgather-chunked-experts": (
        {"chunk_bytes": 4096, "components": {"dit", "text_encoder"}, "encoder_transfer": "allgather"},
        True,
        False,
    ),
    "rank-local": ({"dit_transfer": "rank-local"}, False, False),
    "rank-local-resident": ({"dit_transfer": "rank-local", "resident_layers": 2}, False, False),
    "allgather-encoder-resident-dit": (
        {
            "dit_transfer": "rank-local",
            "resident_layers": 2,
            "encoder_transfer": "allgather",
            "components": {"dit", "text_encoder"},
        },
        False,
        False,
    ),
    "checkpoint-allgather-chunked": ({"chunk_bytes": 5000}, False, True),
    "checkpoint-rank-local-resident": ({"dit_transfer": "rank-local", "resident_layers": 1}, False, True),
}


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k], sb[k]) and sa[k].stride() == sb[k].stride() for k in sa
    )


def _snapshot(p: torch.nn.Module) -> dict[str, tuple[int, str]]:
    named = [*p.named_parameters(remove_duplicate=False), *p.named_buffers(remove_duplicate=False)]
    return {n: (id(t), f"{t.device}:{0 if t.is_meta else t.data_ptr()}") for n, t in named}


class _Reads:
    """Counts the checkpoint bytes the reader copies (wrapping its real copy routine)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._copy = CheckpointReader._copy

    def __enter__(self) -> _Reads:
        reads = self

        def copy(reader: CheckpointReader, file: str, src: int, dst: torch.Tensor) -> None:
            reads.bytes += dst.numel()
            reads._copy(reader, file, src, dst)

        CheckpointReader._copy = copy  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        CheckpointReader._copy = self._copy  # type: ignore[method-assign]


# ------------------------------------------------------------------------------ workers (children)


def _uncovered(group: Any) -> int:
    """Bytes of ``group``'s host buffer no tensor covers (alignment padding, a shard's zero tail)."""
    start, end = group.shard if group.shard is not None else (0, group.nbytes)
    covered = sum(max(0, min(p.offset + p.nbytes, end) - max(p.offset, start)) for p in group.pieces)
    return int(group.host.numel()) - covered


def _equivalence(rank: int, world: int, checkpoint: str) -> dict[str, dict[str, Any]]:
    """Every case of CASES on this rank: outputs, host bytes, bytes read, and the way back."""
    seen: dict[str, dict[str, Any]] = {}
    refs = {two: toy.build(0, two_experts=two) for two in (False, True)}
    expected = {two: [refs[two]("a cat", **call) for call in CALLS] for two in (False, True)}
    for name, (options, two, from_checkpoint) in CASES.items():
        p = toy.build_empty(two_experts=two) if from_checkpoint else toy.build(0, two_experts=two)
        extra = {"checkpoint": checkpoint} if from_checkpoint else {}
        with _Reads() as reads:
            session = torchferry.offload(
                p, strategy="distributed_layerwise", device="cpu", **options, **extra
            )
        row: dict[str, Any] = {"read": reads.bytes}
        row["outputs"] = [torch.equal(p("a cat", **c), e) for c, e in zip(CALLS, expected[two], strict=True)]
        plan = session.plan
        streamed = {b.path: b.nbytes for c in plan.components for b in c.blocks}
        sharded = session.engine.store.sharded
        row["shards"] = {g.name: (g.host.numel(), streamed[g.name]) for g in sharded}
        row["host"] = session.host_bytes
        row["full_host"] = sum(g.nbytes for g in session.engine.store.packs.values())
        row["uncovered"] = sum(_uncovered(g) for g in session.engine.store.packs.values())
        row["gathers"] = sum(op.kind == "gather" for s in session.schedules.values() for op in s.ops)
        row["chunks"] = max((op.chunks for s in session.schedules.values() for op in s.ops), default=1)
        if sharded:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                session.close()
            row["warned"] = [str(w.message) for w in caught if issubclass(w.category, OffloadWarning)]
            row["empty"] = all(t.shape == (0,) for g in sharded for t in g.tensors)
            session.close(gather=True)
        else:
            session.close()
        row["restored"] = _same(p, refs[two])
        seen[name] = row
    return seen


def _disagree(rank: int, world: int, good: str, bad: str) -> dict[str, tuple[str, str, float, bool]]:
    """Ranks that disagree on the plan, on a schedule, or on whether their checkpoint is sound."""
    seen: dict[str, tuple[str, str, float, bool]] = {}

    def attempt(name: str, p: torch.nn.Module, run: Any) -> None:
        before = _snapshot(p)
        start = time.monotonic()
        try:
            run()
            seen[name] = ("ok", "", time.monotonic() - start, _snapshot(p) == before)
        except (ExecutionError, PlanError) as exc:
            seen[name] = (type(exc).__name__, str(exc), time.monotonic() - start, _snapshot(p) == before)

    p = toy.build(0)
    depth = 2 if rank == 1 else 1
    # A different selection is a different plan (a different depth is not: it is the policy's knob).
    selection = {"dit", "text_encoder"} if rank == 1 else {"dit"}
    attempt(
        "plan",
        p,
        lambda: torchferry.offload(p, strategy="distributed_layerwise", device="cpu", components=selection),
    )
    policy = policies.distributed_layerwise(depth=depth)
    session = torchferry.offload(p, strategy="distributed_layerwise", device="cpu", policy=policy)
    attempt("schedule", p, lambda: p("a cat"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        session.close()
    session.close(gather=True)
    seen["usable"] = ("ok", "", 0.0, _same(p, toy.build(0)))
    q = toy.build_empty()
    path = bad if rank == 1 else good
    attempt(
        "checkpoint",
        q,
        lambda: torchferry.offload(q, strategy="distributed_layerwise", device="cpu", checkpoint=path),
    )
    return seen


def _dies(rank: int, world: int) -> tuple[str, str, float]:
    """The last rank exits in the middle of a step; the others report how their step failed."""
    p = toy.build(0)
    session = torchferry.offload(p, strategy="distributed_layerwise", device="cpu")
    if rank == world - 1:
        p.transformer.blocks[3].register_forward_pre_hook(lambda m, a: os._exit(7))
    start = time.monotonic()
    try:
        p("a cat")
    except ExecutionError as exc:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)
            session.close()  # no collective: must not hang on the dead peer
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _out_of_step(rank: int, world: int) -> dict[str, list[tuple[str, Any]]]:
    """Ranks fall out of step: one retries after its own error mid-step, then they run different step
    counts."""
    ref = toy.build(0)
    seen: dict[str, list[tuple[str, Any]]] = {}

    def calls(p: torch.nn.Module, plan: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        ended: list[tuple[str, Any]] = []
        for call in plan:
            try:
                ended.append(("ok", torch.equal(p("a cat", **call), ref("a cat", **call))))
            except Exception as exc:
                ended.append((type(exc).__name__, str(exc)))
        return ended

    p = toy.build(0)
    session = torchferry.offload(p, strategy="distributed_layerwise", device="cpu")
    armed = [rank == 1]

    def fail_once(module: torch.nn.Module, args: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise ValueError("a rank's own error in block 3")

    p.transformer.blocks[3].register_forward_pre_hook(fail_once)
    seen["retry"] = calls(p, [{}, {}])
    seen["steps"] = calls(p, [{"steps": 3 if rank == 0 else 2}, {"steps": 2}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        session.close()
    return seen


def _gather_on_close(rank: int, world: int) -> dict[str, Any]:
    """The with form with gather_on_close=True: full weights back on leaving; a block that raises
    leaves the shards (and warns), and close(gather=True) still gathers them."""
    p, ref = toy.build(0), toy.build(0)
    expected = ref("a cat", steps=2)
    seen: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torchferry.offload(p, strategy="distributed_layerwise", device="cpu", gather_on_close=True) as s:
            seen["output"] = torch.equal(p("a cat", steps=2), expected)
    seen["warned"] = [str(w.message) for w in caught if issubclass(w.category, OffloadWarning)]
    seen["restored"] = s.closed and _same(p, ref)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torchferry.offload(
                p, strategy="distributed_layerwise", device="cpu", gather_on_close=True
            ) as s:
                p("a cat", steps=2)
                raise ValueError("a failure inside the block")
    except ValueError:
        pass
    seen["raised_warned"] = len([w for w in caught if issubclass(w.category, OffloadWarning)])
    seen["raised_empty"] = any(t.shape == (0,) for t in p.transformer.blocks[0].parameters())
    s.close(gather=True)
    seen["raised_restored"] = _same(p, ref)
    return seen


# -------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy (seed 0) saved once for the module's spawned runs."""
    path = tmp_path_factory.mktemp("dist") / "toy.safetensors"
    toy.save_checkpoint(toy.build(0), path)
    return path


@pytest.mark.parametrize("world", [2, 3])
def test_every_mode_is_bit_identical_to_the_resident_run(world: int, checkpoint: Path) -> None:
    """Sharded and rank-local streaming on N ranks reproduce the plain run; shards are 1/N, padded."""
    results = run_ranks(_equivalence, world, str(checkpoint), timeout=90, start_method="spawn")
    rope = 16 * 4  # transformer.freqs: a non-persistent buffer, computed by the module, never read
    transposed = 32 * 32 * 4  # each block's out.weight, read whole where a shard boundary cuts it
    for rank, seen in enumerate(results):
        for name, row in seen.items():
            where = f"rank {rank}, {name}"
            assert row["outputs"] == [True, True], where
            assert row["restored"], where
            gathers = name.startswith(("allgather", "checkpoint-allgather"))
            assert (row["gathers"] > 0) == gathers, where
            assert bool(row["shards"]) == gathers, where
            for held, nbytes in row["shards"].values():
                assert held == shard_nbytes(nbytes, world) == math.ceil(math.ceil(nbytes / world) / 16) * 16
            assert row["host"] == row["full_host"] - sum(n - h for h, n in row["shards"].values()), where
            if gathers:
                names = list(row["shards"])
                shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                assert row["empty"], where
                assert row["warned"] == [
                    f"torchferry: this rank holds only its 1/{world} shard of {len(names)} all-gathered "
                    f"block(s) ({shown}), so their tensors are left empty (shape (0,)); call "
                    "close(gather=True) on every rank (a collective) to get full weights back"
                ], where
        assert seen["allgather-chunked-experts"]["chunks"] > 1
        sharded = seen["checkpoint-allgather-chunked"]
        # bytes no tensor covers (alignment padding, the zero tail of the last shard) are never read
        extra = sharded["read"] - (sharded["host"] - rope - sharded["uncovered"])
        assert 0 <= extra <= len(sharded["shards"]) * transposed  # this rank's shard bytes, not the block's
        local = seen["checkpoint-rank-local-resident"]
        assert local["read"] == local["host"] - rope - local["uncovered"]


def test_disagreeing_ranks_fail_together_and_fast(checkpoint: Path, tmp_path: Path) -> None:
    """A different plan, a different schedule or one bad checkpoint raise on every rank within 30 s."""
    bad = tmp_path / "bad.safetensors"
    raw = checkpoint.read_bytes()
    bad.write_bytes(raw[:-4])
    results = run_ranks(_disagree, 2, str(checkpoint), str(bad), timeout=90, group_timeout=30)
    digest = r"[0-9a-f]{12}"
    for rank, seen in enumerate(results):
        kind, message, seconds, untouched = seen["plan"]
        assert kind == "ExecutionError" and untouched and seconds < 30
        assert message == (  # the first collective names what each rank asked for
            "the ranks of the 2-rank weight-shard group disagree on what they ask for: rank 0 asked for "
            "strategy='distributed_layerwise', dit_transfer='allgather', encoder_transfer='rank-local', "
            "components=['dit']; rank 1 asked for strategy='distributed_layerwise', "
            "dit_transfer='allgather', encoder_transfer='rank-local', components=['dit', 'text_encoder']; "
            f"this is rank {rank}, and "
            "nothing was changed on it. Every rank must open torchferry.offload(...) on the same pipeline "
            "with the same options, so that all issue the same collectives"
        ), message
        kind, message, seconds, _ = seen["schedule"]
        assert kind == "ExecutionError" and seconds < 30
        assert re.fullmatch(
            rf"the ranks of the 2-rank weight-shard group disagree on the schedule of step transformer#0 "
            rf"\(this is rank {rank}; digests rank 0: {digest}; rank 1: {digest}\); .*",
            message,
        ), message
        assert seen["usable"][3]
        kind, message, seconds, untouched = seen["checkpoint"]
        assert untouched and seconds < 30
        if rank == 1:
            assert kind == "PlanError" and message.startswith(f"checkpoint {bad} cannot fill"), message
        else:
            assert kind == "ExecutionError"
            assert message == (
                "rank(s) 1 of the 2-rank weight-shard group could not open the session (see the error on "
                "those ranks); nothing was changed on rank 0"
            )


def test_a_rank_that_dies_mid_step_fails_the_others_within_the_timeout() -> None:
    """When one rank exits during a step the others raise a clear ExecutionError instead of hanging."""
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_ranks(_dies, 3, timeout=60, group_timeout=10)
    assert time.monotonic() - start < 40
    error = caught.value
    assert [(f.rank, f.kind, f.message) for f in error.failures] == [
        (2, "exited", "exit code 7, without a result")
    ]
    for rank in (0, 1):
        kind, message, seconds = error.results[rank]
        assert kind == "ExecutionError" and seconds < 15
        assert re.fullmatch(
            rf"all-gather of transformer\.blocks\.\d+ failed on rank {rank} of 3 \(gloo\): \w+: .*; a peer "
            r"rank died, stalled past the process group's timeout \(the group's timeout is 10 s\), or issued "
            r"a different collective\. Host weights are intact and this step was aborted; the process group "
            r"is likely unusable now, so close\(\) the session \(that needs no collective\) and restart the "
            r"ranks",
            message,
        ), message


def test_ranks_out_of_step_raise_on_every_rank_instead_of_aborting() -> None:
    """A rank retrying after its own error mid-step, or running more steps, raises; it never aborts."""
    results = run_ranks(_out_of_step, 2, timeout=120, group_timeout=10)
    zero, one = results
    assert one["retry"][0] == ("ValueError", "a rank's own error in block 3")
    ended = [*zero["retry"], *one["retry"][1:], *zero["steps"], *one["steps"]]
    assert {kind for kind, _ in ended} <= {"ok", "ExecutionError"}
    assert all(what is True for kind, what in ended if kind == "ok")  # never a wrong output
    assert "ExecutionError" in {kind for kind, _ in zero["retry"] + one["retry"]}
    assert "ExecutionError" in {kind for kind, _ in zero["steps"] + one["steps"]}
    messages = [m for kind, m in ended if kind == "ExecutionError"]
    assert all(
        re.fullmatch(
            r"(the ranks of the 2-rank weight-shard group disagree on the schedule of step \w+#\d+ "
            r"\(this is rank \d; .*|the check that every rank agrees on the schedule of step \w+#\d+ "
            r"failed on rank \d of 2 \(gloo\): .*)",
            m,
            flags=re.DOTALL,
        )
        for m in messages
    ), messages


def test_gather_on_close_gives_full_weights_back_from_the_with_form() -> None:
    """offload(..., gather_on_close=True) makes leaving the with block a close(gather=True) on every
    rank: no warning, every weight back; a block that raises closes without the collective."""
    for rank, seen in enumerate(run_ranks(_gather_on_close, 2, timeout=90)):
        assert seen["output"] and seen["restored"], rank
        assert seen["warned"] == [], rank
        assert seen["raised_warned"] == 1 and seen["raised_empty"], rank
        assert seen["raised_restored"], rank


def _wrong_layout(rank: int, world: int) -> tuple[str, bool]:
    """offload under a layout naming one rank more than the group; the refusal, and weights untouched."""
    from torchferry.topology import ParallelLayout

    p = toy.build(0)
    before = _snapshot(p)
    try:
        layout = ParallelLayout(data_parallel_size=world + 1)
        torchferry.offload(p, strategy="distributed_layerwise", device="cpu", parallel=layout)
    except PlanError as exc:
        return str(exc), _snapshot(p) == before
    return "", False


def test_a_layout_of_another_size_than_the_group_is_refused_at_resolve() -> None:
    """A weight-shard group the process group does not match is refused on every rank before any move."""
    for message, untouched in run_ranks(_wrong_layout, 2, timeout=60):
        assert message == (
            "the parallel layout gives a weight-shard group of 3 ranks but the process group has 2; pass the "
            "group whose ranks share one copy of the weights, or fix the layout"
        )
        assert untouched
