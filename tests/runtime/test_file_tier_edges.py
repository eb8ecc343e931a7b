"""The file tier's edges: a block read and loaded again while a slot holds it, a failed read inside a
stage, the same pack read twice into one staging slot, and components kept from the module refused a
file tier before anything changes."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from module_checks import hook_count
from test_file_tier import _inputs, _layout, _plan, file_ring

import torchferry
from torchferry import ExecutionError, PlanError, runtime
from torchferry.policies import Op, Schedule, Slot, Step
from torchferry.runtime.store._file_tier import TierLayout
from torchferry.testing import toy


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0), path)
    return path


def _same_values(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every parameter and buffer of ``a`` equals ``b``'s (file views come back row-major)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------- a ready block read and loaded again
def _staging_layout(plan: Any) -> TierLayout:
    """Every DiT block in the file tier, with a third staging slot ``t2`` for the extra read."""
    size = max(b.nbytes for b in plan.component("transformer").blocks)
    return attrs.evolve(_layout(plan), staging=(("t0", size), ("t1", size), ("t2", size)))


def _again(schedule: Schedule, block: str, slot: str) -> Schedule:
    """``schedule`` with ``block`` read into ``t2`` and loaded again from there into ``slot`` right
    after its forward (before its evict), and slots ``s2`` and ``t2`` in its table."""
    ops = list(schedule.ops)
    evict = next(i for i, op in enumerate(ops) if op.kind == "evict" and op.unit == block)
    size = schedule.slots[0].nbytes
    after = {"when": "after", "anchor": block, "unit": block, "nbytes": size}
    ops[evict:evict] = [
        Op(stream="io", kind="read", slot="t2", **after),  # type: ignore[arg-type]
        Op(stream="copy", kind="load", slot=slot, src="t2", **after),  # type: ignore[arg-type]
    ]
    staging = Slot(name="t2", nbytes=size, kind="staging")  # type: ignore[arg-type]
    return attrs.evolve(schedule, ops=ops, slots=[*schedule.slots, Slot(name="s2", nbytes=size), staging])


@torch.no_grad()
def test_a_ready_file_block_loaded_again_into_its_slot_waits_for_its_reads(saved: Path) -> None:
    """A file-tier block loaded again from a staging slot into its own slot after its forward is
    ordered after that forward's reads (before, the stream sanitizer saw the copy overwrite them),
    and the output equals the plain model's."""
    p, ref = toy.build_empty(), toy.build(0)
    plan = _plan(p, saved)
    engine = runtime.Engine(p, plan, device="cpu", tier=_staging_layout(plan))
    try:
        schedule = _again(file_ring(plan), "transformer.blocks.2", "s0")
        for _ in range(2):
            with runtime.execute(schedule, p, plan, device="cpu", engine=engine):
                out = p.transformer(*_inputs())
            assert torch.equal(out, ref.transformer(*_inputs()))
    finally:
        engine.close()
    assert _same_values(p, ref)


@torch.no_grad()
def test_a_ready_file_block_loaded_again_into_another_slot_frees_the_one_it_left(saved: Path) -> None:
    """A file-tier block loaded again into another slot leaves the first one free: the next block the
    ring loads there finds it free (before, the block stayed its occupant and that load raised)."""
    p, ref = toy.build_empty(), toy.build(0)
    plan = _plan(p, saved)
    engine = runtime.Engine(p, plan, device="cpu", tier=_staging_layout(plan))
    try:
        schedule = _again(file_ring(plan), "transformer.blocks.2", "s2")
        with runtime.execute(schedule, p, plan, device="cpu", engine=engine):
            out = p.transformer(*_inputs())
            assert engine.occupants == {}
        assert torch.equal(out, ref.transformer(*_inputs()))
    finally:
        engine.close()


