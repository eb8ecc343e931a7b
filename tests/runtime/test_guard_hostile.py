"""The session guard and the engine's buffer write-back under hostile use, against the plain run.

Each test serves a toy pipeline on the CPU next to an identical plain copy and asserts bit-equal
outputs and weights (between steps, in later steps and after ``close()``), or a loud refusal where
rule 2 of [Note: the session contract] in `torchferry.runtime.guard._guard` says so. The cases reach the
units the device holds between steps (the first ring block under layerwise, resident layers, a
depth-2 ring, components staged whole under model_level and none) as well as blocks at host memory.
Tests marked ``xfail(strict=True)`` pin a wrong behaviour still there: the reason says what happens.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from toy_runs import (
    Counter,
    Failing,
    Interrupt,
    block,
    inputs,
    interrupt_once,
    layerwise_peak,
    pair,
    run,
    same_state,
)

import torchferry
from torchferry import ExecutionError, OffloadWarning, policies, topology
from torchferry.testing import run_ranks, toy

Options = dict[str, Any]

#: Session options by name: each keeps other units on the device between steps.
CONFIGS: dict[str, Options] = {
    "layerwise": {"strategy": "layerwise"},
    "resident2": {"strategy": "layerwise", "resident_layers": 2},
    "depth2": {"strategy": "layerwise", "prefetch_depth": 2},
    "model_level": {"strategy": "model_level"},
    "none": {"strategy": "none"},
}


def session(p: nn.Module, config: str) -> torchferry.Session:
    """A session of ``CONFIGS[config]`` on the CPU (model_level without an encoder warns: ignored)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        return torchferry.offload(p, device="cpu", **CONFIGS[config])


def swap(p: toy.ToyPipeline, where: str, cls: type[nn.Linear]) -> None:
    """Replace the linear layer at dotted path ``where`` of the DiT by a ``cls`` with its weights."""
    parent_path, _, name = where.rpartition(".")
    parent = p.transformer.get_submodule(parent_path) if parent_path else p.transformer
    old = getattr(parent, name)
    new = cls(old.in_features, old.out_features)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.copy_(old.bias)
    setattr(parent, name, new)


def swapping(*layers: tuple[str, type[nn.Linear]]) -> Callable[[toy.ToyPipeline], None]:
    """A change that `swap`s each (path, class) of ``layers`` in turn."""

    def change(p: toy.ToyPipeline) -> None:
        for where, cls in layers:
            swap(p, where, cls)

    return change


