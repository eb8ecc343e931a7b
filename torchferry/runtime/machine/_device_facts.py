"""The device's facts, read once at open: what `policies.device_profile` and `policies.open_plan`
decide from (the session reads them here; `torchferry plan` builds the record from its flags)."""

from __future__ import annotations

import functools

import torch

from torchferry import policies
from torchferry.runtime.machine._probe import copy_bytes_per_s, host_name, load_profile

__all__ = ["device_facts"]

#: Bytes of the timed copy that measures the host-to-device bandwidth (CUDA, CPU).
_COPY_BYTES = {"cuda": 64 << 20, "cpu": 16 << 20}


@functools.cache
def _bandwidth(device: str) -> float:
    target = torch.device(device)
    rate = copy_bytes_per_s(target, _COPY_BYTES["cuda" if target.type == "cuda" else "cpu"], 3)
    if target.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def device_facts(device: torch.device, *, measure: bool = False) -> policies.DeviceFacts:
    """What is read of ``device`` at open: its type, its free bytes (CUDA) and its name (``"cpu"``
    off CUDA). With ``measure`` (auto chooses), also this machine's name, the saved profile, and the
    host-to-device rate: the fastest of three timed copies after a warm-up, once per process and
    device (a pinned copy on CUDA, a host memcpy elsewhere)."""
    cuda = device.type == "cuda"
    free = torch.cuda.mem_get_info(device)[0] if cuda else None
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    if not measure:
        return policies.DeviceFacts(type=device.type, free_bytes=free, name=name)
    what = "pinned host-to-device copy" if cuda else "host memcpy"
    size = policies.format_bytes(_COPY_BYTES["cuda" if cuda else "cpu"], exact=False)
    return policies.DeviceFacts(
        type=device.type,
        free_bytes=free,
        name=name,
        machine=host_name(),
        saved=load_profile(),
        h2d_bytes_per_s=_bandwidth(str(device)),
        h2d_source=f"measured: {size} {what}",
    )
