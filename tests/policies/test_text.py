"""The canonical text form: exact round trips and located parse errors."""

from __future__ import annotations

import re

import attrs
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
dotted = st.from_regex(r"[a-z]{1,3}(\.[a-z0-9]{1,3}){0,3}", fullmatch=True)


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
    stream=st.sampled_from(["copy", "comm", "compute", "io"]),
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
        st.builds(Slot, name=unit, nbytes=nbytes, kind=st.sampled_from(["block", "shard", "staging"])),
        max_size=3,
    ),
    entry=st.lists(placement(), max_size=3),
    ops=st.lists(ops, max_size=8),
    exit=st.lists(placement(), max_size=3),
    notes=st.lists(names, max_size=2),
    file=st.lists(st.one_of(plain, names, dotted)),
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
            "line 5: unknown op kind 'carry' (load, gather, wait, evict, stage, unstage, acquire, release, "
            "read): "
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


def test_file_line_groups_names_and_reads_back() -> None:
    """The `# file:` line writes siblings once as parent.{a,b} and quotes names that could misread."""
    names = ("t.blocks.10", "t.blocks.2", "t:rest", "a b", "x.{1}", ".lead", "solo")
    schedule = Schedule(
        policy="p", plan="d", step=Step(component="t"), slots=[], entry=[], ops=[], exit=[], file=names
    )
    assert schedule.file == (".lead", "a b", "solo", "t.blocks.2", "t.blocks.10", "t:rest", "x.{1}")
    text = policies.format_schedule(schedule, sim=False)
    line = next(t for t in text.splitlines() if t.startswith("# file:"))
    assert line == '# file: .lead "a b" solo t.blocks.{2,10} t:rest "x.{1}"'
    assert policies.parse_schedule(text) == schedule


def test_no_file_line_without_a_file_tier() -> None:
    """A schedule whose packs are all in host memory prints no `# file:` line and parses back with file ()."""
    schedule = policies.layerwise(1)(ring_plan(3, 1 << 20), Step(component="transformer"))
    text = policies.format_schedule(schedule)
    assert schedule.file == ()
    assert "# file:" not in text
    assert policies.parse_schedule(text).file == ()


def test_read_ops_and_staging_slots_print_as_lines() -> None:
    """A read is an io line into a staging slot; the load from it names the slot as its source."""
    read = Op(when="before", anchor="t.blocks.0", stream="io", kind="read", unit="t.blocks.2", slot="t0")
    read = attrs.evolve(read, nbytes=4096)
    load = Op(
        when="before",
        anchor="t.blocks.1",
        stream="copy",
        kind="load",
        unit="t.blocks.2",
        slot="s0",
        src="t0",
        nbytes=4096,
    )
    assert repr(read) == "Op<before t.blocks.0 io read t.blocks.2 -> t0 4.0 KiB (4096)>"
    assert repr(load) == "Op<before t.blocks.1 copy load t.blocks.2 -> s0 from t0 4.0 KiB (4096)>"
    schedule = Schedule(
        policy="p",
        plan="d",
        step=Step(component="t"),
        slots=[Slot(name="s0", nbytes=4096), Slot(name="t0", nbytes=4096, kind="staging")],
        entry=[],
        ops=[read, load],
        exit=[],
        file=["t.blocks.2"],
    )
    text = policies.format_schedule(schedule, sim=False)
    assert [line.split() for line in text.splitlines() if line.startswith("slot")] == [
        ["slot", "s0", "block", "4.0", "KiB", "(4096)"],
        ["slot", "t0", "staging", "4.0", "KiB", "(4096)"],
    ]
    assert policies.parse_schedule(text) == schedule


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("# file: a.{b", "line 5: cannot read 'a.{b' as a name or a group parent.{a,b}: '# file: a.{b'"),
        ("# file: a\n# file: b", "line 6: duplicate '# file:' line: '# file: b'"),
    ],
)
def test_bad_file_lines_are_located(line: str, message: str) -> None:
    """A `# file:` line that does not read, or a second one, is a ScheduleError naming its line."""
    text = f"# torchferry schedule v1\n# policy: x\n# plan: y\n# step: t #0\n{line}\n"
    with pytest.raises(ScheduleError, match=re.escape(message)):
        policies.parse_schedule(text)