# --------------------------------------------------------------------- a failed read in a stage
def _stage_whole(plan: Any) -> Schedule:
    """The whole transformer staged for its forward, its blocks through staging slot ``t0``."""
    top = plan.component("transformer")
    size = max(b.nbytes for b in top.blocks)

    def op(stream: str, kind: str, **kw: Any) -> Op:
        return Op(when="before", anchor="transformer", stream=stream, kind=kind, unit="transformer", **kw)  # type: ignore[arg-type]

    return Schedule(
        policy="stage from the file tier(hand-written)",
        plan=plan.digest,
        step=Step(component="transformer"),
        slots=[Slot(name="t0", nbytes=size, kind="staging")],  # type: ignore[arg-type]
        entry=(),
        ops=[
            op("io", "read", slot="t0", nbytes=size),
            op("copy", "stage", src="t0", nbytes=top.nbytes),
            Op(when="after", anchor="transformer", stream="copy", kind="unstage", unit="transformer"),
        ],
        exit=(),
    )


@torch.no_grad()
def test_a_failed_read_in_a_stage_leaves_no_device_bytes_counted(saved: Path) -> None:
    """A stage whose read fails (the checkpoint truncated under it) raises, and the ledger's device
    bytes are back to what they were, the remainder staged before the read included (before, the
    bytes of every pack staged or allocated so far stayed counted for the rest of the session)."""
    p, ref = toy.build_empty(), toy.build(0)
    plan = _plan(p, saved)
    size = max(b.nbytes for b in plan.component("transformer").blocks)
    layout = attrs.evolve(_layout(plan), staging=(("t0", size),))
    engine = runtime.Engine(p, plan, device="cpu", tier=layout)
    schedule = _stage_whole(plan)
    try:
        with runtime.execute(schedule, p, plan, device="cpu", engine=engine):
            out = p.transformer(*_inputs())
        assert torch.equal(out, ref.transformer(*_inputs()))
        held, peak = engine.ledger.held, engine.ledger.peak
        assert peak > held  # the stage was counted, and its unstage given back
        os.truncate(saved, os.path.getsize(saved) - 8)
        with (
            pytest.raises(ExecutionError, match=re.escape(f"of {saved} (tensor transformer.blocks.")),
            runtime.execute(schedule, p, plan, device="cpu", engine=engine),
        ):
            p.transformer(*_inputs())
        assert engine.ledger.held == held
        assert engine.staged == {} and engine.placed == {} and not engine.running
    finally:
        engine.close()
    assert engine.ledger.held == 0


# ---------------------------------------------------------------- one pack read twice into a slot
def _engine(p: toy.ToyPipeline, saved: Path) -> runtime.Engine:
    plan = _plan(p, saved)
    return runtime.Engine(p, plan, device="cpu", tier=_layout(plan))


@torch.no_grad()
def test_the_same_pack_read_again_into_its_slot_waits_for_the_first_read(saved: Path) -> None:
    """A pack read again into the staging slot whose first read of it no load took starts only once
    that first read is done, so two reads never write one slot at once; the bytes are the file's."""
    p = toy.build_empty()
    engine = _engine(p, saved)
    try:
        tier = engine.store.tier
        assert tier is not None
        pack = engine.store.packs["transformer.blocks.3"]
        go = threading.Event()
        threading.Timer(0.3, go.set).start()
        tier.issue(pack, "t0", go.wait)  # the first read waits (as for a slow drain) before writing
        first = tier.slot("t0").ticket
        assert first is not None and not first.done
        tier.issue(pack, "t0", None)
        assert first.done  # the second read was submitted after the first one finished
        _, twice = tier.take(pack, "t0")
        tier.issue(pack, "t1", None)
        _, once = tier.take(pack, "t1")
        assert torch.equal(twice, once)
    finally:
        engine.close()


@torch.no_grad()
def test_the_same_pack_read_again_into_its_slot_raises_the_first_reads_error(saved: Path) -> None:
    """The first read of a pack failed and no load took it: reading the pack again into that slot
    raises the first read's ExecutionError (before, the second read replaced it and the error was
    lost), and the slot is free for the next read."""
    p = toy.build_empty()
    engine = _engine(p, saved)
    try:
        tier = engine.store.tier
        assert tier is not None
        pack = engine.store.packs["transformer.blocks.3"]

        def drain_failed() -> None:
            raise RuntimeError("the copy that drains the slot failed")

        tier.issue(pack, "t0", drain_failed)
        with pytest.raises(ExecutionError, match="the copy that drains the slot failed"):
            tier.issue(pack, "t0", None)
        assert tier.slot("t0").ticket is None
        tier.issue(pack, "t0", None)
        tier.take(pack, "t0")
    finally:
        engine.close()


