"""Devices, streams and collectives: where bytes go and in what order."""

from __future__ import annotations

# The names the rest of the runtime uses: it enters this package only here.
from torchferry.runtime.device._comm import Comm as Comm
from torchferry.runtime.device._devices import resolved as resolved
from torchferry.runtime.device._devices import same_device as same_device
from torchferry.runtime.device._slots import Ledger as Ledger
from torchferry.runtime.device._slots import SlotPool as SlotPool
from torchferry.runtime.device._streams import CpuStreams as CpuStreams
from torchferry.runtime.device._streams import DeviceBuffer as DeviceBuffer
from torchferry.runtime.device._streams import Reading as Reading
from torchferry.runtime.device._streams import StreamContext as StreamContext
from torchferry.runtime.device._streams import Timer as Timer
from torchferry.runtime.device._streams import aligned_empty as aligned_empty
from torchferry.runtime.device._streams import stream_context as stream_context
