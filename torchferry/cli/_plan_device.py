"""The device figures ``torchferry plan`` assumes, by the rule a session's auto starts from.

``--device-class`` names a class and ``--profile FILE`` a profile (used whatever it was measured on);
otherwise the device's facts are built as a session reads them (`device_facts`: a GPU named
``--device-name``, else this machine's) and `policies.device_profile` says which figures apply, the
one rule of a session: with no saved profile, on an H100 both plan for the H100 class.
"""

from __future__ import annotations

import argparse
import os

import attrs

from torchferry import policies
from torchferry._errors import OffloadError
from torchferry.policies import DEVICE_CLASSES, DeviceProfile

__all__ = ["device_facts", "device_figures", "with_reads"]


def device_figures(args: argparse.Namespace) -> DeviceProfile:
    """The figures ``plan`` assumes: the named class, else the profile given, else those a session on
    the device would start from (`policies.device_profile` of `device_facts`)."""
    if args.device_class is not None:
        return DEVICE_CLASSES[args.device_class]
    from torchferry.runtime import load_profile, profile_path

    if args.profile is not None:
        given = load_profile(args.profile)
        assert given is not None
        return given  # named on the command line: used whatever it was measured on
    facts = device_facts(args)
    figures, why = policies.device_profile(facts)
    if not why:
        return figures
    assert facts.saved is not None
    cpu = facts.saved.device == "cpu"
    fix = "pass --profile to plan with them, or --device-class cpu" if cpu else "probe this one"
    note = f"the saved profile {profile_path()}'s device figures were not used: {why}; {fix}"
    return attrs.evolve(figures, source=f"{figures.source}; {note}")


def device_facts(args: argparse.Namespace) -> policies.DeviceFacts:
    """The device ``plan`` plans for, as a session reads its facts: a GPU named ``--device-name``,
    else this machine's GPU, else one not named (a GPU profile saved here names it); this machine's
    name and its saved profile."""
    import torch

    from torchferry.runtime import host_name, load_profile

    name = args.device_name
    if name is None:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return policies.DeviceFacts(type="cuda", name=name, machine=host_name(), saved=load_profile())


def with_reads(args: argparse.Namespace, figures: DeviceProfile) -> tuple[DeviceProfile, str]:
    """The device figures with the drive's read rates, and where those came from (else how to get
    them). The rates are the drive's, not the device's: a saved profile's are kept when its device
    figures are left out (measured on the CPU, or on another GPU) or a device class is named."""
    from torchferry.runtime import host_name, load_profile, profile_path

    if args.host_memory is None or args.read_bandwidth is not None:
        return figures, ""  # no read rate is used, so no profile is opened for one
    where = args.profile if args.profile is not None else str(profile_path())
    what = "the profile" if args.profile is not None else "the saved profile"
    try:
        profile = load_profile(where) if args.profile is not None or os.path.exists(where) else None
    except OffloadError as exc:
        if args.profile is not None:
            raise
        return figures, f"{what} {where} could not be read ({exc}); pass --read-bandwidth"
    elsewhere = profile is not None and args.profile is None and profile.host not in ("", host_name())
    if profile is None or profile.read_bytes_per_s is None or elsewhere:
        held = f"{what} {where} holds no read rate" if profile is not None else f"no profile at {where}"
        if elsewhere:
            assert profile is not None
            held = f"{what} {where} was measured on {profile.host}, another machine with another drive"
        return figures, (
            f"{held}; pass --read-bandwidth, or time the drive with torchferry probe CHECKPOINT"
            + (f" --output {where}" if args.profile is not None else "")
        )
    figures = attrs.evolve(
        figures,
        read_bytes_per_s=profile.read_bytes_per_s,
        read_direct_bytes_per_s=profile.read_direct_bytes_per_s,
    )
    return figures, f"from {what} {where}: {profile.source or profile.name}"
