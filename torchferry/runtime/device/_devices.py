"""Devices as their tensors report them: the one normal form a session keeps, and the one comparison.

``torch.device("cuda")`` names the current CUDA device, yet every CUDA tensor reports its index
(``cuda:0``), and ``torch.device("meta:0")`` or ``torch.device("cpu:0")`` carry an index their
tensors never report; ``==`` between two such spellings of one device is false. So a session
resolves its device once, when it opens (`resolved`), and every check of where a tensor is goes
through `same_device`, which compares the forms tensors report.
"""

from __future__ import annotations

import torch

__all__ = ["resolved", "same_device"]


def resolved(device: torch.device | str) -> torch.device:
    """``device`` as a tensor made there reports it (``cuda`` -> ``cuda:<current>``, ``meta:0`` -> ``meta``).

    Asks torch itself (an empty tensor allocates nothing); where no such device exists here (CUDA on
    a machine without one) an index-less CUDA device is taken as device 0, as a tensor there would be.
    """
    target = torch.device(device)
    try:
        made: torch.device = torch.empty(0, device=target).device
    except (RuntimeError, AssertionError):
        index: int | None = target.index  # typed ``int`` by torch, ``None`` when not given
        if target.type == "cuda" and index is None:
            return torch.device("cuda", 0)
        return target
    return made


def same_device(have: torch.device, want: torch.device) -> bool:
    """Whether a tensor on ``have`` is on ``want``, however either is spelled (an index-less CUDA
    device is the current one)."""
    if have == want:
        return True
    if have.type != want.type:
        return False
    return resolved(have) == resolved(want)
