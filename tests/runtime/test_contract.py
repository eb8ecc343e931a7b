"""The session contract (docs/contract.md): threads, weight edits, moves, saving and copying, bad arguments.

Each case here once ended in a wrong answer or an error of the wrong kind; now it ends in the right
answer or a clear `torchferry` error.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from module_checks import hook_count, same_weights
from safetensors.torch import load_file, save_model

import torchferry
from torchferry import ExecutionError, PlanError, runtime, topology
from torchferry.policies import Schedule, Slot
from torchferry.testing import toy

LAYERWISE: dict[str, Any] = {"strategy": "layerwise", "device": "cpu"}
#: Sessions whose steps leave weights on the device between steps (a resident block) or not.
SESSIONS: list[dict[str, Any]] = [
    {**LAYERWISE},
    {**LAYERWISE, "prefetch_depth": 2, "resident_layers": 1, "components": {"dit", "text_encoder"}},
    {"strategy": "model_level", "device": "cpu"},
]


def _ids(options: dict[str, Any]) -> str:
    return f"{options['strategy']}-{len(options)}"


# ------------------------------------------------------------------------------------- threads


@pytest.mark.parametrize("threads", [2, 4])
def test_threads_on_one_session_get_the_right_output_or_a_clear_error(threads: int) -> None:
    """Threads x 25 calls on one session: each call returns the plain output or is refused clearly."""
    p, ref = toy.build(0), toy.build(0)
    expected = ref("a cat", steps=2)
    outcomes: list[str] = []
    messages: set[str] = set()
    lock = threading.Lock()
    pattern = re.compile(
        r"a forward of '(text_encoder|transformer|vae)' started on thread 'worker-\d' while thread "
        r"'worker-\d' runs a step of '(text_encoder|transformer|vae)' on this torchferry session; a session "
        r"serves one step at a time \(its device slots hold one step's weights\), so serialise calls on the "
        r"pipeline \(one threading.Lock around each call\) or give each thread a pipeline and session of "
        r"its own"
    )

    def work() -> None:
        for _ in range(25):
            try:
                out = p("a cat", steps=2)
                seen = "right" if torch.equal(out, expected) else "wrong"
            except ExecutionError as exc:
                seen = "refused"
                with lock:
                    messages.add(str(exc))
            with lock:
                outcomes.append(seen)

    with torchferry.offload(p, **LAYERWISE):
        workers = [threading.Thread(target=work, name=f"worker-{i}") for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert torch.equal(p("a cat", steps=2), expected)  # the session is sound after the storm
    assert len(outcomes) == 25 * threads
    assert outcomes.count("wrong") == 0
    assert outcomes.count("right") > 0
    assert all(pattern.fullmatch(m) for m in messages), messages
    assert same_weights(p, ref) and hook_count(p) == 0


def test_threads_that_serialise_their_calls_all_get_the_right_output() -> None:
    """With a lock around each call (the documented way), 4 threads x 10 calls are all exact."""
    p, ref = toy.build(0), toy.build(0)
    expected = ref("a cat", steps=2)
    results: list[bool] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(10):
            with lock:
                results.append(torch.equal(p("a cat", steps=2), expected))

    with torchferry.offload(p, **LAYERWISE):
        workers = [threading.Thread(target=work) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert results == [True] * 40


def test_a_thread_that_died_inside_a_step_does_not_block_the_others() -> None:
    """A thread interrupted mid-step (no post hooks run) and gone: the next call elsewhere is exact."""
    p, ref = toy.build(0), toy.build(0)
    armed = [True]

    def interrupt(module: torch.nn.Module, args: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    def work() -> None:
        with contextlib.suppress(KeyboardInterrupt):
            p("a cat")

    with torchferry.offload(p, **LAYERWISE) as session:
        p.transformer.blocks[4].register_forward_pre_hook(interrupt)
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        assert session.engine.running  # the interrupted step was never finished
        assert torch.equal(p("a cat"), ref("a cat"))


# -------------------------------------------------------------------------------- weight edits


def _edit_load_state_dict(p: toy.ToyPipeline) -> toy.ToyPipeline:
    q = toy.build(1)
    p.load_state_dict(q.state_dict())
    return q


def _edit_copy(p: toy.ToyPipeline) -> toy.ToyPipeline:
    q = toy.build(1)
    with torch.no_grad():
        for a, b in zip(
            p.state_dict(keep_vars=True).values(), q.state_dict(keep_vars=True).values(), strict=True
        ):
            a.copy_(b)
    return q


def _edit_data(p: toy.ToyPipeline) -> toy.ToyPipeline:
    q = toy.build(1)
    for a, b in zip([*p.parameters(), *p.buffers()], [*q.parameters(), *q.buffers()], strict=True):
        a.data = b.detach().clone()
    return q


def _edit_mul(p: toy.ToyPipeline) -> toy.ToyPipeline:
    q = toy.build(0)
    with torch.no_grad():
        for a, b in zip(p.parameters(), q.parameters(), strict=True):
            a.mul_(2)
            b.mul_(2)
    return q


#: An edit of the pipeline during a session, returning a plain model holding what it should hold then.
EDITS: dict[str, Callable[[toy.ToyPipeline], toy.ToyPipeline]] = {
    "load_state_dict": _edit_load_state_dict,
    "copy_": _edit_copy,
    "data=": _edit_data,
    "mul_": _edit_mul,
}


@pytest.mark.parametrize("options", SESSIONS, ids=_ids)
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_weight_edit_during_a_session_reaches_every_later_step_and_close(
    edit: str, options: dict[str, Any]
) -> None:
    """load_state_dict, copy_, .data = and in-place ops between calls reach every tensor, then and after."""
    p = toy.build(0)
    with torchferry.offload(p, **options) as session:
        p("a cat", steps=2)
        q = EDITS[edit](p)
        assert torch.equal(p("a cat", steps=2), q("a cat", steps=2))
        assert torch.equal(p("a dog", steps=3), q("a dog", steps=3))
        assert session.device_bytes >= 0
    assert same_weights(p, q)
    assert torch.equal(p("a cat", steps=2), q("a cat", steps=2))


def test_an_edit_after_the_last_call_is_kept_by_close() -> None:
    """An in-place edit made after the last call and before close() is in the weights close gives back."""
    p = toy.build(0)
    with torchferry.offload(p, **LAYERWISE, resident_layers=1):
        p("a cat")
        q = _edit_load_state_dict(p)
    assert same_weights(p, q)


@pytest.mark.docking
@pytest.mark.parametrize("options", SESSIONS, ids=_ids)
def test_a_weight_of_another_dtype_runs_as_in_plain_torch(options: dict[str, Any]) -> None:
    """t.data = a tensor of another dtype between steps, on a CPU session (whose packs dock, so no step
    re-points the weight: rule 2 of the contract): the next call meets that tensor as a plain run does
    (torch's own dtype error here, nothing of torchferry's), the weight put back runs exact again, and
    close leaves each weight as the user gave it."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, **options):
        p("a cat")
        ref("a cat")
        wrong = {pipe: torch.zeros(32, 32, dtype=torch.float64) for pipe in (p, ref)}
        kept = {pipe: pipe.transformer.blocks[0].q.weight.detach().clone() for pipe in (p, ref)}
        errors = []
        for pipe in (ref, p):
            pipe.transformer.blocks[0].q.weight.data = wrong[pipe]
            with pytest.raises(RuntimeError) as raised:
                pipe("a cat")
            errors.append((type(raised.value), str(raised.value)))
        assert errors[0] == errors[1]
        for pipe in (p, ref):
            pipe.transformer.blocks[0].q.weight.data = kept[pipe]
        assert torch.equal(p("a cat"), ref("a cat"))
        for pipe in (p, ref):
            pipe.transformer.blocks[0].q.weight.data = wrong[pipe]
    assert p.transformer.blocks[0].q.weight.dtype == torch.float64
    assert same_weights(p, ref)


