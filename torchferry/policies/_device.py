"""Which device figures apply, and what auto starts from: pure rules over the device's facts.

A session reads its device's facts once (`runtime.read_facts`: the type, the free bytes, the name,
this machine's name, the saved profile and, for auto, the host-to-device rate it timed);
`torchferry plan` builds the same record from its flags (``--device-name``, else this machine's GPU).
`device_profile` then says which figures apply, for both: a saved profile measured on this very
device, else the class of the device's name, else `DEFAULT_DEVICE`; `auto_setup` turns the figures
into what a session's auto chooses and calibrates from (`Calibration`).
"""

from __future__ import annotations

import attrs

from torchferry.policies._calibrate import Calibration
from torchferry.policies._cost import DEFAULT_DEVICE, DeviceProfile, estimate_cost, match_device_class
from torchferry.policies._layout import layout
from torchferry.topology import Plan

__all__ = ["DeviceFacts", "auto_setup", "device_profile"]


@attrs.frozen(kw_only=True)
class DeviceFacts:
    """What was read of the session's device (or assumed of it by ``torchferry plan``).

    ``type`` is ``cuda``, ``cpu`` or ``mps``; ``free_bytes`` its free bytes at open (``None``: not
    read, as on a CPU); ``name`` its name (``torch.cuda.get_device_name()``, ``"cpu"``; empty: not
    known, as for ``plan`` on a machine without a GPU); ``machine`` this machine's name; ``saved`` the
    profile ``torchferry probe`` saved here (``None``: none, or not read); ``h2d_bytes_per_s`` the
    host-to-device rate timed at open and ``h2d_source`` how (``None``: not timed).
    """

    type: str = "cpu"
    free_bytes: int | None = None
    name: str = ""
    machine: str = ""
    saved: DeviceProfile | None = None
    h2d_bytes_per_s: float | None = None
    h2d_source: str = ""


def _left_out(saved: DeviceProfile, facts: DeviceFacts, name: str) -> str:
    """Why ``saved``'s device figures do not describe the device of ``facts`` (named ``name``)."""
    if not saved.measured:
        return "it does not say which device and machine it was measured on"
    if saved.device != facts.type:
        return f"it holds {saved.device.upper()} figures"
    if saved.name != name:
        return f"it was measured on {saved.name}, and this device is {name}"
    return f"it was measured on another machine, {saved.host}"


def device_profile(facts: DeviceFacts) -> tuple[DeviceProfile, str]:
    """The figures that apply to the device of ``facts``, and why the saved profile's device figures
    were left out (empty: they were used, or there is none).

    The saved profile applies when it was measured on this device: of this type, of this name (a
    device whose name is not known takes the saved profile's) and on this machine. Else the class
    of the device's name (`match_device_class`), else `DEFAULT_DEVICE`; a saved profile of this
    machine still gives its drive's read rates (``torchferry probe PATH``): they are the drive's,
    not the device's.
    """
    saved = facts.saved
    name = facts.name
    if not name and saved is not None and saved.device == facts.type:
        name = saved.name
    if saved is not None and saved.measured_on(facts.type, name, facts.machine):
        return saved, ""
    base = (match_device_class(name) if name else None) or DEFAULT_DEVICE
    if saved is None:
        return base, ""
    if saved.read_bytes_per_s is not None and saved.host == facts.machine:
        base = attrs.evolve(
            base,
            read_bytes_per_s=saved.read_bytes_per_s,
            read_direct_bytes_per_s=saved.read_direct_bytes_per_s,
            source=f"{base.source}; read rates from the profile of {saved.name} on this machine",
        )
    return base, _left_out(saved, facts, name)


def auto_setup(plan: Plan, device: DeviceFacts) -> Calibration:
    """What auto in a session chooses and calibrates from: the plan and its device budget, the
    host-to-device rate (timed at open, else the figures'), the cost model before any step is
    measured (the device's figures, `device_profile`, one forward per step and no known model: a
    session knows its pipeline, not a published model's FLOPs), and the components whose steps are
    measured and predicted: the streaming DiTs, else every streaming component."""
    budget = plan.config.device_memory_bytes
    if budget is None:
        raise ValueError("auto_setup needs a plan with a device budget (open_plan sets one)")
    profile, _ = device_profile(device)
    h2d = device.h2d_bytes_per_s if device.h2d_bytes_per_s is not None else profile.h2d_bytes_per_s
    figures = attrs.evolve(profile, h2d_bytes_per_s=h2d)
    base = estimate_cost(plan.topology, device=figures, forwards_per_step=1)
    streamed = layout(plan).streamed
    streaming = [c for c in plan.components if streamed.get(c.path)]
    dits = [c.path for c in streaming if c.kind == "dit"]
    return Calibration(
        plan=plan,
        budget=budget,
        h2d_bytes_per_s=h2d,
        base=base,
        components=tuple(dits or [c.path for c in streaming]),
    )
