"""Runtime test helpers: a hand-written schedule, independent of the built-in policies, and a toy pipeline."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
import torch

from torchferry.policies import Op, Schedule, Slot, Step, rest_unit
from torchferry.testing import sanitize, toy
from torchferry.testing._multiproc import SANITIZE_ENV
from torchferry.topology import Plan


def ring(plan: Plan, component: str = "transformer", *, drop: str | None = None) -> Schedule:
    """A depth-1 ring over two slots for ``component``'s blocks; ``drop`` omits one block's load."""
    sizes = {b.path: b.nbytes for b in plan.component(component).blocks}
    blocks = list(sizes)
    size = max(b.nbytes for b in plan.component(component).blocks)
    rest = rest_unit(component)
    ops = [
        Op(
            when="before",
            anchor=component,
            stream="copy",
            kind="stage",
            unit=rest,
            nbytes=plan.component(component).rest_bytes,
        ),
        Op(
            when="before",
            anchor=component,
            stream="copy",
            kind="load",
            unit=blocks[0],
            slot="s0",
            nbytes=size,
        ),
    ]
    for i, block in enumerate(blocks):
        if block != drop:
            ops.append(Op(when="before", anchor=block, stream="compute", kind="wait", unit=block))
        if i + 1 < len(blocks) and blocks[i + 1] != drop:
            slot = f"s{(i + 1) % 2}"
            ops.append(
                Op(
                    when="before",
                    anchor=block,
                    stream="copy",
                    kind="load",
                    unit=blocks[i + 1],
                    slot=slot,
                    nbytes=size,
                )
            )
        if block != drop:
            ops.append(Op(when="after", anchor=block, stream="compute", kind="evict", unit=block))
    ops.append(Op(when="after", anchor=component, stream="copy", kind="unstage", unit=rest))
    return Schedule(
        policy="ring(hand-written)",
        plan=plan.digest,
        step=Step(component=component),
        slots=[Slot(name="s0", nbytes=size), Slot(name="s1", nbytes=size)],
        entry=(),
        ops=ops,
        exit=(),
    )


@pytest.fixture
def hand_ring() -> Callable[..., Schedule]:
    """The `ring` schedule builder."""
    return ring


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Run torch on one CPU thread: tiny models run fastest and steadiest that way on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield None
    torch.set_num_threads(before)


#: Runtime tests that CI also runs with their packs re-pointed, as on CUDA (``--cuda-path`` runs every
#: test so): in these modules, those whose names match, the edits, interrupts and gradients whose
#: handling differs between a docked and a re-pointed pack.
_BOTH_WAYS_MODULES = frozenset(
    {"test_guard_hostile", "test_weights_hostile", "test_inflight_hostile", "test_contract"}
)
_BOTH_WAYS = re.compile(r"interrupt|assigned|grad|data_|fuse|merge|_view")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    if (
        metafunc.module.__name__.rsplit(".", 1)[-1] in _BOTH_WAYS_MODULES
        and _BOTH_WAYS.search(metafunc.function.__name__)
        and metafunc.definition.get_closest_marker("docking") is None
        and not config.getoption("--cuda-path")
        and not config.getoption("--no-stream-sanitizer")
    ):
        metafunc.parametrize("stream_sanitizer", ["docked", "re-pointed"], indirect=True)


@pytest.fixture(autouse=True)
def stream_sanitizer(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every engine a runtime test builds runs on the stream sanitizer (``--no-stream-sanitizer``: not;
    ``--cuda-path``, or the ``re-pointed`` form of a test run both ways: its packs re-pointed tensor
    by tensor, as on CUDA, rather than docked).

    Tests marked ``gpu`` keep the real CUDA stream context: they are there to run it.
    """
    docks = not request.config.getoption("--cuda-path") and getattr(request, "param", "docked") == "docked"
    if request.config.getoption("--no-stream-sanitizer") and not docks:
        raise pytest.UsageError(
            "--cuda-path runs the runtime tests on the stream sanitizer: drop --no-stream-sanitizer"
        )
    if request.config.getoption("--no-stream-sanitizer") or "gpu" in request.keywords:
        yield None
        return
    with pytest.MonkeyPatch.context() as patch, sanitize(docks=docks):
        patch.setenv(SANITIZE_ENV, "1" if docks else "re-point")  # ranks run_ranks starts run under it too
        yield None


@pytest.fixture
def pipeline() -> toy.ToyPipeline:
    """A fresh one-DiT toy pipeline with seed 0."""
    return toy.build(0)
