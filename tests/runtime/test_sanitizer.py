"""The stream sanitizer: it proves real schedules ordered, and catches the races a CPU run cannot see.

The runtime tests run under it (see ``conftest.py``); these tests show what it catches: a block read
whose wait went missing, and a stale prefetch all-gathered on the comm stream, evicted unwaited,
whose slot a copy then rewrites (issue 10, defect 5) when the evict's old behaviour is restored.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchferry
from torchferry import policies, topology
from torchferry.policies import Op, Schedule, Slot, Step, rest_unit
from torchferry.runtime import Comm, Engine, execute
from torchferry.runtime.executor import _handlers
from torchferry.runtime.memory._pack import PackState, Unit
from torchferry.testing import StreamOrderError, StreamSanitizer, run_ranks, sanitize, toy
from torchferry.testing._multiproc import SANITIZE_ENV
from torchferry.testing._sanitizer import op_line


def _unwaited(engine: Engine, unit: Unit, op: Op) -> None:
    """A broken wait: the block's tensors take its slot, but compute is never ordered after its load."""
    for pack in unit.packs:
        pack.arrive()
        pack.where = PackState.READY


def _old_evict(engine: Engine, unit: Unit, op: Op) -> None:
    """The evict before the fix of defect 5: it records ``free`` without waiting an unwaited unit."""
    transfer = engine.transfers.pop(unit.name, None)
    if transfer is not None:
        engine.streams.release(transfer)
    where = engine.placed.get(unit.name)
    if where is not None and engine.occupants.get(where) is unit:
        del engine.occupants[where]
    for pack in unit.packs:
        pack.to_host()
    engine.placed.pop(unit.name, None)


def test_a_session_runs_on_the_sanitizer_and_its_outputs_stay_bit_identical() -> None:
    """Under `sanitize` a layerwise session's engine is a `StreamSanitizer` that checks every access."""
    expected = toy.build(0)("a cat", steps=2)
    p = toy.build(0)
    with sanitize(), torchferry.offload(p, strategy="layerwise", device="cpu", prefetch_depth=2) as session:
        out = p("a cat", steps=2)
        streams = session.engine.streams
        assert isinstance(streams, StreamSanitizer)
        # Every block load (a write) and every block forward (a read) was checked, two steps of 8.
        assert streams.checked >= 2 * 2 * 8
    assert torch.equal(out, expected)


