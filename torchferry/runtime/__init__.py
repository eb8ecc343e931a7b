"""The only stateful layer: carries out schedules on real modules with streams and collectives."""

from __future__ import annotations

# Imports written ``name as name`` are for the layers above, which enter only through this file
# (tests/test_layering.py); they are not public and not in ``__all__``.
from torchferry.runtime._checkpoint import CheckpointReader
from torchferry.runtime._checkpoint import save_safetensors as save_safetensors
from torchferry.runtime._comm import Comm
from torchferry.runtime._device import Ledger, SlotPool
from torchferry.runtime._engine import Engine, execute
from torchferry.runtime._hooks import Driver
from torchferry.runtime._host import Group, HostStore, Prepared, Sharding, Unit
from torchferry.runtime._meta import meta_parameters
from torchferry.runtime._program import Program, listing, schedule_text
from torchferry.runtime._steps import Steps as Steps
from torchferry.runtime._streams import CudaStreams, StreamContext, Transfer, stream_context
from torchferry.runtime._trace import Span, StepTrace, Tracer

__all__ = [
    "CheckpointReader",
    "Comm",
    "CudaStreams",
    "Driver",
    "Engine",
    "Group",
    "HostStore",
    "Ledger",
    "Prepared",
    "Program",
    "Sharding",
    "SlotPool",
    "Span",
    "StepTrace",
    "StreamContext",
    "Tracer",
    "Transfer",
    "Unit",
    "execute",
    "listing",
    "meta_parameters",
    "schedule_text",
    "stream_context",
]
