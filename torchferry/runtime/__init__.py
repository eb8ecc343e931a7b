"""The only stateful layer: carries out schedules on real modules with streams and collectives."""

from __future__ import annotations

from torchferry.runtime._device import Ledger, SlotPool
from torchferry.runtime._engine import Engine, Program, execute, listing
from torchferry.runtime._host import Group, HostStore, Unit
from torchferry.runtime._streams import CudaStreams, StreamContext, Transfer, stream_context

__all__ = [
    "CudaStreams",
    "Engine",
    "Group",
    "HostStore",
    "Ledger",
    "Program",
    "SlotPool",
    "StreamContext",
    "Transfer",
    "Unit",
    "execute",
    "listing",
    "stream_context",
]
