"""Which device figures apply and what auto starts from, on facts given, not read: one rule for a
session (`runtime.read_facts`) and for `torchferry plan` (its flags)."""

from __future__ import annotations

import attrs
import pytest
from policy_plans import component, plan, ring_plan, stack

from torchferry import policies

MIB = 1 << 20
GIB = 1 << 30
H100 = "NVIDIA H100 80GB HBM3"

#: A profile `torchferry probe` saved on machine ``here`` of its H200.
SAVED = policies.DeviceProfile(
    name="NVIDIA H200",
    h2d_bytes_per_s=5e10,
    flops_per_s=9e14,
    collective_bytes_per_s=4e11,
    dtype="bfloat16",
    source="test",
    device="cuda",
    host="here",
)


def test_an_h100_with_no_saved_profile_takes_the_h100_class_in_a_session_and_in_plan() -> None:
    """Issue 39 (S6): a session on an H100 (its facts as read, a measured rate among them) and plan for
    one (its facts from --device-name) apply the H100 class, not the default figures."""
    session = policies.DeviceFacts(
        type="cuda", free_bytes=80 * GIB, name=H100, machine="here", h2d_bytes_per_s=4e10, h2d_source="x"
    )
    planned = policies.DeviceFacts(type="cuda", name=H100, machine="here")
    assert policies.device_profile(session) == policies.device_profile(planned)
    assert policies.device_profile(planned) == (policies.DEVICE_CLASSES["h100"], "")
    # A device of no known class, and a GPU not named with nothing saved, take the default figures.
    unknown = policies.DeviceFacts(type="cuda", name="Some Future GPU", machine="here")
    assert policies.device_profile(unknown) == (policies.DEFAULT_DEVICE, "")
    assert policies.device_profile(policies.DeviceFacts(type="cuda")) == (policies.DEFAULT_DEVICE, "")


def test_a_saved_profile_applies_only_to_the_device_it_was_measured_on() -> None:
    """The saved profile's figures apply to a device of its type, its name (a GPU not named takes the
    saved one's) and its machine; else the class of the device's name, saying why the saved one was
    left out."""
    h200 = policies.DeviceFacts(type="cuda", name="NVIDIA H200", machine="here", saved=SAVED)
    assert policies.device_profile(h200) == (SAVED, "")
    assert policies.device_profile(attrs.evolve(h200, name="")) == (SAVED, "")
    a100 = attrs.evolve(h200, name="NVIDIA A100-SXM4-80GB")
    assert policies.device_profile(a100) == (
        policies.DEVICE_CLASSES["a100"],
        "it was measured on NVIDIA H200, and this device is NVIDIA A100-SXM4-80GB",
    )
    elsewhere = attrs.evolve(h200, machine="there")
    assert policies.device_profile(elsewhere) == (
        policies.DEVICE_CLASSES["h200"],
        "it was measured on another machine, here",
    )
    cpu = policies.DeviceFacts(type="cpu", name="cpu", machine="here", saved=SAVED)
    assert policies.device_profile(cpu) == (policies.DEVICE_CLASSES["cpu"], "it holds CUDA figures")
    mine = attrs.evolve(SAVED, name="cpu", device="cpu", h2d_bytes_per_s=1.5e10)
    assert policies.device_profile(attrs.evolve(cpu, saved=mine)) == (mine, "")
    unsaid = attrs.evolve(mine, device="", host="")
    assert policies.device_profile(attrs.evolve(cpu, saved=unsaid)) == (
        policies.DEVICE_CLASSES["cpu"],
        "it does not say which device and machine it was measured on",
    )
    assert policies.device_profile(attrs.evolve(h200, type="cuda", saved=mine))[1] == "it holds CPU figures"


def test_a_saved_profile_of_another_device_still_gives_this_machines_read_rates() -> None:
    """A GPU profile with `probe PATH`'s read rates gives a CPU device those rates (the drive's) over
    the CPU class's other figures; one from another machine gives none."""
    gpu = attrs.evolve(SAVED, read_bytes_per_s=1.5e9, read_direct_bytes_per_s=1.0e9)
    cpu = policies.DeviceFacts(type="cpu", name="cpu", machine="here", saved=gpu)
    got, _ = policies.device_profile(cpu)
    cpu_class = policies.DEVICE_CLASSES["cpu"]
    assert got == attrs.evolve(
        cpu_class,
        read_bytes_per_s=1.5e9,
        read_direct_bytes_per_s=1.0e9,
        source=f"{cpu_class.source}; read rates from the profile of NVIDIA H200 on this machine",
    )
    assert got.file_read_bytes_per_s() == 1.0e9
    assert policies.device_profile(attrs.evolve(cpu, machine="there"))[0] == cpu_class


def test_auto_starts_from_the_device_figures_and_measures_the_streaming_dits() -> None:
    """Issue 39 (S7): auto's setup is the plan and its budget, the rate timed at open (else the
    figures'), the figures' cost model at one forward per step, and the streaming DiTs as the
    components it measures (an encoder that streams too is not one of them)."""
    dit = component("transformer", "dit", 0, [stack("transformer", "blocks", [MIB] * 4)])
    encoder = component("text_encoder", "encoder", 0, [stack("text_encoder", "layers", [MIB] * 3)])
    p = plan([dit, encoder], strategy="layerwise", device_memory_bytes=GIB)
    facts = policies.DeviceFacts(type="cuda", name=H100, h2d_bytes_per_s=3e10, h2d_source="measured")
    setup = policies.auto_setup(p, facts)
    h100 = policies.DEVICE_CLASSES["h100"]
    expected = policies.estimate_cost(
        p.topology, device=attrs.evolve(h100, h2d_bytes_per_s=3e10), forwards_per_step=1
    )
    assert setup == policies.Calibration(
        plan=p, budget=GIB, h2d_bytes_per_s=3e10, base=expected, components=("transformer",)
    )
    untimed = policies.auto_setup(p, attrs.evolve(facts, h2d_bytes_per_s=None))
    assert untimed.h2d_bytes_per_s == h100.h2d_bytes_per_s == 55e9
    # No DiT streams: every streaming component is measured.
    only = plan([encoder], strategy="layerwise", device_memory_bytes=GIB)
    assert policies.auto_setup(only, facts).components == ("text_encoder",)
    with pytest.raises(ValueError, match="auto_setup needs a plan with a device budget"):
        policies.auto_setup(ring_plan(2), facts)


def test_the_open_planner_gives_auto_its_setup_and_a_named_strategy_none() -> None:
    """open_plan decides auto's setup from the device's facts with the budget it settled; a named
    strategy gets none."""
    facts = policies.Facts(device=policies.DeviceFacts(type="cuda", free_bytes=8 * GIB, name=H100))
    opened = policies.open_plan(ring_plan(4, 64 * MIB), facts, auto=True)
    assert opened.setup == policies.auto_setup(opened.plan, facts.device)
    assert opened.setup.budget == opened.plan.config.device_memory_bytes
    assert policies.open_plan(ring_plan(4, 64 * MIB, device_memory_bytes=GIB), facts).setup is None
