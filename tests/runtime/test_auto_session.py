"""``offload(pipe)``: the budget kept, the choice made from measurements, switched between steps only."""

from __future__ import annotations

import logging
import re
from typing import Any

import attrs
import pytest
import torch
from module_checks import hook_count, same_weights

import torchferry
from torchferry import PlanError, policies
from torchferry.session._chooser import SessionReport
from torchferry.testing import toy


def _layerwise_peak(p: torch.nn.Module, **options: Any) -> int:
    """The device peak of two calls under layerwise depth 1 (a budget it just fits)."""
    with torchferry.offload(p, strategy="layerwise", device="cpu", **options) as session:
        p("a cat", steps=3)
        p("a cat", steps=3)
        return session.peak_device_bytes


@pytest.mark.parametrize("custom", [False, True])
def test_budget_broken_by_depth_is_refused_before_anything_moves(custom: bool) -> None:
    """A depth (or a custom policy) whose schedule passes the budget is a PlanError with the listing,
    and the pipeline is left untouched."""
    p, ref = toy.build(0), toy.build(0)
    budget = _layerwise_peak(p)
    before = {n: t.data_ptr() for n, t in p.state_dict().items()}
    options: dict[str, Any] = {"policy": policies.layerwise(3)} if custom else {"prefetch_depth": 3}
    with pytest.raises(PlanError) as caught:
        torchferry.offload(p, strategy="layerwise", device="cpu", device_memory=budget, **options)
    text = str(caught.value)
    first = text.splitlines()[0]
    assert re.fullmatch(
        r"step \w+#0: the schedule layerwise\(depth=3\) made breaks the plan, so none of it ran; fix the "
        r"policy, lower its depth or raise device_memory=",
        first,
    ), first
    assert "[4]" in text and "over the budget of" in text and "<-- here" in text
    assert {n: t.data_ptr() for n, t in p.state_dict().items()} == before
    assert hook_count(p) == 0 and same_weights(p, ref)