# ------------------------------------------------------- components kept from the module, refused
def _snapshot(p: torch.nn.Module) -> dict[str, tuple[int, str, tuple[int, ...]]]:
    """Every tensor's identity, storage address and shape, to prove nothing was touched."""
    named = [*p.named_parameters(remove_duplicate=False), *p.named_buffers(remove_duplicate=False)]
    return {n: (id(t), f"{t.device}:{0 if t.is_meta else t.data_ptr()}", tuple(t.shape)) for n, t in named}


def test_a_component_left_out_of_checkpoint_components_takes_no_file_tier(tmp_path: Path) -> None:
    """host_memory= that sends packs of a component kept from the module (left out of
    checkpoint_components=) to the file tier is a PlanError naming that component, its packs and
    the remedies, raised before anything of the pipeline changed."""
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=512), path)
    p = toy.build_empty(hidden=512)
    p.transformer = toy.build(1, hidden=512).transformer  # its own weights, not the checkpoint's
    before = _snapshot(p)
    values = {k: v.clone() for k, v in p.transformer.state_dict().items()}
    with pytest.raises(PlanError) as refused:
        torchferry.offload(
            p, strategy="layerwise", device="cpu", checkpoint=str(path),
            checkpoint_components=["text_encoder", "vae"], host_memory=60 << 20,
        )  # fmt: skip
    message = str(refused.value)
    assert re.fullmatch(
        r"host budget 60\.0 MiB \(given as host_memory=\) is too small for plan [0-9a-f]{8}: with every pack "
        r"in host memory its host buffers need [\d.]+ MiB \([\d.]+ MiB of packs in host memory\), and \d+ "
        r"pack\(s\) cannot be in the file tier, so they stay in host memory \('transformer' keeps its own "
        r"weights \(passed by keyword, or left out of checkpoint_components=\), which are not the "
        r"checkpoint's\); raise host_memory= to [\d.]+ MiB, or fill 'transformer' from the checkpoint \(name "
        r"it in checkpoint_components=, or do not pass it by keyword\)",
        message,
    ), message
    assert _snapshot(p) == before
    assert all(torch.equal(v, p.transformer.state_dict()[k]) for k, v in values.items())
    assert hook_count(p) == 0 and torchferry.session_of(p) is None
    # The same component filled from the checkpoint opens with the same budget.
    with torchferry.offload(
        p, strategy="layerwise", device="cpu", checkpoint=str(path), host_memory=60 << 20
    ) as session:
        assert session.report().file_packs > 0
        assert torch.equal(p("a cat"), toy.build(0, hidden=512)("a cat"))


def _wan() -> Any:
    """A Wan pipeline whose transformer blocks hold 4.2 MiB each (about 35 MiB in all)."""
    return toy.wan_pipeline(layers=8, heads=4, head_dim=64, ffn_dim=1024)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_a_component_given_to_from_pretrained_by_keyword_takes_no_file_tier(tmp_path: Path) -> None:
    """from_pretrained(Pipe, folder, transformer=mine) with a host_memory= that would read the
    transformer's blocks from the folder is a PlanError naming it, and ``mine`` is left as it was."""
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    folder = tmp_path / "wan"
    _wan().save_pretrained(str(folder))
    mine = _wan().transformer
    before = _snapshot(mine)
    values = {k: v.clone() for k, v in mine.state_dict().items()}
    own = re.escape("('transformer' keeps its own weights (passed by")
    with pytest.raises(PlanError, match=own) as refused:
        torchferry.from_pretrained(
            diffusers.WanPipeline, folder, transformer=mine, strategy="layerwise", device="cpu",
            host_memory=28 << 20,
        )  # fmt: skip
    assert "'transformer' keeps its own weights (passed by keyword" in str(refused.value)
    assert _snapshot(mine) == before
    assert all(torch.equal(v, mine.state_dict()[k]) for k, v in values.items())
    assert hook_count(mine) == 0