def test_a_replaced_parameter_object_is_refused_at_the_next_step() -> None:
    """Assigning a new Parameter to a managed module during a session raises at the next call."""
    p = toy.build(0)
    with torchferry.offload(p, **LAYERWISE):
        p.transformer.blocks[1].k.bias = torch.nn.Parameter(torch.zeros(32))
        with pytest.raises(
            ExecutionError, match=re.escape("(transformer.blocks.1.k.bias is another tensor object now)")
        ):
            p("a cat")


def test_the_edit_check_costs_little_per_step() -> None:
    """Checking every managed tensor for edits at a step start takes well under a millisecond on the toy."""
    import time

    p = toy.build(0)
    with torchferry.offload(p, **LAYERWISE) as session:
        guard = session._guard
        start = time.perf_counter()
        for _ in range(200):
            guard.adopt()
            guard.snapshot()
        per_step = (time.perf_counter() - start) / 200
        tensors = len(guard._records)
    assert tensors > 100
    assert per_step < 5e-3, per_step


# ------------------------------------------------------------------------------------- moves


MOVES: dict[str, Callable[[Any], Any]] = {
    "half": lambda m: m.half(),
    "to(float64)": lambda m: m.to(torch.float64),
    "to('meta')": lambda m: m.to("meta"),
    "double": lambda m: m.double(),
    "to_empty": lambda m: m.to_empty(device="cpu"),
}