def _del_then_register(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """``del module.<name>``, then register ``value`` as a buffer under that name."""
    delattr(module, name)
    module.register_buffer(name, value)


def counting(where: str) -> Callable[[toy.ToyPipeline], None]:
    """A change that puts a `Counter` at ``where`` (a linear layer's path in the DiT)."""
    return lambda p: swap(p, where, Counter)


# --------------------------------------------------------------- edits between steps, each unit
def _edit(p: toy.ToyPipeline, i: int, how: str) -> None:
    b = block(p, i)
    w = b.fc1.weight
    with torch.no_grad():
        if how == "mul_":
            w.mul_(2)
        elif how == "copy_":
            w.copy_(torch.full_like(w, 0.01))
        elif how == "data":
            w.data = w.detach() * 3
        elif how == "load_state_dict":
            b.fc1.load_state_dict({"weight": w * 0.5, "bias": b.fc1.bias + 1})
        elif how == "buffer":
            b.scale.add_(1)
        elif how == "tied":
            b.norm_k.weight.mul_(1.5)  # norm_q's weight too (one object)


@pytest.mark.parametrize("how", ["mul_", "copy_", "data", "load_state_dict", "buffer", "tied"])
@pytest.mark.parametrize("i", [0, 1, 3, 7])
@pytest.mark.parametrize("config", ["layerwise", "resident2", "depth2", "model_level"])
def test_edits_between_steps_reach_every_later_step_and_close(config: str, i: int, how: str) -> None:
    """An edit keeping the object made between steps, on a block at host memory or one the device
    holds between steps, is in the next two steps and in the weights after close."""
    p, ref = pair()
    args = inputs()
    with session(p, config):
        for pipe in (p, ref):
            run(pipe, args)
            _edit(pipe, i, how)
        assert torch.equal(run(p, args), run(ref, args))
        assert torch.equal(run(p, args), run(ref, args))
        for pipe in (p, ref):
            _edit(pipe, i, how)  # after the last step: close adopts it
    assert same_state(p, ref)


_PIPELINE_EDITS: dict[str, Callable[[toy.ToyPipeline], object]] = {
    "encoder": lambda p: [t.mul_(1.5) for t in p.text_encoder.parameters()],
    "decoder": lambda p: [t.add_(0.01) for t in p.vae.parameters()],
    "dit_remainder": lambda p: p.transformer.proj_out.weight.mul_(2),
    "dit_buffer": lambda p: p.transformer.freqs.mul_(2),
    "everything": lambda p: p.load_state_dict({k: v * 1.1 for k, v in p.state_dict().items()}),
}


@pytest.mark.parametrize("edit", list(_PIPELINE_EDITS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_edits_between_pipeline_calls_reach_every_component(config: str, edit: str) -> None:
    """Edits to the encoder, decoder or DiT between whole pipeline calls are in the next call, in a
    direct transformer call, and after close."""
    p, ref = pair()
    args = inputs()
    with session(p, config):
        assert torch.equal(p("a cat", steps=2), ref("a cat", steps=2))
        for pipe in (p, ref):
            with torch.no_grad():
                _PIPELINE_EDITS[edit](pipe)
        assert torch.equal(p("a cat", steps=2), ref("a cat", steps=2))
        assert torch.equal(run(p, args), run(ref, args))
        for pipe in (p, ref):
            with torch.no_grad():
                _PIPELINE_EDITS[edit](pipe)
    assert same_state(p, ref)


# ------------------------------------------------------------------------- table changes
_TABLE_EDITS: dict[str, Callable[[Any], object]] = {
    "new_parameter": lambda b: setattr(b.fc1, "weight", nn.Parameter(b.fc1.weight.detach().clone())),
    "register_buffer": lambda b: b.register_buffer("scale", b.scale.clone()),
    "setattr_buffer": lambda b: setattr(b, "scale", b.scale.clone()),
    "del_then_register": lambda b: _del_then_register(b, "scale", torch.full((32,), 2.0)),
}


@pytest.mark.parametrize("edit", list(_TABLE_EDITS))
@pytest.mark.parametrize(("config", "i"), [("layerwise", 0), ("layerwise", 3), ("model_level", 3)])
def test_another_object_in_a_module_is_refused_at_the_next_step(config: str, i: int, edit: str) -> None:
    """Another tensor object set or registered in a managed module's slot between steps raises
    `ExecutionError` at the next step start, naming it, and close gives back the plain run's state."""
    p, ref = pair()
    args = inputs()
    with session(p, config):
        for pipe in (p, ref):
            run(pipe, args)
            with torch.no_grad():
                _TABLE_EDITS[edit](block(pipe, i))
        named = rf"\(transformer\.blocks\.{i}\.\S+ is another tensor object now"
        with pytest.raises(torchferry.ExecutionError, match=named):
            run(p, args)
    assert same_state(p, ref)
    assert torch.equal(run(p, args), run(ref, args))


@pytest.mark.parametrize(
    "edit",
    [
        lambda b: b._buffers.__setitem__("scale", b.scale.clone() * 2),
        lambda b: b.fc1._parameters.__setitem__("weight", nn.Parameter(b.fc1.weight.detach() * 2)),
        lambda b: setattr(b.fc1, "bias", None),
    ],
    ids=["buffer_table", "parameter_table", "bias_none"],
)
@pytest.mark.parametrize(("config", "i"), [("layerwise", 0), ("layerwise", 3), ("model_level", 3)])
def test_table_writes_without_a_registration_are_read_by_the_forward(
    config: str, i: int, edit: Callable[[Any], None]
) -> None:
    """A tensor (or None) written straight into a module table between steps is what the next steps
    read, as in the plain run, and what the module holds after close."""
    p, ref = pair()
    args = inputs()
    with session(p, config):
        for pipe in (p, ref):
            run(pipe, args)
            with torch.no_grad():
                edit(block(pipe, i))
        assert torch.equal(run(p, args), run(ref, args))
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


# ------------------------------------------------------------ buffers a forward writes in place
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
@pytest.mark.parametrize("where", ["blocks.0.fc1", "blocks.3.fc1", "proj_out"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_buffer_a_forward_writes_in_place_is_read_edited_and_kept(
    config: str, where: str, mode: str
) -> None:
    """A counter a forward updates in place, in a ring block, a block left on the device or a staged
    remainder, reads as the plain run's between steps, takes an edit between steps, and is kept at close."""
    p, ref = pair(counting(where))
    args = inputs()

    def counter(pipe: toy.ToyPipeline) -> torch.Tensor:
        module: Any = pipe.transformer.get_submodule(where)
        found: torch.Tensor = module.count
        return found

    with session(p, config):
        for _ in range(2):
            assert torch.equal(run(p, args, mode), run(ref, args, mode))
            assert torch.equal(counter(p), counter(ref))
        for pipe in (p, ref):
            counter(pipe).mul_(10)
        assert torch.equal(run(p, args, mode), run(ref, args, mode))
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


@pytest.mark.parametrize("config", ["layerwise", "model_level"])
def test_buffer_writes_across_modes_and_edits_outside_inference_mode(config: str) -> None:
    """A counter written under inference_mode, then no_grad and grad, can be edited in place between
    steps outside inference mode (it did not become an inference tensor) and stays exact."""
    p, ref = pair(counting("blocks.0.fc1"))
    args = inputs()
    with session(p, config):
        for mode in ("inference_mode", "no_grad", "grad"):
            assert torch.equal(run(p, args, mode), run(ref, args, mode))
            for pipe in (p, ref):
                block(pipe, 0).fc1.count.add_(1)
                block(pipe, 0).scale.mul_(2)
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


def _allocations_per_step(p: toy.ToyPipeline, config: str, steps: int = 4) -> list[int]:
    args = inputs()
    with session(p, config) as s:
        seen = []
        for _ in range(steps):
            run(p, args)
            seen.append(s.engine.ledger.allocations)
    return seen


@pytest.mark.parametrize("config", list(CONFIGS))
def test_steady_steps_allocate_nothing_without_buffer_writes(config: str) -> None:
    """Steady steps of an unchanged pipeline allocate no device memory after the first (nothing restarts)."""
    seen = _allocations_per_step(toy.build(0), config)
    assert seen == seen[:1] * len(seen)


@pytest.mark.parametrize("config", ["layerwise", "depth2", "resident2"])
def test_a_ring_block_writing_a_buffer_does_not_restart_steady_steps(config: str) -> None:
    """A block that streams through a ring slot and writes a buffer in place costs no restart."""
    seen = _allocations_per_step(pair(counting("blocks.3.fc1"))[0], config)
    assert seen == seen[:1] * len(seen)


@pytest.mark.parametrize(
    ("config", "where"),
    [
        ("model_level", "blocks.3.fc1"),
        ("none", "blocks.0.fc1"),
        ("layerwise", "proj_out"),
        ("resident2", "blocks.0.fc1"),
    ],
)
def test_a_forward_writing_a_buffer_of_a_unit_kept_on_the_device_does_not_restart(
    config: str, where: str
) -> None:
    """Steady steps whose forward writes a buffer of a unit kept on the device allocate nothing."""
    seen = _allocations_per_step(pair(counting(where))[0], config)
    assert seen == seen[:1] * len(seen)


# ---------------------------------------------------------------------- failures mid-step
def _fail_mid_step(config: str, counter: str, failing: str, error: BaseException, mode: str) -> None:
    p, ref = pair(swapping((counter, Counter), (failing, Failing)))
    args = inputs()

    def at(pipe: toy.ToyPipeline, path: str) -> Any:
        return pipe.transformer.get_submodule(path)

    with session(p, config):
        for pipe in (p, ref):
            run(pipe, args, mode)
            at(pipe, failing).fail = error
            with pytest.raises(type(error)):
                run(pipe, args, mode)
            at(pipe, failing).fail = None
        assert torch.equal(at(p, counter).count, at(ref, counter).count)
        assert torch.equal(run(p, args, mode), run(ref, args, mode))
    assert same_state(p, ref)


@pytest.mark.parametrize("failure", ["Exception", "BaseException"])
@pytest.mark.parametrize("mode", ["no_grad", "grad"])
@pytest.mark.parametrize(
    ("config", "counter", "failing"),
    [
        ("layerwise", "blocks.3.fc1", "blocks.3.fc2"),
        ("resident2", "blocks.0.fc1", "blocks.5.fc2"),
        ("model_level", "blocks.3.fc1", "blocks.5.fc2"),
        ("none", "blocks.0.fc1", "blocks.5.fc2"),
    ],
)
def test_a_failure_mid_step_keeps_buffer_writes_on_the_device(
    config: str, counter: str, failing: str, mode: str, failure: str
) -> None:
    """An Exception or a BaseException (KeyboardInterrupt-like) after a forward wrote a buffer in
    place on the device keeps the write (before the abort, or at the next step's restart), as the
    plain run does."""
    error = RuntimeError("boom") if failure == "Exception" else Interrupt()
    _fail_mid_step(config, counter, failing, error, mode)


@pytest.mark.parametrize("mode", ["no_grad", "grad"])
@pytest.mark.parametrize("config", ["layerwise", "depth2"])
def test_an_exception_after_the_writing_block_left_keeps_its_buffer_write(config: str, mode: str) -> None:
    """An Exception in a later block, after the ring block that wrote a buffer left, keeps the write."""
    _fail_mid_step(config, "blocks.3.fc1", "blocks.5.fc2", RuntimeError("boom"), mode)


class Drift(nn.Linear):
    """A linear layer whose forward adds 0.5 to its own bias in place (a parameter, not a buffer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.bias.add_(0.5)
        return super().forward(x)


@pytest.mark.parametrize("config", ["model_level", "none", "resident2"])
def test_a_parameter_a_forward_writes_in_a_unit_kept_on_the_device_is_kept(config: str) -> None:
    """A forward's in-place write to a parameter of a unit the device keeps between steps is in later
    steps and after close (taken up at the next step start), as in the plain run."""
    p, ref = pair(lambda q: swap(q, "blocks.0.fc1", Drift))
    args = inputs()
    with session(p, config):
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


@pytest.mark.parametrize("config", ["model_level", "none", "resident2"])
def test_a_parameter_a_forward_writes_on_the_device_survives_an_exception(config: str) -> None:
    """A forward's in-place write to a parameter of a unit kept on the device survives a later block's
    Exception in the same step, as in the plain run."""
    p, ref = pair(swapping(("blocks.0.fc1", Drift), ("blocks.5.fc2", Failing)))
    args = inputs()
    with session(p, config):
        for pipe in (p, ref):
            run(pipe, args)
            block(pipe, 5).fc2.fail = RuntimeError("boom")
            with pytest.raises(RuntimeError, match="boom"):
                run(pipe, args)
            block(pipe, 5).fc2.fail = None
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


def test_an_edit_between_a_failed_step_and_the_next_is_adopted() -> None:
    """An edit made after a step raised mid-forward (block 0 on the device) is in the next step and close."""
    p, ref = pair(lambda q: swap(q, "blocks.5.fc2", Failing))
    args = inputs()
    with session(p, "resident2"):
        for pipe in (p, ref):
            run(pipe, args)
            block(pipe, 5).fc2.fail = RuntimeError("boom")
            with pytest.raises(RuntimeError, match="boom"):
                run(pipe, args)
            block(pipe, 5).fc2.fail = None
            with torch.no_grad():
                block(pipe, 0).fc1.weight.mul_(2)
                block(pipe, 0).scale.add_(1)
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


# ------------------------------------------------------------------- edits during a step
def test_a_buffer_a_hook_writes_in_another_block_during_a_step_is_kept() -> None:
    """A forward hook of the last block writing block 0's buffer in place (block 0 then prefetched or
    at host) is in the next steps and after close, as in the plain run."""
    p, ref = pair()
    args = inputs()
    for pipe in (p, ref):
        target = block(pipe, 0).scale

        def hook(module: nn.Module, args: Any, out: Any, target: torch.Tensor = target) -> None:
            target.add_(0.5)

        block(pipe, 7).register_forward_hook(hook)
    with session(p, "layerwise"):
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
        for pipe in (p, ref):
            block(pipe, 0).scale.mul_(2)
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


def _hooked(kind: str, target: int) -> Callable[[toy.ToyPipeline], None]:
    """A change: block 3's pre hook edits block ``target`` once, in its first forward (``kind``)."""

    def change(p: toy.ToyPipeline) -> None:
        done: list[bool] = []

        def hook(module: nn.Module, args: Any) -> None:
            if done:
                return
            done.append(True)
            w = block(p, target).fc1.weight
            with torch.no_grad():
                if kind == "mul_":
                    w.mul_(2)
                elif kind == "buffer":
                    block(p, target).scale.mul_(2)
                else:
                    w.data = w.detach() * 2

        block(p, 3).register_forward_pre_hook(hook)

    return change


@pytest.mark.parametrize("kind", ["mul_", "buffer"])
@pytest.mark.parametrize("target", [0, 6])
@pytest.mark.parametrize("config", ["layerwise", "resident2", "model_level"])
def test_an_in_place_edit_from_a_hook_during_a_step_then_one_between_steps_is_kept(
    config: str, target: int, kind: str
) -> None:
    """A hook's in-place edit of a block that already ran (0) or runs later (6) in the same step, then a
    user's edit between steps, are in every later step and after close, as in the plain run."""
    p, ref = pair(_hooked(kind, target))
    args = inputs()
    with session(p, config):
        for _ in range(2):
            assert torch.equal(run(p, args), run(ref, args))
        for pipe in (p, ref):
            with torch.no_grad():
                block(pipe, target).fc1.weight.add_(0.01)
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


@pytest.mark.docking
@pytest.mark.parametrize(
    ("config", "target"),
    [("layerwise", 6), ("model_level", 6), ("resident2", 0)],
)
def test_a_data_assignment_from_a_hook_during_a_step_is_kept(config: str, target: int) -> None:
    """``w.data = w * 2`` from a hook during a step is in every later step and after close, as in plain.

    On a CPU session every pack docks, staged ones too ([Note: docking]): no op of a step re-points
    ``w`` over the stray tensor, and close adopts it. (Re-pointed, on CUDA, a staged unit's step end
    read ``w``'s pointer as the engine's own and close put the stale host copy back.)"""
    p, ref = pair(_hooked("data", target))
    args = inputs()
    with session(p, config):
        for _ in range(3):
            assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


# ------------------------------------------------------------- references taken at host memory
_HANDLES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "view": lambda w: w.view(-1),
    "detach": lambda w: w.detach(),
    "row": lambda w: w[0],
}


@pytest.mark.parametrize("how", list(_HANDLES))
@pytest.mark.parametrize("i", [3, 0])
def test_a_view_of_a_streamed_block_edited_between_steps_is_adopted(how: str, i: int) -> None:
    """A view of a ring block's weight taken before the first step and edited in place between steps
    (its block at host memory then; block 0's copy for the next step in flight, its tensors still at
    host memory) is in the next steps and after close."""
    p, ref = pair()
    args = inputs()
    with session(p, "layerwise"):
        handles = [_HANDLES[how](block(pipe, i).fc1.weight) for pipe in (p, ref)]
        for pipe, h in zip((p, ref), handles, strict=True):
            run(pipe, args)
            with torch.no_grad():
                h.mul_(2)
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


@pytest.mark.docking
@pytest.mark.parametrize("how", list(_HANDLES))
@pytest.mark.parametrize(("config", "i"), [("resident2", 0), ("model_level", 3)])
def test_a_view_edited_while_its_block_is_on_the_device_is_adopted(config: str, i: int, how: str) -> None:
    """A view of a weight taken at host memory and edited in place while its block is on the device
    between steps is in the next steps and after close.

    On a CPU session the staged block docks: the view follows its storage onto the device copy, so the
    edit writes the copy the step runs and the next step start keeps it. (Re-pointed, on CUDA, the view
    kept aliasing the host copy and the next step start copied the stale device copy over the edit.)"""
    p, ref = pair()
    args = inputs()
    with session(p, config):
        handles = [_HANDLES[how](block(pipe, i).fc1.weight) for pipe in (p, ref)]
        for pipe, h in zip((p, ref), handles, strict=True):
            run(pipe, args)
            with torch.no_grad():
                h.mul_(2)
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


@pytest.mark.docking
@pytest.mark.parametrize(("config", "i"), [("layerwise", 3), ("model_level", 0)])
def test_a_tensor_assigned_through_data_stays_the_weights_storage(config: str, i: int) -> None:
    """After ``w.data = t`` between steps, an in-place edit of ``t`` changes the weight, as in plain.

    On a CPU session the weight's pack docks, so no step re-points it: it keeps viewing ``t`` until
    close adopts it (rule 2 of the session contract). (Re-pointed, on CUDA, the next step start copies
    ``t`` into the host copy and re-points the weight: a later edit of ``t`` is not seen.)"""
    p, ref = pair()
    args = inputs()
    with session(p, config):
        assigned = []
        for pipe in (p, ref):
            run(pipe, args)
            t = block(pipe, i).fc1.weight.detach().clone()
            block(pipe, i).fc1.weight.data = t
            assigned.append(t)
        assert torch.equal(run(p, args), run(ref, args))
        for t in assigned:
            t.mul_(2)
        assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


@pytest.mark.parametrize("i", [0, 3])
@pytest.mark.parametrize("config", ["layerwise", "resident2", "model_level"])
def test_a_tensor_assigned_after_an_interrupted_step_is_kept(config: str, i: int) -> None:
    """A step interrupted mid-forward (a BaseException, as a KeyboardInterrupt) leaves blocks docked;
    ``w.data = t`` then, and the next call starts clean (undocks, remembers what the abort left): the
    weight runs with ``t`` in every later call and the pipeline after close holds it, as in plain (an
    edit of a docked weight is never taken for the engine's own move). Re-pointed, as on CUDA (this
    test runs both ways), the next call adopts ``t``'s values, which give the same outputs."""
    p, ref = pair()
    args = inputs()
    with session(p, config):
        run(p, args)
        handle = block(p, 5).register_forward_pre_hook(interrupt_once())
        with pytest.raises(Interrupt):
            run(p, args)
        handle.remove()
        for pipe in (p, ref):
            t = block(pipe, i).fc1.weight.detach() * 2
            block(pipe, i).fc1.weight.data = t
        for _ in range(2):
            assert torch.equal(run(p, args), run(ref, args))
    assert same_state(p, ref)


def test_a_data_assignment_to_a_file_tier_weight_after_an_interrupted_step_is_refused(tmp_path: Path) -> None:
    """A file-tier weight is re-pointed on any device and its edits cannot be kept: ``w.data = t`` after
    a step was cut short is refused at the next call, as between any two calls (it was dropped
    silently: the clean start pointed the weight back at the checkpoint, or took ``t`` for its own)."""
    source = toy.build(0)
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(source, path)
    plan = topology.resolve(topology.discover(source), topology.OffloadConfig(strategy="layerwise"))
    host = int(policies.tiers(plan).host_bytes * 0.7)
    p = toy.build_empty()
    with (
        torch.no_grad(),
        torchferry.offload(
            p, strategy="layerwise", device="cpu", checkpoint=str(path), host_memory=host
        ) as s,
    ):
        p("a cat", steps=2)
        in_file = [n for n, u in s.engine.store.units.items() if u.packs[0].in_file and ".blocks." in n]
        assert in_file
        handle = block(p, 5).register_forward_pre_hook(interrupt_once())
        with pytest.raises(Interrupt):
            p("a cat", steps=2)
        handle.remove()
        target = in_file[-1]
        weight = p.get_submodule(target).fc1.weight
        weight.data = weight.detach() * 2
        with pytest.raises(ExecutionError, match=re.escape(f"{target}.fc1.weight is in the file tier")):
            p("a cat", steps=2)


# ---------------------------------------------------------------- chooser and sessions in a row
@pytest.mark.parametrize("edit", ["first_block", "ring_block_and_remainder", "counter"])
def test_edits_around_the_choosers_switch_are_exact(edit: str) -> None:
    """Under a tight budget (auto re-chooses between steps), edits between calls and a counter a
    forward writes in place stay exact across the switch and after close."""
    budget = layerwise_peak() + 3 * 60_000
    p, ref = toy.build(0, hidden=64), toy.build(0, hidden=64)
    if edit == "counter":
        for pipe in (p, ref):
            swap(pipe, "blocks.3.fc1", Counter)
    with torchferry.offload(p, device="cpu", device_memory=budget, components={"dit"}) as s:
        for _ in range(3):
            assert torch.equal(p("a cat", steps=3), ref("a cat", steps=3))
            for pipe in (p, ref):
                with torch.no_grad():
                    if edit == "first_block":
                        block(pipe, 0).fc1.weight.mul_(1.01)
                    elif edit == "ring_block_and_remainder":
                        block(pipe, 3).fc2.weight.mul_(1.01)
                        pipe.transformer.proj_out.bias.add_(0.01)
                    else:
                        block(pipe, 3).fc1.count.add_(1)
        assert s.report().switches
    assert same_state(p, ref)


@pytest.mark.parametrize("config", ["layerwise", "resident2", "model_level"])
def test_two_sessions_in_a_row_keep_buffer_writes_and_edits(config: str) -> None:
    """A counter written by forwards and edited between steps carries over from one session to the next."""
    p, ref = pair(counting("blocks.0.fc1"))
    args = inputs()
    for _ in range(2):
        with session(p, config):
            for _ in range(2):
                assert torch.equal(run(p, args), run(ref, args))
            for pipe in (p, ref):
                block(pipe, 0).fc1.count.mul_(3)
                with torch.no_grad():
                    block(pipe, 0).fc2.weight.mul_(1.5)
        assert same_state(p, ref)
    assert torch.equal(run(p, args), run(ref, args))


@pytest.mark.parametrize("config", ["layerwise", "depth2", "resident2", "model_level"])
def test_a_buffer_written_while_its_block_is_prefetched_and_then_skipped_is_kept(config: str) -> None:
    """A hook of block 2 writing block 3's buffer (prefetched then) is kept in steps that skip block 3,
    between calls and after close, as in the plain run."""
    p, ref = pair()
    for pipe in (p, ref):
        target = block(pipe, 3).scale

        def hook(module: nn.Module, args: Any, out: Any, target: torch.Tensor = target) -> None:
            target.add_(1)

        block(pipe, 2).register_forward_hook(hook)
    with session(p, config):
        for skip in ({0: [3]}, {1: [3]}, {}):
            assert torch.equal(p("a cat", steps=2, skip=skip), ref("a cat", steps=2, skip=skip))
            assert torch.equal(block(p, 3).scale, block(ref, 3).scale)
    assert same_state(p, ref)


# ------------------------------------------------------------------------------ sharded blocks
def _edit_a_sharded_block(rank: int, world: int, how: str) -> tuple[bool, str]:
    """On each rank: a call, an in-place edit of an all-gathered block's weight between calls, a call.

    Returns whether the first call matched the plain run, and what the second call did."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, strategy="distributed_layerwise", device="cpu") as s:
        first = torch.equal(p("a cat", steps=2), ref("a cat", steps=2))
        for pipe in (p, ref):
            w = block(pipe, 3).fc1.weight
            with torch.no_grad():
                w.mul_(2) if how == "mul_" else w.zero_()
        try:
            second = f"ran, equal to the plain run: {torch.equal(p('a cat', steps=2), ref('a cat', steps=2))}"
        except torchferry.ExecutionError as e:
            second = str(e)
        s.close(gather=True)
    return first, second


@pytest.mark.parametrize("how", ["mul_", "zero_"])
def test_an_in_place_edit_of_a_sharded_block_is_refused(how: str) -> None:
    """``w.mul_(2)`` or ``w.zero_()`` between calls on an all-gathered block's weight raises
    `ExecutionError` at the next call on every rank (rule 2: this rank has no full copy to take it)."""
    for first, second in run_ranks(_edit_a_sharded_block, 2, how, timeout=120):
        assert first
        assert "transformer.blocks.3.fc1.weight belongs to a block this rank holds only a shard of" in second


# ------------------------------------------------------------------- several components, hooks
@pytest.mark.parametrize("target", ["transformer", "transformer_2"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_edits_between_calls_of_a_two_expert_pipeline_are_exact(config: str, target: str) -> None:
    """In-place, ``.data`` and buffer edits between calls to either expert's first blocks (the ones
    prefetched across the expert switch) are in every later call and after close."""
    p, ref = toy.build(0, two_experts=True), toy.build(0, two_experts=True)
    with session(p, config):
        for k in range(3):
            assert torch.equal(p("a cat", steps=4), ref("a cat", steps=4))
            for pipe in (p, ref):
                b = getattr(pipe, target).blocks[k % 2]
                with torch.no_grad():
                    b.fc1.weight.mul_(1.5)
                    b.fc2.weight.data = b.fc2.weight.detach() * 0.5
                    b.scale.add_(0.25)
    assert same_state(p, ref)


def _component_hook(p: toy.ToyPipeline, where: str, target: int | str) -> None:
    """A hook on the transformer (``pre`` or ``post``) that edits ``target`` in place at every step."""

    def edit() -> None:
        with torch.no_grad():
            if target == "remainder":
                p.transformer.proj_out.weight.mul_(1.01)
            elif target == "buffer":
                block(p, 0).scale.add_(0.1)
            else:
                block(p, int(target)).fc1.weight.mul_(1.01)

    if where == "pre":
        p.transformer.register_forward_pre_hook(lambda m, a: edit())
    else:
        p.transformer.register_forward_hook(lambda m, a, o: edit())


_HOOK_CASES = [
    (config, where, target)
    for config in CONFIGS
    for where in ("pre", "post")
    for target in (0, 3, "remainder", "buffer")
    if not (where == "pre" and target == 0 and config in ("layerwise", "depth2"))
]


@pytest.mark.parametrize(("config", "where", "target"), _HOOK_CASES)
def test_a_transformer_hook_editing_weights_at_every_step_is_exact(
    config: str, where: str, target: Any
) -> None:
    """A pre or post hook on the transformer, registered after opening, editing a weight or buffer in
    place at every DiT step, gives the plain run's calls and state."""
    p, ref = toy.build(0), toy.build(0)
    with session(p, config):
        for pipe in (p, ref):
            _component_hook(pipe, where, target)
        for _ in range(2):
            assert torch.equal(p("a cat", steps=3), ref("a cat", steps=3))
    assert same_state(p, ref)


@pytest.mark.parametrize("config", ["layerwise", "depth2"])
def test_a_transformer_pre_hook_editing_the_first_block_is_exact(config: str) -> None:
    """A transformer pre hook editing block 0's weight in place at every step gives the plain run's
    calls: it runs after the session's step start, while block 0's copy (issued by the step before)
    is still in flight and its tensors at host memory, so block 0's wait finds the edit and copies
    the block again."""
    p, ref = toy.build(0), toy.build(0)
    with session(p, config):
        for pipe in (p, ref):
            _component_hook(pipe, "pre", 0)
        for _ in range(2):
            assert torch.equal(p("a cat", steps=3), ref("a cat", steps=3))
    assert same_state(p, ref)