def test_offload_with_no_options_fits_the_cpu_default_and_is_bit_identical() -> None:
    """offload(pipe) alone picks, within the stated CPU budget (the CPU's share of the one budget of
    host memory: every pack in host memory, the device every weight), a plan whose outputs equal the
    plain run."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, device="cpu") as session:
        for _ in range(2):
            assert torch.equal(p("a cat", steps=4), ref("a cat", steps=4))
        report = session.report()
        budget = session.plan.config.device_memory_bytes
        assert budget is not None and session.peak_device_bytes <= budget
        assert session.host is not None and session.host.budget.bytes is not None
        assert session.host_bytes <= session.host.budget.bytes  # the host's share of the one budget
        share = policies.format_bytes(budget, exact=False)
        assert f"less {share} for the device" in session.host.budget.source
    assert report.budget == budget
    assert report.budget_source.startswith("every weight resident, ")  # a roomy machine: no more is used
    assert "beside every pack (the device's memory is host memory): " in report.budget_source
    assert report.policy == "none()"
    assert report.reason.startswith("none(): every component fits whole")
    assert same_weights(p, ref) and hook_count(p) == 0


def test_device_memory_none_is_the_default() -> None:
    """``device_memory=None``, the documented default, is the same as not passing it (not a TypeError)."""
    p = toy.build(0)
    with torchferry.offload(p, device="cpu", device_memory=None, host_memory=None) as session:
        assert session.host is not None
        assert session.report().budget == session.host.device_bytes
        assert session.plan.config.host_memory_bytes is None
    with torchferry.offload(p, device="cpu", device_memory=None, device_memory_bytes=123_456) as session:
        assert session.plan.config.device_memory_bytes == 123_456


def test_explicit_config_keeps_the_layerwise_default() -> None:
    """A config names its own strategy (OffloadConfig defaults to layerwise): nothing is chosen."""
    p = toy.build(0)
    with torchferry.offload(p, torchferry.topology.OffloadConfig(), device="cpu") as session:
        report = session.report()
    assert session.plan.strategy == "layerwise"
    assert report.choice is None and report.policy == "layerwise(depth=1)"
    assert (
        report.reason == "layerwise(depth=1): named by the caller (strategy='layerwise'); nothing was chosen"
    )


def test_auto_with_ring_knobs_is_refused() -> None:
    """strategy='auto' picks the depth itself: passing one is a PlanError saying what to do."""
    with pytest.raises(
        PlanError,
        match=re.escape(
            "offload(strategy='auto') with prefetch_depth=: auto picks the policy, its depth and its "
            "resident blocks itself; drop them, or name the strategy (strategy='layerwise')"
        ),
    ):
        torchferry.offload(toy.build(0), strategy="auto", device="cpu", prefetch_depth=2)


def test_resident_layers_name_the_strategy_or_are_refused_with_auto() -> None:
    """resident_layers= alone names the layerwise plan it configures (kept, within the budget that plan
    needs); with strategy='auto' it is refused, since auto picks resident blocks itself."""
    p, ref = toy.build(0), toy.build(0)
    with torchferry.offload(p, device="cpu", resident_layers=3) as session:
        assert torch.equal(p("a cat"), ref("a cat"))
        assert session.report().choice is None
        assert [s.resident_head for s in session.plan.component("transformer").stacks] == [3]
        assert session.policy.name == "layerwise(depth=1)"  # type: ignore[attr-defined]
    with pytest.raises(PlanError) as caught:
        torchferry.offload(p, strategy="auto", device="cpu", resident_layers=3)
    assert str(caught.value) == (
        "offload(strategy='auto') with resident_layers=: auto picks the policy, its depth and its "
        "resident blocks itself; drop them, or name the strategy (strategy='layerwise')"
    )
    assert hook_count(p) == 0 and same_weights(p, ref)


def _record(session: torchferry.Session, module: torch.nn.Module, into: list[str]) -> Any:
    """After every forward of ``module`` (past the session's hooks), note the policy its step ran."""

    def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
        last = session.engine.last
        assert last is not None
        into.append(last.policy)

    return module.register_forward_hook(post)


def test_recalibration_switches_between_steps_once(caplog: pytest.LogCaptureFixture) -> None:
    """Under a tight budget the measured choice replaces the assumed one once, between two steps,
    bit-identically; the report says what was measured and chosen, and INFO lines say what runs: the
    choice at open, the switch, and the new schedule from the step it starts at."""
    p, ref = toy.build(0, hidden=64), toy.build(0, hidden=64)
    budget = _layerwise_peak(p, components={"dit"}) + 3 * 60_000
    seen: list[str] = []
    caplog.set_level(logging.INFO, logger="torchferry")
    with torchferry.offload(p, device="cpu", device_memory=budget, components={"dit"}) as session:
        first = session.report()
        handle = _record(session, p.transformer, seen)
        for _ in range(3):
            assert torch.equal(p("a cat", steps=5), ref("a cat", steps=5))
        handle.remove()
        report = session.report()
        assert session.peak_device_bytes <= budget
        assert max(session.step_peaks.values()) <= budget
    assert first.policy == "layerwise(depth=1)" and not first.calibrated
    assert first.reason.endswith("(under assumed compute; re-chosen once a step is measured)")
    # One change of policy, at a step boundary: a run of the old policy, then only the new one.
    changes = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    assert len(changes) == 1, seen
    assert report.switches == (f"{seen[0]} -> {seen[-1]}: calibrated on transformer",)
    assert report.choice is not None and report.policy == report.choice.policy().name == seen[-1]
    assert report.choice.resident and report.calibrated
    assert report.cost is not None and report.cost.source.startswith("measured by the session")
    assert set(report.predicted_step_s) == set(report.measured_step_s) == {"transformer"}
    assert report.host_op_s > 0 and report.block_s["transformer"] > 0
    assert report.budget == budget and report.budget_source == "given"
    lines = [r.getMessage() for r in caplog.records if r.name == "torchferry"]
    within = f"on cpu within budget {policies.format_bytes(budget, exact=False)} (given)"
    assert lines[0].startswith(f"torchferry: auto: {seen[0]} {within}; transformer: step predicted ")
    assert "(not yet measured); why: " in lines[0] and "(under assumed compute;" in lines[0]
    assert lines[1] == f"torchferry: after measuring transformer, switching {seen[0]} -> {seen[-1]}"
    assert lines[2].startswith(f"torchferry: auto: {seen[-1]} {within}; transformer: step predicted ")
    assert "(not yet measured)" in lines[2]
    assert all(line.startswith(f"torchferry: auto: {seen[-1]} {within}; ") for line in lines[3:])
    assert same_weights(p, ref)


def test_steps_that_run_no_block_are_not_measured() -> None:
    """Under auto, calls whose DiT steps skip every block (a TeaCache-like cache) measure nothing: the
    calls after them run exactly, and a later call that runs the blocks is measured as usual."""
    p, ref = toy.build(0), toy.build(0)
    skip_all = {i: range(8) for i in range(6)}
    with torchferry.offload(p, device="cpu") as session:
        for _ in range(3):
            assert torch.equal(p("a cat", steps=6, skip=skip_all), ref("a cat", steps=6, skip=skip_all))
        assert not session.report().calibrated
        assert session.report().measured_step_s == {}
        assert torch.equal(p("a cat", steps=6), ref("a cat", steps=6))
        report = session.report()
    assert report.calibrated and report.block_s["transformer"] > 0


def test_two_experts_keep_the_budget_at_every_step_including_the_switch() -> None:
    """On a two-expert toy under a tight budget every step, the one that prefetches the next expert
    included, stays within the budget, and outputs equal the plain run."""
    p, ref = toy.build(0, two_experts=True, hidden=64), toy.build(0, two_experts=True, hidden=64)
    budget = _layerwise_peak(p, components={"dit", "text_encoder"}) + 60_000
    with torchferry.offload(p, device="cpu", device_memory=budget, components={"dit", "text_encoder"}) as s:
        for _ in range(3):
            assert torch.equal(p("a cat", steps=6), ref("a cat", steps=6))
        switch = [
            step for step in s.schedules if step.component == "transformer" and step.next == "transformer_2"
        ]
        report = s.report()
        peaks = dict(s.step_peaks)
    assert switch, "the step before the expert switch ran"
    exit_units = {pl.unit for pl in s.schedules[switch[0]].exit} if switch[0] in s.schedules else set()
    assert not exit_units or any(u.startswith("transformer_2.") for u in exit_units)
    assert peaks and max(peaks.values()) <= budget
    assert set(report.predicted_step_s) == {"transformer", "transformer_2"}
    assert set(report.measured_step_s) <= {"transformer", "transformer_2"}
    assert same_weights(p, ref)


def test_measure_reads_block_compute_and_host_cost_from_a_trace() -> None:
    """`measure` takes each block's forward from the trace and leaves no time unaccounted."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        with session.trace("transformer", skip=1) as tracer:
            p("a cat", steps=3)
        figures = policies.measure(tracer.result, session.plan)
    blocks = {f"transformer.blocks.{i}" for i in range(8)}
    assert set(figures.block_s) == blocks and all(v > 0 for v in figures.block_s.values())
    ops = len(tracer.result.schedule.ops)
    total = (
        sum(figures.block_s.values()) + figures.rest_s + figures.host_op_s * ops + figures.host_block_s * 8
    )
    assert total == pytest.approx(tracer.result.wall_s, rel=1e-6)
    assert figures.policy == "layerwise(depth=1)" and figures.clock == "host clock"


def test_report_of_a_named_policy_says_nothing_was_chosen() -> None:
    """A session whose caller named the policy reports it, with no measurements, and its memory."""
    p = toy.build(0)
    with torchferry.offload(p, strategy="none", device="cpu") as session:
        p("a cat", steps=1)
        report = session.report()
        held, peak, host = session.device_bytes, session.peak_device_bytes, session.host_bytes
    assert isinstance(report, SessionReport)
    assert report.policy == "none()" and not report.calibrated and report.predicted_step_s == {}
    assert (report.device, report.device_bytes, report.peak_device_bytes) == ("cpu", held, peak)
    assert report.host_bytes == report.peak_host_bytes == host > 0
    size = policies.format_bytes
    lines = str(report).splitlines()
    # With no host_memory= the host budget is the machine's, read where it ran (docs/host-memory.md).
    assert lines[2].startswith("  budget   device none (none given); host ")
    assert report.host_budget_source in lines[2]
    lines[2] = "  budget   device none (none given); host (the machine's)"
    assert lines == [
        "torchferry session",
        "  running  none() on cpu",
        "  budget   device none (none given); host (the machine's)",
        f"  device   {size(held, exact=False)} now, {size(peak, exact=False)} at peak",
        f"  host     {size(host, exact=False)} now, {size(host, exact=False)} at peak",
        "  why      none(): named by the caller (strategy='none'); nothing was chosen",
    ]
    with torchferry.offload(p, strategy="none", device="cpu", host_memory="1GiB") as session:
        budgeted = session.report()
    assert budgeted.host_budget == 2**30
    assert str(budgeted).splitlines()[2] == (
        "  budget   device none (none given); host 1.0 GiB (given as host_memory=)"
    )


def test_report_compares_predictions_only_with_steps_they_were_not_fitted_to() -> None:
    """Before any step the report says "not yet measured"; the first traced step (which the model is
    then fitted to) checks nothing; each later check pairs a traced step with what the model
    predicted before it saw that step, and `error` is that pair's, not the fitted one's."""
    p = toy.build(0, hidden=64)
    budget = _layerwise_peak(p, components={"dit"}) + 3 * 60_000
    seen: list[tuple[bool, float, float]] = []
    reports: list[SessionReport] = []
    with torchferry.offload(p, device="cpu", device_memory=budget, components={"dit"}) as session:
        chooser = session._chooser
        assert chooser is not None
        traced = chooser.traced

        def spy(trace: Any) -> bool:
            measured = "transformer" in chooser.state.measured
            seen.append((measured, chooser.predicted("transformer"), trace.wall_s))
            rechosen = traced(trace)
            reports.append(session.report())
            return rechosen

        chooser.traced = spy  # type: ignore[method-assign]
        opened = session.report()
        for _ in range(4):
            p("a cat", steps=4)
        later = session.report()
    assert opened.measured_step_s == {} and opened.checked_step_s == {}
    assert opened.error("transformer") is None and "(not yet measured)" in opened.summary()
    assert len(seen) >= 3 and not seen[0][0] and all(s[0] for s in seen[1:])
    assert reports[0].checked_step_s == {} and reports[0].error("transformer") is None
    for (_, before, wall), report in zip(seen[1:], reports[1:], strict=True):
        assert report.checked_step_s["transformer"] == (before, wall)
    before, measured = later.checked_step_s["transformer"]
    assert later.error("transformer") == pytest.approx(before / measured - 1)
    line = next(x for x in str(later).splitlines() if x.startswith("  transformer "))
    n = later.traced_steps["transformer"]
    fastest = later.measured_step_s["transformer"] * 1e3
    assert f"fastest of {n} traced {fastest:.3f} ms (the model is fitted to it)" in line
    assert f"last check: {before * 1e3:.3f} ms predicted, then measured {measured * 1e3:.3f} ms (" in line
    text = str(later).splitlines()
    size = policies.format_bytes(budget, exact=False)
    assert text[0] == "torchferry session"
    assert text[1].split(None, 1) == ["running", f"auto: {later.policy} on cpu"]
    assert text[2].split(None, 1)[0] == "budget"
    host = policies.format_bytes(later.host_budget or 0, exact=False)
    assert text[2].split(None, 1)[1] == f"device {size} (given); host {host} ({later.host_budget_source})"
    assert [t.split()[0] for t in text[3:6]] == ["device", "host", "h2d"]


def test_the_device_facts_are_read_once_and_auto_measures_nothing_itself(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39 (S7): the runtime's fact reader gives the device's type and name, and for auto the saved
    profile, this machine's name and the host-to-device rate it timed; an auto session starts from
    exactly `policies.auto_setup` of those facts (its chooser times nothing), a named one reads no
    profile (a damaged one does not stop it)."""
    from torchferry.runtime import host_name, save_profile
    from torchferry.runtime.machine import device_facts

    monkeypatch.setenv("TORCHFERRY_PROFILE", str(tmp_path / "profile.json"))
    mine = policies.DeviceProfile(
        name="cpu", h2d_bytes_per_s=1.5e10, flops_per_s=1e11, dtype="float32", source="test", device="cpu",
        host=host_name(),
    )  # fmt: skip
    save_profile(mine)
    cpu = torch.device("cpu")
    assert device_facts(cpu) == policies.DeviceFacts(type="cpu", name="cpu")
    facts = device_facts(cpu, measure=True)
    assert (facts.saved, facts.machine) == (mine, host_name())
    assert facts.h2d_source == "measured: 16.0 MiB host memcpy"
    assert facts.h2d_bytes_per_s is not None and facts.h2d_bytes_per_s > 0
    p = toy.build(0)
    with torchferry.offload(p, device="cpu", device_memory="64MiB") as session:
        chooser = session._chooser
        assert chooser is not None
        assert chooser.setup == policies.auto_setup(session.plan, facts)
        assert chooser.setup.base.block_s == policies.estimate_cost(
            session.plan.topology, device=attrs.evolve(mine, h2d_bytes_per_s=facts.h2d_bytes_per_s),
            forwards_per_step=1,
        ).block_s  # fmt: skip
    (tmp_path / "profile.json").write_text('{"torchferry_profile": 999}')
    with torchferry.offload(p, "layerwise", device="cpu"):
        pass


def test_two_opens_of_one_request_share_one_plan() -> None:
    """Issue 39 item 5: opening and closing one pipeline again with the same request plans one plan
    (one value, one object: the caches keyed by plans keep one copy, not one per open)."""
    p = toy.build(0)
    with torchferry.offload(p, device="cpu", host_memory="1GiB") as first:
        plan = first.plan
    for _ in range(2):
        with torchferry.offload(p, device="cpu", host_memory="1GiB") as again:
            assert again.plan is plan
