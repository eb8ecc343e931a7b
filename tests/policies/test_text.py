"""The canonical text form: exact round trips and located parse errors."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_plans import ring_plan

from torchferry import ScheduleError, policies
from torchferry.policies import OP_KINDS, Op, Placement, Schedule, Slot, Step

names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
plain = st.from_regex(r"[a-z][a-z0-9_.]{0,10}", fullmatch=True)
unit = st.one_of(plain, names)
nbytes = st.integers(min_value=0, max_value=1 << 42)


def placement() -> st.SearchStrategy[Placement]:
    return st.builds(
        lambda u, w, n: Placement(unit=u, where=w, nbytes=n),
        unit,
        st.one_of(st.just(policies.DEVICE), plain),
        nbytes,
    )


ops = st.builds(
    Op,
    when=st.sampled_from(["before", "after"]),
    anchor=unit,
    stream=st.sampled_from(["copy", "comm", "compute"]),
    kind=st.sampled_from(OP_KINDS),
    unit=unit,
    slot=st.one_of(st.none(), unit),
    src=st.one_of(st.none(), unit),
    nbytes=nbytes,
    chunks=st.integers(min_value=1, max_value=64),
)

schedules = st.builds(
    Schedule,
    policy=names,
    plan=names,
    step=st.builds(
        Step,
        component=unit,
        index=st.integers(min_value=0, max_value=10_000),
        entry=st.lists(placement(), max_size=3),
        next=st.one_of(st.none(), unit),
    ),
    slots=st.lists(
        st.builds(Slot, name=unit, nbytes=nbytes, kind=st.sampled_from(["block", "shard"])), max_size=3
    ),
    entry=st.lists(placement(), max_size=3),
    ops=st.lists(ops, max_size=8),
    exit=st.lists(placement(), max_size=3),
    notes=st.lists(names, max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(schedules)
def test_parse_inverts_format(schedule: Schedule) -> None:
    """parse(format(s)) == s for any schedule, byte counts of placements included."""
    text = policies.format_schedule(schedule)
    back = policies.parse_schedule(text)
    assert back == schedule
    assert policies.format_schedule(back) == text


def test_listing_of_a_ring() -> None:
    """A layerwise schedule prints as aligned lines with names, human and exact bytes, and a sim line."""
    plan = ring_plan(3, 1 << 20)
    text = policies.format_schedule(policies.layerwise(1)(plan, Step(component="transformer")))
    lines = text.splitlines()
    assert lines[0] == "# torchferry schedule v1"
    assert lines[1] == "# policy: layerwise(depth=1)"
    assert lines[2] == f"# plan: {plan.digest}"
    assert lines[3] == "# step: transformer #0"
    assert lines[4] == "slot    s0      block  1.0 MiB (1048576)"
    assert (
        "before  transformer.blocks.0  copy     load   transformer.blocks.1  -> s1  1.0 MiB (1048576)"
        in lines
    )
    assert lines[-1].startswith("# sim: peak 2.0 MiB · makespan ")


def test_op_repr_is_its_line() -> None:
    """An op's repr is its canonical text line."""
    op = Op(
        when="before",
        anchor="t.blocks.0",
        stream="copy",
        kind="load",
        unit="t.blocks.1",
        slot="s1",
        nbytes=2048,
    )
    assert repr(op) == "Op<before t.blocks.0 copy load t.blocks.1 -> s1 2.0 KiB (2048)>"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope\n", "line 1: a schedule starts with '# torchferry schedule v1': 'nope'"),
        (
            "# torchferry schedule v1\n# policy: x\n# plan: y\n# step: t #0\nbefore t copy carry u\n",
            "line 5: unknown op kind 'carry' (load, gather, wait, evict, stage, unstage, acquire, release): "
            "'before t copy carry u'",
        ),
        (
            "# torchferry schedule v1\n# policy: x\n# plan: y\n# step: t #0\nslot s0 block 1.0 MiB\n",
            "line 5: byte count 1.0 MiB needs its exact value in brackets: 'slot s0 block 1.0 MiB'",
        ),
        (
            "# torchferry schedule v1\n# policy: x\n# step: t #0\n",
            "line 1: the schedule has no '# plan:' line: '# torchferry schedule v1'",
        ),
    ],
)
def test_parse_errors_name_the_line(text: str, message: str) -> None:
    """Malformed text raises ScheduleError naming the line, the problem and the text."""
    with pytest.raises(ScheduleError, match=re.escape(message)):
        policies.parse_schedule(text)


def test_marked_listing_keys_marks_by_op_index_and_exit() -> None:
    """`format_marked` flags the op at each index, the end for ``"exit"``, and numbers lines on request."""
    schedule = policies.layerwise(1)(ring_plan(3, 1 << 20), Step(component="transformer"))
    plain = policies.format_schedule(schedule, sim=False).splitlines()
    ops = [k for k, line in enumerate(plain) if line.startswith(("before ", "after "))]
    marked = policies.format_marked(schedule, [2, "exit"], note="stop").splitlines()
    assert marked[ops[2]] == plain[ops[2]] + "  <-- stop"
    assert marked[-1] == "(end of schedule)  <-- stop"
    assert sum(line.endswith("<-- stop") for line in marked) == 2
    numbered = policies.format_marked(schedule, [0], lines=[1], numbered=True).splitlines()
    width = len(str(len(plain)))
    assert numbered[0] == f"  {1:>{width}} | {plain[0]}  <-- here"
    assert numbered[ops[0]] == f"  {ops[0] + 1:>{width}} | {plain[ops[0]]}  <-- here"
    assert len(numbered) == len(plain)
