"""Step naming as a pure state machine: run indices, what follows each step, index-free naming."""

from __future__ import annotations

from torchferry import policies
from torchferry.policies import Placement, Step, StepState


def _walk(components: list[str], *, index_free: bool = False) -> tuple[list[Step], StepState]:
    state = policies.init_steps()
    steps = []
    for c in components:
        step, state = policies.next_step(state, c, (), index_free=index_free)
        steps.append(step)
    return steps, state


def test_run_indices_count_consecutive_forwards_of_one_component() -> None:
    """Each run of one component numbers its forwards from 0; another component starts a new run."""
    steps, state = _walk(["text_encoder", "transformer", "transformer", "transformer", "vae"])
    assert [(s.component, s.index) for s in steps] == [
        ("text_encoder", 0),
        ("transformer", 0),
        ("transformer", 1),
        ("transformer", 2),
        ("vae", 0),
    ]
    assert state.last == ("vae", 0) and state.index == 0
    assert policies.init_steps().index == -1


def test_next_is_what_followed_the_same_step_last_time() -> None:
    """A step learns the component that followed it, and the next call names it as ``next``."""
    call = ["text_encoder", "transformer", "transformer", "vae"]
    first, state = _walk(call)
    assert [s.next for s in first] == [None, None, None, None]
    second = []
    for c in call:
        step, state = policies.next_step(state, c, (), index_free=False)
        second.append(step)
    # transformer#0 was followed by itself (None), transformer#1 by the vae, the vae by the encoder.
    assert [s.next for s in second] == ["transformer", None, "vae", "text_encoder"]
    assert dict(state.follows) == {
        ("text_encoder", 0): "transformer",
        ("transformer", 1): "vae",
        ("vae", 0): "text_encoder",
    }


def test_a_component_called_in_a_loop_stores_no_follow_ups() -> None:
    """Steps followed by their own component store nothing (a missing key reads as ``None``), and a
    step whose follower became itself drops its entry: a DiT run in a loop copies no table per step."""
    _, state = _walk(["transformer"] * (3 * 512))
    assert len(state.follows) == 0
    _, state = _walk(["transformer", "vae", "transformer", "transformer"])
    assert dict(state.follows) == {("vae", 0): "transformer"}


def test_index_free_names_every_forward_index_zero_but_keeps_the_run_index() -> None:
    """Under an index-free policy each step is named index 0, while the state still counts the run."""
    steps, state = _walk(["transformer"] * 3, index_free=True)
    assert [s.index for s in steps] == [0, 0, 0] and state.index == 2


def test_a_failed_step_starts_a_new_run_and_keeps_what_follows_what() -> None:
    """After `step_failed` the next forward is index 0; the follow-ups learned stay."""
    _, state = _walk(["transformer", "transformer"])
    failed = policies.step_failed(state)
    entry = (Placement(unit="transformer.blocks.0", where="s0"),)
    step, after = policies.next_step(failed, "transformer", entry, index_free=False)
    assert (step.index, step.entry, step.next) == (0, entry, None)
    assert after.follows == state.follows and failed.index == -1


def test_step_names_read_component_hash_index() -> None:
    """A step is named ``component#index`` in messages; the pipeline-level step has no component."""
    assert policies.step_name(Step(component="transformer", index=3)) == "transformer#3"
    assert policies.step_name(Step(component="")) == "(pipeline)#0"


def test_follow_ups_are_bounded() -> None:
    """At most MAX_FOLLOWS follow-ups are remembered, the oldest dropped first."""
    from torchferry.policies._steps import MAX_FOLLOWS

    _, state = _walk([f"c{i}" for i in range(MAX_FOLLOWS + 3)])
    assert len(state.follows) == MAX_FOLLOWS and ("c0", 0) not in state.follows