@pytest.mark.parametrize("target", ["", "transformer", "transformer.blocks.2.q"])
@pytest.mark.parametrize("move", list(MOVES))
def test_a_move_during_a_session_is_refused_before_anything_moves(move: str, target: str) -> None:
    """.to()/.half()/.to('meta') on the pipeline or a managed module raise; close() gives it back whole."""
    p, ref = toy.build(0), toy.build(0)
    where = f"{target!r}" if target else "the pipeline"
    message = (
        f".to()/.half()/.float()/.cuda()/.to('meta') of {where} (a conversion through nn.Module._apply) "
        "while a torchferry session serves it would replace weights the session holds; close() the session "
        "first, then move or convert the pipeline"
    )
    with torchferry.offload(p, **LAYERWISE):
        p("a cat")
        module = topology.find_attr(p, target)
        with pytest.raises(ExecutionError, match=re.escape(message)):
            MOVES[move](module)
        assert torch.equal(p("a cat"), ref("a cat"))
    assert same_weights(p, ref)
    p.half()  # after close, moves work again
    assert {t.dtype for t in p.parameters()} == {torch.float16}


#: Conversions that change no tensor of the float32 parts of the toy (its blocks' gates are float16).
NO_OPS: dict[str, Callable[[Any], Any]] = {
    "to(float32)": lambda m: m.to(torch.float32),
    "to(cpu, float32)": lambda m: m.to(torch.device("cpu"), torch.float32, non_blocking=True),
    "float": lambda m: m.float(),
}
#: Conversions that change no tensor of any part of the toy (all of it is on the CPU).
DEVICE_NO_OPS: dict[str, Callable[[Any], Any]] = {
    "to('cpu')": lambda m: m.to("cpu"),
    "to()": lambda m: m.to(),
    "to(channels_last)": lambda m: m.to(memory_format=torch.channels_last),  # no 4-d tensor
    "cpu": lambda m: m.cpu(),
}
_NO_OP_CASES = [(c, t) for c in NO_OPS for t in ("transformer.blocks.2.q", "text_encoder")] + [
    (c, t) for c in DEVICE_NO_OPS for t in ("", "transformer", "transformer.blocks.2.q")
]


@pytest.mark.parametrize(("conversion", "target"), _NO_OP_CASES)
def test_a_conversion_that_changes_no_tensor_is_a_no_op(conversion: str, target: str) -> None:
    """A conversion that would change no tensor (a float32 part to float32, a CPU pipeline to the CPU)
    returns the module itself, as in plain torch; later steps and the weights after close stay exact."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, **LAYERWISE):
        p("a cat")
        module = topology.find_attr(p, target)
        assert {**NO_OPS, **DEVICE_NO_OPS}[conversion](module) is module
        assert torch.equal(p("a cat"), ref("a cat"))
    assert same_weights(p, ref)
    assert not {"to", "cpu", "float"} & set(vars(module))  # the session's methods are gone after close


@pytest.mark.parametrize("conversion", list(NO_OPS))
def test_a_conversion_that_changes_one_tensor_is_refused(conversion: str) -> None:
    """The same conversions of the whole transformer, whose blocks hold a float16 gate, are refused
    before anything is converted."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, **LAYERWISE):
        p("a cat")
        with pytest.raises(ExecutionError, match=re.escape("of 'transformer' (a conversion through")):
            NO_OPS[conversion](p.transformer)
        assert torch.equal(p("a cat"), ref("a cat"))
    assert same_weights(p, ref)
    assert {t.dtype for t in p.parameters()} == {torch.float32, torch.float16}


