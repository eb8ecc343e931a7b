"""An on-demand encoder with block stacks (MiniMax-H3's shape), served as the seed offloader serves it.

Its ``vision.blocks`` and ``text_model.layers`` stream through the session's ring; its non-block
state follows its own ``load_to_device()`` / ``offload_to_cpu()``, whoever calls them (the pipeline
around its encode, or the session's acquire and release). `h3_pipeline` gives every tensor new
memory on each lifecycle call, as a move between devices does, so a streamed block caught by one
shows here on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h3_pipeline as h3
import pytest
import torch
from module_checks import hook_count, same_weights

import torchferry
from torchferry import ExecutionError
from torchferry.testing import run_ranks, toy

CASES: dict[str, dict[str, Any]] = {
    "layerwise": {"strategy": "layerwise"},
    "layerwise-depth-2": {"strategy": "layerwise", "prefetch_depth": 2},
    "distributed-rank-local": {"strategy": "distributed_layerwise", "dit_transfer": "rank-local"},
}


def _pointers(modules: Any) -> list[int]:
    return [t.data_ptr() for m in modules for t in m.parameters()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_on_demand_encoder_streams_its_blocks_bit_exact(case: str) -> None:
    """Both stacks stream in the ring, the pipeline's own lifecycle calls move only the rest, and two
    calls equal the plain run; close gives every weight back as it was."""
    p, ref = h3.build(0), h3.build(0)
    expected = ref("a cat")
    encoder = p.text_encoder
    blocks = [*encoder.vision.blocks, *encoder.text_model.layers]
    with torchferry.offload(p, device="cpu", **CASES[case]) as session:
        plan = session.plan.component("text_encoder")
        assert plan.on_demand and [len(s.blocks) for s in plan.stacks] == [3, 4]
        held = _pointers(blocks)
        rest = encoder.vision.patch.weight.data_ptr()
        encoder.load_to_device("cpu")  # what the pipeline does before its encode
        assert _pointers(blocks) == held  # the session's blocks stay where it keeps them
        assert encoder.vision.patch.weight.data_ptr() != rest  # the rest moved with the lifecycle
        encoder.offload_to_cpu()
        assert torch.equal(p("a cat"), expected)
        assert torch.equal(p("a cat"), expected)
        steps = [s for step, s in session.schedules.items() if step.component == "text_encoder"]
        loaded = {op.unit for s in steps for op in s.ops if op.kind == "load"}
        assert {"text_encoder.vision.blocks.0", "text_encoder.text_model.layers.3"} <= loaded
        assert {op.kind for s in steps for op in s.ops} >= {"acquire", "release", "wait", "evict"}
        # The lifecycle brings the non-block state alone; the blocks take ring slots.
        acquired = {op.nbytes for s in steps for op in s.ops if op.kind == "acquire"}
        assert acquired == {plan.nbytes - sum(b.nbytes for b in plan.blocks)}
    # The pipeline's calls around each encode, and the session's acquire and release inside them.
    assert encoder.moves[2:8] == ["load", "load", "offload", "offload", "load", "load"]
    assert same_weights(p, ref)
    assert hook_count(p) == 0


def test_a_move_of_a_streamed_block_outside_the_lifecycle_is_refused() -> None:
    """Only the encoder's own lifecycle leaves its streamed blocks alone; a move of one block is refused."""
    p = h3.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu"):
        with pytest.raises(ExecutionError, match=r"\.to\(\)/\.half\(\)"):
            p.text_encoder.vision.blocks[0].to(torch.float64)
        assert p.text_encoder.vision.blocks[0].fc1.weight.dtype == torch.float32


def test_an_on_demand_encoder_fills_from_a_checkpoint(tmp_path: Path) -> None:
    """Built under meta_parameters and opened from a checkpoint: blocks read into their packs, the rest
    into the module, the output equal to the plain run's."""
    ref = h3.build(0)
    path = tmp_path / "h3.safetensors"
    toy.save_checkpoint(ref, path)
    with torchferry.meta_parameters():
        p = h3.H3Pipeline()
    p.eval()
    with torchferry.offload(p, strategy="layerwise", device="cpu", checkpoint=path):
        assert torch.equal(p("a cat"), ref("a cat"))
    assert same_weights(p, ref)


def _ranks(rank: int, world: int) -> list[bool]:
    """On each rank: the encoder's blocks all-gathered (replication declared), two calls exact."""
    ref = h3.build(0)
    expected = ref("a cat")
    p = h3.build(0)
    options = {"encoder_transfer": "allgather", "components": {"dit", "text_encoder"}}
    with torchferry.offload(p, strategy="distributed_layerwise", device="cpu", **options) as session:
        sharded = {g.name for g in session.engine.store.sharded}
        got = [torch.equal(p("a cat"), expected) for _ in range(2)]
    session.close(gather=True)
    return [*got, "text_encoder.vision.blocks.0" in sharded, same_weights(p, ref)]


@pytest.mark.dist
def test_an_on_demand_encoder_all_gathers_its_blocks_on_two_ranks() -> None:
    """Under distributed_layerwise with the encoder's weights declared replicated, each rank keeps a
    shard of every encoder block and the ranks all-gather it, bit-exact on both."""
    assert run_ranks(_ranks, 2, timeout=120) == [[True, True, True, True]] * 2


def test_meta_parameters_from_many_threads_leaves_no_patch_behind() -> None:
    """Threads building under `meta_parameters()` at once each get meta parameters, and afterwards a
    module built outside it has real ones (a patch read outside the lock used to leak for good)."""
    import threading

    from torch import nn

    from torchferry.runtime import meta_parameters

    original = nn.Module.register_parameter
    start = threading.Barrier(4)
    built: list[bool] = []

    def build() -> None:
        start.wait()
        for _ in range(50):
            with meta_parameters():
                built.append(nn.Linear(4, 4).weight.is_meta)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [True] * 200
    assert nn.Module.register_parameter is original
    assert not nn.Linear(4, 4).weight.is_meta