def test_a_block_read_not_ordered_after_its_load_is_reported_at_the_op() -> None:
    """With the wait's stream ordering gone, the first streamed block's forward raises naming its load."""
    p = toy.build(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(_handlers._HANDLERS, "wait", _unwaited)
        with sanitize(), torchferry.offload(p, strategy="layerwise", device="cpu") as session:
            with pytest.raises(StreamOrderError) as caught:
                p("a cat", steps=1)
            (schedule,) = session.schedules.values()
    block = "text_encoder.blocks.0"
    load = next(i for i, op in enumerate(schedule.ops) if op.kind == "load" and op.unit == block)
    pc = 1 + next(i for i, op in enumerate(schedule.ops) if op.kind == "wait" and op.unit == block)
    assert str(caught.value) == (
        f"stream sanitizer: the forward of {block} (before op "
        f"{pc} ({op_line(schedule.ops[pc])})) on the compute stream reads bytes that op "
        f"{load} ({op_line(schedule.ops[load])}) writes on the copy stream, and is not "
        "ordered after that write (read after write); a missing event wait\n"
        + policies.format_marked(schedule, [pc])
    )


def _early_load(engine: Engine, unit: Unit, op: Op) -> None:
    """The load before tensors waited for their copy: they take the slot as soon as it is issued."""
    _handlers.Mover._load(engine, unit, op)
    for pack in unit.packs:
        pack.arrive()


def test_tensors_pointing_at_a_copy_in_flight_are_reported() -> None:
    """With tensors re-pointed at their slot when the load is issued (the old load), the sanitizer
    fails at the first forward after it: a hook or a tied weight reading them would race the copy."""
    p = toy.build(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(_handlers._HANDLERS, "load", _early_load)
        with (
            sanitize(),
            torchferry.offload(p, strategy="layerwise", device="cpu"),
            pytest.raises(StreamOrderError) as caught,
        ):
            p("a cat", steps=1)
    message = str(caught.value)
    assert "the tensors of text_encoder.blocks." in message
    assert "writes on the copy stream, and compute is not ordered after that write" in message


def test_a_copy_in_flight_between_steps_leaves_its_tensors_at_host_memory() -> None:
    """A layerwise step ends with the next step's first block loading: until its wait, its tensors
    read the host copy (on a GPU, a read between calls would otherwise race the copy stream)."""
    p = toy.build(0)
    with sanitize(), torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        p("a cat", steps=2)
        engine = session.engine
        flying = [
            pack
            for name in engine.transfers
            for pack in engine.store.units[name].packs
            if pack.where is PackState.IN_FLIGHT
        ]
        assert flying, "the layerwise exit leaves a block's copy in flight"
        for pack in flying:
            host = pack.host.untyped_storage().data_ptr()
            assert all(t.untyped_storage().data_ptr() == host for t in pack.tensors)
        assert torch.equal(p("a cat", steps=2), toy.build(0)("a cat", steps=2))


# ------------------------------------------------------------------------ defect 5, two ranks
def _stale_gather(plan: topology.Plan) -> Schedule:
    """A text-encoder step that all-gathers a transformer block it never waits for (a stale prefetch),
    evicts it, and loads the encoder's blocks into the same slot on the copy stream."""
    block = plan.component("transformer").blocks[0]
    encoder = plan.component("text_encoder")
    shard = policies.shard_nbytes(block.nbytes, plan.config.dp_size)
    size = max(shard * plan.config.dp_size, *(b.nbytes for b in encoder.blocks))
    first, anchor = encoder.blocks[0].path, encoder.path
    ops = [
        Op(when="before", anchor=anchor, stream="copy", kind="stage", unit=rest_unit(anchor),
           nbytes=encoder.rest_bytes),
        Op(when="before", anchor=anchor, stream="compute", kind="wait", unit=rest_unit(anchor)),
        Op(when="before", anchor=anchor, stream="copy", kind="load", unit=block.path, slot="h0",
           src="shard", nbytes=shard),
        Op(when="before", anchor=anchor, stream="comm", kind="gather", unit=block.path, slot="s0",
           src="h0", nbytes=shard * plan.config.dp_size),
        Op(when="before", anchor=first, stream="compute", kind="evict", unit=block.path),
    ]  # fmt: skip
    for b in encoder.blocks:
        ops += [
            Op(when="before", anchor=b.path, stream="copy", kind="load", unit=b.path, slot="s0",
               nbytes=b.nbytes),
            Op(when="before", anchor=b.path, stream="compute", kind="wait", unit=b.path),
            Op(when="after", anchor=b.path, stream="compute", kind="evict", unit=b.path),
        ]  # fmt: skip
    ops.append(Op(when="after", anchor=anchor, stream="copy", kind="unstage", unit=rest_unit(anchor)))
    return Schedule(
        policy="stale-gather(hand-written)",
        plan=plan.digest,
        step=Step(component=anchor),
        slots=[Slot(name="s0", nbytes=size), Slot(name="h0", nbytes=shard, kind="shard")],
        entry=(),
        ops=ops,
        exit=(),
    )


def _defect5(rank: int, world: int, old: bool) -> tuple[str, str]:
    """Run the stale-gather step on this rank under the sanitizer (with the old evict if ``old``)."""
    p = toy.build(0)
    ids = toy.tokenize("a cat")
    with torch.no_grad():
        expected = p.text_encoder(ids)
    config = topology.OffloadConfig(
        strategy="distributed_layerwise",
        components={"dit", "text_encoder"},
        parallel=topology.ParallelLayout(data_parallel_size=world),
    )
    plan = topology.resolve(topology.discover(p), config)
    schedule = _stale_gather(plan)
    if old:
        _handlers._HANDLERS["evict"] = _old_evict
    with sanitize():
        engine = Engine(p, plan, device="cpu", comm=Comm(dist.group.WORLD, torch.device("cpu")))
    try:
        with torch.no_grad(), execute(schedule, p, plan, device="cpu", engine=engine):
            out = p.text_encoder(ids)
    except StreamOrderError as exc:
        return "race", str(exc)
    finally:
        engine.close(gather=True)
    return "ok", str(torch.equal(out, expected))


@pytest.mark.dist
def test_the_sanitizer_catches_a_stale_gather_evicted_unwaited_and_the_fix_orders_it() -> None:
    """Defect 5: with the old evict the encoder's load races the stale gather; with the fix it is ordered."""
    old = run_ranks(_defect5, 2, True, timeout=90)
    fixed = run_ranks(_defect5, 2, False, timeout=90)
    assert fixed == [("ok", "True")] * 2
    p = toy.build(0)
    plan = topology.resolve(
        topology.discover(p),
        topology.OffloadConfig(
            strategy="distributed_layerwise",
            components={"dit", "text_encoder"},
            parallel=topology.ParallelLayout(data_parallel_size=2),
        ),
    )
    schedule = _stale_gather(plan)
    line = op_line

    def op(i: int) -> str:
        return f"op {i} ({line(schedule.ops[i])})"

    message = (
        f"stream sanitizer: {op(5)} on the copy stream writes a buffer that {op(3)} wrote on the comm "
        "stream, and is not ordered after that write (write after write); a missing event wait\n"
        + policies.format_marked(schedule, [5])
    )
    assert old == [("race", message)] * 2, re.sub(r"\s+", " ", str(old))[:2000]


def test_a_stale_gather_schedule_passes_check() -> None:
    """The hand-written stale-gather step is one `check` accepts: the race is the runtime's to order."""
    p = toy.build(0)
    plan = topology.resolve(
        topology.discover(p),
        topology.OffloadConfig(
            strategy="distributed_layerwise",
            components={"dit", "text_encoder"},
            parallel=topology.ParallelLayout(data_parallel_size=2),
        ),
    )
    policies.check(_stale_gather(plan), plan)


# ---------------------------------------------------------------- the gather slot, in the schedule
def _staged_gathers(rank: int, world: int) -> dict[str, Any]:
    """Chunked gathers through the gather slot, as on NCCL (a staged backend: gloo is made to say it is
    one), for two pipeline calls on this rank: what the slot holds, and every step's measured peak."""
    expected = toy.build(0)("a cat", steps=2)
    Comm.staged = property(lambda self: True)  # type: ignore[method-assign, assignment]
    p = toy.build(0)
    with torchferry.offload(p, strategy="distributed_layerwise", device="cpu", chunk_bytes=4096) as session:
        engine = session.engine
        outs, buffers = [], []
        for _ in range(2):
            outs.append(torch.equal(p("a cat", steps=2), expected))
            buffers.append((engine.slots.slots.get("g0") or engine.slots.parked["g0"])[1])
        gather = {s for schedule in session.schedules.values() for s in schedule.slots if s.kind == "gather"}
        shards = [pack.held_bytes for pack in engine.store.sharded]
        chunks = max(op.chunks for s in session.schedules.values() for op in s.ops)
        peaks = {
            policies.step_name(step): (peak, policies.simulate(session.schedules[step]).peak_device_bytes)
            for step, peak in session.step_peaks.items()
        }
        session.close(gather=True)
    need = max(policies.gather_nbytes(n, -(-n // 4096), world) for n in shards)
    return {"gather": sorted((g.name, g.kind, g.nbytes) for g in gather), "need": need, "chunks": chunks,
            "largest": max(shards), "same": buffers[0] is buffers[1], "outs": outs, "peaks": peaks,
            "sanitized": isinstance(engine.streams, StreamSanitizer)}  # fmt: skip


@pytest.mark.dist
def test_chunked_gathers_land_in_the_schedules_gather_slot_and_peaks_are_simulated() -> None:
    """A staged backend's chunked gathers use the schedule's one gather slot (world chunks of at most
    chunk_bytes) from call to call, and every step's measured device peak equals the simulated one."""
    for row in run_ranks(_staged_gathers, 2, timeout=90, env={SANITIZE_ENV: "1"}):
        assert row["largest"] > 4096 and row["chunks"] > 1  # the toy's blocks do gather in chunks
        assert row["gather"] == [("g0", "gather", row["need"])] and row["need"] <= 2 * 4096
        assert row["same"] and row["outs"] == [True, True] and row["sanitized"]
        assert row["peaks"] and all(measured == simulated for measured, simulated in row["peaks"].values())