def test_a_move_to_the_host_on_a_device_session_is_refused_though_the_weights_are_there() -> None:
    """On a session whose device is not the CPU (meta here, as CUDA on a GPU), ``.cpu()`` and
    ``.to("cpu")`` of a block whose tensors sit at host memory between steps are refused: the session
    would go on serving it on its device. A dtype no-op is still one."""
    p, ref = toy.build(0), toy.build(0)
    session = torchferry.offload(p, strategy="layerwise", device="meta")
    q = p.transformer.blocks[3].q
    assert {t.device.type for t in q.parameters()} == {"cpu"}
    for move in (lambda m: m.cpu(), lambda m: m.to("cpu"), lambda m: m.to("cpu", torch.float32)):
        with pytest.raises(ExecutionError, match=re.escape("(a conversion through nn.Module._apply)")):
            move(q)
    assert q.to(torch.float32) is q
    session.close()
    assert same_weights(p, ref)


class _CachingLinear(torch.nn.Linear):
    """A linear layer whose ``_apply`` also converts a cached float64 table it keeps outside its buffers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache = torch.ones(3, dtype=torch.float64)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self.cache = fn(self.cache)
        return super()._apply(fn, recurse)


class _OwnTo(torch.nn.Linear):
    """A linear layer with a ``to`` of its own (it could move more than its tensors)."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        return super().to(*args, **kwargs)


@pytest.mark.parametrize("cls", [_CachingLinear, _OwnTo])
def test_a_conversion_of_a_module_converting_its_own_way_is_refused(cls: type[torch.nn.Linear]) -> None:
    """A no-op conversion is not answered for a module that converts more than its tensors: its own
    ``to``, or a class ``_apply`` under it (which a parent's ``.to()`` reaches in plain torch, and
    which could change what it keeps); it goes on to the refusal, and nothing changes. A parent whose
    children only have their own ``to`` (which a parent's ``.to()`` never calls) still answers."""
    p = toy.build(0)
    old = p.transformer.blocks[2].q
    new = cls(old.in_features, old.out_features)
    new.load_state_dict(old.state_dict())
    p.transformer.blocks[2].q = new
    ref = copy.deepcopy(p)
    refused = re.escape("(a conversion through nn.Module._apply)")
    with torchferry.offload(p, **LAYERWISE):
        p("a cat")
        with pytest.raises(ExecutionError, match=refused):
            new.to(torch.float32)
        parent = p.transformer.blocks[2]
        if cls is _CachingLinear:
            with pytest.raises(ExecutionError, match=refused):
                parent.to("cpu")
        else:
            assert parent.to("cpu") is parent
        assert p.transformer.blocks[3].q.to(torch.float32) is p.transformer.blocks[3].q
        assert torch.equal(p("a cat"), ref("a cat"))
    assert same_weights(p, ref)


def test_a_no_op_conversion_of_a_quantized_model_keeps_its_own_checks() -> None:
    """A model marked quantized (diffusers' and transformers' ``is_quantized``) gets no no-op answer:
    the call goes on to its own method (here torch's, so to the refusal); nothing changes."""
    p, ref = toy.build(0), toy.build(0)
    q = p.transformer.blocks[3].q
    object.__setattr__(q, "is_quantized", True)
    with torchferry.offload(p, **LAYERWISE):
        with pytest.raises(ExecutionError, match=re.escape("(a conversion through nn.Module._apply)")):
            q.to(torch.float32)
        assert p.transformer.blocks[2].q.to(torch.float32) is p.transformer.blocks[2].q
        assert torch.equal(p("a cat"), ref("a cat"))
    assert same_weights(p, ref)


def test_a_conversion_a_module_rejects_keeps_its_own_error() -> None:
    """Arguments ``nn.Module.to`` rejects raise its own error during a session, and nothing changes."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, **LAYERWISE):
        with pytest.raises(RuntimeError, match="Invalid device string: 'not a device'"):
            p.transformer.to("not a device")
        assert torch.equal(p("a cat"), ref("a cat"))
    assert same_weights(p, ref)


# ---------------------------------------------------------------------------- saving, copying


@pytest.mark.parametrize("options", SESSIONS, ids=_ids)
def test_state_dict_during_a_session_is_right_and_every_saver_takes_it(
    options: dict[str, Any], tmp_path: Path
) -> None:
    """state_dict() mid-session equals the plain one, and torch.save and safetensors save it and load back."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, **options):
        p("a cat")
        state = p.state_dict()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        save_model(p, str(tmp_path / "m.safetensors"))
        live = p.state_dict(keep_vars=True)
        assert live["transformer.blocks.0.q.weight"] is p.transformer.blocks[0].q.weight
        sub = p.transformer.blocks[3].state_dict()
    plain = ref.state_dict()
    assert state.keys() == plain.keys()
    assert all(torch.equal(state[k], plain[k]) for k in plain)
    assert state["text_encoder.in_proj.weight"] is state["text_encoder.out_proj.weight"]  # ties kept
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert all(torch.equal(loaded[k], plain[k]) for k in plain)
    saved = load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(saved[k], plain[k]) for k in saved) and len(saved) > 100
    assert all(torch.equal(v, plain[f"transformer.blocks.3.{k}"]) for k, v in sub.items())


def test_pickling_a_pipeline_during_a_session_is_refused_and_works_after_close() -> None:
    """torch.save(pipe) mid-session raises a clear ExecutionError; after close() it saves."""
    p = toy.build(0)
    message = (
        "pickling or copying the pipeline (torch.save, copy.copy) while a torchferry session serves it: "
        "its hooks and weight buffers belong to the session; save its state_dict() instead (it returns "
        "standalone tensors during a session), or close() the session first"
    )
    with torchferry.offload(p, **LAYERWISE):
        with pytest.raises(ExecutionError, match=re.escape(message)):
            torch.save(p, io.BytesIO())
        with pytest.raises(ExecutionError, match=re.escape("pickling or copying 'transformer' (torch.save")):
            torch.save(p.transformer, io.BytesIO())
    torch.save(p, io.BytesIO())


@pytest.mark.parametrize("how", ["deepcopy", "copy"])
def test_copying_a_pipeline_during_a_session_is_refused_and_works_after_close(how: str) -> None:
    """copy.deepcopy/copy.copy mid-session raise; after close() a deep copy runs and equals the original."""
    p, ref = toy.build(0), toy.build(0)
    message = (
        "copy.deepcopy of the pipeline while a torchferry session serves it: the copy would share the "
        "session's hooks and weight buffers and fail once it closes; copy after close(), or build the copy "
        "from state_dict() (standalone tensors during a session)"
        if how == "deepcopy"
        else "pickling or copying the pipeline (torch.save, copy.copy) while a torchferry session serves it"
    )
    with torchferry.offload(p, **LAYERWISE), pytest.raises(ExecutionError, match=re.escape(message)):
        (copy.deepcopy if how == "deepcopy" else copy.copy)(p)
    twin = copy.deepcopy(p)
    assert torch.equal(twin("a cat"), ref("a cat")) and hook_count(twin) == 0
    assert all(attr not in m.__dict__ for m in p.modules() for attr in ("_apply", "__deepcopy__"))


# ------------------------------------------------------------------------------ device memory


def test_a_device_allocation_that_fails_is_never_counted(hand_ring: Callable[..., Schedule]) -> None:
    """A slot too large to allocate raises out of memory and leaves device_bytes where it was."""
    p = toy.build(0)
    plan = topology.resolve(topology.discover(p), topology.OffloadConfig(strategy="layerwise"))
    good: Schedule = hand_ring(plan)
    huge = attrs.evolve(good, slots=[Slot(name="s0", nbytes=2**62), good.slots[1]])
    engine = runtime.Engine(p, plan, device="cpu", pin_memory=False)
    try:
        with (
            pytest.raises(RuntimeError, match="allocate"),
            runtime.execute(huge, p, plan, device="cpu", engine=engine),
            torch.no_grad(),
        ):
            p.transformer(torch.zeros(1, 16, 16), torch.tensor([0.5]), torch.zeros(1, 8, 32))
        assert engine.ledger.held == 0
        with runtime.execute(good, p, plan, device="cpu", engine=engine), torch.no_grad():
            p.transformer(torch.zeros(1, 16, 16), torch.tensor([0.5]), torch.zeros(1, 8, 32))
        assert engine.ledger.held == sum(s.nbytes for s in good.slots)  # the ring's slots stay allocated
    finally:
        engine.close()


# ------------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("pipeline", [None, 3, {}, "pipe", [torch.nn.Linear(2, 2)]])
def test_what_is_not_a_pipeline_is_a_plan_error(pipeline: Any) -> None:
    """offload(None), offload(3), offload({}) and the like name what a pipeline may be."""
    shown = repr(pipeline)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    with pytest.raises(
        PlanError,
        match=re.escape(
            f"torchferry.offload(pipeline): got {type(pipeline).__name__} {shown}, which is not a pipeline; "
            "pass a torch.nn.Module or an object whose attributes are modules (a diffusers pipeline)"
        ),
    ):
        torchferry.offload(pipeline, **LAYERWISE)


@pytest.mark.parametrize("device", ["mps", "xla", "tpu", 3.5, torch.device("mps")])
def test_a_device_torchferry_cannot_stream_to_is_a_plan_error(device: Any) -> None:
    """device='mps' (or any type but cpu, cuda and the test-only meta) is refused at offload()."""
    p, ref = toy.build(0), toy.build(0)
    with pytest.raises(
        PlanError,
        match=re.escape(
            f"offload(device={device!r}): torchferry streams weights to 'cpu' or 'cuda' (with an index, "
            "'cuda:1'); 'meta' is accepted for tests only (nothing is computed there); pass one of those"
        ),
    ):
        torchferry.offload(p, strategy="layerwise", device=device)
    assert same_weights(p, ref) and hook_count(p) == 0


def test_the_meta_device_is_accepted_for_tests() -> None:
    """device='meta' opens (the documented test device) and closes giving the pipeline back."""
    p, ref = toy.build(0), toy.build(0)
    session = torchferry.offload(p, strategy="layerwise", device="meta")
    assert session.device == torch.device("meta")
    session.close()
    assert same_weights(p, ref)


# ----------------------------------------------------------------- edits through ``.data``
def _fuse_lora(pipe: Any) -> None:
    """An edit in the manner of diffusers' fuse_lora: ``weight.data`` changed in place (no version bump)."""
    with torch.no_grad():
        for p in pipe.transformer.parameters():
            p.data.add_(0.5)


@pytest.mark.parametrize("options", SESSIONS, ids=_ids)
def test_a_fuse_through_data_lands_in_every_later_step_and_after_close(options: dict[str, Any]) -> None:
    """A ``fuse_lora`` that writes ``.data`` in place between calls reaches every later call and close()."""
    p, ref = toy.build(0), toy.build(0)
    _fuse_lora(ref)
    expected = ref("a cat", steps=3)
    object.__setattr__(p.transformer, "fuse_lora", lambda: _fuse_lora(p))
    with torchferry.offload(p, **options):
        p("a cat", steps=3)
        p.transformer.fuse_lora()
        assert torch.equal(p("a cat", steps=3), expected)
        assert torch.equal(p("a cat", steps=3), expected)
    assert torch.equal(p("a cat", steps=3), expected)
    assert same_weights(p, ref)


def test_a_fuse_inside_a_step_is_refused() -> None:
    """Fusing from inside a forward (a step is running) is an ExecutionError, and nothing is edited."""
    p, ref = toy.build(0), toy.build(0)
    object.__setattr__(p.transformer, "fuse_lora", lambda: _fuse_lora(p))
    seen: list[str] = []

    def fuse_during(module: torch.nn.Module, args: Any) -> None:
        try:
            p.transformer.fuse_lora()
        except ExecutionError as exc:
            seen.append(str(exc))

    with torchferry.offload(p, **LAYERWISE):
        handle = p.transformer.register_forward_pre_hook(fuse_during)
        p("a cat", steps=1)
        handle.remove()
    handle.remove()
    assert seen and seen[0] == (
        "transformer.fuse_lora() was called inside a step of the torchferry session (from a forward); "
        "fuse or merge adapters between pipeline calls"
    )
    assert same_weights(p, ref)
